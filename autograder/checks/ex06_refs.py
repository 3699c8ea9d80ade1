"""Exercise 06's shared pieces: the small model every rank trains, its data, the forbidden calls, and the
trusted references (an unsharded torch.optim run on one process; per-rank bytes term by term).

The model is built from a case (plain data) the same way in the ranks and in the judge: widths that are
not powers of two, an optional frozen bias (requires_grad False), an optional module the forward never
uses (its gradients stay None), and an optional weight shared by two modules (listed twice in the
parameter list handed to the optimizer).
"""

from __future__ import annotations

import contextlib
import heapq
import os
import sys

import torch
from torch import nn


# ----------------------------------------------------------------------------- the model and its data
class Net(nn.Module):
    def __init__(self, case):
        super().__init__()
        w = case["widths"]                                       # [d_in, h1, ..., h_last]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(w[:-1], w[1:]))
        h = w[-1]
        self.enc, self.dec = nn.Linear(h, h), nn.Linear(h, h)
        if case["shared"]:
            self.dec.weight = self.enc.weight                    # one tensor, two modules
        self.head = nn.Linear(h, case["d_out"])
        self.extra = nn.Linear(3, 5) if case["unused"] else None   # never called: its .grad stays None
        g = torch.Generator().manual_seed(case["seed"])
        with torch.no_grad():
            for p in self.parameters():                          # deterministic, whatever the global RNG
                p.copy_(torch.randn(p.shape, generator=g) / max(1, p.shape[-1]) ** 0.5)
        if case["frozen"]:
            self.layers[0].bias.requires_grad_(False)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        x = torch.tanh(self.dec(torch.tanh(self.enc(x))))
        return self.head(x)

    def listed_params(self):
        """Module by module, as a careless `[p for m in modules for p in m.parameters()]` lists them: a
        shared weight appears twice."""
        mods = [*self.layers, self.enc, self.dec, self.head] + ([self.extra] if self.extra is not None else [])
        return [p for m in mods for p in m.parameters()]


def unique_params(model: Net) -> list[torch.Tensor]:
    """The model's distinct parameters, in order (the index used in every result)."""
    return list(model.parameters())


def param_groups(case, model: Net):
    """What the optimizer is given: a flat list, or two groups (weights / biases with their own lr and
    weight decay). A shared weight is listed twice in either form."""
    listed = model.listed_params()
    if not case["groups"]:
        return listed
    return [{"params": [p for p in listed if p.dim() > 1]},
            {"params": [p for p in listed if p.dim() == 1], "lr": case["bias_lr"], "weight_decay": 0.0}]


def optimizer_cls(case):
    return {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[case["opt"]]


def batch(case, rank: int, step: int):
    """Rank `rank`'s data at step `step`: different on every rank and every step."""
    g = torch.Generator().manual_seed(case["seed"] * 7919 + 1000 * step + rank + 1)
    x = torch.randn(case["batch"], case["widths"][0], generator=g)
    y = torch.randn(case["batch"], case["d_out"], generator=g)
    return x, y


def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()


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
LAYOUTS = {   # bytes per element: weights, gradients, optimizer state (Rajbhandari et al. 2020, Sec. 3.1)
    "bf16_adam": {"params": 2, "grads": 2, "optimizer": 4 + 4 + 4},      # fp32 master + momentum + variance
    "fp32_adam": {"params": 4, "grads": 4, "optimizer": 4 + 4},          # momentum + variance
}


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


# ----------------------------------------------------------------------------- what the learner may not call
OFF_LIMITS = ("torch.distributed.optim.ZeroRedundancyOptimizer, DeepSpeed, memlab.zero* and "
              "memlab.estimate.zero_model_state_bytes")


def _forbidden(filename: str, name: str) -> bool:
    f = filename.replace(os.sep, "/")
    return (f.endswith("/zero_redundancy_optimizer.py") or "/deepspeed/" in f
            or f.endswith(("/memlab/dist/zero.py", "/memlab/dist/zero_train.py", "/memlab/dist/zero_scale.py"))
            or (f.endswith("/memlab/core/estimate.py") and name == "zero_model_state_bytes"))


@contextlib.contextmanager
def no_shortcuts(task: str):
    """While the learner's code runs, record calls into the off-limits libraries; raise afterwards."""
    hits: list[str] = []
    previous = sys.getprofile()

    def profile(frame, event, arg):
        if event == "call" and _forbidden(frame.f_code.co_filename, frame.f_code.co_name):
            hits.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)
    if hits:
        raise AssertionError(f"{task} called {sorted(set(hits))[:3]}: {OFF_LIMITS} are off limits here; "
                             f"write the sharding yourself")
