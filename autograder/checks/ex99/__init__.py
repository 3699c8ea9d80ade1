"""A small drill exercise for the grading pipeline itself: the adversarial corpus in
tests/test_trusted_grading.py and benchmarks/bench_grading.py grade it, so the
pipeline is tested without the cost of a real exercise. Two tasks:

- task99_1_storage_bytes: `storage_bytes(shape, dtype)`, the bytes of a contiguous tensor;
- task99_2_row_softmax:   `row_softmax(x)`, softmax over the last dimension.

Learner side (staged into the sandbox): this file, inputs.py, run.py. Trusted side (only in the grader and the
learner's own kernel): cases.py, refs.py, judge.py, named here by their functions and imported when called.
"""

from __future__ import annotations

from ..common import Task, tasks
from .run import bytes_run, softmax_run

TASKS = tasks(
    Task("task99_1_storage_bytes", ("storage_bytes",), "bytes_cases", bytes_run, "bytes_judge"),
    Task("task99_2_row_softmax", ("row_softmax",), "softmax_cases", softmax_run, "softmax_judge"),
)
