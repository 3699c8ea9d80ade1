"""Attention's HBM traffic (lesson 05, section 6): the IO complexity of standard attention and FlashAttention
counted exactly (`attention_io`, Dao et al. 2022, sec. 3.2), and `HBMCounter`, which counts the bytes every op
reads and writes, so the counts can be checked on a real loop on any device.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .attention import _act_bytes
from .core.validate import one_of, pos_int

__all__ = ["attention_io", "HBMCounter"]


def attention_io(seq: int, head_dim: int, sram: int | None = None, *, algorithm: str = "flash2",
                 dtype="bf16") -> dict[str, int]:
    """Bytes one attention forward moves between HBM and the chip, per (batch, head), N=seq, d=head_dim, e the
    bytes of dtype, M = sram // e elements of on-chip memory (Dao et al. 2022, "FlashAttention", sec. 3.2).

    "standard" (their Algorithm 0, three kernels; `sram` unused): read Q, K, write S; read S, write P; read P, V,
    write O: 4*N*d + 4*N^2 elements, Theta(N d + N^2).
    "flash1" (their Algorithm 1): key blocks of B_c = ceil(M/(4d)) rows, query blocks of B_r = min(B_c, d), the
    outer loop over the T_c = ceil(N/B_c) key blocks. O, l, m are initialised in HBM (N*d + 2N written); K and V
    are read once; for each key block, every query block reads Q_i, O_i, l_i, m_i and writes O_i, l_i, m_i:
    T_c * (3*N*d + 4*N) more. Theta(N^2 d^2 / M) (their Theorem 2).
    "flash2" (FlashAttention-2's loop order, Dao 2023, Algorithm 1, as `tiled_attention` runs it with
    block_q=B_c, block_k=B_r): the outer loop over T_r = ceil(N/B_c) query blocks reads Q_i once and writes O_i
    once; for each query block K and V are read once: N*d + 2*T_r*N*d + N*d. The running m, l stay on chip
    (FlashAttention-2 also writes one logsumexp per row for the backward, N*4 bytes, not counted here).

    Keys: q, k, v, o, sp (the N x N scores and probabilities), stats (m and l, fp32: 4 bytes each), total;
    block_c, block_r (rows, 0 for "standard") and sram_elements (M). Exact counts of the loops for any N,
    including blocks that do not divide it.
    """
    pos_int("seq", seq)
    pos_int("head_dim", head_dim)
    one_of("algorithm", algorithm, ("standard", "flash1", "flash2"))
    e = _act_bytes(dtype)
    n, d = seq, head_dim
    out = dict(q=n * d * e, k=n * d * e, v=n * d * e, o=n * d * e, sp=0, stats=0, block_c=0, block_r=0,
               sram_elements=0)
    if algorithm == "standard":
        out["sp"] = 4 * n * n * e
    else:
        pos_int("sram", sram, what="a positive int of bytes (required for the flash algorithms)")
        m = sram // e
        if m < 4 * d:
            raise ValueError(f"sram must hold at least 4*head_dim elements ({4 * d * e} bytes), got {sram}")
        b_c = math.ceil(m / (4 * d))
        b_r = min(b_c, d)
        passes = math.ceil(n / b_c)          # T_c (flash1: key blocks) or T_r (flash2: query blocks)
        out.update(block_c=b_c, block_r=b_r, sram_elements=m)
        if algorithm == "flash1":
            out.update(q=passes * n * d * e, o=(1 + 2 * passes) * n * d * e, stats=(2 + 4 * passes) * n * 4)
        else:
            out.update(k=passes * n * d * e, v=passes * n * d * e)
    out["total"] = out["q"] + out["k"] + out["v"] + out["o"] + out["sp"] + out["stats"]
    return out


def _storage_key(t: torch.Tensor):
    return t.untyped_storage()._cdata


def _touched_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor (or view) covers: a broadcast (stride 0) dimension counts once."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


_ALLOC_ONLY = ("empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided")


class HBMCounter(TorchDispatchMode):
    """Count the bytes each ATen op reads and writes, per tensor storage, as if every op were its own kernel
    reading its inputs from and writing its outputs to HBM.

        with HBMCounter() as io:
            out = tiled_attention(q, k, v, 256, 64)
        io.bytes_read(k), io.bytes_written(out)       # what the loops moved to and from these tensors

    An op's tensor arguments count as read (a view: only the elements it covers), its new outputs as written
    (torch.empty writes nothing) and an argument it writes in place (copy_, out=) as written, not read. View ops
    (slicing, transpose, reshape without a copy) move nothing. Counts are per storage, so a slice of q counts
    against q. `total_read` and `total_written` sum every op, temporaries included: for an implementation that
    runs each op as a separate kernel that is its HBM traffic; a fused kernel keeps its temporaries on chip, so
    for it only the counts of its inputs and outputs are HBM traffic. Real (CPU or CUDA) tensors.
    """

    def __init__(self):
        super().__init__()
        self._read: dict[int, int] = {}
        self._written: dict[int, int] = {}
        self.total_read = 0
        self.total_written = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if getattr(func, "is_view", False):
            return result
        dests = set()
        for i, arg in enumerate(func._schema.arguments):
            t = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(t, torch.Tensor) and arg.alias_info is not None and arg.alias_info.is_write:
                dests.add(id(t))
                self._count(self._written, t)
        inputs = set()
        for t in torch.utils._pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                inputs.add(_storage_key(t))
                if id(t) not in dests:
                    self._count(self._read, t)
        for t in torch.utils._pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor) and _storage_key(t) not in inputs:   # a new storage: a new count
                key = _storage_key(t)
                self._read[key] = 0
                self._written[key] = 0
                if func._schema.name.split("::")[-1] not in _ALLOC_ONLY:
                    self._count(self._written, t)
        return result

    def _count(self, book: dict, t: torch.Tensor):
        nbytes = _touched_bytes(t)
        key = _storage_key(t)
        book[key] = book.get(key, 0) + nbytes
        if book is self._read:
            self.total_read += nbytes
        else:
            self.total_written += nbytes

    def _lookup(self, book: dict, tensor) -> int:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor must be a torch.Tensor, got {type(tensor).__name__}")
        return book.get(_storage_key(tensor), 0)

    def bytes_read(self, tensor: torch.Tensor) -> int:
        """Bytes the ops read from `tensor`'s storage (since that storage was created, if inside the block)."""
        return self._lookup(self._read, tensor)

    def bytes_written(self, tensor: torch.Tensor) -> int:
        """Bytes the ops wrote to `tensor`'s storage."""
        return self._lookup(self._written, tensor)
