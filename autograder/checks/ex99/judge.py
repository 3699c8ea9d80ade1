"""Exercise 99's judges: exact int bytes, softmax within tolerance with a hint for large logits."""

from __future__ import annotations

from ..common import allclose, expect_type
from .inputs import softmax_input
from .refs import reference_bytes, reference_softmax


def bytes_judge(case, got):
    want = reference_bytes(case)
    expect_type("storage_bytes(...)", got, int)
    assert got == want, (f"storage_bytes({case['shape']}, {case['dtype']!r}) returned {got}; a contiguous tensor "
                         f"holds numel x itemsize bytes")


def softmax_judge(case, got):
    want = reference_softmax(softmax_input(case))
    hint = " (for large logits subtract each row's max before exp)" if case["big"] else ""
    try:
        allclose("row_softmax(x)", got, want, rtol=1e-4, atol=1e-6)
    except AssertionError as e:
        raise AssertionError(f"{e}{hint}") from None
