"""Checks for exercise 05: attention in O(T) memory.

References are naive: `torch.softmax` for the online softmax, and a plain einsum
attention (`naive_attention` in refs.py, the whole T_q x T_k matrix) with autograd for the
tiled forward, its logsumexp and its gradients. What a task must not allocate is
measured in the learner's process by `LargestOutput` (the largest tensor any aten op
produces) and the saved-for-backward tensors by `saved_tensors_hooks`.
Cases: cases.py; the inputs both sides rebuild from a case: inputs.py; what runs in the learner's process:
run.py; references: refs.py; judges and `corroborate` (task 5.2's large case against the sandbox's memory):
judge.py.

Learner side (staged into the sandbox): this file, inputs.py, run.py. Trusted side (only in the grader and the
learner's own kernel): cases.py, refs.py, judge.py, named here by their functions and imported when called.
"""

from __future__ import annotations

from ..common import Task, tasks
from .run import flash_run, softmax_run, tiled_run

__all__ = ["TASKS"]


TASKS = tasks(
    Task("task5_1_online_softmax", ("online_softmax",), "softmax_cases", softmax_run, "softmax_judge"),
    Task("task5_2_tiled_attention", ("tiled_attention",), "attn_cases", tiled_run, "tiled_judge"),
    Task("task5_3_flash_function", ("FlashAttention",), "flash_cases", flash_run, "flash_judge"),
)
