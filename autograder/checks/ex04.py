"""Checks for exercise 04, "The OOM clinic" (the contract: checks/common.py).

A fixed clinic script (tasks 4.1-4.4) is graded on both halves, as two kinds of case:
1. "full": `run` runs it at full size on the named virtual GPU inside the learner's process, with the
   recorder (bound at import, before learner code) counting sequences, optimizer steps and peaks;
   `judge` decides whether it fits in steady state (from the second step on AdamW's state is alive
   during forward and backward too) with `HEADROOM` to spare, on the capacity memlab's preset has at
   judge time, and does the original's work;
2. "tiny": `run` runs it on a tiny instance with fresh random data and returns the initial weights, the
   gradients handed to the optimizer (projected on fixed random directions), the hyperparameters and the
   updated weights (or the losses); `judge` runs the original script (the patient, memlab/clinic.py) on the
   same data and compares.
Tasks 4.5 and 4.6: see ex04_tools.py.
"""

from __future__ import annotations

import dataclasses
import math

import torch

import memlab

from .common import Task, expect_type, mb, tasks, torch_seed
from memlab.clinic import (CASES, HEADROOM, MODELS, SEQ_LEN, Case, _Recorder, build_gpt, evaluate,  # noqa: F401
                       random_tokens, run_full_size, steady_peak, train_1b3, train_accumulated, train_big_batch)
from .ex04_tools import LEAK_TASK, MAX_BATCH_TASK

__all__ = ["TASKS", "MODELS", "SEQ_LEN", "HEADROOM", "CASES", "build_gpt", "random_tokens", "run_full_size",
           "train_big_batch", "evaluate", "train_accumulated", "train_1b3"]

K_PROJ = 32                      # random directions the gradients are projected on


def _hyper(v):
    """An optimizer hyperparameter as plain data."""
    if isinstance(v, torch.Tensor):
        return float(v)
    if isinstance(v, (tuple, list)):
        return [_hyper(x) for x in v]
    if v is None or type(v) in (bool, int, float, str):
        return v
    return repr(v)[:60]


def _project(tensors, seed: int) -> list[float]:
    """K_PROJ projections of the concatenation of `tensors` on fixed random directions (float64)."""
    out = torch.zeros(K_PROJ, dtype=torch.float64)
    for i, t in enumerate(tensors):
        g = torch.Generator().manual_seed(seed * 7919 + i)
        out += torch.randn(K_PROJ, t.numel(), generator=g, dtype=torch.float64) @ t.detach().double().flatten()
    return out.tolist()


def _script_cases(task):
    def cases(hidden, r):
        if not hidden:
            return [{"part": "full"}, {"part": "tiny", "seed": 401, "data_seed": 7}]
        return [{"part": "full"}, {"part": "tiny", "seed": torch_seed(r), "data_seed": r.randrange(2**31)}]
    return cases


def _tiny_data(case, c: Case):
    return random_tokens(c.model, "tiny", c.rows, generator=torch.Generator().manual_seed(case["data_seed"]))


def _run_tiny(fn, case, c: Case):
    x, y = _tiny_data(case, c)
    rec = _Recorder(clone=True)
    torch.manual_seed(case["seed"])
    with rec:
        out = fn("tiny", data=(x.clone(), y.clone()))
    return rec, out


