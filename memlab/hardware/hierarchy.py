"""Where bytes live and how fast they move: GPU data-sheet figures, the FLOPs and
bytes of common ops, arithmetic intensity and the roofline.

The roofline model (Williams, Waterman and Patterson, "Roofline: an insightful
visual performance model for multicore architectures", CACM 52(4), 2009): an
op that does F floating-point operations and moves Q bytes between DRAM and
the chip has arithmetic intensity I = F / Q (FLOP/byte) and can run at most at

    attainable FLOP/s = min(peak FLOP/s, I x DRAM bandwidth)

It is memory-bound when I < ridge = peak / bandwidth, compute-bound otherwise.

Bytes moved, everywhere in this module, are the *minimum* DRAM traffic of the op
run as one kernel: every input read once and every output written once (a
perfect cache inside the op, nothing kept on chip between ops). Real kernels
move at least this much, so the attainable rate is an upper bound.

The data-sheet table lives in `memlab.core.gpus` and measuring (timing, copy
bandwidth, matmul FLOP/s) in `memlab.hardware.timing`; their names are re-exported here
so `memlab.hardware.hierarchy` is the one place to import from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.gpus import GPU_SPECS, GPUDataSheet, gpu_spec, match_gpu_spec, pcie_bandwidth
from ..core.dtypes import dtype_bytes
from ..core.validate import flag, int_at_least, is_int, number_type, pos_float, pos_int
from .timing import (Timing, copy_bandwidth, cpu_cache_sizes, matmul_throughput, read_bandwidth, synchronize,
                     time_fn, transfer_bandwidth)

__all__ = ["GPUDataSheet", "GPU_SPECS", "gpu_spec", "match_gpu_spec", "pcie_bandwidth", "dtype_bytes", "OpCost",
           "matmul_cost", "elementwise_cost", "softmax_cost", "layer_norm_cost", "attention_cost",
           "MeasuredRoof", "peak_flops", "ridge_point", "Roofline", "roofline",
           "Timing", "time_fn", "synchronize", "copy_bandwidth", "read_bandwidth", "matmul_throughput",
           "transfer_bandwidth", "cpu_cache_sizes"]

# ----------------------------------------------------------------------------- FLOPs and bytes
_TORCH_NAME = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64"}


def _shape(name, shape, min_dims=1):
    if isinstance(shape, torch.Size):
        shape = tuple(shape)
    if not isinstance(shape, (tuple, list)) or len(shape) < min_dims or not all(is_int(s) and s >= 1 for s in shape):
        raise ValueError(f"{name} must be a tuple of >= {min_dims} positive ints, got {shape!r}")
    return tuple(shape)


@dataclass(frozen=True)
class OpCost:
    """FLOPs and minimum DRAM bytes of one op."""
    name: str
    flops: int
    bytes: int

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOP/byte."""
        return self.flops / self.bytes


def matmul_cost(a_shape, b_shape, dtype: torch.dtype | str = "fp32") -> OpCost:
    """`a @ b` with a: (..., M, K), b: (..., K, N); leading dims broadcast.

    FLOPs = 2*M*N*K per matrix (K multiplies and K adds for each of the M*N
    outputs; the usual convention, e.g. Kaplan et al. 2020's 2N FLOPs per token).
    Bytes = (a + b + out) * itemsize, each tensor once: a weight shared by
    every batch entry (b of shape (K, N)) is read once.
    """
    a, b = _shape("a_shape", a_shape, 2), _shape("b_shape", b_shape, 2)
    (m, k), (k2, n) = a[-2:], b[-2:]
    if k != k2:
        raise ValueError(f"inner dimensions differ: a_shape {a} has K={k}, b_shape {b} has K={k2}")
    try:
        batch = math.prod(torch.broadcast_shapes(a[:-2], b[:-2]))
    except RuntimeError as e:
        raise ValueError(f"leading dims of a_shape {a} and b_shape {b} do not broadcast") from e
    nb = dtype_bytes(dtype)
    return OpCost("matmul", 2 * batch * m * n * k, nb * (math.prod(a) + math.prod(b) + batch * m * n))


