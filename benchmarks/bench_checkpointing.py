"""Activation checkpointing on a stack of N residual MLP blocks: peak activation
memory (memlab's tracker) and step time (forward + backward) under four schemes:
no checkpointing, every layer, sqrt(N) segments, and the optimal plan under a
fixed memory budget (the planner of exercise 02). Checks that the sqrt(N)
scheme's peak grows like sqrt(N) (Chen et al. 2016).

    python benchmarks/bench_checkpointing.py [--depths 4 16 64] [--width 64] [--rows 256]
                                             [--budget-blocks 24] [--reps 5] [--threads 1]

Units: u = rows * width * 4 bytes (one block input); a = the bytes one block
keeps for backward when run normally (measured; 9u for hidden = 4 * width).
Step times are the fastest of `reps` rounds, schemes timed in turns; on a CPU
they are the process's CPU time (time.process_time), which other programs on
the same cores do not inflate; on CUDA, wall time after synchronising.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import memlab  # noqa: E402
from memlab.checkpointing import activation_peak, block_stack, plan_peak  # noqa: E402
from memlab.core.estimate import chen_segment_peak  # noqa: E402

SCHEMES = ("none", "every layer", "sqrt(N) segments", "planner")


def sqrt_segments(n: int) -> list[tuple[int, int]]:
    """ceil(sqrt(n)) segments of near-equal length covering blocks 0..n-1 (Chen et al. 2016, sec. 4.1)."""
    k = math.isqrt(n - 1) + 1 if n > 1 else 1
    bounds = [round(i * n / k) for i in range(k + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def search_plan(act_bytes, cost, budget) -> list[bool]:
    """The cheapest plan within `budget`: a plain search over the cost model's states (bytes kept, bytes of
    the current run), keeping one cheapest plan per state; the benchmark's reference, not a fast planner."""
    states = {(0, 0): (0, [])}
    for m, c in zip(act_bytes, cost):
        nxt = {}
        for (kept, run), (total, plan) in states.items():
            for state, new, flag in (((kept + m, 0), total, True), ((kept, run + m), total + c, False)):
                if sum(state) <= budget and (state not in nxt or new < nxt[state][0]):
                    nxt[state] = (new, plan + [flag])
        states = nxt
    if not states:
        raise SystemExit(f"no plan fits the budget of {budget} bytes: raise --budget-blocks")
    return min(states.values())[1]


def run_segment(blocks, start, stop, x):
    for b in blocks[start:stop]:
        x = b(x)
    return x


def forward(blocks, x, scheme, plan=None):
    """The stack's output under a scheme. `plan` (keep flags, for "planner"): kept blocks run
    normally, each maximal run of not-kept blocks is one checkpointed segment."""
    n = len(blocks)
    if scheme == "none":
        return run_segment(blocks, 0, n, x)
    if scheme == "every layer":
        segments = [(i, i + 1) for i in range(n)]
    elif scheme == "sqrt(N) segments":
        segments = sqrt_segments(n)
    else:
        i = 0
        while i < n:
            if plan[i]:
                x = blocks[i](x)
                i += 1
                continue
            j = i
            while j < n and not plan[j]:
                j += 1
            x = checkpoint(run_segment, blocks, i, j, x, use_reentrant=False)
            i = j
        return x
    for start, stop in segments:
        x = checkpoint(run_segment, blocks, start, stop, x, use_reentrant=False)
    return x


