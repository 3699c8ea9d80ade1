"""What runs in the learner's process for exercise 00: each task's `run`, the guard every task runs the
learner's code under, and task 0.3's recorder and the grader's own copy bandwidth (measured here, right before
and right after the learner's call, on the same machine)."""

from __future__ import annotations

import contextlib
import copy
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memlab

from ..common import memlab_files, no_calls_into
from .inputs import KEYS, _storage_fn, _storage_inputs, gpu_spec

_perf_counter, _perf_counter_ns, _sleep = time.perf_counter, time.perf_counter_ns, time.sleep  # bound at import

# the lesson's own formulas and benchmarks: memlab/hardware/hierarchy.py and memlab/hardware/timing.py
HIERARCHY = memlab_files("hardware/hierarchy.py", "hardware/timing.py")


@contextlib.contextmanager
def _off_limits(task: str, tracker: bool = False):
    """During the learner's call: no calls into memlab/hardware/hierarchy.py or memlab/hardware/timing.py (the
    lesson's own formulas and benchmarks), and with tracker=True memlab.MemoryTracker raises."""
    original = memlab.MemoryTracker.__enter__

    def refuse(self):
        raise AssertionError(f"{task}: memlab.MemoryTracker is off limits here; find the new storages yourself "
                             f"(compare the result's storages with the inputs' storages)")

    if tracker:
        memlab.MemoryTracker.__enter__ = refuse
    try:
        with no_calls_into(task, HIERARCHY, "memlab.hardware.hierarchy or memlab.hardware.timing"):
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
def _cost_run(case, op_cost):
    with _off_limits("task0_1_op_cost"):
        res = op_cost(case["op"], [tuple(s) for s in case["shapes"]], getattr(torch, case["dtype"]))
    if not isinstance(res, (tuple, list)) or len(res) != 2:
        raise TypeError(f"op_cost must return a tuple (flops, nbytes), got {type(res).__name__}: {str(res)[:80]}")
    return [_number("flops", res[0]), _number("nbytes", res[1])]


# ----------------------------------------------------------------------------- task 0.2: the roofline
def _roof_run(case, roofline):
    gpu = copy.deepcopy(gpu_spec(case))
    with _off_limits("task0_2_roofline"):
        res = roofline(case["flops"], case["nbytes"], case["op"], getattr(torch, case["dtype"]), gpu)
    if not isinstance(res, dict):
        raise TypeError(f"roofline must return a dict with keys {KEYS}, got {type(res).__name__}")
    return {k: (_number(k, res[k]) if k != "bound" else res[k]) for k in KEYS if k in res}


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
    """Records, in order, every copy (bytes, and whether its destination shares its source's storage), every timer
    read (seconds) and every CUDA synchronize during the learner's call, and sleeps `delay` seconds inside the
    second timed copy (a planted slow outlier)."""

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
            # a copy whose destination shares storage with its source (dst = src, or a view of it) moves no
            # bytes: copy_ returns at once when dst is src. Recorded, so the judge can say so.
            shared = (func.__name__.split(".")[0] == "copy_" and len(args) > 1 and
                      all(isinstance(a, torch.Tensor) for a in args[:2]) and
                      args[0].untyped_storage().data_ptr() == args[1].untyped_storage().data_ptr())
            self.events.append(["copy", out.numel() * out.element_size(), bool(shared)])
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


# ----------------------------------------------------------------------------- task 0.4: new storage
def _storage_run(case, new_storage_bytes):
    xs = _storage_inputs(case)
    with _off_limits("task0_4_new_storage_bytes", tracker=True):
        res = new_storage_bytes(_storage_fn(case), *xs)
    return _number("new_storage_bytes(...)", res)
