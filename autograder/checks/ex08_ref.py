"""Exercise 08 "Make it fit": the problems, the harness that runs a learner's plan, and the grader's references.

A *problem* is plain data: {"model": key of MODELS, "gpu": a memlab preset, "batch": sequences per optimizer
step, "seq": tokens per sequence, "headroom": fraction of the capacity to leave free}. A *plan* is plain data:
{"micro_batch": sequences per forward/backward (1..batch; the last micro-batch may be smaller),
"checkpoint": how many transformer blocks are checkpointed (0..n_layer), "optimizer": "foreach" | "fused"}.
The recipe is fixed: fp32 weights, AdamW(lr=LR, betas=BETAS, weight_decay=WD), the mean cross-entropy over all
batch x seq tokens, one optimizer step per batch.

`make_step` is the harness the learner's notebook and the checks share: it builds the model (full size inside a
virtual GPU run, or the tiny stand-in on real CPU tensors), the optimizer the plan asks for and the data, then
calls the learner's `train_step`. Everything called `reference_*` below is the grader's own, plain-torch
implementation of the recipe: it never runs learner code.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import memlab
from memlab.clinic import run_full_size
from memlab.core.models import GPT, GPTConfig

LR, BETAS, WD = 1e-3, (0.9, 0.95), 0.1
OPTIMIZERS = ("foreach", "fused")
TINY_SEQ = 13                      # tokens per tiny sequence: not a power of two

_LLAMA = dict(mlp="swiglu", norm="rmsnorm", pos="rope", bias=False, tie_weights=False)
MODELS = {   # name -> {"full": real shapes (0.8B to 1.1B parameters), "tiny": same depth and kind, CPU-sized}
    "gpt-1.1b": {"full": GPTConfig(vocab_size=50257, block_size=2048, n_layer=3, n_head=38, n_embd=4864),
                 "tiny": GPTConfig(vocab_size=64, block_size=32, n_layer=3, n_head=2, n_embd=32)},
    "gpt-0.8b": {"full": GPTConfig(vocab_size=50257, block_size=2048, n_layer=3, n_head=32, n_embd=4096),
                 "tiny": GPTConfig(vocab_size=48, block_size=32, n_layer=3, n_head=4, n_embd=24)},
    "llama-0.8b": {"full": GPTConfig(vocab_size=32000, block_size=4096, n_layer=2, n_head=36, n_embd=4608,
                                     **_LLAMA),
                   "tiny": GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32,
                                     mlp_multiple_of=16, **_LLAMA)},
}


# ----------------------------------------------------------------------------- validating plain data
def check_problem(problem) -> dict:
    if type(problem) is not dict:
        raise TypeError(f"problem must be a dict, got {type(problem).__name__}")
    if problem.get("model") not in MODELS:
        raise ValueError(f"problem['model'] must be one of {sorted(MODELS)}, got {problem.get('model')!r}")
    memlab.virtual_gpu.lookup_preset(problem.get("gpu"))
    for k in ("batch", "seq"):
        if type(problem.get(k)) is not int or problem[k] < 1:
            raise ValueError(f"problem[{k!r}] must be a positive int, got {problem.get(k)!r}")
    return problem


def plan_error(plan, problem) -> str | None:
    """Why `plan` is not a valid plan for `problem` (None if it is)."""
    if type(plan) is not dict:
        return f"a plan must be a dict, got {type(plan).__name__}"
    want = {"micro_batch", "checkpoint", "optimizer"}
    if set(plan) != want:
        return f"a plan has exactly the keys {sorted(want)}, got {sorted(map(str, plan))}"
    mb, k, opt = plan["micro_batch"], plan["checkpoint"], plan["optimizer"]
    n_layer = MODELS[problem["model"]]["full"].n_layer
    if type(mb) is not int or not 1 <= mb <= problem["batch"]:
        return f"plan['micro_batch'] must be an int in 1..{problem['batch']} (the batch), got {mb!r}"
    if type(k) is not int or not 0 <= k <= n_layer:
        return f"plan['checkpoint'] must be an int in 0..{n_layer} (blocks of {problem['model']}), got {k!r}"
    if opt not in OPTIMIZERS:
        return f"plan['optimizer'] must be one of {OPTIMIZERS}, got {opt!r}"
    return None


def n_micro(problem, plan) -> int:
    return -(-problem["batch"] // plan["micro_batch"])


def cost(problem, plan) -> tuple[int, int]:
    """(blocks recomputed per micro-batch, micro-batches per optimizer step): what a plan pays in time."""
    return plan["checkpoint"], n_micro(problem, plan)


def usable(problem) -> int:
    """Bytes a plan may use: the preset's capacity (as memlab defines it now) minus the headroom."""
    return int(memlab.VirtualGPU(problem["gpu"]).capacity * (1 - problem["headroom"]))


