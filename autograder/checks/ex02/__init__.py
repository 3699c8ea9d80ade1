"""Checks for exercise 02, "Checkpointed models" (the contract: autograder/checks/common.py).

What is graded is behaviour, on modules the checks own (inputs.py):
  * `run` (run.py, the learner's process) runs the learner's module on stacks of counting
    blocks or memlab's GPT built from the case's seed, and returns the outputs,
    gradient fingerprints, each block's forward calls (counted inside forward(),
    recomputations included) and the peak activation memory, measured with memlab's
    tracker (memlab.checkpointing.activation_peak, bound before any learner code runs);
  * `judge` (judge.py, the grader) recomputes the plain model's outputs and gradients with
    autograd, and the peak of the scheme built by PyTorch's activation-checkpointing pass (refs.py), and
    compares; the planner's plan is judged under the notebook's cost model against
    brute force over every plan, or an exhaustive state search for the 40-layer chain;
  * `corroborate` (judge.py) sets each measured task's watched hidden case, large enough to be seen
    from outside, beside the memory window the sandbox saw it take, and flags a window far above
    the peak the tracker reported (activations the tracker did not see).

Learner side (staged into the sandbox): this file, inputs.py, run.py. Trusted side (only in the grader and the
learner's own kernel): cases.py, refs.py, judge.py, named here by their functions and imported when called.
"""

from __future__ import annotations

from ..common import Task, tasks
from .run import _every_k_run, _gpt_run, _plan_run, _sqrt_run

TASKS = tasks(
    Task("task2_1_checkpoint_every_k", ("CheckpointEveryK",), "_every_k_cases", _every_k_run, "_every_k_judge"),
    Task("task2_2_sqrt_segments", ("sqrt_segments", "SqrtCheckpointed"), "_sqrt_cases", _sqrt_run, "_sqrt_judge"),
    Task("task2_3_plan_checkpoints", ("plan_checkpoints",), "_plan_cases", _plan_run, "_plan_judge"),
    Task("task2_4_checkpointed_gpt", ("CheckpointedGPT",), "_gpt_cases", _gpt_run, "_gpt_judge"),
)
