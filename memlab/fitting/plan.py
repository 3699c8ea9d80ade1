"""Will this model train (or serve) on this GPU, and with what turned on?

`fit(model, gpu, ...)` builds the Hugging Face model from its config on the meta device, gives it fake
storage inside `memlab.VirtualGPU` (nothing is allocated, no weights are downloaded) and runs one real
training step (or a prefill) of it under memlab's tracker: forward, backward, optimizer step, with the
options asked for. What it reports is what PyTorch would allocate, by category and by phase, and what a real
card fails on: the step's allocation stream replayed through a model of PyTorch's caching allocator
(`memlab.core.allocator`: block rounding, 2 / 20 MiB segments, best fit, splitting, release and retry before an
OOM) gives the reserved bytes, and the CUDA context with cuBLAS's workspaces comes on top (`context_bytes`).
It fits when reserved + context <= capacity x (1 - headroom).

Speed: every decoder layer is the same, so each phase's peak is linear in the number of layers. `fit`
runs the model cut to 2 and 3 layers (layer 0 differs: its input needs no gradient) and extends each phase's
peak (every category of it) to L layers: peak(L) = peak(2) + (L - 2) * (peak(3) - peak(2)).
tests/test_fit.py checks this against full-depth runs: exact to the byte for the plans it tries, except
precision="amp" whose forward peak moves with depth (within 2% there).

What is run, and what is computed on top (`memlab.fit_search` has the search and the CLI):
  run        method, precision, optimizer, checkpointing, micro_batch, attention, mode
  computed   ZeRO stage / gpus and offload: the per-rank partition of the run's model states
             (Rajbhandari et al. 2020, section 5), see `shard_phases`.
Not modelled: DDP's gradient buckets, padding (sequences are full, causal attention is sdpa's is_causal), other
processes on the card. The reserved bytes of a deep model are its allocated peak times the 3-layer run's
reserved / allocated (the overhead does not extend linearly; benchmarks/fit.md compares full-depth replays);
with ZeRO, offload or paged state the same share is applied to the partitioned peak, an approximation.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass


from ..core.gpus import HEADROOM, resolve_gpu, usable_bytes
from .optimizers import OPTIMIZERS, trainer_default
from .config import CONFIG_DIR, check_config, fit_presets, load_config, read_config  # noqa: F401
from ..core.track import CATEGORIES
from ..core.validate import flag, is_int, number_in, one_of, pos_int

from .result import BORDERLINE, FitResult  # noqa: F401  (FitResult's home: result.py)

__all__ = ["FitResult", "Plan", "fit", "fit_presets", "load_config", "context_bytes", "CHOICES"]

GiB, MiB = 2**30, 2**20
# What a process holds on the card outside its tensors, when no recording of the card says otherwise:
#   the CUDA context: memlab.core.virtual_gpu.CUDA_CONTEXT_GB (0.4 GiB), "around 400MB if CUDA >= 11.7 is used and lazy
#     module loading enabled" (pytorch/pytorch issue 109888; it varies with the GPU, driver and CUDA version);
#   cuBLAS's workspace: 8,519,680 B, the default CUBLAS_WORKSPACE_CONFIG=:4096:2:16:8 (PyTorch docs, "CUDA
#     semantics", cuBLAS workspaces), allocated through the caching allocator but not a tensor;
#   cuBLASLt's workspace: 32 MiB, its largest default (Hopper; 4 MiB on Ampere with >= 24 GiB, 1 MiB otherwise:
#     pytorch/pytorch pull request 120925), taken for every card to stay on the safe side.
CUBLAS_WORKSPACE = 8_519_680
CUBLASLT_WORKSPACE = 32 * MiB
CHOICES = {"method": ("full", "lora", "qlora"), "precision": ("fp32", "amp", "bf16", "fp16", "mixed"),
           "qlora_rest": ("fp32", "16bit"), "loss": ("full", "chunked"),
           "optimizer": OPTIMIZERS, "checkpointing": ("none", "full", "selective"),
           "zero": (0, 1, 2, 3), "mode": ("train", "inference"), "attention": ("sdpa", "eager")}


# ----------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Plan:
    """The options of one `fit` (see `fit` for their meaning)."""
    batch: int = 1
    seq: int = 512
    method: str = "full"
    precision: str = "bf16"
    optimizer: str = "adamw"
    checkpointing: str = "none"
    zero: int = 0
    gpus: int = 1
    mode: str = "train"
    micro_batch: int | None = None
    offload: bool = False
    attention: str = "sdpa"
    lora_r: int = 16
    qlora_rest: str = "fp32"
    loss: str = "full"
    step_in_backward: bool = False
    paged: bool = False
    activation_offload: bool = False
    target_seq: int | None = None

    def check(self) -> "Plan":
        for name in ("batch", "seq", "gpus", "lora_r"):
            pos_int(name, getattr(self, name))
        if self.target_seq is not None:
            pos_int("target_seq", self.target_seq, what="None or a positive int (an encoder-decoder's target length)")
        for name, allowed in CHOICES.items():
            one_of(name, getattr(self, name), allowed, what=f"one of {', '.join(map(repr, allowed))}")
        mb = self.micro_batch
        if mb is not None and (not is_int(mb) or mb < 1 or self.batch % mb):
            raise ValueError(f"micro_batch must be None or a positive int that divides batch ({self.batch}), "
                             f"got {mb!r}")
        flag("offload", self.offload)
        flag("step_in_backward", self.step_in_backward)
        flag("paged", self.paged)
        flag("activation_offload", self.activation_offload)
        if self.activation_offload and self.mode != "train":
            raise ValueError("activation_offload=True offloads what the forward saves for the backward: mode 'train' "
                             "only")
        if self.paged and (not self.optimizer.startswith(("adamw", "paged_")) or self.offload):
            raise ValueError("paged=True pages the optimizer's state: it needs an AdamW optimizer ('adamw', "
                             "'adamw_fused', 'adamw_forloop', 'adamw8bit', 'paged_adamw8bit') and no offload "
                             "(which already keeps the state on the host)")
        if self.offload and self.optimizer not in ("adamw", "adamw_fused", "adamw_forloop"):
            raise ValueError(f"offload=True runs DeepSpeed's CPU Adam on the host (ZeRO-Offload), which takes no "
                             f"optimizer {self.optimizer!r}: use 'adamw', 'adamw_fused' or 'adamw_forloop'")
        if self.step_in_backward and (self.steps_per_batch > 1 or self.zero or self.offload or self.mode != "train"):
            raise ValueError("step_in_backward=True needs one micro-batch per step (no gradient accumulation), "
                             "zero=0, no offload and mode='train': each gradient is applied and freed at once")
        if self.offload and self.zero < 1:
            raise ValueError("offload=True needs zero >= 1: optimizer offload (ZeRO-Offload) is a ZeRO option")
        if self.mode == "inference" and (self.zero or self.offload or self.micro_batch not in (None, self.batch)):
            raise ValueError("mode='inference' takes no zero, offload or micro_batch (they are training options)")
        if self.method == "qlora" and self.precision == "mixed":
            raise ValueError("precision='mixed' is for full fine-tuning; with method='qlora' use 'bf16' "
                             "(4-bit base, bf16 compute, fp32 adapters) or 'fp32'")
        return self

    @property
    def paged_state(self) -> bool:
        """The optimizer's state is paged (paged=True, or the paged 8-bit AdamW)."""
        return self.paged or self.optimizer == "paged_adamw8bit"

    @property
    def micro(self) -> int:
        return self.micro_batch or self.batch

    @property
    def steps_per_batch(self) -> int:
        return self.batch // self.micro


