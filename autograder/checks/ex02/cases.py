"""Exercise 02's cases (trusted side): what each task's inputs are drawn from. The planner's cases are drawn with
the references' brute force (refs.py). The modules and batches both sides rebuild from a case are in inputs.py."""

from __future__ import annotations

from memlab.checkpointing import plan_peak

# re-exported: moved to inputs.py, the tests still read them as cases.<name>
from .inputs import _gpt_setup, _stack  # noqa: F401
from .refs import all_plans, brute_force_plan, min_peak, plan_cost

LESSON_BYTES = [48, 48, 40, 32, 24, 16, 12, 8, 8, 6, 4, 4]
LESSON_COST = [2, 2, 3, 3, 4, 4, 6, 6, 8, 8, 10, 10]


# ----------------------------------------------------------------------------- stacks (tasks 2.1, 2.2)
def _stack_case(r, n, container, x_grad):
    return {"n": n, "d": r.choice([16, 24, 32]), "rows": r.choice([32, 48, 64]), "container": container,
            "x_grad": x_grad, "seed": r.randrange(2**31)}


# ----------------------------------------------------------------------------- watched cases (tasks 2.1, 2.2, 2.4)
# Each task that measures the learner's module with memlab's tracker (the run's activation_peak) has one hidden case
# large enough to be seen from outside the learner's process: the harness runs every case inside a memory window
# (the sandbox cgroup's high-water mark, reset as the case starts and read as it ends), and `corroborate` (judge.py)
# sets the window beside the peak the tracker reported. Narrow blocks on many rows (or a narrow, deep GPT on many
# tokens) keep the arithmetic small and the activations large; measured with memlab's tracker, the scheme's peak
# (what an honest window holds, with the inputs) and the plain model's (what a module that does not checkpoint
# holds, however it hides from the tracker):
#   2.1, 16 blocks of width 8, k = 1, 45056 rows:        38.5 MiB checkpointed, 203.5 MiB plain
#   2.2, 36 blocks of width 8 in 6 segments, 20480 rows: 39.4 MiB checkpointed, 205.0 MiB plain
#   2.4, 12 layers of width 32, 128 x 64 tokens:         32.2 MiB checkpointed, 199.3 MiB plain
# Half a second of one CPU core to run a stack case and as much to judge it, a second each for the GPT
# (tests/test_checks_ex02.py checks the gaps).
NOISE_BYTES = 64 * 2**20             # what a window may hold beyond the tracker's count (allocator, code pages)


def _watched_stack(r, n, rows):
    return {"n": n, "d": 8, "rows": rows, "container": r.choice(["Sequential", "ModuleList", "list"]),
            "x_grad": True, "seed": r.randrange(2**31), "watched": True}


def _watched_gpt(r):
    return {"cfg": dict(n_layer=12, n_embd=32, n_head=2, vocab_size=32, block_size=80, dropout=0.0, pos="learned",
                        attn="sdpa"),
            "B": 128, "T": 64, "steps": 1, "seed": r.randrange(2**31), "watched": True}


def outside_the_tracker(case) -> int:
    """Bytes a watched case's run holds besides what the tracker measures: for a stack, x, the loss weights, the
    output, x's gradient and a float64 copy for a fingerprint (rows x d each, fp32 or wider); for a GPT, the
    logits of the eval forward and the loss's softmax (B x T x vocab, fp32, a few of them) and the parameters with
    their gradients."""
    if "cfg" in case:
        cfg = case["cfg"]
        params = 12 * cfg["n_layer"] * cfg["n_embd"] ** 2 + 2 * cfg["vocab_size"] * cfg["n_embd"]
        return 4 * 4 * case["B"] * case["T"] * cfg["vocab_size"] + 3 * 4 * params
    return 6 * 4 * case["rows"] * case["d"]


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
    return out + [{"validate": [0, -r.randint(1, 5), float(r.randint(1, 4)), True, str(r.randint(1, 5))]},
                  {**_watched_stack(r, 16, 45_056), "k": 1}]


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
                           zip(sizes, containers, (True, False, r.random() < 0.5))] + [_watched_stack(r, 36, 20_480)]


# ----------------------------------------------------------------------------- task2_3
def _chain(m, c, budget, desc, timed=False):
    return {"m": m, "c": c, "budget": budget, "desc": desc, "timed": timed}


def _forced(r, need, free=False):
    """A random short chain where every cheapest plan has `need(plan, recompute_cost)`: drawn until brute force
    says so. free=True draws some recompute costs of 0."""
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
    return out + [_watched_gpt(r)]
