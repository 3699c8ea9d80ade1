"""Exercise 04: the trusted references (never the solution's code).

- tasks 4.1-4.4: the patients of memlab/clinic.py as they came in, run on the same tiny data under the same
  recorder (the judge calls run.run_tiny on `Case.original`).
- task4_5: the largest batch found without a binary search: a brute-force scan of the step's exact byte
  formula (a fixed buffer plus a per-sample buffer, each rounded up to 512 bytes as the virtual GPU rounds),
  or, for a real training step, the peaks at batch 16 and 32 extrapolated and then walked to the boundary,
  confirmed with the virtual GPU itself.
- task4_6: the same step measured with memlab.MemoryTracker.
"""

from __future__ import annotations

import memlab

from .cases import step_bytes
from .inputs import case_gpu, case_step, leak_scenario


def reference_max_batch(case) -> int:
    """The largest batch in [1, limit] that fits, found without bisection, confirmed by the virtual GPU."""
    gpu, limit = case_gpu(case), case["limit"]
    fits = lambda b: gpu.fits(case_step(case), b)  # noqa: E731
    if case["kind"] in ("staircase", "contrastive"):     # brute force over the exact byte formula
        want = 0
        for b in range(1, limit + 1):
            if step_bytes(case, b) > gpu.capacity:
                break
            want = b
    else:                                     # peaks are affine in the batch: extrapolate, then walk to the edge
        lo, hi = 16, 32                       # past the small batches, where the optimizer's scratch dominates
        p1, p2 = gpu.run(case_step(case), lo, catch_oom=True).peak, gpu.run(case_step(case), hi, catch_oom=True).peak
        slope = max((p2 - p1) // (hi - lo), 1)
        want = max(0, min(limit, lo + (gpu.capacity - p1) // slope))
        while want < limit and fits(want + 1):
            want += 1
        while want > 0 and not fits(want):
            want -= 1
    if (want > 0 and not fits(want)) or (want < limit and fits(want + 1)):
        raise RuntimeError(f"internal check error: the reference answer {want} disagrees with the virtual GPU")
    return want


def reference_leak(case):
    """(category, bytes per step) measured with memlab.MemoryTracker, or None: the growth of each category
    between consecutive steps after the first, required positive on every one."""
    step, model, opt = leak_scenario(case)
    tracker = memlab.MemoryTracker(model, opt)
    levels = []
    with tracker:
        for _ in range(case["n_steps"]):
            step()
            levels.append(tracker.breakdown())
    growing = {}
    for c in memlab.CATEGORIES:
        deltas = [b[c] - a[c] for a, b in zip(levels, levels[1:])]
        if deltas and min(deltas) > 0:
            growing[c] = sum(deltas) / len(deltas)
    if not growing:
        return None
    c = max(growing, key=growing.get)
    return c, growing[c]

