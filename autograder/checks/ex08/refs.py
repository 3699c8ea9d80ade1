"""Exercise 08's references: the grader's own, plain-torch implementation of the recipe (it never runs learner
code): plain full-batch AdamW on the tiny model, the same plan done plainly at full size on the virtual GPU
(its steady-state peak), and the cheapest fitting plans by brute force over the grid."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

import memlab
from memlab.clinic import run_full_size
from memlab.kit.ex08 import MODELS, batch_data, build


# ----------------------------------------------------------------------------- what a plan costs
def n_micro(problem, plan) -> int:
    return -(-problem["batch"] // plan["micro_batch"])


def cost(problem, plan) -> tuple[int, int]:
    """(blocks recomputed per micro-batch, micro-batches per optimizer step): what a plan pays in time."""
    return plan["checkpoint"], n_micro(problem, plan)


def usable(problem) -> int:
    """Bytes a plan may use: the preset's capacity (as memlab defines it now) minus the headroom."""
    return int(memlab.VirtualGPU(problem["gpu"]).capacity * (1 - problem["headroom"]))


# ----------------------------------------------------------------------------- the grader's references
def _reference_loss(model, x, y, recompute: int):
    """Mean cross-entropy of GPT on (x, y), the first `recompute` blocks under torch.utils.checkpoint: GPT's own
    forward (embed, run_blocks, loss) with this model's run_blocks replaced by one that checkpoints them."""
    blocks = model.blocks                                    # not `model`: no reference cycle through it

    def run_blocks(h, rope):                                 # (B, T, C) -> (B, T, C), as GPT.run_blocks
        for i, block in enumerate(blocks):
            h = checkpoint(block, h, rope, use_reentrant=False) if i < recompute else block(h, rope)
        return h
    model.run_blocks = run_blocks                            # this instance only: the grader's own model
    return model(x, y)


def reference_full_step(problem, plan):
    """The grader's own memory-saving step at full size: micro-batches of plan["micro_batch"] sequences, each
    loss weighted by its share of the batch, backward per micro-batch, one AdamW step."""
    def step(size="full"):
        model, opt, _ = build(problem, plan, "full")
        memlab.watch(model, opt)
        x, y = batch_data(problem, "full")
        B, mb = problem["batch"], plan["micro_batch"]
        for s in range(0, B, mb):
            loss = _reference_loss(model, x[s:s + mb], y[s:s + mb], plan["checkpoint"]) * (min(mb, B - s) / B)
            loss.backward()
            del loss
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


@functools.lru_cache(maxsize=256)
def _reference_peak(key) -> int:
    problem, plan = dict(key[0]), dict(key[1])
    gpu = memlab.VirtualGPU(problem["gpu"])
    _, steady, _ = run_full_size(reference_full_step(problem, plan), gpu)
    return int(steady)


def reference_peak(problem, plan) -> int:
    """Steady-state peak (bytes) of the grader's own step for this plan (an OOM counts as capacity + 1). Cached
    without the headroom, which does not change the peak (hidden problems draw it)."""
    measured = {k: v for k, v in problem.items() if k != "headroom"}
    return _reference_peak((tuple(sorted(measured.items())), tuple(sorted(plan.items()))))


def reference_fits(problem, plan) -> bool:
    return reference_peak(problem, plan) <= usable(problem)


@functools.lru_cache(maxsize=64)
def _front(key):
    problem = dict(key)
    B, L = problem["batch"], MODELS[problem["model"]]["full"].n_layer
    front, best = [], B + 1
    for k in range(L + 1):                       # brute force over the grid, cheapest first; a plan with more
        for n in range(1, best):                 # recomputation AND as many micro-batches is dominated: skipped
            sizes = [m for m in range(B, 0, -1) if -(-B // m) == n]
            fitting = [m for m in sizes if reference_fits(problem, {"micro_batch": m, "checkpoint": k,
                                                                    "optimizer": "fused"})]
            if fitting:
                front.append((k, n, fitting[0]))
                best = n
                break
        if best == 1:
            break
    return tuple(front)


def reference_front(problem) -> dict[int, tuple[int, int]]:
    """The cheapest fitting plans: {checkpointed blocks k: (fewest micro-batches n, a micro_batch that fits with
    them)}, only where no fitting plan is as cheap on both counts and cheaper on one (the Pareto front). Found by
    brute force over the grid with the grader's own step and fused AdamW (which never needs more memory than
    foreach). Every micro_batch is tried: the steady peak is not monotone in it when it does not divide the
    batch (the first micro-batch runs before the gradients exist; a smaller last one is cheap)."""
    return {k: (n, m) for k, n, m in _front(tuple(sorted(problem.items())))}


def dominating(problem, plan_cost, front) -> list[tuple[int, int]]:
    """Fitting (k, n) costs no worse than plan_cost on both counts and better on one."""
    k0, n0 = plan_cost
    return [(k, n) for k, (n, _) in front.items() if k <= k0 and n <= n0 and (k, n) != (k0, n0)]


def reference_tiny_run(problem, seed: int, data_seed: int, steps: int):
    """Plain full-batch AdamW on the tiny model: the grads handed to each step, and the final weights."""
    model, opt, params = build(problem, {"optimizer": "foreach", "micro_batch": 1, "checkpoint": 0}, "tiny", seed)
    g = torch.Generator().manual_seed(data_seed)
    grads = []
    for _ in range(steps):
        x, y = batch_data(problem, "tiny", g)
        loss = model(x, y)                      # GPT.forward: mean cross-entropy over all batch x seq tokens
        loss.backward()
        grads.append([p.grad.detach().clone() for p in params])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads, [p.detach().clone() for p in params]
