"""This machine's memory hierarchy and roofline, measured with memlab.hardware.hierarchy:

  * copy bandwidth (dst.copy_(src), read + write counted) and read bandwidth
    (a stride-0 sum that re-reads the working set inside one call) by working-set
    size: the cache staircase, L1 -> L2 -> L3 -> DRAM on a CPU, L2 -> HBM on a GPU;
  * achieved matmul FLOP/s by size (fp32 on a CPU; fp32, fp16, bf16 on CUDA, where
    fp32 runs on CUDA cores: PyTorch leaves TF32 off by default), and the measured ridge;
  * on CUDA also host<->device transfer bandwidth, pageable and pinned, and the
    measured figures as a fraction of the GPU's data sheet (memlab.hardware.hierarchy.GPU_SPECS).

    python benchmarks/bench_hierarchy.py [--threads 1] [--reps 7] [--device cpu|cuda]

Every figure is the median of `reps` samples (each sample >= 2 ms of back-to-back
calls after warm-up; CUDA timed with events), with the best (fastest) sample beside
it: on a shared machine noise only adds time, so the best is the steadier estimate
of what the hardware can do.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from memlab import format_bytes  # noqa: E402
from memlab.hardware import hierarchy as H# noqa: E402


def both(measure, **kw):
    """(median, best) of one measurement function that takes stat=."""
    return measure(stat="median", **kw), measure(stat="min", **kw)


def cache_curve(device, reps):
    ks = range(13, 27) if device.type == "cpu" else range(16, 31)
    print("\n## Bandwidth by working-set size (GB/s, median / best)\n")
    print("| working set | read | copy (working set = 2 x buffer) |")
    print("|---|---|---|")
    for k in ks:
        n = 2**k
        r = both(H.read_bandwidth, nbytes=n, device=device, repeats=reps)
        c = both(H.copy_bandwidth, nbytes=n, device=device, repeats=reps)
        print(f"| {format_bytes(n)} | {r[0]:.1f} / {r[1]:.1f} | buffer {format_bytes(n)}: {c[0]:.1f} / {c[1]:.1f} |")


def matmuls(device, reps):
    sizes = (128, 256, 512, 1024) if device.type == "cpu" else (1024, 2048, 4096, 8192)
    # CPUs without native bf16 math (AVX2) run bf16 matmuls far slower than fp32: fp32 only on CPU
    dtypes = [torch.float32] + ([torch.float16, torch.bfloat16] if device.type == "cuda" else [])
    print("\n## Matmul (n x n) @ (n x n), GFLOP/s counting 2 n^3 (median / best)\n")
    print("| n | " + " | ".join(str(d).replace("torch.", "") for d in dtypes) + " |")
    print("|---|" + "---|" * len(dtypes))
    best = {}
    for n in sizes:
        cells = []
        for d in dtypes:
            m, b = both(H.matmul_throughput, n=n, device=device, dtype=d, repeats=reps)
            best[d] = max(best.get(d, 0.0), b)
            cells.append(f"{m / 1e9:.1f} / {b / 1e9:.1f}")
        print(f"| {n} | " + " | ".join(cells) + " |")
    return best


def transfers(reps):
    print("\n## Host <-> device transfers, 256 MiB (GB/s, median)\n")
    print("| host memory | host -> device | device -> host |")
    print("|---|---|---|")
    for pinned in (False, True):
        h2d = H.transfer_bandwidth(256 << 20, "h2d", pinned, repeats=reps)
        d2h = H.transfer_bandwidth(256 << 20, "d2h", pinned, repeats=reps)
        print(f"| {'pinned' if pinned else 'pageable'} | {h2d:.1f} | {d2h:.1f} |")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (default 1: one core, steadier)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else (platform.processor() or platform.machine())
    print(f"# memlab hierarchy benchmark: {device.type} ({name}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} CPU thread(s) of {os.cpu_count()}")
    if device.type == "cpu":
        print("caches reported by the OS:", {k: format_bytes(v) for k, v in H.cpu_cache_sizes().items()} or "none")
    cache_curve(device, args.reps)
    best = matmuls(device, args.reps)
    big = (64 << 20) if device.type == "cpu" else (1 << 30)
    bw = 1e9 * max(H.copy_bandwidth(big, device, repeats=args.reps, stat="min"),
                   H.read_bandwidth(big, device, repeats=args.reps, stat="min"))
    print(f"\n## Measured roofline\n\nbandwidth roof {bw / 1e9:.1f} GB/s (best large copy or read of "
          f"{format_bytes(big)})")
    for d, f in best.items():
        print(f"compute roof {str(d).replace('torch.', '')}: {f / 1e9:.1f} GFLOP/s -> ridge {f / bw:.1f} FLOP/byte")
    if device.type == "cuda":
        transfers(args.reps)
        key = H.match_gpu_spec(name, torch.cuda.get_device_properties(0).total_memory)
        if key:
            s = H.GPU_SPECS[key]
            print(f"\ndata sheet {key}: measured {bw / s.dram_bandwidth:.0%} of {s.dram_bandwidth / 1e9:,.0f} GB/s, "
                  f"fp16 matmul {best[torch.float16] / s.fp16_tensor:.0%} of {s.fp16_tensor / 1e12:.0f} TFLOP/s, "
                  f"PCIe {s.pcie} theory {H.pcie_bandwidth(int(s.pcie[3])) / 1e9:.1f} GB/s per direction")


if __name__ == "__main__":
    main()
