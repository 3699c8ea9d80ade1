"""Exercise 05's cases (plain data) and the inputs both sides rebuild from them.

- task5_1: rows whose max moves to a later block (the running sum must be rescaled), -inf entries, large
  scales, a last partial block, one block exactly, a block longer than the row.
- task5_2 and 5.3: lengths that are not a multiple of the tile, causal and not, T_q != T_k, several leading
  shapes; for 5.2 causal inputs whose masked scores dwarf the visible ones; for 5.3 plain random inputs and
  the peak of forward + backward at T and 2T.
"""

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
    return x


def softmax_cases(hidden, r):
    if not hidden:
        return [{"seed": 0, "rows": 3, "n": 10, "block": 4, "scale": 1.0, "neg_inf": False, "rising": True}]
    cases = []
    for neg_inf, rising, scale in ((False, True, 1.0), (True, False, 1.0), (True, True, 30.0), (False, False, 200.0)):
        block = r.choice([3, 5, 7, 16])
        n = block * r.randint(2, 5) + r.randint(1, block - 1)          # a last, partial block
        cases.append({"seed": r.randrange(2**31), "rows": r.randint(1, 5), "n": n, "block": block, "scale": scale,
                      "neg_inf": neg_inf, "rising": rising})
    cases.append({"seed": r.randrange(2**31), "rows": 2, "n": 8, "block": 8, "scale": 1.0, "neg_inf": False,
                  "rising": False})                                  # one block exactly
    cases.append({"seed": r.randrange(2**31), "rows": 2, "n": 5, "block": 16, "scale": 1.0, "neg_inf": True,
                  "rising": True})                                   # block longer than the row
    return cases


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


def _attn_case(r, causal, tq=None, tk=None, tile=16, lead=None):
    tq = tq or r.randint(3, 6) * tile + r.randint(1, tile - 1)        # not a multiple of the tile
    tk = tq if causal else (tk or r.randint(3, 6) * tile + r.randint(1, tile - 1))
    return {"seed": r.randrange(2**31), "lead": lead if lead is not None else r.choice([[], [2], [2, 3]]),
            "tq": tq, "tk": tk, "d": r.choice([4, 8]), "tile": tile, "causal": causal}


def attn_cases(hidden, r):
    if not hidden:
        return [{"seed": 1, "lead": [2], "tq": 40, "tk": 40, "d": 8, "tile": 16, "causal": False},
                {"seed": 2, "lead": [2], "tq": 40, "tk": 40, "d": 8, "tile": 16, "causal": True}]
    return [_attn_case(r, False), _attn_case(r, True), _attn_case(r, False, lead=[2, 2]),
            _attn_case(r, True, lead=[]), _attn_case(r, False, tq=r.randint(70, 90), tk=r.randint(20, 30))]


def flash_cases(hidden, r):
    # plain random inputs: gradients through the steep causal inputs of task 5.2 are ill-conditioned in fp32
    if not hidden:
        return [{"seed": 3, "lead": [2], "tq": 40, "tk": 40, "d": 8, "tile": 16, "causal": True, "steep": False}]
    cases = [_attn_case(r, False), _attn_case(r, True), _attn_case(r, False, tq=r.randint(70, 90),
                                                                     tk=r.randint(20, 30), lead=[2])]
    # the peak of forward + backward, measured at T and 2T: linear in T, not quadratic
    growth = {"seed": r.randrange(2**31), "lead": [2], "tq": 128, "tk": 128, "d": 8, "tile": 16,
              "causal": False, "growth": True}
    return [dict(c, steep=False) for c in cases + [growth]]

