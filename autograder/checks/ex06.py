"""Checks for exercise 06: shard the optimizer (ZeRO-1 and ZeRO-2 by hand), and a per-rank memory estimator.

Tasks 6.1 and 6.2 run the learner's optimizer on N forked gloo ranks (`ex06_ranks.run_ranks`), a few steps
of a small model (`ex06_refs.Net`) with different data on every rank. Each rank brings back plain data: its
final parameters, the bytes of optimizer state it holds (the tensors in the `state` of every optimizer
reachable from the learner's: its own and any inner one) and for which parameters, the parameters it still
holds gradients for, and the bytes of each collective issued inside `step()` (memlab's CommCounter). The
judge reruns the same model and data on ONE process with the unsharded torch.optim optimizer, averaging the
N ranks' gradients, and compares. Task 6.3's reference is the per-rank bytes term by term over a
largest-first greedy assignment computed with a heap (`ex06_refs.reference_rank_bytes`).
"""

from __future__ import annotations

import random

import torch

from memlab.dist.comm import CommCounter

from .common import Task, allclose, expect_int, expect_type, tasks
from .ex06_ranks import RanksFailed, run_ranks
from .ex06_refs import (LAYOUTS, OFF_LIMITS, Net, batch, loss_fn, no_shortcuts, optimizer_cls, param_groups,
                        reference_rank_bytes, reference_run, unique_params)

__all__ = ["TASKS", "run_ranks", "OFF_LIMITS", "LAYOUTS", "show_ranks"]

SCALAR_SLACK = 16          # bytes per parameter tensor tolerated beyond a perfect balance (Adam's `step` scalars)


# ----------------------------------------------------------------------------- cases
def _case(r, world, opt, *, groups, frozen, unused, shared, steps=3):
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
            "shared": shared}


def _dp_cases(hidden, r):
    """Every hidden run: AdamW with weight decay AND SGD with momentum, parameter groups, a frozen parameter,
    an unused one, a shared one, two different world sizes among 2-4, sizes that do not divide evenly."""
    if not hidden:
        return [_case(r, 2, "adamw", groups=True, frozen=True, unused=True, shared=True, steps=2)]
    n1, n2 = r.sample([2, 3, 4], 2)
    return [_case(r, n1, "adamw", groups=True, frozen=True, unused=True, shared=False),
            _case(r, n2, "sgd", groups=r.random() < 0.5, frozen=r.random() < 0.5, unused=False, shared=True)]


# ----------------------------------------------------------------------------- the learner's side
def _optimizers(obj) -> list:
    """Every torch.optim.Optimizer reachable from obj: itself, its attributes, and lists/dicts in them."""
    found, seen, stack = [], set(), [(obj, 0)]
    while stack:
        o, depth = stack.pop()
        if id(o) in seen or depth > 3 or isinstance(o, torch.Tensor):
            continue
        seen.add(id(o))
        if isinstance(o, torch.optim.Optimizer):
            found.append(o)
        if isinstance(o, (list, tuple, set)):
            kids = list(o)
        elif isinstance(o, dict):
            kids = list(o.values())
        elif isinstance(o, torch.optim.Optimizer) or depth == 0:
            kids = [v for k, v in vars(o).items() if k not in ("param_groups", "state", "defaults")]
        else:
            kids = []
        stack += [(k, depth + 1) for k in kids]
    return found


def _state(opt, params) -> tuple[int, list[int]]:
    """Bytes of the optimizer-state tensors this rank holds, and the indices of the parameters they belong to."""
    index = {id(p): i for i, p in enumerate(params)}
    seen, nbytes, owners = set(), 0, set()
    for o in _optimizers(opt):
        for key, st in o.state.items():
            tensors = [v for v in st.values() if isinstance(v, torch.Tensor)] if isinstance(st, dict) else []
            if id(key) in index and tensors:
                owners.add(index[id(key)])
            for v in tensors:
                k = (v.data_ptr(), v.nbytes)
                if k not in seen:
                    seen.add(k)
                    nbytes += v.nbytes
    return nbytes, sorted(owners)


def _rank_fn(case, cls, task):
    def fn(rank, world):
        model = Net(case)
        params = unique_params(model)
        comm = CommCounter()
        with no_shortcuts(task):
            opt = cls(param_groups(case, model), optimizer_cls(case), **case["kwargs"])
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"{cls.__name__}(...) must be a torch.optim.Optimizer (subclass it), got "
                                f"{type(opt).__name__}")
            for step in range(case["steps"]):
                model.zero_grad(set_to_none=True)
                loss_fn(model, *batch(case, rank, step)).backward()
                with comm:
                    opt.step()
        nbytes, owners = _state(opt, params)
        held = [i for i, p in enumerate(params) if p.grad is not None]
        return {"params": [p.detach().reshape(-1).tolist() for p in params], "state_bytes": nbytes,
                "state_params": owners, "grad_params": held,
                "grads": {str(i): params[i].grad.reshape(-1).tolist() for i in held}, "comm": comm.as_dict()}
    return fn


