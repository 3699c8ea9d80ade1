"""The virtual GPU: run a full-size training step on a laptop, allocate nothing,
and get a real `torch.OutOfMemoryError` when it would not fit.

Inside `VirtualGPU.run(step)` every tensor is a FakeTensor (PyTorch's
`FakeTensorMode`: shapes, dtypes and strides without data), and memlab's
tracker counts each storage against the GPU's capacity, rounded up to 512
bytes as the CUDA caching allocator rounds requests. A 7B-parameter step
"runs" in seconds because no arithmetic happens.

Build the model, optimizer and batch *inside* the step function (fake
tensors are created on `gpu.device`, the default device, so no `.to()` is
needed: `Module.to()` and `.half()` cannot swap fake parameters), and call
`memlab.watch(model, optimizer)` so parameters are labelled as parameters:

    gpu = VirtualGPU("T4-16GB")
    def step():
        model = GPT(GPTConfig.gpt2_medium())
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        memlab.watch(model, opt)
        x = torch.randint(0, 50257, (8, 1024))
        train_step(model, opt, x, x)
    result = gpu.run(step)          # raises torch.OutOfMemoryError if it does not fit

Why the fake tensors report device "cpu": a CPU-only PyTorch build cannot run
autograd on fake tensors that claim to be on "cuda" (it has no CUDA device
guard), so the virtual GPU's tensors live on a fake "cpu" device. Bytes do not
depend on the device. Two things do differ from a real GPU and are documented
where they matter: autocast uses the CPU op lists (`gpu.autocast(dtype)`), and
optimizers default to foreach=False on CPU tensors while CUDA defaults to
foreach=True; pass foreach=True to see the CUDA step peak.

What it does not model: the CUDA context (hundreds of MiB outside PyTorch's
allocator), cuBLAS/cuDNN workspaces, and fragmentation (cached but unusable
blocks). Its peak is the allocator's `max_memory_allocated`, not `reserved`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from .track import MemoryTracker, format_bytes

__all__ = ["PRESETS", "GPUSpec", "VirtualGPU", "VirtualRun"]

GiB = 2**30


@dataclass(frozen=True)
class GPUSpec:
    name: str
    capacity: int     # bytes: the vendor's nominal memory size, read as GiB
    bf16: bool        # native bf16 tensor cores (Ampere sm_80 and newer)
    note: str         # where the numbers come from


# Nominal capacities from each vendor's data sheet. A real device reports a
# little less (ECC, driver); torch.cuda.mem_get_info() says how much is free.
PRESETS: dict[str, GPUSpec] = {
    "T4-16GB": GPUSpec("T4-16GB", 16 * GiB, False, "NVIDIA T4 data sheet: 16 GB GDDR6, Turing sm_75"),
    "L4-24GB": GPUSpec("L4-24GB", 24 * GiB, True, "NVIDIA L4 data sheet: 24 GB GDDR6, Ada sm_89"),
    "RTX4090-24GB": GPUSpec("RTX4090-24GB", 24 * GiB, True, "GeForce RTX 4090 spec: 24 GB GDDR6X, Ada sm_89"),
    "A100-40GB": GPUSpec("A100-40GB", 40 * GiB, True, "NVIDIA A100 data sheet: 40 GB HBM2, Ampere sm_80"),
    "A100-80GB": GPUSpec("A100-80GB", 80 * GiB, True, "NVIDIA A100 data sheet: 80 GB HBM2e, Ampere sm_80"),
    "H100-80GB": GPUSpec("H100-80GB", 80 * GiB, True, "NVIDIA H100 SXM data sheet: 80 GB HBM3, Hopper sm_90"),
}


@dataclass
class VirtualRun:
    """What one `VirtualGPU.run` saw."""
    gpu: GPUSpec
    fits: bool                 # False if it raised out-of-memory
    peak: int                  # bytes (at the OOM: what was live plus the failed request)
    peak_breakdown: dict[str, int]
    phase_peaks: dict[str, dict[str, int]]
    peak_phase: str
    seconds: float             # wall time of the fake run
    oom_message: str | None
    tracker: MemoryTracker
    value: object = None       # what the step function returned

    @property
    def headroom(self) -> int:
        """Capacity minus peak, in bytes (negative: it did not fit)."""
        return self.gpu.capacity - self.peak

    def __str__(self) -> str:
        head = (f"{self.gpu.name}: {'fits' if self.fits else 'OUT OF MEMORY'}; peak {format_bytes(self.peak)} "
                f"of {format_bytes(self.gpu.capacity)} ({100 * self.peak / self.gpu.capacity:.1f}%), "
                f"in phase '{self.peak_phase}', {self.seconds:.1f} s on this machine")
        rows = [f"  {c:<12} {format_bytes(b):>12}" for c, b in self.peak_breakdown.items()]
        return "\n".join([head, *rows])


class VirtualGPU:
    """A GPU of a given capacity that exists only as a byte count.

    VirtualGPU("A100-80GB"), VirtualGPU(capacity_gb=12), or
    VirtualGPU("T4-16GB", capacity_gb=15) to override a preset's capacity.
    """

    device = torch.device("cpu")   # the device fake tensors report (see the module docstring)

    def __init__(self, preset: str | None = None, *, capacity_gb: float | None = None):
        if preset is None and capacity_gb is None:
            raise ValueError(f"give a preset (one of {sorted(PRESETS)}) or capacity_gb")
        if preset is not None:
            if not isinstance(preset, str):
                raise TypeError(f"preset must be a str, got {type(preset).__name__}")
            if preset not in PRESETS:
                raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)} "
                                 f"or pass capacity_gb=")
            spec = PRESETS[preset]
        else:
            spec = GPUSpec("custom", 0, True, "custom capacity")
        if capacity_gb is not None:
            if isinstance(capacity_gb, bool) or not isinstance(capacity_gb, (int, float)):
                raise TypeError(f"capacity_gb must be a number, got {type(capacity_gb).__name__}")
            if not capacity_gb > 0:
                raise ValueError(f"capacity_gb must be > 0, got {capacity_gb}")
            name = spec.name if preset is None else f"{spec.name}@{capacity_gb:g}GiB"
            spec = GPUSpec(f"custom-{capacity_gb:g}GiB" if preset is None else name,
                           int(capacity_gb * GiB), spec.bf16, spec.note)
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def capacity(self) -> int:
        return self.spec.capacity

    def __repr__(self) -> str:
        return f"VirtualGPU({self.spec.name!r}, capacity={format_bytes(self.spec.capacity)})"

    def autocast(self, dtype: torch.dtype = torch.bfloat16):
        """torch.autocast for the virtual GPU's tensors (CPU op lists; see module docstring)."""
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        return torch.autocast(self.device.type, dtype=dtype)

    def run(self, step, *args, catch_oom: bool = False, timeline: bool = False, **kwargs) -> VirtualRun:
        """Run `step(*args, **kwargs)` on fake tensors against this GPU's capacity.

        Raises torch.OutOfMemoryError if it would not fit, unless catch_oom=True,
        in which case the returned VirtualRun has fits=False and the message.
        """
        if not callable(step):
            raise TypeError(f"step must be callable (a function that builds and runs one training step), "
                            f"got {type(step).__name__}")
        tracker = MemoryTracker(device=self.device, capacity=self.capacity, round_to=512,
                                timeline=timeline, device_label=self.name)
        t0 = time.perf_counter()
        oom = None
        value = None
        with FakeTensorMode():
            try:
                with tracker:
                    value = step(*args, **kwargs)
            except torch.OutOfMemoryError as e:
                if not catch_oom:
                    raise
                oom = str(e)
        seconds = time.perf_counter() - t0
        if oom is not None:
            info = tracker.oom
            peak = sum(info["live"].values()) + info["request"]
            breakdown, ph = info["live"], info["phase"]
        else:
            peak, breakdown, ph = tracker.peak, tracker.peak_breakdown, tracker.peak_phase
        return VirtualRun(self.spec, oom is None, peak, breakdown, tracker.phase_peaks, ph, seconds, oom,
                          tracker, value)

    def fits(self, step, *args, **kwargs) -> bool:
        """True if `step` runs within capacity."""
        return self.run(step, *args, catch_oom=True, **kwargs).fits
