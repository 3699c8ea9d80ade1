"""The `memlab-fit` command line: one plan's verdict (`memlab.fit`), the longest sequence or largest batch that fits
(`memlab.fit_max`), and the cheapest plans that fit (`memlab.fit_search`)."""

from __future__ import annotations

import argparse
import os
import sys

from .config import fit_presets
from .optimizers import trainer_default
from .plan import CHOICES, fit
from .search import HEADROOM, fit_search, format_plans

__all__ = ["main", "HELP"]

HELP = {
    "method": "full: train every weight; lora: frozen base + rank-r adapters (--lora-r); qlora: the same on a 4-bit "
              "NF4 base",
    "precision": "fp32: 4-byte weights, gradients, states; amp: fp32 weights, bf16 autocast; bf16: every state "
                 "in bf16 (pure); fp16: the same bytes in fp16, for GPUs without bf16 tensor cores (T4, V100); "
                 "mixed: bf16 weights and gradients + fp32 master weights (DeepSpeed's bf16); auto: bf16, or fp16 "
                 "on a GPU without bf16",
    "optimizer": "the optimizer as run, its state and step scratch measured: adamw (torch, foreach), adamw_fused, "
                 "adamw_forloop, sgd (no momentum), sgd_momentum, adafactor (transformers', as the HF Trainer "
                 "makes it), adamw8bit and paged_adamw8bit (bitsandbytes); auto: what the Hugging Face Trainer "
                 f"picks on this torch ({trainer_default()})",
    "checkpointing": "none; selective: keep matmul outputs, recompute the rest of each layer; full: keep only "
                     "each layer's input",
    "mode": "train: one optimizer step; inference: a prefill of batch x seq tokens into a KV cache",
    "attention": "sdpa: PyTorch's scaled_dot_product_attention (no T x T matrix kept); eager: the plain matmuls",
}


