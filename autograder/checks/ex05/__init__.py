"""Checks for exercise 05: attention in O(T) memory.

References are naive: `torch.softmax` for the online softmax, and a plain einsum
attention (`naive_attention` in refs.py, the whole T_q x T_k matrix) with autograd for the
tiled forward, its logsumexp and its gradients. What a task must not allocate is
measured in the learner's process by `LargestOutput` (the largest tensor any aten op
produces) and the saved-for-backward tensors by `saved_tensors_hooks`.
Cases: cases.py; what runs in the learner's process: run.py; references: refs.py; judges: judge.py.
"""

from __future__ import annotations

from ..common import Task, tasks
from .cases import LARGE_FLAG_BYTES, LARGE_SCORES, attn_cases, flash_cases, largest_allowed, softmax_cases
from .judge import flash_judge, softmax_judge, tiled_judge
from .run import flash_run, softmax_run, tiled_run

__all__ = ["TASKS", "corroborate"]


TASKS = tasks(
    Task("task5_1_online_softmax", ("online_softmax",), softmax_cases, softmax_run, softmax_judge),
    Task("task5_2_tiled_attention", ("tiled_attention",), attn_cases, tiled_run, tiled_judge),
    Task("task5_3_flash_function", ("FlashAttention",), flash_cases, flash_run, flash_judge),
)



def corroborate(runs) -> list[str]:
    """Task 5.2's large case seen from outside: the learner's process reported no tensor larger than a score
    tile, yet while that case ran (its memory window, sandbox.py) the sandbox's memory rose by half the whole
    (LEAD, T, T) fp32 score matrix or more. Then something held the scores where the tracker could not see them (a
    dispatch mode switched off, work done outside torch): flag it for the instructor. `runs` holds (task id, case,
    value, the case's memory growth in bytes or None) for every case."""
    MiB = 2**20
    for tid, case, value, growth in runs:
        if tid != "task5_2_tiled_attention" or not case.get("watched") or not isinstance(value, dict) \
                or growth is None:
            continue
        largest = value.get("largest")
        if isinstance(largest, int) and largest <= largest_allowed(case, case["tile"]) \
                and growth >= LARGE_FLAG_BYTES:
            return [f"task5_2_tiled_attention: while the large case ran, the sandbox's memory grew by "
                    f"{growth / MiB:.0f} MiB, enough for much of its whole score matrix ({LARGE_SCORES / MiB:.0f} "
                    f"MiB), while your code reported no tensor larger than a score tile"]
    return []
