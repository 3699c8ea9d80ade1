"""Tracker overhead: the time of one training step untracked, under memlab's
MemoryTracker and under PyTorch's MemTracker, as ratios, measured in one run
(interleaved repetitions; median of each). Target: memlab's overhead no larger
than MemTracker's. Also times the 7B-parameter virtual-GPU step (target: under a minute).

    python benchmarks/bench_tracker_overhead.py [--reps 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.distributed._tools.mem_tracker import MemTracker

import memlab


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| model | untracked step | memlab / untracked | MemTracker / untracked |")
    print("|---|---|---|---|")
    cases = [("MLP 256-512x4-10, B=256", lambda: memlab.MLP(256, 512, 4, 10),
              lambda: (torch.randn(256, 256), torch.randint(0, 10, (256,)))),
             ("GPT tiny, B=8 T=128", lambda: memlab.GPT(memlab.GPTConfig.tiny()),
              lambda: (torch.randint(0, 256, (8, 128)),) * 2)]
    for name, make_model, make_batch in cases:
        torch.manual_seed(0)
        model = make_model()
        opt = torch.optim.Adam(model.parameters())
        memlab.train_step(model, opt, *make_batch())       # warm up, create Adam state

        def plain():
            memlab.train_step(model, opt, *make_batch())

        def ours():
            with memlab.MemoryTracker(model, opt):
                memlab.train_step(model, opt, *make_batch())

        def theirs():
            mt = MemTracker()
            mt.track_external(model, opt)
            with mt:
                memlab.train_step(model, opt, *make_batch())

        times = {"plain": [], "ours": [], "theirs": []}
        for _ in range(args.reps):                           # interleaved, so drift hits all three alike
            for key, fn in (("plain", plain), ("ours", ours), ("theirs", theirs)):
                t0 = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"| {name} | {1e3 * med['plain']:.1f} ms | {med['ours'] / med['plain']:.2f}x | "
              f"{med['theirs'] / med['plain']:.2f}x |")

    def llama():
        cfg = memlab.GPTConfig.llama_7b()
        model = memlab.GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        memlab.watch(model, opt)
        x = torch.randint(0, cfg.vocab_size, (1, 512))
        memlab.train_step(model, opt, x, x)

    run = memlab.VirtualGPU(capacity_gb=1024).run(llama)
    print(f"\nLlama-2-7B-shaped training step (batch 1 x 512, AdamW) on the virtual GPU: {run.seconds:.1f} s "
          f"(target: under 60 s), peak {memlab.format_bytes(run.peak)}")


if __name__ == "__main__":
    main()
