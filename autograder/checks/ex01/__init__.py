"""Checks for exercise 01, "Build a memory profiler" (the contract: autograder/checks/common.py).

Each task's `run` (run.py) builds its inputs from the case's seed and sizes, calls the
learner's code in the learner's process (memlab.MemoryTracker is not the learner's work:
task 1.1 refuses it, a subclass of it and any call into memlab/core/track.py while the
learner's mode runs; inside tasks 1.2-1.4 it is switched off and the same calls are
refused) and returns what it saw as plain data; `judge` (judge.py) computes the
reference in the grader (refs.py): byte bookkeeping for 1.1, memlab's tracker on a twin
model for 1.2 and 1.4, the per-op saving rules for 1.3, and memlab's tracker on a
real training step for 1.5.

Learner side (staged into the sandbox): this file, inputs.py, run.py. Trusted side (only in the grader and the
learner's own kernel): cases.py, refs.py, judge.py, named here by their functions and imported when called.
"""

from __future__ import annotations

from ..common import Task, tasks
from .run import _breakdown_run, _estimate_run, _live_run, _phase_run, _saved_run

TASKS = tasks(
    Task("task1_1_live_bytes", ("LiveBytes",), "_live_cases", _live_run, "_live_judge"),
    Task("task1_2_profile_phases", ("profile_phases",), "_phase_cases", _phase_run, "_phase_judge"),
    Task("task1_3_saved_per_layer", ("saved_bytes_per_layer",), "_saved_cases", _saved_run, "_saved_judge"),
    Task("task1_4_category_breakdown", ("category_breakdown",), "_breakdown_cases", _breakdown_run, "_breakdown_judge"),
    Task("task1_5_estimate_peak", ("estimate_peak_bytes",), "_estimate_cases", _estimate_run, "_estimate_judge"),
)
