"""Exercise 08's references (never the learner's code): the same rung done plainly on the tiny twin (full
batch, no checkpointing, one backward: plain torch, peft and bitsandbytes as the kit builds them), memlab.fit's
model states for a plan, and the cheapest fitting plan by the stated order, found with memlab.fit."""

from __future__ import annotations

import functools

import torch

import memlab
from memlab.core.gpus import usable_bytes
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


def reference_memory_peak(problem, plan, seed: int, data_seed: int, size: str = "small") -> tuple[int, int]:
    """The grader's own step of the plan on the twin of `size` (micro-batches of plan["micro_batch"], each mean loss
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
        model, opt = build_tiny(problem, plan, seed, size)
        gen = torch.Generator().manual_seed(data_seed)
        step(model, opt, *tiny_batch(problem, gen, size))
        x, y = tiny_batch(problem, gen, size)
        with memlab.MemoryTracker(model, opt, device="cpu") as trk:
            step(model, opt, x, y)
            end = int(trk.current)
    return int(trk.peak), end


# ----------------------------------------------------------------------------- memlab.fit, cached
def _key(problem, plan):
    """What memlab.fit's answer for the plan depends on, the headroom aside (the verdict is computed from it here):
    a full fine-tune's lora_r changes nothing, so it is one key whatever the problem's rank."""
    o = fit_options(problem, plan)
    o.pop("headroom")
    if plan["method"] == "full":
        o["lora_r"] = 8
    return problem["model"], problem["gpu"], tuple(sorted(o.items()))


@functools.lru_cache(maxsize=1024)
def _fit(key):
    """memlab.fit's run of a plan, kept as plain numbers: (peak, model states, capacity, needed = reserved + the
    CUDA context, trainable parameters). memlab.fit keeps each measured step on disk too (MEMLAB_FIT_CACHE): the
    grader's case generator, its judges and the next run read it back."""
    model, gpu, opts = key
    r = _FIT(model, gpu, **dict(opts))
    _N_PARAMS[model] = int(r.n_params)
    return (int(r.peak), {k: int(v) for k, v in r.model_states.items()}, int(r.capacity), int(r.needed),
            int(r.trainable))


_N_PARAMS: dict = {}


def fit_peak(problem, plan) -> int:
    return _fit(_key(problem, plan))[0]


def measured(problem, plan) -> tuple[int, int, int]:
    """(peak, needed, capacity) in bytes of memlab.fit's run of the plan: it fits where needed <= usable bytes."""
    peak, _, capacity, needed, _ = _fit(_key(problem, plan))
    return peak, needed, capacity


def fits(problem, plan) -> bool:
    """memlab.fit's verdict for the plan with the problem's headroom: reserved + context <= capacity x (1 -
    headroom) (FitResult.fits, computed from the same numbers; tests/test_checks_ex08.py compares the two)."""
    peak, needed, capacity = measured(problem, plan)
    return needed <= usable_bytes(capacity, problem["headroom"])


def reference_states(problem, plan) -> dict:
    """{"parameters", "gradients", "optimizer"}: bytes on the GPU just after the optimizer step, by memlab.fit
    (they do not depend on batch, seq, micro-batches or checkpointing: measured at batch 1 x 32 tokens)."""
    return dict(_fit(_state_key(problem, plan))[1])


def _state_key(problem, plan):
    return _key({**problem, "batch": 1, "seq": 32}, {**plan, "micro_batch": 1, "checkpointing": True})


# ----------------------------------------------------------------------------- task8_2: what each mistake weighs
@functools.lru_cache(maxsize=4)
def _tensor_sizes(model: str) -> tuple[tuple[int, ...], int]:
    """(values of every parameter tensor, values of the decoder layers' linear weights) of the model, counted on a
    meta-device model built by transformers from its config (no memory, no formula)."""
    from transformers import AutoModelForCausalLM
    from memlab.fitting.config import load_config
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(load_config(model))
    sizes = tuple(p.numel() for p in m.parameters())
    linear = sum(mod.weight.numel() for layer in m.model.layers for mod in layer.modules()
                 if isinstance(mod, torch.nn.Linear))
    return sizes, linear


