"""The step `memlab.fit` runs on the virtual GPU: a Hugging Face model built from its config
(`memlab/fitting/architectures.py` says which model and which step), set up for full, LoRA or QLoRA fine-tuning,
with its optimizer, and one steady-state training step (or a prefill / forward).

The model is made on the meta device and then given storage on the current default device (inside
`VirtualGPU.run` that is fake storage), as `memlab.quant.llama.finetune_llama` does for Llama, reusing its pieces
(`give_storage`, `memlab.quant.Linear4bitStandIn`).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn as nn

from ..quant.llama import give_storage, silence_libraries
from ..quant.nf4 import Linear4bitStandIn
from ..core.track import active_trackers, phase, watch
from ..core.virtual_gpu import _CudaAutocastLists, cuda_autocast
from .optimizers import AdamW8bitStandIn, make_optimizer  # noqa: F401  (their home: optimizers.py)
from .practice import LOSS_CHUNKS, chunked_causal_lm_loss, offload_activations  # noqa: F401  (practice.py)
from .architectures import (DECODER_DEPTH, HEAD_MODULES, KINDS, PEFT_TASK, TASKS, _get, _null,  # noqa: F401
                            build_causal_lm, build_model, cut_layers, decoder_layers, grouped_mm_any_dtype,
                            layer_stacks, model_depth, model_task, task_inputs, unpacked_sequences)

__all__ = ["AdamW8bitStandIn", "cut_layers", "fit_step", "layer_stacks", "model_task", "precision_dtype",
           "selective_policy"]


# ----------------------------------------------------------------------------- the model's size and dtype


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype a plan's weights and activations are built in: fp32 for "fp32" and "amp" (autocast keeps
    fp32 weights), fp16 for "fp16", bf16 for the other 16-bit plans."""
    return {"fp32": torch.float32, "amp": torch.float32, "fp16": torch.float16}.get(precision, torch.bfloat16)


# ----------------------------------------------------------------------------- the model
class _Linear4bitBiasStandIn(Linear4bitStandIn):
    """Linear4bitStandIn plus a frozen fp32 bias (the q/k/v biases of Qwen2, GPT-2's Conv1D biases) as
    prepare_model_for_kbit_training leaves it. The bias is added after the 4-bit matmul (bitsandbytes adds
    it inside; the difference is one (tokens, out) temporary)."""

    def __init__(self, in_features, out_features, **kw):
        super().__init__(in_features, out_features, **kw)
        self.bias = nn.Parameter(torch.zeros(out_features, device=kw.get("device")), requires_grad=False)

    def forward(self, x):
        return super().forward(x) + self.bias.to(x.dtype)


def selective_policy(ctx, op, *args, **kwargs):
    """checkpointing="selective": inside each checkpointed decoder layer keep the outputs of the matmuls
    (aten.mm / addmm / bmm: the q, k, v, o, gate, up, down projections and the adapters) and recompute
    everything else in the backward: the norms, RoPE, the attention core (sdpa), the activation function
    and the elementwise products (torch.utils.checkpoint's selective activation checkpointing)."""
    from torch.utils.checkpoint import CheckpointPolicy
    aten = torch.ops.aten
    if op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _linear_shape(m):
    if type(m) is nn.Linear:
        return m.in_features, m.out_features, m.bias is not None
    if type(m).__name__ == "Conv1D":            # GPT-2: weight (in, out)
        return m.weight.shape[0], m.weight.shape[1], m.bias is not None
    return None


