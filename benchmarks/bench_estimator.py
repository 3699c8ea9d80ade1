"""Estimator accuracy: predicted vs measured peak of a training step, on the zoo.

For each zoo entry (benchmarks/zoo.py), the peak measured by memlab's tracker
against three predictions:
  memlab      memlab.core.estimate (walks the step: model states, activations, scratch)
  deepspeed   estimate_zero2_model_states_mem_needs, 1 GPU, no offload: model states only (2 + 18 B/param)
  accelerate  `accelerate estimate-memory`'s training figure: 4 x the fp32 model size (16 B/param)
Target: memlab within 3% everywhere.

    python benchmarks/bench_estimator.py
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import zoo  # noqa: E402


def main(argv=None):
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    from accelerate.commands.estimate import estimate_training_usage
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    print("| step | first step | measured peak | memlab | DeepSpeed ZeRO-2 (states) | accelerate (4x) |")
    print("|---|---|---|---|---|---|")
    worst = 0.0
    for entry in zoo.ZOO:
        for first in (False, True):
            measured, est, model = zoo.measure(entry, first)
            n = sum(p.numel() for p in model.parameters())
            _, ds = estimate_zero2_model_states_mem_needs(n, 1, 1, cpu_offload=False)
            acc = max(estimate_training_usage(4 * n, "float32").values())
            err = lambda v: f"{100 * (v - measured) / measured:+.1f}%"  # noqa: E731
            worst = max(worst, abs(est.peak - measured) / measured)
            print(f"| {zoo.label(entry)} | {'yes' if first else 'no'} | {measured / 2**20:.2f} MiB | "
                  f"{err(est.peak)} | {err(ds)} | {err(acc)} |")
    print(f"\nworst memlab error: {100 * worst:.2f}% (target: within 3%)")


if __name__ == "__main__":
    main()
