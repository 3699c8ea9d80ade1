"""Exercise 08's judges: the forward calls a plan implies, the same maths as plain AdamW on the tiny model, the
steady-state peak against the same plan done plainly, a fitting plan, and no cheaper fitting plan."""

from __future__ import annotations

import torch

import memlab
from memlab.kit.ex08 import MODELS, build

from ..common import expect_type, mb
from .cases import PLAN_TINY_STEPS, TINY_STEPS, norm, project
from .refs import (cost, dominating, n_micro, reference_fits, reference_front, reference_peak,
                   reference_tiny_run, usable)


# ----------------------------------------------------------------------------- judging helpers
def _desc(problem, plan=None):
    d = f"{problem['model']} on the {problem['gpu']}, batch {problem['batch']} x {problem['seq']} tokens"
    return d + (f", plan {plan}" if plan is not None else "")


def _field(got, key, kind, where, length=None):
    """got[key], present, of exactly `kind` and (for lists) of `length` entries: a short or empty list is a
    failure, never a vacuous pass."""
    if type(got) is not dict or key not in got:
        raise AssertionError(f"{where}: the run's result has no {key!r} (the check could not observe your step)")
    v = got[key]
    if type(v) is not kind and not (kind is float and type(v) is int and type(v) is not bool):
        raise AssertionError(f"{where}: the run's {key!r} is a {type(v).__name__}, not a {kind.__name__}")
    if length is not None and len(v) != length:
        raise AssertionError(f"{where}: the run's {key!r} has {len(v)} entries where the case has {length}")
    return v


def _validate_calls(got, where, n_calls=None):
    calls = _field(got, "calls", list, where, n_calls) if "calls" in got or n_calls is not None else [got]
    for c in calls:
        for key in ("wte", "blocks") + (("steps",) if "steps" in c or n_calls is not None else ()):
            _field(c, key, int, where)
    return calls


def _validate_tiny(problem, got, n_calls, where):
    """The tiny run's result has one entry per call, one optimizer step per call, one projection of 32 numbers per
    step, and every parameter's final values (as many as the parameter has)."""
    _validate_calls(got, where, n_calls)
    shapes = [p.numel() for p in build(problem, {"optimizer": "foreach", "micro_batch": 1, "checkpoint": 0}, "tiny",
                                       0)[0].parameters()]
    steps = _field(got, "steps", list, where, n_calls)
    for st in steps:
        _field(st, "missing", list, where)
        _field(st, "unknown", int, where)
        _field(st, "proj", list, where, 32)
        _field(st, "norm", float, where)
    final = _field(got, "final", list, where, len(shapes))
    for i, (vals, n) in enumerate(zip(final, shapes)):
        if type(vals) is not list or len(vals) != n:
            raise AssertionError(f"{where}: the run's final values of parameter {i} are not {n} numbers")


def _judge_calls(problem, plan, got, where):
    L = MODELS[problem["model"]]["full"].n_layer
    n, k = n_micro(problem, plan), plan["checkpoint"]
    for i, c in enumerate(got["calls"] if "calls" in got else [got]):
        if "steps" in c and c["steps"] != 1:
            raise AssertionError(f"{where}: one call of train_step stepped the optimizer {c['steps']} times; it must "
                                 f"step it exactly once, after the last micro-batch (accumulate the gradients).")
        assert c["wte"] == n, (
            f"{where}: the plan's micro_batch={plan['micro_batch']} splits a batch of {problem['batch']} into {n} "
            f"micro-batches, but the model's embedding ran {c['wte']} times in one train_step. Run each micro-batch "
            f"through the model once (the last one may be smaller).")
        assert c["blocks"] == n * (L + k), (
            f"{where}: with {n} micro-batches and checkpoint={k} of {L} blocks, the blocks should run "
            f"{n} x ({L} + {k}) = {n * (L + k)} times (a checkpointed block runs again in backward); they ran "
            f"{c['blocks']} times. Wrap exactly plan['checkpoint'] blocks in torch.utils.checkpoint.checkpoint"
            f"(..., use_reentrant=False) and call the others plainly.")


