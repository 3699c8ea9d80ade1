"""Lesson 09's rank functions: tensor and sequence parallelism with `parallelize_module`, a pipeline with
`torch.distributed.pipelining` (GPipe and 1F1B), ring attention over point-to-point sends, and a 2-D DeviceMesh.
Each is measured on its own rank (memlab's tracker, memlab.sharding.CommCounter, timestamps) and returns plain data.

The same functions run two ways, unchanged:
  * from a notebook or a test, on CPU ranks (gloo):  memlab.sharding.RankGroup(2).run(runs.tp_run, True)
  * on a multi-GPU machine (nccl, one GPU per rank; CPU ranks with gloo elsewhere):
        torchrun --nproc_per_node 2 memlab/parallel/runs.py --mode sp
Run as a script, every rank prints one line of JSON with what it measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from memlab.attention import naive_attention
from memlab.core.track import MemoryTracker, active_trackers, phase
from memlab.core.validate import flag, int_at_least, one_of, pos_int
from memlab.sharding.comm import CommCounter
from memlab.sharding.zero import ShardAwareTracker, label
from memlab.parallel.layout import SCHEDULES, merge_attention
from memlab.parallel.tp import Block, tp_plan

__all__ = ["tp_run", "pp_run", "ring_attention", "ring_attention_run", "mesh_run", "main"]


def _device() -> torch.device:
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _randn(*shape, seed: int, device) -> torch.Tensor:       # the same numbers on every rank
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _settled(read, quiet: float = 0.1, limit: float = 5.0) -> int:
    """The least of `read()` once it has not fallen for `quiet` seconds (at most `limit`).

    A gloo collective returns to its caller before gloo's worker thread drops its own reference to the
    collective's tensors. Until it does, the tracker still counts them: in the tensor-parallel block, the
    all-reduced MLP output ((b, s, h) fp32, freed by the residual add) stayed counted in 6 of 120 forwards
    run beside three busy processes, even after a barrier (the barrier can run on gloo's other worker
    thread). Nothing else runs here meanwhile, so the count can only fall; the least value is the true one."""
    dist.barrier()
    best, since, t0 = read(), time.perf_counter(), time.perf_counter()
    while time.perf_counter() - since < quiet and time.perf_counter() - t0 < limit:
        time.sleep(0.005)
        now = read()
        if now < best:
            best, since = now, time.perf_counter()
    return best


# ----------------------------------------------------------------------------- tensor (+ sequence) parallel
def tp_run(sequence_parallel: bool = False, batch: int = 2, seq: int = 64, d: int = 128, heads: int = 4) -> dict:
    """One forward and backward of `Block(d, heads)` split over all ranks with `tp_plan`, beside the unsharded
    block on the same numbers. Returns this rank's parameter bytes, the bytes kept for backward (tracker
    category "activations" when the forward ends, the block's output included), the step's peak, the
    collectives of each pass, the largest differences from the unsharded output and gradients, and the
    placements of the LayerNorm weight gradients."""
    flag("sequence_parallel", sequence_parallel)
    for n, v in (("batch", batch), ("seq", seq), ("d", d), ("heads", heads)):
        pos_int(n, v)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    dev, t, r = _device(), dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = Block(d, heads).to(dev)
    block = Block(d, heads).to(dev)
    block.load_state_dict(ref.state_dict())
    parallelize_module(block, init_device_mesh(dev.type, (t,)), tp_plan(sequence_parallel))
    x, w = _randn(batch, seq, d, seed=1, device=dev), _randn(batch, seq, d, seed=2, device=dev)
    mine = (lambda z: z.chunk(t, dim=1)[r].contiguous()) if sequence_parallel else (lambda z: z)
    x_in, w_in = mine(x), mine(w)                    # made before the tracker: the input is not counted
    tracker = ShardAwareTracker(device=dev.type, timeline=False)
    with tracker:
        label(list(block.parameters()), "parameters")
        params = tracker.breakdown()["parameters"]
        with CommCounter() as fwd, phase("forward"):
            y = block(x_in)                          # (b, s, h) or, sequence-parallel, (b, s/t, h)
        kept = _settled(lambda: tracker.breakdown()["activations"])
        with CommCounter() as bwd, phase("backward"):
            (y * w_in).sum().backward()
    (ref(x) * w).sum().backward()                    # the unsharded block, for the comparison
    y_err = (y - mine(ref(x))).abs().max().item()
    g_err = max((getattr(p.grad, "full_tensor", lambda g=p.grad: g)() - q.grad).abs().max().item()
                for p, q in zip(block.parameters(), ref.parameters()))
    return {"rank": r, "world_size": t, "sequence_parallel": sequence_parallel, "param_bytes": params,
            "activation_bytes": kept, "peak": tracker.peak, "forward_comm": fwd.as_dict(),
            "backward_comm": bwd.as_dict(), "max_output_error": y_err, "max_grad_error": g_err,
            "ln_grad_placement": str(getattr(block.ln1.weight.grad, "placements", "a plain tensor"))}


# ----------------------------------------------------------------------------- pipeline
class _Mark(torch.autograd.Function):
    """Identity whose backward writes a timestamp: put on a stage's input it fires when the stage's backward
    for that micro-batch is done, on its output when that backward starts."""

    @staticmethod
    def forward(ctx, x, anchor, log, key):
        ctx.log, ctx.key = log, key
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append((ctx.key, time.perf_counter()))
        return grad, torch.zeros((), device=grad.device), None, None


class _Stage(nn.Module):
    """`n_blocks` Blocks that log when each forward and backward starts and ends, and the bytes of activations
    alive when each forward ends. `anchor` (one number) makes the input marker fire on the first stage too."""

    def __init__(self, n_blocks: int, d: int, heads: int):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(n_blocks))
        self.anchor = nn.Parameter(torch.zeros(()))
        self.log: list[tuple[str, float]] = []
        self.kept: list[int] = []

    def forward(self, x):
        self.log.append(("F start", time.perf_counter()))
        with phase("forward"):
            x = _Mark.apply(x, self.anchor, self.log, "B end")
            for block in self.blocks:
                x = block(x)
            x = _Mark.apply(x, self.anchor, self.log, "B start")
        self.log.append(("F end", time.perf_counter()))
        self.kept.append(sum(t.breakdown()["activations"] for t in active_trackers()))
        return x


def _intervals(log, t0):
    """[(kind "F" or "B", micro-batch, start, end)] from the stage's log, seconds from t0."""
    out, count, opened = [], {"F": 0, "B": 0}, {}
    for key, ts in log:
        kind, edge = key.split()
        if edge == "start":
            opened[kind] = ts
        else:
            out.append((kind, count[kind], opened.pop(kind) - t0, ts - t0))
            count[kind] += 1
    return out


