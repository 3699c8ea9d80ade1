"""Exercise 00's references: the closed forms of task 0.1, the peak that applies in task 0.2, and
memlab's tracker on task 0.4's op sequences."""

from __future__ import annotations

import torch

import memlab

from .cases import ITEMSIZE, _describe, _numel
from .inputs import _storage_fn, _storage_inputs


def _cost(op: str, shapes: list[list[int]], dtype: str) -> tuple[int, int]:
    """The reference: the closed forms of the task text."""
    size = ITEMSIZE[dtype]
    if op == "matmul":
        a, b = shapes
        m, k, n = a[-2], a[-1], b[-1]
        lead = list(torch.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2])))
        out = lead + [m, n]
        return 2 * _numel(lead) * m * n * k, (_numel(a) + _numel(b) + _numel(out)) * size
    if op in ("add", "mul"):
        out = list(torch.broadcast_shapes(*[tuple(s) for s in shapes]))
        return _numel(out), (sum(_numel(s) for s in shapes) + _numel(out)) * size
    (x,) = shapes
    if op == "relu":
        return _numel(x), 2 * _numel(x) * size
    if op == "softmax":
        return 5 * _numel(x), 2 * _numel(x) * size
    if op == "layer_norm":
        return 7 * _numel(x), (2 * _numel(x) + 2 * x[-1]) * size
    raise ValueError(op)


def _peak(gpu: dict, op: str, dtype: str) -> float:
    if op == "matmul" and dtype in gpu["tensor_flops"]:
        return gpu["tensor_flops"][dtype]
    return gpu["vector_flops"]


def _new_storage_reference(case) -> int:
    """memlab's tracker on the same fn: bytes of the storages created inside that are still alive when fn
    has returned (the result holds them), cross-checked by comparing the result's storages with the inputs'."""
    xs = _storage_inputs(case)
    with memlab.MemoryTracker() as tracker:
        out = _storage_fn(case)(*xs)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    owned = {x.untyped_storage().data_ptr() for x in xs}
    new = {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes() for o in outs}
    counted = sum(v for k, v in new.items() if k not in owned)
    if counted != tracker.current:
        raise RuntimeError(f"grader self-check failed for {_describe(case)}: tracker {tracker.current}, "
                           f"storages {counted}")
    return tracker.current