def _judge_tiny(problem, plan, case, got, where, n_calls=TINY_STEPS):
    expect_type("the tiny run's result", got, dict)
    if "raised" in got:
        raise AssertionError(f"{where}: train_step raised {got['raised']} on the tiny instance (real CPU tensors)")
    _validate_calls(got, where, n_calls)
    _judge_calls(problem, plan, got, where)            # one optimizer step per call: as many steps as calls
    _validate_tiny(problem, got, n_calls, where)
    ref_grads, ref_final = reference_tiny_run(problem, case["seed"], case["data_seed"], n_calls)
    for s, (mine, ref) in enumerate(zip(got["steps"], ref_grads)):
        if mine["unknown"]:
            raise AssertionError(f"{where}: the optimizer holds {mine['unknown']} tensors that are not the model's "
                                 f"parameters: step the optimizer you are given, with the model's parameters.")
        if mine["missing"]:
            names = [n for n, _ in build(problem, plan, "tiny", 0)[0].named_parameters()]
            raise AssertionError(
                f"{where}: at step {s + 1} {len(mine['missing'])} parameters had no gradient (e.g. "
                f"{[names[i] for i in mine['missing'][:3]]}). The recipe trains every parameter: do not freeze "
                f"any (requires_grad_(False)), do not compute under torch.no_grad(), and do not zero the gradients "
                f"before the step.")
        pr = torch.tensor(project(ref, 1), dtype=torch.float64)
        ps = torch.tensor(mine["proj"], dtype=torch.float64)
        err = (ps - pr).norm().item() / max(pr.norm().item(), 1e-30)
        if not err <= 1e-4:
            cos = (ps @ pr).item() / max(ps.norm().item() * pr.norm().item(), 1e-30)
            ratio = mine["norm"] / max(norm(ref), 1e-30)
            if cos > 0.999:
                why = (f"Your gradient points the right way but is {ratio:.3g}x the full batch's: scale each "
                       f"micro-batch's loss by its share of the batch (its sequences / the batch), so the sum is the "
                       f"mean over all {problem['batch']} sequences.")
            else:
                why = ("Your gradient points elsewhere: each sequence must count as in the mean over the whole batch. "
                       "When the micro-batch does not divide the batch, the last micro-batch is smaller: weight "
                       "each loss by its size (dividing every loss by the number of micro-batches is wrong then), "
                       "and zero the gradients after each step, not between micro-batches.")
            raise AssertionError(f"{where}: at step {s + 1} the gradient handed to AdamW differs from the full-batch "
                                 f"gradient by {err:.2e} (relative). {why}")
    lr = 1e-3
    off, total, worst = 0, 0, 0.0
    for vals, w in zip(got["final"], ref_final):
        diff = (torch.tensor(vals, dtype=torch.float64) - w.double().flatten()).abs()
        off += int((diff > 0.05 * lr).sum())
        total += diff.numel()
        worst = max(worst, diff.max().item())
    assert off <= 1e-3 * total and worst <= 2.5 * lr, (
        f"{where}: the gradients match, but after {len(got['calls'])} steps {off} of {total} weights differ from "
        f"plain AdamW's by more than 5% of the learning rate (largest {worst:.2e}). Step the optimizer you are given "
        f"once per train_step and do not change its settings.")


def _validate_full(got, where):
    expect_type("the full-size run's result", got, dict)
    if "raised" in got:
        return
    _field(got, "fits", bool, where)
    for key in ("peak", "steady", "wte", "blocks", "steps"):
        _field(got, key, int, where)
    _field(got, "state", list, where)


def _judge_full_fits(problem, plan, got, where):
    _validate_full(got, where)
    if "raised" in got:
        raise AssertionError(f"{where}: at full size train_step raised {got['raised']}. It runs on the virtual GPU's "
                             f"fake tensors: do not read values (.item(), print(tensor)).")
    cap = memlab.VirtualGPU(problem["gpu"]).capacity
    room = usable(problem)
    if not got["fits"]:
        raise AssertionError(f"{where}: runs out of memory on the {problem['gpu']} ({mb(cap)}):\n{got['oom']}")
    _judge_calls(problem, plan, got, where)
    if got["steady"] > room:
        extra = ""
        if got["peak"] <= room:
            extra = (f" Its first step peaks at {mb(got['peak'])}, which looks fine, but from the second step on "
                     f"AdamW's {mb(got['state'][0] if got['state'] else 0)} of state is alive during forward and "
                     f"backward too: measure the steady state (memlab.clinic.run_full_size).")
        elif got["steady"] <= cap:
            extra = (f" It would squeeze under the capacity itself, but keep {problem['headroom']:.1%} free for the "
                     f"CUDA context, cuBLAS workspaces and fragmentation, which the virtual GPU does not model.")
        raise AssertionError(f"{where}: peaks at {mb(got['steady'])} in steady state; the {problem['gpu']} "
                             f"({mb(cap)}) leaves {mb(room)} after {problem['headroom']:.1%} headroom.{extra}")


