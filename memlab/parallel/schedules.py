"""Pipeline schedules beyond GPipe and 1F1B, run with `torch.distributed.pipelining`'s own schedule classes:
GPipe with the re-materialisation it is published with, interleaved 1F1B, and two zero-bubble schedules.

* GPipe re-materialises: each stage keeps only its input per micro-batch and recomputes its layers in the
  backward pass (Huang et al. 2019, "GPipe", Sec. 2.3).
* Interleaved 1F1B gives each GPU v model chunks (stages i, i + p, ...): the bubble falls to (p-1)/(v m) of the
  ideal time, for v times the point-to-point traffic (Narayanan et al. 2021, Sec. 2.2.2; `ScheduleInterleaved1F1B`).
* Zero bubble splits each backward into B (the input gradient, which the previous stage waits for) and W (the
  weight gradient, which nobody waits for), and runs W in the bubble (Qi et al. 2024, "Zero Bubble Pipeline
  Parallelism", ICLR 2024): `ScheduleInterleavedZeroBubble` (their ZB1P on interleaved chunks) and
  `ScheduleZBVZeroBubble` (their ZB-V: two chunks per GPU in a V, rank r holds stages r and 2p-1-r).
  PyTorch names the input-gradient pass I and keeps B for a full backward; so do we.

The idea is `timeline`: play each rank's action order with fixed costs (F = I = W = 1, a full backward B = 2,
+1 for every recomputed forward) and free communication, the papers' setting, which gives the bubble and the
micro-batches in flight that order implies. `schedule_run` is the plumbing: it runs one step of a schedule on
the ranks of a `memlab.sharding.RankGroup` (or under torchrun) and records, for every action, when it ran and the
activation bytes alive after it; the recorded order is what `timeline` plays.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.validate import flag, one_of, pos_int

__all__ = ["SCHEDULES", "COSTS", "timeline", "schedule_run"]

# name -> (torch.distributed.pipelining class, model chunks per rank)
SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
             "interleaved-1f1b": ("ScheduleInterleaved1F1B", 2),
             "zb-interleaved": ("ScheduleInterleavedZeroBubble", 2), "zb-v": ("ScheduleZBVZeroBubble", 2)}
COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}       # one chunk's forward = 1; Qi et al.'s T_F = T_B = T_W


# ----------------------------------------------------------------------------- the idea: play an order
def _check_orders(orders):
    if not isinstance(orders, (list, tuple)) or not orders:
        raise ValueError("orders must be a non-empty list (one per rank) of lists of (kind, stage, micro-batch)")
    for r, order in enumerate(orders):
        for a in order:
            if not (isinstance(a, (list, tuple)) and len(a) == 3 and a[0] in COSTS
                    and all(isinstance(x, int) and x >= 0 for x in a[1:])):
                raise ValueError(f"orders[{r}] holds {a!r}: each action must be (kind in {tuple(COSTS)}, stage, "
                                 "micro-batch), stage and micro-batch ints >= 0")


def timeline(orders, recompute: bool = False, durations=None) -> dict:
    """Play every rank's actions in its order, each as soon as the rank is free and its inputs exist: a forward
    F(s, k) needs F(s-1, k); an input gradient (B or I) of (s, k) needs F(s, k) and the input gradient of
    (s+1, k); a weight gradient W(s, k) needs I(s, k). Costs: `COSTS`, one more for B or I with recompute=True
    (the forward is run again first), or, given `durations` (per rank, one number per action, e.g. the times a
    run measured), those. Communication is free.

    orders: per rank, [(kind, stage, micro-batch), ...] with kind in F, B, I, W (what `schedule_run` records).
    Returns {"step": the step's length, "ranks": [{"busy", "idle_share" (1 - busy/step), "in_flight" (most
    chunk-micro-batches whose forward ran and whose last backward part, B or W, had not), "spans":
    [(kind, stage, micro-batch, start, end)]}]}."""
    _check_orders(orders)
    flag("recompute", recompute)
    if durations is not None and (not isinstance(durations, (list, tuple)) or len(durations) != len(orders)
                                  or any(len(d) != len(o) for d, o in zip(durations, orders))
                                  or any(not isinstance(x, (int, float)) or x < 0 for d in durations for x in d)):
        raise ValueError("durations must hold one number >= 0 per action of orders, rank by rank")
    last = max(s for order in orders for _, s, _ in order)
    cost = dict(COSTS, **({"B": COSTS["B"] + 1, "I": COSTS["I"] + 1} if recompute else {}))
    done: dict[tuple, float] = {}                                  # (kind, stage, mb) -> end time
    free, pos = [0.0] * len(orders), [0] * len(orders)
    spans: list[list] = [[] for _ in orders]

    def ready(kind, s, k):                                          # end time of the inputs, None if not yet run
        if kind == "F":
            need = [[("F", s - 1, k)]] if s > 0 else []
        elif kind in ("B", "I"):
            need = [[("F", s, k)]] + ([[("B", s + 1, k), ("I", s + 1, k)]] if s < last else [])
        else:
            need = [[("I", s, k)]]
        ends = []
        for alternatives in need:                                   # one of each group must have run
            got = [done[a] for a in alternatives if a in done]
            if not got:
                return None
            ends.append(min(got))
        return max(ends, default=0.0)

    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while pos[r] < len(order):
                kind, s, k = order[pos[r]]
                t = ready(kind, s, k)
                if t is None:
                    break
                start = max(free[r], t)
                took = cost[kind] if durations is None else durations[r][pos[r]]
                free[r] = done[(kind, s, k)] = start + took
                spans[r].append((kind, s, k, start, free[r]))
                pos[r] += 1
                progress = True
    if any(p < len(o) for p, o in zip(pos, orders)):
        stuck = [o[p] for p, o in zip(pos, orders) if p < len(o)]
        raise ValueError(f"the orders deadlock: every rank waits ({stuck}); is an action missing or misplaced?")
    step = max(free)
    ranks = []
    for r, order in enumerate(orders):
        live = peak = 0
        for kind, _, _ in order:
            live += 1 if kind == "F" else -1 if kind in ("B", "W") else 0
            peak = max(peak, live)
        busy = sum(e - b for *_, b, e in spans[r])
        ranks.append({"busy": busy, "idle_share": 1 - busy / step, "in_flight": peak, "spans": spans[r]})
    return {"step": step, "ranks": ranks}


# ----------------------------------------------------------------------------- the plumbing: run one on ranks
class _Recompute(nn.Module):
    """Runs `inner` under torch.utils.checkpoint: keeps its input, recomputes the rest in backward."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.inner, x, use_reentrant=False)


