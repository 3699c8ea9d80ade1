"""What exercise 08's notebook ("Make it fit") takes from the kit: the models (`MODELS`), the recipe's settings
and `make_step`, the harness that runs a plan. The checks of exercise 08 build models and data with the same
functions.

A *problem* is plain data: {"model": key of MODELS, "gpu": a memlab preset, "batch": sequences per optimizer
step, "seq": tokens per sequence, "headroom": fraction of the capacity to leave free}. A *plan* is plain data:
{"micro_batch": sequences per forward/backward (1..batch; the last micro-batch may be smaller),
"checkpoint": how many transformer blocks are checkpointed (0..n_layer), "optimizer": "foreach" | "fused"}.
The recipe is fixed: fp32 weights, AdamW(lr=LR, betas=BETAS, weight_decay=WD), the mean cross-entropy over all
batch x seq tokens, one optimizer step per batch.

`make_step` builds the model (full size inside a virtual GPU run, or the tiny stand-in on real CPU tensors),
the optimizer the plan asks for and the data, then calls the learner's `train_step`.
"""

from __future__ import annotations

import torch

from ..core.models import GPT, GPTConfig
from ..core.track import watch
from ..core.virtual_gpu import lookup_preset

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
    lookup_preset(problem.get("gpu"))
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
        watch(model, opt)
        x, y = batch_data(problem, size)
        train_step(model, opt, x, y, plan)
    return step
