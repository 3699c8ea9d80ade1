"""Checks for exercise 00: read the roofline.

References, all computed here by the grader:
- task 0.1: the closed forms of the task text, written plainly (`_cost`);
- task 0.2: min(peak, intensity x bandwidth) with the peak picked from the data-sheet dicts below;
- task 0.3: what the learner's own timer reads say (the grader records every `time.perf_counter()` read,
  every copy and, on CUDA, every `torch.cuda.synchronize()` during the call), and a copy bandwidth the
  grader measures itself right before and right after the call (`_reference_bandwidth`);
- task 0.4: memlab's `MemoryTracker` run by the judge on the same op sequence, cross-checked by
  counting the result's storages.
Tasks 0.3 and 0.4, and the guard, live in ex00_memory.py. Off limits during the learner's calls: anything in
memlab/hardware/hierarchy.py (detected), and `memlab.MemoryTracker` in task 0.4 (it raises).
"""

from __future__ import annotations

import copy
import math

import torch

from .common import Task, expect_int, expect_type, tasks
from .ex00_memory import (HIERARCHY, _bw_cases, _bw_judge, _bw_run, _chain, _new_storage_reference,  # noqa: F401
                          _number, _off_limits, _scase, _storage_cases, _storage_judge, _storage_run)


# ----------------------------------------------------------------------------- GPU data-sheet figures
# Dense (no sparsity) peaks in FLOP/s and memory bandwidth in bytes/s. "tensor_flops" holds the tensor-core
# peaks by dtype name; "vector_flops" is the FP32 peak without tensor cores. TF32 is left out on purpose:
# PyTorch keeps TF32 off for float32 matmuls by default (torch.backends.cuda.matmul.allow_tf32 = False).
GPUS = {
    "T4": {"name": "NVIDIA T4", "bandwidth": 320e9, "vector_flops": 8.1e12,
           "tensor_flops": {"float16": 65e12},         # Turing: FP16 tensor cores, no BF16
           "source": "NVIDIA T4 Tensor Core GPU data sheet: 320 GB/s GDDR6, FP32 8.1 TFLOPS, "
                     "mixed precision (FP16/FP32) 65 TFLOPS"},
    "A100": {"name": "NVIDIA A100 SXM4 80GB", "bandwidth": 2039e9, "vector_flops": 19.5e12,
             "tensor_flops": {"float16": 312e12, "bfloat16": 312e12},
             "source": "NVIDIA A100 Tensor Core GPU data sheet: 2,039 GB/s HBM2e, FP32 19.5 TFLOPS, "
                       "BF16/FP16 Tensor Core 312 TFLOPS (624 with sparsity)"},
    "H100": {"name": "NVIDIA H100 SXM5 80GB", "bandwidth": 3.35e12, "vector_flops": 67e12,
             "tensor_flops": {"float16": 989.5e12, "bfloat16": 989.5e12, "float8_e4m3fn": 1979e12},
             "source": "NVIDIA H100 Tensor Core GPU data sheet: 3.35 TB/s HBM3, FP32 67 TFLOPS, "
                       "BF16/FP16 Tensor Core 1,979 and FP8 3,958 TFLOPS with sparsity (half of that dense)"},
}

DTYPES = ("float32", "float16", "bfloat16", "float64", "float8_e4m3fn")
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "int8": 1}


# ----------------------------------------------------------------------------- task 0.1: FLOPs and bytes
def _numel(shape) -> int:
    return math.prod(shape)


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


def _cost_cases(hidden, r):
    if not hidden:
        return [{"op": "matmul", "shapes": [[8, 128, 64], [64, 96]], "dtype": "bfloat16"},
                {"op": "matmul", "shapes": [[2, 3, 5, 7], [2, 3, 7, 11]], "dtype": "float32"},
                {"op": "add", "shapes": [[4, 10, 6], [6]], "dtype": "float16"},
                {"op": "relu", "shapes": [[3, 5]], "dtype": "float32"},
                {"op": "softmax", "shapes": [[2, 4, 9, 9]], "dtype": "float32"},
                {"op": "layer_norm", "shapes": [[4, 10, 48]], "dtype": "bfloat16"}]

    def d():
        return r.randint(3, 97) | 1                              # odd: never a power of two past 1

    def dt():
        return r.choice(DTYPES)

    b, h, t, c = d(), d(), d(), d()
    m, k, n = d(), d(), d()
    return [
        {"op": "matmul", "shapes": [[b, t, k], [k, n]], "dtype": dt()},                  # weights: 2-D b
        {"op": "matmul", "shapes": [[b, h, m, k], [b, h, k, n]], "dtype": dt()},         # batched heads
        {"op": "matmul", "shapes": [[b, 1, m, k], [h, k, n]], "dtype": dt()},            # broadcast leading dims
        {"op": "matmul", "shapes": [[m, k], [k, n]], "dtype": dt()},                     # plain 2-D
        {"op": "add", "shapes": [[b, t, c], [b, t, c]], "dtype": dt()},
        {"op": "add", "shapes": [[b, t, c], [c]], "dtype": dt()},                        # bias broadcast
        {"op": "mul", "shapes": [[b, 1, c], [b, t, 1]], "dtype": dt()},                  # both broadcast
        {"op": "relu", "shapes": [[b, t, c]], "dtype": dt()},
        {"op": "softmax", "shapes": [[b, h, t, t]], "dtype": dt()},
        {"op": "layer_norm", "shapes": [[b, t, c]], "dtype": dt()},
        {"op": "layer_norm", "shapes": [[t, c]], "dtype": dt()},
    ]


