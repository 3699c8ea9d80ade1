"""What runs in the learner's process for exercise 02: each task's `run` builds the learner's module on stacks
of counting blocks or memlab's GPT rebuilt from the case, and returns the outputs, gradient fingerprints, each
block's forward calls and the peak activation memory, measured with memlab's tracker
(memlab.checkpointing.activation_peak, bound before any learner code runs); the planner runs under a
wall-clock limit."""

from __future__ import annotations

import signal
import time

import torch
import torch.nn as nn

from memlab.checkpointing import activation_peak
from memlab.core.models import GPT, Block

from .inputs import (CountingBlock, _gpt_desc, _gpt_setup, _stack, _stack_desc, _step, _train,
                     fingerprint as _fingerprint)

PLANNER_SECONDS = 20


# ----------------------------------------------------------------------------- plain-data helpers
def _crash(task, desc, what, e) -> dict:
    msg = f"{task} ({desc}): {what} raised {type(e).__name__}: {str(e)[:300]}"
    if "does not require grad" in str(e):
        msg += (". The output is cut from the autograd graph: with use_reentrant=True, a checkpoint whose "
                "inputs do not require grad (here the input batch) returns an output that does not require "
                "grad either. Use use_reentrant=False.")
    return {"problem": msg}


# ----------------------------------------------------------------------------- modules the checks own
class CountingGPTBlock(Block):
    """memlab's GPT Block, counting its forward calls. Installed by swapping a block's class,
    so parameter names and values do not change."""

    def forward(self, x, rope=None):
        self.calls += 1
        return super().forward(x, rope)


def count_gpt_blocks(model: GPT) -> list[Block]:
    blocks = list(model.blocks)
    for b in blocks:
        b.__class__ = CountingGPTBlock
        b.calls = 0
    return blocks


# ----------------------------------------------------------------------------- stacks (tasks 2.1, 2.2)
def _stack_run(task, case, make):
    container, blocks, x, weights = _stack(case)
    desc = _stack_desc(case)
    try:
        wrapped = make(container)
    except Exception as e:  # noqa: BLE001 - a crash of the submission is a failed check with a message
        return _crash(task, desc, "building your module", e)
    if not isinstance(wrapped, nn.Module):
        return {"problem": f"{task}: your wrapper must be an nn.Module (got {type(wrapped).__name__})"}
    params = [p for b in blocks for p in b.parameters()]
    mine = {id(p) for p in wrapped.parameters()}
    for b in blocks:
        b.calls = 0
    try:
        out = _step(wrapped, params, x, weights)
    except Exception as e:  # noqa: BLE001
        return _crash(task, desc, "a forward + backward through your module", e)
    calls = [b.calls for b in blocks]
    if not isinstance(out, torch.Tensor):
        return {"problem": f"{task} ({desc}): your module must return a tensor, got {type(out).__name__}"}
    # a watched case's output is too large to send whole (common.MAX_VALUE_CHARS): its fingerprint comes back
    whole = (lambda t: t.detach().double().tolist()) if not case.get("watched") else _fingerprint
    result = {"unregistered": sum(id(p) not in mine for p in params), "shape": list(out.shape),
              "out": whole(out), "x_grad": None if x.grad is None else whole(x.grad),
              "grads": [_fingerprint(p.grad) for p in params], "calls": calls}
    try:
        measured = activation_peak(wrapped, lambda: (wrapped(x) * weights).sum())
        result["peak"], result["stored"] = measured.peak, measured.stored
    except Exception as e:  # noqa: BLE001
        return _crash(task, desc, "measuring the peak memory of your module", e)
    return result


# ----------------------------------------------------------------------------- task2_1
def _every_k_run(case, CheckpointEveryK):
    if "validate" in case:
        raised = {}
        for bad in case["validate"]:
            try:
                CheckpointEveryK([CountingBlock(8, 8) for _ in range(3)], bad)
                raised[str(bad)] = None
            except Exception as e:  # noqa: BLE001
                raised[str(bad)] = type(e).__name__
        return raised
    return _stack_run("task2_1", case, lambda blocks: CheckpointEveryK(blocks, case["k"]))


# ----------------------------------------------------------------------------- task2_2
def _plain_pairs(segs):
    try:
        out = []
        for s in segs:
            s = tuple(s)
            out.append([v if type(v) is int else repr(v) for v in s])
        return out
    except TypeError:
        return repr(segs)[:200]


def _sqrt_run(case, sqrt_segments, SqrtCheckpointed):
    if "ns" in case:
        out = {}
        for n in case["ns"]:
            try:
                out[str(n)] = _plain_pairs(sqrt_segments(n))
            except Exception as e:  # noqa: BLE001
                out[str(n)] = {"raised": f"{type(e).__name__}: {str(e)[:200]}"}
        return out
    return _stack_run("task2_2", case, SqrtCheckpointed)


# ----------------------------------------------------------------------------- task2_3
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


# ----------------------------------------------------------------------------- task2_4
def _gpt_run(case, CheckpointedGPT):
    cfg, plain, batches = _gpt_setup(case)
    desc = _gpt_desc(case)
    try:
        mine = CheckpointedGPT(cfg)
    except Exception as e:  # noqa: BLE001
        return {"problem": f"task2_4 ({desc}): CheckpointedGPT(cfg) raised {type(e).__name__}: {e}"}
    if not isinstance(mine, GPT):
        return {"problem": f"task2_4: CheckpointedGPT must subclass memlab.core.models.GPT (got {type(mine).__mro__}); "
                           f"override run_blocks(), keep the parameters"}
    try:
        mine.load_state_dict(plain.state_dict())
    except Exception as e:  # noqa: BLE001
        return {"problem": f"task2_4 ({desc}): CheckpointedGPT must have exactly GPT's parameters under the same "
                           f"names, so a plain GPT's state_dict loads into it; load_state_dict failed: "
                           f"{str(e)[:300]}. Override run_blocks() instead of wrapping or renaming the blocks."}
    blocks = count_gpt_blocks(mine)
    try:
        return _train(mine, case, batches, blocks)
    except Exception as e:  # noqa: BLE001
        return {"problem": f"task2_4 ({desc}): your model raised {type(e).__name__}: {str(e)[:300]}"}
