"""Exercise 08's inputs, the learner side rebuilt on both sides: run.py uses them in the sandbox, the trusted
judge.py in the grader. How many steps train_step runs on a tiny twin, and what a gradient is reduced to (the
twins themselves, their batches and the problems are memlab.kit.ex08's)."""

from __future__ import annotations

import math

import torch

TINY_STEPS = 3             # three steps: the optimizer's state is in play


# ----------------------------------------------------------------------------- what a gradient is reduced to
def project(tensors, seed: int, k: int = 32) -> list[float]:
    """k projections of the concatenation of `tensors` on fixed random directions (float64)."""
    out = torch.zeros(k, dtype=torch.float64)
    for i, t in enumerate(tensors):
        gen = torch.Generator().manual_seed(seed * 7919 + i)
        out += torch.randn(k, t.numel(), generator=gen, dtype=torch.float64) @ t.detach().double().flatten()
    return out.tolist()


def norm(tensors) -> float:
    return math.sqrt(sum(t.double().pow(2).sum().item() for t in tensors))