# ----------------------------------------------------------------------------- task8_1
def train_step_judge(case, got):
    expect_type("train_step's run", got, dict)
    problem, plan = case["problem"], case["plan"]
    where = f"train_step on {_desc(problem, plan)}"
    if case["part"] == "tiny":
        return _judge_tiny(problem, plan, case, got, f"train_step on a tiny {problem['model']}, batch "
                                                     f"{problem['batch']}, plan {plan}")
    _validate_full(got, where)
    if "raised" in got:
        raise AssertionError(f"{where}: raised {got['raised']}")
    _judge_calls(problem, plan, got, where)
    want = reference_peak(problem, plan)
    cfg = MODELS[problem["model"]]["full"]
    logits = plan["micro_batch"] * problem["seq"] * cfg.vocab_size * 4      # one micro-batch's (b, T, V) fp32
    assert got["fits"] and got["steady"] <= want + logits + 32 * 2**20, (
        f"{where}: your step peaks at {mb(got['steady']) if got['fits'] else 'more than the GPU'} in steady state; "
        f"the same plan done plainly peaks at {mb(want)} (allowed: up to one micro-batch's logits, {mb(logits)}, "
        f"more). Call backward on each micro-batch's loss as soon as it is computed (summing the losses first "
        f"keeps every micro-batch's graph alive), and keep no outputs, logits or losses across micro-batches.")


# ----------------------------------------------------------------------------- task8_2 and task8_3
def _judge_plan_valid(problem, got):
    where = f"plan_for({_desc(problem)})"
    if "raised" in got:
        raise AssertionError(f"{where} raised {got['raised']}")
    if "invalid" in got:
        raise AssertionError(f"{where}: {got['invalid']}")
    return f"{where} -> {got['plan']}"


def fit_judge(case, got):
    expect_type("plan_for's run", got, dict)
    problem = case["problem"]
    where = _judge_plan_valid(problem, got)
    _judge_full_fits(problem, got["plan"], got["full"], where)
    _judge_tiny(problem, got["plan"], {"seed": 808, "data_seed": 88}, _field(got, "tiny", dict, where),
                where + " (tiny instance)", n_calls=PLAN_TINY_STEPS)


def cheap_judge(case, got):
    expect_type("plan_for's run", got, dict)
    problem = case["problem"]
    where = _judge_plan_valid(problem, got)
    plan = got["plan"]
    full = _field(got, "full", dict, where)
    _validate_full(full, where)
    # it must fit with the learner's step and with the grader's own step for the same plan (a step that does not
    # train, or skips work, must not make a plan look as if it fitted)
    if "raised" in full or not full["fits"] or full["steady"] > usable(problem) or not reference_fits(problem, plan):
        raise AssertionError(f"{where}: this plan does not fit in steady state with headroom (task 8.2 says why); "
                             f"the cheapest plan must first fit.")
    front = reference_front(problem)
    better = dominating(problem, cost(problem, plan), front)
    if better:
        k, n = min(better, key=lambda kn: (kn[0] + kn[1], kn))
        L = MODELS[problem["model"]]["full"].n_layer
        k0, n0 = cost(problem, plan)
        hint = (f"you recompute {k0} blocks where {k} suffice" if k < k0 else
                f"you run {n0} micro-batches where {n} suffice")
        table = ", ".join(f"checkpoint={kk}: {nn} micro-batches (micro_batch={mm})" for kk, (nn, mm) in front.items())
        raise AssertionError(
            f"{where}: fits, but costs more than needed: {hint} (checkpoint={k} with micro_batch={front[k][1]} "
            f"fits too, with fused AdamW). The cheapest fitting plans, found by brute force over the grid: {table} "
            f"(of {L} blocks). Search from the cheapest, and try every micro_batch: the peak is not monotone in it "
            f"when it does not divide the batch.")
