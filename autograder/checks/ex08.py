"""Checks for exercise 08, "Make it fit" (the contract: checks/common.py; problems, harness and the grader's
references: ex08_ref.py).

- task8_1_train_step: the learner's train_step(model, optimizer, x, y, plan) on tiny models, for plans that
  cover every option (one micro-batch, one sequence per micro-batch, micro-batches that divide the batch and
  ones that do not; no, some and all blocks checkpointed; foreach and fused AdamW; GPT- and Llama-shaped
  models; three steps, so the optimizer's state is in play): the gradients handed to each step and the
  weights after the last must equal plain full-batch AdamW computed by the grader; the forward calls must
  match the plan (each checkpointed block runs twice). One full-size case: the step's steady-state peak on the
  virtual GPU must not exceed the grader's own implementation of the same plan.
- task8_2_make_it_fit: plan_for(problem) at full size on the problem's virtual GPU: steady state (memlab.clinic,
  as exercise 04) within capacity minus headroom, and on the tiny instance the same training as the recipe.
- task8_3_cheapest_plan: no fitting plan of the option grid is cheaper on one count (blocks recomputed,
  micro-batches) and no dearer on the other; the grader finds the fitting plans by brute force.
memlab.fit and memlab.fit_search (if this memlab has them) raise inside the learner's calls.
"""

from __future__ import annotations

import contextlib

import torch

import memlab
from memlab.checkpointing import ForwardCounter
from memlab.clinic import run_full_size

from .common import Task, expect_type, mb, tasks, torch_seed
from .ex08_ref import (MODELS, OPTIMIZERS, batch_data, build, cost, dominating, make_step, n_micro,  # noqa: F401
                       norm, plan_error, project, reference_front, reference_peak, reference_tiny_run, usable)

__all__ = ["TASKS", "MODELS", "OPTIMIZERS", "make_step"]

TINY_STEPS = 3
VISIBLE_PROBLEM = {"model": "gpt-0.8b", "gpu": "T4-16GB", "batch": 4, "seq": 1024, "headroom": 0.05}
HIDDEN_PROBLEMS = [   # each needs checkpointing or micro-batches, and AdamW's state decides what fits
    {"model": "gpt-1.1b", "gpu": "L4-24GB", "batch": 6, "seq": 1024, "headroom": 0.05},
    {"model": "gpt-1.1b", "gpu": "L4-24GB", "batch": 5, "seq": 1280, "headroom": 0.05},
]


# ----------------------------------------------------------------------------- learner-side helpers
@contextlib.contextmanager
def _no_fit_tool():
    """memlab.fit / memlab.fit_search answer this exercise: they raise while the learner's code runs."""
    import sys
    homes = [memlab, memlab.fitting, sys.modules.get("memlab.fitting.plan"), sys.modules.get("memlab.fitting.search")]
    saved = [(m, n, getattr(m, n)) for m in homes if m is not None for n in ("fit", "fit_search") if hasattr(m, n)]

    def refuse(*a, **k):
        raise RuntimeError("memlab.fit and memlab.fit_search are off limits in exercise 08: measure your plans "
                           "with memlab.VirtualGPU / memlab.clinic.run_full_size and search the options yourself")
    for m, n, _ in saved:
        setattr(m, n, refuse)
    try:
        yield
    finally:
        for m, n, v in saved:
            setattr(m, n, v)


def _counted(model):
    return ForwardCounter([model.wte]), ForwardCounter(model.blocks)


