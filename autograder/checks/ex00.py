"""Checks for exercise 00: read the roofline.

References, all computed here by the grader:
- task 0.1: the closed forms of the task text, written plainly (`_cost`);
- task 0.2: min(peak, intensity x bandwidth) with the peak picked from the data-sheet dicts below;
- task 0.3: what the learner's own timer reads say (the grader records every `time.perf_counter()` read,
  every copy and, on CUDA, every `torch.cuda.synchronize()` during the call), and a copy bandwidth the
  grader measures itself right before and right after the call (`_reference_bandwidth`);
- task 0.4: memlab's `MemoryTracker` run by the judge on the same op sequence, cross-checked by
  counting the result's storages.
Off limits during the learner's calls: anything in memlab/hierarchy.py (detected), and
`memlab.MemoryTracker` in task 0.4 (it raises).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import statistics
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memlab

from .common import Task, expect_int, expect_type, memlab_files, no_calls_into, tasks

_perf_counter, _perf_counter_ns, _sleep = time.perf_counter, time.perf_counter_ns, time.sleep  # bound at import

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

# the lesson's own formulas and benchmarks: memlab/hierarchy.py and memlab/timing.py
HIERARCHY = memlab_files("hierarchy.py", "timing.py")


@contextlib.contextmanager
def _off_limits(task: str, tracker: bool = False):
    """During the learner's call: no calls into memlab/hierarchy.py or memlab/timing.py (the lesson's own
    formulas and benchmarks), and with tracker=True memlab.MemoryTracker raises."""
    original = memlab.MemoryTracker.__enter__

    def refuse(self):
        raise AssertionError(f"{task}: memlab.MemoryTracker is off limits here; find the new storages yourself "
                             f"(compare the result's storages with the inputs' storages)")

    if tracker:
        memlab.MemoryTracker.__enter__ = refuse
    try:
        with no_calls_into(task, HIERARCHY, "memlab.hierarchy or memlab.timing"):
            yield
    finally:
        if tracker:
            memlab.MemoryTracker.__enter__ = original


def _number(name, v):
    if isinstance(v, bool) or type(v) not in (int, float):
        raise TypeError(f"{name} must be a Python int or float, got {type(v).__name__}: {str(v)[:60]} "
                        f"(use float(...) or .item())")
    return v


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


# ----------------------------------------------------------------------------- task 0.3: copy bandwidth
COPY_OPS = {"copy_", "clone", "_to_copy", "copy"}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _reference_bandwidth(n_bytes: int, device: torch.device, warmup: int = 2, repeats: int = 9) -> float:
    """The grader's own measurement: median over per-copy times of dst.copy_(src), GB/s of 2 * n_bytes."""
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = _perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(_perf_counter() - t0)
    return 2 * n_bytes / statistics.median(times) / 1e9


