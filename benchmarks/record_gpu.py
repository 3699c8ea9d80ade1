"""Record the GPU-only experiments of lessons 01-04 on a CUDA GPU, so that
learners without one can see real numbers (clearly labelled as recorded).

    python benchmarks/record_gpu.py [--out DIR] [--no-batch-search]

Runs, in this order (the first two must see a fresh process):
  context        device memory in use after CUDA starts, before any tensor: the CUDA context
  cublas         what the first matmul adds (cuBLAS handle and workspace)
  rounding       the caching allocator's rounding of single requests, and the segment it takes
  segments       lesson 01: 1000 small tensors, 6 MiB tensors, holes, a 20 MiB request, empty_cache
  step           lesson 01: a GPT step, memlab's tracker vs the allocator's max allocated / reserved
  fragmentation  lesson 04: freed 5 MiB holes between live blocks cannot serve an 8 MiB request
  empty_cache    lesson 04: del lowers allocated; empty_cache() then lowers reserved
  snapshot       lesson 04: a memory snapshot of three steps, for https://pytorch.org/memory_viz
  matmul         lesson 03: 4096^3 matmul time in fp32, TF32, fp16 and bf16 (tensor cores)
  oom            lesson 04: the largest GPT-2 small batch (T=1024, AdamW) by real OOMs, the recovery
                 after each, and the virtual GPU's answer for the same free memory

It writes memlab/hardware/recordings/<gpu>.json (GPU name, driver, CUDA, torch, date, the command) and
<gpu>.snapshot.pickle beside it; memlab.hardware.recorded loads them. Without CUDA it refuses and writes nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import pickle
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import memlab  # noqa: E402
import memlab.core.estimate as E  # noqa: E402
from memlab.core.models import GPT, GPTConfig, train_step  # noqa: E402
from memlab.hardware.recorded import DIR, SCHEMA, file_stem  # noqa: E402

MiB, GiB = 2**20, 2**30
REFUSAL = ("record_gpu.py needs a CUDA GPU and torch.cuda.is_available() is False here (torch {torch}, "
           "CUDA build: {cuda}). Run it on a machine with an NVIDIA GPU (a Colab GPU runtime will do); "
           "nothing was written.")


def mem(what: str) -> dict:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"what": what, "allocated_bytes": torch.cuda.memory_allocated(),
            "reserved_bytes": torch.cuda.memory_reserved(), "device_used_bytes": total - free}


def fresh() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def nvml_used() -> int | None:
    """Device memory in use by every process (NVML), read without creating a CUDA context; None without
    pynvml (the nvidia-ml-py package)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(first) if first.isdigit() else 0)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except Exception:
        return None


def driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


# ----------------------------------------------------------------------------- experiments
def exp_context(before: int | None) -> dict:
    steps = [mem("CUDA context created (mem_get_info)")]
    x = torch.zeros(1, device="cuda")                                # 4 B, in a 2 MiB small-pool segment
    steps.append(mem("first tensor (4 bytes)"))
    del x
    return {"nvml_used_before_bytes": before, "steps": steps,
            "note": "device_used includes other processes on this GPU; record on an idle GPU. "
                    "device_used - reserved = CUDA context, loaded kernels and libraries (outside PyTorch's allocator)"}


