"""Exercise 99's cases (trusted side): shapes and dtypes for task 99.1, seeded logits for task 99.2."""

from __future__ import annotations

from .inputs import DTYPES


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
