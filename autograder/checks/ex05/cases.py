"""Exercise 05's cases (trusted side, plain data); the inputs both sides rebuild from them are in inputs.py.

- task5_1: rows whose max moves to a later block (the running sum must be rescaled), -inf entries, large
  scales, a last partial block, one block exactly, a block longer than the row; in every run rows far below
  float32 exp's underflow (a running max started at 0 gives 0 / 0), rows whose maxima differ by hundreds (one max
  over all rows underflows the lower rows) and rows whose first block is all -inf (exp(-inf - (-inf)) is NaN);
  a float64 input (the state kept in x's dtype). Every case checks that x comes back unchanged and that no
  reduction (max, sum, sort ...) reads more than one block of a row at once.
- task5_2 and 5.3: lengths that are not a multiple of the tile, causal and not, T_q != T_k, several leading
  shapes; for 5.2 tiles of several sizes, always more than one key tile, and sizes where a strip of one query
  tile against all the keys is larger than any tile-sized tensor (`largest_allowed`), and causal inputs whose
  masked scores dwarf the visible ones; for 5.3 plain random inputs and the peak of forward + backward at T
  and 2T (the largest tensor is bounded by the tile its forward passes to tiled_attention).
"""

from __future__ import annotations

import math

# re-exported: moved to inputs.py, the tests still read it as cases.<name>
from .inputs import softmax_input  # noqa: F401


# ----------------------------------------------------------------------------- task 5.1: online softmax
def softmax_cases(hidden, r):
    if not hidden:
        return [{"seed": 0, "rows": 3, "n": 10, "block": 4, "scale": 1.0, "neg_inf": False, "rising": True},
                {"seed": 1, "rows": 3, "n": 9, "block": 4, "scale": 1.0, "neg_inf": True, "rising": False,
                 "shift": [-200.0, 120.0, -350.0], "inf_first": [0]}]
    cases = []
    for neg_inf, rising, scale in ((False, True, 1.0), (True, False, 1.0), (True, True, 30.0), (False, False, 200.0)):
        block = r.choice([3, 5, 7, 16])
        n = block * r.randint(2, 5) + r.randint(1, block - 1)          # a last, partial block
        cases.append({"seed": r.randrange(2**31), "rows": r.randint(1, 5), "n": n, "block": block, "scale": scale,
                      "neg_inf": neg_inf, "rising": rising})
    cases.append({"seed": r.randrange(2**31), "rows": 2, "n": 8, "block": 8, "scale": 1.0, "neg_inf": False,
                  "rising": False})                                  # one block exactly
    block = r.choice([3, 5, 6])                                      # float64: the state kept in x's dtype
    cases.append({"seed": r.randrange(2**31), "rows": r.randint(2, 4), "n": block * r.randint(2, 4) + 1,
                  "block": block, "scale": 5.0, "neg_inf": True, "rising": True, "dtype": "float64"})
    cases.append({"seed": r.randrange(2**31), "rows": 2, "n": 5, "block": 16, "scale": 1.0, "neg_inf": True,
                  "rising": True})                                   # block longer than the row
    # every row far below float32 exp's underflow (exp(x) == 0 below about -104): a running max started at 0
    # instead of -inf sums zeros
    block = r.choice([3, 4, 6])
    rows = r.randint(2, 4)
    cases.append({"seed": r.randrange(2**31), "rows": rows, "n": block * r.randint(2, 4) + r.randint(1, block - 1),
                  "block": block, "scale": r.choice([1.0, 3.0]), "neg_inf": r.random() < 0.5, "rising": False,
                  "shift": [-r.uniform(150.0, 400.0) for _ in range(rows)]})
    # row maxima hundreds apart, the first row's first block all -inf, another row's first block all -inf and
    # its max rising later: one max over all rows underflows the lower rows, exp(-inf - (-inf)) is NaN
    block = r.choice([3, 4, 5])
    rows = r.randint(3, 5)
    shift = [r.uniform(-300.0, 300.0) for _ in range(rows)]
    shift[0], shift[1] = r.uniform(150.0, 300.0), r.uniform(-300.0, -150.0)
    r.shuffle(shift)
    cases.append({"seed": r.randrange(2**31), "rows": rows, "n": block * r.randint(2, 4) + r.randint(0, block - 1),
                  "block": block, "scale": 1.0, "neg_inf": True, "rising": r.random() < 0.5, "shift": shift,
                  "inf_first": sorted(r.sample(range(rows), 2))})
    return cases


# ----------------------------------------------------------------------------- task 5.2 and 5.3: attention
def largest_allowed(case, tile):
    """Elements of the largest tensor tiled attention needs: one (..., tile, tile) score tile, or a tensor of
    the size of q, k, v or the output (..., T, d). A strip of one query tile against all T_k keys is larger."""
    lead = math.prod(case["lead"]) if case["lead"] else 1
    return lead * max(tile * tile, case["tq"] * case["d"], case["tk"] * case["d"], case["tq"], case["tk"])