def skeleton(cfg, method: str, dtype: torch.dtype, r: int, attention: str, layers: tuple | None = None):
    """The model on the meta device (shapes only; build it outside FakeTensorMode: some models make
    tensors in __init__), to be given storage by `materialise`. Returns (model, info):
    info = {"n_params": base parameters, "layer_params": one layer of each stack, "stack_params": every layer of
    every stack, "trainable": trainable}. `layers`: keep only these layers of the stack as built (a run of chosen
    kinds of layer, `memlab.fitting.layers.select_layers`).

    full: every parameter in `dtype`, trainable. lora: frozen base in `dtype`, peft LoRA adapters (fp32,
    peft's default) of rank r on every linear layer but the output head (target_modules="all-linear"; peft's
    task type for the model's task; a classifier's head is trained whole instead, `HEAD_MODULES`).
    qlora: as lora, every adapted linear's base as an NF4 Linear4bitStandIn computing in `dtype`, the rest
    (embeddings, norms, head) in fp32 as peft.prepare_model_for_kbit_training leaves it."""
    silence_libraries()
    cfg = copy.deepcopy(cfg)
    if _get(cfg, "problem_type") is None and model_task(cfg) in ("seq-cls", "image-cls"):
        # what transformers' classifiers (and the Trainer) settle on for these labels on the first forward; set
        # before it, as some (DeBERTa-v2) otherwise select the labelled rows with a data-dependent nonzero()
        cfg.problem_type = "regression" if getattr(cfg, "num_labels", 2) == 1 else "single_label_classification"
    with torch.device("meta"):
        model, task = build_model(cfg, attention)
        model._memlab_task = task
        if _get(cfg, "memlab_untied_head"):   # the config.json says the head is its own (mT5, T5 v1.1)
            _untie_head(model)
        if layers is not None:           # a run of chosen layers (memlab/fitting/layers.py)
            from .layers import select_layers
            select_layers(model, cfg, layers)
        stacks = layer_stacks(model)
        info = {"n_params": sum(p.numel() for p in model.parameters()),
                "layer_params": sum(p.numel() for st in stacks for p in st[0].parameters()),
                "stack_params": sum(p.numel() for st in stacks for p in st.parameters()),
                "attention_run": getattr(model, "_memlab_attention", attention)}
        if method != "full":
            from peft import LoraConfig, get_peft_model
            head = {} if task not in ("seq-cls", "image-cls") else \
                {"exclude_modules": HEAD_MODULES, "modules_to_save": ["classifier"]}
            lc = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, bias="none", target_modules="all-linear",
                            task_type=PEFT_TASK[task], **head)
            model = get_peft_model(model, lc)
    if method == "qlora":
        for m in list(model.modules()):
            for cname, child in list(m.named_children()):
                shape = _linear_shape(child) if cname == "base_layer" else None
                if shape:
                    i, o, bias = shape
                    cls = _Linear4bitBiasStandIn if bias else Linear4bitStandIn
                    setattr(m, cname, cls(i, o, compute_dtype=dtype, quant_dtype=dtype, device="meta"))
    info["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model._memlab_unused = _unreached(model)
    return model, info


def _untie_head(model) -> None:
    """Give the output head its own weight where transformers ties it to the input embedding although the
    checkpoint's config.json says "tie_word_embeddings": false (transformers 5 ties T5 and mT5 always; mt0-xxl's
    head is then 1.02B parameters that the real run holds and the tied model does not)."""
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    if out is not None and inp is not None and out.weight is inp.weight:
        out.weight = nn.Parameter(torch.empty_like(inp.weight))


def _unreached(model) -> frozenset:
    """Names of the trainable parameters the task's loss does not reach: they get no gradient in a real step, so
    AdamW keeps no state for them (the cross-attention of BART's decoder run as a causal LM). Found from the
    autograd graph of one forward of a 2-token batch on the meta device, where nothing is allocated or counted;
    none if the model cannot run on meta."""
    try:
        with torch.device("meta"), unpacked_sequences():
            loss = model(**task_inputs(model, 1, 2)).loss
    except Exception:                    # a model that reads values while it runs: every parameter is reached
        return frozenset()
    reached, todo, seen = set(), [loss.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            reached.add(id(fn.variable))
        todo += [f for f, _ in fn.next_functions]
    return frozenset(n for n, p in model.named_parameters() if p.requires_grad and id(p) not in reached)


def _base(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


class _Both:
    """Two context managers entered as one (the first outside)."""

    def __init__(self, a, b):
        self.a, self.b = a, b

    def __enter__(self):
        self.a.__enter__()
        self.b.__enter__()
        return self

    def __exit__(self, *exc):
        self.b.__exit__(*exc)
        return self.a.__exit__(*exc)


def _amp_recompute(context_fn=None):
    """checkpoint's context_fn for precision "amp": the recomputation in the backward runs under CPU autocast, which
    checkpoint restores, but not under the virtual GPU's CUDA op lists (a torch-function mode, which the autograd
    engine does not carry into the backward); without them ops on CUDA's fp32 list (pow in GPT-2's GELU, softmax in
    eager attention) recompute in bf16 where the forward ran them in fp32, and checkpoint raises CheckpointError.
    This puts the lists around the recomputation (and keeps selective checkpointing's own contexts)."""
    def contexts():
        fwd, rec = context_fn() if context_fn is not None else (_null(), _null())
        return fwd, _Both(rec, _CudaAutocastLists(torch.bfloat16))
    return contexts


def _kept_in_fp32(model, dtype: torch.dtype) -> set:
    """ids of the parameters and buffers from_pretrained(dtype=...) keeps in fp32: the model class's
    `_keep_in_fp32_modules_strict` (MoE routers: DeepSeek-V3's gate.weight and e_score_correction_bias; for bf16 and
    fp16) and `_keep_in_fp32_modules` (for fp16 only: T5's wo, GPT-OSS's norms), matched as transformers matches them
    (each name a regular expression searched in the parameter's name: `PreTrainedModel._get_dtype_plan`)."""
    base = _base(model)
    plan = base._get_dtype_plan(dtype) if hasattr(base, "_get_dtype_plan") and dtype != torch.float32 else {}
    if not plan:
        return set()
    import re
    pattern = re.compile("|".join(k.replace("*", ".*") for k in plan))
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return {id(t) for n, t in named if pattern.search(n)}


def materialise(model, method: str, dtype: torch.dtype, checkpointing: str, rest: torch.dtype = torch.float32,
                amp: bool = False):
    """Give a `skeleton` storage on the current default device (fake inside VirtualGPU.run): trainable
    parameters in `dtype` (full) or fp32 adapters (and, for a classifier, peft's trainable copy of its head in
    `dtype`), frozen ones in `dtype` (`rest` outside the 4-bit layers for qlora: fp32 by default); checkpointing
    "full" (every repeated layer) or "selective" (`selective_policy`)."""
    other = rest if method == "qlora" else dtype
    keep = _kept_in_fp32(model, other)

    def dtype_of(mname, p):
        adapter = ".lora_" in f".{mname}"
        return (torch.float32 if adapter or id(p) in keep else other), method == "full" or p.requires_grad
    give_storage(model, dtype_of)
    for m in model.modules():       # floating buffers (BART's final_logits_bias) in the weights' dtype, as
        if not isinstance(m, Linear4bitStandIn):     # model.to(dtype) and from_pretrained(dtype=...) leave them
            for name, b in m._buffers.items():
                want = torch.float32 if id(b) in keep else other
                if b is not None and b.is_floating_point() and b.dtype != want:
                    m._buffers[name] = b.to(want)
    if checkpointing != "none":
        kw = {"use_reentrant": False}
        if checkpointing == "selective":
            from torch.utils.checkpoint import create_selective_checkpoint_contexts
            kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_policy)
        if amp:
            kw["context_fn"] = _amp_recompute(kw.get("context_fn"))
        base = _base(model)
        if not getattr(base, "supports_gradient_checkpointing", False):
            raise ValueError(f"checkpointing: {base.config.model_type!r} ({type(base).__name__}) does not support "
                             f"gradient checkpointing in transformers; use checkpointing='none'")
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    return model


# ----------------------------------------------------------------------------- the step
def _nbytes(ps) -> int:
    return sum(p.numel() * p.element_size() for p in ps)


def _sizes(model) -> dict:
    """Byte sizes ZeRO-3 and offload need: the largest layer's tensors, the biggest single parameter, the
    trainable parameters' bytes and element size."""
    layers = [list(st[0].parameters()) + list(st[0].buffers()) for st in layer_stacks(model)]
    params = list(model.parameters())
    train = [p for p in params if p.requires_grad]
    return {"gather_bytes": max(max(_nbytes(ly) for ly in layers), max(_nbytes([p]) for p in params)),
            "gather_grad_bytes": max(max(_nbytes([p for p in ly if p.requires_grad]) for ly in layers),
                                     max((_nbytes([p]) for p in train), default=0)),
            "grad_elem_bytes": train[0].element_size() if train else 2,
            "trainable_bytes": _nbytes(train), "weight_bytes": _nbytes(params) + _nbytes(model.buffers())}


def fit_step(model, info: dict, plan) -> dict:
    """One steady-state training step (plan.mode="train": the optimizer's state made first, as the first step
    makes it, then min(2, steps_per_batch) micro-batches of forward and backward - the second one runs beside
    the accumulated gradients - then the optimizer step) or one inference pass (mode="inference": a causal LM's
    prefill of (batch, seq) tokens into a KV cache with the logits of the last token only, as generate()
    computes them; a seq2seq model's encoder and first decoder step; a classifier's no_grad forward). The batch
    is the model's task's (`task_inputs`). Phases: "forward", "backward", "step". Returns the model's info plus
    "states": parameters/gradients/optimizer bytes just after the optimizer step.
    `model` is a `skeleton` (each call needs a fresh one: it is given storage here)."""
    task = getattr(model, "_memlab_task", "causal")
    if getattr(plan, "target_seq", None) is not None and task != "seq2seq":
        raise ValueError(f"target_seq is the target length of an encoder-decoder; {model.config.model_type!r} runs a "
                         f"{task} step: leave target_seq=None")
    if getattr(plan, "loss", "full") == "chunked" and task != "causal":
        raise ValueError(f"loss='chunked' is for causal language models; {model.config.model_type!r} runs a "
                         f"{task} step: use loss='full'")
    with unpacked_sequences(), grouped_mm_any_dtype(model):
        try:
            return _fit_step(model, info, plan)
        except (AttributeError, KeyError) as e:      # a config without a field its model reads (T5's start token)
            raise ValueError(f"model: transformers could not run {model.config.model_type!r} from this config "
                             f"({type(e).__name__}: {e})") from None


def _forward_loss(model, batch: dict, plan):
    if getattr(plan, "loss", "full") == "chunked":
        return chunked_causal_lm_loss(model, batch["input_ids"])
    return model(**batch).loss


def _inference(model, info: dict, plan, autocast) -> dict:
    """mode="inference": the KV cache outlives the forward (the tracker calls it activations)."""
    model.eval()
    watch(model)
    task = getattr(model, "_memlab_task", "causal")
    batch = task_inputs(model, plan.batch, plan.seq, labels=False)
    kw = {}
    if task in ("causal", "seq2seq"):
        model.config.use_cache = True
        kw["use_cache"] = True
    if task == "causal":
        kw["logits_to_keep"] = 1
    if task == "seq2seq":      # the encoder over seq tokens, then the decoder's first step (its cache)
        kw["decoder_input_ids"] = torch.zeros(plan.batch, 1, dtype=torch.long)
    with torch.no_grad(), phase("forward"), (autocast or _null()):
        out = model(**batch, **kw)
    del out
    return info


def _fit_step(model, info: dict, plan) -> dict:
    dtype = precision_dtype(plan.precision)
    info = dict(info)
    with phase("load"):
        rest = torch.float32 if getattr(plan, "qlora_rest", "fp32") == "fp32" else dtype
        model = materialise(model, plan.method, dtype, plan.checkpointing if plan.mode == "train" else "none", rest,
                            amp=plan.precision == "amp")
        info.update(_sizes(model))
    autocast = cuda_autocast(torch.bfloat16) if plan.precision == "amp" else None
    if plan.mode == "inference":
        return _inference(model, info, plan, autocast)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if getattr(plan, "step_in_backward", False):
        return _step_in_backward(model, trainable, info, plan, autocast)
    with phase("load"):
        opt = make_optimizer(trainable, plan.optimizer, plan.precision)
        watch(model, getattr(opt, "inner", opt))
    # every step after the first runs its forward and backward beside the optimizer's state, which the first
    # step creates: one step on zero gradients makes it now, so the phases below are the steady state's
    # (tests/test_fit.py checks this against two real steps)
    unreached = getattr(model, "_memlab_unused", frozenset())
    with phase("step"):
        for name, p in model.named_parameters():
            if p.requires_grad and name not in unreached:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for i in range(min(2, plan.steps_per_batch)):
        _forward_backward(model, info, plan, autocast)
    watch(tensors=[p.grad for p in trainable if p.grad is not None], category="gradients")
    with phase("step"):
        opt.step()
        trk = active_trackers()
        info["states"] = {k: v for k, v in trk[-1].breakdown().items()
                          if k in ("parameters", "gradients", "optimizer")} if trk else {}
        opt.zero_grad(set_to_none=True)
    return info


def _forward_backward(model, info: dict, plan, autocast) -> None:
    """One micro-batch: a forward (phase "forward", autocast for "amp", activations offloaded if the plan says so)
    and its backward (phase "backward"); nothing of it is kept."""
    batch = task_inputs(model, plan.micro, plan.seq, target_seq=getattr(plan, "target_seq", None))
    with phase("forward"), (autocast or _null()), offload_activations(info, getattr(plan, "activation_offload", False)):
        loss = _forward_loss(model, batch, plan)
    with phase("backward"):
        loss.backward()


def _step_in_backward(model, trainable, info: dict, plan, autocast) -> dict:
    """The optimizer step in the backward pass (torchtune's optimizer_in_bwd, lesson 04): one optimizer per
    parameter, stepped by a post-accumulate-grad hook as soon as that parameter's gradient is complete, which
    is then freed; there is no "step" phase and never a whole set of gradients. Two steps run, so that the
    optimizer state created in the first is alive through the second's forward and backward."""
    with phase("load"):
        opts = {p: make_optimizer([p], plan.optimizer, plan.precision) for p in trainable}
        watch(model, [getattr(o, "inner", o) for o in opts.values()])

    def step_now(p):
        opts[p].step()
        opts[p].zero_grad(set_to_none=True)
    hooks = [p.register_post_accumulate_grad_hook(step_now) for p in trainable]
    for _ in range(2):
        _forward_backward(model, info, plan, autocast)
    for h in hooks:
        h.remove()
    trk = active_trackers()
    info["states"] = {k: v for k, v in trk[-1].breakdown().items()
                      if k in ("parameters", "gradients", "optimizer")} if trk else {}
    return info