def _tiny_run(problem, plan, train_step, seed, data_seed, steps=TINY_STEPS):
    """Run the learner's train_step `steps` times on the tiny model; plain data of what the optimizer saw."""
    model, opt, params = build(problem, plan, "tiny", seed)
    index = {id(p): i for i, p in enumerate(params)}
    seen = []

    def pre_step(o, args, kwargs):
        grads = {index[id(p)]: p.grad for g in o.param_groups for p in g["params"] if id(p) in index}
        seen.append({"missing": [i for i, gr in sorted(grads.items()) if gr is None],
                     "unknown": sum(1 for g in o.param_groups for p in g["params"] if id(p) not in index),
                     "grads": [grads.get(i) for i in range(len(params))]})
    opt.register_step_pre_hook(pre_step)
    gen = torch.Generator().manual_seed(data_seed)
    wte, blocks = _counted(model)
    calls = []
    try:
        for _ in range(steps):
            x, y = batch_data(problem, "tiny", gen)
            before = len(seen)
            train_step(model, opt, x.clone(), y.clone(), plan)
            calls.append({"steps": len(seen) - before, "wte": wte.total, "blocks": blocks.total})
            wte.reset()
            blocks.reset()
    finally:
        wte.remove()
        blocks.remove()
    return {"calls": calls,
            "steps": [{"missing": s["missing"], "unknown": s["unknown"],
                       "proj": project([g if g is not None else torch.zeros_like(p)
                                        for g, p in zip(s["grads"], params)], 1),
                       "norm": norm([g for g in s["grads"] if g is not None])} for s in seen],
            "final": [p.detach().double().flatten().tolist() for p in params]}


def _full_run(problem, plan, train_step):
    """Steady-state peak of the learner's step at full size on the problem's virtual GPU, with forward calls."""
    counts = {}

    def step(size="full"):
        model, opt, _ = build(problem, plan, "full")
        memlab.watch(model, opt)
        x, y = batch_data(problem, "full")
        wte, blocks = _counted(model)
        try:
            train_step(model, opt, x, y, plan)
        finally:
            counts.update(wte=wte.total, blocks=blocks.total)
            wte.remove()
            blocks.remove()
    run, steady, rec = run_full_size(step, memlab.VirtualGPU(problem["gpu"]))
    return {"fits": bool(run.fits), "peak": int(run.peak), "steady": int(steady),
            "oom": None if run.fits else str(run.oom_message)[:1500], "steps": len(rec.pre_step_peak),
            "state": [int(s) for s in rec.state_bytes], **counts}


def _safe(fn, *a):
    try:
        return fn(*a)
    except Exception as e:  # noqa: BLE001 - the judge teaches
        return {"raised": f"{type(e).__name__}: {str(e)[:500]}"}


# ----------------------------------------------------------------------------- judging helpers
def _desc(problem, plan=None):
    d = f"{problem['model']} on the {problem['gpu']}, batch {problem['batch']} x {problem['seq']} tokens"
    return d + (f", plan {plan}" if plan is not None else "")


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


def _judge_tiny(problem, plan, case, got, where):
    if "raised" in got:
        raise AssertionError(f"{where}: train_step raised {got['raised']} on the tiny instance (real CPU tensors)")
    _judge_calls(problem, plan, got, where)
    ref_grads, ref_final = reference_tiny_run(problem, case["seed"], case["data_seed"], len(got["calls"]))
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


def _judge_full_fits(problem, plan, got, where):
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
            extra = (f" It would squeeze under the capacity itself, but keep {problem['headroom']:.0%} free for the "
                     f"CUDA context, cuBLAS workspaces and fragmentation, which the virtual GPU does not model.")
        raise AssertionError(f"{where}: peaks at {mb(got['steady'])} in steady state; the {problem['gpu']} "
                             f"({mb(cap)}) leaves {mb(room)} after {problem['headroom']:.0%} headroom.{extra}")


# ----------------------------------------------------------------------------- task8_1
def _plan(mbatch, k, opt):
    return {"micro_batch": mbatch, "checkpoint": k, "optimizer": opt}


