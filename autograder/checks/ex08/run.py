"""Exercise 08's runs, in the learner's process: the learner's train_step on a tiny twin (what the optimizer saw
at every step, how often each layer ran), state_bytes on plain arguments, and plan_for with a measuring
function; memlab.fit and memlab.fit_search are kept out of the learner's own calls. Plain data out."""

from __future__ import annotations

import contextlib
import sys

import torch

import memlab
from memlab.checkpointing import ForwardCounter
from memlab.kit.ex08 import build_tiny, decoder_layers, measurer, one_thread, plan_error, tiny_batch

from .inputs import TINY_STEPS, norm, project

_FIT = memlab.fit                 # the measuring function task 8.3 hands plan_for (bound before any patching)


# ----------------------------------------------------------------------------- learner-side helpers
@contextlib.contextmanager
def _no_fit_tool():
    """memlab.fit / memlab.fit_search answer this exercise: they raise while the learner's code runs."""
    homes = [memlab, memlab.fitting, sys.modules.get("memlab.fitting.plan"), sys.modules.get("memlab.fitting.search")]
    saved = [(m, n, getattr(m, n)) for m in homes if m is not None for n in ("fit", "fit_search") if hasattr(m, n)]

    def refuse(*a, **k):
        raise RuntimeError("memlab.fit and memlab.fit_search are off limits inside exercise 08's functions: "
                           "count the bytes yourself (task 8.2) and measure with the `measure` you are handed "
                           "(task 8.3)")
    for m, n, _ in saved:
        setattr(m, n, refuse)
    try:
        yield
    finally:
        for m, n, v in saved:
            setattr(m, n, v)


def _safe(fn, *a):
    try:
        return fn(*a)
    except Exception as e:  # noqa: BLE001 - the judge teaches
        return {"raised": f"{type(e).__name__}: {str(e)[:500]}"}


# ----------------------------------------------------------------------------- task8_1
def _tiny_run(problem, plan, train_step, seed, data_seed, steps=TINY_STEPS):
    """Run the learner's train_step `steps` times on the tiny twin; plain data of what the optimizer saw."""
    model, opt = build_tiny(problem, plan, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    index = {id(p): i for i, p in enumerate(params)}
    seen = []

    def pre_step(o, args, kwargs):
        grads = {index[id(p)]: None if p.grad is None else p.grad.detach().float().clone()   # copies: what the
                 for g in o.param_groups for p in g["params"] if id(p) in index}              # step sees
        seen.append({"missing": [i for i in range(len(params)) if grads.get(i) is None],
                     "unknown": sum(1 for g in o.param_groups for p in g["params"] if id(p) not in index),
                     "grads": [grads.get(i) for i in range(len(params))]})
    opt.register_step_pre_hook(pre_step)
    gen = torch.Generator().manual_seed(data_seed)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    # each layer's first module (its input norm): transformers checkpoints a layer's class forward, so counting
    # the layer itself would miss the recomputation; what runs inside it is counted both times
    embed = ForwardCounter([base.model.embed_tokens])
    layers = ForwardCounter([layer.input_layernorm for layer in decoder_layers(model)])
    calls = []
    try:
        for _ in range(steps):
            x, y = tiny_batch(problem, gen)
            before = len(seen)
            train_step(model, opt, x.clone(), y.clone(), dict(plan))
            calls.append({"steps": len(seen) - before, "embed": embed.total, "layers": layers.total})
            embed.reset()
            layers.reset()
    finally:
        embed.remove()
        layers.remove()
    return {"calls": calls,
            "steps": [{"missing": s["missing"], "unknown": s["unknown"],
                       "proj": project([g if g is not None else torch.zeros_like(p, dtype=torch.float32)
                                        for g, p in zip(s["grads"], params)], 1),
                       "norm": norm([g for g in s["grads"] if g is not None])} for s in seen],
            "final": [p.detach().double().flatten().tolist() for p in params]}


def _memory_run(problem, plan, train_step, seed, data_seed):
    """The learner's step twice on the small twin; the second step's peak (live bytes on the CPU, exact: memlab's
    tracker), when the optimizer's state is alive through forward and backward."""
    model, opt = build_tiny(problem, plan, seed, "small")
    gen = torch.Generator().manual_seed(data_seed)
    train_step(model, opt, *tiny_batch(problem, gen, "small"), dict(plan))         # creates the optimizer state
    x, y = tiny_batch(problem, gen, "small")
    with memlab.MemoryTracker(model, opt, device="cpu") as trk:
        train_step(model, opt, x, y, dict(plan))
        end = int(trk.current)                  # what stays alive into the next step's forward
    return {"peak": int(trk.peak), "end": end}


def train_step_run(case, train_step):
    run = _tiny_run if case["part"] == "tiny" else _memory_run
    with _no_fit_tool(), one_thread():
        return _safe(run, case["problem"], case["plan"], train_step, case["seed"], case["data_seed"])


# ----------------------------------------------------------------------------- task8_2
def state_run(case, state_bytes):
    out = []
    with _no_fit_tool():
        for plan in case["plans"]:
            got = _safe(state_bytes, dict(case["problem"]), dict(plan))
            if type(got) is dict and "raised" not in got:
                got = {k: (v if type(v) is int else repr(v)[:60]) for k, v in got.items() if type(k) is str}
            out.append(got if type(got) is dict else {"returned": type(got).__name__})
    return out


# ----------------------------------------------------------------------------- task8_3
_PLANS: dict = {}


def plan_run(case, plan_for):
    problem = case["problem"]
    key = (id(plan_for), tuple(sorted(problem.items())))
    if key not in _PLANS:
        measure = measurer(dict(problem), _FIT)     # the real memlab.fit object: not the patched name
        with _no_fit_tool():
            plan = _safe(plan_for, dict(problem), measure)
        if type(plan) is not dict:
            out = {"invalid": f"plan_for must return a dict, got {type(plan).__name__}"}
        elif "raised" in plan:
            out = {"raised": plan["raised"]}
        elif plan_error(plan, problem, dividing=True):
            out = {"invalid": plan_error(plan, problem, dividing=True)}
        else:
            out = {"plan": plan}
        _PLANS[key] = out
    return _PLANS[key]
