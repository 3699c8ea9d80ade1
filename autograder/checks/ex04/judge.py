"""Exercise 04's judges: each compares what `run` returned with a reference computed here (refs.py, or the
original clinic script run on the same data) and raises AssertionError with a teaching message."""

from __future__ import annotations

import dataclasses
import math

import torch

import memlab
from memlab.clinic import MODELS, steady_peak

from ..common import expect_type, mb
from .cases import HEADROOM
from .inputs import CASES, Case, case_gpu
from .refs import reference_leak, reference_max_batch
from .run import merged, project, run_tiny


# ----------------------------------------------------------------------------- half 1: it fits
def _one_update_each(what, updates, n_params):
    """Every parameter of the model updated exactly once: one optimizer step, or one per parameter in backward."""
    twice = sorted(i for i, n in updates.items() if n > 1)
    never = n_params - sum(1 for i in updates if not i.startswith("?"))
    assert not twice, (
        f"{what} updated {len(twice)} parameter(s) more than once; the original updates each parameter once, in one "
        f"AdamW step (accumulation calls optimizer.step() once, after all micro-batches).")
    assert never <= 0, (
        f"{what} left {never} of the model's {n_params} parameters without an update: give the optimizer every "
        f"parameter of the model.")


def _judge_full(c: Case, got):
    name = c.fixed_name
    if "raised" in got:
        raise AssertionError(f"{name}('full') raised {got['raised']}. At full size it runs on the virtual GPU's fake "
                             f"tensors: build the model, optimizer and data inside the function (build_gpt, "
                             f"random_tokens) and do not read tensor values (.item(), print(tensor)).")
    capacity = memlab.VirtualGPU(c.gpu).capacity          # the preset as memlab defines it now
    if not got["fits"] and got.get("second_step"):
        raise AssertionError(
            f"{name}('full') fits one step, but a second training step on the model it returns runs out of memory on "
            f"the {c.gpu}:\n{got['oom']}\nWhat your step leaves alive is alive during the next forward and backward "
            f"too: the optimizer's state must stay, but gradients zeroed in place (zero_grad(set_to_none=False)) or "
            f"kept tensors need not. {c.hint_oom}")
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
        assert steps, f"{name}('full') took no optimizer step; the original takes one AdamW step"
        _one_update_each(name + "('full')", got["updates"], got["n_params"])
        assert got["optimizers"] == ["AdamW"], (
            f"{name}('full') steps {got['optimizers']} optimizer(s); the original trains with AdamW. Switching "
            f"optimizers is a different training run, not a memory fix: keep AdamW.")
        missing = [m for s in steps for m in s["missing"]]
        assert not missing, (
            f"at full size the optimizer stepped while {len(missing)} parameters had no gradient (e.g. "
            f"{missing[:3]}): did you run the forward under torch.no_grad()/inference_mode(), or detach "
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
    ref, ref_out = run_tiny(c.original, case, c)
    assert got["configs"] == [dataclasses.asdict(k) for k in ref.configs], (
        f"{name}('tiny') ran a different model than the original: use build_gpt({c.model!r}, size)")
    want_init = [[list(p.shape), p.double().sum().item(), project([p], i)[0]] for i, (_, p) in enumerate(ref.initial)]
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
    assert got["steps"], f"{name}('tiny') took no optimizer step; the original takes one"
    _one_update_each(name + "('tiny')", got["merged"]["updates"], len(ref.initial))
    s, r = got["merged"], merged(ref)
    names = [n for n, _ in ref.initial]
    assert not s["missing"], (
        f"on the tiny instance the optimizer stepped while {len(s['missing'])} parameters had no gradient (e.g. "
        f"{s['missing'][:3]}): training under torch.no_grad()/inference_mode() or on a detached loss computes "
        f"nothing to learn from.")
    assert s["optimizers"] == r["optimizers"], (
        f"{name} steps {s['optimizers']} optimizer(s); the original uses {r['optimizers']}. A different optimizer "
        f"trains a different model: keep {r['optimizers'][0]} and fix the memory another way.")
    want_hyper = r["hyper"]
    assert set(s["hyper"]) == set(want_hyper), (
        f"{name}'s optimizer updates different parameters than the original's: give it every parameter of the "
        f"model, once")
    for i, h in want_hyper.items():
        assert s["hyper"][i] == h, (
            f"{name}'s optimizer hyperparameters for {names[int(i)]} are {s['hyper'][i]}; the original uses {h}. Keep "
            f"the learning rate, betas, eps and weight decay: the fix must not change the maths.")
    assert s["grad_keys"] == r["grad_keys"], f"{name}'s optimizer received gradients for other parameters"
    pr = torch.tensor(r["grad_proj"], dtype=torch.float64)
    ps = torch.tensor(s["grad_proj"], dtype=torch.float64)
    err = (ps - pr).norm().item() / max(pr.norm().item(), 1e-30)
    if not err <= 1e-4:
        ratio = s["grad_norm"] / max(r["grad_norm"], 1e-30)
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
    lr = float(next(iter(want_hyper.values()))["lr"])
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


def script_judge(task):
    c = CASES[task]

    def judge(case, got):
        expect_type(f"{c.fixed_name}'s run", got, dict)
        if case["part"] == "full":
            _judge_full(c, got)
        else:
            _judge_tiny(c, case, got)
    return judge


# each script task's judge by name (the package's __init__.py names them)
task4_1_judge = script_judge("task4_1")
task4_2_judge = script_judge("task4_2")
task4_3_judge = script_judge("task4_3")
task4_4_judge = script_judge("task4_4")


# ----------------------------------------------------------------------------- task4_5
def _desc(case, gpu):
    if case["kind"] == "staircase":
        return (f"a step needing {mb(case['fixed'])} + batch x {mb(case['per'])} on a {mb(gpu.capacity)} virtual "
                f"GPU, limit={case['limit']}")
    if case["kind"] == "contrastive":
        return (f"a contrastive step needing {mb(case['fixed'])} + batch x {mb(case['per'])} + ({case['pairs']}, "
                f"batch, batch) fp32 logits on a {mb(gpu.capacity)} virtual GPU, limit={case['limit']}")
    return (f"one AdamW step of a width-{case['width']} MLP over (batch, 1024, {case['width']}) inputs on the "
            f"{case['gpu']}, limit={case['limit']}")


def max_batch_judge(case, got):
    gpu, limit = case_gpu(case), case["limit"]
    desc = _desc(case, gpu)
    if "oom_escaped" in got:
        raise AssertionError(f"find_max_batch_size let a torch.OutOfMemoryError escape ({desc}): probe with "
                             f"gpu.fits(step_fn, b) or catch the error — an OOM is an answer, not a crash. "
                             f"({got['oom_escaped']})")
    value = got["got"]
    if type(value) is not int:
        raise AssertionError(f"find_max_batch_size must return a Python int, got {value}")
    bad = [b for b in got["calls"] if type(b) is not int or not 1 <= b <= limit]
    assert not bad, f"probe batch sizes must be ints in [1, limit={limit}]; you tried {bad[:5]} ({desc})"
    want = reference_max_batch(case)
    if value != want:
        if value == want + 1:
            hint = (f"one too large: batch {value} does not fit (it raises out-of-memory). When bisecting, return "
                    f"the largest batch you have SEEN fit (lo), not the first one that failed (hi).")
        elif value == want - 1:
            hint = f"one too small: batch {want} fits. Check the end of your search: probe until hi - lo == 1."
        elif want == 0:
            hint = "even batch 1 does not fit here: return 0."
        elif want == limit:
            hint = (f"every batch up to limit={limit} fits: return limit (doubling may jump past a limit that is "
                    f"not a power of two: probe the limit itself).")
        else:
            hint = "search by doubling until a batch fails, then bisect between the last fit and the first failure."
        raise AssertionError(f"{desc}: the largest batch that fits is {want}, you returned {value}: {hint}")
    budget = 2 * math.ceil(math.log2(limit)) + 3
    assert got["n_calls"] <= budget, (
        f"{desc}: you found {value} but ran {got['n_calls']} probe steps; a binary search needs at most about "
        f"2*log2(limit) = {budget} (double until it fails, then bisect). Each probe is a full training step.")


# ----------------------------------------------------------------------------- task4_6
_WHAT = {"outputs": "the step keeps its outputs in a list", "grads": "the step keeps every step's gradients",
         "inputs": "the step keeps its input batches", "eval": "an evaluation with autograd on keeps its loss",
         "hook": "a forward hook keeps a block's output", "none_adam": "no leak (AdamW creates its state in step 1)",
         "none_sgd": "no leak (SGD creates its momentum in step 1)",
         "two_leaks": "the step keeps its outputs and its input batches",
         "grads_and_inputs": "the step keeps every step's gradients and its input batches",
         "late": "the step keeps its outputs from the second step on",
         "flat_then_growing": "the step keeps its input batches from the third step on",
         "leak_and_late_growth": "the step keeps its outputs, and its input batches from the third step on",
         "leak_and_noise": "the step keeps its outputs, and a scratch buffer whose size goes up and down",
         "slow_leak_on_a_big_base": "the step keeps its outputs (a slow leak on top of a large evaluation graph "
                                    "it replaces every step) and its input batches (a faster leak)"}


_TRAPS = {"two_leaks", "grads_and_inputs", "late", "flat_then_growing", "leak_and_late_growth", "leak_and_noise",
          "slow_leak_on_a_big_base"}


def leak_judge(case, got):
    want = reference_leak(case)
    desc = f"{_WHAT[case['kind']]}, batch {case['batch']}, width {case['width']}, {case['n_steps']} steps"
    if want is None:
        assert got.get("none") or case["kind"] not in _TRAPS, (
            f"{desc}: no category grows on every step after the first, but you reported {got}. A category that is "
            f"flat from step 1 to step 2 and grows after is no leak by the spec: compare each step with the one "
            f"before, not only the first with the last.")
        assert got.get("none"), (
            f"{desc}: nothing grows from step to step, but you reported {got}. The optimizer state (or momentum) "
            f"appears once, inside the first step: compare only steps after the first, and require growth on every "
            f"one of them.")
        return
    if got.get("none") or "shape" in got:
        raise AssertionError(f"{desc}: {want[0]} grows by {want[1]:.0f} bytes every step; you returned "
                             f"{got.get('shape', 'None')} (expected a tuple (category, bytes_per_step))")
    assert got["category"] == want[0], (
        f"{desc}: you reported {got['category']!r}, which is not the category that grows the most on every step "
        f"after the first. A category leaks only if it grows on EVERY step after the first (compare each step "
        f"with the one before, not only the first with the last: growth that starts late or goes up and down is "
        f"no leak), and of the leaking categories report the one that grows the most per step, not the first found nor "
        f"the largest in total."
    ) if case["kind"] in _TRAPS else (
        f"{desc}: the category that grows every step is {want[0]!r} (+{want[1]:.0f} B per step); you reported "
        f"{got['category']!r}. Read tracker.breakdown() after each step inside ONE tracker and compare consecutive "
        f"steps.")
    per = got["per_step"]
    if type(per) is not float or not math.isfinite(per):
        raise AssertionError(f"{desc}: bytes_per_step must be a number, got {per}")
    assert abs(per - want[1]) <= max(16, 0.01 * want[1]), (
        f"{desc}: {want[0]} grows by {want[1]:.0f} bytes per step; you reported {per:g}. Average the growth over the "
        f"steps after the first: (after last step - after first step) / (n_steps - 1).")