def _script_run(task):
    c = CASES[task]

    def run(case, **names):
        fn = names[c.fixed_name]
        if not callable(fn):
            return {"raised": f"{c.fixed_name} is a {type(fn).__name__}, not a function taking (size, data)"}
        if case["part"] == "full":
            rec = _Recorder(clone=False)
            try:
                with rec:
                    run_ = memlab.VirtualGPU(c.gpu).run(fn, "full", catch_oom=True)
            except Exception as e:  # noqa: BLE001 - the judge teaches
                return {"raised": f"{type(e).__name__}: {str(e)[:400]}"}
            return {"fits": bool(run_.fits), "oom": None if run_.fits else str(run_.oom_message)[:3000],
                    "peak": int(run_.peak), "pre_step_peak": [int(p) for p in rec.pre_step_peak],
                    "state_bytes": [int(s) for s in rec.state_bytes], "rows": int(rec.rows),
                    "configs": [dataclasses.asdict(k) for k in rec.configs],
                    "steps": [{"optimizer": s["optimizer"], "missing": list(map(str, s["missing"]))}
                              for s in rec.steps]}
        try:
            rec, out = _run_tiny(fn, case, c)
        except Exception as e:  # noqa: BLE001
            return {"raised_tiny": f"{type(e).__name__}: {str(e)[:400]}"}
        got = {"configs": [dataclasses.asdict(k) for k in rec.configs],
               "initial": [[list(p.shape), p.double().sum().item(), _project([p], i)[0]]
                           for i, (_, p) in enumerate(rec.initial)],
               "steps": [{"optimizer": s["optimizer"], "missing": list(map(str, s["missing"])),
                          "hyper": {str(i): {k: _hyper(v) for k, v in h.items()} for i, h in s["hyper"].items()},
                          "grad_keys": sorted(map(str, s["grads"])),
                          "grad_norm": math.sqrt(sum(g.double().pow(2).sum().item() for g in s["grads"].values())),
                          "grad_proj": _project([s["grads"][i] for i in sorted(s["grads"], key=str)], 1)}
                         for s in rec.steps]}
        if isinstance(out, torch.nn.Module):
            got["out"] = {"module": [[list(p.shape), p.detach().float().flatten().tolist()]
                                     for p in out.parameters()]}
        elif isinstance(out, torch.Tensor):
            got["out"] = {"tensor": out.detach().double().tolist(), "shape": list(out.shape)}
        else:
            got["out"] = {"other": type(out).__name__}
        return got
    return run


# ----------------------------------------------------------------------------- half 1: it fits
def _judge_full(c: Case, got):
    name = c.fixed_name
    if "raised" in got:
        raise AssertionError(f"{name}('full') raised {got['raised']}. At full size it runs on the virtual GPU's fake "
                             f"tensors: build the model, optimizer and data inside the function (build_gpt, "
                             f"random_tokens) and do not read tensor values (.item(), print(tensor)).")
    capacity = memlab.VirtualGPU(c.gpu).capacity          # the preset as memlab defines it now
    if not got["fits"]:
        raise AssertionError(f"{name}('full') still runs out of memory on the {c.gpu}:\n{got['oom']}\n{c.hint_oom}")
    want_cfg = dataclasses.asdict(MODELS[c.model]["full"])
    assert got["configs"] == [want_cfg], (
        f"{name}('full') must train the original model, {c.model} (build_gpt({c.model!r}, size)); it ran "
        f"{len(got['configs'])} different GPT configuration(s). Fix the memory, not the model.")
    assert got["rows"] == c.rows, (
        f"{name}('full') pushed {got['rows']} sequences through the model; the original processes {c.rows}. "
        + ("Shrinking the batch fits, but trains on fewer samples: keep all of them (accumulate gradients "
           "over micro-batches)." if got["rows"] < c.rows else
           "Every sequence should go through the model exactly once."))
    steps = got["steps"]
    if c.trains:
        assert len(steps) == 1, (
            f"{name}('full') took {len(steps)} optimizer steps; the original takes exactly one (accumulation "
            f"calls optimizer.step() once, after all micro-batches).")
        assert steps[0]["optimizer"] == "AdamW", (
            f"{name}('full') steps a {steps[0]['optimizer']} optimizer; the original trains with AdamW. Switching "
            f"optimizers is a different training run, not a memory fix: keep AdamW.")
        assert not steps[0]["missing"], (
            f"at full size the optimizer stepped while {len(steps[0]['missing'])} parameters had no gradient (e.g. "
            f"{steps[0]['missing'][:3]}): did you run the forward under torch.no_grad()/inference_mode(), or detach "
            f"the loss? Then nothing is trained.")
    else:
        assert not steps, f"{name}('full') is an evaluation: it must not step an optimizer"
    steady = steady_peak(True, got["peak"], got["pre_step_peak"], got["state_bytes"])
    if steady > capacity - HEADROOM:
        extra = ""
        if steady > got["peak"]:
            extra = (f" This first step peaks at {mb(got['peak'])}, but from the second step on AdamW's "
                     f"{mb(got['state_bytes'][0])} of state is alive during forward and backward too.")
        raise AssertionError(
            f"{name}('full') peaks at {mb(steady)} in steady state on the {c.gpu} ({mb(capacity)}), leaving "
            f"{mb(capacity - steady)}: keep at least {mb(HEADROOM)} free for the CUDA context and allocator "
            f"rounding, which the virtual GPU does not model.{extra} {c.hint_oom}")


