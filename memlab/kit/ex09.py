"""What exercise 09's notebook takes from the kit: `run_ranks` (N gloo ranks forked from the kernel, the same
harness as exercise 06), the weights and data every case is built from, `show_tp` (what each rank of a
tensor-parallel MLP holds and sends) and `measure_pipeline` (a real two-stage pipeline run with
`torch.distributed.pipelining`, weighed per stage). The checks of exercise 09 build their inputs with the same
functions; nothing here grades.

Weights and data are drawn from a case's seed with their own `torch.Generator`, so every rank, the one-process
reference and the demo build the same tensors whatever the global RNG did. A *linear case* is
{"seed", "out", "in", "bias": bool, "rows"}; an *MLP run* is {"seed", "batch", "seq", "d", "hidden"} (the
hidden size a multiple of the tensor-parallel degree).

`measure_pipeline(schedule, microbatches)` runs PIPE's model split into two stages on two ranks with PyTorch's
own `ScheduleGPipe` or `Schedule1F1B` and reports, per stage, the peak bytes of the tensors autograd keeps for
the backward pass (counted with `torch.autograd.graph.saved_tensors_hooks`: every saved tensor from its save to
its release, parameters left out, a tensor saved twice counted once) and memlab's tracker's peak of everything
the stage allocated during the step.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..core.track import MemoryTracker, format_bytes
from ..core.validate import int_at_least, one_of, pos_int
from ..sharding.comm import CommCounter, ring_bytes_sent
from .ex06 import RanksFailed, run_ranks

__all__ = ["RanksFailed", "run_ranks", "linear_weights", "linear_input", "mlp_weights", "mlp_data",
           "unsharded_mlp", "show_tp", "PIPE", "pipeline_stage", "measure_pipeline",
           "saved_bytes_per_microbatch"]


# ----------------------------------------------------------------------------- weights and data from a case
def _gen(seed: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(int(seed) * 1000003 + salt)


def linear_weights(case) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An nn.Linear's (weight (out, in), bias (out,) or None) for a linear case, fp32."""
    g = _gen(case["seed"])
    weight = torch.randn(case["out"], case["in"], generator=g) / case["in"] ** 0.5
    bias = torch.randn(case["out"], generator=g) if case["bias"] else None
    return weight, bias


def linear_input(case) -> torch.Tensor:
    """A batch of inputs for a linear case: (rows, in) fp32."""
    return torch.randn(case["rows"], case["in"], generator=_gen(case["seed"], 1))


def mlp_weights(run) -> dict[str, torch.Tensor]:
    """The MLP's full weights: W1 (hidden, d), b1 (hidden,), W2 (d, hidden), b2 (d,), fp32."""
    g = _gen(run["seed"])
    d, h = run["d"], run["hidden"]
    return {"w1": torch.randn(h, d, generator=g) / d ** 0.5, "b1": 0.5 * torch.randn(h, generator=g),
            "w2": torch.randn(d, h, generator=g) / h ** 0.5, "b2": torch.randn(d, generator=g)}


