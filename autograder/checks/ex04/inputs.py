"""Exercise 04's inputs, the learner side rebuilt on both sides from a case's plain data: run.py uses them in the
sandbox, the trusted refs.py and judge.py in the grader.

- tasks 4.1-4.4: `CASES` says, per task, which patient of memlab/clinic.py it fixes, the name of the learner's
  fix, the virtual GPU it must fit (with cases.HEADROOM to spare), the model, the sequences it processes,
  whether it trains, and what to try when it still runs out; `tiny_data` the tiny case's random data.
- task4_5: the virtual GPU of a case and the step the learner's search probes (a staircase, a contrastive step,
  a real AdamW training step).
- task4_6: `leak_scenario`, a training step that leaks (or not) in a known way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import memlab
from memlab.clinic import evaluate, random_tokens, train_1b3, train_accumulated, train_big_batch


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
def tiny_data(case, c: Case):
    return random_tokens(c.model, "tiny", c.rows, generator=torch.Generator().manual_seed(case["data_seed"]))


# ----------------------------------------------------------------------------- task4_5
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
