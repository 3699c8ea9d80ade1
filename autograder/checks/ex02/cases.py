"""Exercise 02's cases, and what both sides rebuild from a case: the stacks of counting blocks (each
`CountingBlock` counts its forward calls inside forward() itself: a non-reentrant checkpoint stops its
recomputation early, so forward hooks would miss calls), memlab's GPT with its batches, the training run a
judge compares, and the gradient fingerprints. The planner's cases are drawn with the references' brute force
(refs.py), imported inside the drawers so that run.py, which imports this module, never loads the references."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from memlab.checkpointing import activation_peak, plan_peak
from memlab.core.models import GPT, GPTConfig

LESSON_BYTES = [48, 48, 40, 32, 24, 16, 12, 8, 8, 6, 4, 4]
LESSON_COST = [2, 2, 3, 3, 4, 4, 6, 6, 8, 8, 10, 10]


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


def _stack_case(r, n, container, x_grad):
    return {"n": n, "d": r.choice([16, 24, 32]), "rows": r.choice([32, 48, 64]), "container": container,
            "x_grad": x_grad, "seed": r.randrange(2**31)}


# ----------------------------------------------------------------------------- task2_1
def _every_k_cases(hidden, r):
    if not hidden:
        return [dict(n=8, d=32, rows=64, container="Sequential", x_grad=True, k=2, seed=21),
                dict(n=8, d=32, rows=64, container="ModuleList", x_grad=False, k=3, seed=22),
                {"validate": [0, -1, 2.0, True, "2"]}]
    containers = ["Sequential", "ModuleList", "list"]
    r.shuffle(containers)                            # every container, an input without grad, in every run
    out = []
    for container, x_grad, kind in zip(containers, (True, False, r.random() < 0.5), ("one", "uneven", "beyond")):
        n = r.randint(6, 14)
        k = {"one": 1, "uneven": r.choice([k for k in range(2, n) if n % k]), "beyond": n + r.randint(0, 2)}[kind]
        out.append({**_stack_case(r, n, container, x_grad), "k": k})
    # k that is not a positive int, in every run: zero, a negative int, a float, a bool (an int subclass) and a
    # string, the last three holding values that would be valid ints
    return out + [{"validate": [0, -r.randint(1, 5), float(r.randint(1, 4)), True, str(r.randint(1, 5))]}]


# ----------------------------------------------------------------------------- task2_2
def _sqrt_cases(hidden, r):
    if not hidden:
        return [{"ns": list(range(1, 30)) + [64, 100, 101]},
                dict(n=16, d=32, rows=64, container="Sequential", x_grad=True, seed=23)]
    s = r.randint(2, 19)
    ns = [1, s * s, s * s + 1, s * s - 1] + [r.randint(2, 400) for _ in range(36)]   # squares and their neighbours
    containers = ["Sequential", "ModuleList", "list"]
    r.shuffle(containers)
    sizes = [r.choice([9, 16]), r.choice([10, 11, 13, 14, 17, 18, 19]), r.randint(9, 20)]   # even and uneven
    return [{"ns": ns}] + [_stack_case(r, n, c, x_grad) for n, c, x_grad in
                           zip(sizes, containers, (True, False, r.random() < 0.5))]


# ----------------------------------------------------------------------------- task2_3
def _chain(m, c, budget, desc, timed=False):
    return {"m": m, "c": c, "budget": budget, "desc": desc, "timed": timed}


def _forced(r, need, free=False):
    """A random short chain where every cheapest plan has `need(plan, recompute_cost)`: drawn until brute force
    says so. free=True draws some recompute costs of 0."""
    from .refs import all_plans, brute_force_plan, min_peak, plan_cost   # not in run.py's imports

    for _ in range(10_000):
        n = r.randint(3, 8)
        m = [r.randint(1, 60) for _ in range(n)]
        c = [0 if free and r.random() < 0.4 else r.randint(1, 20) for _ in range(n)]
        budget = r.randint(min_peak(m), sum(m) - 1)
        best = brute_force_plan(m, c, budget)[0]
        plans = [k for k in all_plans(n) if plan_peak(m, k) <= budget and plan_cost(c, k) == best]
        if all(need(k, c) for k in plans):
            return m, c, budget
    raise RuntimeError("no chain found")


def _plan_cases(hidden, r):
    from .refs import min_peak                                          # not in run.py's imports

    if not hidden:
        lesson = [_chain(LESSON_BYTES, LESSON_COST, b, f"the lesson's 12-layer chain, budget {b}")
                  for b in (100, 140, 250)]
        return lesson + [_chain(LESSON_BYTES, LESSON_COST, min_peak(LESSON_BYTES) - 1,
                                "the lesson's chain, budget below every plan"),
                         _chain([5], [3], 5, "one layer, budget 5")]
    out = []
    for i in range(48):
        n = r.randint(1, 10)
        m, c = [r.randint(1, 100) for _ in range(n)], [r.randint(0, 20) for _ in range(n)]
        lo, hi = min_peak(m), sum(m)
        if i % 6 == 5:
            b = lo - r.randint(1, lo)
            out.append(_chain(m, c, b, f"random chain {i}: act_bytes={m}, recompute_cost={c}, budget {b} below "
                                       f"every plan"))
        else:
            b = r.randint(lo, hi)
            out.append(_chain(m, c, b, f"random chain {i}: act_bytes={m}, recompute_cost={c}, budget {b}"))
    # the edges, in every run: one layer, a budget met exactly, just missed, everything kept, free layers,
    # and chains whose every cheapest plan recomputes a run of several layers / keeps a middle layer
    m1, c1 = [r.randint(1, 100)], [r.randint(1, 20)]
    n = r.randint(4, 9)
    m, c = [r.randint(1, 100) for _ in range(n)], [r.randint(0, 20) for _ in range(n)]
    c0 = [0 if i % 2 else r.randint(1, 9) for i in range(n)]
    out += [_chain(m1, c1, m1[0], f"one layer of {m1[0]} bytes, budget {m1[0]}"),
            _chain(m, c, min_peak(m), f"act_bytes={m}, recompute_cost={c}, a budget of exactly the smallest peak"),
            _chain(m, c, min_peak(m) - 1, f"act_bytes={m}, recompute_cost={c}, a budget 1 byte below every plan"),
            _chain(m, c, sum(m), f"act_bytes={m}, recompute_cost={c}, a budget that holds everything"),
            _chain(m, c0, r.randint(min_peak(m), sum(m)), f"act_bytes={m}, recompute_cost={c0} (free layers)")]
    for need, what, free in (
            (lambda k, c: any(not a and not b for a, b in zip(k, k[1:])), "recomputes a run of two or more layers",
             False),
            (lambda k, c: any(k[1:-1]) and not k[0], "keeps a middle layer but not the first", False),
            (lambda k, c: any(kk and not cc for kk, cc in zip(k, c)), "keeps a layer that is free to recompute",
             True)):
        fm, fc, fb = _forced(r, need, free)
        out.append(_chain(fm, fc, fb, f"act_bytes={fm}, recompute_cost={fc}, budget {fb} (every cheapest plan "
                                      f"{what})"))
    # a longer chain with MiB-sized, uneven layers, within a time limit
    m = [r.randint(1, 16) * 2**20 for _ in range(40)]
    c = [r.randint(1, 50) for _ in range(40)]
    b = r.randint(int(0.2 * sum(m)), int(0.4 * sum(m)))
    out.append(_chain(m, c, b, f"a 40-layer chain, budget {b} bytes", timed=True))
    return out


# ----------------------------------------------------------------------------- task2_4
def _gpt_cases(hidden, r):
    if not hidden:
        return [{"cfg": dict(n_layer=3, n_embd=64, n_head=4, vocab_size=64, block_size=32), "B": 4, "T": 32,
                 "steps": 2, "seed": 24}]
    # learned positions with dropout (the recomputation must replay the masks) and rotary embeddings, both
    # attention kernels, in every run
    attn = ["sdpa", "math"]
    r.shuffle(attn)
    # T < block_size in every run: position tables (learned or rotary) used unsliced do not fit. The rope case
    # trains with the token embedding frozen (fine-tuning the blocks only): the first block's input then does not
    # require grad, and a reentrant checkpoint (use_reentrant=True) gives the blocks no gradient
    out = []
    for pos, dropout, a in (("learned", r.choice([0.1, 0.2]), attn[0]), ("rope", r.choice([0.0, 0.1]), attn[1])):
        block_size = r.choice([32, 40, 48])
        out.append({"cfg": dict(n_layer=r.randint(2, 4), n_embd=32 * r.randint(1, 3), n_head=r.choice([2, 4]),
                                vocab_size=r.choice([48, 64, 96]), block_size=block_size, dropout=dropout, pos=pos,
                                attn=a),
                    "B": r.randint(2, 5), "T": r.randint(12, block_size - 4), "steps": 3, "seed": r.randrange(2**31),
                    "frozen_embeddings": pos == "rope"})
    return out


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
