"""Exercise 02, tasks 2.3 (the checkpoint planner) and 2.4 (the checkpointed GPT); see ex02.py."""

from __future__ import annotations

import signal
import time

import torch

from memlab.checkpointing import activation_peak
from memlab.core.models import GPT, GPTConfig

from .common import Task, mb
from .ex02_refs import (RTOL, RefCheckpointedGPT, all_plans, brute_force_plan, count_gpt_blocks, fingerprint,
                        min_peak, plan_cost, plan_peak, same, search_min_cost)

PLANNER_SECONDS = 20
LESSON_BYTES = [48, 48, 40, 32, 24, 16, 12, 8, 8, 6, 4, 4]
LESSON_COST = [2, 2, 3, 3, 4, 4, 6, 6, 8, 8, 10, 10]


# ----------------------------------------------------------------------------- task2_3
def _chain(m, c, budget, desc, timed=False):
    return {"m": m, "c": c, "budget": budget, "desc": desc, "timed": timed}


def _forced(r, need):
    """A random short chain where every cheapest plan has `need(plan)`: drawn until brute force says so."""
    for _ in range(10_000):
        n = r.randint(3, 8)
        m, c = [r.randint(1, 60) for _ in range(n)], [r.randint(1, 20) for _ in range(n)]
        budget = r.randint(min_peak(m), sum(m) - 1)
        best = brute_force_plan(m, c, budget)[0]
        plans = [k for k in all_plans(n) if plan_peak(m, k) <= budget and plan_cost(c, k) == best]
        if all(need(k) for k in plans):
            return m, c, budget
    raise RuntimeError("no chain found")


def _plan_cases(hidden, r):
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
    for need, what in ((lambda k: any(not a and not b for a, b in zip(k, k[1:])), "recomputes a run of two or "
                                                                                   "more layers"),
                       (lambda k: any(k[1:-1]) and not k[0], "keeps a middle layer but not the first")):
        fm, fc, fb = _forced(r, need)
        out.append(_chain(fm, fc, fb, f"act_bytes={fm}, recompute_cost={fc}, budget {fb} (every cheapest plan "
                                      f"{what})"))
    # a longer chain with MiB-sized, uneven layers, within a time limit
    m = [r.randint(1, 16) * 2**20 for _ in range(40)]
    c = [r.randint(1, 50) for _ in range(40)]
    b = r.randint(int(0.2 * sum(m)), int(0.4 * sum(m)))
    out.append(_chain(m, c, b, f"a 40-layer chain, budget {b} bytes", timed=True))
    return out


class _TooSlow(BaseException):
    pass


def _call_timed(fn, seconds):
    """fn() with a wall-clock limit (SIGALRM; restores an alarm that was already set)."""
    if not hasattr(signal, "setitimer"):
        return fn()
    left, _ = signal.getitimer(signal.ITIMER_REAL)

    def too_slow(signum, frame):
        raise _TooSlow()

    old = signal.signal(signal.SIGALRM, too_slow)
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, min(seconds, left) if left else seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if left:
            signal.setitimer(signal.ITIMER_REAL, max(left - (time.monotonic() - start), 0.001))


def _plan_run(case, plan_checkpoints):
    call = lambda: plan_checkpoints(list(case["m"]), list(case["c"]), case["budget"])  # noqa: E731
    try:
        keep = _call_timed(call, PLANNER_SECONDS) if case["timed"] else call()
    except _TooSlow:
        return {"too_slow": PLANNER_SECONDS}
    except Exception as e:  # noqa: BLE001
        return {"raised": type(e).__name__, "message": str(e)[:300]}
    try:
        keep = list(keep)
    except TypeError:
        return {"keep": repr(keep)[:200]}
    return {"keep": [bool(k) if type(k) is bool or (type(k) is int and k in (0, 1)) else repr(k)[:40]
                     for k in keep]}


def _show(keep):
    return "".join("K" if k else "." for k in keep)


