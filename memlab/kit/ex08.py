"""What exercise 08's notebook (the capstone, "Make it fit") takes from the kit: the problems' vocabulary, the
plan's rungs and their checks, the tiny twins that `train_step` runs on, and the translation of a plan into
`memlab.fit`'s options. The checks of exercise 08 build models, optimizers and data with the same functions;
nothing here grades.

A *problem* is plain data:
    {"model": "llama-2-7b" | "llama-3.1-8b" (memlab.fit presets), "gpu": "T4-16GB" | "L4-24GB" (memlab presets),
     "batch": sequences per optimizer step, "seq": tokens per sequence, "headroom": the share of the GPU's
     capacity to keep free, "lora_r": the LoRA rank the team asks for (for lora and qlora plans),
     "offload_ok": whether the host has the RAM for ZeRO-Offload (fp32 master weights and Adam's two moments:
     12 bytes per parameter)}

A *plan* is plain data naming one choice per rung of lesson 08's ladder:
    "method"        "full" (every weight trains) | "lora" (frozen base in the plan's precision, fp32 adapters of
                    rank lora_r on every linear layer but the head, peft's default) | "qlora" (the same on an NF4
                    base, bitsandbytes' Linear4bit computing in the plan's precision; embeddings, norms and head
                    fp32, as peft.prepare_model_for_kbit_training leaves them)
    "lora_r"        int >= 1: the adapters' rank (ignored by "full")
    "precision"     "fp32" | "bf16": the dtype of the trained weights, their gradients and AdamW's state
                    ("full": pure bf16), or of the frozen base ("lora"), or the 4-bit layers' compute ("qlora")
    "optimizer"     "adamw" (torch.optim.AdamW) | "adamw8bit" (bitsandbytes.optim.AdamW8bit: 8-bit moments);
                    "lora" and "qlora" use "adamw" (their adapters' state is a few MB)
    "checkpointing" bool: every decoder layer keeps only its input and runs its forward again in backward
    "micro_batch"   int in 1..batch: sequences per forward/backward (gradient accumulation); the last
                    micro-batch is smaller when it does not divide the batch (memlab.fit takes divisors only)
    "offload"       bool: ZeRO-Offload (optimizer state, fp32 masters and the step on the CPU; the GPU keeps the
                    16-bit weights): "full" with "adamw" only, and only where problem["offload_ok"]
The recipe: AdamW(lr=LR, betas=BETAS, weight_decay=WD) (AdamW8bit with the same settings), the causal-LM loss of
Hugging Face (labels = the input ids, shifted inside: the mean over batch x (seq - 1) predicted tokens), one
optimizer step per batch.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..core.validate import one_of, pos_int
from ..core.virtual_gpu import lookup_preset

LR, BETAS, WD = 1e-3, (0.9, 0.95), 0.1
MODELS = ("llama-2-7b", "llama-3.1-8b")
GPUS = ("T4-16GB", "L4-24GB")
METHODS = ("full", "lora", "qlora")
PRECISIONS = ("fp32", "bf16")
OPTIMIZERS = ("adamw", "adamw8bit")
PLAN_KEYS = ("method", "lora_r", "precision", "optimizer", "checkpointing", "micro_batch", "offload")
PROBLEM_KEYS = ("model", "gpu", "batch", "seq", "headroom", "lora_r", "offload_ok")
TINY_SEQ = 13                      # tokens per tiny sequence: not a power of two
SMALL_SEQ = 96                     # tokens per sequence of the "small" twins (task 8.1's memory case)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

# the tiny twins: the same kind of model as each preset (Llama blocks; Llama-3.1's grouped-query attention),
# CPU-sized. Hidden 64 and vocabularies of 128+ give tensors of >= 4096 values: bitsandbytes' AdamW8bit keeps
# 8-bit state only for those (min_8bit_size).
TINY = {"llama-2-7b": dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4),
        "llama-3.1-8b": dict(vocab_size=160, hidden_size=64, intermediate_size=192, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0)}

# the "small" twins: wide enough that one micro-batch's activations are worth measuring, still CPU-sized
SMALL = {name: dict(cfg, vocab_size=4 * cfg["vocab_size"], hidden_size=128, intermediate_size=3 * cfg[
    "intermediate_size"]) for name, cfg in TINY.items()}


# ----------------------------------------------------------------------------- validating plain data
def check_problem(problem) -> dict:
    """problem, checked (ValueError naming the key)."""
    if type(problem) is not dict:
        raise TypeError(f"problem must be a dict, got {type(problem).__name__}")
    missing = [k for k in PROBLEM_KEYS if k not in problem]
    if missing:
        raise ValueError(f"problem has no {missing} (keys: {list(PROBLEM_KEYS)})")
    one_of("problem['model']", problem["model"], MODELS)
    lookup_preset(problem["gpu"])
    for k in ("batch", "seq", "lora_r"):
        pos_int(f"problem[{k!r}]", problem[k])
    h = problem["headroom"]
    if type(h) not in (int, float) or not 0 <= h < 1:
        raise ValueError(f"problem['headroom'] must be a fraction in [0, 1), got {h!r}")
    if type(problem["offload_ok"]) is not bool:
        raise ValueError(f"problem['offload_ok'] must be a bool, got {problem['offload_ok']!r}")
    return problem


def n_micro(problem, plan) -> int:
    """Micro-batches per optimizer step: ceil(batch / micro_batch)."""
    return -(-problem["batch"] // plan["micro_batch"])


def plan_error(plan, problem, *, dividing: bool = False) -> str | None:
    """Why `plan` is not a valid plan for `problem` (None if it is). dividing=True: micro_batch must also divide
    the batch (what memlab.fit measures, and what tasks 8.2 and 8.3 use)."""
    if type(plan) is not dict:
        return f"a plan must be a dict, got {type(plan).__name__}"
    if set(plan) != set(PLAN_KEYS):
        return f"a plan has exactly the keys {sorted(PLAN_KEYS)}, got {sorted(map(str, plan))}"
    for key, allowed in (("method", METHODS), ("precision", PRECISIONS), ("optimizer", OPTIMIZERS)):
        if plan[key] not in allowed or type(plan[key]) is not str:
            return f"plan[{key!r}] must be one of {allowed}, got {plan[key]!r}"
    r, mb = plan["lora_r"], plan["micro_batch"]
    if type(r) is not int or r < 1:
        return f"plan['lora_r'] must be a positive int, got {r!r}"
    for key in ("checkpointing", "offload"):
        if type(plan[key]) is not bool:
            return f"plan[{key!r}] must be True or False, got {plan[key]!r}"
    if type(mb) is not int or not 1 <= mb <= problem["batch"]:
        return f"plan['micro_batch'] must be an int in 1..{problem['batch']} (the batch), got {mb!r}"
    if dividing and problem["batch"] % mb:
        return (f"plan['micro_batch'] = {mb} does not divide the batch ({problem['batch']}): plans for memlab.fit "
                f"take micro-batches that divide it")
    if plan["method"] != "full" and plan["optimizer"] != "adamw":
        return f"plan['optimizer'] must be 'adamw' for method {plan['method']!r} (the adapters' state is tiny)"
    if plan["offload"]:
        if plan["method"] != "full" or plan["optimizer"] != "adamw":
            return "plan['offload'] = True needs method 'full' and optimizer 'adamw' (ZeRO-Offload's CPU Adam)"
        if not problem.get("offload_ok", True):
            return "plan['offload'] = True, but this problem's host has no RAM for it (problem['offload_ok'])"
    return None


def fit_options(problem, plan) -> dict:
    """The keyword arguments of memlab.fit(problem["model"], problem["gpu"], **options) for this plan."""
    err = plan_error(plan, problem, dividing=True)
    if err:
        raise ValueError(err)
    return dict(batch=problem["batch"], seq=problem["seq"], method=plan["method"], precision=plan["precision"],
                optimizer=plan["optimizer"], checkpointing="full" if plan["checkpointing"] else "none",
                micro_batch=None if plan["micro_batch"] == problem["batch"] else plan["micro_batch"],
                lora_r=plan["lora_r"], zero=1 if plan["offload"] else 0, offload=plan["offload"],
                headroom=problem["headroom"])


# ----------------------------------------------------------------------------- the tiny twins
def tiny_config(model: str, size: str = "tiny"):
    """The Hugging Face LlamaConfig of `model`'s tiny (or "small") twin."""
    from transformers import LlamaConfig
    one_of("model", model, MODELS)
    one_of("size", size, ("tiny", "small"))
    return LlamaConfig(**(TINY if size == "tiny" else SMALL)[model], max_position_embeddings=128,
                       tie_word_embeddings=False, use_cache=False,
                       rms_norm_eps=1e-5, attn_implementation="sdpa")


