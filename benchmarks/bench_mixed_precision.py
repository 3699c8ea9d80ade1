"""Peak memory and step time of memlab's small GPT in fp32, fp16 + GradScaler and bf16 autocast.

    python benchmarks/bench_mixed_precision.py                 # CPU, and CUDA too when available
    python benchmarks/bench_mixed_precision.py --device cpu --steps 20

Prints a markdown table per device. Peak memory is memlab.MemoryTracker's exact
count of tensor bytes in one training step (AdamW, optimizer state already
created), split into model states (parameters + gradients + optimizer) and
activations; on CUDA the caching allocator's max_memory_allocated is shown beside
it. Step time is the median of timed steps after warm-up (CUDA synchronised).
Lesson 03 explains the figures: autocast shrinks activations only, and 16-bit
speed needs tensor cores (GPU) or native 16-bit instructions (CPU).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import memlab
from memlab.core.models import GPT, GPTConfig, train_step

# per-device defaults: small enough for a laptop CPU, big enough to keep a GPU busy
DEFAULTS = {"cpu": dict(n_layer=2, n_embd=128, batch=8, seq=64, steps=10, warmup=2),
            "cuda": dict(n_layer=4, n_embd=256, batch=32, seq=256, steps=50, warmup=5)}


def modes(device: torch.device) -> dict[str, torch.dtype | None]:
    out = {"fp32": None, "fp16 + GradScaler": torch.float16}
    if device.type == "cpu" or torch.cuda.is_bf16_supported():
        out["bf16 autocast"] = torch.bfloat16
    return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Run:
    """One precision mode: its own model (same seed), optimizer, scaler and batch stream."""

    def __init__(self, device: torch.device, dtype: torch.dtype | None, cfg: GPTConfig, batch: int, seq: int,
                 seed: int = 0):
        torch.manual_seed(seed)
        self.device, self.dtype, self.cfg, self.batch, self.seq = device, dtype, cfg, batch, seq
        self.model = GPT(cfg).to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.scaler = torch.amp.GradScaler(device.type) if dtype == torch.float16 else None
        self.gen = torch.Generator().manual_seed(seed)
        self.times: list[float] = []

    def next_batch(self):
        x = torch.randint(0, self.cfg.vocab_size, (self.batch, self.seq), generator=self.gen).to(self.device)
        return x, torch.roll(x, -1, dims=1)

    def step(self, timed: bool) -> None:
        x, y = self.next_batch()
        sync(self.device)
        t0 = time.perf_counter()
        train_step(self.model, self.opt, x, y, autocast_dtype=self.dtype, scaler=self.scaler)
        sync(self.device)
        if timed:
            self.times.append(time.perf_counter() - t0)

    def measure(self) -> dict:
        x, y = self.next_batch()
        tracker = memlab.MemoryTracker(self.model, self.opt)
        with tracker:
            train_step(self.model, self.opt, x, y, autocast_dtype=self.dtype, scaler=self.scaler)
        bd = tracker.peak_breakdown
        return {"peak": tracker.peak, "states": bd["parameters"] + bd["gradients"] + bd["optimizer"],
                "activations": bd["activations"], "phase": tracker.peak_phase,
                "cuda_max": tracker.cuda_stats.get("max_allocated"), "ms": 1e3 * statistics.median(self.times)}


def bench_device(device: torch.device, args) -> str:
    d = dict(DEFAULTS[device.type])
    for k in d:
        if getattr(args, k) is not None:
            d[k] = getattr(args, k)
    cfg = GPTConfig.tiny(n_layer=d["n_layer"], n_embd=d["n_embd"], block_size=max(d["seq"], 16))
    n = sum(p.numel() for p in GPT(cfg).parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, " \
        f"{torch.backends.cpu.get_cpu_capability()}"
    runs = {label: Run(device, dtype, cfg, d["batch"], d["seq"]) for label, dtype in modes(device).items()}
    for run in runs.values():
        for _ in range(d["warmup"]):               # creates Adam's state, warms kernels and caches
            run.step(timed=False)
    for _ in range(d["steps"]):                    # round robin: a load spike hits every mode alike
        for run in runs.values():
            run.step(timed=True)
    lines = [f"### {device.type}: {name}", "",
             f"GPT n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, {n:,} parameters; batch {d['batch']} x {d['seq']} "
             f"tokens; AdamW; median of {d['steps']} steps (modes interleaved) after {d['warmup']} warm-up; "
             f"torch {torch.__version__}", "",
             "| mode | peak (tracker) | model states | activations | peak phase | CUDA max allocated | ms/step "
             "| speedup |",
             "|---|---|---|---|---|---|---|---|"]
    rows = {label: run.measure() for label, run in runs.items()}
    for label, r in rows.items():
        cuda = memlab.format_bytes(r["cuda_max"]) if r["cuda_max"] is not None else "n/a"
        lines.append(f"| {label} | {memlab.format_bytes(r['peak'])} | {memlab.format_bytes(r['states'])} | "
                     f"{memlab.format_bytes(r['activations'])} | {r['phase']} | {cuda} | {r['ms']:.1f} | "
                     f"{rows['fp32']['ms'] / r['ms']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: the CPU, and CUDA too when available")
    p.add_argument("--n-layer", dest="n_layer", type=int, default=None)
    p.add_argument("--n-embd", dest="n_embd", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per mode")
    args = p.parse_args(argv)
    for k in ("n_layer", "n_embd", "batch", "seq", "steps"):
        v = getattr(args, k)
        if v is not None and v < 1:
            p.error(f"--{k.replace('_', '-')} must be >= 1, got {v}")
    if args.warmup is not None and args.warmup < 1:
        p.error("--warmup must be >= 1 (the first step creates the optimizer state)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available on this machine")
    devices = {"cpu": ["cpu"], "cuda": ["cuda"], "auto": ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])}
    print("## Mixed precision: peak memory and step time\n")
    for dev in devices[args.device]:
        print(bench_device(torch.device(dev), args))
        print()


if __name__ == "__main__":
    main()
