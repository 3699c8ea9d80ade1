"""Published peak-memory figures of real GPU runs, with their sources and settings, and fit's prediction for each
(`fit_row`). `python benchmarks/bench_fit_published.py` prints them all (benchmarks/fit_published.md); lesson 08
sets torchtune's three single-GPU Llama-3.1-8B rows beside its ladder.

Each row: (kind, source, what was run, published figure, model, gpu, fit's options, what fit cannot express or
differs in). Kinds: "peak" (a run's published peak in GiB against fit's allocated peak), "states" (a published
output of DeepSpeed's model-state estimator against fit's model_states), "fits" (a published "this trained on that
card"), "used" (the device memory in use that nvidia-smi / NVML showed after training, in GiB, against fit's
`reserved_cached` + the CUDA context measured on that machine), "maxseq" (a published longest sequence that trained,
in tokens, against `fit_max`), "speed" (published training tokens per second against the most fit's lower bound on
the step's time allows, `step_bound`).
"""

from __future__ import annotations

__all__ = ["ROWS", "fit_row", "step_bound", "RTX4090"]

GiB = 2**30
TT = "torchtune README"
TT_PERF = (f"{TT} at commit 30b8519 (2024-09-24), 'Memory and training speed' (batch 2, dataset packed to 2048, "
           "torch.compile on, no gradient accumulation); config")

# LLaMA-65B (Touvron et al. 2023, Table 2: dim 8192, 64 heads, 80 layers; Hugging Face's LlamaConfig of it:
# intermediate_size 22016, vocab 32000), the base of the QLoRA paper's Guanaco 65B
LLAMA_65B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 8192,
             "intermediate_size": 22016, "num_attention_heads": 64, "num_key_value_heads": 64,
             "num_hidden_layers": 80, "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
             "hidden_act": "silu", "tie_word_embeddings": False}
# the DeepSpeed ZeRO-Offload tutorial's 10B GPT-2 (Megatron-LM flags --num-layers 50 --hidden-size 4096
# --num-attention-heads 32; GPT-2's 1024 positions; Megatron pads the 50257-word vocabulary to a multiple of 128)
GPT2_10B = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 4096, "n_layer": 50, "n_head": 32,
            "n_positions": 1024, "vocab_size": 50304, "activation_function": "gelu_new"}

