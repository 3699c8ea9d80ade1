"""Exercise 05's references: naive ones. `torch.softmax` for the online softmax (in the judge), and a plain
einsum attention with the whole T_q x T_k matrix, differentiated by autograd, for the tiled forward, its
logsumexp and its gradients."""

from __future__ import annotations

import memlab


def naive_attention(q, k, v, is_causal=False):
    """The reference: memlab's einsum attention with the whole (..., T_q, T_k) matrix; (out, lse (..., T_q))."""
    return memlab.naive_attention(q, k, v, is_causal=is_causal, return_lse=True)