def _quantize_nf4(model, compute_dtype):
    """Every nn.Linear inside the decoder layers -> bitsandbytes Linear4bit (NF4, double quantization)."""
    import bitsandbytes as bnb
    for layer in model.model.layers:
        for mod in list(layer.modules()):
            for name, child in list(mod.named_children()):
                if type(child) is nn.Linear:
                    q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False,
                                          compute_dtype=compute_dtype, quant_type="nf4", compress_statistics=True)
                    q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, quant_type="nf4",
                                                 compress_statistics=True)
                    setattr(mod, name, q.to("cpu"))           # .to() quantizes
    return model


def build_tiny(problem, plan, seed: int, size: str = "tiny"):
    """(model, optimizer) of the plan's rungs on problem["model"]'s tiny twin, on the CPU, in train mode:
    method and precision as the module docstring says (LoRA by peft.get_peft_model: lora_alpha = 2 r, no dropout,
    target_modules="all-linear"), the plan's optimizer on the trainable parameters. Checkpointing, micro-batches
    and offload are the step's business (offload changes nothing on a CPU). Same seed, same model."""
    from transformers import LlamaForCausalLM
    from ..quant.llama import silence_libraries
    silence_libraries()
    dtype = DTYPES[plan["precision"]]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(problem["model"], size))
    if plan["method"] == "qlora":
        _quantize_nf4(model, dtype)
    elif dtype != torch.float32:
        model = model.to(dtype)
    if plan["method"] != "full":
        from peft import LoraConfig, get_peft_model
        torch.manual_seed(seed + 1)
        model = get_peft_model(model, LoraConfig(r=plan["lora_r"], lora_alpha=2 * plan["lora_r"], lora_dropout=0.0,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
        with torch.no_grad():                     # B = 0 at init would hide a wrong gradient of A: start off zero
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    if plan["optimizer"] == "adamw8bit":
        import bitsandbytes as bnb
        opt = bnb.optim.AdamW8bit(params, lr=LR, betas=BETAS, weight_decay=WD)
    else:
        opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WD)
    return model, opt


def decoder_layers(model):
    """The tiny twin's decoder layers (through a peft wrapper)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def tiny_batch(problem, generator=None, size: str = "tiny"):
    """(x, y): (batch, TINY_SEQ or SMALL_SEQ) token ids and their labels (y = x: the model shifts them inside)."""
    V = (TINY if size == "tiny" else SMALL)[problem["model"]]["vocab_size"]
    x = torch.randint(0, V, (problem["batch"], TINY_SEQ if size == "tiny" else SMALL_SEQ), generator=generator)
    return x, x.clone()


def usable(problem) -> int:
    """Bytes a plan may use on the problem's GPU: capacity x (1 - headroom), as memlab.fit computes it."""
    from ..core.gpus import usable_bytes
    return usable_bytes(lookup_preset(problem["gpu"]).capacity, problem["headroom"])


def measurer(problem, fit):
    """measure(plan) -> {"peak": bytes, "fits": bool}: memlab.fit's steady-state peak and verdict for a plan of
    `problem` (the headroom included), `fit` being memlab.fit. Task 8.3 hands plan_for one of these."""
    check_problem(problem)

    def measure(plan):
        r = fit(problem["model"], problem["gpu"], **fit_options(problem, plan))
        return {"peak": int(r.peak), "fits": bool(r.fits)}
    return measure


class one_thread:
    """with one_thread(): ... runs torch on one CPU thread: the tiny twins' matrices are too small to share, and on
    a busy machine a second thread costs more than it gives."""

    def __enter__(self):
        self.n = torch.get_num_threads()
        torch.set_num_threads(1)
        return self

    def __exit__(self, *exc):
        torch.set_num_threads(self.n)
        return False