def _run(task, name):
    def run(case, **names):
        cls = names[name]
        if not isinstance(cls, type):
            raise TypeError(f"{name} must be a class (a torch.optim.Optimizer subclass), got {type(cls).__name__}")
        try:
            return run_ranks(case["world"], _rank_fn(case, cls, task), timeout=60)
        except RanksFailed as e:
            text = str(e)
            if "NoneType" in text:
                text = ("a parameter without a gradient (frozen, or unused by this forward: .grad is None) reached a "
                        "collective or the optimizer: skip it, on every rank alike. " + text)
            raise RanksFailed(text) from None
    return run


def show_ranks(cls, world: int = 2):
    """Run the visible case of task 6.1 with `cls` and print what every rank holds (the test cells use it)."""
    case = _dp_cases(False, random.Random(0))[0]
    case = dict(case, world=world)
    res = run_ranks(world, _rank_fn(case, cls, "show_ranks"))
    unsharded = sum(reference_run(case)[1])
    print(f"{'rank':>4} {'state bytes':>12} {'params with state':>18} {'grads held':>10}  bytes per collective")
    for r, g in enumerate(res):
        comm = ", ".join(f"{k} {v['bytes']:,}" for k, v in sorted(g["comm"].items()))
        print(f"{r:>4} {g['state_bytes']:>12,} {len(g['state_params']):>18} {len(g['grad_params']):>10}  {comm}")
    print(f"the unsharded {case['opt']} on one process holds {unsharded:,} bytes of state for "
          f"{len(res[0]['params'])} parameter tensors")
    return res


# ----------------------------------------------------------------------------- judging
def _what(case):
    bits = [f"{case['world']} ranks", f"{case['opt']} {case['kwargs']}"]
    bits += [w for w, on in (("two parameter groups", case["groups"]), ("a frozen bias", case["frozen"]),
                             ("an unused module (grad None)", case["unused"]),
                             ("a weight shared by two modules (listed twice)", case["shared"])) if on]
    return "[" + ", ".join(bits) + "]"


def _check_params(case, got, ref):
    n = case["world"]
    for r in range(n):
        for i, w in enumerate(ref):
            try:
                allclose(f"rank {r}'s parameter {i}", got[r]["params"][i], w.reshape(-1), rtol=1e-4, atol=1e-5)
            except AssertionError as e:
                others = [q for q in range(n) if q != r]
                hint = []
                same_as_ref = [q for q in others if torch.allclose(torch.tensor(got[q]["params"][i]), w.reshape(-1),
                                                                   rtol=1e-4, atol=1e-5)]
                if same_as_ref:
                    hint.append(f"rank(s) {same_as_ref} have it right: after the step, the owner must send every "
                                f"parameter to all ranks (dist.broadcast(p, src=owner))")
                hint.append("the gradient must be averaged over the ranks exactly once (all-reduce the sum, "
                            "divide by N once)")
                if case["shared"]:
                    hint.append("a parameter listed twice is one tensor: give it one owner and step it once")
                if case["groups"]:
                    hint.append("each parameter group keeps its own lr and weight_decay")
                if case["frozen"] or case["unused"]:
                    hint.append("parameters without a gradient are skipped, not dropped from the others' shares")
                raise AssertionError(f"{e} {_what(case)}. Compared with torch.optim on one process: "
                                     + "; ".join(hint)) from None


def _check_state(case, got, ref_state):
    n = case["world"]
    stateful = [i for i, b in enumerate(ref_state) if b]
    per_rank = [expect_int(f"rank {r}'s state bytes", got[r]["state_bytes"]) for r in range(n)]
    total = sum(ref_state)
    for i in stateful:
        holders = [r for r in range(n) if i in got[r]["state_params"]]
        if len(holders) != 1:
            raise AssertionError(f"parameter {i} has optimizer state on ranks {holders} {_what(case)}: ZeRO-1 keeps "
                                 f"each parameter's state on exactly one rank, its owner"
                                 + (" (every rank stepping every parameter keeps N copies)" if len(holders) > 1
                                    else ""))
    for r in range(n):
        extra = [i for i in got[r]["state_params"] if i not in stateful]
        if extra:
            raise AssertionError(f"rank {r} holds optimizer state for parameter(s) {extra}, which have no gradient "
                                 f"(frozen or unused) {_what(case)}: skip them")
    if sum(per_rank) != total:
        raise AssertionError(f"the ranks hold {sum(per_rank):,} bytes of optimizer state together, expected "
                             f"{total:,} (the unsharded optimizer's state) {_what(case)}")
    bound = total / n + max(ref_state) + SCALAR_SLACK * len(ref_state)
    if max(per_rank) > bound or min(per_rank) == 0:
        raise AssertionError(f"optimizer state per rank {per_rank} bytes is not balanced {_what(case)}: the most "
                             f"loaded rank should hold at most the whole / N plus the largest tensor's state (its "
                             f"bytes should be {bound:,.0f} or less) and every rank some. Assign the largest tensors first, "
                             f"each to the rank with the fewest bytes so far")