# ----------------------------------------------------------------------------- fit
def _gpu(gpu):
    """(name, capacity bytes) of a card by any name people type, a capacity in GiB, or a VirtualGPU
    (`memlab.core.gpus.resolve_gpu`, the one lookup)."""
    spec = resolve_gpu(gpu)
    return spec.name, spec.capacity


def context_bytes(gpu_name: str, capacity: int) -> tuple[int, str]:
    """(bytes, where the figure comes from) that a PyTorch process holds on the card beside its tensors: the CUDA
    context and cuBLAS's handle and workspaces. From a recording of the same card (memlab.hardware.recorded: its
    "cublas" experiment, device memory in use after the first matmuls minus what the allocator reserved before
    them) when one matches the GPU's name and total_memory (within 1%); else the cited figures above."""
    from ..hardware.recorded import Recording, available
    if not isinstance(gpu_name, str):
        raise TypeError(f"gpu_name must be a str, got {type(gpu_name).__name__}")
    pos_int("capacity", capacity)
    token = gpu_name.split("-")[0].lower()
    for path in available():
        try:
            rec = Recording.from_file(path)
            steps = rec.experiments.get("cublas", {}).get("steps", [])
            same = token in rec.gpu.lower() and abs(rec.meta["total_memory_bytes"] - capacity) <= capacity / 100
            if same and len(steps) >= 2:
                used = int(steps[-1]["device_used_bytes"] - steps[0]["reserved_bytes"])
                if used > 0:
                    return used, f"recorded on {rec.gpu}, {rec.meta['date']}"
        except (ValueError, KeyError, TypeError, AttributeError):
            continue                      # not a usable recording: the cited figure below
    from ..core.virtual_gpu import CUDA_CONTEXT_GB
    return (int(CUDA_CONTEXT_GB * GiB) + CUBLAS_WORKSPACE + CUBLASLT_WORKSPACE,
            "cited: CUDA context ~0.4 GiB + cuBLAS/cuBLASLt workspaces")