_KINDS = {"forward_one_chunk": "F", "backward_weight_one_chunk": "W"}


def _record(stage, log, tracker_box):
    """Wrap the stage's three compute methods: log (kind, stage, micro-batch, start, end, activation bytes
    alive after it), forwards under phase "forward" so that the tracker labels what they keep as activations."""
    from ..core.track import phase
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        method = getattr(stage, name)

        def wrapped(chunk_id, *args, _method=method, _name=name, **kwargs):
            kind = _KINDS.get(_name) or ("B" if kwargs.get("full_backward", args[1] if len(args) > 1 else True)
                                         else "I")
            with phase("forward" if kind == "F" else "backward"):
                t0 = time.perf_counter()
                out = _method(chunk_id, *args, **kwargs)
                t1 = time.perf_counter()
            tracker = tracker_box[0]
            if tracker is not None:
                log.append((kind, stage.stage_index, chunk_id, t0, t1, tracker.breakdown()["activations"]))
            return out
        setattr(stage, name, wrapped)


def schedule_run(schedule: str = "1f1b", n_micro: int = 4, layers: int = 4, micro_batch: int = 4, seq: int = 64,
                 d: int = 128, heads: int = 4, recompute: bool = False) -> dict:
    """One training step of `layers` `memlab.parallel.Block(d, heads)` split over the ranks with
    torch.distributed.pipelining's schedule `schedule` (a key of SCHEDULES), m = n_micro micro-batches of
    micro_batch x seq tokens, fp32, after one warm-up step; recompute=True wraps every chunk in
    torch.utils.checkpoint (GPipe's re-materialisation). Run it on every rank of a process group.

    Returns this rank's "stages" (its chunk indices), "order" (the actions it ran, [(kind, stage, micro-batch)]),
    "actions" (the same with start and end in seconds from the step's start and the activation bytes alive
    after it), "chunk_bytes" (the activation bytes one chunk keeps for one micro-batch without recompute, the
    formula `layer_activation_bytes` x layers per chunk), "peak_kept" (most activation bytes alive after any
    action), "peak" (the tracker's peak of everything the rank allocated during the step), "busy", "wall"
    (from a common start to the end of the slowest rank), "bubble" (1 - busy / wall) and the point-to-point
    traffic."""
    one_of("schedule", schedule, tuple(SCHEDULES))
    for n, v in (("n_micro", n_micro), ("layers", layers), ("micro_batch", micro_batch), ("seq", seq), ("d", d),
                 ("heads", heads)):
        pos_int(n, v)
    flag("recompute", recompute)
    import torch.distributed as dist
    from torch.distributed import pipelining
    from .tp import Block, layer_activation_bytes
    from ..core.track import MemoryTracker
    from ..sharding.comm import CommCounter
    cls_name, v = SCHEDULES[schedule]
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    p, r = dist.get_world_size(), dist.get_rank()
    if layers % (p * v):
        raise ValueError(f"layers ({layers}) must divide into {p} ranks x {v} chunks")
    per_chunk = layers // (p * v)
    chunks = [r, 2 * p - 1 - r] if schedule == "zb-v" else [r + i * p for i in range(v)]
    torch.manual_seed(r)
    mods = []
    for _ in chunks:
        m = nn.Sequential(*(Block(d, heads) for _ in range(per_chunk))).to(dev)
        mods.append(_Recompute(m) if recompute else m)
    stages = [pipelining.PipelineStage(m, i, p * v, dev) for m, i in zip(mods, chunks)]
    log: list[tuple] = []
    tracker_box = [None]
    for st in stages:
        _record(st, log, tracker_box)
    cls = getattr(pipelining, cls_name)
    sched = cls(stages if v > 1 else stages[0], n_microbatches=n_micro, loss_fn=lambda out, y: F.mse_loss(out, y))
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n_micro * micro_batch, seq, d, generator=gen).to(dev)         # (m*b, s, h) fp32
    target = torch.randn(n_micro * micro_batch, seq, d, generator=gen).to(dev)
    args = (x,) if 0 in chunks else ()
    kwargs = {"target": target} if p * v - 1 in chunks else {}
    sched.step(*args, **kwargs, return_outputs=False)         # warm-up: the schedule sizes its buffers
    for m in mods:
        m.zero_grad(set_to_none=True)
    tracker = MemoryTracker(nn.ModuleList(mods), device=dev.type, timeline=False)
    tracker_box[0] = tracker
    dist.barrier()
    with tracker, CommCounter() as comm:
        t0 = time.perf_counter()
        sched.step(*args, **kwargs, return_outputs=False)
        busy_end = time.perf_counter()
        dist.barrier()                                        # the step ends for everyone with the slowest rank
        wall = time.perf_counter() - t0
    tracker_box[0] = None
    busy = sum(e - b for _, _, _, b, e, _ in log)
    return {"rank": r, "schedule": schedule, "stages": chunks, "n_micro": n_micro, "recompute": recompute,
            "layers_per_chunk": per_chunk, "order": [(k, s, mb) for k, s, mb, *_ in log],
            "actions": [(k, s, mb, b - t0, e - t0, kept) for k, s, mb, b, e, kept in log],
            "chunk_bytes": per_chunk * layer_activation_bytes(seq, micro_batch, d, heads, e=4, dropout=False,
                                                              impl="pytorch"),
            "boundary_bytes": 4 * micro_batch * seq * d, "peak_kept": max(kept for *_, kept in log),
            "peak": tracker.peak, "busy": busy, "own_wall": busy_end - t0, "wall": wall, "bubble": 1 - busy / wall,
            "comm": comm.as_dict()}
