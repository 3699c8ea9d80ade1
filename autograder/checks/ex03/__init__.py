"""Checks for exercise 03, "A loss scaler and an AMP step" (the contract: checks/common.py).

- task3_1_loss_scaler: `run` drives the learner's DynamicLossScaler through a seeded fp16-autocast
  training run (inf/NaN injected into chosen gradients, explicit unscale_ at chosen steps) and returns
  per step the scale used, whether optimizer.step() ran, the scale after update() and a summary of the
  gradients; `judge` drives `torch.amp.GradScaler("cpu")` through the same plan and compares.
- task3_2_amp_step: `run` calls the learner's amp_step for a few steps, then once more with the model and the
  micro-batches reporting a CUDA device (their arithmetic on the CPU, torch.autocast behaving as on CUDA: a step
  that names "cpu" runs in fp32 there); `judge` runs its own loop (autograd.grad per micro-batch, accumulated by
  hand, an explicit clipping formula) with a real GradScaler and compares losses, scales and the parameter
  updates, and the dtype the forward ran in on both devices; `corroborate` sets the watched case's memory window
  beside the peak the tracker measured.
- task3_3_dtype_report: `judge` measures the same step with memlab.MemoryTracker, noting the dtype
  of each storage when an op creates it (refs.py), and compares with the learner's report.
Plans and cases: cases.py; the inputs both sides rebuild from a case: inputs.py; what runs in the learner's
process: run.py; references: refs.py; judges: judge.py.

Learner side (staged into the sandbox): this file, inputs.py, run.py. Trusted side (only in the grader and the
learner's own kernel): cases.py, refs.py, judge.py, named here by their functions and imported when called.
"""

from __future__ import annotations

from ..common import Task, tasks
from .run import amp_run, report_run, scaler_run

__all__ = ["TASKS"]


TASKS = tasks(
    Task("task3_1_loss_scaler", ("DynamicLossScaler",), "scaler_cases", scaler_run, "scaler_judge"),
    Task("task3_2_amp_step", ("amp_step",), "amp_cases", amp_run, "amp_judge"),
    Task("task3_3_dtype_report", ("dtype_report",), "report_cases", report_run, "report_judge"),
)