def _cost_run(case, op_cost):
    with _off_limits("task0_1_op_cost"):
        res = op_cost(case["op"], [tuple(s) for s in case["shapes"]], getattr(torch, case["dtype"]))
    if not isinstance(res, (tuple, list)) or len(res) != 2:
        raise TypeError(f"op_cost must return a tuple (flops, nbytes), got {type(res).__name__}: {str(res)[:80]}")
    return [_number("flops", res[0]), _number("nbytes", res[1])]


def _cost_judge(case, got):
    expect_type("result", got, list)
    flops, nbytes = got
    op, shapes, dtype = case["op"], case["shapes"], case["dtype"]
    want_f, want_b = _cost(op, shapes, dtype)
    what = f"op_cost({op!r}, {[tuple(s) for s in shapes]}, torch.{dtype})"
    expect_int(f"{what} flops", flops)
    expect_int(f"{what} nbytes", nbytes)
    if flops != want_f:
        hint = {"matmul": " A matmul does M*N*K multiply-adds, 2 FLOPs each, for every entry of the broadcast "
                          "leading dims.",
                "softmax": " The convention is 5 FLOPs per element (max, subtract, exp, sum, divide).",
                "layer_norm": " The convention is 7 FLOPs per element of x."}.get(op, " One FLOP per output element.")
        if op == "matmul" and flops * 2 == want_f:
            hint = " Yours is exactly half: each multiply-add is 2 FLOPs."
        raise AssertionError(f"{what}: flops {flops}, expected {want_f}.{hint}")
    if nbytes != want_b:
        size = ITEMSIZE[dtype]
        hint = (f" Count every input read once (its own numel, before broadcasting) plus the output written "
                f"once, times the itemsize ({size} bytes for {dtype}).")
        if op == "layer_norm":
            hint += " Layer norm also reads its weight and bias, shape (C,) each."
        if op == "matmul" and nbytes < want_b and nbytes == _numel(
                list(torch.broadcast_shapes(tuple(shapes[0][:-2]), tuple(shapes[1][:-2]))) + [shapes[0][-2],
                                                                                          shapes[1][-1]]) * size:
            hint = " You counted only the output: the inputs are read from memory too."
        raise AssertionError(f"{what}: nbytes {nbytes}, expected {want_b}.{hint}")


# ----------------------------------------------------------------------------- task 0.2: the roofline
def _peak(gpu: dict, op: str, dtype: str) -> float:
    if op == "matmul" and dtype in gpu["tensor_flops"]:
        return gpu["tensor_flops"][dtype]
    return gpu["vector_flops"]


def _roof_case(r, gpu, op, dtype, where):
    """`where` places the intensity: 'below' the vector ridge, 'between' the two ridges, 'above' the
    tensor ridge (or the vector ridge when no tensor peak applies)."""
    g = GPUS[gpu]
    vec = g["vector_flops"] / g["bandwidth"]
    ten = max(g["tensor_flops"].values()) / g["bandwidth"]
    lo, hi = {"below": (0.1, 0.6 * vec), "between": (1.5 * vec, 0.6 * ten), "above": (1.6 * ten, 5 * ten)}[where]
    intensity = r.uniform(lo, hi)
    nbytes = r.randrange(10**6, 10**9)
    return {"gpu": gpu, "op": op, "dtype": dtype, "flops": int(nbytes * intensity), "nbytes": nbytes}


