"""Exercise 06's trusted references: the unsharded torch.optim run on one process (the same model and data
as the ranks, memlab.kit.ex06), and the per-rank bytes of task 6.3 term by term over the partition torch's
ZeroRedundancyOptimizer makes."""

from __future__ import annotations

import torch

from memlab.kit.ex06 import Net, batch, loss_fn, optimizer_cls, param_groups, scheduler, unique_params


# ----------------------------------------------------------------------------- the reference: one process
def reference_run(case):
    """The unsharded run: the same model and data on ONE process with torch.optim, each step's gradient
    the average of the N ranks' gradients. Returns (final params, state bytes per param index (0 if none),
    the last step's averaged gradients (None where there is none))."""
    model = Net(case)
    params = unique_params(model)
    groups = param_groups(case, model)
    seen = set()
    if isinstance(groups[0], dict):                              # torch.optim rejects nothing, so dedupe here
        groups = [dict(g, params=[p for p in g["params"] if not (id(p) in seen or seen.add(id(p)))])
                  for g in groups]
    else:
        groups = [p for p in groups if not (id(p) in seen or seen.add(id(p)))]
    opt = optimizer_cls(case)(groups, **case["kwargs"])
    sched = scheduler(case, opt)                                 # the same schedule on the unsharded optimizer
    grads = [None] * len(params)
    for step in range(case["steps"]):
        per_rank = []
        for r in range(case["world"]):
            model.zero_grad(set_to_none=True)
            loss_fn(model, *batch(case, r, step)).backward()
            per_rank.append([None if p.grad is None else p.grad.clone() for p in params])
        for i, p in enumerate(params):
            gs = [g[i] for g in per_rank]
            p.grad = None if gs[0] is None else sum(gs[1:], gs[0].clone()) / case["world"]
        grads = [None if p.grad is None else p.grad.clone() for p in params]
        opt.step()
        if sched is not None:
            sched.step()
    index = {id(p): i for i, p in enumerate(params)}
    state = [0] * len(params)
    for p, st in opt.state.items():
        state[index[id(p)]] = sum(v.nbytes for v in st.values() if isinstance(v, torch.Tensor))
    return [p.detach().clone() for p in params], state, grads


# ----------------------------------------------------------------------------- per-rank bytes (task 6.3)
def zero_partition_loads(numels: list[int], world: int) -> list[int]:
    """Elements per rank as the library partitions whole tensors: torch's ZeroRedundancyOptimizer's own
    `_partition_parameters` (largest first, each to the least loaded rank), run on meta tensors of these sizes
    without a process group (only `world_size` and `param_groups` are read)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    zero = object.__new__(ZeroRedundancyOptimizer)               # no __init__: it would need a process group
    zero.world_size = world
    zero.param_groups = [{"params": [torch.empty(n, device="meta") for n in numels]}]
    zero._partition_parameters_cache = []
    parts = ZeroRedundancyOptimizer._partition_parameters(zero)
    loads = [sum(p.numel() for g in groups for p in g["params"]) for groups in parts]
    if len(loads) != world or sum(loads) != sum(numels):
        raise RuntimeError(f"ZeroRedundancyOptimizer's partition of {numels} over {world} ranks gave {loads}")
    return loads


LAYOUTS = {   # bytes per element: weights, gradients, optimizer state (Rajbhandari et al. 2020, Sec. 3.1)
    "bf16_adam": {"params": 2, "grads": 2, "optimizer": 4 + 4 + 4},      # fp32 master + momentum + variance
    "fp32_adam": {"params": 4, "grads": 4, "optimizer": 4 + 4},          # momentum + variance
}


def reference_rank_bytes(numels: list[int], stage: int, world: int, layout: str) -> dict[str, int]:
    """The most loaded rank's bytes, category by category: a category is sharded from its stage on
    (optimizer state from stage 1, gradients from 2, weights from 3) and then holds only the rank's own
    tensors; before that it holds all of them."""
    total, mine = sum(numels), max(zero_partition_loads(numels, world))
    b = LAYOUTS[layout]
    out = {"params": b["params"] * (mine if stage >= 3 else total),
           "grads": b["grads"] * (mine if stage >= 2 else total),
           "optimizer": b["optimizer"] * (mine if stage >= 1 else total)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
