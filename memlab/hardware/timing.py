"""Timing done right, and the bandwidths and FLOP/s measured with it.

Four rules, all in `time_fn`:
  1. warm up: the first call pays one-off costs (kernel selection, the cuBLAS
     handle, first-touch page faults of fresh memory, caches still cold);
     `Timing.first` keeps that cold call so you can see the difference;
  2. synchronise: CUDA calls return when the work is *queued*; without
     `torch.cuda.synchronize()` a timer measures the launch, not the work. On CUDA
     the samples are timed with CUDA events recorded on the stream;
  3. make each sample long enough (`min_sample_s`) for the timer, by running
     `inner` calls back to back, and repeat it;
  4. report the median: robust to the slow outliers (other programs, interrupts,
     the garbage collector) that a mean absorbs.
`torch.utils.benchmark.Timer(...).blocked_autorange()` follows the same rules
(it also synchronises CUDA, and reports the median); use either.

Bandwidth conventions: `copy_bandwidth` counts bytes read + bytes written
(2 x nbytes per copy), as the STREAM benchmark's Copy kernel does (McCalpin,
"Memory bandwidth and machine balance", 1995); `read_bandwidth` counts bytes
read; `transfer_bandwidth` counts the bytes that cross the bus once.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass

import torch

from ..core.validate import flag, int_at_least, is_int, number_in, one_of, pos_int

__all__ = ["Timing", "synchronize", "time_fn", "copy_bandwidth", "read_bandwidth", "matmul_throughput",
           "transfer_bandwidth", "cpu_cache_sizes"]


def _device(device) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    try:
        d = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device must be cpu, cuda or mps, got {device!r}") from e
    if d.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device must be cpu, cuda or mps, got {d.type!r}")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device is 'cuda' but torch.cuda.is_available() is False on this machine")
    if d.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device is 'mps' but MPS is not available on this machine")
    return d


def synchronize(device: str | torch.device = "cpu") -> None:
    """Wait until all work queued on `device` has finished (a no-op on CPU: CPU ops are synchronous)."""
    d = _device(device)
    if d.type == "cuda":
        torch.cuda.synchronize(d)
    elif d.type == "mps":
        torch.mps.synchronize()


@dataclass
class Timing:
    """Seconds per call of a function, measured by `time_fn`."""
    first: float            # the very first call, alone (cold)
    times: list[float]      # one per repeat: a sample of `inner` back-to-back calls / inner
    inner: int
    device: str

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def max(self) -> float:
        return max(self.times)

    def __str__(self) -> str:
        return (f"median {self.median * 1e3:.4g} ms per call (min {self.min * 1e3:.4g}, max {self.max * 1e3:.4g}; "
                f"{len(self.times)} samples x {self.inner} calls, {self.device}); first call {self.first * 1e3:.4g} ms")


def _sample(fn, inner: int, dev: torch.device) -> float:
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3        # elapsed_time is in milliseconds
    synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    synchronize(dev)
    return time.perf_counter() - t0


def time_fn(fn, device: str | torch.device = "cpu", warmup: int = 2, repeats: int = 7,
            min_sample_s: float = 2e-3, max_inner: int = 100_000) -> Timing:
    """Time `fn()` (no arguments: wrap it in a lambda) on `device`: one cold call,
    `warmup` calls, then `repeats` samples of `inner` calls each, `inner` chosen so
    one sample lasts at least `min_sample_s`. Returns a Timing (use `.median`)."""
    if not callable(fn):
        raise TypeError(f"fn must be callable with no arguments, got {type(fn).__name__}")
    dev = _device(device)
    for nm, v, lo in (("warmup", warmup, 0), ("repeats", repeats, 1), ("max_inner", max_inner, 1)):
        int_at_least(nm, v, lo)
    number_in("min_sample_s", min_sample_s, 0, 10, hi_open=False, what="a number of seconds in [0, 10]")
    first = _sample(fn, 1, dev)
    for _ in range(warmup):
        fn()
    inner = 1
    for _ in range(4):                          # calibrate: grow inner until a sample is long enough
        t = _sample(fn, inner, dev)
        if t >= min_sample_s or inner >= max_inner:
            break
        inner = min(max_inner, max(2 * inner, math.ceil(inner * 1.2 * min_sample_s / max(t, 1e-7))))
    times = [_sample(fn, inner, dev) / inner for _ in range(repeats)]
    return Timing(first, times, inner, str(dev))


def _stat(t: Timing, stat: str) -> float:
    one_of("stat", stat, ("median", "min"), what="'median' or 'min'")
    return t.median if stat == "median" else t.min


def _nbytes(nbytes):
    if not is_int(nbytes) or nbytes < 4 or nbytes % 4:
        raise ValueError(f"nbytes must be a positive int multiple of 4 (fp32 elements), got {nbytes!r}")
    return nbytes // 4


def copy_bandwidth(nbytes: int, device: str | torch.device = "cpu", repeats: int = 7, warmup: int = 2,
                   min_sample_s: float = 2e-3, stat: str = "median") -> float:
    """GB/s (1e9 bytes/s) of `dst.copy_(src)` between two fp32 buffers of `nbytes`
    each on `device`, counting read + write (2 x nbytes per copy). The working set
    is 2 x nbytes. Small copies measure PyTorch's per-call overhead as much as memory.
    stat="min" (the fastest sample) is steadier on a busy machine: noise only adds time."""
    n, dev = _nbytes(nbytes), _device(device)
    src, dst = torch.ones(n, device=dev), torch.empty(n, device=dev)
    t = time_fn(lambda: dst.copy_(src), dev, warmup, repeats, min_sample_s)
    return 2 * nbytes / _stat(t, stat) / 1e9


def read_bandwidth(nbytes: int, device: str | torch.device = "cpu", total_bytes: int = 64 * 2**20,
                   repeats: int = 7, warmup: int = 2, min_sample_s: float = 2e-3, stat: str = "median") -> float:
    """GB/s of reading a working set of `nbytes` (fp32) over and over inside ONE call:
    `x.expand(r, n).sum()` walks a stride-0 view, r passes over the same n floats,
    about `total_bytes` read per call, so per-call overhead is amortised and the
    rate is that of the cache level the working set fits in."""
    n, dev = _nbytes(nbytes), _device(device)
    _nbytes(total_bytes)
    r = max(1, total_bytes // nbytes)
    view = torch.ones(n, device=dev).expand(r, n)             # (r, n), strides (0, 1): no copy
    t = time_fn(lambda: view.sum(), dev, warmup, repeats, min_sample_s)
    return r * nbytes / _stat(t, stat) / 1e9


def matmul_throughput(n: int, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                      repeats: int = 7, warmup: int = 2, min_sample_s: float = 2e-3, stat: str = "median") -> float:
    """FLOP/s achieved by an (n, n) @ (n, n) matmul, counting 2 n^3 FLOPs."""
    pos_int("n", n)
    one_of("dtype", dtype, (torch.float32, torch.float16, torch.bfloat16, torch.float64), what="a floating torch.dtype")
    dev = _device(device)
    a, b = torch.randn(n, n, device=dev, dtype=dtype), torch.randn(n, n, device=dev, dtype=dtype)
    t = time_fn(lambda: a @ b, dev, warmup, repeats, min_sample_s)
    return 2 * n**3 / _stat(t, stat)


def transfer_bandwidth(nbytes: int, direction: str = "h2d", pinned: bool = True, repeats: int = 7,
                       warmup: int = 2) -> float:
    """GB/s of one host<->CUDA copy of `nbytes` (bytes crossing the bus once).
    direction "h2d" (host to device) or "d2h"; pinned=True uses page-locked host
    memory and non_blocking copies, pinned=False ordinary (pageable) memory. CUDA only."""
    one_of("direction", direction, ("h2d", "d2h"), what="'h2d' or 'd2h'")
    flag("pinned", pinned)
    n = _nbytes(nbytes)
    if not torch.cuda.is_available():
        raise ValueError("transfer_bandwidth needs a CUDA device (host<->device copies cross PCIe/NVLink)")
    host = torch.ones(n, pin_memory=pinned)
    dev = torch.ones(n, device="cuda")
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    t = time_fn(lambda: dst.copy_(src, non_blocking=pinned), "cuda", warmup, repeats)
    return nbytes / t.median / 1e9


def cpu_cache_sizes() -> dict[str, int]:
    """This machine's data caches as the OS reports them (Linux sysfs, cpu0):
    {"L1d": bytes, "L2": bytes, "L3": bytes}; {} where the OS does not say."""
    out, base = {}, "/sys/devices/system/cpu/cpu0/cache"
    if not os.path.isdir(base):
        return out
    for idx in sorted(os.listdir(base)):
        try:
            with open(os.path.join(base, idx, "level")) as f:
                level = f.read().strip()
            with open(os.path.join(base, idx, "type")) as f:
                kind = f.read().strip()
            with open(os.path.join(base, idx, "size")) as f:
                size = f.read().strip()
        except OSError:
            continue
        if kind == "Instruction" or not size:
            continue
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1].upper(), 1)
        value = int(size[:-1] if mult > 1 else size) * mult
        out[f"L{level}d" if level == "1" else f"L{level}"] = value
    return out
