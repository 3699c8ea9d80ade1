"""Exercise 08's references (never the learner's code): the same rung done plainly on the tiny twin (full
batch, no checkpointing, one backward: plain torch, peft and bitsandbytes as the kit builds them), memlab.fit's
model states for a plan, and the cheapest fitting plan by the stated order, found with memlab.fit."""

from __future__ import annotations

import functools

import torch

import memlab
from memlab.kit.ex08 import (METHODS, OPTIMIZERS, PRECISIONS, build_tiny, fit_options, n_micro, one_thread,
                             plan_error, tiny_batch, usable)

_FIT = memlab.fit                 # bound at import: the grader's own, whatever a learner's call patches


# ----------------------------------------------------------------------------- task8_1
def reference_tiny_run(problem, plan, seed: int, data_seed: int, steps: int):
    """The same rung done plainly: the kit's model and optimizer, the whole batch in one forward and backward, no
    checkpointing. The trainable parameters' gradients handed to each step, and their final values."""
    with one_thread():
        return _plain_run(problem, plan, seed, data_seed, steps)


def _plain_run(problem, plan, seed, data_seed, steps):
    model, opt = build_tiny(problem, plan, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(data_seed)
    grads = []
    for _ in range(steps):
        x, y = tiny_batch(problem, g)
        model(input_ids=x, labels=y).loss.backward()     # HF: the mean over batch x (seq - 1) tokens
        grads.append([p.grad.detach().float().clone() for p in params])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads, [p.detach().float().clone() for p in params]


def reference_memory_peak(problem, plan, seed: int, data_seed: int) -> tuple[int, int]:
    """The grader's own step of the plan on the small twin (micro-batches of plan["micro_batch"], each mean loss
    weighted by its share, backward per micro-batch, one step), twice; the second step's peak, and the bytes still
    alive when it has returned."""
    def step(model, opt, x, y):
        B, m = x.shape[0], plan["micro_batch"]
        for s in range(0, B, m):
            loss = model(input_ids=x[s:s + m], labels=y[s:s + m]).loss * (min(m, B - s) / B)
            loss.backward()
            del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
    with one_thread():
        model, opt = build_tiny(problem, plan, seed, "small")
        gen = torch.Generator().manual_seed(data_seed)
        step(model, opt, *tiny_batch(problem, gen, "small"))
        x, y = tiny_batch(problem, gen, "small")
        with memlab.MemoryTracker(model, opt, device="cpu") as trk:
            step(model, opt, x, y)
            end = int(trk.current)
    return int(trk.peak), end


# ----------------------------------------------------------------------------- memlab.fit, cached
def _key(problem, plan):
    o = fit_options(problem, plan)
    o.pop("headroom")
    return problem["model"], problem["gpu"], tuple(sorted(o.items()))


@functools.lru_cache(maxsize=512)
def _fit(key):
    model, gpu, opts = key
    r = _FIT(model, gpu, **dict(opts))
    _N_PARAMS[model] = int(r.n_params)
    return int(r.peak), {k: int(v) for k, v in r.model_states.items()}, int(r.capacity)


_N_PARAMS: dict = {}


def fit_peak(problem, plan) -> int:
    return _fit(_key(problem, plan))[0]


def fits(problem, plan) -> bool:
    """memlab.fit's verdict for the plan with the problem's headroom."""
    return bool(_FIT(problem["model"], problem["gpu"], **fit_options(problem, plan)).fits)


def reference_states(problem, plan) -> dict:
    """{"parameters", "gradients", "optimizer"}: bytes on the GPU just after the optimizer step, by memlab.fit
    (they do not depend on batch, seq, micro-batches or checkpointing: measured at batch 1 x 32 tokens)."""
    small = {**problem, "batch": 1, "seq": 32}
    return dict(_fit(_key(small, {**plan, "micro_batch": 1, "checkpointing": True}))[1])


# ----------------------------------------------------------------------------- task8_3: the order and the grid
def order_key(problem, plan) -> tuple:
    """The stated cost order, cheapest first: what changes the result first (method full < lora < qlora,
    precision fp32 < bf16, optimizer adamw < adamw8bit), then what only costs time (no offload < offload,
    no checkpointing < checkpointing, fewer micro-batches < more)."""
    return (METHODS.index(plan["method"]), PRECISIONS.index(plan["precision"]), OPTIMIZERS.index(plan["optimizer"]),
            plan["offload"], plan["checkpointing"], n_micro(problem, plan))


def grid(problem) -> list[dict]:
    """Every valid plan of the problem (micro-batches dividing the batch, the problem's rank), cheapest first."""
    B = problem["batch"]
    out = []
    for method in METHODS:
        for precision in PRECISIONS:
            for optimizer in OPTIMIZERS:
                for offload in (False, True):
                    for ckpt in (False, True):
                        for mb in [d for d in range(B, 0, -1) if B % d == 0]:
                            plan = {"method": method, "lora_r": problem["lora_r"], "precision": precision,
                                    "optimizer": optimizer, "checkpointing": ckpt, "micro_batch": mb,
                                    "offload": offload}
                            if plan_error(plan, problem, dividing=True) is None:
                                out.append(plan)
    return sorted(out, key=lambda p: order_key(problem, p))


def weights_floor(problem, plan) -> int:
    """Bytes every plan of the plan's branch holds at its optimizer step, at least: the weights in the plan's
    precision, and for full fine-tuning without offload a gradient as large (memlab.fit's parameter count; a
    lower bound of its model states, which are a lower bound of its peak). 0 for QLoRA."""
    if problem["model"] not in _N_PARAMS:
        _fit(_key({**problem, "batch": 1, "seq": 32}, {**plan, "micro_batch": 1, "checkpointing": True}))
    n, d = _N_PARAMS[problem["model"]], 4 if plan["precision"] == "fp32" else 2
    if plan["method"] == "qlora":
        return 0
    return n * d * (2 if plan["method"] == "full" and not plan["offload"] else 1)


def fitting_before(problem, key) -> dict | None:
    """The first plan of the grid, in the order, that memlab.fit says fits and that comes before `key` (None: no
    such plan). A plan whose branch's weights (and full gradients) alone exceed the usable bytes is not measured
    (weights_floor)."""
    room = usable(problem)
    for plan in grid(problem):
        if order_key(problem, plan) >= key:
            return None
        if weights_floor(problem, plan) > room:
            continue
        if fits(problem, plan):
            return plan
    return None
def reference_plan(problem) -> dict | None:
    """The cheapest plan that fits (None: none does)."""
    return fitting_before(problem, (99,))
