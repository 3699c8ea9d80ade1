"""Exercise 08's judges: the tiny twin's gradients and weights against the same rung done plainly, the forward
calls the plan implies (task 8.1); each category of the model states against memlab.fit's (task 8.2); a plan
that fits, by memlab.fit, with no cheaper one that fits by the stated order (task 8.3). Messages teach and mark
every reference value with expected() (hidden checks show [hidden] in its place)."""

from __future__ import annotations

import torch

from memlab.kit.ex08 import SMALL, SMALL_SEQ, TINY, TINY_SEQ, build_tiny, n_micro, tiny_config, usable

from ..common import expect_type, expected, mb
from .inputs import TINY_STEPS, norm, project
from .refs import (fits, fitting_before, measured, mistake_weights, order_key, reference_memory_peak,
                   reference_states, reference_tiny_run)

STATE_RTOL, STATE_ATOL = 0.03, 2**21      # model states: within 3% (+ 2 MiB: step counters, norms' fp32 states),
                                          # tighter where a small part must be counted (state_tolerance)
CORROBORATE_FACTOR, CORROBORATE_BYTES = 2.0, 64 * 2**20     # outside growth allowed above a reported peak
CATEGORIES = ("parameters", "gradients", "optimizer")


def plan_words(plan) -> str:
    """A plan in words, without brackets or quotes: what stays readable in a hidden check's message once its values
    are redacted (a bracketed or quoted group holding a digit goes whole)."""
    return (f"method {plan['method']}, precision {plan['precision']}, optimizer {plan['optimizer']}, checkpointing "
            f"{'on' if plan['checkpointing'] else 'off'}, micro_batch {plan['micro_batch']}, offload "
            f"{'on' if plan['offload'] else 'off'}" + (f", rank {plan['lora_r']}" if plan["method"] != "full" else ""))


def _field(got, key, kind, where, length=None):
    """got[key], present, of exactly `kind` and (for lists) of `length` entries: a short or empty list fails."""
    if type(got) is not dict or key not in got:
        raise AssertionError(f"{where}: the run's result has no {key!r} (the check could not observe your step)")
    v = got[key]
    if type(v) is not kind and not (kind is float and type(v) is int):
        raise AssertionError(f"{where}: the run's {key!r} is a {type(v).__name__}, not a {kind.__name__}")
    if length is not None and len(v) != length:
        raise AssertionError(f"{where}: the run's {key!r} has {len(v)} entries where the case has {length}")
    return v


# ----------------------------------------------------------------------------- task8_1
def _tolerances(plan, step: int = 0):
    """(relative gradient error at `step` (0: the first), weight slack in units of lr, share of weights allowed
    past it, the largest excess in units of lr). 16-bit compute rounds every sum, and micro-batches sum in another
    order, so a weight whose gradient is near zero may step the other way (each AdamW step moves a weight by about
    lr: over TINY_STEPS steps up to 2 lr each apart); 8-bit moments may round to a neighbouring code. Those weights
    then differ, and so do the later gradients. fp32 rungs are compared to 1e-4 at the first step, where both runs
    start from the same weights, and after it to 1e-3 (AdamW) or 1e-2 (8-bit AdamW): over 120 hidden draws the
    reference solution's fp32 gradient was at most 2.3e-7 off at the first step, 1.7e-5 at the later ones with
    AdamW and 9.3e-5 with 8-bit AdamW (once, in a sandbox, 1.6e-4)."""
    if plan["precision"] == "bf16":
        return 6e-2, 0.5, 2e-2, 2 * TINY_STEPS + 0.5
    eight = plan["optimizer"] != "adamw"
    return 1e-4 if step == 0 else 1e-2 if eight else 1e-3, 0.05, 1e-2 if eight else 1e-3, 2.5


