"""Exercise 04's cases (trusted side, plain data) and the headroom the judge asks for; the grading spec of each
clinic script (`CASES`) and the inputs both sides rebuild from a case are in inputs.py.

- tasks 4.1-4.4: each task has a "full" case (the script at full size on the virtual GPU, which it must fit
  with `HEADROOM` to spare) and a "tiny" case (fresh random data on the tiny instance; hidden: a fresh seed).
- task4_5: staircase steps whose answer is exactly chosen (only batch 1 fits, a power of two, one below and
  one above one, anywhere, limit - 1, nothing fits, everything up to a limit that is or is not a power of
  two) on preset and custom capacities; a contrastive step whose memory grows with batch squared (its (B, B)
  logits), so no answer extrapolated from a few probes as if memory were affine in the batch holds; and a real
  AdamW training step (a T4 visible, a drawn GPU and width hidden).
- task4_6: every leak (outputs, gradients, inputs, an evaluation with autograd on, a forward hook) and both
  traps (AdamW's and SGD's state created in step 1), the shortest run included; two leaking categories of
  different rates (the larger one later, and earlier, in memlab.CATEGORIES), a leak that starts in step 2, a
  category flat from step 1 to 2 and growing after (no leak by the spec, alone and beside a smaller real leak)
  and a leak beside temporaries that go up and down.
"""

from __future__ import annotations

import memlab

from ..common import torch_seed
from .inputs import LEAK_PLANS, case_gpu

HEADROOM = 512 * 2**20                   # left free for the CUDA context and allocator rounding (not modelled)


# ----------------------------------------------------------------------------- tasks 4.1-4.4
def script_cases(task):
    def cases(hidden, r):
        if not hidden:
            return [{"part": "full"}, {"part": "tiny", "seed": 401, "data_seed": 7}]
        return [{"part": "full"}, {"part": "tiny", "seed": torch_seed(r), "data_seed": r.randrange(2**31)}]
    return cases


# each script task's generator by name (the package's __init__.py names them)
task4_1_cases = script_cases("task4_1")
task4_2_cases = script_cases("task4_2")
task4_3_cases = script_cases("task4_3")
task4_4_cases = script_cases("task4_4")


# ----------------------------------------------------------------------------- task4_5
ROUND = 512   # the virtual GPU rounds every storage up to 512 bytes, as the CUDA caching allocator does


