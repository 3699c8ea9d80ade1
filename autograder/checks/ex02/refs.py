"""Exercise 02's references.

- Memory bounds: the schemes of tasks 2.1 and 2.4 built by PyTorch's own activation-checkpointing pass
  (`torch.distributed.algorithms._checkpoint.checkpoint_wrapper.apply_activation_checkpointing`, which wraps
  chosen submodules of a model in place; a mechanism the solution does not use), the segments of task 2.2
  under `torch.utils.checkpoint` (laid out round-robin, unlike the solution), each used only to measure the
  peak a scheme needs, and the plain forward they are compared with.
- The planner: the exercise's cost model (`plan_peak`, `plan_cost`), brute force
  over every plan for short chains, and `search_min_cost`, a plain loop over the
  layers that carries every reachable (kept bytes, running bytes) state for long
  chains (exhaustive, no pruning: it only merges plans in the same state).
- `same`: two gradient fingerprints agree.
"""

from __future__ import annotations

import itertools

import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         apply_activation_checkpointing,
                                                                         checkpoint_wrapper)
from torch.utils.checkpoint import checkpoint

from memlab.core.models import GPT, Block
from memlab.checkpointing import plan_peak  # the cost model, shared with benchmarks/bench_checkpointing.py

RTOL = 1e-5                       # checkpointing repeats the same arithmetic


# ----------------------------------------------------------------------------- gradient fingerprints
def same(got, want, rtol=RTOL) -> bool:
    if got is None or want is None:
        return got is None and want is None
    return all(abs(g - w) <= rtol * (4 * want[1] + 1e-3) for g, w in zip(got, want))


# ----------------------------------------------------------------------------- schemes, for memory bounds
def plain_forward(blocks, x):
    for b in blocks:
        x = b(x)
    return x


def _wrap_in_place(model: nn.Module, chosen) -> nn.Module:
    """`model` with each submodule for which chosen(module) holds wrapped, in place, in a non-reentrant
    checkpoint by PyTorch's activation-checkpointing pass."""
    apply_activation_checkpointing(
        model, check_fn=chosen,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT))
    return model


def ref_every_k(blocks, k) -> nn.Module:
    """The blocks in an nn.Sequential the check owns, blocks 0, k, 2k, ... wrapped by PyTorch's pass."""
    chosen = {id(b) for b in list(blocks)[::k]}
    return _wrap_in_place(nn.Sequential(*blocks), lambda m: id(m) in chosen)


def ref_checkpointed_gpt(cfg, state_dict) -> GPT:
    """memlab's plain GPT with the plain state, every Block wrapped by PyTorch's pass (GPT.run_blocks unchanged)."""
    model = GPT(cfg)
    model.load_state_dict(state_dict)
    return _wrap_in_place(model, lambda m: isinstance(m, Block))


def round_robin_segments(n: int, s: int) -> list[tuple[int, int]]:
    """s contiguous segments of range(n) whose lengths differ by at most one: deal the
    n blocks out one at a time, then lay the segments end to end."""
    sizes = [0] * s
    for i in range(n):
        sizes[i % s] += 1
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


class RefSegments(nn.Module):
    def __init__(self, blocks, segments):
        super().__init__()
        self.blocks, self.segments = nn.ModuleList(blocks), segments

    def _run(self, start, stop, x):
        return plain_forward(self.blocks[start:stop], x)

    def forward(self, x):
        for start, stop in self.segments:
            x = checkpoint(self._run, start, stop, x, use_reentrant=False)
        return x


# ----------------------------------------------------------------------------- the planner's cost model
def plan_cost(recompute_cost, keep) -> int:
    return sum(c for c, k in zip(recompute_cost, keep) if not k)


def all_plans(n):
    return itertools.product((False, True), repeat=n)


def brute_force_plan(act_bytes, recompute_cost, budget):
    """(min cost, plan) over all 2**N plans, or (None, None) if none fits."""
    best = (None, None)
    for keep in all_plans(len(act_bytes)):
        if plan_peak(act_bytes, keep) <= budget:
            c = plan_cost(recompute_cost, keep)
            if best[0] is None or c < best[0]:
                best = (c, list(keep))
    return best


def min_peak(act_bytes) -> int:
    """The smallest peak any plan reaches (brute force; small N only)."""
    return min(plan_peak(act_bytes, k) for k in all_plans(len(act_bytes)))


def search_min_cost(act_bytes, recompute_cost, budget):
    """The smallest cost of a plan within `budget`, or None: a plain loop over the layers that
    carries every reachable state of the cost model (bytes kept, bytes of the current
    recomputed run) with the cheapest cost reaching it. Two plans in the same state have
    the same future, so this is brute force with equal states merged."""
    states = {(0, 0): 0}
    for m, c in zip(act_bytes, recompute_cost):
        nxt = {}
        for (kept, run), cost in states.items():
            for state, new_cost in (((kept + m, 0), cost), ((kept, run + m), cost + c)):
                if sum(state) <= budget and new_cost < nxt.get(state, new_cost + 1):
                    nxt[state] = new_cost
        states = nxt
    return min(states.values(), default=None)