def _bytes(g, *names):
    return sum(g["comm"].get(k, {}).get("bytes", 0) for k in names)


def _check_param_comm(case, got, ref, ref_grads):
    n, steps = case["world"], case["steps"]
    moving = sum(w.nbytes for w, gr in zip(ref, ref_grads) if gr is not None)
    everything = sum(w.nbytes for w in ref) + n * max(w.nbytes for w in ref)
    for r in range(n):
        b = _bytes(got[r], "broadcast", "all_gather")
        if not steps * moving <= b <= steps * everything:
            raise AssertionError(f"rank {r} broadcast/all-gathered {b:,} bytes of parameters in {steps} steps, "
                                 f"expected {steps * moving:,} or more (every updated parameter once per step), and no more "
                                 f"than one padded all-gather per step: that should be {steps * everything:,} or "
                                 f"less {_what(case)}")


def _check_dp_grads(case, got, ref_grads):
    """ZeRO-1: after the step every rank holds the average of the ranks' gradients (Adam hardly notices a
    gradient scaled by N, so the parameters alone cannot tell a sum from an average)."""
    for r in range(case["world"]):
        for i, g in enumerate(ref_grads):
            if g is None:
                continue
            if str(i) not in got[r]["grads"]:
                raise AssertionError(f"after the step rank {r} has no gradient for parameter {i} {_what(case)}: "
                                     f"ZeRO-1 all-reduces the gradients and leaves them in .grad")
            try:
                allclose(f"rank {r}'s gradient of parameter {i} after the step", got[r]["grads"][str(i)],
                         g.reshape(-1), rtol=1e-4, atol=1e-6)
            except AssertionError as e:
                hint = " A parameter listed twice is one tensor: reduce it once." if case["shared"] else ""
                raise AssertionError(f"{e} {_what(case)}. Expected the average over the {case['world']} ranks: "
                                     f"all-reduce the sum, then divide by the world size exactly once.{hint}") \
                    from None


def _dp_judge(case, got):
    expect_type("result", got, list)
    assert len(got) == case["world"], f"expected one result per rank ({case['world']}), got {len(got)}"
    ref, ref_state, ref_grads = reference_run(case)
    _check_dp_grads(case, got, ref_grads)
    _check_params(case, got, ref)
    _check_state(case, got, ref_state)
    grad_bytes, steps = sum(g.nbytes for g in ref_grads if g is not None), case["steps"]
    for r in range(case["world"]):
        b = _bytes(got[r], "all_reduce")
        if not steps * grad_bytes <= b <= steps * (grad_bytes + 64):
            raise AssertionError(f"rank {r} all-reduced {b:,} bytes in {steps} steps, expected {steps * grad_bytes:,}"
                                 f" (each existing gradient once per step) {_what(case)}: all-reduce each gradient "
                                 f"exactly once, and skip parameters whose .grad is None")
    _check_param_comm(case, got, ref, ref_grads)


def _zero2_judge(case, got):
    expect_type("result", got, list)
    assert len(got) == case["world"], f"expected one result per rank ({case['world']}), got {len(got)}"
    ref, ref_state, ref_grads = reference_run(case)
    n, steps = case["world"], case["steps"]
    for r in range(n):
        b = _bytes(got[r], "all_reduce")
        if b > 64 * steps:
            raise AssertionError(f"rank {r} all-reduced {b:,} bytes {_what(case)}: ZeRO-2 reduces each gradient to "
                                 f"its owner only (dist.reduce(grad, dst=owner) or a reduce-scatter), so no rank "
                                 f"receives gradients it does not own")
    _check_params(case, got, ref)
    _check_state(case, got, ref_state)
    with_grad = [i for i, g in enumerate(ref_grads) if g is not None]
    for i in with_grad:
        holders = [r for r in range(n) if i in got[r]["grad_params"]]
        owner = [r for r in range(n) if i in got[r]["state_params"]]
        if holders != owner:
            raise AssertionError(f"after the step, parameter {i}'s gradient is held by ranks {holders}; only its "
                                 f"owner {owner} should keep it {_what(case)}: set .grad = None on the others "
                                 f"(that is the memory ZeRO-2 saves)")
        allclose(f"the owner's gradient of parameter {i} after the last step", got[owner[0]]["grads"][str(i)],
                 ref_grads[i].reshape(-1), rtol=1e-4, atol=1e-6)
    for r in range(n):
        extra = [i for i in got[r]["grad_params"] if i not in with_grad]
        if extra:
            raise AssertionError(f"rank {r} holds gradients for parameter(s) {extra}, which have none "
                                 f"(frozen or unused) {_what(case)}")
    grad_bytes = sum(ref_grads[i].nbytes for i in with_grad)
    largest = max(ref_grads[i].nbytes for i in with_grad)
    for r in range(n):
        b = _bytes(got[r], "reduce", "reduce_scatter")
        if not steps * grad_bytes <= b <= steps * (grad_bytes + n * largest):
            raise AssertionError(f"rank {r} reduced/reduce-scattered {b:,} bytes of gradients in {steps} steps, "
                                 f"expected {steps * grad_bytes:,} (each existing gradient once per step, to its "
                                 f"owner) {_what(case)}")
    _check_param_comm(case, got, ref, ref_grads)