def _validate_tiny(problem, plan, got, where):
    L = tiny_config(problem["model"]).num_hidden_layers
    calls = _field(got, "calls", list, where, TINY_STEPS)
    for c in calls:
        _field(c, "steps", int, where)
        _field(c, "ignored", int, where)
        for call in _field(c, "embed", list, where):
            if type(call) is not list or any(type(r) is not int for r in call):
                raise AssertionError(f"{where}: the run's embedding rows are not lists of ints")
        for rows in _field(c, "recompute", list, where, L):
            if type(rows) is not list or any(type(r) is not int or r < 0 for r in rows):
                raise AssertionError(f"{where}: the run's recomputed rows are not lists of counts")
    model, _ = build_tiny(problem, plan, 0)
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    steps = _field(got, "steps", list, where)
    for st in steps:
        _field(st, "missing", list, where)
        _field(st, "unknown", int, where)
        _field(st, "proj", list, where, 32)
        _field(st, "norm", float, where)
    final = _field(got, "final", list, where, len(sizes))
    for i, (vals, n) in enumerate(zip(final, sizes)):
        if type(vals) is not list or len(vals) != n:
            raise AssertionError(f"{where}: the run's final values of trainable tensor {i} are not {n} numbers")


def _judge_calls(problem, plan, got, where):
    """What each train_step call ran, counted where it cannot be pumped from outside the step (run.py's _Watch):
    the embedding's forward passes (grad enabled, outside the backward) must see every row of the batch exactly
    once, at most micro_batch rows at a time, in n_micro calls; with checkpointing every decoder layer must be
    replayed inside the backward (grad enabled) on every row once, at most micro_batch rows at a time; without
    it, never."""
    B, m = problem["batch"], plan["micro_batch"]
    n = n_micro(problem, plan)
    for c in got["calls"]:
        if c["steps"] != 1:
            raise AssertionError(f"{where}: one call of train_step stepped the optimizer {c['steps']} times; it must "
                                 f"step it exactly once, after the last micro-batch (accumulate the gradients).")
        rows = [r for call in c["embed"] for r in call]
        if any(r < 0 for r in rows):
            raise AssertionError(
                f"{where}: with grad enabled, the model's embedding was handed token ids that are not rows of the "
                f"batch train_step was given. Feed the model the batch's own rows, in micro-batches, and nothing "
                f"else (calls under torch.no_grad() or inside the backward are not counted as forward passes).")
        widest = max((len(call) for call in c["embed"]), default=0)
        if widest > m:
            raise AssertionError(
                f"{where}: one forward pass took {widest} sequences at once, but micro_batch={m}: cut the batch in "
                f"order into micro-batches of at most micro_batch sequences and run each through the model on its "
                f"own (forward, weighted loss, backward).")
        if sorted(rows) != list(range(B)) or len(c["embed"]) != n:
            raise AssertionError(
                f"{where}: in one train_step the forward passes (counted at the embedding, with grad enabled, "
                f"outside the backward) saw {len(rows)} rows in {len(c['embed'])} calls; the batch of {B} cut into "
                f"micro-batches of {m} is {n} calls that see every row exactly once. Run each micro-batch through "
                f"the model once (the last one may be smaller), and no row twice or never.")
        for rec in c["recompute"]:
            if plan["checkpointing"] and (sum(rec) != B or len(rec) != n or max(rec, default=0) > m):
                raise AssertionError(
                    f"{where}: with checkpointing every decoder layer must run its forward again inside the "
                    f"backward, once per micro-batch, on every row of the batch; a layer was replayed there on "
                    f"{sum(rec)} rows in {len(rec)} calls, where the batch has {B} rows in {n} micro-batches. Turn "
                    f"checkpointing on for every decoder layer, e.g. the base model's gradient_checkpointing_enable("
                    f"gradient_checkpointing_kwargs={{'use_reentrant': False}}); calling layers yourself outside "
                    f"the backward is not a recomputation.")
            if not plan["checkpointing"] and rec:
                raise AssertionError(
                    f"{where}: this plan does not checkpoint, but a decoder layer ran again inside the backward: "
                    f"turn checkpointing off when plan['checkpointing'] is False (it costs a forward per layer).")


