"""Attention that keeps less than the (B, H, T, T) probabilities: local (sliding window), linear (kernelized) and
low-rank (Linformer-style), beside exact attention (memlab.attention.naive_attention, lesson 05). All are
non-causal and take q, k, v of shape (B, H, T, d).

  exact      softmax(q k^T / sqrt(d)) v                        keeps P: B*H*T*T values per layer
  local      each block of `window` queries attends to its own block and the two next to it (Longformer's
             sliding window, Beltagy et al. 2020, in BigBird's blocked form, Zaheer et al. 2020)
                                                               keeps B*H*T*3*window probabilities
  linear     phi(q) (phi(k)^T v) / (phi(q) phi(k)^T 1), phi = elu + 1 (Katharopoulos et al. 2020, "Transformers
             are RNNs"): no T x T matrix at all; a (d, d) state per head (the causal form needs a running state
             per position, O(T d^2) if kept for backward)
  low-rank   keys and values projected along the sequence to r rows by learned (r, T) matrices E and F
             (Wang et al. 2020, "Linformer"): scores (B, H, T, r), so B*H*T*r probabilities

The seed's "low-rank approximation reduces the d^2 term" is not what Linformer does: it reduces the T^2 term
to T*r; the T*d^2 terms (the projections' weights and FLOPs) are untouched.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention import naive_attention
from ..core.validate import one_of, pos_int

__all__ = ["local_attention", "linear_attention", "lowrank_attention", "KINDS", "ToyAttentionModel",
           "reversal_batch"]

KINDS = ("exact", "local", "linear", "lowrank")


def _check(q, k, v):
    for nm, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise TypeError(f"{nm} must be a (B, H, T, d) torch.Tensor, got {getattr(t, 'shape', type(t).__name__)}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")


def local_attention(q, k, v, window: int):
    """Blocked sliding-window attention: T is cut into blocks of `window` positions (T must be a multiple), and
    the queries of block i see the keys of blocks i-1, i and i+1 (zero padding masked out at the ends)."""
    _check(q, k, v)
    pos_int("window", window)
    B, H, T, d = q.shape
    if T % window:
        raise ValueError(f"window must divide the sequence length T={T}, got {window}")
    n = T // window
    qb = q.reshape(B, H, n, window, d)                                    # (B, H, n, w, d)

    def neighbours(x):                                                    # (B, H, n, 3w, d): blocks i-1, i, i+1
        xp = F.pad(x.reshape(B, H, n, window, d), (0, 0, 0, 0, 1, 1))
        return torch.cat([xp[:, :, :-2], xp[:, :, 1:-1], xp[:, :, 2:]], dim=3)

    s = torch.einsum("bhnid,bhnjd->bhnij", qb, neighbours(k)) / math.sqrt(d)    # (B, H, n, w, 3w)
    block = torch.arange(n, device=q.device).view(n, 1)
    side = torch.arange(3 * window, device=q.device).view(1, -1) // window      # 0: left, 1: own, 2: right
    pad = ((block == 0) & (side == 0)) | ((block == n - 1) & (side == 2))       # (n, 3w) padding keys
    s = s.masked_fill(pad.view(1, 1, n, 1, 3 * window), float("-inf"))
    p = torch.softmax(s, dim=-1)                                          # kept: B*H*T*3w values
    return torch.einsum("bhnij,bhnjd->bhnid", p, neighbours(v)).reshape(B, H, T, d)


def linear_attention(q, k, v, eps: float = 1e-6):
    """Kernelized attention with phi(x) = elu(x) + 1 (Katharopoulos et al. 2020), non-causal."""
    _check(q, k, v)
    qf, kf = F.elu(q) + 1, F.elu(k) + 1                                   # (B, H, T, d), positive features
    kv = torch.einsum("bhtd,bhte->bhde", kf, v)                           # (B, H, d, d): the whole "memory"
    norm = torch.einsum("bhtd,bhd->bht", qf, kf.sum(dim=2)) + eps         # (B, H, T)
    return torch.einsum("bhtd,bhde->bhte", qf, kv) / norm.unsqueeze(-1)


def lowrank_attention(q, k, v, proj_k: torch.Tensor, proj_v: torch.Tensor):
    """Linformer attention: k and v projected along the sequence by proj_k, proj_v of shape (r, T)."""
    _check(q, k, v)
    T = q.shape[2]
    for nm, p in (("proj_k", proj_k), ("proj_v", proj_v)):
        if not isinstance(p, torch.Tensor) or p.dim() != 2 or p.shape[1] != T:
            raise ValueError(f"{nm} must be an (r, T={T}) tensor, got {getattr(p, 'shape', type(p).__name__)}")
    kr = torch.einsum("rt,bhtd->bhrd", proj_k, k)                         # (B, H, r, d)
    vr = torch.einsum("rt,bhtd->bhrd", proj_v, v)
    s = torch.einsum("bhtd,bhrd->bhtr", q, kr) / math.sqrt(q.shape[-1])   # (B, H, T, r)
    return torch.einsum("bhtr,bhrd->bhtd", torch.softmax(s, dim=-1), vr)


class ToyAttentionModel(nn.Module):
    """Token + learned position embeddings, one multi-head attention layer of the chosen `kind`, a linear head:
    logits (B, T, vocab) for a sequence-to-sequence toy task. `window` is for "local", `rank` for "lowrank"."""

    def __init__(self, kind: str = "exact", vocab: int = 16, seq: int = 32, d_model: int = 64, heads: int = 2,
                 window: int = 4, rank: int = 8):
        super().__init__()
        one_of("kind", kind, KINDS)
        for nm, val in (("vocab", vocab), ("seq", seq), ("d_model", d_model), ("heads", heads), ("window", window),
                        ("rank", rank)):
            pos_int(nm, val)
        if d_model % heads:
            raise ValueError(f"heads must divide d_model={d_model}, got {heads}")
        self.kind, self.heads, self.window = kind, heads, window
        self.tok, self.pos = nn.Embedding(vocab, d_model), nn.Parameter(torch.randn(seq, d_model) * 0.1)
        self.qkv, self.out = nn.Linear(d_model, 3 * d_model), nn.Linear(d_model, d_model)
        self.head = nn.Linear(d_model, vocab)
        if kind == "lowrank":
            self.proj_k = nn.Parameter(torch.randn(rank, seq) / math.sqrt(seq))
            self.proj_v = nn.Parameter(torch.randn(rank, seq) / math.sqrt(seq))

    def attend(self, q, k, v):
        if self.kind == "exact":
            return naive_attention(q, k, v)
        if self.kind == "local":
            return local_attention(q, k, v, self.window)
        if self.kind == "linear":
            return linear_attention(q, k, v)
        return lowrank_attention(q, k, v, self.proj_k, self.proj_v)

    def forward(self, idx):
        B, T = idx.shape
        x = self.tok(idx) + self.pos[:T]                                  # (B, T, C)
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)   # each (B, H, T, C/H)
        y = self.attend(q, k, v).transpose(1, 2).reshape(B, T, -1)
        return self.head(x + self.out(y))                                 # (B, T, vocab)


def reversal_batch(batch: int, seq: int, vocab: int, generator: torch.Generator | None = None):
    """(inputs, targets) of the reversal task: targets[:, i] = inputs[:, seq - 1 - i]. Every output needs one
    token at the mirror position, near for the middle of the sequence and far at its ends."""
    for nm, val in (("batch", batch), ("seq", seq), ("vocab", vocab)):
        pos_int(nm, val)
    x = torch.randint(0, vocab, (batch, seq), generator=generator)
    return x, x.flip(1)