def elementwise_cost(shape, dtype: torch.dtype | str = "fp32", n_inputs: int = 1,
                     flops_per_element: int = 1) -> OpCost:
    """An elementwise op on `n_inputs` tensors of `shape` (no broadcasting) with one
    output: FLOPs = flops_per_element * numel, bytes = (n_inputs + 1) * numel * itemsize.
    relu/scale: 1 input; add/mul: 2 inputs."""
    s = _shape("shape", shape)
    pos_int("n_inputs", n_inputs)
    int_at_least("flops_per_element", flops_per_element, 0)
    n = math.prod(s)
    return OpCost("elementwise", flops_per_element * n, (n_inputs + 1) * n * dtype_bytes(dtype))


def softmax_cost(shape, dtype: torch.dtype | str = "fp32") -> OpCost:
    """Softmax over the last dim: 5 FLOPs per element (max, subtract, exp, sum,
    divide; exp counted as one), bytes = read x + write y = 2 * numel * itemsize."""
    s = _shape("shape", shape)
    n = math.prod(s)
    return OpCost("softmax", 5 * n, 2 * n * dtype_bytes(dtype))


def layer_norm_cost(shape, dtype: torch.dtype | str = "fp32", affine: bool = True) -> OpCost:
    """LayerNorm over the last dim C (Ba, Kiros and Hinton 2016): per element 5 FLOPs
    (sum for the mean, subtract, square, sum for the variance, scale by 1/std) plus
    2 for the affine weight and bias; per-row scalars (divide by C, rsqrt) ignored.
    Bytes = read x + write y (+ weight and bias, C each) times itemsize."""
    s = _shape("shape", shape)
    flag("affine", affine)
    n, c = math.prod(s), s[-1]
    return OpCost("layer_norm", (7 if affine else 5) * n, (2 * n + (2 * c if affine else 0)) * dtype_bytes(dtype))


def attention_cost(batch: int, heads: int, seq: int, head_dim: int, dtype: torch.dtype | str = "fp16",
                   fused: bool = False) -> OpCost:
    """softmax(Q K^T / sqrt(d)) V for Q, K, V, O of shape (batch, heads, seq, head_dim); no mask.

    FLOPs = 2*B*H*T*T*d (Q K^T) + 5*B*H*T*T (softmax) + 2*B*H*T*T*d (P V);
    the 1/sqrt(d) scale, folded into Q, is ignored.
    Bytes, fused=False (three kernels, the T x T matrix goes through DRAM):
      read Q, K, write S; read S, write P; read P, V, write O
      = (4*B*H*T*d + 4*B*H*T*T) * itemsize.
    Bytes, fused=True (one kernel keeps S and P on chip, as FlashAttention does,
    Dao et al. 2022): read Q, K, V, write O = 4*B*H*T*d * itemsize.
    """
    for nm, v in (("batch", batch), ("heads", heads), ("seq", seq), ("head_dim", head_dim)):
        pos_int(nm, v)
    flag("fused", fused)
    bh, t, d, nb = batch * heads, seq, head_dim, dtype_bytes(dtype)
    flops = 4 * bh * t * t * d + 5 * bh * t * t
    moved = 4 * bh * t * d + (0 if fused else 4 * bh * t * t)
    return OpCost("attention (fused)" if fused else "attention", flops, moved * nb)


# ----------------------------------------------------------------------------- the roofline
@dataclass(frozen=True)
class MeasuredRoof:
    """A roof you measured yourself (this CPU, your GPU): best FLOP/s and bytes/s."""
    name: str
    peak_flops: float
    bandwidth: float

    def __post_init__(self):
        for nm in ("peak_flops", "bandwidth"):
            v = getattr(self, nm)
            pos_float(nm, v, finite=True)


