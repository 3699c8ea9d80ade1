"""Exercise 06's trusted references: the unsharded torch.optim run on one process (the same model and data
as the ranks, memlab.kit.ex06), and the per-rank bytes of task 6.3 term by term."""

from __future__ import annotations

import heapq

import torch

from memlab.kit.ex06 import Net, batch, loss_fn, optimizer_cls, param_groups, unique_params

from .cases import LAYOUTS


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
    index = {id(p): i for i, p in enumerate(params)}
    state = [0] * len(params)
    for p, st in opt.state.items():
        state[index[id(p)]] = sum(v.nbytes for v in st.values() if isinstance(v, torch.Tensor))
    return [p.detach().clone() for p in params], state, grads


# ----------------------------------------------------------------------------- per-rank bytes (task 6.3)
def greedy_loads(numels: list[int], world: int) -> list[int]:
    """Elements per rank when whole tensors go, largest first, to the least loaded rank (a heap)."""
    heap = [(0, r) for r in range(world)]
    loads = [0] * world
    for n in sorted(numels, reverse=True):
        load, r = heapq.heappop(heap)
        loads[r] = load + n
        heapq.heappush(heap, (loads[r], r))
    return loads


def reference_rank_bytes(numels: list[int], stage: int, world: int, layout: str) -> dict[str, int]:
    """The most loaded rank's bytes, category by category: a category is sharded from its stage on
    (optimizer state from stage 1, gradients from 2, weights from 3) and then holds only the rank's own
    tensors; before that it holds all of them."""
    total, mine = sum(numels), max(greedy_loads(numels, world))
    b = LAYOUTS[layout]
    out = {"params": b["params"] * (mine if stage >= 3 else total),
           "grads": b["grads"] * (mine if stage >= 2 else total),
           "optimizer": b["optimizer"] * (mine if stage >= 1 else total)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