def _plan_judge(case, got):
    m, c, budget, desc = case["m"], case["c"], case["budget"], case["desc"]
    if "too_slow" in got:
        raise AssertionError(f"task2_3: your planner took more than {got['too_slow']} s on {desc}; trying every "
                             f"subset (2**{len(m)} plans) cannot finish: use dynamic programming over (next layer, "
                             f"bytes kept).")
    want = brute_force_plan(m, c, budget)[0] if len(m) <= 12 else search_min_cost(m, c, budget)
    if want is None:
        if "raised" in got:
            assert got["raised"] == "ValueError", (
                f"task2_3 ({desc}): for a budget no plan can meet, raise ValueError; your planner raised "
                f"{got['raised']}: {got['message']}")
            assert "budget" in got["message"].lower(), (
                f"task2_3 ({desc}): raise ValueError with a message that says the budget cannot be met (mention "
                f"the budget), got {got['message']!r}")
            return
        raise AssertionError(f"task2_3 ({desc}): no plan fits a budget of {budget} bytes (the smallest possible "
                             f"peak is {min_peak(m)}), yet your planner returned {got['keep']!r} instead of raising "
                             f"ValueError. Never return a plan that breaks the budget.")
    if "raised" in got:
        raise AssertionError(f"task2_3 ({desc}): your planner raised {got['raised']} ({got['message']}), but a plan "
                             f"fits this budget" + (" (a plan may use the budget exactly: peak <= budget)"
                                                    if got["raised"] == "ValueError" else ""))
    keep = got["keep"]
    assert isinstance(keep, list) and len(keep) == len(m) and all(type(k) is bool for k in keep), (
        f"task2_3 ({desc}): plan_checkpoints must return one bool per layer ({len(m)}), got {keep!r}")
    peak, cost = plan_peak(m, keep), plan_cost(c, keep)
    assert peak <= budget, (
        f"task2_3 ({desc}): your plan {_show(keep)} peaks at {peak} bytes, over the budget of {budget}. Check every "
        f"moment of the cost model: the end of the forward (all kept outputs) and each recomputed run (the outputs "
        f"kept before it plus the whole run).")
    assert cost == want, (
        f"task2_3 ({desc}): your plan {_show(keep)} fits (peak {peak}) but costs {cost}; the cheapest plan that "
        f"fits costs {want}. A greedy choice (keep the expensive or small layers first) is not optimal in "
        f"general: search over where each recomputed run starts and ends, with the bytes kept so far as part of "
        f"the state (dynamic programming); and remember the plan may end with a recomputed run.")


TASK3 = Task("task2_3_plan_checkpoints", ("plan_checkpoints",), _plan_cases, _plan_run, _plan_judge)


# ----------------------------------------------------------------------------- task2_4
def _gpt_cases(hidden, r):
    if not hidden:
        return [{"cfg": dict(n_layer=3, n_embd=64, n_head=4, vocab_size=64, block_size=32), "B": 4, "T": 32,
                 "steps": 2, "seed": 24}]
    # learned positions with dropout (the recomputation must replay the masks) and rotary embeddings, both
    # attention kernels, in every run
    attn = ["sdpa", "math"]
    r.shuffle(attn)
    return [{"cfg": dict(n_layer=r.randint(2, 4), n_embd=32 * r.randint(1, 3), n_head=r.choice([2, 4]),
                         vocab_size=r.choice([48, 64, 96]), block_size=32, dropout=dropout, pos=pos, attn=a),
             "B": r.randint(2, 5), "T": r.choice([16, 24, 32]), "steps": 3, "seed": r.randrange(2**31)}
            for pos, dropout, a in (("learned", r.choice([0.1, 0.2]), attn[0]), ("rope", r.choice([0.0, 0.1]), attn[1]))]


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