# ----------------------------------------------------------------------------- the shared harness
def build(problem, plan, size: str, seed: int = 0):
    """(model, optimizer, params in order) for a plan: full size on the current (fake) mode, or tiny."""
    cfg = MODELS[problem["model"]][size]
    if size == "tiny":
        torch.manual_seed(seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD, **{plan["optimizer"]: True})
    return model, opt, list(model.parameters())


def batch_data(problem, size: str, generator=None):
    """(x, y): (batch, seq) token ids and next-token targets (tiny: seq = TINY_SEQ)."""
    cfg = MODELS[problem["model"]][size]
    shape = (problem["batch"], problem["seq"] if size == "full" else TINY_SEQ)
    return (torch.randint(0, cfg.vocab_size, shape, generator=generator),
            torch.randint(0, cfg.vocab_size, shape, generator=generator))


def make_step(problem, plan, train_step):
    """A step function `step(size)` for memlab.VirtualGPU.run / memlab.clinic.run_full_size: builds the model
    of `problem`, the AdamW the plan asks for and one batch, then calls train_step(model, optimizer, x, y, plan)
    once (one optimizer step on the whole batch)."""
    check_problem(problem)
    if plan_error(plan, problem):
        raise ValueError(plan_error(plan, problem))

    def step(size="full"):
        model, opt, _ = build(problem, plan, size)
        memlab.watch(model, opt)
        x, y = batch_data(problem, size)
        train_step(model, opt, x, y, plan)
    return step


# ----------------------------------------------------------------------------- the grader's references
def _reference_loss(model, x, y, recompute: int):
    """Mean cross-entropy of GPT on (x, y), the first `recompute` blocks under torch.utils.checkpoint."""
    cfg = model.cfg
    T = x.shape[1]
    h = model.wte(x)
    if model.wpe is not None:
        h = h + model.wpe(torch.arange(T))
    rope = (model.rope_cos[:T], model.rope_sin[:T]) if cfg.pos == "rope" else None
    for i, block in enumerate(model.blocks):
        h = checkpoint(block, h, rope, use_reentrant=False) if i < recompute else block(h, rope)
    logits = model.head(model.ln_f(h))
    return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))


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
    """Steady-state peak (bytes) of the grader's own step for this plan (an OOM counts as capacity + 1)."""
    return _reference_peak((tuple(sorted(problem.items())), tuple(sorted(plan.items()))))


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


def project(tensors, seed: int, k: int = 32) -> list[float]:
    """k projections of the concatenation of `tensors` on fixed random directions (float64)."""
    out = torch.zeros(k, dtype=torch.float64)
    for i, t in enumerate(tensors):
        gen = torch.Generator().manual_seed(seed * 7919 + i)
        out += torch.randn(k, t.numel(), generator=gen, dtype=torch.float64) @ t.detach().double().flatten()
    return out.tolist()


def norm(tensors) -> float:
    return math.sqrt(sum(t.double().pow(2).sum().item() for t in tensors))
