"""ZeRO at full size: one rank's training step of a large model on the virtual GPU.

`zero_rank_step` runs, on fake tensors, what one of N data-parallel ranks holds and
does in a bf16 mixed-precision step with AdamW and every transformer block
checkpointed, at ZeRO stage 0-3 (Rajbhandari et al. 2020):

  stage   bf16 weights   bf16 gradients                 fp32 master, exp_avg, exp_avg_sq
  0       full           full                           full
  1       full           full (reduced after backward)  1/N
  2       full           1/N (+ one reduce bucket)      1/N
  3       1/N, each block gathered while it runs         1/N (+ one reduce bucket)

What the formula leaves out is allocated for real: the activations (checkpointed
block inputs plus one block recomputed at a time), the logits and their gradients,
the reduce bucket (DeepSpeed allocates `reduce_bucket_size` elements whatever the
model: 5e8 by default, a 1 GB bf16 buffer), a block's gathered weights and their
gradients under stage 3, and the optimizer step's scratch: the fp32 copy of the
gradient partition and one partition-sized temporary of a foreach Adam. Run it with
`memlab.VirtualGPU(...).run(zero_rank_step, cfg, stage, n_gpus, batch, seq)`.
Not modelled: prefetching more than one block, fragmentation, the CUDA context.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from ..core.models import GPT, GPTConfig
from ..core.track import phase, watch
from ..core.validate import is_int, one_of, pos_int

__all__ = ["zero_rank_step", "per_gpu_peaks", "DEEPSPEED_REDUCE_BUCKET"]

DEEPSPEED_REDUCE_BUCKET = int(5e8)   # elements: DeepSpeed's default zero_optimization.reduce_bucket_size


def _check(cfg, stage, n_gpus, batch, seq, bucket):
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
    one_of("stage", stage, (0, 1, 2, 3), what="0, 1, 2 or 3")
    for name, v in (("n_gpus", n_gpus), ("batch", batch), ("seq", seq)):
        pos_int(name, v)
    pos_int("bucket", bucket, zero_ok=True, what="a number of elements >= 0")
    if seq > cfg.block_size:
        raise ValueError(f"seq ({seq}) exceeds cfg.block_size ({cfg.block_size})")


def zero_rank_step(cfg: GPTConfig, stage: int, n_gpus: int, batch: int, seq: int,
                   bucket: int = DEEPSPEED_REDUCE_BUCKET) -> dict:
    """One rank's ZeRO training step (see the module docstring); call it inside VirtualGPU.run.
    Returns {"n_params", "partition"}: the parameter count and this rank's partition size."""
    _check(cfg, stage, n_gpus, batch, seq, bucket)
    bf16, fp32 = torch.bfloat16, torch.float32
    with torch.device("meta"):
        model = GPT(cfg)                                  # shapes only: no bytes anywhere
    names = dict(model.named_parameters())
    n_params = sum(p.numel() for p in names.values())
    part = math.ceil(n_params / n_gpus)                   # elements this rank owns
    shard = stage >= 1
    # ---- model states, allocated as the flat buffers DeepSpeed keeps (phase "states")
    with phase("states"):
        master = [torch.empty(part if shard else n_params, dtype=fp32) for _ in range(3)]   # master, m, v
        watch(tensors=master, category="optimizer")
        if stage == 3:                    # a 1/N flat partition; the module's weights are empty until gathered
            partition16 = torch.empty(part, dtype=bf16)
            watch(tensors=[partition16], category="parameters")
            live = {n: torch.empty(0, dtype=bf16, requires_grad=True) for n in names}
        else:
            live = {n: torch.empty(p.shape, dtype=bf16, requires_grad=True) for n, p in names.items()}
            watch(tensors=list(live.values()), category="parameters")
        grad_part = torch.empty(part, dtype=bf16) if stage >= 2 else None
        buckets = [torch.empty(bucket, dtype=bf16)] if stage >= 1 and bucket else []
        watch(tensors=[t for t in [grad_part, *buckets] if t is not None], category="gradients")

    def reduced(w):                   # stage 2: its gradient went through the bucket to its owner rank
        w.grad = None
        if stage == 3:                # stage 3: and the gathered weight is released
            w.data = torch.empty(0, dtype=bf16)
    if stage >= 2:
        for w in live.values():
            w.register_post_accumulate_grad_hook(reduced)
    buffers = {n: torch.empty(b.shape, dtype=fp32) for n, b in model.named_buffers()}

    def weights(prefix):              # a module's bf16 weights; under stage 3 all-gathered now
        out = {}
        for n, p in names.items():
            if n.startswith(prefix):
                if live[n].numel() != p.numel():
                    live[n].data = torch.empty(p.shape, dtype=bf16)
                out[n[len(prefix):]] = live[n]
        return out

    def release(*prefixes):           # stage 3, after a module's forward: free the gathered weights
        if stage == 3:
            for n in names:
                if n.startswith(prefixes):
                    live[n].data = torch.empty(0, dtype=bf16)

    def embed(idx):
        h = functional_call(model.wte, weights("wte."), (idx,))              # (B, T, C) bf16
        if model.wpe is not None:
            h = h + functional_call(model.wpe, weights("wpe."), (torch.arange(seq),))
        return h

    def run_block(i, h):
        rope = (buffers["rope_cos"][:seq], buffers["rope_sin"][:seq]) if cfg.pos == "rope" else None
        return functional_call(model.blocks[i], weights(f"blocks.{i}."), (h, rope))

    def head(h, idx):
        h = functional_call(model.ln_f, weights("ln_f."), (h,))
        logits = functional_call(model.head, weights("head."), (h,))          # (B, T, V) bf16
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), idx.view(-1))

    idx = torch.randint(0, cfg.vocab_size, (batch, seq))
    with phase("forward"):            # every piece checkpointed: only its input is kept for the backward
        h = checkpoint(embed, idx, use_reentrant=False)
        release("wte.", "wpe.")
        for i in range(cfg.n_layer):
            h = checkpoint(run_block, i, h, use_reentrant=False)
            release(f"blocks.{i}.")
        loss = checkpoint(head, h, idx, use_reentrant=False)
        release("ln_f.", "head.")
    with phase("backward"):
        loss.backward()
    watch(tensors=[w.grad for w in live.values() if w.grad is not None], category="gradients")
    del loss, h
    with phase("step"):
        grads32 = torch.empty(part if shard else n_params, dtype=fp32)   # the gradient partition in fp32
        scratch = torch.empty(part if shard else n_params, dtype=fp32)   # foreach Adam: sqrt(v) of the partition
        watch(tensors=[grads32], category="gradients")
        del grads32, scratch
    return {"n_params": n_params, "partition": part}