# (kind, source, what was run, published GiB, model, gpu, fit's options, what fit cannot express or differs in)
ROWS = [
    ("peak", f"{TT_PERF} llama3_1/8B_qlora_single_device",
     "Llama 3.1 8B QLoRA, 1x RTX 4090, batch 2 x 2048 packed, bf16, LoRA r=8 on q,k,v,o and the MLP, "
     "activation checkpointing, chunked cross-entropy, torch.compile",
     7.4, "llama-3.1-8b", "RTX4090-24GB",
     dict(method="qlora", lora_r=8, precision="bf16", qlora_rest="16bit", loss="chunked", checkpointing="full",
          batch=2, seq=2048),
     "torch.compile (fit runs eager: the chunked loss keeps every chunk's fp32 log-probabilities for the backward, "
     "2 x 2047 x 128256 x 4 B = 1.96 GiB; compiled, the saved tensors are chosen by the compiler); adapters and "
     "their Adam state fp32 in fit, bf16 in torchtune"),
    ("peak", f"{TT_PERF} llama3_1/8B_lora_single_device",
     "Llama 3.1 8B LoRA, 1x RTX 4090, batch 2 x 2048 packed, bf16, LoRA r=8 on q and v only, activation "
     "checkpointing, chunked cross-entropy, fused AdamW, torch.compile",
     16.2, "llama-3.1-8b", "RTX4090-24GB",
     dict(method="lora", lora_r=8, precision="bf16", loss="chunked", checkpointing="full", batch=2, seq=2048),
     "torch.compile (as in the QLoRA row); fit's adapters are on every linear layer (21.0M parameters, fp32 with "
     "fp32 Adam state: 0.31 GiB), torchtune's on q and v only (3.4M, bf16)"),
    ("peak", f"{TT_PERF} llama3_1/8B_full_single_device",
     "Llama 3.1 8B full fine-tune, 1x RTX 4090, batch 2 x 2048 packed, bf16, bitsandbytes PagedAdamW8bit, optimizer "
     "step in backward, activation checkpointing, chunked cross-entropy, torch.compile",
     18.9, "llama-3.1-8b", "RTX4090-24GB",
     dict(method="full", precision="bf16", optimizer="adamw8bit", loss="chunked", checkpointing="full", batch=2,
          seq=2048, step_in_backward=True, paged=True),
     "torch.compile; paged state counted wholly off the card (bitsandbytes pages tensors of >= 1e5 values: the "
     "norms' small state stays)"),
    ("peak", f"{TT_PERF} llama3_1/70B_lora",
     "Llama 3.1 70B LoRA, 8x A100 (FSDP: weights, gradients and optimizer state sharded), batch 2 x 2048 packed, "
     "bf16, LoRA r=16 on q, k, v, activation checkpointing, chunked cross-entropy, fused AdamW, torch.compile",
     27.6, "llama-3.1-70b", "A100-80GB",
     dict(method="lora", lora_r=16, precision="bf16", loss="chunked", checkpointing="full", batch=2, seq=2048,
          zero=3, gpus=8),
     "torch.compile; FSDP2 gathers one layer at a time (fit's ZeRO-3: one decoder layer gathered in forward and "
     "backward); fit's adapters on every linear layer (207M parameters), torchtune's on q, k, v"),
    ("peak", f"{TT} at commit 1814feb (2024-11-18), 'Optimization flags', row '+ Packed Dataset' (peak memory "
     "active); recipe full_finetune_single_device",
     "Llama 3.2 3B full fine-tune, 1x A100, batch 2 x 4096 packed, bf16 (weights, gradients, AdamW state), no "
     "activation checkpointing, no compile, plain cross-entropy on the whole fp32 logits",
     60.0, "llama-3.2-3b", "A100-80GB",
     dict(method="full", precision="bf16", optimizer="adamw", loss="full", checkpointing="none", batch=2, seq=4096),
     "the packed batch's attention mask (flex attention's block mask, a few MiB); the peak is in the backward, "
     "where foreach or fused AdamW does not matter"),
    ("peak", "PEFT README (huggingface/peft), 'High performance on consumer hardware' table, bigscience/bloomz-7b1, "
     "column 'PEFT-LoRA PyTorch'; settings from examples/causal_language_modeling/"
     "peft_lora_clm_accelerate_ds_zero3_offload.py (max_memory_allocated)",
     "BLOOMZ 7B1 LoRA, 1x A100 80GB, batch 8 x 64 (every row padded to 64), fp32 weights, LoRA r=8 on "
     "query_key_value, lora_dropout 0.1, torch AdamW, no checkpointing",
     32.0, "bloomz-7b1", "A100-80GB",
     dict(method="lora", lora_r=8, precision="fp32", optimizer="adamw", batch=8, seq=64),
     "the README gives '32GB' (2 significant figures; the script prints MiB, so read as GiB); fit's adapters "
     "on every linear layer (15.7M parameters), peft's default for BLOOM is query_key_value (3.9M); no dropout "
     "masks in fit"),
    ("states", "DeepSpeed docs, 'Memory Requirements' (docs/code-docs/source/memory.rst): "
     "estimate_zero2_model_states_mem_needs_all_live(AutoModel t5-3b, num_gpus_per_node=8), row "
     "'offload_optimizer=cpu'",
     "T5-3B (2851M parameters), ZeRO-2, 8 GPUs, optimizer offloaded to the CPU: model states per GPU",
     5.31, "t5-3b", "A100-80GB",
     dict(precision="mixed", zero=2, gpus=8, offload=True, batch=1, seq=128),
     "exact by construction: DeepSpeed counts 2 bytes per parameter on the GPU (the 16-bit weights; "
     "deepspeed/runtime/zero/stage_1_and_2.py, estimate_zero2_model_states_mem_needs), fit's model states after "
     "the step are the same weights"),
    ("fits", "QLoRA paper (Dettmers et al. 2023, arXiv 2305.14314), abstract: 'finetune a 65B parameter model on a "
     "single 48GB GPU'; settings of scripts/finetune_guanaco_65b.sh (artidoro/qlora) and qlora.py's default "
     "optimizer paged_adamw_32bit",
     "LLaMA 65B QLoRA, one 48 GB GPU, batch 4 x up to 528 tokens (source 16 + target 512), NF4 double-quantized, "
     "bf16, LoRA r=64 on every linear layer, gradient checkpointing, paged AdamW",
     48e9 / GiB, LLAMA_65B, 48e9 / GiB,
     dict(method="qlora", lora_r=64, precision="bf16", qlora_rest="16bit", optimizer="adamw", paged=True,
          checkpointing="full", batch=4, seq=528),
     "the paper's batches vary in length (group_by_length); fit runs every row at the longest, 528 tokens"),
    ("fits", "DeepSpeed ZeRO-Offload tutorial (deepspeed.ai/tutorials/zero-offload): a 10B GPT-2 on one V100 "
     "32GB; its nvidia-smi screenshot shows 32290 MiB of 32480 MiB used (the allocator caches what it can)",
     "GPT-2 10B (Megatron-LM: 50 layers, hidden 4096, 32 heads), 1x V100 32GB, batch 10 x 1024, fp16 with fp32 "
     "masters, ZeRO-2 with the optimizer on the CPU, activation checkpointing",
     32480 / 1024, GPT2_10B, 32480 / 1024,
     dict(precision="mixed", zero=2, offload=True, checkpointing="full", batch=10, seq=1024),
     "the tutorial does not restate --seq-length (1024 assumed, GPT-2's context); DeepSpeed's contiguous "
     "gradient buffer and Megatron's fused kernels are not modelled"),
]


