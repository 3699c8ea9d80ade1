"""The OOM clinic on the virtual GPU: how long each clinic script takes at full size
on this machine, and the largest batch found by binary search against a
linear-fit prediction.

    python benchmarks/bench_oom_clinic.py [--presets T4-16GB A100-80GB] [--fit-batches 2 3 4]

Table 1 runs each clinic script of exercise 04 as it came in (it runs out of
memory) and as fixed in the exercise's source notebook, at full size on the named
virtual GPU, and reports the wall time of the fake run, the outcome and the
steady-state peak (the first step's peak, or the forward/backward peak plus the
optimizer state created by the first step, whichever is larger).

Table 2 trains GPT-2 medium (1024-token sequences, AdamW with foreach=True, two
steps so the optimizer state is alive in the second step's forward/backward)
and compares, per GPU preset, the largest batch found by binary search with the
one predicted from a straight line fitted to the peaks of a few small batches:
B* = floor((capacity - intercept) / slope).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import sys
import time
from pathlib import Path

import nbformat
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import memlab  # noqa: E402
from autograder.checks.ex04.inputs import CASES  # noqa: E402
from memlab import clinic  # noqa: E402
from memlab.core.models import GPT, GPTConfig  # noqa: E402

GiB = 2**30
SOURCE = ROOT / "solutions" / "04_oom_clinic" / "04_oom_clinic.ipynb"


def fixed_scripts() -> dict:
    """The exercise's reference fixes, from the source notebook's solution cells."""
    ns: dict = {}
    nb = nbformat.read(SOURCE, as_version=4)
    for cell in nb.cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if meta.get("grade_id") == "setup":
            with contextlib.redirect_stdout(io.StringIO()):      # it prints the device summary
                exec(compile(cell.source, "setup", "exec"), ns)
        elif meta.get("solution"):
            code = "\n".join(line for line in cell.source.splitlines()
                             if not line.strip().startswith(("### BEGIN SOLUTION", "### END SOLUTION")))
            exec(compile(code, meta["grade_id"], "exec"), ns)
    return ns


def steady_peak(script, gpu):
    """(fits, steady-state peak in bytes, seconds, VirtualRun) of one full-size run of `script` on `gpu`."""
    t0 = time.perf_counter()
    run, steady, _ = clinic.run_full_size(script, gpu)
    return run.fits, steady, time.perf_counter() - t0, run


def clinic_table() -> list[str]:
    ns = fixed_scripts()
    rows = ["| script | GPU | version | outcome | steady-state peak | headroom | seconds |",
            "|---|---|---|---|---|---|---|"]
    for task, case in CASES.items():
        gpu = memlab.VirtualGPU(case.gpu)
        for version, fn in (("as it came in", case.original), ("fixed", ns[case.fixed_name])):
            fits, peak, seconds, run = steady_peak(fn, gpu)
            outcome = "fits" if fits else f"OOM in {run.peak_phase}"
            head = memlab.format_bytes(gpu.capacity - peak) if fits else "-"
            shown = memlab.format_bytes(peak) if fits else f"> {memlab.format_bytes(gpu.capacity)}"
            rows.append(f"| {case.original.__name__} ({task}) | {case.gpu} | {version} | {outcome} | {shown} | "
                        f"{head} | {seconds:.2f} |")
    return rows


def gpt_two_steps(batch, cfg=None, seq=1024):
    """Two AdamW steps of GPT-2 medium at this batch size, built inside (fake tensors on the virtual GPU)."""
    cfg = cfg or GPTConfig.gpt2_medium()
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    memlab.watch(model, opt)
    for _ in range(2):
        x = torch.randint(0, cfg.vocab_size, (batch, seq))
        memlab.train_step(model, opt, x, x)


def binary_search(gpu, step, limit=4096):
    """(largest batch in [1, limit] that fits, number of probes): double until a probe fails, then bisect."""
    probes = [0]

    def fits(b):
        probes[0] += 1
        return gpu.fits(step, b)

    if not fits(1):
        return 0, probes[0]
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, 2 * hi
    if hi > limit:
        if lo == limit or fits(limit):
            return limit, probes[0]
        hi = limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, probes[0]


def batch_table(presets, fit_batches) -> list[str]:
    big = memlab.VirtualGPU(capacity_gb=4096)
    t0 = time.perf_counter()
    peaks = [big.run(gpt_two_steps, b).peak for b in fit_batches]
    fit_seconds = time.perf_counter() - t0
    slope, intercept = np.polyfit(fit_batches, peaks, 1)
    worst = max(abs(np.polyval([slope, intercept], b) - p) / p for b, p in zip(fit_batches, peaks))
    rows = [f"Linear fit from batches {list(fit_batches)} ({fit_seconds:.1f} s): peak = "
            f"{intercept / GiB:.3f} GiB + B x {slope / GiB:.4f} GiB (worst misfit {100 * worst:.3f}%)", "",
            "| GPU | capacity | predicted (linear fit) | found (binary search) | probes | search seconds |",
            "|---|---|---|---|---|---|"]
    for name in presets:
        gpu = memlab.VirtualGPU(name)
        predicted = max(0, math.floor((gpu.capacity - intercept) / slope))
        t0 = time.perf_counter()
        found, probes = binary_search(gpu, gpt_two_steps)
        rows.append(f"| {name} | {memlab.format_bytes(gpu.capacity)} | {predicted} | {found} | {probes} | "
                    f"{time.perf_counter() - t0:.1f} |")
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["T4-16GB", "A100-80GB"], choices=sorted(memlab.PRESETS),
                   help="virtual GPU presets for the batch-size search (default: T4-16GB A100-80GB)")
    p.add_argument("--fit-batches", nargs="+", type=int, default=[2, 3, 4],
                   help="small batches whose measured peaks the line is fitted to (default: 2 3 4)")
    p.add_argument("--skip-clinic", action="store_true", help="only the batch-size table")
    a = p.parse_args(argv)
    if len(a.fit_batches) < 2 or any(b < 1 for b in a.fit_batches):
        p.error("--fit-batches needs at least two positive batch sizes")
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; times are wall-clock seconds of fake "
          f"runs on this machine\n")
    if not a.skip_clinic:
        print("## Clinic scripts at full size on the virtual GPU\n")
        print("\n".join(clinic_table()))
        print()
    print("## Largest batch: GPT-2 medium, T=1024, AdamW (foreach), two steps\n")
    print("\n".join(batch_table(a.presets, a.fit_batches)))


if __name__ == "__main__":
    main()
