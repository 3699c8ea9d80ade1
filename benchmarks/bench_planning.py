"""Static memory planning on real training steps and on small traces (lesson 10, memlab.planning).

1. The small GPT of lesson 01 (GPTConfig.tiny, AdamW), one steady-state step per batch size: the number of
   lifetimes, the live-bytes lower bound, greedy by size, first fit and memlab's model of the caching allocator
   (allocated and reserved peaks), every size rounded to 512 B, and how long each planner takes.
2. The brute-force optimum (`optimal_offsets`) on random traces of n tensors: its time, and how often greedy by
   size, first fit and the lower bound equal it.
3. With --compile: the cold and warm time of lesson 10's `torch.compile` (Inductor's code read back with
   `inductor_code`), in a fresh Inductor cache directory so that the cold time is a first run's.

    python benchmarks/bench_planning.py [--batches 2 8 16] [--sizes 6 8 10] [--traces 30] [--compile]

Times are wall-clock (time.perf_counter) on whatever else the machine is doing: the load average is printed.
Byte counts are exact and do not depend on load.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import memlab  # noqa: E402
import memlab.planning as P  # noqa: E402
from memlab.core.allocator import replay  # noqa: E402


def gpt_steps(batches, seq=128):
    fmt = memlab.format_bytes
    print(f"## GPT tiny ({memlab.GPTConfig.tiny().n_layer} blocks), AdamW, T={seq}, sizes rounded to 512 B\n")
    print("| batch | lifetimes | lower bound | greedy by size | first fit | allocator allocated | allocator reserved "
          "| greedy (s) | first fit (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b in batches:
        torch.manual_seed(0)
        cfg = memlab.GPTConfig.tiny()
        gpt = memlab.GPT(cfg)
        opt = torch.optim.AdamW(gpt.parameters())
        idx = torch.randint(0, cfg.vocab_size, (b, seq))
        memlab.train_step(gpt, opt, idx, idx)                        # AdamW's state exists before the trace
        trace = P.record_step(memlab.train_step, gpt, opt, idx, idx, model=gpt, optimizer=opt)
        lts = P.round_lifetimes(trace.lifetimes, 512)
        bound = P.live_bytes_peak(lts)
        t0 = time.perf_counter()
        g = P.check_plan(lts, P.greedy_by_size(lts))
        t1 = time.perf_counter()
        f = P.check_plan(lts, P.first_fit(lts))
        t2 = time.perf_counter()
        a = replay(trace.events)
        print(f"| {b} | {len(lts)} | {fmt(bound)} | {fmt(g)} ({g / bound:.3f}x) | {fmt(f)} ({f / bound:.3f}x) | "
              f"{fmt(a['max_allocated'])} | {fmt(a['max_reserved'])} ({a['max_reserved'] / bound:.3f}x) | "
              f"{t1 - t0:.2f} | {t2 - t1:.2f} |")


def brute_force(sizes, traces, seed=0):
    rng = random.Random(seed)
    print(f"\n## Brute-force optimum on {traces} random traces per size (sizes from 1, 2, 3, 4, 6; 8 time steps)\n")
    print("| tensors | mean time (ms) | max time (ms) | greedy = optimum | first fit = optimum | optimum = bound |")
    print("|---|---|---|---|---|---|")
    for n in sizes:
        times, hits = [], [0, 0, 0]
        for _ in range(traces):
            lts = []
            for _ in range(n):
                b = rng.randrange(8)
                lts.append((rng.choice((1, 2, 3, 4, 6)), b, rng.randrange(b + 1, 9)))
            t0 = time.perf_counter()
            best = P.check_plan(lts, P.optimal_offsets(lts, max_tensors=n))
            times.append(time.perf_counter() - t0)
            hits[0] += P.arena_size(lts, P.greedy_by_size(lts)) == best
            hits[1] += P.arena_size(lts, P.first_fit(lts)) == best
            hits[2] += P.live_bytes_peak(lts) == best
        print(f"| {n} | {1e3 * sum(times) / len(times):.1f} | {1e3 * max(times):.1f} | "
              + " | ".join(f"{h}/{traces}" for h in hits) + " |")


def compile_times():
    """Cold and warm time of lesson 10's inductor_code call, in a fresh cache directory (run in a subprocess so
    the cache directory is read when torch._inductor is first imported)."""
    import subprocess
    probe = ("import time, torch, torch.nn as nn; torch.set_num_threads(1)\n"
             "import memlab.planning as P\n"
             "mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), "
             "nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 10))\n"
             "x = torch.randn(32, 64); t0 = time.perf_counter()\n"
             "with torch.no_grad():\n"
             "    for planning in (False, True):\n"
             "        P.inductor_code(mlp, x, memory_planning=planning)\n"
             "print(round(time.perf_counter() - t0, 1))\n")
    print("\n## torch.compile of lesson 10's MLP (default, then memory_planning=True)\n")
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
        for run in ("cold (empty cache)", "warm (same cache)"):
            out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
            print(f"- {run}: {out.stdout.strip().splitlines()[-1]} s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[2, 8, 16])
    ap.add_argument("--sizes", type=int, nargs="+", default=[6, 8, 10])
    ap.add_argument("--traces", type=int, default=30)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile cold and warm")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, 1 torch thread, "
          f"load average {os.getloadavg()[0]:.1f} at the start\n")
    gpt_steps(args.batches)
    brute_force(args.sizes, args.traces)
    if args.compile:
        compile_times()
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
