"""Attention's memory: a naive reference, the byte formulas, the KV cache, and
which kernel actually runs.

Notation: B batch, H heads, T_q query length, T_k key length, d head dimension,
e bytes per element of the activations (4 fp32, 2 fp16/bf16).

* `naive_attention` is the textbook softmax(q k^T / sqrt(d)) v with einsum: it
  materialises the (..., T_q, T_k) scores and is the reference other
  implementations are checked against.
* `attention_bytes` predicts the bytes of that matrix and its relatives, and what
  a fused kernel keeps instead; `kv_cache_bytes` the cache of inference.
* `sdpa_backend` / `sdpa_backends` say which kernel F.scaled_dot_product_attention
  picks on the device; `flash_attn_status` / `attention_with_fallback` use the
  optional `flash-attn` package where it can run and say so when it cannot.

Importing this module imports neither flash_attn nor anything heavy.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import warnings
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from .core.dtypes import dtype_bytes
from .core.estimate import llama_param_groups
from .core.validate import flag, one_of, pos_float, pos_int

__all__ = ["naive_attention", "tiled_attention", "attention_bytes", "kv_cache_bytes", "LLAMA_SHAPES",
           "llama_param_count", "SDPAChoice", "sdpa_backend", "sdpa_backends", "flash_attn_status",
           "attention_with_fallback", "dtype_bytes"]

# the activations' dtypes these formulas price (an fp8 attention is not modelled)
_ACT_DTYPES = ("fp32", "float32", "fp16", "float16", "bf16", "bfloat16")


def _act_bytes(dtype) -> int:
    """Bytes per element of an activation dtype: a floating torch.dtype or one of _ACT_DTYPES."""
    if isinstance(dtype, str):
        one_of("dtype", dtype, _ACT_DTYPES, what=f"one of {sorted(_ACT_DTYPES)} or a torch floating dtype")
    return dtype_bytes(dtype)


def _check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have shape (..., T, d), got {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype) or not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share dtype and device, got {q.dtype}/{k.dtype}/{v.dtype} on "
                         f"{q.device}/{k.device}/{v.device}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same last dimension d, got {q.shape[-1]} and {k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"k and v must have the same length T_k (dim -2), got {k.shape[-2]} and {v.shape[-2]}")
    try:
        torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(f"the leading dimensions of q, k, v must broadcast, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}") from None


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False,
                    scale: float | None = None, return_lse: bool = False):
    """softmax(q k^T * scale) v, written out: the reference implementation.

    q: (..., T_q, d), k: (..., T_k, d), v: (..., T_k, d_v) with leading dimensions
    that broadcast; returns (..., T_q, d_v), and with return_lse=True also the
    logsumexp of each query row's scaled (and masked) scores, (..., T_q), in the
    inputs' dtype. scale defaults to 1/sqrt(d) (Vaswani et al. 2017, eq. 1).

    is_causal=True masks key j for query i when j > i: the top-left aligned mask
    of F.scaled_dot_product_attention(is_causal=True), so no row is fully masked.
    (flash-attn >= 2.1 aligns the mask bottom-right when T_q != T_k.)

    Memory: it materialises the (..., T_q, T_k) scores and probabilities (and a
    (T_q, T_k) bool mask when causal); autograd keeps the probabilities for the
    backward pass. See `attention_bytes`.
    """
    _check_qkv(q, k, v)
    flag("is_causal", is_causal)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    else:
        pos_float("scale", scale, what="a positive number or None")
    s = torch.einsum("...id,...jd->...ij", q, k) * scale               # (..., T_q, T_k) scores
    if is_causal:
        t_q, t_k = q.shape[-2], k.shape[-2]
        keep = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril()  # (T_q, T_k): 1 byte each
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)                                       # (..., T_q, T_k), saved for backward
    out = torch.einsum("...ij,...jd->...id", p, v)                     # (..., T_q, d_v)
    if return_lse:
        return out, torch.logsumexp(s, dim=-1)                         # (..., T_q)
    return out


def tiled_attention(q, k, v, block_q=64, block_k=64):
    """Non-causal attention, one (block_q x block_k) tile of scores at a time.

    Outer loop over query blocks, inner loop over key blocks (FlashAttention-2's
    order, Dao 2023, Algorithm 1); each query block keeps a running row maximum m,
    a running sum l of exp(s - m) and an unnormalised output acc (the online
    softmax of Milakov & Gimelshein 2018). Live memory: the output plus one tile,
    O(T d + block_q block_k) per head instead of O(T^2). Forward only: autograd
    through these loops would keep every tile for backward. This is the function
    lesson 05 develops (its cell has the same loop without the input checks;
    tests/test_attention.py runs both on the same inputs).
    """
    _check_qkv(q, k, v)
    pos_int("block_q", block_q)
    pos_int("block_k", block_k)
    scale = q.shape[-1] ** -0.5
    T_q, T_k = q.shape[-2], k.shape[-2]
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)   # (..., T_q, d_v)
    for i in range(0, T_q, block_q):
        qi = q[..., i:i + block_q, :] * scale                          # (..., bq, d)
        m = torch.full(qi.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)  # (..., bq) row max
        l = torch.zeros_like(m)                                        # (..., bq) running sum of exp(s - m)
        acc = torch.zeros(*qi.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)  # (..., bq, d_v)
        for j in range(0, T_k, block_k):
            s = qi @ k[..., j:j + block_k, :].transpose(-1, -2)        # (..., bq, bk): the only score tile
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new.unsqueeze(-1))                     # (..., bq, bk)
            alpha = torch.exp(m - m_new)                               # rescales what was summed so far
            l = alpha * l + p.sum(dim=-1)
            acc = alpha.unsqueeze(-1) * acc + p @ v[..., j:j + block_k, :]
            m = m_new
        out[..., i:i + block_q, :] = acc / l.unsqueeze(-1)
    return out


def attention_bytes(batch: int, heads: int, seq: int, head_dim: int, *, seq_k: int | None = None,
                    dtype="fp32", dropout: bool = False, mask_bytes: int = 1) -> dict[str, int]:
    """Bytes of one attention call's tensors, for B=batch, H=heads, T_q=seq,
    T_k=seq_k (default seq), d=head_dim, e=bytes of dtype. Keys:

      scores         B*H*T_q*T_k*e   q k^T (a temporary: freed once softmax has run)
      probs          B*H*T_q*T_k*e   softmax output, kept for backward
      dropout_mask   B*H*T_q*T_k*mask_bytes (if dropout): 1 on CUDA, where dropout
                     keeps a bool mask (aten.native_dropout); PyTorch's CPU dropout
                     keeps a scaled noise tensor of the activations' dtype instead
                     (pass mask_bytes=e)
      dropout_out    B*H*T_q*T_k*e   the dropped-out probabilities, kept by P@V (if dropout)
      qkv            B*H*(T_q + 2*T_k)*d*e
      out            B*H*T_q*d*e
      lse            B*H*T_q*4       fp32 logsumexp per query row (fused kernels)
      saved_naive    probs + dropout_mask + dropout_out: what the unfused (math)
                     path keeps for backward on top of q, k, v
      saved_fused    out + lse: what FlashAttention keeps on top of q, k, v (its
                     dropout mask is regenerated from the RNG state, not stored)

    Sources: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", sec. 4.1: in 16 bits with dropout the T x T terms are
    2 (softmax) + 1 (mask) + 2 (dropout output) = 5 bytes per element, their
    5*a*s^2*b. Dao et al. 2022, "FlashAttention", sec. 3.1 and Algorithm 2: only O
    and the softmax statistics are stored; Dao 2023, "FlashAttention-2", sec. 3.1.1:
    one logsumexp per row. Exact storage bytes, as memlab's tracker counts them.
    """
    for name, val in (("batch", batch), ("heads", heads), ("seq", seq), ("head_dim", head_dim)):
        pos_int(name, val)
    if seq_k is not None:
        pos_int("seq_k", seq_k)
    flag("dropout", dropout)
    pos_int("mask_bytes", mask_bytes)
    e = _act_bytes(dtype)
    t_k = seq if seq_k is None else seq_k
    n = batch * heads * seq * t_k                     # elements of one (B, H, T_q, T_k) matrix
    d = {"scores": n * e, "probs": n * e, "dropout_mask": n * mask_bytes if dropout else 0,
         "dropout_out": n * e if dropout else 0, "qkv": batch * heads * (seq + 2 * t_k) * head_dim * e,
         "out": batch * heads * seq * head_dim * e, "lse": batch * heads * seq * 4}
    d["saved_naive"] = d["probs"] + d["dropout_mask"] + d["dropout_out"]
    d["saved_fused"] = d["out"] + d["lse"]
    return d


# Shapes of Llama-family decoders. Sources: Touvron et al. 2023, "Llama 2", Table 1
# (GQA only for 34B/70B) and the released config.json files; Dubey et al. 2024, "The
# Llama 3 Herd of Models", Table 3 (8B: 8 key/value heads; Llama 3.1: 128K context).
LLAMA_SHAPES: dict[str, dict[str, int]] = {
    "Llama-2-7B": dict(n_layer=32, n_head=32, n_kv_head=32, head_dim=128, hidden=4096, ffn=11008, vocab=32000),
    "Llama-3-8B": dict(n_layer=32, n_head=32, n_kv_head=8, head_dim=128, hidden=4096, ffn=14336, vocab=128256),
    "Llama-2-70B": dict(n_layer=80, n_head=64, n_kv_head=8, head_dim=128, hidden=8192, ffn=28672, vocab=32000),
}


def llama_param_count(n_layer: int, n_head: int, n_kv_head: int, head_dim: int, hidden: int, ffn: int,
                      vocab: int) -> int:
    """Parameters of a Llama decoder (untied embedding and head, RMSNorm, SwiGLU):
    per layer q and o projections 2*C*H*d, k and v 2*C*H_kv*d, MLP 3*C*F, two norms
    2*C; plus embedding and head 2*V*C and the final norm C. Llama-2-7B: 6,738,415,616.
    The count is `memlab.core.estimate.llama_param_groups` (its "total")."""
    return llama_param_groups(n_layer, n_head, n_kv_head, head_dim, hidden, ffn, vocab)["total"]


def kv_cache_bytes(n_layer: int, n_kv_head: int, head_dim: int, seq: int, batch: int = 1, dtype="bf16") -> int:
    """Bytes of the key/value cache after `seq` tokens: 2 (K and V) * n_layer *
    batch * seq * n_kv_head * head_dim * e. Grouped-query attention (Ainslie et al.
    2023) shares each K/V head among n_head/n_kv_head query heads, so the cache
    shrinks by that factor; multi-query attention (Shazeer 2019) is n_kv_head=1.
    Assumes a contiguous cache of exactly `seq` positions (a paged or
    preallocated cache rounds up to its page or to the maximum length)."""
    for name, val in (("n_layer", n_layer), ("n_kv_head", n_kv_head), ("head_dim", head_dim), ("seq", seq),
                      ("batch", batch)):
        pos_int(name, val)
    return 2 * n_layer * batch * seq * n_kv_head * head_dim * _act_bytes(dtype)


# ----------------------------------------------------------------------------- which kernel runs
_BACKEND_OPS = {  # the ATen op each SDPA backend dispatches to
    "_scaled_dot_product_flash_attention_for_cpu": "flash_attention",
    "_scaled_dot_product_flash_attention": "flash_attention",
    "_scaled_dot_product_efficient_attention": "efficient_attention",
    "_scaled_dot_product_cudnn_attention": "cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable": "overrideable",
}


class SDPAChoice(NamedTuple):
    backend: str    # "flash_attention", "efficient_attention", "cudnn_attention", "math" or "overrideable"
    op: str         # the ATen op that ran, e.g. "aten._scaled_dot_product_flash_attention_for_cpu"


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.name())
        return func(*args, **(kwargs or {}))


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **sdpa_kwargs) -> SDPAChoice:
    """Run F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs) once and report
    which backend PyTorch chose, by watching which ATen op it dispatched to (the
    math backend dispatches plain matmul/softmax ops). Respects an enclosing
    `torch.nn.attention.sdpa_kernel(...)`. Inputs are (B, H, T, d) as for SDPA."""
    _check_qkv(q, k, v)
    rec = _OpNames()
    with torch.no_grad(), rec:
        F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)
    for name in rec.ops:
        base = name.split("::")[-1].split(".")[0]
        if base in _BACKEND_OPS:
            return SDPAChoice(_BACKEND_OPS[base], "aten." + name.split("::")[-1])
    return SDPAChoice("math", "aten ops: " + ", ".join(dict.fromkeys(n.split("::")[-1] for n in rec.ops)))


def sdpa_backends(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **sdpa_kwargs) -> dict[str, str]:
    """For each SDPA backend (math, flash, efficient, cuDNN): 'runs' if
    `sdpa_kernel(<that backend>)` can run these inputs here, else why not (the
    error, and the warnings PyTorch gives with the reasons)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    _check_qkv(q, k, v)
    out = {}
    for b in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
              SDPBackend.CUDNN_ATTENTION):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                with sdpa_kernel(b), torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, **sdpa_kwargs)
                out[b.name.lower()] = "runs"
            except RuntimeError as e:   # on CUDA PyTorch warns why each kernel was refused, one warning per reason
                why = dict.fromkeys(str(w.message).split("(Triggered internally")[0].strip() for w in caught)
                out[b.name.lower()] = "; ".join(w for w in why if w) or str(e).split("\n")[0]
    return out