def exp_cublas() -> dict:
    a, b = torch.randn(64, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    steps = [mem("before the first matmul")]
    c = a @ b
    del c
    steps.append(mem("after the first fp32 matmul (output freed)"))
    c = a.half() @ b.half()
    del c
    steps.append(mem("after the first fp16 matmul (output freed)"))
    return {"steps": steps, "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "note": "the growth of allocated/reserved here is cuBLAS's workspace, taken from PyTorch's allocator; "
                    "the rest of device_used's growth is the cuBLAS handle and its kernels"}


def exp_rounding() -> dict:
    rows = []
    for n in (1, 400, 512, 513, 1 * MiB, 1 * MiB + 1, 10 * MiB + 1, 30 * MiB):
        fresh()
        a0, r0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        t = torch.empty(n, dtype=torch.uint8, device="cuda")
        rows.append({"request_bytes": n, "allocated_bytes": torch.cuda.memory_allocated() - a0,
                     "reserved_bytes": torch.cuda.memory_reserved() - r0})
        del t
    return {"rows": rows, "note": "allocated = the block (rounded request); reserved = the segment taken from CUDA"}


def exp_segments() -> dict:                        # lesson 01, "the caching allocator"
    fresh()
    steps = [mem("start")]
    small = [torch.empty(100, device="cuda") for _ in range(1000)]      # 400 B each -> 512 B blocks
    steps.append(mem("1000 tensors of 400 bytes"))
    big = [torch.empty(6 * MiB, device="cuda", dtype=torch.uint8) for _ in range(8)]
    steps.append(mem("+ 8 tensors of 6 MiB"))
    del big[::2]
    steps.append(mem("freed every other 6 MiB tensor"))
    try_big = torch.empty(20 * MiB, device="cuda", dtype=torch.uint8)
    steps.append(mem("+ one 20 MiB tensor (new segment needed)"))
    segs = [{"pool": s["segment_type"], "size_bytes": s["total_size"], "allocated_bytes": s["allocated_size"]}
            for s in torch.cuda.memory_snapshot()]
    del small, big, try_big
    steps.append(mem("everything deleted (cache kept)"))
    torch.cuda.empty_cache()
    steps.append(mem("after empty_cache()"))
    return {"steps": steps, "segments_at_peak": segs}


def exp_step() -> dict:                            # lesson 01, predict / measure / explain on CUDA
    fresh()
    cfg, B, T = GPTConfig.gpt2_small(n_layer=4, block_size=512), 8, 512
    torch.manual_seed(0)
    model = GPT(cfg).to("cuda")
    opt = torch.optim.Adam(model.parameters(), lr=3e-4, foreach=True)
    x = torch.randint(0, cfg.vocab_size, (B, T), device="cuda")
    train_step(model, opt, x, x)                   # step 1 creates Adam's state
    tracker = memlab.MemoryTracker(model, opt)
    with tracker:
        train_step(model, opt, x, x)
    out = {"model": "GPT-2 small shapes, 4 layers, block 512", "batch": B, "seq": T, "optimizer": "Adam foreach",
           "tracker_peak_bytes": tracker.peak, "tracker_peak_phase": tracker.peak_phase,
           "max_allocated_bytes": tracker.cuda_stats["max_allocated"],
           "max_reserved_bytes": tracker.cuda_stats["max_reserved"]}
    try:
        out["predicted_peak_bytes"] = E.gpt_peak_bytes(cfg, B, T, optimizer="adam", foreach=True).peak
    except Exception as e:                         # the estimator's signature may have moved on
        out["predicted_peak_bytes"] = None
        out["prediction_error"] = f"{type(e).__name__}: {e}"
    return out


def exp_fragmentation() -> dict:                   # lesson 04
    fresh()
    blocks = [torch.empty(5 * MiB, dtype=torch.uint8, device="cuda") for _ in range(8)]
    steps = [mem("8 blocks of 5 MiB")]
    del blocks[::2]
    steps.append(mem("freed every other block"))
    torch.cuda.empty_cache()
    steps.append(mem("empty_cache()"))
    big = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    steps.append(mem("then asked for 8 MiB"))
    del blocks, big
    fresh()
    steps.append(mem("after del + empty_cache()"))
    return {"steps": steps}


def exp_empty_cache() -> dict:                     # lesson 04
    fresh()
    steps = [mem("start")]
    big = torch.randn(64, MiB // 4, device="cuda")  # 64 MiB
    steps.append(mem("64 MiB tensor"))
    del big
    steps.append(mem("del: allocated drops, reserved stays (cached)"))
    torch.cuda.empty_cache()
    steps.append(mem("empty_cache()"))
    return {"steps": steps}


def _shorten_paths(obj):
    """Make a snapshot's stack frames say site-packages/... and <repo>/... instead of this machine's paths."""
    if isinstance(obj, dict):
        return {k: (_short(v) if k == "filename" and isinstance(v, str) else _shorten_paths(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_shorten_paths(v) for v in obj]
    return obj


def _short(path: str) -> str:
    if "site-packages/" in path:
        return "site-packages/" + path.split("site-packages/", 1)[1]
    return path.replace(str(ROOT), "<repo>")


def exp_snapshot(out: Path) -> dict:               # lesson 04
    fresh()
    cfg, T = GPTConfig.tiny(n_layer=2, n_embd=64), 64
    # Python frames, at allocations only: a small file
    torch.cuda.memory._record_memory_history(context="alloc", stacks="python", max_entries=100_000)
    try:
        model = GPT(cfg).to("cuda")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            xs = torch.randint(0, cfg.vocab_size, (16, T), device="cuda")
            train_step(model, opt, xs, xs)
        torch.cuda.memory._dump_snapshot(str(out))
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)     # stop recording, whatever happened
    summary = torch.cuda.memory_summary(abbreviated=True)
    snap = _shorten_paths(pickle.loads(out.read_bytes()))
    out.write_bytes(pickle.dumps(snap))
    return {"file": out.name, "file_bytes": out.stat().st_size, "model": "GPT tiny, 2 layers, width 64",
            "batch": 16, "seq": T, "steps_recorded": 3, "memory_summary": summary,
            "open_with": "https://pytorch.org/memory_viz (drag the file onto the page)"}


def _ms(fn, reps=10) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def exp_matmul() -> dict:                          # lesson 03
    fresh()
    n = 4096
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    exact = a.double() @ b.double()
    old = torch.backends.cuda.matmul.allow_tf32
    rows = []
    try:
        for label, dtype, tf32 in (("fp32", torch.float32, False), ("tf32", torch.float32, True),
                                   ("fp16", torch.float16, False), ("bf16", torch.bfloat16, False)):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            x, y = a.to(dtype), b.to(dtype)
            ms = _ms(lambda: x @ y)
            err = ((x @ y).double() - exact).abs().max().item() / exact.abs().max().item()
            rows.append({"format": label, "ms": round(ms, 4), "tflops": round(2 * n**3 / (ms * 1e-3) / 1e12, 2),
                         "max_rel_error": float(f"{err:.3g}")})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return {"shape": [n, n, n], "rows": rows, "timing": "median of 10 after one warm-up, synchronized"}


def _two_steps(cfg, batch, seq, on_virtual):
    model = GPT(cfg) if on_virtual else GPT(cfg).to("cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=True)
    memlab.watch(model, opt)
    for _ in range(2):
        x = torch.randint(0, cfg.vocab_size, (batch, seq), device=None if on_virtual else "cuda")
        train_step(model, opt, x, x)


def exp_oom(search: bool) -> dict:                 # lesson 04: real OOMs, recovery, the virtual GPU
    cfg, seq = GPTConfig.gpt2_small(), 1024
    fresh()
    base = mem("before the search")
    free, total = torch.cuda.mem_get_info()
    first_oom: dict = {}

    def fits(b: int) -> bool:
        try:
            _two_steps(cfg, b, seq, on_virtual=False)
            ok = True
        except torch.OutOfMemoryError as e:
            if not first_oom:
                first_oom.update(batch=b, message=str(e).splitlines()[0][:400],
                                 in_handler=mem("inside the except block (traceback pins tensors)"))
            ok = False                              # the exception is dropped here, with its traceback
        fresh()
        if not ok and "after_cleanup" not in first_oom:
            first_oom["after_cleanup"] = mem("after leaving the handler, gc.collect(), empty_cache()")
        return ok

    def largest(ok) -> int:
        hi = 1
        while ok(hi):                               # double until it fails, then bisect
            hi *= 2
        lo = hi // 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo

    out = {"model": "GPT-2 small, T=1024, AdamW foreach, two steps", "free_bytes": free, "total_bytes": total,
           "baseline": base}
    if search:
        out["largest_batch_real"] = largest(fits)
        out["first_oom"] = first_oom
        gpu = memlab.VirtualGPU(capacity_gb=free / GiB)
        out["largest_batch_virtual"] = largest(lambda b: gpu.fits(_two_steps, cfg, b, seq, True))
    else:                                           # one certain OOM: far more than the free memory
        fits(int(free // (200 * MiB)) + 1)          # its (B, T, V) fp32 logits alone exceed the free memory
        out["first_oom"] = first_oom
    return out


# ----------------------------------------------------------------------------- the file
def metadata(argv: list[str]) -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {"gpu": props.name, "total_memory_bytes": int(props.total_memory),
            "compute_capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count,
            "driver": driver_version(), "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "torch": torch.__version__, "python": platform.python_version(), "memlab": memlab.__version__,
            "commit": commit, "colab": memlab.on_colab(),
            "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(["python", "benchmarks/record_gpu.py", *argv]),
            "env": {k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF",
                                                   "CUBLAS_WORKSPACE_CONFIG", "CUDA_MODULE_LOADING")}}


def write_recording(meta: dict, experiments: dict, out_dir: Path) -> Path:
    """Write one recording: out_dir/<gpu>.json. Returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{file_stem(meta['gpu'])}.json"
    path.write_text(json.dumps({"schema": SCHEMA, "meta": meta, "experiments": experiments}, indent=1) + "\n")
    return path


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DIR, help=f"folder for the recording (default {DIR})")
    ap.add_argument("--no-batch-search", action="store_true", help="skip the largest-batch search (one OOM only)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(REFUSAL.format(torch=torch.__version__, cuda=torch.version.cuda or "none, CPU-only"), file=sys.stderr)
        return 2
    before = nvml_used()                            # first, before anything creates the CUDA context
    meta = metadata(argv)
    snap = args.out / f"{file_stem(meta['gpu'])}.snapshot.pickle"
    args.out.mkdir(parents=True, exist_ok=True)
    plan = [("context", lambda: exp_context(before)), ("cublas", exp_cublas), ("rounding", exp_rounding),
            ("segments", exp_segments), ("step", exp_step), ("fragmentation", exp_fragmentation),
            ("empty_cache", exp_empty_cache), ("snapshot", lambda: exp_snapshot(snap)), ("matmul", exp_matmul),
            ("oom", lambda: exp_oom(not args.no_batch_search))]
    experiments, failed = {}, []
    for name, fn in plan:
        t0 = time.time()
        print(f"{name:<14}", end=" ", flush=True)
        try:
            experiments[name] = fn()
            print(f"done in {time.time() - t0:.1f} s", flush=True)
        except Exception as e:                      # record the failure and go on with the others
            experiments[name] = {"error": f"{type(e).__name__}: {e}"}
            failed.append(name)
            print("FAILED\n" + traceback.format_exc(), flush=True)
    path = write_recording(meta, experiments, args.out)
    print(f"wrote {path}" + (f" and {snap.name}" if snap.exists() else ""))
    print(memlab.hardware.recorded.Recording.from_file(path).show())
    if failed:
        print(f"experiments that failed (recorded as errors): {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