def peak_flops(spec: str | GPUDataSheet, tensor_cores: bool = False, dtype: torch.dtype | str = "fp32") -> float:
    """The data-sheet FLOP/s ceiling for work of `dtype`.

    tensor_cores=False: the FP32 CUDA-core peak, the non-tensor figure every data
      sheet lists; used for every dtype (elementwise ops, reductions, a matmul
      that does not use tensor cores).
    tensor_cores=True: fp32 -> TF32 tensor cores (fp32 matmuls use them only when
      allowed: torch.backends.cuda.matmul.allow_tf32, False by default in PyTorch),
      fp16 -> FP16 tensor cores, bf16 -> BF16 tensor cores. Raises ValueError if
      the GPU has none for that dtype (a T4 has no TF32 and no BF16 tensor cores).
    """
    s = gpu_spec(spec)
    flag("tensor_cores", tensor_cores)
    name = _TORCH_NAME.get(dtype, dtype) if isinstance(dtype, torch.dtype) else dtype
    if name not in ("fp32", "tf32", "fp16", "bf16"):
        raise ValueError(f"dtype must be fp32, tf32, fp16 or bf16 (str or torch.dtype), got {dtype!r}")
    if not tensor_cores:
        return s.fp32
    value = {"fp32": s.tf32_tensor, "tf32": s.tf32_tensor, "fp16": s.fp16_tensor, "bf16": s.bf16_tensor}[name]
    if value is None:
        raise ValueError(f"{s.name} has no {'TF32' if name in ('fp32', 'tf32') else 'BF16'} tensor cores; "
                         f"use tensor_cores=False or another dtype")
    return value


def ridge_point(spec: str | GPUDataSheet | MeasuredRoof, tensor_cores: bool = False,
                dtype: torch.dtype | str = "fp32") -> float:
    """FLOP/byte at which the bandwidth roof meets the compute roof: peak / bandwidth."""
    if isinstance(spec, MeasuredRoof):
        return spec.peak_flops / spec.bandwidth
    return peak_flops(spec, tensor_cores, dtype) / gpu_spec(spec).dram_bandwidth


@dataclass(frozen=True)
class Roofline:
    """Where one op sits on one machine's roofline."""
    flops: float
    bytes: float
    intensity: float        # FLOP/byte
    peak_flops: float       # the compute roof used, FLOP/s
    bandwidth: float        # the memory roof used, bytes/s
    ridge: float            # FLOP/byte
    attainable: float       # FLOP/s: min(peak, intensity * bandwidth)
    bound: str              # "memory-bound" or "compute-bound"

    @property
    def time_s(self) -> float:
        """Lower bound on the op's time: max(flops / peak, bytes / bandwidth)."""
        return max(self.flops / self.peak_flops, self.bytes / self.bandwidth)


def _num(name, v, positive):
    number_type(name, v)
    if not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{name} must be a finite number {'> 0' if positive else '>= 0'}, got {v!r}")


def roofline(flops: float, nbytes: float, spec: str | GPUDataSheet | MeasuredRoof, tensor_cores: bool = False,
             dtype: torch.dtype | str = "fp32") -> Roofline:
    """Attainable FLOP/s of an op doing `flops` FLOPs and moving `nbytes` DRAM bytes.

    memory-bound if intensity < ridge, else compute-bound (at the ridge both
    roofs give the same rate; we call it compute-bound). `tensor_cores` and
    `dtype` pick the compute roof of a data sheet (see `peak_flops`); a
    MeasuredRoof carries its own roofs and ignores them.
    """
    _num("flops", flops, positive=False)
    _num("nbytes", nbytes, positive=True)
    if isinstance(spec, MeasuredRoof):
        peak, bw = spec.peak_flops, spec.bandwidth
    else:
        peak, bw = peak_flops(spec, tensor_cores, dtype), gpu_spec(spec).dram_bandwidth
    intensity, ridge = flops / nbytes, peak / bw
    attainable = min(peak, intensity * bw)
    return Roofline(flops, nbytes, intensity, peak, bw, ridge, attainable,
                    "memory-bound" if intensity < ridge else "compute-bound")
