"""Exercise 04's cases (plain data), the grading spec of each clinic script, and the inputs both sides rebuild.

- tasks 4.1-4.4: `CASES` says, per task, which patient of memlab/clinic.py it fixes, the name of the learner's
  fix, the virtual GPU it must fit with `HEADROOM` to spare, the model, the sequences it processes, whether it
  trains, and what to try when it still runs out. Each task has a "full" case (the script at full size on
  the virtual GPU) and a "tiny" case (fresh random data on the tiny instance; hidden: a fresh seed).
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

from dataclasses import dataclass
from typing import Callable

import torch

import memlab
from memlab.clinic import evaluate, random_tokens, train_1b3, train_accumulated, train_big_batch

from ..common import torch_seed

HEADROOM = 512 * 2**20                   # left free for the CUDA context and allocator rounding (not modelled)


@dataclass(frozen=True)
class Case:
    task: str
    original: Callable
    fixed_name: str          # the name of the learner's function
    gpu: str                 # virtual GPU preset it must fit
    model: str               # key of MODELS
    rows: int                # sequences the script pushes through the model
    trains: bool             # True: returns the model after one AdamW step; False: returns losses
    hint_oom: str            # what to try when it still runs out
    two_steps: bool = False  # full size: the grader runs a second real step on the returned model (steady state)


CASES = {
    "task4_1": Case("task4_1", train_big_batch, "train_big_batch_fixed", "T4-16GB", "gpt2-medium", 16, True,
                    "A batch of 16 does not fit in one forward pass: split it into micro-batches and accumulate "
                    "the gradients (dividing each micro-batch loss so the sum is the mean over all 16)."),
    "task4_2": Case("task4_2", evaluate, "evaluate_fixed", "T4-16GB", "gpt2-medium", 48, False,
                    "Evaluation needs no backward: run the forward passes under torch.no_grad() (or "
                    "torch.inference_mode()) so autograd saves nothing."),
    "task4_3": Case("task4_3", train_accumulated, "train_accumulated_fixed", "T4-16GB", "gpt2-small", 32, True,
                    "Summing the micro-batch losses into one tensor keeps all four graphs alive until the single "
                    "backward: call backward on each micro-batch's loss (divided by 4) as soon as it is computed."),
    "task4_4": Case("task4_4", train_1b3, "train_1b3_fixed", "L4-24GB", "gpt-1.3b", 1, True,
                    "The OOM is in the optimizer step: AdamW creates its state there and, with foreach=True, "
                    "also a temporary as large as all the parameters. Keep AdamW (and its maths): what does "
                    "foreach=False change? And let the gradients go: zero_grad(set_to_none=True) (or the optimizer "
                    "step in backward) frees them, zeroing them in place keeps them through the next forward.",
                    two_steps=True),
}


# ----------------------------------------------------------------------------- tasks 4.1-4.4
def script_cases(task):
    def cases(hidden, r):
        if not hidden:
            return [{"part": "full"}, {"part": "tiny", "seed": 401, "data_seed": 7}]
        return [{"part": "full"}, {"part": "tiny", "seed": torch_seed(r), "data_seed": r.randrange(2**31)}]
    return cases


def tiny_data(case, c: Case):
    return random_tokens(c.model, "tiny", c.rows, generator=torch.Generator().manual_seed(case["data_seed"]))


# ----------------------------------------------------------------------------- task4_5
ROUND = 512   # the virtual GPU rounds every storage up to 512 bytes, as the CUDA caching allocator does


def round_up(n: int) -> int:
    return -(-n // ROUND) * ROUND


def case_gpu(case) -> memlab.VirtualGPU:
    return memlab.VirtualGPU(case["gpu"]) if case.get("gpu") else memlab.VirtualGPU(capacity_gb=case["capacity_gb"])


def _staircase(fixed_bytes: int, per_sample: int):
    """A step whose memory is known exactly: a fixed buffer plus per_sample bytes per batch element."""
    def step(batch):
        state = torch.empty(fixed_bytes, dtype=torch.uint8)               # like model states
        acts = torch.empty(per_sample * batch, dtype=torch.uint8)         # like activations
        return state, acts
    return step


def _sequence_mlp_step(width):
    """One AdamW step of a 2-layer MLP over (batch, 1024, width) activations: cheap on fake tensors."""
    def step(batch):
        model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                    torch.nn.Linear(4 * width, width))
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        memlab.watch(model, opt)
        x = torch.randn(batch, 1024, width)
        with memlab.phase("forward"):
            loss = model(x).pow(2).mean()
        with memlab.phase("backward"):
            loss.backward()
        with memlab.phase("step"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def _contrastive(fixed_bytes: int, per_sample: int, pairs: int):
    """A step with a CLIP-style contrastive loss: a fixed buffer, per_sample bytes per batch element and fp32
    logits between every pair of the batch in `pairs` heads, (pairs, B, B): fixed + per * B + 4 * pairs * B^2
    bytes."""
    def step(batch):
        state = torch.empty(fixed_bytes, dtype=torch.uint8)               # like model states
        acts = torch.empty(per_sample * batch, dtype=torch.uint8)         # like activations
        logits = torch.empty(pairs, batch, batch)                         # (pairs, B, B) fp32: 4*pairs*B^2 bytes
        return state, acts, logits
    return step


def case_step(case):
    if case["kind"] == "staircase":
        return _staircase(case["fixed"], case["per"])
    if case["kind"] == "contrastive":
        return _contrastive(case["fixed"], case["per"], case["pairs"])
    return _sequence_mlp_step(case["width"])


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
# kind -> (what each step keeps from which step on (0: the first), noise). A kept input batch is a temporary, a
# kept output or an evaluation's loss an activation, kept gradients gradients.
LEAK_PLANS = {
    "outputs": ((("outputs", 0),), False), "grads": ((("grads", 0),), False), "inputs": ((("inputs", 0),), False),
    "eval": ((("eval", 0),), False), "hook": ((("hook", 0),), False), "none_adam": ((), False),
    "none_sgd": ((), False),
    "two_leaks": ((("outputs", 0), ("inputs", 0)), False),          # the later category (temporaries) grows more
    "grads_and_inputs": ((("grads", 0), ("inputs", 0)), False),     # the earlier category (gradients) grows more
    "late": ((("outputs", 1),), False),                             # starts in step 2: still every step after the 1st
    "flat_then_growing": ((("inputs", 2),), False),                 # flat from step 1 to 2: no leak by the spec
    "leak_and_late_growth": ((("outputs", 0), ("inputs", 2)), False),   # a small leak, a larger late growth
    "leak_and_noise": ((("outputs", 0),), True),                    # a leak, and temporaries that go up and down
    # a slow leak on a large, flat base (an evaluation's graph, replaced every step) beside a faster leak of a
    # smaller category: the largest category at the end is not the one that grows fastest
    "slow_leak_on_a_big_base": ((("outputs", 0), ("inputs", 0), ("base", 0)), False),
}


def leak_scenario(case):
    """A fresh (step_fn, model, optimizer) whose training step leaks (or not) in a known way."""
    kind, batch, width, d_in, seed = case["kind"], case["batch"], case["width"], case["d_in"], case["seed"]
    leaks, noisy = LEAK_PLANS[kind]
    leaks = dict(leaks)
    torch.manual_seed(seed)
    d_out = 10
    model = memlab.MLP(d_in, width, 2, d_out)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if kind == "none_sgd" else \
        torch.optim.AdamW(model.parameters(), lr=1e-3)
    kept, calls, noise, held = [], [], [], []
    g = torch.Generator().manual_seed(seed)
    xv, yv = torch.randn(batch, d_in, generator=g), torch.randint(0, d_out, (batch,), generator=g)
    big = 8 * batch * case["n_steps"]                                     # its graph outweighs every leak's total
    xbig, ybig = torch.randn(big, d_in, generator=g), torch.randint(0, d_out, (big,), generator=g)
    if "hook" in leaks:
        model.layers[1].register_forward_hook(lambda mod, inp, out: kept.append(out))   # (B, width) per step
    # noise: one buffer, replaced each step, whose size climbs by 4 units a step but drops once (not the last step)
    unit = batch * d_out * 4
    sizes = [unit + 4 * unit * i for i in range(case["n_steps"])]
    if noisy:
        j = case.get("drop", 1)
        sizes[j] = max(0, sizes[j - 1] - unit)

    def step():
        i = len(calls)
        calls.append(1)
        on = {w for w, start in leaks.items() if i >= start}
        x, y = torch.randn(batch, d_in, generator=g), torch.randint(0, d_out, (batch,), generator=g)
        with memlab.phase("forward"):
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
        with memlab.phase("backward"):
            loss.backward()
        if "grads" in on:
            kept.append([p.grad for p in model.parameters()])             # keeps every step's gradients
        with memlab.phase("step"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        if "outputs" in on:
            kept.append(out)                                              # keeps a (B, d_out) output per step
        if "inputs" in on:
            kept.append(x)                                                # keeps each input batch
        if "eval" in on:
            with memlab.phase("forward"):                                 # evaluation with autograd on
                kept.append(model(xv, yv))
        if "base" in on:
            with memlab.phase("forward"):                                 # the same large graph every step
                held[:] = [model(xbig, ybig)]
        if noisy:
            noise[:] = [torch.empty(sizes[i], dtype=torch.uint8)]

    return step, model, opt


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
