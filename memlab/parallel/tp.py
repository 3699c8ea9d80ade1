"""Tensor and sequence parallelism, the idea: a transformer block written to be split (Megatron-LM's layout),
the plan that splits it with PyTorch's `parallelize_module`, and the formulas for what each rank holds and sends.

Notation (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec. 4):
s sequence length, b micro-batch, h hidden size, a attention heads, f MLP width (4h in their model), t the
tensor-parallel size, e bytes per activation element (2 in their 16-bit accounting).

Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", Sec. 3, Fig. 3): the first Linear of the MLP and the
q/k/v projections are split by output columns (`ColwiseParallel`), the second MLP Linear and the attention output
projection by input rows (`RowwiseParallel`): each pair needs one all-reduce of the (b, s, h) output in the
forward pass and one of the input gradient in the backward pass. Heads are split too: a rank runs a/t heads.
Sequence parallelism (Korthikanti et al., Sec. 4.2.2) also splits the LayerNorm/dropout region along the
sequence: each all-reduce becomes a reduce-scatter after the row-parallel Linear and an all-gather before the
column-parallel one (the same bytes on the wire with ring algorithms).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.validate import flag, one_of, pos_int

__all__ = ["Attention", "FeedForward", "Block", "tp_plan", "block_param_counts", "tp_param_bytes",
           "kv_head_split", "layer_activation_bytes", "korthikanti_layer_bytes", "tp_comm_per_layer"]


# ----------------------------------------------------------------------------- a block written to be split
class Attention(nn.Module):
    """Causal self-attention with separate q, k, v, o projections. The number of heads is read from the width
    of q, so the same code runs whole (h/hd heads) or on a rank that holds a/t of them after ColwiseParallel."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        pos_int("d", d)
        pos_int("heads", heads)
        if d % heads:
            raise ValueError(f"d ({d}) must be divisible by heads ({heads})")
        self.head_dim = d // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):                                   # x (b, s, h), whole on every rank
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        att = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5             # (b, a/t, s, s)
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()  # (s, s): 1 byte each
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)           # kept for backward
        y = (att @ v).transpose(1, 2).reshape(b, s, -1)                     # (b, s, h/t)
        return self.wo(y)                                                   # (b, s, h): partial sums under TP


class FeedForward(nn.Module):
    """h -> f -> h with GELU (GPT-2's MLP)."""

    def __init__(self, d: int, f: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))                               # (b, s, f/t) inside under TP


