"""Exercise 06's inputs, the learner side rebuilt on both sides from a case's plain data: none of their own here.
The model, its data, its parameter groups and the forked ranks a case is rebuilt into are memlab.kit.ex06's (Net,
batch, param_groups, rank_fn, run_ranks): run.py uses them in the sandbox, the trusted refs.py and judge.py in the
grader, each importing them from the kit."""