class _Recorder(TorchDispatchMode):
    """Records, in order, every copy (bytes), every timer read (seconds) and every CUDA synchronize during
    the learner's call, and sleeps `delay` seconds inside the second timed copy (a planted slow outlier)."""

    def __init__(self, delay: float, repeats: int, namespace: dict):
        super().__init__()
        self.events: list[list] = []
        self.delay, self.repeats = delay, repeats
        self.ns = namespace
        self._saved: list = []

    def _timer(self, fn, scale):
        def read():
            v = fn()
            self.events.append(["timer", v * scale])
            return v
        return read

    def __enter__(self):
        pc, pcn = self._timer(_perf_counter, 1.0), self._timer(_perf_counter_ns, 1e-9)
        swaps = [(time, "perf_counter", pc), (time, "perf_counter_ns", pcn)]
        for k, v in list(self.ns.items()):               # `from time import perf_counter` in the notebook
            if v is _perf_counter:
                swaps.append((self.ns, k, pc))
            elif v is _perf_counter_ns:
                swaps.append((self.ns, k, pcn))
        if torch.cuda.is_available():
            real = torch.cuda.synchronize

            def synchronize(*a, **kw):
                real(*a, **kw)
                self.events.append(["sync"])
            swaps.append((torch.cuda, "synchronize", synchronize))
        for obj, k, new in swaps:
            if isinstance(obj, dict):
                self._saved.append((obj, k, obj[k]))
                obj[k] = new
            else:
                self._saved.append((obj, k, getattr(obj, k)))
                setattr(obj, k, new)
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        for obj, k, old in reversed(self._saved):
            if isinstance(obj, dict):
                obj[k] = old
            else:
                setattr(obj, k, old)
        self._saved.clear()
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in COPY_OPS and isinstance(out, torch.Tensor):
            self.events.append(["copy", out.numel() * out.element_size()])
            timers = [i for i, e in enumerate(self.events) if e[0] == "timer"]
            copies = [i for i, e in enumerate(self.events) if e[0] == "copy" and timers and i > timers[0]]
            if len(copies) == 2:
                # at least 10x the learner's own first timed copy per repeat: a mean over the copies then
                # lands far from the median however slow this machine is right now
                before = [i for i in timers if i < copies[0]]
                after = [i for i in timers if copies[0] < i < copies[1]]
                if before and after:
                    first = self.events[after[0]][1] - self.events[before[-1]][1]
                    self.delay = max(self.delay, 10 * self.repeats * first)
                self.delay = min(self.delay, 3.0)
                _sleep(self.delay)
        return out


def _bw_cases(hidden, r):
    if not hidden:
        return [{"n_bytes": 8_000_003, "n_bytes_cuda": 256_000_003, "warmup": 2, "repeats": 7}]
    repeats = [r.choice([5, 7, 9, 11]), r.choice([6, 8, 10]), r.randint(5, 11)]    # an odd and an even count
    return [{"n_bytes": r.randrange(4_000_000, 12_000_000), "n_bytes_cuda": r.randrange(200_000_000, 400_000_000),
             "warmup": w, "repeats": k} for w, k in zip((1, 2, 3), repeats)]


def _bw_run(case, copy_bandwidth):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = case["n_bytes_cuda"] if device.type == "cuda" else case["n_bytes"]
    before = _reference_bandwidth(n, device)
    t_copy = 2 * n / (before * 1e9)
    rec = _Recorder(min(3.0, max(0.5, 10 * case["repeats"] * t_copy)), case["repeats"],
                    getattr(copy_bandwidth, "__globals__", {}))
    with _off_limits("task0_3_copy_bandwidth"), rec:
        value = copy_bandwidth(n, device, warmup=case["warmup"], repeats=case["repeats"])
    after = _reference_bandwidth(n, device)
    return {"value": _number("copy_bandwidth(...)", value), "events": rec.events, "reference": [before, after],
            "device": device.type, "n_bytes": n, "delay_s": rec.delay}


