"""Attention as T grows: peak memory and time of naive attention (einsum +
softmax, memlab.attention.naive_attention), PyTorch's scaled_dot_product_attention
(SDPA, whichever backend it picks here) and lesson 05's tiled forward
(memlab.attention.tiled_attention), forward only and forward + backward. On a CUDA
GPU it also times each SDPA backend alone and the flash-attn package where it runs.

    python benchmarks/bench_attention.py [--seqs 256 512 1024 2048] [--batch 1] [--heads 4]
                                         [--head-dim 64] [--block 128] [--reps 3] [--threads 1]

Memory: on a CPU, memlab's tracker (exact bytes of the storages the call creates;
q, k, v are made before it starts); on CUDA, torch.cuda.max_memory_allocated above
what was allocated before the call. Time: the fastest of `reps` calls after a
warm-up; on a CPU the process's CPU time (time.process_time, which other programs
on the same cores do not inflate), on CUDA wall time after synchronising.
"Tiled" is timed and measured without autograd for the forward; its training row
differentiates through the Python loops (autograd keeps every tile).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import memlab  # noqa: E402
from memlab.attention import (attention_bytes, attention_with_fallback, flash_attn_status,  # noqa: E402
                              naive_attention, sdpa_backend, tiled_attention)


def measure(fn, shape, device, dtype, backward, reps):
    """(peak bytes, fastest seconds) of fn(q, k, v) [+ backward] on fresh inputs."""
    on_gpu = device.type == "cuda"
    q, k, v = (torch.randn(*shape, device=device, dtype=dtype, requires_grad=backward) for _ in range(3))

    def call():
        if backward:
            fn(q, k, v).sum().backward()
        else:
            with torch.no_grad():
                fn(q, k, v)

    if on_gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        call()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        tracker = memlab.MemoryTracker(device=device, timeline=False)
        with tracker:
            call()
        peak = tracker.peak
    clock = time.perf_counter if on_gpu else time.process_time
    best = float("inf")
    for _ in range(reps):
        for t in (q, k, v):
            t.grad = None
        if on_gpu:
            torch.cuda.synchronize()
        t0 = clock()
        call()
        if on_gpu:
            torch.cuda.synchronize()
        best = min(best, clock() - t0)
    return peak, best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=128, help="tile size of the tiled forward (queries and keys)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (1: steady timings on a shared machine)")
    args = ap.parse_args(argv)
    if min(args.seqs) < 1 or min(args.batch, args.heads, args.head_dim, args.block, args.reps) < 1:
        ap.error("sizes and --reps must be positive")

    device = memlab.pick_device()
    on_gpu = device.type == "cuda"
    if not on_gpu:
        torch.set_num_threads(args.threads)
    dtype = torch.float16 if on_gpu else torch.float32
    B, H, d, blk = args.batch, args.heads, args.head_dim, args.block
    probe = torch.randn(1, H, 64, d, device=device, dtype=dtype)
    info = memlab.describe(device)
    print(f"device: {info.name}; torch {torch.__version__}; threads {torch.get_num_threads()}; {dtype}; "
          f"SDPA picks: {sdpa_backend(probe, probe, probe).op}")
    print(f"B={B}, H={H}, d={d}; tiles of {blk}; peak = bytes the call allocates; time = fastest of {args.reps}\n")

    impls = {"naive": naive_attention, "SDPA": F.scaled_dot_product_attention,
             "tiled": lambda q, k, v: tiled_attention(q, k, v, blk, blk)}
    print("| T | implementation | forward peak | forward time (ms) | fwd+bwd peak | fwd+bwd time (ms) "
          "| one (B,H,T,T) matrix |")
    print("|---|---|---|---|---|---|---|")
    ratios = {}
    for T in args.seqs:
        shape = (B, H, T, d)
        row = {}
        for name, fn in impls.items():
            fwd = measure(fn, shape, device, dtype, False, args.reps)
            trn = measure(fn, shape, device, dtype, True, args.reps)
            row[name] = (fwd, trn)
            mat = attention_bytes(B, H, T, d, dtype=dtype)["probs"]
            label = name if name != "tiled" else "tiled (training: autograd through the loops)"
            print(f"| {T} | {label} | {memlab.format_bytes(fwd[0])} | {fwd[1] * 1e3:.2f} | "
                  f"{memlab.format_bytes(trn[0])} | {trn[1] * 1e3:.2f} | {memlab.format_bytes(mat)} |")
        ratios[T] = row["naive"][1][0] / row["SDPA"][1][0]
    print("\nnaive / SDPA fwd+bwd peak: " + ", ".join(f"{r:.1f}x at T={t}" for t, r in ratios.items()))

    if not on_gpu:
        print("\nno CUDA GPU: the flash-attn and per-backend comparison runs only on one")
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    ok, why = flash_attn_status(device)
    print(f"\nflash-attn: {why}")
    variants = {}
    for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        def run(q, k, v, b=b):
            with sdpa_kernel(b):
                return F.scaled_dot_product_attention(q, k, v)
        variants[f"SDPA {b.name}"] = run
    if ok:
        variants["flash-attn"] = lambda q, k, v: attention_with_fallback(q, k, v)[0]
    print("| T | kernel | fwd+bwd peak | fwd+bwd time (ms) |")
    print("|---|---|---|---|")
    for T in args.seqs:
        for name, fn in variants.items():
            try:
                peak, sec = measure(fn, (B, H, T, d), device, dtype, True, args.reps)
                print(f"| {T} | {name} | {memlab.format_bytes(peak)} | {sec * 1e3:.2f} |")
            except RuntimeError as e:
                print(f"| {T} | {name} | not run: {str(e).splitlines()[0][:70]} | |")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