def _roof_cases(hidden, r):
    if not hidden:
        return [{"gpu": "A100", "op": "matmul", "dtype": "bfloat16", "flops": 2 * 4096**3, "nbytes": 3 * 2 * 4096**2},
                {"gpu": "A100", "op": "matmul", "dtype": "bfloat16", "flops": 2 * 64 * 4096 * 4096,
                 "nbytes": 2 * (64 * 4096 * 2 + 4096 * 4096)},
                {"gpu": "T4", "op": "softmax", "dtype": "float16", "flops": 5 * 2**24, "nbytes": 4 * 2**24}]
    big = r.choice(["A100", "H100"])
    return [
        _roof_case(r, big, "matmul", "bfloat16", "between"),         # memory-bound on tensor cores only
        _roof_case(r, r.choice(["A100", "H100"]), "matmul", "float16", "above"),
        _roof_case(r, "T4", "matmul", "float16", "between"),
        _roof_case(r, "T4", "matmul", "bfloat16", "between"),         # no BF16 tensor cores: the vector peak
        _roof_case(r, "H100", "matmul", "float8_e4m3fn", "between"),
        _roof_case(r, r.choice(list(GPUS)), "matmul", "float32", "between"),  # fp32: vector peak, compute-bound
        _roof_case(r, r.choice(list(GPUS)), r.choice(["add", "softmax", "layer_norm"]),
                   r.choice(["bfloat16", "float16"]), "below"),
        _roof_case(r, r.choice(["A100", "H100"]), "layer_norm", "bfloat16", "between"),  # not a matmul: vector
    ]


KEYS = ("intensity", "peak", "ridge", "attainable", "bound", "time_s")


def _roof_run(case, roofline):
    gpu = copy.deepcopy(GPUS[case["gpu"]])
    with _off_limits("task0_2_roofline"):
        res = roofline(case["flops"], case["nbytes"], case["op"], getattr(torch, case["dtype"]), gpu)
    if not isinstance(res, dict):
        raise TypeError(f"roofline must return a dict with keys {KEYS}, got {type(res).__name__}")
    return {k: (_number(k, res[k]) if k != "bound" else res[k]) for k in KEYS if k in res}


def _roof_judge(case, got):
    expect_type("result", got, dict)
    missing = [k for k in KEYS if k not in got]
    if missing:
        raise AssertionError(f"roofline's dict lacks {missing}; expected the keys {list(KEYS)}")
    g = GPUS[case["gpu"]]
    op, dtype = case["op"], case["dtype"]
    peak = _peak(g, op, dtype)
    intensity = case["flops"] / case["nbytes"]
    ridge = peak / g["bandwidth"]
    attainable = min(peak, intensity * g["bandwidth"])
    want = {"intensity": intensity, "peak": peak, "ridge": ridge, "attainable": attainable,
            "bound": "memory" if intensity < ridge else "compute", "time_s": case["flops"] / attainable}
    what = f"{op} in {dtype} on the {g['name']} (intensity {intensity:.1f} FLOP/byte)"
    if got["peak"] != want["peak"] and not math.isclose(got["peak"], peak, rel_tol=1e-9):
        tc = dtype in g["tensor_flops"]
        rule = (f"a {dtype} matmul runs on the tensor cores: gpu['tensor_flops'][{dtype!r}]" if op == "matmul" and tc
                else f"the {g['name']} has no {dtype} tensor-core peak: gpu['vector_flops']" if op == "matmul"
                else "only matmuls use the tensor cores; every other op gets gpu['vector_flops']")
        raise AssertionError(f"{what}: peak {got['peak']:.4g} FLOP/s, expected {peak:.4g}: {rule}")
    for k in ("intensity", "ridge", "attainable", "time_s"):
        if not math.isclose(float(got[k]), want[k], rel_tol=1e-6):
            hint = {"intensity": "flops / nbytes", "ridge": "peak / gpu['bandwidth']",
                    "attainable": "min(peak, intensity * gpu['bandwidth'])",
                    "time_s": "flops / attainable"}[k]
            raise AssertionError(f"{what}: {k} = {got[k]:.6g}, expected {want[k]:.6g} ({hint})")
    if got["bound"] != want["bound"]:
        raise AssertionError(f"{what}: bound {got['bound']!r}, expected {want['bound']!r}: memory-bound when the "
                             f"intensity is below the ridge point ({ridge:.1f} FLOP/byte here)")



TASKS = tasks(
    Task("task0_1_op_cost", ("op_cost",), _cost_cases, _cost_run, _cost_judge),
    Task("task0_2_roofline", ("roofline",), _roof_cases, _roof_run, _roof_judge),
    Task("task0_3_copy_bandwidth", ("copy_bandwidth",), _bw_cases, _bw_run, _bw_judge),
    Task("task0_4_new_storage_bytes", ("new_storage_bytes",), _storage_cases, _storage_run, _storage_judge),
)
