"""Exercise 06's cases (trusted side): optimizer runs on N ranks (tasks 6.1 and 6.2) and uneven tensor sizes
(task 6.3), and the byte layouts task 6.3 names."""

from __future__ import annotations



def _case(r, world, opt, *, groups, frozen, unused, shared, steps=3, gamma=None):
    depth = r.randint(3, 4)
    h = r.randint(17, 29)
    widths = [r.randint(4, 9)] + [h + r.randint(-2, 2) for _ in range(depth)]
    if opt == "adamw":
        kwargs = {"lr": r.choice([0.01, 0.02, 0.03]), "weight_decay": r.choice([0.05, 0.1, 0.2]),
                  "betas": [0.9, r.choice([0.95, 0.99])]}
    else:
        kwargs = {"lr": r.choice([0.05, 0.1]), "momentum": r.choice([0.8, 0.9]),
                  "weight_decay": r.choice([0.0, 0.01])}
    return {"seed": r.randrange(2**31), "world": world, "widths": widths, "d_out": r.randint(2, 5),
            "batch": r.randint(3, 6), "steps": steps, "opt": opt, "kwargs": kwargs, "groups": groups,
            "bias_lr": round(kwargs["lr"] * r.choice([0.3, 0.5, 2.0]), 4), "frozen": frozen, "unused": unused,
            "shared": shared, "gamma": gamma}


def not_largest_first(sizes: dict, owner: dict, world: int) -> str | None:
    """Why `owner` (key -> rank) is not what the task's rule gives for tensors of `sizes` bytes (key -> bytes):
    largest first, each to a rank with the fewest bytes so far; any rank among equals, any order among tensors of
    the same size. None if it is."""
    load = [0] * world
    by_size: dict[int, list] = {}
    for k, n in sizes.items():
        by_size.setdefault(n, []).append(k)
    for size in sorted(by_size, reverse=True):
        picks = [owner[k] for k in by_size[size]]
        for _ in by_size[size]:
            least = [r for r in range(world) if load[r] == min(load) and r in picks]
            if not least:
                return (f"a tensor of {size} bytes went to rank(s) {sorted(set(picks))} while rank "
                        f"{load.index(min(load))} held the fewest bytes ({min(load)} against "
                        f"{[load[p] for p in sorted(set(picks))]})")
            picks.remove(least[0])
            load[least[0]] += size
    return None


def _greedy_passes(case, size, largest_first: bool) -> bool:
    """Would owners dealt greedily (each tensor, in list order or largest `size` first, to the rank with the least
    `size` so far) be a valid owner map under the text's bytes rule on this case's model?"""
    from memlab.kit.ex06 import Net, param_groups
    params, seen = [], set()
    for g in param_groups(case, Net(case)):                      # the order the optimizer is given them
        for p in (g["params"] if isinstance(g, dict) else [g]):
            if id(p) not in seen and p.requires_grad:
                seen.add(id(p))
                params.append(p)
    order = range(len(params))
    if largest_first:
        order = sorted(order, key=lambda i: size(params[i]), reverse=True)
    load, owner = [0] * case["world"], {}
    for i in order:
        owner[i] = load.index(min(load))
        load[owner[i]] += size(params[i])
    return not_largest_first({i: p.numel() * p.element_size() for i, p in enumerate(params)}, owner,
                             case["world"]) is None


def _list_order_is_largest_first(case) -> bool:
    """Would a greedy in list order (not largest first) give a valid owner map on this case's model?"""
    return _greedy_passes(case, lambda p: p.numel() * p.element_size(), largest_first=False)


def _by_numel_is_by_bytes(case) -> bool:
    """Would balancing by element count give a valid owner map under the bytes rule on this case's model? Only a
    model with tensors of two dtypes tells them apart."""
    return _greedy_passes(case, lambda p: p.numel(), largest_first=True)