def main(argv=None) -> int:
    """memlab-fit MODEL --gpu L4-24GB [options] [--search | --no-search]"""
    ap = argparse.ArgumentParser(prog="memlab-fit", description="Will this model train (or serve) on this GPU, "
                                 "and what must I turn on? Runs one step on memlab's virtual GPU.")
    ap.add_argument("model", nargs="?", help="a preset (see --list), a path to a Hugging Face config.json")
    ap.add_argument("--list", action="store_true", help="list the shipped model presets and GPU presets, then exit")
    ap.add_argument("--gpu", default="L4-24GB", help="a card as you would name it (4090, 'RTX 3090', a10g, "
                    "h100-80gb, T4-16GB ...: see --list) or its capacity in GiB (default L4-24GB)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per optimizer step (default 1)")
    ap.add_argument("--seq", type=int, default=512, help="tokens per sequence (default 512); an encoder-decoder's "
                    "source length")
    ap.add_argument("--target-seq", type=int, default=None,
                    help="an encoder-decoder's target length (labels and decoder input; default: --seq)")
    for opt in ("method", "precision", "optimizer", "checkpointing", "mode", "attention"):
        default = dict(method="full", precision="auto", optimizer="auto", checkpointing="none", mode="train",
                       attention="sdpa")[opt]
        choices = CHOICES[opt] + (("auto",) if opt in ("precision", "optimizer") else ())
        ap.add_argument(f"--{opt}", choices=choices, default=default, help=f"{HELP[opt]} (default {default})")
    ap.add_argument("--zero", type=int, choices=CHOICES["zero"], default=0,
                    help="ZeRO stage on --gpus data-parallel ranks: 1 shards optimizer states, 2 also gradients, "
                         "3 also weights (default 0)")
    ap.add_argument("--gpus", type=int, default=1, help="data-parallel GPUs (default 1)")
    ap.add_argument("--micro-batch", type=int, default=None,
                    help="gradient accumulation: micro-batches of this many sequences (must divide --batch)")
    ap.add_argument("--offload", action="store_true",
                    help="ZeRO-Offload: optimizer states, fp32 masters and the step on the CPU (needs --zero >= 1)")
    ap.add_argument("--lora-r", type=int, default=16, help="LoRA rank (default 16)")
    ap.add_argument("--loss", choices=CHOICES["loss"], default="full",
                    help="full: the model's own loss over the whole (batch, seq, vocab) logits in fp32; chunked: the "
                         "output head and its fp32 upcast one eighth of the sequence at a time, as torchtune's "
                         "CEWithChunkedOutputLoss (default full)")
    ap.add_argument("--step-in-backward", action="store_true",
                    help="apply each parameter's optimizer step in the backward pass and free its gradient at once "
                         "(torchtune's optimizer_in_bwd; no gradient accumulation, no ZeRO)")
    ap.add_argument("--paged", action="store_true",
                    help="bitsandbytes' paged optimizer state (PagedAdamW, PagedAdamW8bit): evicted to the host when "
                         "the card is full, so not counted against it; its PCIe traffic is counted in the cost")
    ap.add_argument("--activation-offload", action="store_true",
                    help="copy what the forward saves for the backward to the host and bring it back when the "
                         "backward needs it (torchtune's enable_activation_offloading); its PCIe traffic is counted")
    ap.add_argument("--qlora-rest", choices=CHOICES["qlora_rest"], default="fp32",
                    help="with --method qlora: the dtype of the parts not quantized (embeddings, norms, head): fp32 "
                         "as peft's prepare_model_for_kbit_training leaves them, or 16bit as the QLoRA authors' "
                         "script casts them (default fp32)")
    ap.add_argument("--context", type=float, default=None, metavar="MIB",
                    help="MiB your process holds on the card outside its tensors (CUDA context, cuBLAS workspaces), "
                         "as measured on your card: total_memory - torch.cuda.mem_get_info()[0] - "
                         "torch.cuda.memory_reserved() after a first matmul (default: a recording of the card, else "
                         "the cited 0.4 GiB + workspaces)")
    ap.add_argument("--headroom", type=float, default=HEADROOM,
                    help="share of the GPU kept free for the CUDA context and fragmentation (default 0.05)")
    from .run import cache_folder
    kept = cache_folder()
    ap.add_argument("--no-cache", action="store_true",
                    help="measure every step afresh and keep nothing. By default each measured step is kept in "
                         f"{kept if kept else '(none: MEMLAB_FIT_CACHE is set empty)'} (MEMLAB_FIT_CACHE names "
                         "another folder; default $XDG_CACHE_HOME/memlab/fit, else ~/.cache/memlab/fit), so a "
                         "question asked before is answered without running it again")
    limit = ap.add_mutually_exclusive_group()
    limit.add_argument("--max-seq", action="store_true",
                       help="find the longest sequence that fits the plan (--seq is ignored): the bytes at the limit "
                            "and what one more token would need")
    limit.add_argument("--max-batch", action="store_true",
                       help="find the largest batch (no gradient accumulation) that fits the plan at --seq")
    search = ap.add_mutually_exclusive_group()
    search.add_argument("--search", action="store_true", help="also list the cheapest combinations that fit")
    search.add_argument("--no-search", action="store_true",
                        help="never search, even when the plan does not fit (a search runs many steps: minutes)")
    args = ap.parse_args(argv)
    if args.list:
        from ..core.gpus import PRESETS
        print("models:", ", ".join(fit_presets()))
        print("GPUs:  ", ", ".join(PRESETS), "(any spelling: 4090, rtx4090, 'RTX 4090', h100-80gb; or a capacity "
              "in GiB)")
        return 0
    if args.model is None:
        print("memlab-fit: error: give a MODEL (a preset, see --list, or a path to a config.json)", file=sys.stderr)
        return 2
    if args.no_cache:
        os.environ["MEMLAB_FIT_CACHE"] = ""          # this process keeps nothing on disk (memlab.fitting.run)
    gpu = args.gpu
    options = dict(method=args.method, precision=args.precision, optimizer=args.optimizer,
                   checkpointing=args.checkpointing, zero=args.zero, gpus=args.gpus, mode=args.mode,
                   micro_batch=args.micro_batch, offload=args.offload, attention=args.attention, lora_r=args.lora_r,
                   qlora_rest=args.qlora_rest, loss=args.loss, step_in_backward=args.step_in_backward,
                   paged=args.paged, activation_offload=args.activation_offload, target_seq=args.target_seq,
                   headroom=args.headroom)
    if args.context is not None:
        if not args.context >= 0:
            print(f"memlab-fit: error: --context must be MiB >= 0, got {args.context}", file=sys.stderr)
            return 2
        options["context"] = int(args.context * 2**20)
    try:
        if args.max_seq or args.max_batch:
            from .limits import fit_max
            what = "seq" if args.max_seq else "batch"
            other = {"batch": args.batch} if what == "seq" else {"seq": args.seq}
            print(fit_max(args.model, gpu, what=what, **other, **options), flush=True)
            return 0
        r = fit(args.model, gpu, batch=args.batch, seq=args.seq, **options)
        print(r, flush=True)
        if args.search or (not r.fits and not args.no_search):
            print(f"\nsearching the cheapest combinations that fit (each new step takes about {r.seconds:.0f} s "
                  f"here; --no-search skips this)...", flush=True)
            plans = fit_search(args.model, gpu, batch=args.batch, seq=args.seq, mode=args.mode,
                               precision=args.precision, gpus=sorted({1, args.gpus}), attention=args.attention,
                               lora_r=args.lora_r, target_seq=args.target_seq, headroom=args.headroom,
                               context=options.get("context"),
                               progress=lambda line: print("  " + line, flush=True))
            print("cheapest combinations that fit (full fine-tuning first, then LoRA, QLoRA; fewer GPUs first):")
            print(format_plans(plans))
    except (ValueError, TypeError) as e:
        print(f"memlab-fit: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