# ----------------------------------------------------------------------------- device memory as users see it
# Hugging Face's "Methods and tools for efficient training on a single GPU" guide (transformers docs,
# perf_train_gpu_one.md, the version with these figures: v4.21-v4.29, 2022-2023; the same rows in its zh and ko
# translations): bert-large-uncased for sequence classification, 512 random tokens per sequence, the Trainer's
# defaults of its time (fp32, transformers' own for-loop AdamW "adamw_hf", dropout 0.1) on a V100 16GB, and NVML's
# memory in use after training ("GPU memory occupied"). Its model-anatomy guide measures that card's process before
# any tensor: 1343 MB once torch.ones((1, 1)).to("cuda") has loaded the kernels (a 2 MiB segment of it the
# allocator's), so the rows are set against fit's most-reserved bytes + 1341 MiB of context.
BERT_LARGE = {"model_type": "bert", "architectures": ["BertForSequenceClassification"], "vocab_size": 30522,
              "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
              "max_position_embeddings": 512, "type_vocab_size": 2}
HF_GUIDE = ("Hugging Face transformers docs, 'Methods and tools for efficient training on a single GPU' "
            "(perf_train_gpu_one.md, v4.21-v4.29), V100 16GB, 'GPU memory occupied' (NVML) after training")
V100_16GB = 16160 / 1024                    # nvidia-smi's total for it in the guide's screenshot: 16160 MiB
GUIDE_CONTEXT = (1343 - 2) * 2**20          # model_memory_anatomy.md: 1343 MB used after a first tiny tensor
_B = dict(seq=512, optimizer="adamw_forloop", context=GUIDE_CONTEXT)
_GUIDE = [("bs 4", 14949, dict(batch=4, precision="fp32")),
          ("bs 1 x 4 accumulation", 8681, dict(batch=4, micro_batch=1, precision="fp32")),
          ("bs 4, fp16", 13939, dict(batch=4, precision="amp")),
          ("bs 1 x 4, checkpointing, fp16", 7275, dict(batch=4, micro_batch=1, precision="amp",
                                                         checkpointing="full")),
          ("bs 4, Adafactor", 12295, dict(batch=4, precision="fp32", optimizer="adafactor")),
          ("bs 1 x 4, checkpointing, fp16, Adafactor", 4847, dict(batch=4, micro_batch=1, precision="amp",
                                                                    checkpointing="full", optimizer="adafactor")),
          ("bs 4, 8-bit Adam", 13085, dict(batch=4, precision="fp32", optimizer="adamw8bit")),
          ("bs 1 x 4, checkpointing, fp16, 8-bit Adam", 5363, dict(batch=4, micro_batch=1, precision="amp",
                                                                     checkpointing="full", optimizer="adamw8bit"))]
ROWS += [("used", HF_GUIDE, f"BERT-large, seq-cls, 512 tokens, {what}", mib / 1024, BERT_LARGE, V100_16GB,
          {**_B, **kw}, "the Trainer's AdamW of 2022 (transformers' own, for-loop) is run as torch's for-loop AdamW; "
          "fp16 AMP as fit's amp (the same 2-byte activations; the GradScaler's scalars not counted); the kernels "
          "and context are the guide's own measurement")
         for what, mib, kw in _GUIDE]

# ----------------------------------------------------------------------------- the longest context that trains
UNSLOTH = ("Unsloth README (github.com/unslothai/unsloth), 'Context length benchmarks', Llama 3.1 (8B) and Llama "
           "3.3 (70B) max. context length, column 'Hugging Face + FA2': 4-bit QLoRA on all linear layers, rank 32, "
           "batch 1, every sequence padded to the length")