def _partitioned_bytes_per_element(stage: int, phase_name: str) -> int:
    """Bytes per partition element that zero_rank_step holds as flat 1/N buffers in a phase."""
    if stage == 0:
        return 0
    per = 12 + (2 if stage >= 2 else 0) + (2 if stage == 3 else 0)     # master+m+v, grad partition, weights
    return per + (8 if phase_name == "step" else 0)                      # fp32 gradients + Adam's scratch


def per_gpu_peaks(cfg: GPTConfig, batch: int, seq: int, n_gpus=(1, 2, 4, 8, 16, 32, 64), stages=(0, 1, 2, 3),
                  bucket: int = DEEPSPEED_REDUCE_BUCKET) -> dict:
    """Per-GPU peak bytes of `zero_rank_step` for every stage and number of GPUs, from 2 x len(stages)
    virtual-GPU runs.

    Every layer of the model is the same, so the peak of each phase is linear in the number of
    layers: it is measured with the model cut to 1 and 2 layers (at N = 1) and extended to
    cfg.n_layer. The bytes that depend on N are flat 1/N buffers (`_partitioned_bytes_per_element`),
    so each phase's peak moves to N ranks by exactly those bytes. The step's peak is the largest
    phase. Returns {"n_params": ..., stage: {N: {"peak": bytes, "phase": name, "phases": {...}}}}.
    """
    from dataclasses import replace
    from ..core.virtual_gpu import VirtualGPU
    _check(cfg, 0, 1, batch, seq, bucket)
    if not n_gpus or not all(is_int(n) and n >= 1 for n in n_gpus):
        raise ValueError(f"n_gpus must be positive ints, got {n_gpus!r}")
    if any(s not in (0, 1, 2, 3) for s in stages):
        raise ValueError(f"stages must be among 0, 1, 2, 3, got {stages!r}")
    gpu = VirtualGPU(capacity_gb=2**20)                  # big enough to measure anything
    L = cfg.n_layer
    out: dict = {}
    for stage in stages:
        runs = [gpu.run(zero_rank_step, replace(cfg, n_layer=k), stage, 1, batch, seq, bucket) for k in (1, 2)]
        psi1, psi2 = (r.value["n_params"] for r in runs)
        psi = psi1 + (L - 1) * (psi2 - psi1)
        out["n_params"] = psi
        p1, p2 = (r.phase_peaks for r in runs)
        at1 = {ph: p1[ph]["total"] + (L - 1) * (p2[ph]["total"] - p1[ph]["total"])
               for ph in ("states", "forward", "backward", "step")}
        table = {}
        for n in n_gpus:
            phases = {ph: v - _partitioned_bytes_per_element(stage, ph) * (psi - math.ceil(psi / n))
                      for ph, v in at1.items()}
            top = max(phases, key=phases.get)
            table[n] = {"peak": phases[top], "phase": top, "phases": phases}
        out[stage] = table
    return out
