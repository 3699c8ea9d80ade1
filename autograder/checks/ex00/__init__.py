"""Checks for exercise 00: read the roofline.

References, all computed by the grader (refs.py, judged in judge.py):
- task 0.1: the closed forms of the task text, written plainly (`refs._cost`);
- task 0.2: min(peak, intensity x bandwidth) with the peak picked from the data-sheet dict the case passes:
  the three of memlab.kit.ex00.GPUS (the table the notebook shows) and, hidden, a made-up GPU whose fp16 and
  bf16 peaks differ (`cases._made_up_gpu`);
- task 0.3: what the learner's own timer reads say (the grader records every `time.perf_counter()` read,
  every copy, whether its destination shares its source's storage (a copy that moves nothing), and, on CUDA,
  every `torch.cuda.synchronize()` during the call), and a copy bandwidth the
  grader measures itself right before and right after the call (`run._reference_bandwidth`);
- task 0.4: memlab's `MemoryTracker` run by the judge on the same op sequence, cross-checked by
  counting the result's storages.
The guard lives in run.py. Off limits during the learner's calls: anything in memlab/hardware/hierarchy.py
(detected), and `memlab.MemoryTracker` in task 0.4 (it raises).

Learner side (staged into the sandbox): this file, inputs.py, run.py. Trusted side (only in the grader and the
learner's own kernel): cases.py, refs.py, judge.py, named here by their functions and imported when called.
"""

from __future__ import annotations

from ..common import Task, tasks
from .run import _bw_run, _cost_run, _roof_run, _storage_run

TASKS = tasks(
    Task("task0_1_op_cost", ("op_cost",), "_cost_cases", _cost_run, "_cost_judge"),
    Task("task0_2_roofline", ("roofline",), "_roof_cases", _roof_run, "_roof_judge"),
    Task("task0_3_copy_bandwidth", ("copy_bandwidth",), "_bw_cases", _bw_run, "_bw_judge"),
    Task("task0_4_new_storage_bytes", ("new_storage_bytes",), "_storage_cases", _storage_run, "_storage_judge"),
)
