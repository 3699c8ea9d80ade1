"""What runs in the learner's process for exercise 10: each task's `run` calls the learner's functions on the
case's trace, lifetimes or block and returns plain data. memlab's lifetime and planning helpers, its allocator
model and tracker, and the exercise kit's replay are off limits inside the learner's functions of tasks 10.1 and
10.2 (the lesson computes these answers), memlab.planning's blocks inside task 10.3's; the planner runs under a
wall-clock limit; `block_bytes` may run no torch operation (it predicts)."""

from __future__ import annotations

import signal
import time

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from memlab.checkpointing import activation_peak

from ..common import memlab_files, no_calls_into
from .inputs import block_batch, conv_filters, fingerprint

PLANNER_SECONDS = 20
PLANNING = memlab_files("planning/lifetimes.py", "planning/planner.py", "core/allocator.py", "core/track.py",
                        "kit/ex10.py")
BLOCKS = memlab_files("planning/architectures.py")


def _is_int(v) -> bool:
    return type(v) is int


def _ints(name: str, v, n: int | None = None):
    """v as a list of Python ints (a tuple or a list of them), or a str saying what is wrong."""
    if not isinstance(v, (list, tuple)):
        return f"{name} must be a list of ints, got {type(v).__name__}: {str(v)[:80]}"
    bad = [x for x in v if not _is_int(x)]
    if bad:
        return (f"{name} must hold Python ints, got a {type(bad[0]).__name__}: {str(bad[0])[:60]} (use int(...); "
                f"a bool or a tensor is not an int here)")
    if n is not None and len(v) != n:
        return f"{name} must have {n} entries, got {len(v)}"
    return list(v)


# ----------------------------------------------------------------------------- task 10.1
def _lifetimes_run(case, tensor_lifetimes, live_bytes_bound):
    why = "memlab's lifetime and planning helpers, its allocator model and tracker, and the kit's replay"
    if "events" in case:
        events = [tuple(e) for e in case["events"]]
        with no_calls_into("task10_1_lifetimes", PLANNING, why):
            got = tensor_lifetimes(events)
        if not isinstance(got, (list, tuple)):
            return {"problem": f"tensor_lifetimes must return a list of (size, birth, death) tuples, got "
                               f"{type(got).__name__}: {str(got)[:80]}"}
        out = []
        for i, lt in enumerate(got):
            triple = _ints(f"tensor_lifetimes(...)[{i}]", lt, 3)
            if isinstance(triple, str):
                return {"problem": triple + " (each lifetime is a (size, birth, death) tuple of three ints)"}
            out.append(triple)
        return {"lifetimes": out}
    intervals = [tuple(lt) for lt in case["intervals"]]
    with no_calls_into("task10_1_lifetimes", PLANNING, why):
        got = live_bytes_bound(intervals)
    if not _is_int(got):
        return {"problem": f"live_bytes_bound must return a Python int (bytes), got {type(got).__name__}: "
                           f"{str(got)[:80]}"}
    return {"bound": got}


# ----------------------------------------------------------------------------- task 10.2
class _TooSlow(Exception):
    pass


def _call_timed(fn, seconds):
    """fn() under a wall-clock limit (SIGALRM), restoring an outer timer if one was running."""
    if not hasattr(signal, "setitimer"):
        return fn()
    left, _ = signal.getitimer(signal.ITIMER_REAL)

    def too_slow(signum, frame):
        raise _TooSlow()

    old = signal.signal(signal.SIGALRM, too_slow)
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, min(seconds, left) if left else seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if left:
            signal.setitimer(signal.ITIMER_REAL, max(left - (time.monotonic() - start), 0.001))


def _plan_run(case, plan_offsets):
    lifetimes = [tuple(lt) for lt in case["lifetimes"]]

    def call():
        with no_calls_into("task10_2_plan_offsets", PLANNING, "memlab's planners and plan checks"):
            return plan_offsets(lifetimes, case["alignment"])
    try:
        got = _call_timed(call, PLANNER_SECONDS)
    except _TooSlow:
        return {"too_slow": PLANNER_SECONDS}
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return {"problem": f"plan_offsets must return (offsets, arena), got {type(got).__name__}: {str(got)[:80]}"}
    offsets = _ints("offsets", got[0], len(lifetimes))
    if isinstance(offsets, str):
        return {"problem": offsets + " (one offset per lifetime, in the order of the lifetimes)"}
    if not _is_int(got[1]):
        return {"problem": f"the arena must be a Python int (bytes), got {type(got[1]).__name__}: {str(got[1])[:60]}"}
    return {"offsets": offsets, "arena": got[1]}


# ----------------------------------------------------------------------------- task 10.3
class _Ops(TorchDispatchMode):
    """Records the torch operations that run inside it."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def _predict(case, block_bytes) -> dict:
    ops = _Ops()
    with ops, no_calls_into("task10_3_separable_block", BLOCKS, "memlab.planning's blocks"):
        got = block_bytes(case["c_in"], case["c_out"], case["side"], case["batch"], case["stride"])
    if ops.ops:
        return {"problem": f"block_bytes ran torch operations ({sorted(set(ops.ops))[:4]}): it must PREDICT the "
                           f"bytes from the shapes with a formula, without building or running a block"}
    pair = _ints("block_bytes(...)", got, 2)
    if isinstance(pair, str):
        return {"problem": pair + " (return (param_bytes, kept_bytes))"}
    return {"predicted": pair}


def _block_run(case, SeparableBlock, block_bytes):
    out = _predict(case, block_bytes)
    if "problem" in out or case.get("predict_only"):
        return out
    c_in, c_out = case["c_in"], case["c_out"]
    with no_calls_into("task10_3_separable_block", BLOCKS, "memlab.planning's blocks"):
        block = SeparableBlock(c_in, c_out, case["stride"])
        if not isinstance(block, nn.Module):
            return {"problem": f"SeparableBlock(c_in, c_out, stride) must make an nn.Module, got "
                               f"{type(block).__name__}"}
        block.train()
        params = list(block.parameters())
        dw, pw = conv_filters(case)
        found = {"dw": False, "pw": False}
        with torch.no_grad():
            for p in params:
                for name, f in (("dw", dw), ("pw", pw)):
                    if tuple(p.shape) == tuple(f.shape) and not found[name]:
                        p.copy_(f)
                        found[name] = True
                        break
        x, w = block_batch(case)
        y = block(x)
        if not isinstance(y, torch.Tensor):
            return {"problem": f"the block's forward must return a tensor, got {type(y).__name__}"}
        out["shape"] = list(y.shape)
        out["param_bytes"] = sum(p.numel() * p.element_size() for p in params)
        out["filters"] = found
        if out["shape"] != [case["batch"], c_out, *[(case["side"] - 1) // case["stride"] + 1] * 2]:
            return out
        (y * w).sum().backward()
        out["out"], out["x_grad"] = fingerprint(y), fingerprint(x.grad)
        grads = {}
        for p in params:
            for name, f in (("dw", dw), ("pw", pw)):
                if tuple(p.shape) == tuple(f.shape) and name not in grads:
                    grads[name] = fingerprint(p.grad)
                    break
        out["dw_grad"], out["pw_grad"] = grads.get("dw"), grads.get("pw")
        out["stats"] = [b.tolist() for b in block.buffers() if b.dim() == 1 and b.is_floating_point()]
        x.grad = None
        out["kept"] = activation_peak(block, lambda: (block(x) * w).sum()).stored    # a second step, measured
    return out