def pp_run(schedule: str = "1f1b", n_micro: int = 4, micro_batch: int = 4, seq: int = 64, d: int = 128,
           heads: int = 4, blocks_per_stage: int = 2, return_outputs: bool = False) -> dict:
    """One training step of a pipeline with one stage per rank (`PipelineStage`, then `ScheduleGPipe` or
    `Schedule1F1B`), after one warm-up step. Returns this stage's activation bytes after each forward
    ("kept"), one micro-batch's ("per_micro_batch"), their ratio at its largest ("in_flight"), the step's wall
    time, the time spent computing, the idle share ("bubble"), the forward/backward intervals and the
    point-to-point traffic. return_outputs=True (PyTorch's default) makes the last stage keep every
    micro-batch's output until the step ends, so that `step()` can return them."""
    one_of("schedule", schedule, SCHEDULES)
    flag("return_outputs", return_outputs)
    for n, v in (("n_micro", n_micro), ("micro_batch", micro_batch), ("seq", seq), ("d", d), ("heads", heads),
                 ("blocks_per_stage", blocks_per_stage)):
        pos_int(n, v)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    dev, p, r = _device(), dist.get_world_size(), dist.get_rank()
    torch.manual_seed(r)
    stage_mod = _Stage(blocks_per_stage, d, heads).to(dev)
    stage = PipelineStage(stage_mod, r, p, dev)
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    sched = cls(stage, n_microbatches=n_micro, loss_fn=lambda out, target: F.mse_loss(out, target))
    x = _randn(n_micro * micro_batch, seq, d, seed=1, device=dev)
    target = _randn(n_micro * micro_batch, seq, d, seed=2, device=dev)
    args = ((x,), {}) if r == 0 else ((), {"target": target} if r == p - 1 else {})
    args[1]["return_outputs"] = return_outputs
    sched.step(*args[0], **args[1])                  # warm-up: the schedule sizes its buffers
    stage_mod.zero_grad(set_to_none=True)
    stage_mod.log.clear()
    stage_mod.kept.clear()
    tracker = MemoryTracker(stage_mod, device=dev.type, timeline=False)
    dist.barrier()
    with tracker, CommCounter() as comm:
        t0 = time.perf_counter()
        sched.step(*args[0], **args[1])
        wall = time.perf_counter() - t0
    spans = _intervals(stage_mod.log, t0)
    busy = sum(e - s for _, _, s, e in spans)
    kept = stage_mod.kept
    return {"rank": r, "stages": p, "schedule": schedule, "n_micro": n_micro, "boundary_bytes":
            4 * micro_batch * seq * d, "kept": kept,
            "per_micro_batch": kept[0], "in_flight": max(kept) / kept[0], "peak": tracker.peak, "wall": wall,
            "busy": busy, "bubble": 1 - busy / wall, "intervals": spans, "comm": comm.as_dict()}