def auto_precision(gpu) -> str:
    """"bf16" on a card with bf16 tensor cores (or a bare capacity), "fp16" on one without (T4, V100), whatever
    the card's spelling ("t4", "T4-16GB", "Tesla T4")."""
    return "bf16" if resolve_gpu(gpu).bf16 else "fp16"


def fit(model, gpu="L4-24GB", *, batch: int = 1, seq: int = 512, method: str = "full", precision: str = "auto",
        optimizer: str = "auto", checkpointing: str = "none", zero: int = 0, gpus: int = 1, mode: str = "train",
        micro_batch: int | None = None, offload: bool = False, attention: str = "sdpa", lora_r: int = 16,
        qlora_rest: str = "fp32", loss: str = "full", step_in_backward: bool = False, paged: bool = False,
        activation_offload: bool = False, target_seq: int | None = None, headroom: float = HEADROOM,
        context: int | None = None) -> FitResult:
    """Will `model` train (mode="train": one optimizer step of `batch` sequences of `seq` tokens) or serve
    (mode="inference": a prefill of batch x seq tokens into a KV cache) on `gpu`?

    model       a preset (`fit_presets()`), a path to a Hugging Face config.json, a dict or a PretrainedConfig
    gpu         a memlab.core.virtual_gpu preset ("T4-16GB", "L4-24GB", "A100-80GB" ...: the real total_memory),
                a capacity in GiB, or a memlab.VirtualGPU
    method      "full" | "lora" (frozen base, fp32 adapters of rank lora_r on every linear but the head)
                | "qlora" (the same on an NF4 base, the rest fp32: the QLoRA recipe, Dettmers et al. 2023)
    precision   "fp32" | "amp" (fp32 weights, bf16 autocast with CUDA's op lists) | "bf16" (pure bf16:
                weights, gradients and optimizer state) | "fp16" (the same bytes in fp16, for a card without
                bf16 tensor cores such as the T4; training in fp16 needs loss scaling, lesson 03) | "mixed"
                (bf16 weights and gradients + an fp32 master copy the optimizer updates; 16 bytes/param with
                Adam, the ZeRO paper's 2 + 2 + 12) | "auto" (the default: "bf16" on a GPU with bf16 tensor
                cores, "fp16" on one without). For lora/qlora it is the base's dtype; adapters stay fp32.
    optimizer   the optimizer as run, each with its own state and step scratch (`memlab.fitting.optimizers`):
                "adamw" (torch, foreach: torch's default on CUDA) | "adamw_fused" | "adamw_forloop" | "sgd" (no
                momentum) | "sgd_momentum" | "adafactor" (transformers', as the HF Trainer makes it) | "adamw8bit"
                | "paged_adamw8bit" (bitsandbytes) | "auto" (the default: what the Hugging Face Trainer picks on the
                installed torch, "adamw_fused" from torch 2.8 on)
    checkpointing "none" | "full" (every decoder layer) | "selective" (matmul outputs kept, the rest of
                each layer recomputed: `memlab.fitting.model.selective_policy`)
    zero, gpus  ZeRO stage 0-3 on `gpus` data-parallel ranks: per-rank bytes (`memlab.fitting.run.shard_phases`)
    micro_batch gradient accumulation: micro-batches of this size (must divide batch)
    offload     optimizer state and step on the CPU (ZeRO-Offload; needs zero >= 1)
    qlora_rest  method="qlora" only: the dtype of what is not quantized (embeddings, norms, head): "fp32", as
                peft.prepare_model_for_kbit_training leaves it, or "16bit", the plan's 16-bit dtype, as the
                QLoRA authors' script casts it (ignored for other methods)
    loss        "full": the model's own loss (HF: the whole (B, T, V) logits, upcast to fp32 for the
                cross-entropy) | "chunked": the head and the fp32 upcast one eighth of the sequence at a time,
                as torchtune's CEWithChunkedOutputLoss (`memlab.fitting.model.chunked_causal_lm_loss`)
    step_in_backward  each parameter's optimizer step runs in the backward pass as soon as its gradient is
                complete, and the gradient is freed (torchtune's optimizer_in_bwd; lesson 04): no accumulation
    paged       bitsandbytes' paged optimizers (PagedAdamW, PagedAdamW8bit): the state, measured as usual, lives
                in CUDA unified memory, which the driver evicts to the host when the card is full (lesson 07,
                section 10), so it is not counted against the card; the cost counts it crossing PCIe twice per
                step, the worst case. bitsandbytes pages only tensors of >= 1e5 values; here all the state is
                counted as paged (norm and bias state is small)
    activation_offload  every tensor the forward saves for the backward (but parameters and tensors under 1 KiB)
                is copied to the host and its card copy freed, then brought back when the backward needs it
                (torchtune's enable_activation_offloading; `memlab.fitting.model.offload_activations`); measured
                on the virtual GPU, and the cost counts each offloaded byte crossing PCIe twice
    headroom    the share of capacity kept free for what is still not modelled (a longer batch than planned,
                other processes, the allocator model's and the context's error): fits = reserved + context <=
                capacity * (1 - headroom)
    target_seq  an encoder-decoder's target length (labels and decoder input), where `seq` is the source's; None:
                the same as seq. Real seq2seq targets are often a few tokens (a class name, a short answer)
    context     bytes the process holds outside its tensors (CUDA context, cuBLAS workspaces); None: `context_bytes`
                (a recording of this card, else a cited figure). Measure yours: on the card, total_memory minus
                torch.cuda.mem_get_info()[0] minus torch.cuda.memory_reserved(), after a first matmul

    What is reported: `peak` (the allocator's max allocated: live tensors, each rounded to 512 B), `reserved` (the
    least memory the caching allocator runs the steady-state step in: the replayed stream's segments, with the
    allocator freeing its cache and retrying before it fails), `reserved_cached` (what it holds when the card has
    room to spare: torch.cuda.max_memory_reserved() on a larger card) and `context`.
    """
    t0 = time.perf_counter()
    precision = auto_precision(gpu) if precision == "auto" else precision
    optimizer = trainer_default() if optimizer == "auto" else optimizer
    plan = Plan(batch, seq, method, precision, optimizer, checkpointing, zero, gpus, mode, micro_batch, offload,
                attention, lora_r, qlora_rest, loss, step_in_backward, paged, activation_offload, target_seq).check()
    number_in("headroom", headroom, 0, 1, what="a fraction in [0, 1)")
    if context is not None:
        pos_int("context", context, zero_ok=True, what="a non-negative int of bytes or None")
    gpu_name, capacity = _gpu(gpu)
    ctx, ctx_source = (context, "given") if context is not None else context_bytes(gpu_name, capacity)
    raw = check_config(read_config(model))         # one line for a bad field, before transformers is imported
    limit = raw.get("max_position_embeddings") or raw.get("n_positions")
    if limit and seq > limit:
        raise ValueError(f"seq ({seq}) exceeds the model's max_position_embeddings ({limit})")
    from .run import measure, plan_cost, shard_phases
    m = measure(raw if isinstance(model, (str, dict, os.PathLike)) else model, plan)
    info = m["info"]
    phases = shard_phases(m["phases"], info, plan)
    phases.pop("idle", None)          # before "load" and after the step: below the peak of those phases
    paged = 0
    if plan.paged_state:   # the measured optimizer state lives in unified memory: the driver evicts it under pressure
        paged = max(d.get("optimizer", 0) for d in phases.values())
        for d in phases.values():
            d["total"] -= d.get("optimizer", 0)
            d["optimizer"] = 0
    top = max(phases, key=lambda ph: phases[ph]["total"])
    peak = phases[top]["total"]
    usable = usable_bytes(capacity, headroom)
    # the caching allocator's overhead, as a share of the allocated peak of the run (BASE + 1 layers, or the whole
    # model when it is that shallow: then exact), applied to this plan's peak (full depth, per rank)
    a = m["allocator"]
    reserved = -(-peak * a["reserved"] // max(a["allocated"], 1)) if a["allocated"] else peak
    cached = max(reserved, -(-peak * a["reserved_cached"] // max(a["allocated"], 1)))
    states = {}
    if "states" in info:   # model states per rank just after the step: no bucket, nothing gathered
        after = shard_phases({"after": {**info["states"], "activations": 0, "temporaries": 0}}, info, plan)
        states = {k: after["after"][k] for k in ("parameters", "gradients", "optimizer")}
    cost = plan_cost(plan, info)
    if paged:        # at worst the whole state comes in for the update and goes out again, every step
        cost["offload_bytes"] = cost.get("offload_bytes", 0) + 2 * paged
        cost["paged_bytes"] = 2 * paged             # that worst case, on its own
    name = model if isinstance(model, str) else raw["model_type"]
    notes = []
    ran = info.get("attention_run", plan.attention)
    if ran != plan.attention:
        notes.append(f"attention {ran}: transformers has no {plan.attention} path for {raw['model_type']!r}, so "
                     f"this is what it runs")
    return FitResult(peak=peak, capacity=capacity, usable=usable, fits=reserved + ctx <= usable,
                     by_category={c: phases[top][c] for c in CATEGORIES},
                     by_phase={ph: d["total"] for ph, d in phases.items()}, plan=asdict(plan),
                     cost=cost, seconds=time.perf_counter() - t0, model=str(name),
                     gpu=gpu_name, peak_phase=top, model_states=states, n_params=int(info["n_params"]),
                     trainable=int(info["trainable"]), reserved=reserved, reserved_cached=cached, context=ctx,
                     context_source=ctx_source, notes=notes)
