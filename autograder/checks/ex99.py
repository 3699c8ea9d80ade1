"""A small drill exercise for the grading pipeline itself: the adversarial corpus in
tests/test_trusted_grading.py and benchmarks/bench_grading.py grade it, so the
pipeline is tested without the cost of a real exercise. Two tasks:

- task99_1_storage_bytes: `storage_bytes(shape, dtype)`, the bytes of a contiguous tensor;
- task99_2_row_softmax:   `row_softmax(x)`, softmax over the last dimension.
"""

from __future__ import annotations

import torch

from .common import Task, allclose, expect_type, tasks

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64,
          "int8": torch.int8, "float64": torch.float64}


def _bytes_cases(hidden, r):
    if not hidden:
        return [{"shape": [3, 4], "dtype": "float32"}]
    # every dtype size, an empty shape and a scalar, in every run
    return [{"shape": [r.randint(1, 9) for _ in range(r.randint(1, 4))], "dtype": d} for d in DTYPES] + \
           [{"shape": [0, r.randint(1, 5)], "dtype": "float32"}, {"shape": [], "dtype": "int8"}]


def _bytes_run(case, storage_bytes):
    return storage_bytes(list(case["shape"]), case["dtype"])


def _bytes_judge(case, got):
    want = torch.empty(case["shape"], dtype=DTYPES[case["dtype"]]).nbytes
    expect_type("storage_bytes(...)", got, int)
    assert got == want, (f"storage_bytes({case['shape']}, {case['dtype']!r}) returned {got}; a contiguous tensor "
                         f"holds numel x itemsize bytes")


def _softmax_cases(hidden, r):
    if not hidden:
        return [{"seed": 0, "shape": [2, 5], "big": False}]
    return [{"seed": r.randrange(2**31), "shape": [r.randint(1, 4), r.randint(1, 9)], "big": big}
            for big in (False, True)]


def _softmax_input(case):
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["shape"], generator=g)
    return x * 1000 if case["big"] else x     # big logits: exp overflows unless the row max is subtracted


def _softmax_run(case, row_softmax):
    out = row_softmax(_softmax_input(case))
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"row_softmax must return a tensor, got {type(out).__name__}")
    return out.tolist()


def _softmax_judge(case, got):
    want = torch.softmax(_softmax_input(case).double(), dim=-1)
    hint = " (for large logits subtract each row's max before exp)" if case["big"] else ""
    try:
        allclose("row_softmax(x)", got, want, rtol=1e-4, atol=1e-6)
    except AssertionError as e:
        raise AssertionError(f"{e}{hint}") from None


TASKS = tasks(
    Task("task99_1_storage_bytes", ("storage_bytes",), _bytes_cases, _bytes_run, _bytes_judge),
    Task("task99_2_row_softmax", ("row_softmax",), _softmax_cases, _softmax_run, _softmax_judge),
)
