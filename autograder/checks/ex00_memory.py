"""Exercise 00, tasks 0.3 (copy bandwidth) and 0.4 (new storage): measurements on real tensors, with their
references; and the guard every task of exercise 00 runs the learner's code under. The task list is in ex00.py."""

from __future__ import annotations

import contextlib
import math
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memlab

from .common import expect_int, expect_type, memlab_files, no_calls_into

_perf_counter, _perf_counter_ns, _sleep = time.perf_counter, time.perf_counter_ns, time.sleep  # bound at import

# the lesson's own formulas and benchmarks: memlab/hardware/hierarchy.py and memlab/hardware/timing.py
HIERARCHY = memlab_files("hardware/hierarchy.py", "hardware/timing.py")


@contextlib.contextmanager
def _off_limits(task: str, tracker: bool = False):
    """During the learner's call: no calls into memlab/hardware/hierarchy.py or memlab/hardware/timing.py (the lesson's own
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
