"""Helpers shared by the exercise checks: fresh randomness per run, a guard
that keeps memlab's own tracker out of tasks that ask you to build one, and
comparisons whose failure messages say what was expected."""

from __future__ import annotations

import contextlib
import os
import random

import torch

import memlab


def rng(hidden: bool, fixed_seed: int = 0) -> random.Random:
    """Visible checks use a fixed seed (reproducible feedback); hidden checks
    draw a fresh seed every run, so numbers copied from one run do not pass."""
    return random.Random(int.from_bytes(os.urandom(8), "little") if hidden else fixed_seed)


def torch_seed(r: random.Random) -> int:
    seed = r.randrange(2**31)
    torch.manual_seed(seed)
    return seed


@contextlib.contextmanager
def forbid_memlab_tracker(task: str):
    """Inside this block, entering memlab.MemoryTracker raises: the task asks
    you to build the measurement yourself."""
    original = memlab.MemoryTracker.__enter__

    def refuse(self):
        raise AssertionError(f"{task} asks you to measure with your own code: memlab.MemoryTracker is not "
                             f"allowed inside it (use the LiveBytes mode you wrote in task1_1).")

    memlab.MemoryTracker.__enter__ = refuse
    try:
        yield
    finally:
        memlab.MemoryTracker.__enter__ = original


def expect_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AssertionError(f"{name} must be a Python int (a byte count), got {type(value).__name__}: {value!r}. "
                             f"Hint: tensor.nbytes and storage.nbytes() are ints; .item() turns a tensor into one.")
    return value


def close(got: int, want: int, rel: float) -> bool:
    return abs(got - want) <= rel * max(abs(want), 1)


def mb(n: float) -> str:
    return memlab.format_bytes(n)
