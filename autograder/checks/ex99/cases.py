"""Exercise 99's cases: shapes and dtypes for task 99.1, seeded logits for task 99.2 (rebuilt on both sides)."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64,
          "int8": torch.int8, "float64": torch.float64}


def bytes_cases(hidden, r):
    if not hidden:
        return [{"shape": [3, 4], "dtype": "float32"}]
    # every dtype size, an empty shape and a scalar, in every run
    return [{"shape": [r.randint(1, 9) for _ in range(r.randint(1, 4))], "dtype": d} for d in DTYPES] + \
           [{"shape": [0, r.randint(1, 5)], "dtype": "float32"}, {"shape": [], "dtype": "int8"}]


def softmax_cases(hidden, r):
    if not hidden:
        return [{"seed": 0, "shape": [2, 5], "big": False}]
    return [{"seed": r.randrange(2**31), "shape": [r.randint(1, 4), r.randint(1, 9)], "big": big}
            for big in (False, True)]


def softmax_input(case):
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["shape"], generator=g)
    return x * 1000 if case["big"] else x     # big logits: exp overflows unless the row max is subtracted