def _judge_memory(case, got, where):
    problem, plan = case["problem"], case["plan"]
    peak = _field(got, "peak", int, where)
    end = _field(got, "end", int, where)
    size = case.get("size", "small")
    want, want_end = reference_memory_peak(problem, plan, case["seed"], case["data_seed"], size)
    if end > want_end + 2**16:
        raise AssertionError(
            f"{where}: when your step returns, {mb(end - want_end)} more is still alive than after the same plan "
            f"done plainly: free the gradients after the optimizer step (optimizer.zero_grad(set_to_none=True); "
            f"zeroing them in place keeps every gradient buffer alive through the next forward) and keep no "
            f"outputs, logits or losses.")
    seq, vocab = (SMALL_SEQ, SMALL[problem["model"]]["vocab_size"]) if size == "small" else \
        (TINY_SEQ, TINY[problem["model"]]["vocab_size"])
    logits = plan["micro_batch"] * seq * vocab * 4          # (b, T, V) fp32
    if peak > want + logits + 2**16:
        raise AssertionError(
            f"{where}: the second step peaks at {mb(peak)}; the same plan done plainly peaks at {expected(mb(want))} "
            f"(allowed: one micro-batch's fp32 logits, {mb(logits)}, more). Call backward on each micro-batch's "
            f"weighted loss as soon as it is computed (summing the losses first keeps every micro-batch's graph "
            f"alive), and keep no outputs, logits or losses across micro-batches.")


def train_step_judge(case, got):
    problem, plan = case["problem"], case["plan"]
    if case["part"] == "memory":
        where = (f"train_step on the {case.get('size', 'small')} twin of {problem['model']}, batch {problem['batch']}, "
                 f"plan: {plan_words(plan)}")
        expect_type("train_step's run", got, dict)
        if "raised" in got:
            raise AssertionError(f"{where}: train_step raised {got['raised']}")
        return _judge_memory(case, got, where)
    where = f"train_step on the tiny twin of {problem['model']}, batch {problem['batch']}, plan: {plan_words(plan)}"
    expect_type("train_step's run", got, dict)
    if "raised" in got:
        raise AssertionError(f"{where}: train_step raised {got['raised']}")
    _validate_tiny(problem, plan, got, where)
    _judge_calls(problem, plan, got, where)
    steps = _field(got, "steps", list, where, TINY_STEPS)
    _, slack, share, most = _tolerances(plan)          # the gradient tolerance is per step, below
    ref_grads, ref_final = reference_tiny_run(problem, plan, case["seed"], case["data_seed"], TINY_STEPS)
    for s, (mine, ref) in enumerate(zip(steps, ref_grads)):
        rtol = _tolerances(plan, s)[0]
        if mine["unknown"]:
            raise AssertionError(f"{where}: the optimizer holds {mine['unknown']} tensors that are not the model's "
                                 f"trainable parameters: step the optimizer you are given.")
        if mine["missing"]:
            raise AssertionError(
                f"{where}: at step {s + 1}, {len(mine['missing'])} trainable tensors had no gradient. Compute under "
                f"grad mode, do not freeze anything the kit left trainable, and do not zero the gradients before "
                f"the step.")
        pr = torch.tensor(project(ref, 1), dtype=torch.float64)
        ps = torch.tensor(mine["proj"], dtype=torch.float64)
        err = (ps - pr).norm().item() / max(pr.norm().item(), 1e-30)
        if not err <= rtol:
            cos = (ps @ pr).item() / max(ps.norm().item() * pr.norm().item(), 1e-30)
            ratio = mine["norm"] / max(norm(ref), 1e-30)
            if cos > 0.999:
                why = (f"Your gradient points the right way but is {ratio:.3g} times the full batch's: weight each "
                       f"micro-batch's mean loss by its share of the batch (its sequences / the batch).")
            else:
                why = ("Your gradient points elsewhere: every sequence must count as in the mean over the whole "
                       "batch. When micro_batch does not divide the batch the last micro-batch is smaller: weight "
                       "each loss by its size (dividing every loss by the number of micro-batches is wrong then); "
                       "zero the gradients after the optimizer step, never between micro-batches.")
            raise AssertionError(f"{where}: at step {s + 1} the gradient handed to the optimizer differs from the "
                                 f"same rung done plainly (whole batch, one backward) by {err:.2e} relative "
                                 f"(allowed {rtol:.0e}). {why}")
    lr = 1e-3
    off, total, worst = 0, 0, 0.0
    for vals, w in zip(_field(got, "final", list, where), ref_final):
        w = w.double().flatten()
        diff = (torch.tensor(vals, dtype=torch.float64) - w).abs()
        bound = slack * lr + (2**-7 * w.abs() if plan["precision"] == "bf16" else 0)
        off += int((diff > bound).sum())
        total += diff.numel()
        worst = max(worst, (diff - bound).max().item())
    assert off <= share * total and worst <= most * lr, (
        f"{where}: the gradients match, but after {TINY_STEPS} steps {off} of {total} trained weights differ from "
        f"the plain run's by more than {slack:g} x the learning rate. Step the optimizer you are given once per "
        f"train_step, after the last micro-batch, and do not change its settings.")


