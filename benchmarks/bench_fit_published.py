"""memlab.fit against published peak-memory figures of real GPU runs: each figure with its source and settings,
fit's prediction with the nearest settings fit can express, and the difference.

    python benchmarks/bench_fit_published.py          # prints the tables quoted in benchmarks/fit_published.md
    python benchmarks/bench_fit_published.py maxseq   # only the rows of these kinds

Three kinds of row:
  peak    a run's published peak (torch.cuda.max_memory_allocated or the allocator's peak active bytes) against
          fit's allocated peak (`FitResult.peak`) with the same settings
  states  a published output of DeepSpeed's model-state estimator against fit's `model_states` (parameters,
          gradients and optimizer state per GPU after the step): exact by construction where both count the same
          bytes
  fits    a published "this trained on that card" claim: the card's capacity against fit's allocated peak, and
          fit's verdict on that card (allocated + caching-allocator reserve + CUDA context, no headroom kept)
  used    the device memory in use (nvidia-smi / NVML) a run showed, against fit's most-reserved bytes + the CUDA
          context measured on that run's machine
  maxseq  a published longest sequence that trained, against memlab.fit_max (no headroom kept)
  speed   published training tokens per second, against the most fit's lower bound on the step's time allows
          (memlab.fitting.published.step_bound: peak FLOP/s and bandwidths of the card)
Where a published run uses something fit cannot express, the row says what.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from memlab.fitting.published import ROWS, fit_row  # noqa: E402

GiB = 2**30


UNIT = {"maxseq": "tok", "speed": "tok/s"}


def _fmt(kind, v):
    return f"{v:>6,.0f} {UNIT[kind]:<5}" if kind in UNIT else f"{v:>6.2f} GiB  "


def main(argv=None) -> int:
    kinds = set(argv or sys.argv[1:]) or None          # e.g. `maxseq speed`: only those kinds
    print(f"{'kind':<6} {'published':>12} {'fit':>12} {'diff':>7}  run")
    for kind, source, what, published, model, gpu, kw, note in ROWS:
        if kinds and kind not in kinds:
            continue
        t0 = time.perf_counter()
        got, r = fit_row(kind, model, gpu, kw)
        if got is None:
            print(f"{kind:<6} {_fmt(kind, published)} {'-':>12} {'-':>7}  {what}")
            print(f"{'':>40}NOT RUN: {r}")
            continue
        if kind == "fits":
            room = "fits" if got <= published else "over"
            print(f"{kind:<6} {_fmt(kind, published)} {_fmt(kind, got)} {room:>7}  {what}")
            print(f"{'':>40}fit's verdict: {r.verdict} (allocated peak + allocator reserve + CUDA context = "
                  f"{r.needed / GiB:.2f} GiB of {published:.2f} GiB)")
        else:
            print(f"{kind:<6} {_fmt(kind, published)} {_fmt(kind, got)} {(got - published) / published:>+7.1%}  {what}")
        print(f"{'':>40}source: {source}")
        if kind == "maxseq":
            print(f"{'':>40}fit_max: {kw} -> {r.value:,} tokens fit ({r.at.needed / GiB:.2f} GiB of "
                  f"{r.at.usable / GiB:.2f} GiB), {r.value + 1:,} do not; {len(r.probes)} steps measured "
                  f"({time.perf_counter() - t0:.1f} s)" if r.at is not None else f"{'':>40}fit_max: nothing fits")
        else:
            print(f"{'':>40}fit: {kw} -> allocated peak {r.peak / GiB:.2f} GiB in '{r.peak_phase}', reserved "
                  f"{r.reserved_cached / GiB:.2f} GiB at most ({time.perf_counter() - t0:.1f} s)")
        print(f"{'':>40}left: {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