_Q = dict(method="qlora", lora_r=32, checkpointing="full", batch=1)
_UNSLOTH_NOTE = ("the card of each size is not named (a preset of that size is used: its capacity as that card "
                 "reports it); the optimizer is not named (the Hugging Face Trainer's default assumed: fused AdamW, "
                 "fp32 state for the fp32 adapters; with 8-bit AdamW, as Unsloth's own notebooks set, fit's lengths "
                 "come out longer: 2,996 tokens on 16 GB, 6,381 on 24 GB); gradient checkpointing assumed on; "
                 "FlashAttention-2 run as sdpa")
ROWS += [("maxseq", UNSLOTH, f"Llama 3.1 8B QLoRA r=32, batch 1, the longest sequence on a {gb} GB card", n,
          "llama-3.1-8b", card, _Q, _UNSLOTH_NOTE)
         for gb, n, card in ((16, 2551, "RTX4080-16GB"), (24, 5789, "RTX4090-24GB"), (40, 12264, "A100-40GB"),
                             (48, 15502, "L40S-48GB"), (80, 28454, "A100-80GB"))]
ROWS += [("maxseq", UNSLOTH, "Llama 3.3 70B QLoRA r=32, batch 1, the longest sequence on an A100 80GB", 6916,
          "llama-3.1-70b", "A100-80GB", _Q, _UNSLOTH_NOTE + "; Llama 3.3 70B has Llama 3.1 70B's shapes")]

# ----------------------------------------------------------------------------- training speed
# The RTX 4090's peaks, NVIDIA Ada GPU Architecture whitepaper (v2.01), Appendix A, Table 2: BF16 tensor FLOP/s
# with FP32 accumulate 165.2 TFLOPS dense (330.4 with sparsity), GDDR6X 1008 GB/s; PCIe Gen4 x16, 32 GB/s a way.
RTX4090 = {"bf16": 165.2e12, "dram": 1008e9, "pcie": 32e9}
ROWS += [("speed", f"{src}; 'Tokens/sec' (measured over one full training epoch)", what, tps,
          "llama-3.1-8b", "RTX4090-24GB", kw, "torch.compile; fit's figure is the most a step's lower bound at the "
          "card's peaks allows (`step_bound`): the published rate must not exceed it, and their ratio is the share "
          "of that bound the run reached")
         for (_, src, what, _, _, _, kw, _), tps in zip(ROWS[:3], (2413, 3083, 1650))]


def step_bound(r, card: dict) -> float:
    """The least seconds one optimizer step of fit's result `r` can take on a card of `card`'s peaks (bf16 FLOP/s,
    DRAM and one-way PCIe bytes/s): the matmul FLOPs at the bf16 peak - 6 per trainable parameter and token (forward,
    input and weight gradients), 4 per frozen one (no weight gradient), the attention's matmuls (3 times the
    forward's, half of them for causal attention), and the recomputation checkpointing adds - plus QLoRA's
    dequantization traffic in DRAM and the PCIe traffic of `r.cost` (offload; paged state only moves when the card
    is short, so its worst case, `paged_bytes`, is left out of a lower bound)."""
    p, c = r.plan, r.cost
    tokens = p["batch"] * p["seq"]
    frozen = r.n_params - r.trainable if p["method"] != "full" else 0
    train = r.n_params if p["method"] == "full" else r.trainable
    attn = 3 * c.get("attention_flops", 0) // 2
    flops = (6 * train + 4 * frozen) * tokens + attn + c["recompute_flops"]
    pcie = c["offload_bytes"] - c.get("paged_bytes", 0)
    return flops / card["bf16"] + c.get("dequant_bytes", 0) / card["dram"] + pcie / card["pcie"]


def fit_row(kind, model, gpu, kw):
    """fit's figure for one row (GiB, tokens, or tokens/s, as the row's kind) and its FitResult (a FitMax for
    "maxseq"), or (None, reason) where fit cannot build the model."""
    from .plan import fit
    try:
        if kind == "maxseq":
            from .limits import fit_max
            m = fit_max(model, gpu, headroom=0.0, **kw)
            return m.value, m
        r = fit(model, gpu, headroom=0.0, **kw)
    except ValueError as e:
        return None, str(e).split(" (")[0]
    if kind == "states":
        return sum(r.model_states.values()) / GiB, r
    if kind == "used":
        return (r.reserved_cached + r.context) / GiB, r
    if kind == "speed":
        return r.plan["batch"] * r.plan["seq"] / step_bound(r, RTX4090), r
    return r.peak / GiB, r
