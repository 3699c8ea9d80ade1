"""Checks for exercise 04, "The OOM clinic" (the contract: checks/common.py).

A fixed clinic script (tasks 4.1-4.4) is graded on both halves, as two kinds of case:
1. "full": `run` runs it at full size on the named virtual GPU inside the learner's process, with the
   recorder (bound at import, before learner code) counting sequences, optimizer steps and peaks;
   `judge` decides whether it fits in steady state (from the second step on AdamW's state is alive
   during forward and backward too) with `HEADROOM` to spare, on the capacity memlab's preset has at
   judge time, and does the original's work;
2. "tiny": `run` runs it on a tiny instance with fresh random data and returns the initial weights, the
   gradients handed to the optimizer (projected on fixed random directions), the hyperparameters and the
   updated weights (or the losses); `judge` runs the original script (the patient, memlab/clinic.py) on the
   same data and compares.

Tasks 4.5 and 4.6, the two instruments:
- task4_5_find_max_batch_size: `run` hands the learner's search a step on a virtual GPU and counts its
  probes; `judge` finds the answer without a binary search: a brute-force scan of the step's exact
  byte formula (a fixed buffer plus a per-sample buffer, each rounded up to 512 bytes as the virtual GPU
  rounds), or, for a real training step, the peaks at batch 16 and 32 extrapolated and then walked to the
  boundary, and confirms the boundary with the virtual GPU itself. GPU capacities are read from memlab's
  presets at judge time.
- task4_6_leak_detector: `run` builds a step that leaks in a known way (or not) and calls the learner's
  detector; `judge` rebuilds the same step and measures it with memlab.MemoryTracker.

Cases and the headroom (`HEADROOM`): cases.py; each script's spec (`CASES`) and the inputs both sides rebuild
from a case: inputs.py; what runs in the learner's process: run.py; references: refs.py; judges: judge.py.

Learner side (staged into the sandbox): this file, inputs.py, run.py. Trusted side (only in the grader and the
learner's own kernel): cases.py, refs.py, judge.py, named here by their functions and imported when called.
"""

from __future__ import annotations

from ..common import Task, tasks
from .inputs import CASES
from .run import leak_run, max_batch_run, script_run

__all__ = ["TASKS"]


def _script_task(gid, task):
    # cases.py and judge.py hold each script task's generator and judge by name: task4_1_cases, task4_1_judge ...
    return Task(gid, (CASES[task].fixed_name,), f"{task}_cases", script_run(task), f"{task}_judge")


TASKS = tasks(
    _script_task("task4_1_big_batch", "task4_1"),
    _script_task("task4_2_eval_no_grad", "task4_2"),
    _script_task("task4_3_accumulated_loss", "task4_3"),
    _script_task("task4_4_optimizer_step", "task4_4"),
    Task("task4_5_find_max_batch_size", ("find_max_batch_size",), "max_batch_cases", max_batch_run,
         "max_batch_judge"),
    Task("task4_6_leak_detector", ("detect_leak",), "leak_cases", leak_run, "leak_judge"),
)
