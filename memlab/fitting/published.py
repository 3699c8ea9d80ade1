"""Published peak-memory figures of real GPU runs, with their sources and settings, and fit's prediction for each
(`fit_row`). `python benchmarks/bench_fit_published.py` prints them all (benchmarks/fit_published.md); lesson 08
sets torchtune's three single-GPU Llama-3.1-8B rows beside its ladder.

Each row: (kind, source, what was run, published GiB, model, gpu, fit's options, what fit cannot express or
differs in). Kinds: "peak" (a run's published peak against fit's allocated peak), "states" (a published output of
DeepSpeed's model-state estimator against fit's model_states), "fits" (a published "this trained on that card").
"""

from __future__ import annotations

__all__ = ["ROWS", "fit_row"]

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


def fit_row(kind, model, gpu, kw):
    """fit's figure for one row: (GiB, FitResult), or (None, reason) where fit cannot build the model."""
    from .plan import fit
    try:
        r = fit(model, gpu, headroom=0.0, **kw)
    except ValueError as e:
        return None, str(e).split(" (")[0]
    if kind == "states":
        return sum(r.model_states.values()) / GiB, r
    return r.peak / GiB, r
