"""Exercise 02's judges (the grader): recompute the plain model's outputs and gradients with autograd, and
the peak of the scheme built by PyTorch's checkpointing pass (refs.py), and compare; the planner's plan is judged
under the notebook's cost model against brute force over every plan, or an exhaustive state search for the
40-layer chain."""

from __future__ import annotations

import torch
import torch.nn as nn

from memlab.checkpointing import activation_peak

from ..common import expect_int, expected, mb
from .cases import NOISE_BYTES, outside_the_tracker
from .inputs import (CountingBlock, _gpt_desc, _gpt_setup, _stack, _stack_desc, _step, _train,
                     fingerprint as _fingerprint)
from .refs import (RTOL, RefSegments, brute_force_plan, min_peak, plain_forward, plan_cost, plan_peak,
                   ref_checkpointed_gpt, ref_every_k, round_robin_segments, same, search_min_cost)

def _problem(got):
    if isinstance(got, dict) and "problem" in got:
        raise AssertionError(got["problem"])


# ----------------------------------------------------------------------------- stacks (tasks 2.1, 2.2)
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
    if case.get("watched"):              # fingerprints of the output and of x's gradient (run.py)
        out_ok = shape_ok and same(got["out"], _fingerprint(ref))
        diff = "its fingerprint differs" if shape_ok else "shape " + str(got["shape"])
    else:
        mine = torch.tensor(got["out"], dtype=torch.float64) if shape_ok else None
        out_ok = shape_ok and torch.allclose(mine, ref, rtol=RTOL, atol=1e-6)
        diff = "max |diff| %.2e" % (mine - ref).abs().max().item() if shape_ok else "shape " + str(got["shape"])
    assert out_ok, (
        f"{task} ({desc}): the output differs from running the blocks in order ({diff}). "
        f"Checkpointing must not change the forward: run every block exactly once, in order, on the previous output.")
    if case["x_grad"]:
        if case.get("watched"):
            gx_ok = same(got["x_grad"], _fingerprint(x.grad))
        else:
            gx = None if got["x_grad"] is None else torch.tensor(got["x_grad"], dtype=torch.float64)
            gx_ok = gx is not None and torch.allclose(gx, x.grad.double(), rtol=RTOL, atol=1e-6)
        assert gx_ok, (
            f"{task} ({desc}): the gradient of the INPUT differs from the plain model's. Did you detach the "
            f"checkpointed input (x.detach())? That cuts the graph: gradients stop at the checkpoint.")
    bad = [i for i, (g, p) in enumerate(zip(got["grads"], params)) if g is None or not same(g, _fingerprint(p.grad))]
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
                             f"expected {expected(expected_calls)}. " + " ".join(why))
    scheme = ref_scheme(blocks)
    ref_peak = activation_peak(scheme, lambda: (scheme(x) * weights).sum()).peak
    bound = ref_peak + int(slack_blocks * _per_block_bytes(case))
    if got["peak"] > bound:
        plain_peak = activation_peak(scheme, lambda: (plain_forward(blocks, x) * weights).sum()).peak
        raise AssertionError(
            f"{task} ({desc}): peak activation memory {mb(got['peak'])} is above the {mb(bound)} the checkpointing "
            f"scheme needs (no checkpointing: {mb(plain_peak)}). Checkpointed blocks must not keep their "
            f"activations: do not also run them outside the checkpoint, and do not hold on to intermediate outputs.")


def _per_block_bytes(case):
    """Bytes one CountingBlock keeps for backward when run normally, its input included (measured)."""
    torch.manual_seed(case["seed"])
    block = nn.Sequential(CountingBlock(case["d"], 4 * case["d"]))
    x = torch.randn(case["rows"], case["d"])
    return activation_peak(block, lambda: block(x * 1.0).sum()).stored


# ----------------------------------------------------------------------------- task2_1
def _every_k_judge(case, got):
    if "validate" in case:
        for bad in case["validate"]:
            raised = got.get(str(bad)) if isinstance(got, dict) else None
            what = {bool: "a bool", float: "a float", str: "a string"}.get(type(bad), "not positive")
            assert raised == "ValueError", (
                f"task2_1: CheckpointEveryK(blocks, k={bad!r}) should raise ValueError: k must be a positive int, "
                f"and this k is {what}" + (f" (it raised {raised})" if raised else " (it raised nothing)")
                + (". bool is a subclass of int: test isinstance(k, bool) first." if type(bad) is bool else "")
                + (". Do not convert k with int(): reject anything that is not an int." if type(bad) in (float, str)
                   else ""))
        return
    k = case["k"]
    _stack_judge("task2_1", case, got, [2 if i % k == 0 else 1 for i in range(case["n"])],
                 lambda blocks: ref_every_k(blocks, k), 0.5)   # the reference scheme's peak plus half a block