def _strip(case):
    """Elements of the smallest score strip: one query tile against all the keys, or all the queries against one
    key tile (tiling one side only)."""
    lead = math.prod(case["lead"]) if case["lead"] else 1
    t = case["tile"]
    return lead * min(min(t, case["tq"]) * case["tk"], case["tq"] * min(t, case["tk"]))


def _attn_case(r, causal, tq=None, tk=None, tile=16, lead=None, d=None):
    tq = tq or r.randint(3, 6) * tile + r.randint(1, tile - 1)        # not a multiple of the tile
    tk = tq if causal else (tk or r.randint(3, 6) * tile + r.randint(1, tile - 1))
    return {"seed": r.randrange(2**31), "lead": lead if lead is not None else r.choice([[], [2], [2, 3]]),
            "tq": tq, "tk": tk, "d": d or r.choice([4, 8]), "tile": tile, "causal": causal}


def attn_cases(hidden, r):
    """Every hidden run: causal and not, no / one / two leading dims, T_q > T_k with fewer than two key tiles,
    tiles of 16 and of another size; in every case more than one key tile, and one query tile against all
    the keys (or all queries against one key tile) is larger than `largest_allowed`."""
    if not hidden:
        return [{"seed": 1, "lead": [2], "tq": 40, "tk": 40, "d": 8, "tile": 16, "causal": False},
                {"seed": 2, "lead": [2], "tq": 40, "tk": 40, "d": 8, "tile": 16, "causal": True}]
    def drawn(*args, **kwargs):
        while True:                       # one-sided tiling must be caught: the strip exceeds the allowed tensor
            c = _attn_case(r, *args, **kwargs)
            if (_strip(c) > largest_allowed(c, c["tile"]) and c["tk"] > c["tile"] and c["tq"] > c["tile"]
                    and c["tq"] % c["tile"] and c["tk"] % c["tile"]):     # a last, partial tile on both sides
                return c

    other = r.choice([12, 20, 24])
    tk = r.randint(21, 30)                                           # two key tiles, the second partial
    return [drawn(False), drawn(True), drawn(False, lead=[2, 2], tile=other), drawn(True, lead=[], tile=other),
            drawn(False, tq=r.choice([t for t in range(3 * tk // 2, 2 * tk + 1) if t % 16]), tk=tk, d=4),
            large_case(r)]


# The large case, watched from outside the learner's process: the harness runs it inside a memory window (the
# grader resets the sandbox cgroup's high-water mark as it starts and reads it as it ends, sandbox.py), so the window
# sees this case's memory alone, not the notebook's. A tiled pass adds little to what the process already holds
# (score tiles of LEAD x 256 x 256 x 4 B = 0.5 MiB, q, k, v and the output 0.25 MiB each); a pass that makes the
# whole (LEAD, T, T) fp32 score matrix adds LARGE_SCORES bytes at least, however it hides that from the tracker
# (`corroborate` in judge.py). Only a few query rows come back (the whole output is more JSON than a result line
# may hold); the judge recomputes them.
LARGE_T, LARGE_LEAD, LARGE_TILE = 4000, 2, 256      # 4000 = 15 tiles of 256 and a partial one
LARGE_SCORES = LARGE_LEAD * LARGE_T * LARGE_T * 4          # 122 MiB
# a window that grew this much held something of the scores' size; the reference's window grows by a few MiB
# (`python benchmarks/bench_grading.py`)
LARGE_FLAG_BYTES = LARGE_SCORES // 2                       # 61 MiB


def large_case(r):
    rows = sorted(r.sample(range(LARGE_T - 1), 5)) + [LARGE_T - 1]
    return {"seed": r.randrange(2**31), "lead": [LARGE_LEAD], "tq": LARGE_T, "tk": LARGE_T, "d": 8,
            "tile": LARGE_TILE, "causal": r.random() < 0.5, "steep": False, "rows": rows, "watched": True}


def flash_cases(hidden, r):
    # plain random inputs: gradients through the steep causal inputs of task 5.2 are ill-conditioned in fp32
    if not hidden:
        return [{"seed": 3, "lead": [2], "tq": 40, "tk": 40, "d": 8, "tile": 16, "causal": True, "steep": False}]
    cases = [_attn_case(r, False), _attn_case(r, True), _attn_case(r, False, tq=r.randint(70, 90),
                                                                     tk=r.randint(20, 30), lead=[2])]
    # the peak of forward + backward, measured at T and 2T: linear in T, not quadratic
    growth = {"seed": r.randrange(2**31), "lead": [2], "tq": 128, "tk": 128, "d": 8, "tile": 16,
              "causal": False, "growth": True}
    return [dict(c, steep=False) for c in cases + [growth]]
