"""Exercise 07's inputs, the learner side rebuilt on both sides from a case's plain data: run.py uses them in the
sandbox, the trusted refs.py and judge.py in the grader. Seeded tensors to quantize (task 7.1), absmax values
(7.2), a pretrained Linear with its adapters, input and upstream gradient (7.3)."""

from __future__ import annotations

import math

import torch

NF4_BLOCK, DQ_BLOCK = 64, 256


# ----------------------------------------------------------------------------- inputs rebuilt from a case
def nf4_input(case):
    """The tensor to quantize. kinds: normal; ties (entries exactly on the float32 midpoints between NF4
    levels, every block's absmax a power of two so x / absmax is exact); zeros (block 1 all zeros);
    scales (every block a different magnitude)."""
    g = torch.Generator().manual_seed(case["seed"])
    shape, bs = case["shape"], case["blocksize"]
    n = math.prod(shape)
    if case["kind"] == "ties":
        import bitsandbytes.functional as bf
        code = bf.get_4bit_type("nf4", device="cpu").float()
        mids = (code[:-1] + code[1:]) / 2                              # float32, as bitsandbytes computes them
        x = mids[torch.randint(0, 15, (n,), generator=g)]
        x[::bs] = torch.where(torch.rand(x[::bs].shape, generator=g) < 0.5, -1.0, 1.0)   # absmax 1 in every block
        x = x * 2.0 ** torch.randint(-3, 4, ((n + bs - 1) // bs,), generator=g).repeat_interleave(bs)[:n].float()
    else:
        x = torch.randn(n, generator=g)
        if case["kind"] == "zeros":
            x[bs:2 * bs] = 0.0
        if case["kind"] == "scales":
            x = x * torch.exp(3 * torch.randn((n + bs - 1) // bs, generator=g)).repeat_interleave(bs)[:n]
    x = x.reshape(shape)
    return x.to(torch.bfloat16) if case["dtype"] == "bfloat16" else x


def absmax_input(case):
    """The absmax values to double-quantize. skew "right": absmax of N(0,1) blocks (a long upper tail: max(y)
    and max|y| of the centred values agree); "left": the same mirrored, with every block of DQ_BLOCK holding
    one value at the low extreme (max|y| comes from the negative side in every block); "symmetric": a
    symmetric spread around a positive centre."""
    g = torch.Generator().manual_seed(case["seed"])
    a = torch.randn(case["blocks"], NF4_BLOCK, generator=g).abs().amax(dim=1)          # absmax of N(0,1) blocks
    if case["spread"]:
        a = a * torch.exp(torch.randn(case["blocks"], generator=g))
    skew = case.get("skew", "right")
    if skew == "left":
        a = a.max() + a.min() - a                                   # mirrored: the long tail points down
        low = a.min() * 0.5                                         # one value far below the rest per block
        a[::DQ_BLOCK] = low
        a[-1] = low                                                 # and in the last (maybe partial) block
    elif skew == "symmetric":
        a = 3.0 + torch.rand(case["blocks"], generator=g) * 2 - 1   # uniform on [2, 4]
    return a.float()


def lora_tensors(case):
    g = torch.Generator().manual_seed(case["seed"] + 7)
    A = torch.randn(case["r"], case["d_in"], generator=g) * 0.3
    B = torch.randn(case["d_out"], case["r"], generator=g) * 0.3
    x = torch.randn(*case["lead"], case["d_in"], generator=g)
    gout = torch.randn(*case["lead"], case["d_out"], generator=g)
    return A, B, x, gout


def base_linear(case):
    """The pretrained Linear, its weights drawn from the case's seed (no global RNG)."""
    lin = torch.nn.Linear(case["d_in"], case["d_out"], bias=case["bias"])
    g = torch.Generator().manual_seed(case["seed"])
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / math.sqrt(case["d_in"]))
        if lin.bias is not None:
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) * 0.1)
    return lin