def mlp_data(run, replica: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Input x (batch, seq, d) and the upstream gradient dL/dy (same shape) of data-parallel replica `replica`:
    different for every replica, the same on every rank of one tensor-parallel group."""
    g = _gen(run["seed"], 2 + replica)
    shape = (run["batch"], run["seq"], run["d"])
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def unsharded_mlp(run) -> nn.Sequential:
    """The one-process model the tensor-parallel MLP must equal: Linear(d, hidden), GELU, Linear(hidden, d)."""
    w = mlp_weights(run)
    model = nn.Sequential(nn.Linear(run["d"], run["hidden"]), nn.GELU(), nn.Linear(run["hidden"], run["d"]))
    with torch.no_grad():
        for p, key in zip(model.parameters(), ("w1", "b1", "w2", "b2")):
            p.copy_(w[key])
    return model


# ----------------------------------------------------------------------------- task 9.2's demo
DEMO_RUN = {"seed": 909, "batch": 4, "seq": 16, "d": 24, "hidden": 96}


def _demo_rank_fn(run, shards, forward):
    def fn(rank, world):
        w1, b1, w2, b2 = (t.clone().requires_grad_(True) for t in shards[rank])
        x, gy = mlp_data(run)
        comm = CommCounter()
        with comm:
            y = forward(x, w1, b1, w2, b2, torch.distributed.group.WORLD)
        (y * gy).sum().backward()
        return {"y": y.detach().reshape(-1).tolist(), "comm": comm.as_dict(),
                "param_bytes": sum(t.nbytes for t in (w1, b1, w2, b2))}
    return fn


def show_tp(forward, column_fn, row_fn, world: int = 2):
    """Shard DEMO_RUN's MLP with your task 9.1 functions (W1 and b1 column-parallel, W2 row-parallel, b2
    replicated), run `forward` (your tp_mlp_forward) on `world` ranks and print what each rank holds and sends
    next to the prediction. Returns the ranks' results, or None when the 9.1 functions are not ready."""
    world = int_at_least("world", world, 2)
    run, w = DEMO_RUN, mlp_weights(DEMO_RUN)
    h, d = run["hidden"] // world, run["d"]
    try:
        shards = []
        for r in range(world):
            w1, b1 = column_fn(w["w1"], w["b1"], r, world)
            w2, _ = row_fn(w["w2"], None, r, world)
            shapes = [tuple(t.shape) for t in (w1, b1, w2)]
            if shapes != [(h, d), (h,), (d, h)]:
                raise ValueError(f"rank {r}'s shards have shapes {shapes}, not {[(h, d), (h,), (d, h)]}")
            shards.append((w1.detach(), b1.detach(), w2.detach(), w["b2"]))
    except Exception as e:                                   # noqa: BLE001 - the demo must not need task 9.1
        print(f"(this table shards the weights with your task 9.1 functions, which failed here: "
              f"{type(e).__name__}: {str(e)[:100]}. Task 9.2 is checked below with the grader's own shards.)")
        return None
    res = run_ranks(world, _demo_rank_fn(run, shards, forward))
    x, _ = mlp_data(run)
    with torch.no_grad():
        ref = unsharded_mlp(run)(x).reshape(-1)
    full = sum(t.nbytes for t in w.values())
    predicted = (w["w1"].nbytes + w["b1"].nbytes + w["w2"].nbytes) // world + w["b2"].nbytes
    payload = x.nbytes                                       # the (B, T, d) fp32 output: B*T*d*4 bytes
    print(f"unsharded MLP d={run['d']}, hidden={run['hidden']}: {format_bytes(full)} of weights; "
          f"x and y (B, T, d) = ({run['batch']}, {run['seq']}, {run['d']}) fp32: {payload:,} bytes each")
    print(f"predicted per rank: {format_bytes(predicted)} of weights, one all-reduce of {payload:,} bytes "
          f"({round(ring_bytes_sent('all_reduce', payload, world)):,} bytes sent with a ring)")
    for r, g in enumerate(res):
        err = (torch.tensor(g["y"]) - ref).abs().max().item()
        comm = ", ".join(f"{k}: {v['calls']} call(s), {v['bytes']:,} bytes, {v['sent']:,} sent"
                         for k, v in sorted(g["comm"].items())) or "no collective"
        print(f"rank {r}: {format_bytes(g['param_bytes'])} of weights; forward {comm}; "
              f"max |y - unsharded| = {err:.2e}")
    return res


# ----------------------------------------------------------------------------- task 9.3: a measured pipeline
PIPE = {"width": 64, "layers": 3, "rows": 32, "stages": 2}     # per stage: 3 x (Linear 64x64, Tanh); 32 rows


