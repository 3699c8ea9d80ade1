"""Exercise 08's judges: the tiny twin's gradients and weights against the same rung done plainly, the forward
calls the plan implies (task 8.1); each category of the model states against memlab.fit's (task 8.2); a plan
that fits, by memlab.fit, with no cheaper one that fits by the stated order (task 8.3). Messages teach and mark
every reference value with expected() (hidden checks show [hidden] in its place)."""

from __future__ import annotations

import torch

from memlab.kit.ex08 import SMALL, SMALL_SEQ, build_tiny, n_micro, tiny_config, usable

from ..common import expect_type, expected, mb
from .inputs import TINY_STEPS, norm, project
from .refs import fits, fitting_before, order_key, reference_memory_peak, reference_states, reference_tiny_run

STATE_RTOL, STATE_ATOL = 0.03, 2**21      # model states: within 3% (+ 2 MiB: step counters, norms' fp32 states)
CATEGORIES = ("parameters", "gradients", "optimizer")


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
    calls = _field(got, "calls", list, where, TINY_STEPS)
    for c in calls:
        for key in ("steps", "embed", "layers"):
            _field(c, key, int, where)
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
    L = tiny_config(problem["model"]).num_hidden_layers
    n = n_micro(problem, plan)
    per = 2 if plan["checkpointing"] else 1
    for c in got["calls"]:
        if c["steps"] != 1:
            raise AssertionError(f"{where}: one call of train_step stepped the optimizer {c['steps']} times; it must "
                                 f"step it exactly once, after the last micro-batch (accumulate the gradients).")
        assert c["embed"] == n, (
            f"{where}: micro_batch={plan['micro_batch']} cuts a batch of {problem['batch']} into {n} micro-batches, "
            f"but the embedding ran {c['embed']} times in one train_step. Run each micro-batch through the model "
            f"once (the last one may be smaller).")
        assert c["layers"] == n * L * per, (
            f"{where}: with {n} micro-batches of a {L}-layer model and checkpointing={plan['checkpointing']}, the "
            f"decoder layers should run {n} x {L} x {per} = {n * L * per} times (a checkpointed layer runs again "
            f"in backward); they ran {c['layers']} times. "
            + ("Turn checkpointing on for every decoder layer, e.g. the base model's gradient_checkpointing_enable("
               "gradient_checkpointing_kwargs={'use_reentrant': False})." if plan["checkpointing"] else
               "This plan does not checkpoint: do not recompute anything."))


def _judge_memory(case, got, where):
    problem, plan = case["problem"], case["plan"]
    peak = _field(got, "peak", int, where)
    end = _field(got, "end", int, where)
    want, want_end = reference_memory_peak(problem, plan, case["seed"], case["data_seed"])
    if end > want_end + 2**16:
        raise AssertionError(
            f"{where}: when your step returns, {mb(end - want_end)} more is still alive than after the same plan "
            f"done plainly: free the gradients after the optimizer step (optimizer.zero_grad(set_to_none=True); "
            f"zeroing them in place keeps every gradient buffer alive through the next forward) and keep no "
            f"outputs, logits or losses.")
    logits = plan["micro_batch"] * SMALL_SEQ * SMALL[problem["model"]]["vocab_size"] * 4   # (b, T, V) fp32
    if peak > want + logits + 2**16:
        raise AssertionError(
            f"{where}: the second step peaks at {mb(peak)}; the same plan done plainly peaks at {expected(mb(want))} "
            f"(allowed: one micro-batch's fp32 logits, {mb(logits)}, more). Call backward on each micro-batch's "
            f"weighted loss as soon as it is computed (summing the losses first keeps every micro-batch's graph "
            f"alive), and keep no outputs, logits or losses across micro-batches.")


def train_step_judge(case, got):
    problem, plan = case["problem"], case["plan"]
    if case["part"] == "memory":
        where = f"train_step on the small twin of {problem['model']}, batch {problem['batch']}, plan {plan}"
        expect_type("train_step's run", got, dict)
        if "raised" in got:
            raise AssertionError(f"{where}: train_step raised {got['raised']}")
        return _judge_memory(case, got, where)
    where = (f"train_step on the tiny twin of {problem['model']}, batch {problem['batch']}, plan {plan}")
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
                why = (f"Your gradient points the right way but is {ratio:.3g}x the full batch's: weight each "
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
def state_judge(case, got):
    problem = case["problem"]
    expect_type("state_bytes's results", got, list)
    if len(got) != len(case["plans"]):
        raise AssertionError(f"expected one result per plan ({len(case['plans'])}), got {len(got)}")
    for plan, g in zip(case["plans"], got):
        where = f"state_bytes({problem['model']}, plan {plan})"
        expect_type(where, g, dict)
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
            w = want[c]
            if abs(v - w) > STATE_RTOL * w + STATE_ATOL:
                hint = {"parameters": "every weight the GPU holds: the trained ones in the plan's precision, a "
                                      "frozen base in its dtype, an NF4 base at half a byte per weight plus its "
                                      "block constants, the adapters in fp32; with offload the GPU keeps the "
                                      "16-bit weights",
                        "gradients": "one gradient per TRAINED weight, in its dtype (none for a frozen base); "
                                     "with offload they leave the GPU during backward",
                        "optimizer": "AdamW keeps two moments per trained weight in its dtype; AdamW8bit one byte "
                                     "each plus an fp32 absmax per block of 256; with offload they live on the "
                                     "host"}[c]
                raise AssertionError(f"{where}: {c} = {mb(v)} ({v:,} bytes); memlab.fit measures "
                                     f"{expected(mb(w))} (allowed: {STATE_RTOL:.0%}). Count {hint}.")


# ----------------------------------------------------------------------------- task8_3
def _describe(problem):
    return (f"{problem['model']} on the {problem['gpu']}, batch {problem['batch']} x {problem['seq']} tokens, "
            f"headroom {problem['headroom']:.1%}, rank {problem['lora_r']}, "
            f"{'offload possible' if problem['offload_ok'] else 'no offload'}")


def plan_judge(case, got):
    problem = case["problem"]
    where = f"plan_for({_describe(problem)})"
    expect_type("plan_for's run", got, dict)
    if "raised" in got:
        raise AssertionError(f"{where} raised {got['raised']}")
    if "invalid" in got:
        raise AssertionError(f"{where}: {got['invalid']}")
    plan = _field(got, "plan", dict, where)
    where += f" -> {plan}"
    if plan["method"] != "full" and plan["lora_r"] != problem["lora_r"]:
        raise AssertionError(f"{where}: the team asks for adapters of rank {problem['lora_r']} (problem['lora_r'])")
    if not fits(problem, plan):
        raise AssertionError(f"{where}: memlab.fit says this plan does not fit: {mb(usable(problem))} usable after "
                             f"the headroom. plan_for must return a plan whose measure(plan)['fits'] is True.")
    cheaper = fitting_before(problem, order_key(problem, plan))
    if cheaper is not None:
        raise AssertionError(
            f"{where}: fits, but a plan earlier in the stated order fits too: {expected(cheaper)}. The order puts "
            f"what changes the result first (full before lora before qlora, fp32 before bf16, adamw before "
            f"adamw8bit), then what only costs time (no offload, no checkpointing, fewer micro-batches). Walk the "
            f"grid in that order and return the first plan that fits.")
