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

Capacities (`PRESETS`, derived from the one GPU table `memlab.core.gpus.GPUS`)
are what the real card reports as `torch.cuda.get_device_properties(0).total_memory`
(the same number as `cudaDeviceProp.totalGlobalMem`, which NVIDIA's deviceQuery
sample prints), not the vendor's nominal "16 GB" read as GiB: a T4 holds 14.74 GiB.
The figure moves a little with the driver; each preset names its source.

Why the fake tensors report device "cpu": a CPU-only PyTorch build cannot run
autograd on fake tensors that claim to be on "cuda" (it has no CUDA device
guard), so the virtual GPU's tensors live on a fake "cpu" device. Bytes do not
depend on the device. Two things would differ from a real GPU and are handled:
`gpu.autocast(dtype)` applies CUDA's autocast op lists, not the CPU's (see
`cuda_autocast`); and optimizers default to foreach=False on CPU tensors while
CUDA defaults to foreach=True: pass foreach=True (or fused=True) explicitly.

What it does not model: the CUDA context (outside PyTorch's allocator; pass
`reserve_gb=CUDA_CONTEXT_GB` to keep room for it), cuBLAS/cuDNN workspaces and
fragmentation (cached but unusable blocks). Its peak is the allocator's
`max_memory_allocated`, not `reserved`. (`memlab.fit` adds both: it replays a run's
allocation stream through `memlab.core.allocator`, the caching allocator's model, and
adds the context.)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.overrides import TorchFunctionMode

from .gpus import PRESETS, GPUSpec, resolve_gpu
from .track import MemoryTracker, format_bytes
from .validate import number_type, one_of

__all__ = ["PRESETS", "GPUSpec", "VirtualGPU", "VirtualRun", "CUDA_CONTEXT_GB", "cuda_autocast", "lookup_preset"]

GiB, MiB = 2**30, 2**20

# Memory the CUDA context takes outside PyTorch's allocator (driver state, loaded kernels): "around 400MB if
# CUDA >= 11.7 is used and lazy module loading enabled" (ptrblck, pytorch/pytorch#109888, 2023; ~300 MB in
# pytorch/pytorch#107667; "from 200+mb to 700+mb" depending on the machine, pytorch/pytorch#28113). A guess to
# reserve, not a measurement of your machine: on a GPU, compare torch.cuda.mem_get_info() with total_memory.
CUDA_CONTEXT_GB = 0.4


def lookup_preset(name: str) -> GPUSpec:
    """The card called `name`, in any spelling people type ("t4-16gb", "4090", "RTX 4090", "h100-80gb"):
    `memlab.core.gpus.resolve_gpu`, the one GPU lookup; an unknown name raises a ValueError naming the closest."""
    if not isinstance(name, str):
        raise TypeError(f"preset must be a str, got {type(name).__name__}")
    return resolve_gpu(name, "preset")


# ----------------------------------------------------------------------------- CUDA's autocast lists
# PyTorch docs, "Automatic Mixed Precision package - torch.amp", Autocast Op Reference, "CUDA Ops that can
# autocast to float32". The CPU lists leave softmax, log_softmax, layer_norm, sum, exp, pow, rsqrt ... off any
# list (they follow their input's dtype), so a virtual GPU running CPU autocast would keep 16-bit copies where
# CUDA keeps fp32 ones. `cuda_autocast` casts the inputs of these ops to fp32, as CUDA autocast does.
CUDA_FP32_OPS = frozenset("""__pow__ __rdiv__ __rpow__ __rtruediv__ acos asin binary_cross_entropy_with_logits cosh
    cosine_embedding_loss cdist cosine_similarity cross_entropy cumprod cumsum dist erfinv exp expm1 group_norm
    hinge_embedding_loss kl_div l1_loss layer_norm log log_softmax log10 log1p log2 margin_ranking_loss mse_loss
    multilabel_margin_loss multi_margin_loss nll_loss norm normalize pdist poisson_nll_loss pow prod reciprocal
    rsqrt sinh smooth_l1_loss soft_margin_loss softmax softmin softplus sum renorm tan triplet_margin_loss""".split())