# ----------------------------------------------------------------------------- task2_2
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
        f"task2_2: sqrt_segments({n}) returned {len(segs)} segments, expected ceil(sqrt({n})) = {expected(want)}")
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
    # what the forward leaves for the backward: one input per segment after the first (whose input is the caller's
    # x), measured 2.0-4.0 block inputs for 9-18 blocks; one per block when each block is checkpointed on its own
    _, blocks, x, weights = _stack(case)
    one_input = x.numel() * x.element_size()
    stored = expect_int("the bytes kept for backward", got.get("stored"))
    assert stored < (len(segments) - 0.5) * one_input, (
        f"task2_2 ({_stack_desc(case)}): after the forward your module keeps {mb(stored)} for the backward, "
        f"{stored / one_input:.1f} block inputs; {len(segments)} segments keep the input of each segment but the "
        f"first (that one is the caller's x). Checkpoint each SEGMENT as one region (one checkpoint call around "
        f"the blocks start..stop), not each block on its own.")


# ----------------------------------------------------------------------------- task2_3
def _show(keep):
    return "".join("K" if k else "." for k in keep)


def _plan_judge(case, got):
    m, c, budget, desc = case["m"], case["c"], case["budget"], case["desc"]
    if "too_slow" in got:
        raise AssertionError(f"task2_3: your planner took more than {got['too_slow']} s on {desc}; trying every "
                             f"subset (2**{len(m)} plans) cannot finish: use dynamic programming over (next layer, "
                             f"bytes kept).")
    want = brute_force_plan(m, c, budget)[0] if len(m) <= 12 else search_min_cost(m, c, budget)
    if want is None:
        if "raised" in got:
            assert got["raised"] == "ValueError", (
                f"task2_3 ({desc}): for a budget no plan can meet, raise ValueError; your planner raised "
                f"{got['raised']}: {got['message']}")
            assert "budget" in got["message"].lower(), (
                f"task2_3 ({desc}): raise ValueError with a message that says the budget cannot be met (mention "
                f"the budget), got {got['message']!r}")
            return
        raise AssertionError(f"task2_3 ({desc}): no plan fits a budget of {budget} bytes (the smallest possible "
                             f"peak is {min_peak(m)}), yet your planner returned {got['keep']!r} instead of raising "
                             f"ValueError. Never return a plan that breaks the budget.")
    if "raised" in got:
        raise AssertionError(f"task2_3 ({desc}): your planner raised {got['raised']} ({got['message']}), but a plan "
                             f"fits this budget" + (" (a plan may use the budget exactly: peak <= budget)"
                                                    if got["raised"] == "ValueError" else ""))
    keep = got["keep"]
    assert isinstance(keep, list) and len(keep) == len(m) and all(type(k) is bool for k in keep), (
        f"task2_3 ({desc}): plan_checkpoints must return one bool per layer ({len(m)}), got {keep!r}")
    peak, cost = plan_peak(m, keep), plan_cost(c, keep)
    assert peak <= budget, (
        f"task2_3 ({desc}): your plan {_show(keep)} peaks at {peak} bytes, over the budget of {budget}. Check every "
        f"moment of the cost model: the end of the forward (all kept outputs) and each recomputed run (the outputs "
        f"kept before it plus the whole run).")
    assert cost == want, (
        f"task2_3 ({desc}): your plan {_show(keep)} fits (peak {peak}) but costs {cost}; the cheapest plan that "
        f"fits costs {want}. A greedy choice (keep the expensive or small layers first) is not optimal in "
        f"general: search over where each recomputed run starts and ends, with the bytes kept so far as part of "
        f"the state (dynamic programming); and remember the plan may end with a recomputed run.")