class Block(nn.Module):
    """Pre-norm transformer block, x + attn(ln1(x)), then x + mlp(ln2(x)): GPT-2's block with q, k, v kept
    apart so that `parallelize_module` can split each by columns."""

    def __init__(self, d: int = 128, heads: int = 4, f: int | None = None):
        super().__init__()
        f = 4 * d if f is None else pos_int("f", f)
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads)
        self.ln2, self.mlp = nn.LayerNorm(d), FeedForward(d, f)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def tp_plan(sequence_parallel: bool = False) -> dict:
    """The `parallelize_module` plan for `Block`: Megatron's column/row pairs, optionally with sequence
    parallelism (LayerNorms on sequence shards, all-gather into the attention and the MLP, reduce-scatter out).
    PrepareModuleInput hands the attention one replicated DTensor, so q, k and v share one all-gather (one
    input-gradient all-reduce in backward) instead of one each."""
    flag("sequence_parallel", sequence_parallel)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)
    into = (Shard(1),) if sequence_parallel else (Replicate(),)
    out = Shard(1) if sequence_parallel else Replicate()
    plan = {"attn": PrepareModuleInput(input_layouts=into, desired_input_layouts=(Replicate(),)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=out),
            "mlp": PrepareModuleInput(input_layouts=into, desired_input_layouts=(Replicate(),)),
            "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=out)}
    if sequence_parallel:
        plan.update(ln1=SequenceParallel(), ln2=SequenceParallel())
    return plan


# ----------------------------------------------------------------------------- parameters
def block_param_counts(d: int, f: int | None = None) -> dict[str, int]:
    """Parameters of `Block(d, heads, f)` by how tensor parallelism treats them: "sharded" (q, k, v and up:
    weights and biases split by output; o and down: weights split by input) and "replicated" (both LayerNorms'
    weights and biases, and the biases of o and down, which are added after the all-reduce)."""
    pos_int("d", d)
    f = 4 * d if f is None else pos_int("f", f)
    sharded = 3 * (d * d + d) + d * d + (d * f + f) + f * d
    replicated = 2 * 2 * d + 2 * d
    return {"sharded": sharded, "replicated": replicated, "total": sharded + replicated}


def tp_param_bytes(d: int, f: int | None = None, t: int = 1, bytes_per_param: int = 4) -> int:
    """Bytes of one `Block`'s parameters on one of t tensor-parallel ranks: sharded / t + replicated."""
    pos_int("t", t)
    pos_int("bytes_per_param", bytes_per_param)
    c = block_param_counts(d, f)
    if c["sharded"] % t:
        raise ValueError(f"t ({t}) must divide the block's widths evenly")
    return bytes_per_param * (c["sharded"] // t + c["replicated"])


def kv_head_split(kv_heads: int, t: int) -> dict[str, int]:
    """How t tensor-parallel ranks share the key/value heads of grouped-query attention. Each rank needs whole
    k/v heads for its query heads. t divides kv_heads: each rank keeps kv_heads/t of them, one copy of each
    (Megatron-LM requires this: `divide(config.num_query_groups, world_size)` in
    megatron/core/transformer/attention.py). kv_heads divides t: each rank keeps one, and every head is
    replicated on t/kv_heads ranks (vLLM's `QKVParallelLinear`, num_kv_head_replicas). Returns
    {"per_rank", "replicas"}; any other t raises ValueError."""
    pos_int("kv_heads", kv_heads)
    pos_int("t", t)
    if kv_heads % t == 0:
        return {"per_rank": kv_heads // t, "replicas": 1}
    if t % kv_heads == 0:
        return {"per_rank": 1, "replicas": t // kv_heads}
    raise ValueError(f"t ({t}) must divide kv_heads ({kv_heads}) or be a multiple of it")


# ----------------------------------------------------------------------------- activations
def _terms(s, b, h, a, f, kv, mlp, e, dropout, mask_bytes, attn, impl):
    """(name, bytes, split) of what one layer keeps for backward; split: 'tp' (divided by t under tensor
    parallelism), 'sp' (divided by t only with sequence parallelism), 'gather' (an all-gathered input: divided
    by t with Megatron's sequence parallelism, which keeps the shard and gathers again in backward; whole with
    PyTorch's, whose Linear keeps the gathered tensor), 'none' (never divided)."""
    sbh, hkv = s * b * h, h // a * kv                     # hkv: width of k and of v (grouped-query attention)
    t = [("ln1 input", e * sbh, "sp"), ("qkv input (ln1 output)", e * sbh, "gather"),
         ("q", e * sbh, "tp"), ("k", e * s * b * hkv, "tp"), ("v", e * s * b * hkv, "tp")]
    if attn == "math":
        t.append(("softmax output", e * a * s * s * b, "tp"))
        if dropout:
            t += [("attention dropout mask", mask_bytes * a * s * s * b, "tp"),
                  ("attention dropout output", e * a * s * s * b, "tp")]
    else:                                                  # fused kernel: one fp32 logsumexp per row
        t.append(("logsumexp", 4 * a * s * b, "tp"))
    t.append(("output projection input", e * sbh, "tp"))
    if dropout:
        t.append(("attention-out dropout mask", mask_bytes * sbh, "sp"))
    t += [("ln2 input", e * sbh, "sp"), ("mlp input (ln2 output)", e * sbh, "gather")]
    if mlp == "gelu":
        t += [("gelu input", e * s * b * f, "tp"), ("down input (gelu output)", e * s * b * f, "tp")]
    else:                                                  # SwiGLU: silu(gate(x)) * up(x)
        t += [("gate output (silu input)", e * s * b * f, "tp"), ("silu output", e * s * b * f, "tp"),
              ("up output", e * s * b * f, "tp"), ("down input (product)", e * s * b * f, "tp")]
    if dropout:
        t.append(("mlp-out dropout mask", mask_bytes * sbh, "sp"))
    if impl == "pytorch":                                  # what eager PyTorch keeps besides the paper's terms
        t += [("layernorm mean and rstd (fp32)", 2 * 2 * 4 * s * b, "sp")]
        if attn == "math":
            t.append(("causal mask (bool)", s * s, "none"))
    return t


def layer_activation_bytes(s: int, b: int, h: int, a: int, *, f: int | None = None, kv_heads: int | None = None,
                           mlp: str = "gelu", t: int = 1,
                           sequence_parallel: bool = False, e: int = 2, dropout: bool = True, mask_bytes: int = 1,
                           attn: str = "math", impl: str = "megatron", terms: bool = False):
    """Bytes one transformer layer keeps for backward on one of t tensor-parallel ranks.

    impl="megatron", e=2, dropout, attn="math", f=4h is Korthikanti et al. 2022, Sec. 4: s*b*h*(34 + 5*a*s/h)
    with t=1 (Eq. 1), s*b*h*(10 + 24/t + 5*a*s/(h*t)) with tensor parallelism, s*b*h/t*(34 + 5*a*s/h) with
    tensor and sequence parallelism (Sec. 4.2.2). impl="pytorch" is what eager PyTorch keeps for `Block`: the
    LayerNorms' fp32 mean and rstd, the (s, s) bool causal mask, and, with `SequenceParallel`, the all-gathered
    inputs of the column-parallel Linears (whole, not 1/t). attn="flash": a fused kernel keeps a logsumexp per
    row instead of the (s, s) matrices. kv_heads < a: grouped-query attention (narrower k and v); mlp="swiglu":
    Llama's MLP, silu(gate(x)) * up(x), which keeps four (s, b, f) tensors instead of GELU's two.
    terms=True returns {term: bytes on this rank} instead of the total.
    """
    for n, v in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t), ("e", e), ("mask_bytes", mask_bytes)):
        pos_int(n, v)
    f = 4 * h if f is None else pos_int("f", f)
    kv = a if kv_heads is None else pos_int("kv_heads", kv_heads)
    one_of("mlp", mlp, ("gelu", "swiglu"))
    flag("sequence_parallel", sequence_parallel)
    flag("dropout", dropout)
    flag("terms", terms)
    one_of("attn", attn, ("math", "flash"))
    one_of("impl", impl, ("megatron", "pytorch"))
    if h % a or a % kv or a % t or kv % t or f % t or (sequence_parallel and s % t):
        raise ValueError(f"t ({t}) must divide the heads a ({a}), kv_heads ({kv}), f ({f}) and, with sequence "
                         f"parallelism, s ({s}); h ({h}) must divide by a and a by kv_heads")
    out = {}
    for name, nbytes, split in _terms(s, b, h, a, f, kv, mlp, e, dropout, mask_bytes, attn, impl):
        divided = split == "tp" or (sequence_parallel and (split == "sp" or (split == "gather" and
                                                                              impl == "megatron")))
        out[name] = nbytes // t if divided else nbytes
    return out if terms else sum(out.values())


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False) -> float:
    """The paper's closed forms (Korthikanti et al. 2022, Sec. 4): s*b*h*(34 + 5as/h) (no parallelism),
    s*b*h*(10 + 24/t + 5as/(ht)) (tensor parallel), s*b*h/t*(34 + 5as/h) (tensor + sequence parallel)."""
    for n, v in (("s", s), ("b", b), ("h", h), ("a", a), ("t", t)):
        pos_int(n, v)
    flag("sequence_parallel", sequence_parallel)
    sbh, r = s * b * h, 5 * a * s / h
    if sequence_parallel:
        return sbh / t * (34 + r)
    return sbh * (10 + 24 / t + r / t)


# ----------------------------------------------------------------------------- traffic
def tp_comm_per_layer(s: int, b: int, h: int, t: int, *, sequence_parallel: bool = False, e: int = 2) -> dict:
    """Collectives of one layer per training step on one tensor-parallel rank (Shoeybi et al. 2019, Sec. 3:
    two all-reduces forward, two backward). Each moves a (b, s, h) tensor: payload S = e*s*b*h bytes. With
    sequence parallelism each all-reduce is a reduce-scatter plus an all-gather of the same S. "sent": the bytes
    a rank puts on the wire with ring algorithms, 2(t-1)/t*S per all-reduce, (t-1)/t*S per gather or scatter.
    Returns {"forward": {collective: {"calls", "bytes", "sent"}}, "backward": {...}, "sent_per_step": ...}."""
    for n, v in (("s", s), ("b", b), ("h", h), ("t", t), ("e", e)):
        pos_int(n, v)
    flag("sequence_parallel", sequence_parallel)
    S = e * s * b * h
    if sequence_parallel:
        one = {c: {"calls": 2, "bytes": 2 * S, "sent": round(2 * (t - 1) / t * S)}
               for c in ("all_gather", "reduce_scatter")}
    else:
        one = {"all_reduce": {"calls": 2, "bytes": 2 * S, "sent": round(2 * 2 * (t - 1) / t * S)}}
    per_pass = sum(c["sent"] for c in one.values())
    return {"forward": one, "backward": {k: dict(v) for k, v in one.items()}, "sent_per_step": 2 * per_pass}
