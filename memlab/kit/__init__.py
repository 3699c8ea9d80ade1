"""What the graded exercises' notebooks call beside the technique modules: the data, models and drivers an
exercise hands to the learner (one module per exercise that needs one, `memlab.kit.exNN`). Nothing here
grades: cases, references and judges live only in autograder/checks/."""
