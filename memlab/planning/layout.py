"""Data layout: which dimension is contiguous, and what a layout change allocates.

A tensor's strides say how far apart in memory consecutive indices of each dimension are. The same (N, C, H, W)
image batch can be stored NCHW ("channels first": each channel a contiguous H x W plane, a structure of arrays
over channels) or NHWC (`torch.channels_last`: the C values of one pixel side by side, an array of structures);
only the strides differ. `layout_report(t)` prints them and the formats the tensor is contiguous in.

Some copies are ops the tracker sees (`x.to(memory_format=...)`, `.contiguous()`), but a kernel can also copy
inside itself: oneDNN's CPU convolution reorders an NCHW input into its own blocked layout and back, and the
tracker, which sees only the storages ops return, never sees those buffers. `profiled_allocations(fn, *args)`
runs a call under PyTorch's profiler, which records every allocation of the CPU (and CUDA) allocator, and
returns the bytes allocated in all, their number and the peak of new memory during the call.
"""

from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch

__all__ = ["layout_report", "Allocations", "profiled_allocations"]


def layout_report(t: torch.Tensor) -> dict:
    """Shape, strides, the dimensions from outermost to innermost in memory (largest stride first), and whether
    the tensor is contiguous in the default format and (4-D) channels_last / (5-D) channels_last_3d."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    out = {"shape": tuple(t.shape), "strides": t.stride(), "memory order": order,
           "contiguous": t.is_contiguous()}
    if t.dim() == 4:
        out["channels_last"] = t.is_contiguous(memory_format=torch.channels_last)
    if t.dim() == 5:
        out["channels_last_3d"] = t.is_contiguous(memory_format=torch.channels_last_3d)
    return out


class Allocations(NamedTuple):
    """What the allocator handed out during one call: bytes in all, how many blocks, and the peak of new memory
    (allocations minus frees, in time order)."""
    total: int
    count: int
    peak: int


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ layer prints start/stop lines on file descriptor 2: send them to /dev/null."""
    try:
        saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    except OSError:
        yield
        return
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def profiled_allocations(fn, *args, device: str | torch.device = "cpu", **kwargs) -> Allocations:
    """Run fn(*args, **kwargs) once under torch.profiler(profile_memory=True) and add up the allocator events
    it recorded on `device` ("cpu" or "cuda"): kernels' internal buffers and compiled code included, which the
    tracker does not see. Memory that existed before the call is not counted."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    dev = torch.device(device).type
    if dev not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with _quiet_stderr(), profile(activities=acts, profile_memory=True) as prof:
        fn(*args, **kwargs)
    want = "CUDA" if dev == "cuda" else "CPU"
    deltas = [d for _, d in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                                   if e.name() == "[memory]" and e.device_type().name == want)]
    live = peak = 0
    for d in deltas:
        live += d
        peak = max(peak, live)
    return Allocations(sum(d for d in deltas if d > 0), sum(1 for d in deltas if d > 0), peak)