def _bw_judge(case, got):
    expect_type("result", got, dict)
    value, events, n, cuda = float(got["value"]), got["events"], got["n_bytes"], got["device"] == "cuda"
    what = f"copy_bandwidth({n}, {got['device']!r}, warmup={case['warmup']}, repeats={case['repeats']})"
    if not (math.isfinite(value) and value > 0):
        raise AssertionError(f"{what} returned {value}: expected a positive number of GB/s")
    timers = [i for i, e in enumerate(events) if e[0] == "timer"]
    if len(timers) < 2:
        raise AssertionError(f"{what} read time.perf_counter() {len(timers)} time(s): time each copy with "
                             f"time.perf_counter() before and after it")
    first = timers[0]
    warm = sum(1 for e in events[:first] if e[0] == "copy")
    if warm < max(1, case["warmup"]):
        raise AssertionError(f"{what}: {warm} copies ran before your first timer read, expected {case['warmup']} "
                             f"warm-up copies: the first copies pay for page faults, allocator and kernel start-up "
                             f"(and on CUDA, lazy initialisation); run them untimed before the first timer read")
    if any(e[0] == "copy" for e in events[timers[-1]:]):
        raise AssertionError(f"{what}: a copy ran after your last timer read; every copy after the warm-up is "
                             f"timed")
    intervals = []                                     # (seconds, copies, bytes, synced after the last copy)
    for a, b in zip(timers, timers[1:]):
        span = events[a + 1:b]
        copies = [e[1] for e in span if e[0] == "copy"]
        if copies:
            last = max(i for i, e in enumerate(span) if e[0] == "copy")
            synced = any(e[0] == "sync" for e in span[last + 1:])
            intervals.append((events[b][1] - events[a][1], len(copies), sum(copies), synced))
    if sum(c for _, c, _, _ in intervals) != case["repeats"] or any(c != 1 for _, c, _, _ in intervals):
        raise AssertionError(f"{what}: your timed intervals held {[c for _, c, _, _ in intervals]} copies; expected "
                             f"{case['repeats']} intervals of one copy each (a timer read before and after every "
                             f"timed copy), so that a robust statistic can be taken over the per-copy times")
    sizes = {b for _, _, b, _ in intervals}
    if sizes != {n}:
        raise AssertionError(f"{what}: your timed copies moved {sorted(sizes)} bytes each, expected n_bytes = {n}: "
                             f"copy a torch.uint8 tensor of n_bytes elements")
    if cuda:
        warm_synced = any(e[0] == "sync" for e in events[:first]) and events[:first] and \
            max(i for i, e in enumerate(events[:first]) if e[0] == "sync") > \
            max(i for i, e in enumerate(events[:first]) if e[0] == "copy")
        if not warm_synced or not all(s for _, _, _, s in intervals):
            raise AssertionError(f"{what}: CUDA copies are asynchronous: call torch.cuda.synchronize() after the "
                                 f"warm-up and after each timed copy, before reading the timer; otherwise you time "
                                 f"the launch, not the copy")
    times = sorted(t for t, _, _, _ in intervals)
    if times[0] <= 0:
        raise AssertionError(f"{what}: one of your timed intervals shows no elapsed time")
    # every median convention lies between the lower and the upper middle time (torch.median takes the lower,
    # statistics.median the mean of the two); your times are the grader's records of your own timer reads
    k = len(times)
    slow, fast = 2 * n / times[k // 2] / 1e9, 2 * n / times[(k - 1) // 2] / 1e9
    if not 0.99 * slow <= value <= 1.01 * fast:
        hint = ""
        if 0.99 * slow <= 2 * value <= 1.01 * fast:
            hint = " Yours is half of it: a copy reads n_bytes AND writes n_bytes, so it moves 2 * n_bytes."
        elif value < slow:
            hint = (f" The grader slowed one of your timed copies down by {got['delay_s']:.2f} s on purpose: a mean "
                    f"follows such an outlier, a median does not.")
        elif value > fast:
            hint = " Yours is faster than your median copy: the task asks for the median time, not the best one."
        med = f"{slow:.4g}" if k % 2 else f"{slow:.4g} to {fast:.4g}"
        raise AssertionError(f"{what} returned {value:.4g} GB/s, but your own timer reads give {med} GB/s at the "
                             f"median copy time; return 2 * n_bytes / median(times) / 1e9.{hint}")
    # Plausibility against the grader's own copy, on CUDA only: there a missing synchronize times the launch,
    # not the copy. A shared CPU swings by two orders of magnitude between consecutive measurements (seen while
    # writing this check: 0.35 and 64 GB/s for the same 5.5 MB copy, seconds apart), so on a CPU the
    # checks above, on the learner's own recorded timer reads, carry the weight.
    lo, hi = min(got["reference"]) / 5, max(got["reference"]) * 5
    if cuda and not lo <= value <= hi:
        raise AssertionError(f"{what} returned {value:.3g} GB/s; the grader measured {got['reference'][0]:.3g} and "
                             f"{got['reference'][1]:.3g} GB/s for the same copy just before and after your call")


# ----------------------------------------------------------------------------- task 0.4: new storage
# Each op maps a tensor to a tensor (or a tuple); a case lists the ops, and fn applies them in order.
def _chunk2(x):
    return x.chunk(2, dim=0)


OPS = {
    "t": lambda x: x.transpose(-1, -2),                                   # view
    "contiguous": lambda x: x.contiguous(),                               # copy only if not contiguous
    "flatten": lambda x: x.reshape(-1),                                   # view if it can, copy if it must
    "reshape_rows": lambda x: x.reshape(x.shape[0], -1),
    "mul_": lambda x: x.mul_(2),                                          # in place
    "add": lambda x: x + 1,                                               # a new tensor
    "rows": lambda x: x[1:-1],                                            # basic slicing: view
    "cols": lambda x: x[..., ::2],
    "index": lambda x: x[[0, -1]],                                        # advanced indexing: copy
    "expand": lambda x: x.unsqueeze(0).expand(3, *x.shape),               # view, stride 0
    "clone": lambda x: x.clone(),
    "channels_last": lambda x: x.contiguous(memory_format=torch.channels_last),
    "to_self_dtype": lambda x: x.to(x.dtype),                             # no-op: returns x itself
    "half": lambda x: x.half(),                                           # a dtype change is a copy
    "detach": lambda x: x.detach(),
    "chunk2": _chunk2,                                                    # a tuple of views
}
PAIR_OPS = {
    "cat": lambda x, y: torch.cat([x, y]),
    "add_": lambda x, y: x.add_(y),
    "pair": lambda x, y: (x, y.t().contiguous()),
}
CHAIN_OPS = ("t", "contiguous", "flatten", "mul_", "add", "rows", "cols", "expand", "clone", "to_self_dtype",
             "detach", "reshape_rows")


def _storage_inputs(case):
    g = torch.Generator().manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    xs = [torch.randn(*case["shape"], generator=g).to(dtype) for _ in range(case.get("inputs", 1))]
    return xs


def _storage_fn(case):
    ops = case["ops"]
    if case.get("inputs", 1) == 2:
        def fn(x, y):
            return PAIR_OPS[ops[0]](x, y)
        return fn

    def fn(x):
        for name in ops:
            x = OPS[name](x)
        return x
    return fn


def _describe(case):
    ops = case["ops"]
    if case.get("inputs", 1) == 2:
        return f"fn(x, y) = {ops[0]}(x, y) with x, y of shape {tuple(case['shape'])} {case['dtype']}"
    return f"fn(x) = x -> {' -> '.join(ops)} with x of shape {tuple(case['shape'])} {case['dtype']}"


def _scase(r, ops, shape, dtype=None, inputs=1):
    return {"seed": r.randrange(2**31), "ops": ops, "shape": shape, "dtype": dtype or r.choice(
        ["float32", "float16", "bfloat16", "float64"]), "inputs": inputs}


def _chain(r, shape) -> list[str]:
    """3 to 5 ops drawn at random, each one kept only if it applies to what the previous ones made."""
    x, ops, want = torch.zeros(shape), [], r.randint(3, 5)
    while len(ops) < want:
        name = r.choice(CHAIN_OPS)
        try:
            y = OPS[name](x)
        except (RuntimeError, IndexError, ValueError):
            continue
        if y.numel() and y.dim():
            x, ops = y, ops + [name]
    return ops


def _storage_cases(hidden, r):
    if not hidden:
        return [_scase(r, ["t", "contiguous"], [5, 7], "float32"),
                _scase(r, ["flatten"], [3, 5, 7], "float32"),
                _scase(r, ["t", "flatten"], [5, 7], "float32"),
                _scase(r, ["rows"], [6, 7], "float16"),
                _scase(r, ["mul_"], [6, 7], "float32")]

    def d():
        return r.randint(3, 31) | 1

    b, c, h, w = d(), d(), d(), d()
    cases = [
        _scase(r, ["t", "contiguous"], [b, c]),
        _scase(r, ["flatten"], [b, c, h]),                                 # reshape of contiguous: free
        _scase(r, ["t", "flatten"], [b, c]),                               # reshape of non-contiguous: a copy
        _scase(r, ["t", "reshape_rows"], [b, c, h]),
        _scase(r, ["mul_"], [b, c]),
        _scase(r, ["rows"], [b, c]),
        _scase(r, ["cols", "clone"], [b, c]),                              # copy of the slice only
        _scase(r, ["expand"], [b, c]),
        _scase(r, ["expand", "contiguous"], [b, c]),                       # 3x the input
        _scase(r, ["channels_last"], [2, c, h, w]),
        _scase(r, ["channels_last", "channels_last"], [2, c, h, w]),       # the second is free
        _scase(r, ["clone", "chunk2"], [2 * b, c]),                        # two views of one new storage
        _scase(r, ["t", "contiguous", "rows"], [b, c]),                    # a slice of a new storage
        _scase(r, ["t", "contiguous", "t", "contiguous"], [b, c]),         # a temporary freed inside fn
        _scase(r, ["to_self_dtype", "detach", "contiguous"], [b, c]),      # all free
        _scase(r, ["index"], [b, c]),
        _scase(r, ["half"], [b, c], "float32"),
        _scase(r, ["cat"], [b, c], inputs=2),
        _scase(r, ["add_"], [b, c], inputs=2),
        _scase(r, ["pair"], [b, c], inputs=2),
    ]
    for _ in range(2):                                                     # random chains
        cases.append(_scase(r, _chain(r, [b + 2, c, h]), [b + 2, c, h]))
    return cases


def _storage_run(case, new_storage_bytes):
    xs = _storage_inputs(case)
    with _off_limits("task0_4_new_storage_bytes", tracker=True):
        res = new_storage_bytes(_storage_fn(case), *xs)
    return _number("new_storage_bytes(...)", res)


def _new_storage_reference(case) -> int:
    """memlab's tracker on the same fn: bytes of the storages created inside that are still alive when fn
    has returned (the result holds them), cross-checked by comparing the result's storages with the inputs'."""
    xs = _storage_inputs(case)
    with memlab.MemoryTracker() as tracker:
        out = _storage_fn(case)(*xs)
    outs = out if isinstance(out, tuple) else (out,)
    owned = {x.untyped_storage().data_ptr() for x in xs}
    new = {o.untyped_storage().data_ptr(): o.untyped_storage().nbytes() for o in outs}
    counted = sum(v for k, v in new.items() if k not in owned)
    if counted != tracker.current:
        raise RuntimeError(f"grader self-check failed for {_describe(case)}: tracker {tracker.current}, "
                           f"storages {counted}")
    return tracker.current


def _storage_judge(case, got):
    want = _new_storage_reference(case)
    expect_int("new_storage_bytes(fn, *inputs)", got)
    if got != want:
        ops = case["ops"]
        hint = ""
        if "flatten" in ops or "reshape_rows" in ops:
            hint = (" reshape returns a view when the strides allow it and copies when they do not (after a "
                    "transpose, say): look at the storages, not at the op's name.")
        elif want and got > want:
            hint = (" Count each new storage once, at storage.nbytes(); views of a storage add nothing, and "
                    "intermediates freed inside fn do not count.")
        elif want and got < want:
            hint = " A slice of a new storage keeps the whole storage alive: count untyped_storage().nbytes()."
        elif not want:
            hint = " Views, in-place ops and no-op conversions return tensors that share an input's storage."
        raise AssertionError(f"new_storage_bytes for {_describe(case)}: got {got}, expected {want} bytes of new "
                             f"storage.{hint}")


TASKS = tasks(
    Task("task0_1_op_cost", ("op_cost",), _cost_cases, _cost_run, _cost_judge),
    Task("task0_2_roofline", ("roofline",), _roof_cases, _roof_run, _roof_judge),
    Task("task0_3_copy_bandwidth", ("copy_bandwidth",), _bw_cases, _bw_run, _bw_judge),
    Task("task0_4_new_storage_bytes", ("new_storage_bytes",), _storage_cases, _storage_run, _storage_judge),
)