def theory(n, scheme, u, a, plan):
    """Predicted peak activation bytes (Chen et al.'s segment formula; the planner's cost model)."""
    if scheme == "none":
        return n * a
    if scheme == "every layer":
        return chen_segment_peak(n, 1, u, a)
    if scheme == "sqrt(N) segments":
        longest = max(stop - start for start, stop in sqrt_segments(n))
        return len(sqrt_segments(n)) * u + longest * a
    return plan_peak([a] * n, plan)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[4, 16, 64])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--budget-blocks", type=float, default=24.0,
                    help="the planner's memory budget, in units of one block's stored activations (a)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (1: steady timings on a shared machine)")
    args = ap.parse_args(argv)
    if sorted(set(args.depths)) != sorted(args.depths) or min(args.depths) < 1:
        ap.error("--depths must be distinct positive ints")

    device = memlab.pick_device()
    on_gpu = device.type == "cuda"
    if not on_gpu:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if on_gpu else time.process_time

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    d, rows = args.width, args.rows
    u = rows * d * 4
    torch.manual_seed(0)
    one = block_stack(1, d).to(device)
    x1 = torch.randn(rows, d, device=device)
    a = activation_peak(one, lambda: one(x1 * 1.0).sum()).stored       # what one block keeps, its input included
    budget = int(args.budget_blocks * a)
    print(f"device: {memlab.describe(device).name}; torch threads {torch.get_num_threads()}")
    print(f"blocks: x + W2 gelu(W1 x), width {d}, hidden {4 * d}, {rows} rows; u = {memlab.format_bytes(u)}, "
          f"a = {memlab.format_bytes(a)} = {a / u:.2f} u; planner budget {args.budget_blocks:g} a = "
          f"{memlab.format_bytes(budget)} (uniform recompute cost 1 per block)\n")

    print("| N | scheme | peak activations (measured) | theory | measured / theory | step (ms) | vs none |")
    print("|---|---|---|---|---|---|---|")
    results = {}
    for n in args.depths:
        torch.manual_seed(n)
        blocks = block_stack(n, d).to(device)
        x = torch.randn(rows, d, device=device, requires_grad=True)
        plan = search_plan([a] * n, [1] * n, budget)
        fns = {s: (lambda s=s: forward(blocks, x, s, plan).square().mean()) for s in SCHEMES}
        peaks = {s: activation_peak(blocks, fn).peak for s, fn in fns.items()}
        times = {s: [] for s in SCHEMES}
        for r in range(args.reps + 1):                 # round 0 warms up
            for s, fn in fns.items():
                sync()
                t0 = clock()
                fn().backward()
                sync()
                if r:
                    times[s].append(clock() - t0)
        for s in SCHEMES:
            th = theory(n, s, u, a, plan)
            t = min(times[s])
            results[(n, s)] = (peaks[s], th, t)
            label = s if s != "planner" else f"planner (keeps {sum(plan)} of {n})"
            print(f"| {n} | {label} | {memlab.format_bytes(peaks[s])} ({peaks[s] / u:.1f} u) | "
                  f"{memlab.format_bytes(th)} ({th / u:.1f} u) | {peaks[s] / th:.2f} | {t * 1e3:.1f} | "
                  f"{t / min(times['none']):.2f}x |")

    over = [(n, results[(n, "planner")][0]) for n in args.depths if results[(n, "planner")][0] > budget]
    if over:
        print("\nthe planner's cost model counts what each kept block stores and each recomputed run; it leaves out "
              "the input a checkpointed run keeps (one u per run) and the gradients in flight (a few u), so the "
              "measured peak exceeds the budget by " + ", ".join(
                  f"{(pk - budget) / u:.1f} u at N={n}" for n, pk in over))
    print()
    ok = True
    lo, hi = (16, 64) if {16, 64} <= set(args.depths) else (sorted(args.depths)[-2], sorted(args.depths)[-1])
    if len(args.depths) >= 2:
        got = results[(hi, "sqrt(N) segments")][0] / results[(lo, "sqrt(N) segments")][0]
        want = math.sqrt(hi / lo)
        full = results[(hi, "sqrt(N) segments")][1] / results[(lo, "sqrt(N) segments")][1]
        ok = abs(got / want - 1) <= 0.15
        print(f"| sqrt(N) segments, peak(N={hi}) / peak(N={lo}) | measured | sqrt({hi}/{lo}) | full formula |")
        print("|---|---|---|---|")
        print(f"| ratio | {got:.3f} | {want:.3f} | {full:.3f} |")
        print(f"\nmeasured ratio within 15% of sqrt(N) growth: {'yes' if ok else 'NO'} "
              f"({100 * (got / want - 1):+.1f}%)")
        e = results[(hi, "every layer")][0] / results[(lo, "every layer")][0]
        print(f"for comparison, every-layer checkpointing grows x{e:.2f} over the same depths (x{hi / lo:.0f} "
              f"layers): O(N)")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main()