def dp_cases(hidden, r):
    """Every hidden run: AdamW with weight decay AND SGD with momentum, parameter groups (the AdamW case) and a
    flat list of tensors (the SGD case: the constructor must accept both forms), a frozen parameter,
    an unused one, a shared one, a learning-rate scheduler changing the outer optimizer's lr after every step
    (the AdamW case; the SGD case half the time), two different world sizes among 2-4, sizes that do not
    divide evenly."""
    if not hidden:
        return [_case(r, 2, "adamw", groups=True, frozen=True, unused=True, shared=True, steps=2, gamma=0.5)]
    n1, n2 = r.sample([2, 3, 4], 2)
    while True:     # sizes on which owners dealt greedily in list order, not largest first, are told apart
        adamw = _case(r, n1, "adamw", groups=True, frozen=True, unused=True, shared=False,
                      gamma=r.choice([0.3, 0.5, 2.0]))
        if not _list_order_is_largest_first(adamw):
            break
    return [adamw,
            _case(r, n2, "sgd", groups=False, frozen=r.random() < 0.5, unused=False, shared=True,
                  gamma=r.choice([None, 0.5, 2.0]))]


def sharded_cases(hidden, r):
    """Task 6.1's cases: dp_cases, and in every hidden run the AdamW case has one float64 layer among float32
    ones (the text balances owners by bytes), redrawn until balancing by element count is told apart as well as
    greedy in list order."""
    cases = dp_cases(hidden, r)
    if not hidden:
        return cases
    adamw = cases[0]
    while True:
        adamw = dict(adamw, float64_layers=[r.randrange(1, len(adamw["widths"]) - 1)])
        if not (_by_numel_is_by_bytes(adamw) or _list_order_is_largest_first(adamw)):
            return [adamw] + cases[1:]
        adamw = dp_cases(hidden, r)[0]


def _uneven(r, k):
    """k tensor sizes far from equal: a few big matrices, odd biases, one tensor that may dwarf the rest."""
    sizes = [r.randint(20, 90) * r.randint(20, 90) for _ in range(k)] + [r.randint(5, 300) for _ in range(k)]
    if r.random() < 0.5:
        sizes.append(r.randint(2, 4) * max(sizes))                   # an embedding larger than a fair share
    r.shuffle(sizes)
    return sizes


def list_order_loads(numels: list[int], world: int) -> list[int]:
    """Elements per rank when tensors go in list order (not largest first) to the least loaded rank: a mistake
    every hidden case of task 6.3 tells apart."""
    loads = [0] * world
    for n in numels:
        loads[loads.index(min(loads))] += n
    return loads


def mem_cases(hidden, r):
    """Every hidden run: stages 0-3, both layouts; every sharded case (stage >= 1) uneven (the fullest rank holds
    more than Psi / N), with its fullest rank NOT rank 0 (which takes the largest tensor), and with a fullest
    rank that assigning in list order instead of largest first gets wrong."""
    if not hidden:
        return [{"numels": [4096, 64, 4096, 64, 1000, 10, 50257], "stage": 2, "world": 4, "layout": "bf16_adam"},
                {"numels": [500, 400, 300, 300, 200], "stage": 3, "world": 2, "layout": "fp32_adam"}]
    from .refs import LAYOUTS, zero_partition_loads      # drawn in the trusted grader only: run.py never imports refs
    layouts = ["bf16_adam", "fp32_adam", r.choice(list(LAYOUTS))]
    out = []
    for stage, layout in zip((1, 2, 3), layouts):
        while True:
            c = {"numels": _uneven(r, r.randint(3, 8)), "stage": stage, "world": r.randint(2, 8), "layout": layout}
            loads = zero_partition_loads(c["numels"], c["world"])
            if (max(loads) * c["world"] != sum(c["numels"])      # uneven: the largest rank holds more than 1/N
                    and loads[0] < max(loads)                    # the fullest rank is not rank 0
                    and max(list_order_loads(c["numels"], c["world"])) != max(loads)):   # order matters
                break
        out.append(c)
    out.append({"numels": _uneven(r, 3), "stage": 0, "world": r.randint(2, 8), "layout": r.choice(list(LAYOUTS))})
    return out
