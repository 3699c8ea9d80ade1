"""Exercise 06's judges: every rank's parameters, gradients, optimizer state and collective bytes against the
one-process reference (tasks 6.1 and 6.2), and the per-rank bytes of task 6.3."""

from __future__ import annotations

import torch

from memlab.kit.ex06 import Net, unique_params

from ..common import allclose, expect_int, expect_type
from .cases import not_largest_first
from .refs import LAYOUTS
from .refs import reference_rank_bytes, reference_run


SCALAR_SLACK = 16          # bytes per parameter tensor tolerated beyond a perfect balance (Adam's `step` scalars)


# ----------------------------------------------------------------------------- judging
def _what(case):
    bits = [f"{case['world']} ranks", f"{case['opt']} {case['kwargs']}"]
    bits += [w for w, on in (("two parameter groups", case["groups"]), ("a frozen bias", case["frozen"]),
                             ("an unused module (grad None)", case["unused"]),
                             ("a weight shared by two modules (listed twice)", case["shared"]),
                             (f"a StepLR scheduler multiplying the lr by {case.get('gamma')} after every step",
                              case.get("gamma")),
                             (f"float64 layer(s) {case.get('float64_layers')} among float32 ones",
                              case.get("float64_layers"))) if on]
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
                if case.get("gamma"):
                    hint.append("a scheduler changes the lr in your optimizer's param_groups after every step: "
                                "copy each group's settings to the inner optimizer's group before its step")
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
        raise AssertionError(f"the ranks hold {sum(per_rank):,} bytes of optimizer state together, "
                             f"{'more' if sum(per_rank) > total else 'less'} than the unsharded optimizer's state "
                             f"{_what(case)}: each parameter with a gradient has its state on exactly one rank")
    bound = total / n + max(ref_state) + SCALAR_SLACK * len(ref_state)
    if max(per_rank) > bound or min(per_rank) == 0:
        raise AssertionError(f"optimizer state per rank {per_rank} bytes is not balanced {_what(case)}: the most "
                             f"loaded rank should hold at most the whole / N plus the largest tensor's state (its "
                             f"bytes should be {bound:,.0f} or less) and every rank some. Assign the largest "
                             f"tensors first, "
                             f"each to the rank with the fewest bytes so far")


def _bytes(g, *names):
    return sum(g["comm"].get(k, {}).get("bytes", 0) for k in names)


def _check_param_comm(case, got, ref, ref_grads):
    n, steps = case["world"], case["steps"]
    moving = sum(w.nbytes for w, gr in zip(ref, ref_grads) if gr is not None)
    largest = {}                                   # one padded flat buffer per dtype: its padding < n x its largest
    for w in ref:
        largest[w.dtype] = max(largest.get(w.dtype, 0), w.nbytes)
    everything = sum(w.nbytes for w in ref) + n * sum(largest.values())
    for r in range(n):
        b = _bytes(got[r], "broadcast", "all_gather")
        if not steps * moving <= b <= steps * everything:
            raise AssertionError(f"rank {r} broadcast/all-gathered {b:,} bytes of parameters in {steps} steps, "
                                 f"{'fewer' if b < steps * moving else 'more'} than it should {_what(case)}: every "
                                 f"updated parameter reaches every rank once per step, and no more than one padded "
                                 f"all-gather per dtype per step")


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
            shared = " A parameter listed twice is one tensor: reduce it once." if case["shared"] else ""
            allclose(f"rank {r}'s gradient of parameter {i} after the step", got[r]["grads"][str(i)],
                     g.reshape(-1), rtol=1e-4, atol=1e-6,
                     hint=f" {_what(case)}. Expected the average over the {case['world']} ranks: all-reduce the sum, "
                          f"then divide by the world size exactly once.{shared}")


def _check_owner(case, got):
    """self.owner against the rule of the task text, replayed naively: the parameters that require a gradient, by
    bytes, largest first, each to a rank with the fewest bytes so far (any rank among equals, and any order among
    tensors of the same size)."""
    params = unique_params(Net(case))
    want = {str(i) for i, p in enumerate(params) if p.requires_grad}
    owners = [got[r].get("owner") for r in range(case["world"])]
    for r, o in enumerate(owners):
        if not isinstance(o, dict):
            raise AssertionError(f"rank {r}: {o} {_what(case)}: store the assignment as self.owner, a dict "
                                 f"tensor -> rank")
        if set(o) != want:
            extra = sorted(set(o) - want, key=int)
            raise AssertionError(f"rank {r}'s self.owner has parameters {sorted(o, key=int)}; every parameter that "
                                 f"requires a gradient, and only those, gets an owner {_what(case)}"
                                 + (f" (parameter(s) {extra} are frozen)" if extra else ""))
        if o != owners[0]:
            raise AssertionError(f"ranks 0 and {r} computed different owners {_what(case)}: every rank must compute "
                                 f"the same assignment from the same list")
    sizes = {i: params[int(i)].numel() * params[int(i)].element_size() for i in want}
    why = not_largest_first(sizes, owners[0], case["world"])
    if why:
        raise AssertionError(f"self.owner is not balanced by bytes {_what(case)}: {why}; take the tensors largest "
                             f"first (by bytes) and give each to the rank with the fewest bytes so far")


def dp_judge(case, got):
    expect_type("result", got, list)
    assert len(got) == case["world"], f"expected one result per rank ({case['world']}), got {len(got)}"
    ref, ref_state, ref_grads = reference_run(case)
    _check_owner(case, got)
    _check_dp_grads(case, got, ref_grads)
    _check_params(case, got, ref)
    _check_state(case, got, ref_state)
    grad_bytes, steps = sum(g.nbytes for g in ref_grads if g is not None), case["steps"]
    for r in range(case["world"]):
        b = _bytes(got[r], "all_reduce")
        if not steps * grad_bytes <= b <= steps * (grad_bytes + 64):
            raise AssertionError(f"rank {r} all-reduced {b:,} bytes in {steps} steps, "
                                 f"{'fewer' if b < steps * grad_bytes else 'more'} than each existing gradient once "
                                 f"per step {_what(case)}: all-reduce each gradient exactly once, and skip "
                                 f"parameters whose .grad is None")
    _check_param_comm(case, got, ref, ref_grads)


def zero2_judge(case, got):
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
                                 f"{'fewer' if b < steps * grad_bytes else 'more'} than each existing gradient once "
                                 f"per step, to its owner {_what(case)}")
    _check_param_comm(case, got, ref, ref_grads)


# ----------------------------------------------------------------------------- task 6.3: per-rank bytes
def mem_judge(case, got):
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
            size = ("; the largest rank holds whole tensors, so more than Psi / N: assign them largest first "
                    "(sort the sizes, do not keep the list's order) to the least loaded rank, and report the "
                    "fullest rank (any rank may be the fullest, not only rank 0, which takes the largest tensor)") \
                if case["stage"] else ""
            hint = hints.get(k, "total is the sum of the three")
            raise AssertionError(f"{k} is {v:,} bytes, {'more' if v > want[k] else 'less'} than the reference "
                                 f"{what}. {hint}{size}")