# on CUDA's lower-precision list but not on the CPU's (the CPU list has the rest: linear, matmul, mm, bmm, and
# scaled_dot_product_attention, which both lists run in the autocast dtype: aten/src/ATen/autocast_mode.cpp,
# KERNEL_CUDA(scaled_dot_product_attention, lower_precision_fp))
CUDA_LOW_OPS = frozenset("addmv addr mv chain_matmul multi_dot".split())


class _CudaAutocastLists(TorchFunctionMode):
    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if torch.is_autocast_enabled("cpu") and kwargs.get("dtype") is None:
            if name in CUDA_FP32_OPS or name in CUDA_LOW_OPS:
                to = torch.float32 if name in CUDA_FP32_OPS else self.dtype

                def cast(t):
                    return t.to(to) if isinstance(t, torch.Tensor) and t.is_floating_point() \
                        and t.dtype != torch.float64 else t
                args, kwargs = tuple(cast(a) for a in args), {k: cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


class cuda_autocast:
    """`torch.autocast` for the virtual GPU's (CPU-device) fake tensors with CUDA's op lists: matmuls in
    `dtype`, the CUDA float32 list (softmax, log_softmax, layer_norm, sum, exp, pow, rsqrt, the losses ...)
    in fp32. Bytes then match a CUDA run; `VirtualGPU.autocast(dtype, op_lists="cpu")` gives the CPU lists."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16):
        one_of("dtype", dtype, (torch.float16, torch.bfloat16), what="torch.float16 or torch.bfloat16")
        self._autocast, self._mode = torch.autocast("cpu", dtype=dtype), _CudaAutocastLists(dtype)

    def __enter__(self):
        self._autocast.__enter__()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return self._autocast.__exit__(*exc)


class _VirtualGradScaler(torch.amp.GradScaler):
    """GradScaler whose step() does not read found_inf (fake tensors have no values): it always steps.
    Scaling the loss and unscaling the gradients in place allocate exactly what the real scaler allocates."""

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)


# ----------------------------------------------------------------------------- results
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
    request: int = 0           # at an OOM: the bytes of the allocation that failed (0 if it fit)

    @property
    def headroom(self) -> int:
        """Capacity minus peak, in bytes (negative: it did not fit)."""
        return self.gpu.capacity - self.peak

    def __str__(self) -> str:
        head = (f"{self.gpu.name}: {'fits' if self.fits else 'OUT OF MEMORY'}; peak {format_bytes(self.peak)} "
                f"of {format_bytes(self.gpu.capacity)} ({100 * self.peak / self.gpu.capacity:.1f}%), "
                f"in phase '{self.peak_phase}', {self.seconds:.1f} s on this machine")
        rows = [f"  {c:<12} {format_bytes(b):>12}" for c, b in self.peak_breakdown.items()]
        if not self.fits:
            rows.append(f"  {'+ failed request':<12} {format_bytes(self.request):>8}")
        return "\n".join([head, *rows])


class VirtualGPU:
    """A GPU of a given capacity that exists only as a byte count.

    VirtualGPU("A100-80GB") (names ignore case), VirtualGPU(capacity_gb=12) (GiB), or
    VirtualGPU("T4-16GB", capacity_gb=15) to override a preset's capacity. `reserve_gb` keeps that
    many GiB out of reach, e.g. `reserve_gb=memlab.core.virtual_gpu.CUDA_CONTEXT_GB` for the CUDA context.
    """

    device = torch.device("cpu")   # the device fake tensors report (see the module docstring)

    def __init__(self, preset: str | None = None, *, capacity_gb: float | None = None, reserve_gb: float = 0.0):
        if preset is None and capacity_gb is None:
            raise ValueError(f"give a preset (one of {sorted(PRESETS)}) or capacity_gb")
        spec = lookup_preset(preset) if preset is not None else GPUSpec("custom", 0, True, "custom capacity")
        if capacity_gb is not None:
            _check_gib("capacity_gb", capacity_gb, positive=True)
            name = f"custom-{capacity_gb:g}GiB" if preset is None else f"{spec.name}@{capacity_gb:g}GiB"
            spec = GPUSpec(name, int(capacity_gb * GiB), spec.bf16, spec.note)
        _check_gib("reserve_gb", reserve_gb, positive=False)
        if reserve_gb:
            if reserve_gb * GiB >= spec.capacity:
                raise ValueError(f"reserve_gb ({reserve_gb}) must be less than the capacity "
                                 f"({spec.capacity / GiB:.2f} GiB)")
            spec = GPUSpec(f"{spec.name}-{reserve_gb:g}GiB reserved", spec.capacity - int(reserve_gb * GiB),
                           spec.bf16, spec.note)
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def capacity(self) -> int:
        return self.spec.capacity

    def __repr__(self) -> str:
        return f"VirtualGPU({self.spec.name!r}, capacity={format_bytes(self.spec.capacity)})"

    def autocast(self, dtype: torch.dtype = torch.bfloat16, op_lists: str = "cuda"):
        """torch.autocast for the virtual GPU's tensors. op_lists="cuda" (default): CUDA's op lists
        (`cuda_autocast`); "cpu": PyTorch's CPU lists, as plain torch.autocast("cpu") applies them."""
        one_of("op_lists", op_lists, ("cuda", "cpu"), what="'cuda' or 'cpu'")
        one_of("dtype", dtype, (torch.float16, torch.bfloat16), what="torch.float16 or torch.bfloat16")
        return cuda_autocast(dtype) if op_lists == "cuda" else torch.autocast(self.device.type, dtype=dtype)

    def grad_scaler(self, **kwargs) -> torch.amp.GradScaler:
        """A torch.amp.GradScaler for fp16 steps on the virtual GPU. The real scaler's step() reads
        found_inf with .item(), which fake tensors cannot answer; this one always steps. Its tensors
        (the scaled loss, the in-place unscale) are the real scaler's."""
        return _VirtualGradScaler(self.device.type, **kwargs)

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
            except DataDependentOutputException as e:
                raise RuntimeError(
                    f"the step read a tensor's value ({e}): on the virtual GPU tensors are fake, with shapes "
                    f"but no data, so .item(), float(t), print(t), `if t > 0:` and a GradScaler's step() "
                    f"cannot run. Return the tensor (or nothing) instead of its value, use memlab.train_step "
                    f"(it returns nan for a fake loss), and gpu.grad_scaler() for fp16 loss scaling.") from None
        seconds = time.perf_counter() - t0
        request = 0
        if oom is not None:
            info = tracker.oom
            request = info["request"]
            peak = sum(info["live"].values()) + request
            breakdown, ph = info["live"], info["phase"]
        else:
            peak, breakdown, ph = tracker.peak, tracker.peak_breakdown, tracker.peak_phase
        return VirtualRun(self.spec, oom is None, peak, breakdown, tracker.phase_peaks, ph, seconds, oom,
                          tracker, value, request)

    def fits(self, step, *args, **kwargs) -> bool:
        """True if `step` runs within capacity."""
        return self.run(step, *args, catch_oom=True, **kwargs).fits


def _check_gib(name, v, positive):
    number_type(name, v, what="a number of GiB")
    if not math.isfinite(v):
        raise ValueError(f"{name} must be a finite number of GiB, got {v}: for a GPU that never runs out, "
                         f"pass a large finite size such as capacity_gb=4096")
    if (v <= 0) if positive else (v < 0):
        raise ValueError(f"{name} must be {'> 0' if positive else '>= 0'} GiB, got {v}")
