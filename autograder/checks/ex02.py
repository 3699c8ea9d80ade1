"""Checks for exercise 02, "Checkpointed models" (the contract: autograder/checks/common.py).

What is graded is behaviour, on modules the checks own (ex02_refs.py):
  * `run` (the learner's process) runs the learner's module on stacks of counting
    blocks or memlab's GPT built from the case's seed, and returns the outputs,
    gradient fingerprints, each block's forward calls (counted inside forward(),
    recomputations included) and the peak activation memory, measured with memlab's
    tracker (memlab.checkpointing.activation_peak, bound before any learner code runs);
  * `judge` (the grader) recomputes the plain model's outputs and gradients with
    autograd, and the peak of the scheme written with torch.utils.checkpoint, and
    compares; the planner's plan is judged under the notebook's cost model against
    brute force over every plan, or an exhaustive state search for the 40-layer chain.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from memlab.checkpointing import activation_peak

from .common import Task, mb, tasks
from .ex02_refs import (CountingBlock, RefEveryK, RefSegments, fingerprint as _fingerprint, plain_forward,
                        round_robin_segments, same as _same)

from .ex02_refs import RTOL


# ----------------------------------------------------------------------------- plain-data helpers
def _crash(task, desc, what, e) -> dict:
    msg = f"{task} ({desc}): {what} raised {type(e).__name__}: {str(e)[:300]}"
    if "does not require grad" in str(e):
        msg += (". The output is cut from the autograd graph: with use_reentrant=True, a checkpoint whose "
                "inputs do not require grad (here the input batch) returns an output that does not require "
                "grad either. Use use_reentrant=False.")
    return {"problem": msg}


def _problem(got):
    if isinstance(got, dict) and "problem" in got:
        raise AssertionError(got["problem"])


# ----------------------------------------------------------------------------- stacks (tasks 2.1, 2.2)
def _stack(case):
    """(container given to the learner, the blocks, x, weights), rebuilt from the case."""
    torch.manual_seed(case["seed"])
    blocks = [CountingBlock(case["d"], 4 * case["d"]) for _ in range(case["n"])]
    container = {"Sequential": lambda: nn.Sequential(*blocks), "ModuleList": lambda: nn.ModuleList(blocks),
                 "list": lambda: list(blocks)}[case["container"]]()
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["rows"], case["d"], generator=g).requires_grad_(case["x_grad"])
    weights = torch.randn(case["rows"], case["d"], generator=g)        # the loss: sum(output * weights)
    return container, blocks, x, weights


def _step(fn, params, x, weights):
    for p in params:
        p.grad = None
    x.grad = None
    out = fn(x)
    (out * weights).sum().backward()
    return out


def _stack_run(task, case, make):
    container, blocks, x, weights = _stack(case)
    desc = _stack_desc(case)
    try:
        wrapped = make(container)
    except Exception as e:  # noqa: BLE001 - a crash of the submission is a failed check with a message
        return _crash(task, desc, "building your module", e)
    if not isinstance(wrapped, nn.Module):
        return {"problem": f"{task}: your wrapper must be an nn.Module (got {type(wrapped).__name__})"}
    params = [p for b in blocks for p in b.parameters()]
    mine = {id(p) for p in wrapped.parameters()}
    for b in blocks:
        b.calls = 0
    try:
        out = _step(wrapped, params, x, weights)
    except Exception as e:  # noqa: BLE001
        return _crash(task, desc, "a forward + backward through your module", e)
    calls = [b.calls for b in blocks]
    if not isinstance(out, torch.Tensor):
        return {"problem": f"{task} ({desc}): your module must return a tensor, got {type(out).__name__}"}
    result = {"unregistered": sum(id(p) not in mine for p in params), "shape": list(out.shape),
              "out": out.detach().double().tolist(), "x_grad": None if x.grad is None else x.grad.double().tolist(),
              "grads": [_fingerprint(p.grad) for p in params], "calls": calls}
    try:
        result["peak"] = activation_peak(wrapped, lambda: (wrapped(x) * weights).sum()).peak
    except Exception as e:  # noqa: BLE001
        return _crash(task, desc, "measuring the peak memory of your module", e)
    return result


def _stack_desc(case):
    k = f", k={case['k']}" if "k" in case else ""
    return f"{case['n']} blocks in a {case['container']}{k}, input requires_grad={case['x_grad']}"


def _stack_judge(task, case, got, expected_calls, ref_scheme, slack_blocks):
    _problem(got)
    desc = _stack_desc(case)
    _, blocks, x, weights = _stack(case)
    params = [p for b in blocks for p in b.parameters()]
    assert got["unregistered"] == 0, (
        f"{task} ({desc}): {got['unregistered']} of the blocks' {len(params)} parameters are not parameters of your "
        f"module. Register the blocks as submodules (self.blocks = nn.ModuleList(blocks)) so that an optimizer and "
        f".to(device) see them; do not copy them.")
    ref = _step(lambda t: plain_forward(blocks, t), params, x, weights).detach().double()
    shape_ok = got["shape"] == list(ref.shape)
    mine = torch.tensor(got["out"], dtype=torch.float64) if shape_ok else None
    assert shape_ok and torch.allclose(mine, ref, rtol=RTOL, atol=1e-6), (
        f"{task} ({desc}): the output differs from running the blocks in order "
        f"({'max |diff| %.2e' % (mine - ref).abs().max().item() if shape_ok else 'shape ' + str(got['shape'])}). "
        f"Checkpointing must not change the forward: run every block exactly once, in order, on the previous output.")
    if case["x_grad"]:
        gx = None if got["x_grad"] is None else torch.tensor(got["x_grad"], dtype=torch.float64)
        assert gx is not None and torch.allclose(gx, x.grad.double(), rtol=RTOL, atol=1e-6), (
            f"{task} ({desc}): the gradient of the INPUT differs from the plain model's. Did you detach the "
            f"checkpointed input (x.detach())? That cuts the graph: gradients stop at the checkpoint.")
    bad = [i for i, (g, p) in enumerate(zip(got["grads"], params)) if g is None or not _same(g, _fingerprint(p.grad))]
    if bad:
        none = any(got["grads"][i] is None for i in bad)
        hint = ("Some parameters got NO gradient at all: with use_reentrant=True a checkpoint whose inputs do not "
                "require grad (here the input batch) gives the blocks inside it no gradients; use "
                "use_reentrant=False. A detached checkpoint input (x.detach()) also cuts the gradient to "
                "everything before it." if none else
                "Did you detach the checkpointed input, or run a block on something other than the previous "
                "block's output?")
        raise AssertionError(f"{task} ({desc}): {len(bad)} of {len(params)} parameter gradients differ from the "
                             f"unmodified model's. {hint}")
    calls = got["calls"]
    if calls != expected_calls:
        more = [i for i, (c, e) in enumerate(zip(calls, expected_calls)) if c > e]
        less = [i for i, (c, e) in enumerate(zip(calls, expected_calls)) if c < e]
        why = []
        if less:
            why.append(f"blocks {less} ran fewer times than expected: a checkpointed block runs twice (forward, "
                       f"then the recomputation in backward); one that ran once was not checkpointed"
                       + (", and one that ran 0 times was not called at all: use the blocks you are given, do not "
                          "copy them." if any(calls[i] == 0 for i in less) else "."))
        if more:
            why.append(f"blocks {more} ran more times than expected: do you call a block twice in forward (for "
                       f"example once under torch.no_grad() and once normally), or checkpoint it twice?")
        raise AssertionError(f"{task} ({desc}): forward calls per block in one forward + backward were {calls}, "
                             f"expected {expected_calls}. " + " ".join(why))
    scheme = ref_scheme(blocks)
    ref_peak = activation_peak(scheme, lambda: (scheme(x) * weights).sum()).peak
    plain_peak = activation_peak(scheme, lambda: (plain_forward(blocks, x) * weights).sum()).peak
    bound = ref_peak + int(slack_blocks * _per_block_bytes(case))
    assert got["peak"] <= bound, (
        f"{task} ({desc}): peak activation memory {mb(got['peak'])} is above the {mb(bound)} the checkpointing "
        f"scheme needs (no checkpointing: {mb(plain_peak)}). Checkpointed blocks must not keep their activations: "
        f"do not also run them outside the checkpoint, and do not hold on to intermediate outputs.")


def _per_block_bytes(case):
    """Bytes one CountingBlock keeps for backward when run normally, its input included (measured)."""
    torch.manual_seed(case["seed"])
    block = nn.Sequential(CountingBlock(case["d"], 4 * case["d"]))
    x = torch.randn(case["rows"], case["d"])
    return activation_peak(block, lambda: block(x * 1.0).sum()).stored


def _stack_case(r, n, container, x_grad):
    return {"n": n, "d": r.choice([16, 24, 32]), "rows": r.choice([32, 48, 64]), "container": container,
            "x_grad": x_grad, "seed": r.randrange(2**31)}


# ----------------------------------------------------------------------------- task2_1
def _every_k_cases(hidden, r):
    if not hidden:
        return [dict(n=8, d=32, rows=64, container="Sequential", x_grad=True, k=2, seed=21),
                dict(n=8, d=32, rows=64, container="ModuleList", x_grad=False, k=3, seed=22)]
    containers = ["Sequential", "ModuleList", "list"]
    r.shuffle(containers)                            # every container, an input without grad, in every run
    out = []
    for container, x_grad, kind in zip(containers, (True, False, r.random() < 0.5), ("one", "uneven", "beyond")):
        n = r.randint(6, 14)
        k = {"one": 1, "uneven": r.choice([k for k in range(2, n) if n % k]), "beyond": n + r.randint(0, 2)}[kind]
        out.append({**_stack_case(r, n, container, x_grad), "k": k})
    return out + [{"validate": [0, -1]}]


def _every_k_run(case, CheckpointEveryK):
    if "validate" in case:
        raised = {}
        for bad in case["validate"]:
            try:
                CheckpointEveryK([CountingBlock(8, 8) for _ in range(3)], bad)
                raised[str(bad)] = None
            except Exception as e:  # noqa: BLE001
                raised[str(bad)] = type(e).__name__
        return raised
    return _stack_run("task2_1", case, lambda blocks: CheckpointEveryK(blocks, case["k"]))


def _every_k_judge(case, got):
    if "validate" in case:
        for bad, raised in got.items():
            assert raised == "ValueError", (
                f"task2_1: CheckpointEveryK(blocks, k={bad}) should raise ValueError: k must be a positive int"
                + (f" (it raised {raised})" if raised else ""))
        return
    k = case["k"]
    _stack_judge("task2_1", case, got, [2 if i % k == 0 else 1 for i in range(case["n"])],
                 lambda blocks: RefEveryK(blocks, k), 0.5)   # the reference scheme's peak plus half a block


# ----------------------------------------------------------------------------- task2_2
def _sqrt_cases(hidden, r):
    if not hidden:
        return [{"ns": list(range(1, 30)) + [64, 100, 101]},
                dict(n=16, d=32, rows=64, container="Sequential", x_grad=True, seed=23)]
    s = r.randint(2, 19)
    ns = [1, s * s, s * s + 1, s * s - 1] + [r.randint(2, 400) for _ in range(36)]   # squares and their neighbours
    containers = ["Sequential", "ModuleList", "list"]
    r.shuffle(containers)
    sizes = [r.choice([9, 16]), r.choice([10, 11, 13, 14, 17, 18, 19]), r.randint(9, 20)]   # even and uneven
    return [{"ns": ns}] + [_stack_case(r, n, c, x_grad) for n, c, x_grad in
                           zip(sizes, containers, (True, False, r.random() < 0.5))]


def _plain_pairs(segs):
    try:
        out = []
        for s in segs:
            s = tuple(s)
            out.append([v if type(v) is int else repr(v) for v in s])
        return out
    except TypeError:
        return repr(segs)[:200]


def _sqrt_run(case, sqrt_segments, SqrtCheckpointed):
    if "ns" in case:
        out = {}
        for n in case["ns"]:
            try:
                out[str(n)] = _plain_pairs(sqrt_segments(n))
            except Exception as e:  # noqa: BLE001
                out[str(n)] = {"raised": f"{type(e).__name__}: {str(e)[:200]}"}
        return out
    return _stack_run("task2_2", case, SqrtCheckpointed)


def _judge_segments(n, segs):
    if isinstance(segs, dict):
        raise AssertionError(f"task2_2: sqrt_segments({n}) raised {segs['raised']}")
    ok = isinstance(segs, list) and all(len(s) == 2 and all(type(v) is int for v in s) for s in segs)
    assert ok, f"task2_2: sqrt_segments({n}) must return a list of (start, stop) pairs of ints, got {segs!r}"
    want = next(s for s in range(1, n + 1) if s * s >= n)          # ceil(sqrt(n)), counted up
    assert segs and segs[0][0] == 0 and segs[-1][1] == n and all(
        a[1] == b[0] for a, b in zip(segs, segs[1:])) and all(s[1] > s[0] for s in segs), (
        f"task2_2: sqrt_segments({n}) = {segs}: the segments must be non-empty, contiguous and cover "
        f"0..{n} exactly (each stop is the next start; Python slice convention, stop excluded)")
    sizes = [s[1] - s[0] for s in segs]
    assert len(segs) == want, (
        f"task2_2: sqrt_segments({n}) returned {len(segs)} segments, expected ceil(sqrt({n})) = {want}")
    assert max(sizes) - min(sizes) <= 1, (
        f"task2_2: sqrt_segments({n}) has segment lengths {sizes}; they must differ by at most one "
        f"(spread the remainder n % segments over the first or last segments)")


def _sqrt_judge(case, got):
    if "ns" in case:
        for n in case["ns"]:
            _judge_segments(n, got[str(n)])
        return
    n = case["n"]
    segments = round_robin_segments(n, next(s for s in range(1, n + 1) if s * s >= n))
    try:   # another balanced order of the segment lengths may shift the peak by up to one block
        _stack_judge("task2_2", case, got, [2] * n, lambda blocks: RefSegments(blocks, segments), 1)
    except AssertionError as e:
        calls = got.get("calls", []) if isinstance(got, dict) else []
        if "forward calls per block" in str(e) and calls and all(c == 1 for c in calls[segments[-1][0]:]):
            raise AssertionError(str(e) + " The last segment was not checkpointed: "
                                 "torch.utils.checkpoint.checkpoint_sequential leaves it out on purpose, but "
                                 "this task asks you to checkpoint every segment.") from None
        raise


# ----------------------------------------------------------------------------- task2_3 and task2_4
from .ex02_tasks34 import TASK3, TASK4  # noqa: E402  (the planner and the GPT, split by size)

TASKS = tasks(
    Task("task2_1_checkpoint_every_k", ("CheckpointEveryK",), _every_k_cases, _every_k_run, _every_k_judge),
    Task("task2_2_sqrt_segments", ("sqrt_segments", "SqrtCheckpointed"), _sqrt_cases, _sqrt_run, _sqrt_judge),
    TASK3,
    TASK4,
)