# ----------------------------------------------------------------------------- task 6.3: per-rank bytes
def _uneven(r, k):
    """k tensor sizes far from equal: a few big matrices, odd biases, one tensor that may dwarf the rest."""
    sizes = [r.randint(20, 90) * r.randint(20, 90) for _ in range(k)] + [r.randint(5, 300) for _ in range(k)]
    if r.random() < 0.5:
        sizes.append(r.randint(2, 4) * max(sizes))                   # an embedding larger than a fair share
    r.shuffle(sizes)
    return sizes


def _mem_cases(hidden, r):
    if not hidden:
        return [{"numels": [4096, 64, 4096, 64, 1000, 10, 50257], "stage": 2, "world": 4, "layout": "bf16_adam"}]
    layouts = ["bf16_adam", "fp32_adam", r.choice(list(LAYOUTS))]
    out = []
    for stage, layout in zip((1, 2, 3), layouts):
        while True:
            c = {"numels": _uneven(r, r.randint(3, 8)), "stage": stage, "world": r.randint(2, 8), "layout": layout}
            ref = reference_rank_bytes(c["numels"], stage, c["world"], layout)
            if ref["optimizer"] * c["world"] != LAYOUTS[layout]["optimizer"] * sum(c["numels"]):
                break                                            # uneven: the largest rank holds more than 1/N
        out.append(c)
    out.append({"numels": _uneven(r, 3), "stage": 0, "world": r.randint(2, 8), "layout": r.choice(list(LAYOUTS))})
    return out


def _mem_run(case, rank_memory):
    with no_shortcuts("task6_3_rank_memory"):
        out = rank_memory(list(case["numels"]), case["stage"], case["world"], case["layout"])
    if not isinstance(out, dict):
        raise TypeError(f"rank_memory must return a dict, got {type(out).__name__}")
    return {str(k): (v if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v)[:60])
            for k, v in out.items()}


def _mem_judge(case, got):
    expect_type("result", got, dict)
    want = reference_rank_bytes(case["numels"], case["stage"], case["world"], case["layout"])
    keys = sorted(want)
    assert sorted(got) == keys, f"rank_memory must return exactly the keys {keys}, got {sorted(got)}"
    b = LAYOUTS[case["layout"]]
    what = (f"[stage {case['stage']}, {case['world']} ranks, {case['layout']} ({b['params']} + {b['grads']} + "
            f"{b['optimizer']} bytes per parameter), {len(case['numels'])} tensors, Psi = {sum(case['numels']):,}]")
    hints = {"optimizer": "optimizer state is sharded from stage 1 on; mixed-precision Adam keeps K = 12 bytes "
                          "(fp32 master 4 + momentum 4 + variance 4), fp32 Adam K = 8 (the weights are the master)",
             "grads": "gradients are sharded from stage 2 on (each rank keeps only its own tensors' gradients)",
             "params": "weights are sharded only at stage 3"}
    for k in ("params", "grads", "optimizer", "total"):
        v = expect_int(f"rank_memory(...)[{k!r}]", got[k])
        if v != want[k]:
            size = ("; the largest rank holds whole tensors, so more than Psi / N: assign them largest first to "
                    "the least loaded rank and take the fullest rank") if case["stage"] else ""
            hint = hints.get(k, "total is the sum of the three")
            raise AssertionError(f"{k} is {v:,} bytes, expected {want[k]:,} {what}. {hint}{size}")


TASKS = tasks(
    Task("task6_1_sharded_optimizer", ("ShardedOptimizer",), _dp_cases, _run("task6_1_sharded_optimizer",
                                                                             "ShardedOptimizer"), _dp_judge),
    Task("task6_2_reduce_scatter", ("ZeRO2Optimizer",), _dp_cases, _run("task6_2_reduce_scatter", "ZeRO2Optimizer"),
         _zero2_judge),
    Task("task6_3_rank_memory", ("rank_memory",), _mem_cases, _mem_run, _mem_judge),
)
