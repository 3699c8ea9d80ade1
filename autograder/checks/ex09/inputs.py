"""Exercise 09's inputs, the learner side rebuilt on both sides from a case's plain data: none of their own here.
The layer weights, the MLP's shards and data and the forked ranks a case is rebuilt into are memlab.kit.ex09's
(linear_weights, linear_input, mlp_weights, mlp_data, run_ranks): run.py uses them in the sandbox, the trusted
refs.py and judge.py in the grader, each importing them from the kit."""