# ----------------------------------------------------------------------------- task8_2
def state_tolerance(problem, plan, category: str) -> int:
    """Bytes a learner's count may be off memlab.fit's: STATE_RTOL of it (+ STATE_ATOL), but never more than half
    of what the smallest mistake the task must catch weighs in this plan (refs.mistake_weights: QLoRA's NF4
    constants, the 8-bit state's block constants), so that leaving such a part out always fails."""
    want = reference_states(problem, plan)[category]
    rel = STATE_RTOL * want
    w = mistake_weights(problem, plan).get(category)
    return STATE_ATOL + int(rel if w is None else min(rel, max(w, 0) / 2))


_STATE_HINTS = {
    ("qlora", "parameters"): "an NF4 base at half a byte per 4-bit weight PLUS its block constants: an absmax byte "
                             "per block of sixty-four values, double quantization's fp32 per two hundred and "
                             "fifty-six of those blocks, a small code table per layer. Here the tolerance is half of "
                             "what those constants weigh, so they must be counted. Embeddings, norms and head stay "
                             "fp32, and so do the adapters",
    ("lora", "parameters"): "the frozen base, every weight of it, in the plan's precision: four bytes a weight in "
                            "fp32, two in bf16; plus the fp32 adapters",
    ("full", "parameters"): "every weight in the plan's precision (with offload the GPU keeps the 16-bit weights)",
    ("full", "gradients"): "one gradient per weight in its dtype; with offload they leave the GPU during backward",
    ("lora", "gradients"): "one fp32 gradient per adapter weight, none for the frozen base",
    ("qlora", "gradients"): "one fp32 gradient per adapter weight, none for the frozen base",
    ("full", "optimizer"): "AdamW's two moments per weight in its dtype; AdamW8bit's one byte per moment PLUS an "
                           "fp32 absmax per block of two hundred and fifty-six values of each moment, for tensors of "
                           "min_8bit_size values or more, smaller ones keeping two fp32 moments. Here the tolerance "
                           "is half of what the block constants weigh, so they must be counted. With offload the "
                           "state lives on the host",
    ("lora", "optimizer"): "AdamW's two fp32 moments per adapter weight",
    ("qlora", "optimizer"): "AdamW's two fp32 moments per adapter weight",
}


def state_judge(case, got):
    problem = case["problem"]
    expect_type("state_bytes's results", got, list)
    if len(got) != len(case["plans"]):
        raise AssertionError(f"expected one result per plan ({len(case['plans'])}), got {len(got)}")
    for plan, g in zip(case["plans"], got):
        where = f"state_bytes for {problem['model']}, plan: {plan_words(plan)}"
        expect_type(where, g, dict)
        if "forbidden" in g:
            raise AssertionError(f"{where}: {g['forbidden']}")
        if "raised" in g:
            raise AssertionError(f"{where} raised {g['raised']}")
        if "returned" in g:
            raise AssertionError(f"{where} must return a dict, got a {g['returned']}")
        if set(g) != set(CATEGORIES):
            raise AssertionError(f"{where} must return a dict with exactly the keys {list(CATEGORIES)}, got "
                                 f"{sorted(g)}")
        want = reference_states(problem, plan)
        for c in CATEGORIES:
            v = g[c]
            if type(v) is not int:
                raise AssertionError(f"{where}[{c!r}] must be an int of bytes, got {v!r}")
            w, tol = want[c], state_tolerance(problem, plan, c)
            if abs(v - w) > tol:
                side = "below" if v < w else "above"
                raise AssertionError(
                    f"{where}: your {c} count is {side} memlab.fit's by more than the check allows: you count "
                    f"{mb(v)}, memlab.fit measures {expected(mb(w))}, allowed {expected(mb(tol))} off. Count "
                    f"{_STATE_HINTS[(plan['method'], c)]}.")


# ----------------------------------------------------------------------------- task8_3
def _describe(problem):
    return (f"{problem['model']} on the {problem['gpu']} with a batch of {problem['batch']} x {problem['seq']} tokens, "
            f"headroom {problem['headroom']:.1%}, rank {problem['lora_r']}, "
            f"{'offload possible' if problem['offload_ok'] else 'no offload'}")


