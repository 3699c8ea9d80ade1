"""memlab.fit against published peak-memory figures of real GPU runs: each figure with its source and settings,
fit's prediction with the nearest settings fit can express, and the difference.

    python benchmarks/bench_fit_published.py          # prints the tables quoted in benchmarks/fit_published.md

Three kinds of row:
  peak    a run's published peak (torch.cuda.max_memory_allocated or the allocator's peak active bytes) against
          fit's allocated peak (`FitResult.peak`) with the same settings
  states  a published output of DeepSpeed's model-state estimator against fit's `model_states` (parameters,
          gradients and optimizer state per GPU after the step): exact by construction where both count the same
          bytes
  fits    a published "this trained on that card" claim: the card's capacity against fit's allocated peak, and
          fit's verdict on that card (allocated + caching-allocator reserve + CUDA context, no headroom kept)
Where a published run uses something fit cannot express, the row says what.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from memlab.fitting.published import ROWS, fit_row  # noqa: E402

GiB = 2**30


def main() -> int:
    print(f"{'kind':<6} {'published':>10} {'fit':>10} {'diff':>7}  run")
    for kind, source, what, published, model, gpu, kw, note in ROWS:
        t0 = time.perf_counter()
        got, r = fit_row(kind, model, gpu, kw)
        if got is None:
            print(f"{kind:<6} {published:>6.2f} GiB {'-':>10} {'-':>7}  {what}")
            print(f"{'':>38}NOT RUN: {r}")
            continue
        if kind == "fits":
            room = "fits" if got <= published else "over"
            print(f"{kind:<6} {published:>6.2f} GiB {got:>6.2f} GiB {room:>7}  {what}")
            needed = getattr(r, "needed", r.peak) / GiB
            print(f"{'':>38}fit's verdict: {r.verdict} (allocated peak + allocator reserve + CUDA context = "
                  f"{needed:.2f} GiB of {published:.2f} GiB)")
        else:
            print(f"{kind:<6} {published:>6.2f} GiB {got:>6.2f} GiB {(got - published) / published:>+7.1%}  {what}")
        print(f"{'':>38}source: {source}")
        print(f"{'':>38}fit: {kw} -> allocated peak {r.peak / GiB:.2f} GiB in '{r.peak_phase}' "
              f"({time.perf_counter() - t0:.1f} s)")
        print(f"{'':>38}left: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