def _gpt_run(case, CheckpointedGPT):
    cfg, plain, batches = _gpt_setup(case)
    desc = _gpt_desc(case)
    try:
        mine = CheckpointedGPT(cfg)
    except Exception as e:  # noqa: BLE001
        return {"problem": f"task2_4 ({desc}): CheckpointedGPT(cfg) raised {type(e).__name__}: {e}"}
    if not isinstance(mine, GPT):
        return {"problem": f"task2_4: CheckpointedGPT must subclass memlab.models.GPT (got {type(mine).__mro__}); "
                           f"override forward(), keep the parameters"}
    try:
        mine.load_state_dict(plain.state_dict())
    except Exception as e:  # noqa: BLE001
        return {"problem": f"task2_4 ({desc}): CheckpointedGPT must have exactly GPT's parameters under the same "
                           f"names, so a plain GPT's state_dict loads into it; load_state_dict failed: "
                           f"{str(e)[:300]}. Override forward() instead of wrapping or renaming the blocks."}
    blocks = count_gpt_blocks(mine)
    try:
        return _train(mine, case, batches, blocks)
    except Exception as e:  # noqa: BLE001
        return {"problem": f"task2_4 ({desc}): your model raised {type(e).__name__}: {str(e)[:300]}"}


def _gpt_judge(case, got):
    if "problem" in got:
        raise AssertionError(got["problem"])
    cfg, plain, batches = _gpt_setup(case)
    desc = _gpt_desc(case)
    want = _train(plain, case, batches)
    assert got["logits_shape"] == want["logits_shape"] and _from(got["logits"], want["logits"]), (
        f"task2_4 ({desc}): model(idx) must return the same logits as GPT (shape {tuple(want['logits_shape'])}); "
        f"yours {'differ' if got['logits_shape'] == want['logits_shape'] else 'have the wrong shape'}. "
        f"Keep GPT.forward's steps (embeddings, position table or rope, dropout, blocks, ln_f, head, loss).")
    for step, (g, w) in enumerate(zip(got["steps"], want["steps"])):
        assert abs(g["loss"] - w["loss"]) <= 1e-5 * max(1.0, abs(w["loss"])), (
            f"task2_4 ({desc}): step {step}: your loss {g['loss']:.6f} differs from GPT's {w['loss']:.6f}: the "
            f"forward must compute exactly what GPT.forward computes.")
        for name, fw in w["grads"].items():
            if not _from(g["grads"].get(name), fw):
                hint = (" With dropout, the recomputation must draw the same masks as the forward: keep "
                        "preserve_rng_state=True (the default)." if cfg.dropout else "")
                hint += (" Did you detach the checkpointed input? Gradients then stop at that checkpoint and "
                         "never reach the embeddings and the blocks before it.")
                raise AssertionError(f"task2_4 ({desc}): at training step {step}, the gradient of {name!r} differs "
                                     f"from the plain GPT's, so your model would train differently.{hint}")
        calls = g["calls"]
        assert calls == [2] * cfg.n_layer, (
            f"task2_4 ({desc}): forward calls per block in one training step were {calls}, expected 2 each "
            f"(forward, then the recomputation in backward), got {calls}. "
            + ("A block that ran once was not checkpointed." if min(calls, default=0) < 2 else
               "A block that ran more often is called more than once in your forward."))
    # memory: one stashed block input per block, one block recomputed at a time
    ref = RefCheckpointedGPT(cfg)
    ref.load_state_dict(plain.state_dict())
    x, y = batches[0]
    torch.manual_seed(case["seed"])
    ref_peak = activation_peak(ref, lambda: ref(x, y)).peak
    plain_peak = want["peak"]
    slack = max((plain_peak - ref_peak) // (4 * cfg.n_layer), 1024)
    assert got["peak"] <= ref_peak + slack, (
        f"task2_4 ({desc}): peak activation memory {mb(got['peak'])}, but checkpointing every block needs only "
        f"{mb(ref_peak)} (no checkpointing: {mb(plain_peak)}). Run each block only inside "
        f"checkpoint(block, x, rope, use_reentrant=False), and keep nothing else per block.")


def _from(got, want) -> bool:
    return got is not None and same(got, want)


TASK4 = Task("task2_4_checkpointed_gpt", ("CheckpointedGPT",), _gpt_cases, _gpt_run, _gpt_judge)
