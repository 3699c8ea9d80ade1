"""Exercise 09's cases (trusted side): linear layers to shard (task 9.1), tensor-parallel MLP runs on four forked ranks
(task 9.2) and pipeline schedules to weigh (task 9.3). Every hidden draw covers every branch of each spec."""

from __future__ import annotations

RANKS = 4                  # task 9.2 runs every case on 4 ranks: tp-way tensor parallel x (4 / tp)-way data parallel
SCHEDULES = ("gpipe", "1f1b")


# ----------------------------------------------------------------------------- task 9.1: shard a linear layer
def _linear(r, kind, world, *, bias, error=None, bad_rank=None):
    """A layer whose split dimension (out for "column", in for "row") divides by `world` and whose other
    dimension does not (a check on the wrong dimension raises on it); `error` makes it fail on purpose:
    "uneven" (the split dimension does not divide) or "rank" (a rank outside [0, world))."""
    split = world * r.randint(2, 4) + (r.randint(1, world - 1) if error == "uneven" else 0)
    other = world * r.randint(1, 3) + r.randint(1, world - 1)
    out, inp = (split, other) if kind == "column" else (other, split)
    case = {"seed": r.randrange(2**31), "kind": kind, "out": out, "in": inp, "bias": bias, "world": world,
            "rows": r.randint(2, 5), "error": error}
    if error == "rank":
        case["bad_rank"] = world if bad_rank == "world" else bad_rank if bad_rank is not None else r.choice([-1, world])
    return case


def shard_cases(hidden, r):
    """Every hidden run: both functions at 2 and 4 ranks, with and without a bias, the other dimension never
    divisible; an uneven split dimension for each function; a rank of -1 and one of world (outside [0, world)).
    A row-parallel bias must sit whole on one rank, None elsewhere."""
    if not hidden:
        return [_linear(r, "column", 2, bias=True), _linear(r, "row", 2, bias=True),
                _linear(r, "column", 2, bias=True, error="uneven")]
    w_col, w_row = r.sample([2, 4], 2)
    return [_linear(r, "column", w_col, bias=True), _linear(r, "column", w_row, bias=False),
            _linear(r, "row", w_row, bias=True), _linear(r, "row", w_col, bias=False),
            _linear(r, "column", r.choice([2, 4]), bias=r.random() < 0.5, error="uneven"),
            _linear(r, "row", r.choice([2, 4]), bias=r.random() < 0.5, error="uneven"),
            _linear(r, r.choice(["column", "row"]), r.choice([2, 4]), bias=True, error="rank", bad_rank=-1),
            _linear(r, r.choice(["column", "row"]), r.choice([2, 4]), bias=True, error="rank", bad_rank="world")]


# ----------------------------------------------------------------------------- task 9.2: the MLP on ranks
def _mlp(r, tp):
    d = r.randint(5, 9)                                       # d need not divide by tp: W2 splits hidden
    return {"seed": r.randrange(2**31), "tp": tp, "batch": r.randint(2, 3), "seq": r.randint(3, 5), "d": d,
            "hidden": 4 * d}                                  # Megatron's 4d: an all-gathered hidden is 2x traffic


def tp_cases(hidden, r):
    """One case per check (one start of the 4 ranks): a list of runs. Every hidden draw: tp = 2 (two
    tensor-parallel groups side by side, each its own data) and tp = 4 (one group of all ranks)."""
    runs = [_mlp(r, 2)] if not hidden else [_mlp(r, 2), _mlp(r, 4)]
    if hidden:
        r.shuffle(runs)
    return [{"world": RANKS, "runs": runs}]


# ----------------------------------------------------------------------------- task 9.3: pipeline memory
def _pipe(r, schedule, *, fewer):
    """A schedule with fewer micro-batches than stages (fewer=True) or at least as many."""
    p = r.randint(3, 8) if fewer else r.randint(2, 8)
    m = r.randint(1, p - 1) if fewer else r.randint(p, 3 * p)
    return {"schedule": schedule, "stages": p, "microbatches": m,
            "bytes_per_microbatch": p * r.randint(1, 500) * 1024, "error": None}


def pipe_cases(hidden, r):
    """Every hidden run: both schedules with m < p and m >= p (every stage of each, the first and the last
    included), a byte count that does not divide by the stages and an unknown schedule name."""
    if not hidden:
        return [{"schedule": "gpipe", "stages": 4, "microbatches": 8, "bytes_per_microbatch": 4 * 3 * 2**20,
                 "error": None},
                {"schedule": "1f1b", "stages": 4, "microbatches": 8, "bytes_per_microbatch": 4 * 3 * 2**20,
                 "error": None},
                {"schedule": "1f1b", "stages": 4, "microbatches": 2, "bytes_per_microbatch": 4 * 3 * 2**20,
                 "error": None},
                {"schedule": "gpipe", "stages": 3, "microbatches": 4, "bytes_per_microbatch": 1000,
                 "error": "bytes_per_microbatch"}]
    out = [_pipe(r, s, fewer=f) for s in SCHEDULES for f in (True, False)]
    r.shuffle(out)
    p = r.randint(2, 8)
    out.append({"schedule": r.choice(SCHEDULES), "stages": p, "microbatches": r.randint(1, 12),
                "bytes_per_microbatch": p * r.randint(1, 999) + r.randint(1, p - 1), "error": "bytes_per_microbatch"})
    p = r.randint(2, 8)
    out.append({"schedule": r.choice(["interleaved", "zero_bubble", "1F1B-interleaved", "pipedream"]),
                "stages": p, "microbatches": r.randint(1, 12), "bytes_per_microbatch": p * 1024,
                "error": "schedule"})
    return out