# ----------------------------------------------------------------------------- half 2: same maths
def _judge_tiny(c: Case, case, got):
    name = c.fixed_name
    if "raised_tiny" in got:
        raise AssertionError(f"{name}('tiny', data=...) raised {got['raised_tiny']}. At size 'tiny' it must run on "
                             f"real CPU tensors, on the (x, y) batch given as `data`.")
    ref, ref_out = _run_tiny(c.original, case, c)
    assert got["configs"] == [dataclasses.asdict(k) for k in ref.configs], (
        f"{name}('tiny') ran a different model than the original: use build_gpt({c.model!r}, size)")
    want_init = [[list(p.shape), p.double().sum().item(), _project([p], i)[0]] for i, (_, p) in enumerate(ref.initial)]
    same = len(got["initial"]) == len(want_init) and all(
        a[0] == b[0] and all(math.isclose(u, v, rel_tol=1e-9, abs_tol=1e-9) for u, v in zip(a[1:], b[1:]))
        for a, b in zip(got["initial"], want_init))
    assert same, (f"{name}('tiny') starts from different weights than the original. Build the model first, with "
                  f"build_gpt({c.model!r}, size), before drawing any random numbers, and keep all its parameters.")
    out = got["out"]
    if not c.trains:
        want = ref_out.detach().double()
        if "tensor" not in out:
            raise AssertionError(f"{name} must return the losses as a tensor of shape {tuple(want.shape)} (like the "
                                 f"original), got {out.get('other', 'a model')}")
        assert out["shape"] == list(want.shape), (
            f"{name} returned losses of shape {tuple(out['shape'])}; the original returns {tuple(want.shape)} (the "
            f"mean loss of each batch of 16)")
        g = torch.tensor(out["tensor"], dtype=torch.float64)
        assert torch.allclose(g, want, rtol=1e-5, atol=1e-6), (
            f"{name} returned losses {g.tolist()} but the original computes {want.tolist()} on the same data: keep "
            f"the batches of 16 and the per-batch mean.")
        return
    assert len(got["steps"]) == 1, f"{name}('tiny') took {len(got['steps'])} optimizer steps; the original takes one"
    s, r = got["steps"][0], ref.steps[0]
    names = [n for n, _ in ref.initial]
    assert not s["missing"], (
        f"on the tiny instance the optimizer stepped while {len(s['missing'])} parameters had no gradient (e.g. "
        f"{s['missing'][:3]}): training under torch.no_grad()/inference_mode() or on a detached loss computes "
        f"nothing to learn from.")
    assert s["optimizer"] == r["optimizer"], (
        f"{name} steps a {s['optimizer']} optimizer; the original uses {r['optimizer']}. A different optimizer trains "
        f"a different model: keep {r['optimizer']} and fix the memory another way.")
    want_hyper = {str(i): {k: _hyper(v) for k, v in h.items()} for i, h in r["hyper"].items()}
    assert set(s["hyper"]) == set(want_hyper), (
        f"{name}'s optimizer updates different parameters than the original's: give it every parameter of the "
        f"model, once")
    for i, h in want_hyper.items():
        assert s["hyper"][i] == h, (
            f"{name}'s optimizer hyperparameters for {names[int(i)]} are {s['hyper'][i]}; the original uses {h}. Keep "
            f"the learning rate, betas, eps and weight decay: the fix must not change the maths.")
    keys = sorted(r["grads"], key=str)
    assert s["grad_keys"] == sorted(map(str, keys)), f"{name}'s optimizer received gradients for other parameters"
    pr = torch.tensor(_project([r["grads"][i] for i in keys], 1), dtype=torch.float64)
    ps = torch.tensor(s["grad_proj"], dtype=torch.float64)
    err = (ps - pr).norm().item() / max(pr.norm().item(), 1e-30)
    if not err <= 1e-4:
        ratio = s["grad_norm"] / max(math.sqrt(sum(g.double().pow(2).sum().item() for g in r["grads"].values())),
                                     1e-30)
        cos = (ps @ pr).item() / max(ps.norm().item() * pr.norm().item(), 1e-30)
        if cos > 0.999:
            why = (f"Your gradient points the same way but is {ratio:.3g}x the original's: a loss scale is off. Divide "
                   f"each micro-batch's loss by the number of micro-batches, so that the accumulated gradient is the "
                   f"gradient of the mean over the whole batch.")
        else:
            why = ("Your gradient points elsewhere: it was computed from different samples or a different loss. Every "
                   "sequence of the batch must contribute, each weighted as in the original's mean — a smaller batch "
                   "without accumulation trains a different model.")
        raise AssertionError(f"on a tiny instance with fresh random data, the gradient {name} hands to the optimizer "
                             f"differs from the original's by about {err:.2e} (relative). {why}")
    if "module" not in out:
        raise AssertionError(f"{name} must return the trained model (like the original), got {out.get('other')}")
    ref_params = list(ref_out.named_parameters())
    mine = out["module"]
    assert len(mine) == len(ref_params) and all(a[0] == list(b.shape) for a, (_, b) in zip(mine, ref_params)), (
        f"{name} returned a model with different parameters than the original: return the model you trained")
    # Adam's first step is about lr * g / (|g| + eps): where a gradient is as small as eps, float rounding in g
    # (micro-batches add in another order) moves that weight by up to 2 lr. So: almost every weight must agree to
    # 5% of a step, and none may be further apart than Adam's largest possible disagreement.
    lr = float(next(iter(r["hyper"].values()))["lr"])
    off, total, worst = 0, 0, (0.0, "")
    for (_, vals), (pname, w) in zip(mine, ref_params):
        diff = (torch.tensor(vals, dtype=torch.float32) - w.detach().flatten()).abs()
        off += int((diff > 0.05 * lr).sum())
        total += diff.numel()
        if diff.max().item() > worst[0]:
            worst = (diff.max().item(), pname)
    assert off <= 1e-3 * total and worst[0] <= 2.5 * lr, (
        f"the gradients match, but after the step {off} of {total} weights differ from the original's by more than "
        f"5% of the learning rate ({lr}); the largest difference is {worst[0]:.2e} in {worst[1]}. Step the optimizer "
        f"exactly once, after all micro-batches, and return the model it updated.")


def _script_judge(task):
    c = CASES[task]

    def judge(case, got):
        expect_type(f"{c.fixed_name}'s run", got, dict)
        if case["part"] == "full":
            _judge_full(c, got)
        else:
            _judge_tiny(c, case, got)
    return judge


def _script_task(gid, task):
    return Task(gid, (CASES[task].fixed_name,), _script_cases(task), _script_run(task), _script_judge(task))


TASKS = tasks(
    _script_task("task4_1_big_batch", "task4_1"),
    _script_task("task4_2_eval_no_grad", "task4_2"),
    _script_task("task4_3_accumulated_loss", "task4_3"),
    _script_task("task4_4_optimizer_step", "task4_4"),
    MAX_BATCH_TASK,
    LEAK_TASK,
)