def round_up(n: int) -> int:
    return -(-n // ROUND) * ROUND


def step_bytes(case, batch: int) -> int:
    """What a staircase or contrastive step holds at `batch`, each tensor rounded as the virtual GPU rounds it."""
    b = round_up(case["fixed"]) + round_up(case["per"] * batch)
    return b + round_up(4 * case["pairs"] * batch * batch) if case["kind"] == "contrastive" else b


def _stair(r, gpu, target, limit):
    """A staircase whose answer is exactly `target`: room for target samples, not for target + 1."""
    cap = case_gpu(gpu).capacity                                              # the preset as memlab defines it now
    per = ROUND * r.randint(2, max(2, min(cap // ((target + 1) * ROUND), 2**21)))
    slack = ROUND * r.randrange(0, per // ROUND - 1)                          # < per - 512
    fixed_r = (cap - per * target - slack) // ROUND * ROUND                   # room in [per*target, per*(target+1))
    fixed = max(0, fixed_r - r.randrange(ROUND))                              # rounds up to fixed_r
    return {**gpu, "kind": "staircase", "fixed": fixed, "per": per, "limit": limit}


def _quadratic(r, gpu, target, limit):
    """A contrastive step whose answer is exactly `target`, its B^2 logits most of the memory at the answer."""
    cap = case_gpu(gpu).capacity
    case = {**gpu, "kind": "contrastive", "fixed": 0, "per": ROUND * r.randint(1, 64), "limit": limit}
    case["pairs"] = max(1, int(cap * r.uniform(0.4, 0.7)) // (4 * target * target))
    need, more = step_bytes(case, target), step_bytes(case, target + 1)
    fixed_r = (cap - need - r.randrange(0, (more - need) // ROUND) * ROUND) // ROUND * ROUND
    return dict(case, fixed=max(0, fixed_r - r.randrange(ROUND)))    # rounds up to fixed_r: room for target only


def max_batch_cases(hidden, r):
    if not hidden:
        t4 = memlab.VirtualGPU("T4-16GB").capacity
        return [{"gpu": "T4-16GB", "kind": "staircase", "fixed": 6 * 2**30, "per": 300 * 2**20, "limit": 4096},
                {"gpu": "T4-16GB", "kind": "staircase", "fixed": t4 + 2**20, "per": 2**20, "limit": 4096},
                {"gpu": "T4-16GB", "kind": "mlp", "width": 1024, "limit": 4096}]
    gpus = [{"gpu": "T4-16GB"}, {"gpu": "L4-24GB"}, {"capacity_gb": r.choice([4, 8, 12])},
            {"capacity_gb": r.choice([6.5, 40])}, {"gpu": "A100-40GB"}, {"capacity_gb": 16}]
    r.shuffle(gpus)
    k = r.randint(2, 8)
    cases = [_stair(r, gpus[0], 1, r.choice([256, 1000])),                # only batch 1 fits
             _stair(r, gpus[1], 2 ** k, 4096),                            # a power of two
             _stair(r, gpus[2], 2 ** r.randint(2, 8) - 1, 5000),           # one below one
             _stair(r, gpus[3], 2 ** r.randint(2, 8) + 1, 1000),           # one above one
             _stair(r, gpus[4], r.randint(3, 999), 1000),                  # anywhere, limit not a power of two
             _stair(r, gpus[5], 999, 1000),                                # limit - 1
             _quadratic(r, r.choice(gpus), r.randint(100, 900), 1000),     # quadratic: affine guesses overshoot
             {"gpu": r.choice(["L4-24GB", "A100-40GB", "T4-16GB"]), "kind": "mlp",  # a real AdamW step
              "width": r.choice([512, 768, 1024, 1536]), "limit": r.choice([1000, 4096])}]
    cap = memlab.VirtualGPU(capacity_gb=8).capacity
    cases.append({"capacity_gb": 8, "kind": "staircase", "fixed": cap + r.randrange(1, 10**6), "per": 1000,
                  "limit": 4096})                                          # nothing fits
    for limit in (1000, 4096):                                            # everything up to the limit fits
        cases.append({"capacity_gb": r.choice([8, 16]), "kind": "staircase", "fixed": r.randrange(0, 10**6),
                      "per": r.randrange(1, 10**4), "limit": limit})
    return cases


# ----------------------------------------------------------------------------- task4_6
def leak_cases(hidden, r):
    if not hidden:
        return [{"kind": k, "batch": 16, "width": 64, "d_in": 32, "seed": s, "n_steps": 5}
                for k, s in (("outputs", 1), ("none_adam", 2))]
    kinds = list(LEAK_PLANS)                       # every leak, both traps, two leaks, late, flat-then-growing, noise
    r.shuffle(kinds)
    cases = []
    for k in kinds:
        n = r.randint(4, 6) if k in ("flat_then_growing", "leak_and_late_growth") else r.randint(3, 5)
        # two leaks and late growth: the kept inputs (B x d_in) grow more than the kept outputs (B x 10)
        d_in = r.randint(24, 64) if k in ("two_leaks", "leak_and_late_growth", "slow_leak_on_a_big_base") \
            else r.randint(4, 64)
        # gradients and inputs: few samples, a wide model, so the gradients (earlier in CATEGORIES) grow more
        batch, width = (r.randint(2, 8), r.randint(32, 128)) if k == "grads_and_inputs" else \
            (r.randint(2, 64), r.randint(8, 128))
        c = {"kind": k, "batch": batch, "width": width, "d_in": d_in,
             "seed": r.randrange(2**31), "n_steps": n}
        if k == "leak_and_noise":
            c["drop"] = r.randrange(1, n - 1)
        cases.append(c)
    shortest = next(c for c in cases if c["kind"] in ("outputs", "grads", "inputs", "eval", "hook"))
    shortest["n_steps"] = 3                        # the shortest run included
    return cases