def flash_attn_status(device: torch.device | str | None = None) -> tuple[bool, str]:
    """(usable, reason): can the optional `flash-attn` package (FlashAttention-2,
    Dao 2023) run on `device`? It needs CUDA with compute capability sm_80 or newer
    (Ampere, Ada, Hopper; a T4 is sm_75: the flash-attn README sends Turing to
    FlashAttention 1.x) and the package installed (`pip install flash-attn`, GPU only)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str, torch.device or None, got {type(device).__name__}")
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False, f"flash-attn runs only on CUDA GPUs; this device is {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return False, f"flash-attn 2 needs sm_80 or newer; this GPU is sm_{major}{minor}"
    if importlib.util.find_spec("flash_attn") is None:
        return False, "the flash-attn package is not installed (pip install flash-attn)"
    try:
        fa = importlib.import_module("flash_attn")
    except Exception as e:          # a wheel built for another torch/CUDA fails at import
        return False, f"flash_attn is installed but does not import: {type(e).__name__}: {e}"
    return True, f"flash-attn {getattr(fa, '__version__', '?')} on sm_{major}{minor}"


def attention_with_fallback(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            is_causal: bool = False) -> tuple[torch.Tensor, str]:
    """Attention on (B, H, T, d) inputs through flash-attn's `flash_attn_func` where
    it can run (CUDA sm_80+, package installed, fp16/bf16, d <= 256), else through
    F.scaled_dot_product_attention. Returns (output, which path ran and why), so the
    fallback is visible. A causal call with T_q != T_k goes to SDPA, because the two
    libraries align that mask differently (see `naive_attention`)."""
    _check_qkv(q, k, v)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (B, H, T, d), got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    ok, why = flash_attn_status(q.device)
    if ok and q.dtype not in (torch.float16, torch.bfloat16):
        ok, why = False, f"flash-attn takes fp16/bf16 only, got {q.dtype}"
    if ok and q.shape[-1] > 256:
        ok, why = False, f"flash-attn supports head_dim <= 256, got {q.shape[-1]}"
    if ok and is_causal and q.shape[-2] != k.shape[-2]:
        ok, why = False, "causal with T_q != T_k: flash-attn aligns the mask bottom-right, SDPA top-left"
    if ok:
        from flash_attn import flash_attn_func       # layout (B, T, H, d)
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=is_causal)
        return out.transpose(1, 2), f"flash-attn ({why})"
    out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    return out, f"SDPA fallback: {why}"
