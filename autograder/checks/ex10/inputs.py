"""Exercise 10's inputs, the learner side rebuilt on both sides from a case's plain data: run.py uses them in the
sandbox to call the learner's code, the trusted refs.py and judge.py in the grader for their references. Tasks 10.1
and 10.2 take plain lists (a trace, lifetimes); task 10.3's batch, loss weights and filters come from the case's
seed."""

from __future__ import annotations

import torch


def out_side(case) -> int:
    """The output side of a 3x3 convolution with padding 1 and the case's stride: ceil(side / stride)."""
    return (case["side"] - 1) // case["stride"] + 1


def block_batch(case) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, w): the input batch (B, c_in, side, side), requiring grad, and the loss weights (B, c_out, side', side')
    of the loss sum(block(x) * w)."""
    g = torch.Generator().manual_seed(case["seed"])
    s = out_side(case)
    x = torch.randn(case["batch"], case["c_in"], case["side"], case["side"], generator=g).requires_grad_(True)
    w = torch.randn(case["batch"], case["c_out"], s, s, generator=g)
    return x, w


def conv_filters(case) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise (c_in, 1, 3, 3) and pointwise (c_out, c_in, 1, 1) filters the check gives the block."""
    g = torch.Generator().manual_seed(case["seed"] + 1)
    c_in, c_out = case["c_in"], case["c_out"]
    dw = torch.randn(c_in, 1, 3, 3, generator=g) / 3
    pw = torch.randn(c_out, c_in, 1, 1, generator=g) / c_in ** 0.5
    return dw, pw


def fingerprint(t) -> list[float] | None:
    """[sum, sum of |x|, sum of x * v] in float64 (v a fixed random vector), or None."""
    if t is None:
        return None
    t = t.detach().double().flatten()
    v = torch.randn(t.numel(), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return [float(t.sum()), float(t.abs().sum()), float((t * v).sum())]


def block_desc(case) -> str:
    return (f"c_in={case['c_in']}, c_out={case['c_out']}, stride={case['stride']}, "
            f"a ({case['batch']}, {case['c_in']}, {case['side']}, {case['side']}) batch")