def pipeline_stage(stage: int) -> nn.Sequential:
    """Stage `stage` of PIPE's model: `layers` x (Linear(width, width), Tanh), weights drawn from the stage
    index (every stage the same shape, so each keeps the same activations per micro-batch)."""
    pos_int("stage", stage, zero_ok=True)
    g, n = _gen(77, stage), PIPE["width"]
    mods = []
    for _ in range(PIPE["layers"]):
        lin = nn.Linear(n, n)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, n, generator=g) / n ** 0.5)
            lin.bias.copy_(0.1 * torch.randn(n, generator=g))
        mods += [lin, nn.Tanh()]
    return nn.Sequential(*mods)


class _SavedBytes:
    """saved_tensors_hooks that keep the live bytes of tensors autograd saved (parameters left out, one tensor
    saved by two ops counted once) and their peak."""

    class _Box:
        __slots__ = ("t", "__weakref__")

    def __init__(self, params):
        self.skip = {p.untyped_storage().data_ptr() for p in params}
        self.live: dict[tuple, list[int]] = {}
        self.current = self.peak = 0

    def _release(self, key):
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[key]

    def pack(self, t):
        box = self._Box()
        box.t = t
        if t.untyped_storage().data_ptr() not in self.skip:
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
            if key not in self.live:
                self.live[key] = [t.nbytes, 0]
                self.current += t.nbytes
                self.peak = max(self.peak, self.current)
            self.live[key][1] += 1
            weakref.finalize(box, self._release, key)
        return box

    @staticmethod
    def unpack(box):
        return box.t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def saved_bytes_per_microbatch(stage: int = 0) -> int:
    """Bytes one micro-batch's forward through one stage leaves saved for its backward (one process)."""
    mod = pipeline_stage(stage)
    counter = _SavedBytes(mod.parameters())
    x = torch.randn(PIPE["rows"], PIPE["width"], requires_grad=stage > 0)
    with counter.hooks():
        y = mod(x)
    del y
    return counter.peak


def _loss(out, target):
    return out.mean()                                        # saves nothing: every stage keeps the same bytes


def _pipeline_rank_fn(schedule: str, microbatches: int):
    def fn(rank, world):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
        mod = pipeline_stage(rank)
        stage = PipelineStage(mod, rank, world, torch.device("cpu"))
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        sched = cls(stage, microbatches, loss_fn=_loss)
        g = _gen(78)
        x = torch.randn(microbatches * PIPE["rows"], PIPE["width"], generator=g)
        def step():
            if rank == 0:
                sched.step(x)
            elif rank == world - 1:
                sched.step(target=torch.zeros_like(x))
            else:
                sched.step()

        step()                              # the first step also runs the stages' shape inference: not weighed
        mod.zero_grad(set_to_none=True)
        counter, tracker = _SavedBytes(mod.parameters()), MemoryTracker()
        with tracker, counter.hooks():
            step()
        return {"stage": rank, "saved_peak": counter.peak, "tracker_peak": tracker.peak}
    return fn


def measure_pipeline(schedule: str, microbatches: int, stages: int = PIPE["stages"]) -> list[dict]:
    """PIPE's model on `stages` gloo ranks (one stage each) for one step of `microbatches` micro-batches under
    torch's ScheduleGPipe ("gpipe") or Schedule1F1B ("1f1b", which needs microbatches >= stages). Per stage:
    {"stage", "saved_peak": peak bytes autograd kept for backward, "tracker_peak": memlab's tracker's peak of
    everything the stage allocated during the step}."""
    one_of("schedule", schedule, ("gpipe", "1f1b"))
    int_at_least("stages", stages, 2)
    lo = stages if schedule == "1f1b" else 1
    int_at_least("microbatches", microbatches, lo,
                 what=f"an int >= {lo} (torch's Schedule1F1B needs at least one micro-batch per stage)"
                 if schedule == "1f1b" else None)
    import torch.distributed.pipelining  # noqa: F401 - imported once here, not in every forked rank
    return run_ranks(stages, _pipeline_rank_fn(schedule, microbatches), timeout=90)
