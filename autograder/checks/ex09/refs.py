"""Exercise 09's trusted references: the plain unsharded torch modules (nn.Linear; nn.Sequential(Linear, GELU,
Linear)) on one process, the shard layout of PyTorch's tensor parallelism (the Shard(dim) placement that
ColwiseParallel (dim 0 of the weight) and RowwiseParallel (dim 1) give each rank, split by DTensor's own
`Shard._split_tensor`; tests/test_checks_ex09.py checks it against `parallelize_module`'s `.to_local()` on real
ranks), and a naive walk of each pipeline schedule's event order (tests check it against torch's own
`_get_pipeline_order` and against a measured pipeline run)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Shard

from memlab.kit.ex09 import linear_input, linear_weights, mlp_data, unsharded_mlp

# which dimension of each tensor tensor parallelism splits (None: replicated on every rank)
TP_DIMS = {"w1": 0, "b1": 0, "w2": 1, "b2": None}


def torch_shard(t: torch.Tensor, dim: int | None, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s local piece of `t` under DTensor's Shard(dim) placement (all of it when dim is None)."""
    if dim is None:
        return t
    pieces, pads = Shard(dim)._split_tensor(t, world, with_padding=False)
    if any(pads):
        raise RuntimeError(f"a {tuple(t.shape)} tensor does not split evenly over {world} ranks along dim {dim}")
    return pieces[rank]


# ----------------------------------------------------------------------------- task 9.1
def linear_reference(case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, the unsharded nn.Linear's output, its output without the bias) for a linear case."""
    weight, bias = linear_weights(case)
    layer = torch.nn.Linear(case["in"], case["out"], bias=bias is not None)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
        x = linear_input(case)
        return x, layer(x), F.linear(x, weight)


def row_input(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """What a row-parallel rank receives: its block of the input features, as a column-parallel layer before
    it leaves them (Shard(-1) of the activation)."""
    return torch_shard(x, x.dim() - 1, rank, world)


# ----------------------------------------------------------------------------- task 9.2
def tp_reference(run, replica: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The one-process model on replica `replica`'s data: its output and the gradients of its four tensors for
    the loss sum(y * dL/dy)."""
    model = unsharded_mlp(run)
    x, gy = mlp_data(run, replica)
    y = model(x)
    (y * gy).sum().backward()
    grads = dict(zip(("w1", "b1", "w2", "b2"), (p.grad for p in model.parameters())))
    return y.detach(), grads


# ----------------------------------------------------------------------------- task 9.3
def events(schedule: str, stages: int, microbatches: int, stage: int) -> list[int]:
    """Stage `stage`'s compute in order: +1 a micro-batch's forward (its activations are kept), -1 a backward
    (they are freed). GPipe: every forward, then every backward (Huang et al. 2019). 1F1B: warm-up forwards
    until the first backward can arrive from the last stage, then one backward and one forward in turn, then
    the remaining backwards (Megatron-LM's forward_backward_pipelining_without_interleaving: min(p - s - 1, m)
    warm-up micro-batches; torch's Schedule1F1B does the same for m >= p)."""
    m = microbatches
    if schedule == "gpipe":
        return [+1] * m + [-1] * m
    warm = min(stages - stage - 1, m)
    out = [+1] * warm
    for _ in range(m - warm):                                 # steady state: 1F then 1B
        out += [+1, -1]
    return out + [-1] * warm                                  # cool-down


def in_flight(schedule: str, stages: int, microbatches: int) -> list[int]:
    """Per stage, the most micro-batches whose activations are alive at once (walking `events`)."""
    peaks = []
    for s in range(stages):
        live = peak = 0
        for e in events(schedule, stages, microbatches, s):
            live += e
            peak = max(peak, live)
            if live < 0:
                raise RuntimeError(f"stage {s} ran a backward before its forward")
        peaks.append(peak)
    return peaks


def reference_pipeline_bytes(schedule: str, stages: int, microbatches: int, bytes_per_microbatch: int) -> list[int]:
    """Per stage, the peak bytes of in-flight activations: the model's layers split evenly over the stages."""
    return [n * (bytes_per_microbatch // stages) for n in in_flight(schedule, stages, microbatches)]