def train_step_cases(hidden, r):
    if not hidden:
        return [{"part": "tiny", "problem": {**VISIBLE_PROBLEM, "batch": 5}, "plan": _plan(2, 1, "fused"),
                 "seed": 801, "data_seed": 8},
                {"part": "tiny", "problem": {**HIDDEN_PROBLEMS[1], "batch": 4}, "plan": _plan(4, 2, "foreach"),
                 "seed": 802, "data_seed": 9},
                {"part": "full", "problem": VISIBLE_PROBLEM, "plan": _plan(2, 1, "fused")}]
    models = ["gpt-0.8b", "llama-0.8b", "gpt-1.1b", r.choice(list(MODELS))]
    r.shuffle(models)
    opts = list(OPTIMIZERS) * 2
    r.shuffle(opts)
    cases = []
    for i, model in enumerate(models):
        B = r.randint(3, 7)
        L = MODELS[model]["full"].n_layer
        mbatch = [1, B, r.choice([d for d in range(2, B) if B % d] or [2]),          # micro-batches: one
                  r.choice([d for d in range(1, B) if B % d == 0 and d > 1] or [B])][i]  # sequence, all, uneven, even
        k = [L, 0, r.randint(1, L - 1), r.randint(0, L)][i]                       # all, none, some, any
        cases.append({"part": "tiny", "problem": {"model": model, "gpu": "L4-24GB", "batch": B, "seq": 16,
                                                  "headroom": 0.05},
                      "plan": _plan(mbatch, k, opts[i]), "seed": torch_seed(r), "data_seed": r.randrange(2**31)})
    p = r.choice(HIDDEN_PROBLEMS)
    cases.append({"part": "full", "problem": p, "plan": _plan(r.choice([2, 3]), 1, "fused")})   # n >= 2: one graph at a time
    return cases


def train_step_run(case, train_step):
    problem, plan = case["problem"], case["plan"]
    with _no_fit_tool():
        if case["part"] == "tiny":
            return _safe(_tiny_run, problem, plan, train_step, case["seed"], case["data_seed"])
        return _safe(_full_run, problem, plan, train_step)


def train_step_judge(case, got):
    expect_type("train_step's run", got, dict)
    problem, plan = case["problem"], case["plan"]
    where = f"train_step on {_desc(problem, plan)}"
    if case["part"] == "tiny":
        return _judge_tiny(problem, plan, case, got, f"train_step on a tiny {problem['model']}, batch "
                                                     f"{problem['batch']}, plan {plan}")
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
_PLANS: dict = {}


def _plan_and_measure(problem, plan_for, train_step):
    """plan_for's plan for `problem` and its measurements, once per problem in this process (8.2 and 8.3 share)."""
    key = (id(plan_for), id(train_step), tuple(sorted(problem.items())))
    if key not in _PLANS:
        with _no_fit_tool():
            plan = _safe(plan_for, dict(problem))
            out = {"plan": plan if type(plan) is dict and "raised" not in plan else None}
            if "raised" in (plan if type(plan) is dict else {}):
                out["raised"] = plan["raised"]
            elif plan_error(plan, problem):
                out["invalid"] = plan_error(plan, problem) if type(plan) is dict else \
                    f"plan_for must return a dict, got {type(plan).__name__}"
                out["plan"] = None
            else:
                out["full"] = _safe(_full_run, problem, plan, train_step)
                out["tiny"] = _safe(_tiny_run, problem, plan, train_step, 808, 88, 2)
        _PLANS[key] = out
    return _PLANS[key]


def plan_cases(hidden, r):
    if not hidden:
        return [{"problem": VISIBLE_PROBLEM}]
    return [{"problem": r.choice(HIDDEN_PROBLEMS)}]


def plan_run(case, plan_for, train_step):
    return _plan_and_measure(case["problem"], plan_for, train_step)


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
    _judge_tiny(problem, got["plan"], {"seed": 808, "data_seed": 88}, got["tiny"], where + " (tiny instance)")


def cheap_judge(case, got):
    expect_type("plan_for's run", got, dict)
    problem = case["problem"]
    where = _judge_plan_valid(problem, got)
    plan = got["plan"]
    full = got["full"]
    if "raised" in full or not full["fits"] or full["steady"] > usable(problem):
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


TASKS = tasks(
    Task("task8_1_train_step", ("train_step",), train_step_cases, train_step_run, train_step_judge),
    Task("task8_2_make_it_fit", ("plan_for", "train_step"), plan_cases, plan_run, fit_judge),
    Task("task8_3_cheapest_plan", ("plan_for", "train_step"), plan_cases, plan_run, cheap_judge),
)
