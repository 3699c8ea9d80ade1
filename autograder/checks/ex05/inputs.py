"""Exercise 05's inputs, the learner side rebuilt on both sides from a case's plain data: run.py uses them in the
sandbox, the trusted judge.py in the grader. The rows of task 5.1 and the q, k, v of tasks 5.2 and 5.3."""

from __future__ import annotations

import math

import torch


# ----------------------------------------------------------------------------- task 5.1: online softmax
def softmax_input(case):
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["rows"], case["n"], generator=g) * case["scale"]
    if case["neg_inf"]:
        mask = torch.rand(case["rows"], case["n"], generator=g) < 0.3
        mask[:, 0] = False                   # every row keeps at least one finite entry
        x = x.masked_fill(mask, float("-inf"))
    if case["rising"]:                       # the row max moves to a later block: the running sum must be rescaled
        x = x + torch.linspace(0, 40, case["n"])
    if case.get("shift"):                    # per-row offsets: far below exp's underflow, far apart from each other
        x = x + torch.tensor(case["shift"], dtype=x.dtype)[:, None]
    for row in case.get("inf_first", []):    # the row's whole first block is masked; a later entry stays finite
        x[row, :case["block"]] = float("-inf")
        if not torch.isfinite(x[row]).any():
            x[row, -1] = 0.0
    return x.to(getattr(torch, case.get("dtype", "float32")))


# ----------------------------------------------------------------------------- task 5.2 and 5.3: attention
def qkv(case, requires_grad=False):
    """q, k, v of shape (*lead, T, d). For causal cases the later keys point along the queries' common
    direction, so masked scores are far larger than visible ones: a mask applied after the tile's max fails."""
    g = torch.Generator().manual_seed(case["seed"])
    lead, tq, tk, d = case["lead"], case["tq"], case["tk"], case["d"]
    q = torch.randn(*lead, tq, d, generator=g)
    k = torch.randn(*lead, tk, d, generator=g)
    v = torch.randn(*lead, tk, d, generator=g)
    if case["causal"] and case.get("steep", True):
        u = torch.randn(d, generator=g)
        u = u / u.norm()
        q = q * 0.3 + 3 * u
        k = k * 0.3 + (3.0 * torch.arange(tk))[:, None] * u * math.sqrt(d)   # score of key j: about 9 j
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]
