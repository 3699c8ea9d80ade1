"""Exercise 02's inputs, the learner side rebuilt on both sides from a case's plain data: run.py uses them in the
sandbox, the trusted judge.py in the grader. The stacks of counting blocks (each `CountingBlock` counts its forward
calls inside forward() itself: a non-reentrant checkpoint stops its recomputation early, so forward hooks would
miss calls), memlab's GPT with its batches, the training run a judge compares, and the gradient fingerprints."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from memlab.checkpointing import activation_peak
from memlab.core.models import GPT, GPTConfig


# ----------------------------------------------------------------------------- gradient fingerprints
def fingerprint(t):
    """[sum, sum of |x|, sum of x * w] in float64 (w a fixed random vector), or None."""
    if t is None:
        return None
    t = t.detach().double().flatten()
    w = torch.randn(t.numel(), generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return [float(t.sum()), float(t.abs().sum()), float((t * w).sum())]


# ----------------------------------------------------------------------------- modules the checks own
class CountingBlock(nn.Module):
    """x + fc2(gelu(fc1(x))) that counts how often its forward runs (recomputations included)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.fc2(F.gelu(self.fc1(x)))


# ----------------------------------------------------------------------------- stacks (tasks 2.1, 2.2)
def _stack(case):
    """(container given to the learner, the blocks, x, weights), rebuilt from the case."""
    torch.manual_seed(case["seed"])
    blocks = [CountingBlock(case["d"], 4 * case["d"]) for _ in range(case["n"])]
    container = {"Sequential": lambda: nn.Sequential(*blocks), "ModuleList": lambda: nn.ModuleList(blocks),
                 "list": lambda: list(blocks)}[case["container"]]()
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["rows"], case["d"], generator=g).requires_grad_(case["x_grad"])
    weights = torch.randn(case["rows"], case["d"], generator=g)        # the loss: sum(output * weights)
    return container, blocks, x, weights


def _step(fn, params, x, weights):
    for p in params:
        p.grad = None
    x.grad = None
    out = fn(x)
    (out * weights).sum().backward()
    return out


def _stack_desc(case):
    k = f", k={case['k']}" if "k" in case else ""
    return f"{case['n']} blocks in a {case['container']}{k}, input requires_grad={case['x_grad']}"


# ----------------------------------------------------------------------------- GPTs (task 2.4)
def _gpt_desc(case):
    cfg = case["cfg"]
    return (f"n_layer={cfg['n_layer']}, n_embd={cfg['n_embd']}, pos={cfg.get('pos', 'learned')!r}, "
            f"attn={cfg.get('attn', 'sdpa')!r}, dropout={cfg.get('dropout', 0.0)}, batch {case['B']}x{case['T']}")


def _gpt_setup(case):
    cfg = GPTConfig.tiny(**case["cfg"])
    torch.manual_seed(case["seed"])
    plain = GPT(cfg)
    g = torch.Generator().manual_seed(case["seed"])
    batches = [(torch.randint(0, cfg.vocab_size, (case["B"], case["T"]), generator=g),
                torch.randint(0, cfg.vocab_size, (case["B"], case["T"]), generator=g)) for _ in range(case["steps"])]
    return cfg, plain, batches


def _train(model, case, batches, blocks=None):
    """Logits (eval), then SGD steps with the same dropout masks; what a judge compares."""
    out = {}
    model.eval()
    with torch.no_grad():
        logits = model(batches[0][0])
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"model(idx) must return the logits tensor, got {type(logits).__name__}")
    out["logits_shape"], out["logits"] = list(logits.shape), fingerprint(logits)
    model.train()
    if case.get("frozen_embeddings"):
        model.wte.weight.requires_grad_(False)              # the blocks' input no longer requires grad
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    out["steps"] = []
    for step, (x, y) in enumerate(batches):
        torch.manual_seed(case["seed"] + step)              # the same dropout masks on both sides
        opt.zero_grad(set_to_none=True)
        for b in blocks or []:
            b.calls = 0
        loss = model(x, y)
        loss.backward()
        out["steps"].append({"loss": float(loss.item()), "calls": [b.calls for b in blocks or []],
                             "grads": {n: fingerprint(p.grad) for n, p in model.named_parameters()}})
        opt.step()
    x, y = batches[0]
    torch.manual_seed(case["seed"])
    out["peak"] = activation_peak(model, lambda: model(x, y)).peak        # in training mode, like the steps
    return out
