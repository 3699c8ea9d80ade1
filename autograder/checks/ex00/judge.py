"""Exercise 00's judges: each compares what the learner's `run` returned with the references (refs.py)."""

from __future__ import annotations

import math

import torch

from ..common import expect_int, expect_type, expected
from .cases import ITEMSIZE, _describe, _numel
from .inputs import KEYS, gpu_spec
from .refs import _cost, _new_storage_reference, _peak

# ----------------------------------------------------------------------------- task 0.1: FLOPs and bytes
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
        raise AssertionError(f"{what}: flops {flops}, expected {expected(want_f)}.{hint}")
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
        raise AssertionError(f"{what}: nbytes {nbytes}, expected {expected(want_b)}.{hint}")


# ----------------------------------------------------------------------------- task 0.2: the roofline
def _roof_judge(case, got):
    expect_type("result", got, dict)
    missing = [k for k in KEYS if k not in got]
    if missing:
        raise AssertionError(f"roofline's dict lacks {missing}; expected the keys {list(KEYS)}")
    g = gpu_spec(case)
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
        raise AssertionError(f"{what}: peak {got['peak']:.4g} FLOP/s, expected {expected(f'{peak:.4g}')}: {rule}")
    for k in ("intensity", "ridge", "attainable", "time_s"):
        if not math.isclose(float(got[k]), want[k], rel_tol=1e-6):
            hint = {"intensity": "flops / nbytes", "ridge": "peak / gpu['bandwidth']",
                    "attainable": "min(peak, intensity * gpu['bandwidth'])",
                    "time_s": "flops / attainable"}[k]
            raise AssertionError(f"{what}: {k} = {got[k]:.6g}, expected {expected(f'{want[k]:.6g}')} ({hint})")
    if got["bound"] != want["bound"]:
        raise AssertionError(f"{what}: bound {got['bound']!r}, expected {expected(repr(want['bound']))}: "
                             f"memory-bound when the intensity is below the ridge point ({ridge:.1f} FLOP/byte here)")


# ----------------------------------------------------------------------------- task 0.3: copy bandwidth
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
    if any(e[0] == "copy" and e[2] for e in events):
        raise AssertionError(f"{what}: a copy's destination shares its storage with the source (dst is src, or a "
                             f"view of it): dst.copy_(src) then returns at once and moves no bytes, so you time "
                             f"nothing. Allocate a separate destination, torch.empty_like(src).")
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
        raise AssertionError(f"new_storage_bytes for {_describe(case)}: got {got}, expected {expected(want)} bytes "
                             f"of new storage.{hint}")