# ----------------------------------------------------------------------------- task2_4
def _gpt_judge(case, got):
    if "problem" in got:
        raise AssertionError(got["problem"])
    cfg, plain, batches = _gpt_setup(case)
    desc = _gpt_desc(case)
    want = _train(plain, case, batches)
    assert got["logits_shape"] == want["logits_shape"] and _from(got["logits"], want["logits"]), (
        f"task2_4 ({desc}): model(idx) must return the same logits as GPT (shape {tuple(want['logits_shape'])}); "
        f"yours {'differ' if got['logits_shape'] == want['logits_shape'] else 'have the wrong shape'}. "
        f"Keep GPT.forward's steps (embeddings, position table or rope, dropout, blocks, ln_f, head, loss).")
    for step, (g, w) in enumerate(zip(got["steps"], want["steps"])):
        assert abs(g["loss"] - w["loss"]) <= 1e-5 * max(1.0, abs(w["loss"])), (
            f"task2_4 ({desc}): step {step}: your loss {g['loss']:.6f} differs from GPT's {w['loss']:.6f}: the "
            f"forward must compute exactly what GPT.forward computes.")
        for name, fw in w["grads"].items():
            if not _from(g["grads"].get(name), fw):
                hint = (" With dropout, the recomputation must draw the same masks as the forward: keep "
                        "preserve_rng_state=True (the default)." if cfg.dropout else "")
                hint += (" Did you detach the checkpointed input? Gradients then stop at that checkpoint and "
                         "never reach the embeddings and the blocks before it.")
                if case.get("frozen_embeddings") and g["grads"].get(name) is None:
                    hint += (" Here the token embedding is frozen, so the blocks' input does not require grad: a "
                             "reentrant checkpoint (use_reentrant=True) then gives the blocks inside it no "
                             "gradient; use use_reentrant=False.")
                raise AssertionError(f"task2_4 ({desc}): at training step {step}, the gradient of {name!r} differs "
                                     f"from the plain GPT's, so your model would train differently.{hint}")
        calls = g["calls"]
        assert calls == [2] * cfg.n_layer, (
            f"task2_4 ({desc}): forward calls per block in one training step were {calls}, expected 2 each "
            f"(forward, then the recomputation in backward), got {calls}. "
            + ("A block that ran once was not checkpointed." if min(calls, default=0) < 2 else
               "A block that ran more often is called more than once in your forward."))
    # memory: one stashed block input per block, one block recomputed at a time
    ref = ref_checkpointed_gpt(cfg, plain.state_dict())
    x, y = batches[0]
    torch.manual_seed(case["seed"])
    ref_peak = activation_peak(ref, lambda: ref(x, y)).peak
    plain_peak = want["peak"]
    slack = max((plain_peak - ref_peak) // (4 * cfg.n_layer), 1024)
    assert got["peak"] <= ref_peak + slack, (
        f"task2_4 ({desc}): peak activation memory {mb(got['peak'])}, but checkpointing every block needs only "
        f"{mb(ref_peak)} (no checkpointing: {mb(plain_peak)}). Run each block only inside "
        f"checkpoint(block, x, rope, use_reentrant=False), and keep nothing else per block.")


def _from(got, want) -> bool:
    if want is None:                     # a frozen parameter: no gradient on either side
        return got is None
    return got is not None and same(got, want)


# ----------------------------------------------------------------------------- the watched cases, from outside
MEASURED = ("task2_1_checkpoint_every_k", "task2_2_sqrt_segments", "task2_4_checkpointed_gpt")


def corroborate(runs) -> list[str]:
    """The watched cases of tasks 2.1, 2.2 and 2.4 seen from outside: memlab's tracker in the learner's process
    reported the module's activation peak; while the case ran (its memory window, sandbox.py) the sandbox's memory
    may hold that (the run's own training step holds it again, untracked), what the run keeps besides
    (cases.outside_the_tracker) and some noise, not much more. A window more than twice those, plus NOISE_BYTES,
    held activations the tracker never saw (a module that checkpoints only while a dispatch mode watches, a
    dispatch mode switched off): flag it for the instructor. `runs`: (task id, case, value, the case's memory growth
    in bytes or None) for every case; only watched cases are large enough for the comparison to mean something (a
    first case also pages in code, tens of MiB)."""
    MiB = 2**20
    flags = []
    for tid, case, value, growth in runs:
        if tid not in MEASURED or not case.get("watched") or growth is None or not isinstance(value, dict):
            continue
        peak = value.get("peak")
        if type(peak) is not int:
            continue
        extra = outside_the_tracker(case)
        if growth > 2 * (peak + extra) + NOISE_BYTES:
            flags.append(f"{tid}: while its large case ran, the sandbox's memory grew by {growth / MiB:.0f} MiB, more "
                         f"than twice the activation peak memlab's tracker measured for your module "
                         f"({peak / MiB:.0f} MiB) and the case's inputs and outputs ({extra / MiB:.0f} MiB) plus "
                         f"{NOISE_BYTES // MiB} MiB: activations the tracker did not see (checkpointing only while "
                         f"it watches, a dispatch mode switched off)")
    return flags