def _earlier(problem, plan, cheaper) -> str:
    """In words, where the earlier plan that fits comes before the learner's in the order (no values)."""
    mine, theirs = order_key(problem, plan), order_key(problem, cheaper)
    i = next(k for k in range(len(mine)) if mine[k] != theirs[k])
    return [f"the method {cheaper['method']} fits, and it comes before {plan['method']}",
            f"the {cheaper['precision']} version of your method fits, and fp32 comes before bf16 (it changes the "
            f"result less)",
            "your method with AdamW fits, and AdamW comes before AdamW8bit",
            "a plan of your branch without offload fits, and no offload comes before offload",
            "a plan without checkpointing fits (with more micro-batches): no checkpointing comes before "
            "checkpointing whatever the micro-batches, since micro-batches come last in the order",
            "a plan with fewer micro-batches (a larger micro_batch) fits"][i]


def plan_judge(case, got):
    problem = case["problem"]
    where = f"plan_for on {_describe(problem)}"
    expect_type("plan_for's run", got, dict)
    if "forbidden" in got:
        raise AssertionError(f"{where}: {got['forbidden']}")
    if "raised" in got:
        raise AssertionError(f"{where} raised {got['raised']}")
    if "invalid" in got:
        raise AssertionError(f"{where}: {got['invalid']}")
    plan = _field(got, "plan", dict, where)
    where += f", returned plan: {plan_words(plan)}"
    if plan["method"] != "full" and plan["lora_r"] != problem["lora_r"]:
        raise AssertionError(f"{where}: the team asks for adapters of rank {problem['lora_r']} (problem['lora_r'])")
    if not fits(problem, plan):
        peak = measured(problem, plan)[0]
        why = (" It peaks below the usable bytes and still does not fit: memlab.fit's verdict also counts what the "
               "caching allocator reserves beyond the peak and the CUDA context, so read measure(plan)['fits'], "
               "never compare the peak with the usable bytes yourself." if peak <= usable(problem) else "")
        raise AssertionError(f"{where}: memlab.fit says this plan does not fit: {mb(usable(problem))} usable after "
                             f"the headroom. plan_for must return a plan whose measure(plan)['fits'] is True.{why}")
    cheaper = fitting_before(problem, order_key(problem, plan))
    if cheaper is not None:
        raise AssertionError(
            f"{where}: fits, but a plan earlier in the stated order fits too: {expected(cheaper)}; "
            f"{_earlier(problem, plan, cheaper)}. The order puts what changes the result first: full before lora "
            f"before qlora, fp32 before bf16, adamw before adamw8bit; then what only costs time: no offload, no "
            f"checkpointing, fewer micro-batches. Walk the grid in that order and return the first plan that fits.")


# ----------------------------------------------------------------------------- memory seen from outside
def corroborate(runs) -> list[str]:
    """Task 8.1's memory cases seen from outside: the peak the learner's process reported (memlab's tracker in it)
    against how far the sandbox's memory rose while the case ran (its memory window, sandbox.py). A growth of more
    than twice the reported peak + 64 MiB means that the step did work the tracker did not see (a dispatch mode
    switched off, tensors made outside torch): flag it for the instructor. The watched case (cases.py) is large
    enough for a step kept from the tracker to show. `runs` holds (task id, case, value, the case's memory growth
    in bytes or None) for every case; the grader looks for `corroborate` in the package's judge.py."""
    MiB = 2**20
    for tid, case, value, growth in runs:
        if tid != "task8_1_train_step" or not isinstance(case, dict) or case.get("part") != "memory" \
                or not isinstance(value, dict) or type(value.get("peak")) is not int or growth is None:
            continue
        peak = value["peak"]
        if growth > CORROBORATE_FACTOR * peak + CORROBORATE_BYTES:
            return [f"task8_1_train_step: while a memory case ran, the sandbox's memory grew by {growth / MiB:.0f} "
                    f"MiB, more than {CORROBORATE_FACTOR:g} x the {peak / MiB:.0f} MiB peak your step reported to "
                    f"memlab's tracker + {CORROBORATE_BYTES // MiB} MiB: memory the tracker did not see"]
    return []
