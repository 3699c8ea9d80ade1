"""Exercise 02's references.

- Memory bounds: the schemes written directly with `torch.utils.checkpoint`
  (library calls, used only to measure the peak a scheme needs), and the plain
  forward they are compared with.
- The planner: the exercise's cost model (`plan_peak`, `plan_cost`), brute force
  over every plan for short chains, and `search_min_cost`, a plain loop over the
  layers that carries every reachable (kept bytes, running bytes) state for long
  chains (exhaustive, no pruning: it only merges plans in the same state).
- `same`: two gradient fingerprints agree.
"""

from __future__ import annotations

import functools
import itertools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from memlab.core.models import GPT
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


class RefEveryK(nn.Module):
    def __init__(self, blocks, k):
        super().__init__()
        self.blocks, self.k = nn.ModuleList(blocks), k

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            x = checkpoint(b, x, use_reentrant=False) if i % self.k == 0 else b(x)
        return x


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


class RefCheckpointedGPT(GPT):
    """Every block under its own non-reentrant checkpoint, written apart from the solution: rope is bound into
    the checkpointed function (functools.partial), so the checkpoint's only input is x (B, T, C)."""

    def run_blocks(self, x, rope):
        for block in self.blocks:
            x = checkpoint(functools.partial(block, rope=rope), x, use_reentrant=False)
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