# ----------------------------------------------------------------------------- ring attention
def ring_attention(q, k, v, causal: bool = True):
    """Attention of this rank's query chunk over every rank's keys and values (Liu et al. 2023): the ranks
    hold consecutive chunks of the sequence, (B, H, T/N, d) each; at every step each rank sends the key/value
    block it holds to the next rank and receives one from the previous, attends its queries to the block in
    hand and merges the result (`merge_attention`). Causal: blocks from later ranks are passed on, not used."""
    n, r = dist.get_world_size(), dist.get_rank()
    kv = torch.stack([k, v])                                    # (2, B, H, T/N, d): what travels
    out = lse = None
    for step in range(n):
        src = (r - step) % n                                    # the rank whose block we hold now
        if step < n - 1:
            nxt = torch.empty_like(kv)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (r + 1) % n),
                                           dist.P2POp(dist.irecv, nxt, (r - 1) % n)])
        if not causal or src <= r:
            o, l = naive_attention(q, kv[0], kv[1], is_causal=causal and src == r, return_lse=True)
            out, lse = merge_attention(out, lse, o, l)
        if step < n - 1:
            for req in reqs:
                req.wait()
            kv = nxt
    return out


def ring_attention_run(batch: int = 1, heads: int = 4, seq: int = 512, head_dim: int = 32,
                       causal: bool = True) -> dict:
    """Ring attention on this rank's chunk of one (B, H, T, d) problem, checked against full attention on the
    whole sequence; the bytes the tracker saw at the ring's peak (forward only)."""
    for n, v in (("batch", batch), ("heads", heads), ("seq", seq), ("head_dim", head_dim)):
        pos_int(n, v)
    flag("causal", causal)
    dev, n, r = _device(), dist.get_world_size(), dist.get_rank()
    if seq % n:
        raise ValueError(f"seq ({seq}) must divide by the number of ranks ({n})")
    q, k, v = (_randn(batch, heads, seq, head_dim, seed=s, device=dev) for s in (1, 2, 3))
    mine = [z.chunk(n, dim=2)[r].contiguous() for z in (q, k, v)]
    tracker = MemoryTracker(device=dev.type, timeline=False)
    with torch.no_grad():
        with tracker, CommCounter() as comm:
            out = ring_attention(*mine, causal=causal)
        full = naive_attention(q, k, v, is_causal=causal).chunk(n, dim=2)[r]
    return {"rank": r, "max_error": (out - full).abs().max().item(), "peak": tracker.peak, "comm": comm.as_dict()}


# ----------------------------------------------------------------------------- meshes
def mesh_run(shape: tuple = (2, 2), names: tuple = ("dp", "tp")) -> dict:
    """A DeviceMesh of `shape` named `names` over all ranks: this rank's coordinates and, per dimension, the
    ranks of the process group it talks to along it."""
    if not isinstance(shape, (tuple, list)) or not all(isinstance(s, int) and s > 0 for s in shape):
        raise ValueError(f"shape must be a tuple of positive ints, got {shape!r}")
    if not isinstance(names, (tuple, list)) or len(names) != len(shape):
        raise ValueError(f"names must name each of the {len(shape)} dimensions, got {names!r}")
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh(_device().type, tuple(shape), mesh_dim_names=tuple(names))
    return {"rank": dist.get_rank(), "coords": dict(zip(names, mesh.get_coordinate())),
            "groups": {nm: dist.get_process_group_ranks(mesh[nm].get_group()) for nm in names}}


# ----------------------------------------------------------------------------- as a script
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("tp", "sp", "gpipe", "1f1b", "ring", "mesh"), default="tp")
    ap.add_argument("--micro", type=int, default=4, help="pipeline: micro-batches per step")
    a = ap.parse_args(argv)
    int_at_least("--micro", a.micro, 1)
    cuda = torch.cuda.is_available()
    if cuda:
        import os
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if a.mode in ("tp", "sp"):
        out = tp_run(a.mode == "sp")
    elif a.mode in SCHEDULES:
        out = pp_run(a.mode, a.micro)
    elif a.mode == "ring":
        out = ring_attention_run()
    else:
        out = mesh_run((2, dist.get_world_size() // 2))
    sys.stdout.write(json.dumps(out) + "\n")          # one write per line: ranks' lines do not interleave
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