def mistake_weights(problem, plan) -> dict:
    """category -> the bytes the smallest mistake the task must catch weighs in memlab.fit's own count of this plan
    (absent: no small mistake there, the plain tolerance holds). Each is memlab.fit's number less the same count
    without the part (the model's tensor sizes from a meta-device model, the trainable count from memlab.fit):
    - QLoRA parameters: NF4's constants (an absmax byte per block of 64, double quantization's fp32 per 256 of
      those, the code tables): what a count of half a byte per 4-bit weight misses;
    - full fine-tuning with AdamW8bit, no offload, optimizer: the 8-bit state's fp32 absmax per block of 256;
    - LoRA parameters: the frozen base in the other precision (2 bytes a weight).
    """
    states = reference_states(problem, plan)
    trainable = _fit(_state_key(problem, plan))[4]
    sizes, linear = _tensor_sizes(problem["model"])
    n = sum(sizes)
    out = {}
    if plan["method"] == "qlora":
        out["parameters"] = states["parameters"] - (4 * (n - linear) + linear // 2 + 4 * trainable)
    elif plan["method"] == "lora":
        out["parameters"] = 2 * n
    elif plan["optimizer"] == "adamw8bit" and not plan["offload"]:
        out["optimizer"] = states["optimizer"] - sum(2 * k if k >= 4096 else 8 * k for k in sizes)
    return out


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
        _fit(_state_key(problem, plan))
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


def offload_branch(problem) -> dict:
    """The branch of full fine-tuning in pure bf16 with AdamW and ZeRO-Offload (the problem's rank, unused)."""
    return {"method": "full", "lora_r": problem["lora_r"], "precision": "bf16", "optimizer": "adamw",
            "offload": True}


def trap_windows(problem, headrooms=(0.01, 0.2)) -> list[tuple[int, int, int]]:
    """Where, in usable bytes, a problem whose first branch with room is full fine-tuning in pure bf16 with
    ZeRO-Offload teaches both of the order's finer points: [(m, lo, hi), ...] such that with lo <= usable < hi
    - the first plan that fits is (no checkpointing, micro_batch m), with m < the batch: every plan of the branch
      without checkpointing and larger micro-batches needs more than the usable bytes;
    - the plan just before it peaks at most at the usable bytes but does not fit: a plan_for that compares
      measure(plan)["peak"] with the usable bytes instead of reading measure(plan)["fits"] returns it;
    - checkpointing the whole batch fits too: a plan_for that tries fewer micro-batches before no checkpointing
      returns that plan;
    and the headroom stays within `headrooms`. Measured with memlab.fit (each run kept on disk for the judge)."""
    B = problem["batch"]
    branch = offload_branch(problem)
    mbs = [d for d in range(B, 0, -1) if B % d == 0]
    plain = {m: measured(problem, {**branch, "checkpointing": False, "micro_batch": m}) for m in mbs}
    _, ck_needed, capacity = measured(problem, {**branch, "checkpointing": True, "micro_batch": B})
    out = []
    for i in range(1, len(mbs)):
        m, before = mbs[i], mbs[i - 1]
        lo = max(plain[m][1], plain[before][0], ck_needed, usable_bytes(capacity, headrooms[1]))
        hi = min(min(plain[k][1] for k in mbs[:i]), usable_bytes(capacity, headrooms[0]))
        if hi - lo >= 2**24:                                   # 16 MiB at least: room for a drawn headroom
            out.append((m, lo, hi))
    return out


def trap_headroom(problem, r) -> float | None:
    """A headroom drawn with `r` inside one of trap_windows(problem) (None: there is none), with 4 decimals."""
    windows = trap_windows(problem)
    if not windows:
        return None
    _, lo, hi = r.choice(windows)
    capacity = measured(problem, {**offload_branch(problem), "checkpointing": True,
                                  "micro_batch": problem["batch"]})[2]
    for _ in range(100):
        h = round(1 - r.uniform(lo + (hi - lo) / 8, hi - (hi - lo) / 8) / capacity, 4)
        if lo <= usable_bytes(capacity, h) < hi:
            return h
    return None


def reference_plan(problem) -> dict | None:
    """The cheapest plan that fits (None: none does)."""
    return fitting_before(problem, (99,))
