"""Exercise 09's runs, in the learner's process: the shard functions called on every rank's behalf (task 9.1),
the learner's tensor-parallel forward and its backward on 4 forked ranks (task 9.2), the pipeline estimator
called on plain arguments (task 9.3), and the calls the learner may not make. Everything comes back as plain
data; nothing here decides."""

from __future__ import annotations

import os

import torch

from memlab.sharding.comm import CommCounter
from memlab.kit.ex09 import linear_weights, mlp_data, mlp_weights, run_ranks

from ..common import no_calls

# ----------------------------------------------------------------------------- what the learner may not call
OFF_LIMITS = {"shard": "torch.distributed.tensor (DTensor, parallelize_module) and memlab.parallel",
              "pipe": "memlab.parallel and torch.distributed.pipelining"}


def _forbidden(filename: str, kind: str) -> bool:
    f = filename.replace(os.sep, "/")
    if "/memlab/parallel/" in f:
        return True
    if kind == "shard":
        return "/torch/distributed/tensor/" in f
    return "/torch/distributed/pipelining/" in f


def no_shortcuts(task: str, kind: str):
    """While the learner's code runs, no call into the off-limits libraries of `kind` (common.no_calls)."""
    return no_calls(task, lambda filename, name: _forbidden(filename, kind),
                    f"{OFF_LIMITS[kind]} are off limits here; write the sharding and the collectives yourself")


# ----------------------------------------------------------------------------- task 9.1
def _summary(t, full: set[int]):
    """A returned shard as plain data: its values, and whether it owns its memory."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        return {"type": type(t).__name__}
    st = t.untyped_storage()
    return {"type": "Tensor", "shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
            "values": t.detach().reshape(-1).tolist(), "aliases": st.data_ptr() in full,
            "storage_bytes": st.nbytes(), "nbytes": t.nbytes}


def _call(fn, case, rank):
    weight, bias = linear_weights(case)
    weight = torch.nn.Parameter(weight)                      # what nn.Linear holds
    bias = torch.nn.Parameter(bias) if bias is not None else None
    full = {weight.untyped_storage().data_ptr()} | ({bias.untyped_storage().data_ptr()} if bias is not None
                                                    else set())
    try:
        with no_shortcuts("task9_1_shard_linear", "shard"):
            out = fn(weight, bias, rank, case["world"])
    except NotImplementedError:
        raise
    except AssertionError:
        raise
    except Exception as e:                                    # noqa: BLE001 - the judge reads what was raised
        return {"raised": type(e).__name__, "message": str(e)[:300]}
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        return {"raised": None, "returned": type(out).__name__ + (f" of length {len(out)}"
                                                                   if isinstance(out, (tuple, list)) else "")}
    return {"raised": None, "weight": _summary(out[0], full), "bias": _summary(out[1], full)}


def shard_run(case, column_parallel_linear, row_parallel_linear):
    fn = column_parallel_linear if case["kind"] == "column" else row_parallel_linear
    if not callable(fn):
        raise TypeError(f"{case['kind']}_parallel_linear must be a function, got {type(fn).__name__}")
    if case["error"] == "rank":
        return {"calls": [_call(fn, case, case["bad_rank"])]}
    if case["error"] == "uneven":
        return {"calls": [_call(fn, case, 0)]}
    return {"calls": [_call(fn, case, r) for r in range(case["world"])]}


# ----------------------------------------------------------------------------- task 9.2
def _grads(tensors: dict) -> dict:
    return {k: None if t.grad is None else t.grad.reshape(-1).tolist() for k, t in tensors.items()}


def _one_run(run, rank, world, forward):
    import torch.distributed as dist
    tp = run["tp"]
    groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(world // tp)]   # on every rank
    tp_rank, replica = rank % tp, rank // tp
    w, h = mlp_weights(run), run["hidden"] // tp
    part = slice(tp_rank * h, (tp_rank + 1) * h)              # the grader's own shards (task 9.1's layout)
    mine = {"w1": w["w1"][part], "b1": w["b1"][part], "w2": w["w2"][:, part], "b2": w["b2"]}
    mine = {k: t.clone().requires_grad_(True) for k, t in mine.items()}
    x, gy = mlp_data(run, replica)
    comm, back = CommCounter(), CommCounter()
    with no_shortcuts("task9_2_tp_mlp", "shard"), comm:
        y = forward(x, mine["w1"], mine["b1"], mine["w2"], mine["b2"], groups[replica])
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"tp_mlp_forward must return a tensor, got {type(y).__name__}")
    out = {"shape": list(y.shape), "comm": comm.as_dict(), "requires_grad": bool(y.requires_grad)}
    if list(y.shape) != list(x.shape):
        return out
    out["y"] = y.detach().reshape(-1).tolist()
    if y.requires_grad:
        with no_shortcuts("task9_2_tp_mlp", "shard"), back:
            (y * gy).sum().backward()                        # every rank: the same loss from its replicated y
    out["grads"], out["backward_comm"] = _grads(mine), back.as_dict()
    return out


def tp_run(case, tp_mlp_forward):
    if not callable(tp_mlp_forward):
        raise TypeError(f"tp_mlp_forward must be a function, got {type(tp_mlp_forward).__name__}")

    def fn(rank, world):
        return [_one_run(run, rank, world, tp_mlp_forward) for run in case["runs"]]
    return run_ranks(case["world"], fn, timeout=60)


# ----------------------------------------------------------------------------- task 9.3
def pipe_run(case, pipeline_activation_bytes):
    try:
        with no_shortcuts("task9_3_pipeline_memory", "pipe"):
            out = pipeline_activation_bytes(case["schedule"], case["stages"], case["microbatches"],
                                            case["bytes_per_microbatch"])
    except (NotImplementedError, AssertionError):
        raise
    except Exception as e:                                    # noqa: BLE001 - the judge reads what was raised
        return {"raised": type(e).__name__, "message": str(e)[:300]}
    if not isinstance(out, (list, tuple)):
        return {"raised": None, "returned": type(out).__name__}
    return {"raised": None, "value": [v if type(v) is int else repr(v)[:40] for v in out]}
