"""Quantization and QLoRA: error and bits per parameter of weight formats, one QLoRA
step on a tiny Llama measured against the estimator, and 7B fine-tunes on the virtual GPU.

    python benchmarks/bench_quant.py                 # all three parts
    python benchmarks/bench_quant.py --part formats --size 2048
    python benchmarks/bench_quant.py --part step
    python benchmarks/bench_quant.py --part 7b --seqs 512 2048
    python benchmarks/bench_quant.py --part ex07

Prints markdown tables.
  formats  int8 / int4 (absmax and zero-point, blocks of 64), bitsandbytes FP4, NF4 and NF4 with
           double quantization on the same weights: N(0, 0.02^2), Student-t (3 degrees of freedom,
           heavy tails, same std) and normal with 0.01% outliers at 20 sigma. Relative error
           ||w - w_hat|| / ||w||; bits per parameter from the stored tensors (code tables aside).
  step     one QLoRA step (bitsandbytes NF4 + double quantization, peft LoRA r=8, the
           prepare_model_for_kbit_training recipe, torch AdamW, first step) on memlab's tiny Llama on
           the CPU, by category, against memlab.quant.qlora.qlora_bytes (mask_bytes=4: CPU dropout).
  7b       Llama-2-7B shapes on the virtual GPU (fake tensors, 512-byte rounding): one step of full
           fine-tuning in bf16 (AdamW, bf16 state), LoRA on a bf16 base and QLoRA (NF4 stand-in), LoRA
           r=16 alpha=32 dropout 0.05 on q,k,v,o, checkpointing, batch 1; the QLoRA estimator beside.
  ex07     exercise 07 task 7.4's recipe (NF4 projections, everything else and the LoRA adapters on all
           seven projections in bf16, no dropout): the activations memlab's tracker attributes in one
           step (kept at the end of the forward + one recomputed layer), as the grader measures them
           (autograder/checks/ex07/refs.py: the tiny Llama on CPU tensors; 7B/13B on the virtual GPU from
           1- and 2-layer cuts, and once at full depth), against the task text's count.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import memlab  # noqa: E402
from memlab.quant import llama as LL# noqa: E402
from memlab.quant import qlora as QL# noqa: E402
from memlab import quant as Q  # noqa: E402
from memlab.core.models import tiny_llama_config  # noqa: E402

fmt = memlab.format_bytes


def bench_formats(size: int) -> str:
    torch.manual_seed(0)
    normal = torch.randn(size, size) * 0.02
    t = torch.distributions.StudentT(3.0).sample((size, size))
    heavy = t / t.std() * 0.02
    outl = normal.clone()
    k = max(1, normal.numel() // 10_000)
    outl.view(-1)[torch.randperm(normal.numel())[:k]] = 0.4 * torch.randn(k).sign()
    weights = {"normal": normal, "Student-t (3)": heavy, "normal + 0.01% outliers": outl}
    formats = {
        "int8 absmax, per tensor": lambda x: Q.absmax_roundtrip(x, 8),
        "int8 absmax, blocks of 64": lambda x: Q.absmax_roundtrip(x, 8, blocksize=64),
        "int4 absmax, blocks of 64": lambda x: Q.absmax_roundtrip(x, 4, blocksize=64),
        "int4 zero-point, blocks of 64": lambda x: Q.zeropoint_roundtrip(x, 4, blocksize=64),
        "FP4 (bitsandbytes), blocks of 64": lambda x: Q.bnb_roundtrip(x, "fp4"),
        "NF4 (bitsandbytes), blocks of 64": lambda x: Q.bnb_roundtrip(x, "nf4"),
        "NF4 + double quantization": lambda x: Q.bnb_roundtrip(x, "nf4", double_quant=True),
    }
    lines = [f"### Weight formats: relative error on {size} x {size} weights (std 0.02)\n",
             "| format | bits/param | " + " | ".join(weights) + " |", "|---|---:|" + "---:|" * len(weights)]
    for name, f in formats.items():
        rts = {w: f(x) for w, x in weights.items()}
        bits = next(iter(rts.values())).bits_per_param
        lines.append(f"| {name} | {bits:.3f} | " + " | ".join(
            f"{100 * Q.relative_error(weights[w], rt.x_hat):.2f}%" for w, rt in rts.items()) + " |")
    lines.append(f"\nformula: {Q.bits_per_param():.3f} bits without, {Q.bits_per_param(double_quant=True):.4f} "
                 "with double quantization (Dettmers et al. 2023, section 3)")
    return "\n".join(lines)


def _real_qlora(targets, dropout, ckpt, r=8):
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    m = LL.tiny_llama("nf4", dtype=torch.bfloat16)
    m = prepare_model_for_kbit_training(m, use_gradient_checkpointing=ckpt,
                                        gradient_checkpointing_kwargs={"use_reentrant": False})
    return get_peft_model(m, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=dropout, target_modules=list(targets),
                                        task_type="CAUSAL_LM")).train()


def _measure_step(model, batch, seq):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    tr = memlab.MemoryTracker(model, opt)
    out = {}
    with tr:
        memlab.watch(tensors=LL.quant_tensors(model), category="parameters")
        ids = torch.randint(0, 256, (batch, seq))
        with memlab.phase("forward"):
            loss = model(input_ids=ids, labels=ids).loss
        out["activations"] = tr.breakdown()["activations"]
        with memlab.phase("backward"):
            loss.backward()
        out["gradients"] = tr.breakdown()["gradients"]
        del loss
        with memlab.phase("step"):
            opt.step()
        out["parameters"], out["optimizer"] = tr.breakdown()["parameters"], tr.breakdown()["optimizer"]
        opt.zero_grad(set_to_none=True)
    out["peak"] = tr.peak
    return out


def bench_step(batch: int, seq: int) -> str:
    cfg = tiny_llama_config()
    lines = [f"### One QLoRA step on the tiny Llama (CPU, batch {batch} x {seq}): "
             "measured vs memlab.quant.qlora.qlora_bytes\n",
             "| adapters (r=8) | dropout | checkpointing | parameters | gradients | optimizer | activations "
             "| peak measured | peak predicted | predicted - measured | stand-in = real |",
             "|---|---:|---|" + "---:|" * 7 + "---|"]
    for targets, tname in ((QL.ATTENTION, "q,k,v,o"), (QL.PROJECTIONS, "all 7 projections")):
        for dropout in (0.0, 0.05):
            for ckpt in (False, True):
                got = _measure_step(_real_qlora(targets, dropout, ckpt), batch, seq)
                stand = _measure_step(LL.finetune_llama(cfg, "qlora", r=8, targets=targets, lora_dropout=dropout,
                                                        checkpointing=ckpt), batch, seq)
                e = QL.qlora_bytes(cfg, r=8, targets=targets, batch=batch, seq=seq, checkpointing=ckpt,
                                   lora_dropout=dropout, mask_bytes=4)
                exact = "".join(" | " + ("exact" if got[k] == getattr(e, k) else f"{got[k] - getattr(e, k):+,} B")
                                for k in ("parameters", "gradients", "optimizer", "activations"))
                same = all(got[k] == stand[k] for k in got if k != "peak")
                lines.append(f"| {tname} | {dropout} | {'yes' if ckpt else 'no'}{exact} | {fmt(got['peak'])} | "
                             f"{fmt(e.peak)} | {100 * (e.peak - got['peak']) / got['peak']:+.1f}% | "
                             f"{'yes' if same else 'no'}{'' if got['peak'] == stand['peak'] else ' (peak differs)'} |")
    lines.append("\n(parameters ... activations: measured minus predicted; 'exact' = equal to the byte. "
                 "stand-in = real: memlab.quant.llama.finetune_llama's Linear4bitStandIn model against bitsandbytes "
                 "+ peft.)")
    return "\n".join(lines)


def bench_7b(seqs: list[int]) -> str:
    cfg = QL.llama_7b_config()
    gpu = memlab.VirtualGPU("A100-80GB")
    caps = {"T4-16GB": memlab.PRESETS["T4-16GB"].capacity, "L4-24GB": memlab.PRESETS["L4-24GB"].capacity}
    lines = ["### Llama-2-7B shapes on the virtual GPU: one fine-tuning step, batch 1, checkpointing, "
             "LoRA r=16 on q,k,v,o, dropout 0.05\n",
             "| method | seq | peak | phase | parameters | gradients | optimizer | activations | temporaries "
             "| T4-16GB | L4-24GB | QLoRA estimator | fake run (CPU s) |",
             "|---|---:|" + "---:|---|" + "---:|" * 5 + "---|---|---:|---:|"]

    def step(method, seq):
        model = LL.finetune_llama(cfg, method, r=16, targets=QL.ATTENTION, lora_dropout=0.05, checkpointing=True)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        memlab.watch(model, opt)
        LL.causal_lm_step(model, opt, torch.randint(0, cfg.vocab_size, (1, seq)))

    for seq in seqs:
        for method in ("full", "lora", "qlora"):
            t0 = time.process_time()
            run = gpu.run(step, method, seq)
            cpu = time.process_time() - t0
            b = run.peak_breakdown
            est = ""
            if method == "qlora":
                e = QL.qlora_bytes(cfg, r=16, targets=QL.ATTENTION, seq=seq, checkpointing=True, lora_dropout=0.05,
                                   mask_bytes=4)
                est = f"{fmt(e.peak)} ({100 * (e.peak - run.peak) / run.peak:+.1f}%)"
            lines.append(f"| {method} | {seq} | {fmt(run.peak)} | {run.peak_phase} | " +
                         " | ".join(fmt(b[c]) for c in memlab.CATEGORIES) + " | " +
                         " | ".join("fits" if run.peak <= c else "OOM" for c in caps.values()) +
                         f" | {est} | {cpu:.1f} |")
    return "\n".join(lines)


def _task74_count(cfg, r, batch, seq, ckpt):
    """Exercise 07 task 7.4's activation count, as its text states it."""
    C, F, L, H, V = cfg["hidden"], cfg["intermediate"], cfg["layers"], cfg["heads"], cfg["vocab"]
    kv, d, BT = cfg["kv_heads"] * (C // H), C // H, batch * seq
    norm = 4 * C + 4
    layer = BT * (2 * norm + 4 * C + 2 * (C + 2 * kv) + 2 * C + 4 * H + 8 * F + 14 * r)
    outside = BT * (norm + 4 * V + 8) + 4 * seq * d
    return L * 2 * BT * C + 8 * seq + outside + layer if ckpt else L * layer - BT * norm + outside


def bench_ex07() -> str:
    from autograder.checks.ex07 import cases as C, refs as R
    rows = [("tiny (grader's visible config)", C.TINY, 3, 2, 9, False),
            ("tiny (grader's visible config)", C.TINY, 3, 2, 9, True),
            ("7B", C.LLAMA_7B, 16, 1, 2048, False), ("7B", C.LLAMA_7B, 16, 1, 2048, True),
            ("13B", C.LLAMA_13B, 16, 1, 2048, True)]
    lines = ["### Exercise 07 task 7.4: activations of one QLoRA step, measured vs the task text\n",
             "| model | r | batch x seq | checkpointing | how measured | kept | recomputed | measured | task text "
             "| text - measured | CPU s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, cfg, r, b, s, ck in rows:
        runs = [("CPU tensors", lambda: R.measure_tiny(cfg, r, b, s, ck))] if cfg["layers"] <= 3 else [
            ("virtual GPU, 1-/2-layer cuts", lambda: R.measure_virtual(cfg, r, b, s, ck))]
        if name == "7B":
            def full(cfg=cfg, r=r, b=b, s=s, ck=ck):
                out: dict = {}
                memlab.VirtualGPU(capacity_gb=2**20).run(R.activation_step, cfg, r, b, s, ck, out)
                return out
            runs.append(("virtual GPU, full depth", full))
        text = _task74_count(cfg, r, b, s, ck)
        for how, f in runs:
            t0 = time.process_time()
            m = f()
            cpu = time.process_time() - t0
            tot = m["kept"] + m["recomputed"]
            lines.append(f"| {name} | {r} | {b} x {s} | {'yes' if ck else 'no'} | {how} | {m['kept']:,} | "
                         f"{m['recomputed']:,} | {tot:,} ({fmt(tot)}) | {text:,} | {text - tot:+,} "
                         f"({100 * (text - tot) / tot:+.4f}%) | {cpu:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["all", "formats", "step", "7b", "ex07"], default="all")
    p.add_argument("--size", type=int, default=1024, help="formats: the weights are size x size")
    p.add_argument("--batch", type=int, default=4, help="step: batch size")
    p.add_argument("--seq", type=int, default=64, help="step: sequence length")
    p.add_argument("--seqs", type=int, nargs="+", default=[512, 2048], help="7b: sequence lengths")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = p.parse_args(argv)
    for name in ("size", "batch", "seq", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    if args.size % 64 or any(s < 1 for s in args.seqs):
        p.error("--size must be a multiple of 64 and --seqs positive")
    torch.set_num_threads(args.threads)
    LL.silence_libraries()
    import bitsandbytes
    import peft
    import transformers
    print(f"## Quantization and QLoRA (torch {torch.__version__}, bitsandbytes {bitsandbytes.__version__}, "
          f"peft {peft.__version__}, transformers {transformers.__version__})\n")
    if args.part in ("all", "formats"):
        print(bench_formats(args.size), "\n")
    if args.part in ("all", "step"):
        print(bench_step(args.batch, args.seq), "\n")
    if args.part in ("all", "7b"):
        print(bench_7b(args.seqs), "\n")
    if args.part in ("all", "ex07"):
        print(bench_ex07(), "\n")


if __name__ == "__main__":
    main()
