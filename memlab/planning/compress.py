"""Top-k compression of saved activations: keep the k = frac * n largest-magnitude values of each tensor autograd
saves, with their positions, and rebuild a dense tensor (zeros elsewhere) when the backward pass needs it.

Bytes of a packed tensor of n values (`topk_bytes`):

    values    k * value_bytes            (4 for fp32, 2 for bf16)
    indices   k * index_bytes            (8: torch.topk returns int64; 4 after a cast to int32, enough below 2^31;
                                          2 with int16 offsets inside blocks of at most 32768 values)
    or a bitmap of n bits instead of the indices: n / 8 bytes

So the seed's "10x for k = 10%" counts the values only: 0.1 * (4 + 4) = 0.8 bytes per value is 5x for fp32
values with int32 indices, 0.1 * (4 + 8) = 1.2 bytes is 3.3x with torch.topk's int64 indices.

`TopKSavedActivations(model, frac)` is a saved_tensors_hooks context like lesson 02's int8 one, with the same
rules for what it leaves alone: the model's parameters (and views of them), integer tensors, and small tensors
(fewer than 4096 values). Lesson 02 packs into int8 codes with one fp32 scale per 64 values: 1.0625 bytes per
value (memlab.quant.absmax_roundtrip(x, 8, 64) is the same quantizer, for its error).
"""

from __future__ import annotations

import collections
import itertools
from typing import NamedTuple

import torch

from ..core.validate import flag, int_at_least, one_of, pos_int

__all__ = ["TopK", "topk_pack", "topk_unpack", "topk_bytes", "TopKSavedActivations"]

_INDEX = {torch.int64: 8, torch.int32: 4, torch.int16: 2}


class TopK(NamedTuple):
    """A packed tensor: the kept values, their flat positions, and the original shape and dtype."""
    values: torch.Tensor
    indices: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.indices.nbytes


def _frac(frac) -> float:
    if not isinstance(frac, (int, float)) or isinstance(frac, bool) or not 0 < frac <= 1:
        raise ValueError(f"frac must be a number in (0, 1], got {frac!r}")
    return frac


def _k(numel: int, frac: float) -> int:
    """ceil(frac * numel), without float noise (0.7 * 10 is 7.000000000000001 in floats)."""
    return -(-round(frac * numel * 1_000_000) // 1_000_000)


def topk_bytes(numel: int, frac: float, value_bytes: int = 4, index_bytes: int = 4, bitmap: bool = False) -> int:
    """Bytes of k = ceil(frac * numel) values and their positions (index_bytes each, or an n-bit bitmap)."""
    pos_int("numel", numel)
    _frac(frac)
    pos_int("value_bytes", value_bytes)
    pos_int("index_bytes", index_bytes)
    flag("bitmap", bitmap)
    k = _k(numel, frac)
    return k * value_bytes + (-(-numel // 8) if bitmap else k * index_bytes)


def topk_pack(t: torch.Tensor, frac: float, index_dtype: torch.dtype = torch.int32) -> TopK:
    """Keep the ceil(frac * n) entries of largest |t| (ties: torch.topk's choice) and their flat indices,
    cast to `index_dtype` (torch.int64 as torch.topk returns them, int32, or int16 for n <= 32768)."""
    if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.numel() == 0:
        raise TypeError(f"t must be a non-empty floating-point torch.Tensor, got {getattr(t, 'dtype', type(t))}")
    _frac(frac)
    one_of("index_dtype", index_dtype, tuple(_INDEX))
    n = t.numel()
    if n > torch.iinfo(index_dtype).max + 1:
        raise ValueError(f"index_dtype {index_dtype} cannot address {n} values")
    k = _k(n, frac)
    flat = t.detach().reshape(-1)
    idx = flat.abs().topk(k, sorted=False).indices                      # (k,) int64
    return TopK(flat[idx], idx.to(index_dtype), t.shape, t.dtype)


def topk_unpack(packed: TopK) -> torch.Tensor:
    """A dense tensor of the original shape and dtype: the kept values in place, zeros elsewhere."""
    if not isinstance(packed, TopK):
        raise TypeError(f"packed must be what topk_pack returned (a TopK), got {type(packed).__name__}")
    out = torch.zeros(packed.shape.numel(), dtype=packed.dtype, device=packed.values.device)
    out[packed.indices.long()] = packed.values
    return out.view(packed.shape)


class TopKSavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """`with TopKSavedActivations(model, frac):` every float tensor autograd saves (not a parameter or a view of
    one, at least `min_numel` values) is stored as its top-k values and indices and rebuilt with zeros in the
    backward pass. `tally` adds up the bytes the hook saw: "packed (bytes in)", "top-k values + indices (out)",
    and what it left alone ("parameter", "integer", "small")."""

    def __init__(self, model: torch.nn.Module, frac: float, index_dtype: torch.dtype = torch.int32,
                 min_numel: int = 4096):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        _k(1, _frac(frac))
        one_of("index_dtype", index_dtype, tuple(_INDEX))
        int_at_least("min_numel", min_numel, 1)
        tensors = itertools.chain(model.parameters(), model.buffers())
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in tensors}
        self.frac, self.index_dtype, self.min_numel = frac, index_dtype, min_numel
        self.tally: collections.Counter = collections.Counter()
        super().__init__(self.pack, self.unpack)

    def __enter__(self):
        super().__enter__()
        return self

    def _keep(self, t):
        if t.untyped_storage().data_ptr() in self.param_ptrs:
            return "parameter"                     # the model holds it anyway (W.t() is a view of W)
        if not t.is_floating_point():
            return "integer"
        if t.numel() < self.min_numel or t.numel() > torch.iinfo(self.index_dtype).max + 1:
            return "small"
        return None

    def pack(self, t):
        reason = self._keep(t)
        self.tally[reason or "packed (bytes in)"] += t.numel() * t.element_size()
        if reason:
            return t
        packed = topk_pack(t, self.frac, self.index_dtype)
        self.tally["top-k values + indices (out)"] += packed.nbytes
        return packed

    @staticmethod
    def unpack(packed):
        return packed if isinstance(packed, torch.Tensor) else topk_unpack(packed)
