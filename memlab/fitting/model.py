"""The step `memlab.fit` runs on the virtual GPU: any Hugging Face causal LM built from its config,
set up for full, LoRA or QLoRA fine-tuning, with its optimizer, and one training step (or a prefill).

The model is made on the meta device and then given storage on the current default device (inside
`VirtualGPU.run` that is fake storage), as `memlab.llama.finetune_llama` does for Llama; this module
does the same for any `AutoModelForCausalLM` config and reuses its pieces (`give_storage`,
`memlab.quant.Linear4bitStandIn`).
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.nn as nn

from ..quant.llama import give_storage, silence_libraries
from ..quant.nf4 import Linear4bitStandIn
from ..core.track import active_trackers, phase, watch
from ..core.virtual_gpu import cuda_autocast

__all__ = ["AdamW8bitStandIn", "cut_layers", "fit_step", "precision_dtype", "selective_policy"]


# ----------------------------------------------------------------------------- the model's size and dtype
def cut_layers(cfg, layers: int):
    """A copy of cfg with `layers` decoder layers (per-layer lists cut to match)."""
    c = copy.deepcopy(cfg)
    c.num_hidden_layers = layers
    if isinstance(getattr(c, "layer_types", None), list):
        c.layer_types = c.layer_types[:layers]
    c.use_cache = False
    return c


def precision_dtype(precision: str) -> torch.dtype:
    """The dtype a plan's weights and activations are built in: fp32 for "fp32" and "amp" (autocast keeps
    fp32 weights), fp16 for "fp16", bf16 for the other 16-bit plans."""
    return {"fp32": torch.float32, "amp": torch.float32, "fp16": torch.float16}.get(precision, torch.bfloat16)



# ----------------------------------------------------------------------------- 8-bit AdamW, bytes only
class AdamW8bitStandIn(torch.optim.Optimizer):
    """Holds exactly the state `bitsandbytes.optim.AdamW8bit` holds (bitsandbytes 0.50,
    `Optimizer2State.init_state`), and updates nothing: for fake tensors, where bitsandbytes cannot run.

    Per parameter tensor of n elements (n >= min_8bit_size = 4096): state1, state2 uint8 (n each) and
    absmax1, absmax2 fp32 (ceil(n / 256) each), i.e. 2 n + 8 ceil(n / 256) bytes (Dettmers et al. 2022,
    "8-bit Optimizers via Block-wise Quantization"); smaller tensors keep fp32 state1/state2 (8 n bytes).
    The two 256-entry fp32 quantization maps (qmap1 "dynamic", qmap2 "udynamic") are made once and shared
    by every tensor. `step` is a Python int. The real update is one fused kernel per tensor: no scratch.
    """

    def __init__(self, params, lr: float = 1e-3, min_8bit_size: int = 4096, blocksize: int = 256):
        super().__init__(params, dict(lr=lr))
        self.min_8bit_size, self.blocksize, self._qmaps = min_8bit_size, blocksize, None

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["step"] = 0
                    if p.numel() < self.min_8bit_size:
                        st["state1"] = torch.zeros_like(p, dtype=torch.float32)
                        st["state2"] = torch.zeros_like(p, dtype=torch.float32)
                    else:
                        if self._qmaps is None:
                            self._qmaps = (torch.zeros(256, device=p.device), torch.zeros(256, device=p.device))
                        blocks = -(-p.numel() // self.blocksize)
                        st["state1"] = torch.zeros_like(p, dtype=torch.uint8)
                        st["qmap1"] = self._qmaps[0]
                        st["state2"] = torch.zeros_like(p, dtype=torch.uint8)
                        st["qmap2"] = self._qmaps[1]
                        st["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                        st["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
                st["step"] += 1
        return None


class _MasterWeights:
    """precision="mixed": 16-bit weights and gradients in the model, an fp32 master copy that the optimizer
    updates (Micikevicius et al. 2018; DeepSpeed's bf16/fp16 optimizer). At the step the 16-bit gradients
    are copied to fp32 (all at once, as DeepSpeed's flat fp32 gradient partition), the inner optimizer
    steps the masters, and the masters are copied back into the 16-bit weights."""

    def __init__(self, params, make):
        self.params = list(params)
        self.masters = [torch.empty(p.shape, dtype=torch.float32) for p in self.params]
        watch(tensors=self.masters, category="optimizer")
        for m in self.masters:
            m.requires_grad_(True)
        self.inner = make(self.masters)

    def step(self):
        for m, p in zip(self.masters, self.params):
            m.grad = p.grad.float() if p.grad is not None else None
        self.inner.step()
        # the fp32 gradient copies are the step's scratch (the optimizer's hook labelled them gradients)
        watch(tensors=[m.grad for m in self.masters if m.grad is not None], category="temporaries")
        for m, p in zip(self.masters, self.params):
            m.grad = None
            p.data.copy_(m.data)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


def make_optimizer(params, optimizer: str, precision: str):
    """torch AdamW (foreach=True, CUDA's default), plain SGD (foreach, no momentum: no state), or the
    8-bit stand-in; wrapped in fp32 master weights for precision="mixed" (trainable 16-bit params only)."""
    def make(ps):
        if optimizer == "adamw":
            return torch.optim.AdamW(ps, lr=1e-4, foreach=True)
        if optimizer == "sgd":
            return torch.optim.SGD(ps, lr=1e-3, foreach=True)
        return AdamW8bitStandIn(ps, lr=1e-4)
    params = list(params)
    if precision == "mixed" and any(p.dtype != torch.float32 for p in params):
        return _MasterWeights(params, make)
    return make(params)


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


def build_causal_lm(cfg, attention: str):
    """transformers' AutoModelForCausalLM for `cfg` with the model's own attention path: `attention` ("sdpa" or
    "eager"), or eager where the architecture has no sdpa path (Gemma-2 in transformers 5). Anything that is not
    a causal language model here fails in one line naming the architecture and what is supported."""
    import transformers
    from transformers import AutoModelForCausalLM
    kind = getattr(cfg, "model_type", "?")
    for impl in dict.fromkeys((attention, "eager")):
        cfg._attn_implementation = impl
        try:
            return AutoModelForCausalLM.from_config(cfg)
        except ValueError as e:
            if "attention implementation" in str(e) and impl != "eager":
                continue                     # no sdpa path for this architecture: its eager one
            if "Unrecognized configuration class" in str(e):
                raise ValueError(f"model: {kind!r} is not a causal language model in transformers "
                                 f"{transformers.__version__} (memlab.fit runs the AutoModelForCausalLM "
                                 f"architectures: decoder-only models such as Llama, Mistral, Qwen, Gemma, Phi, GPT-2, "
                                 f"Falcon, Mixtral; encoder-decoder models such as T5 and encoder-only "
                                 f"classifiers are not supported yet)"
                                 ) from None
            raise ValueError(f"model: transformers could not build {kind!r} from this config: {e}") from None
        except (KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"model: transformers could not build {kind!r} from this config "
                             f"({type(e).__name__}: {e})") from None
    raise AssertionError("not reached")


def decoder_layers(model) -> nn.ModuleList:
    """The model's stack of decoder layers, found generically: the ModuleList with num_hidden_layers entries."""
    n = model.config.num_hidden_layers
    stacks = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if not stacks:
        raise ValueError(f"model: no stack of {n} layers found in {type(model).__name__} (memlab.fit needs the "
                         f"decoder layers as one nn.ModuleList, as transformers' decoder-only models have them)")
    return stacks[0]


def skeleton(cfg, method: str, dtype: torch.dtype, r: int, attention: str):
    """The model on the meta device (shapes only; build it outside FakeTensorMode: some models make
    tensors in __init__), to be given storage by `materialise`. Returns (model, info):
    info = {"n_params": base parameters, "layer_params": one decoder layer's, "trainable": trainable}.

    full: every parameter in `dtype`, trainable. lora: frozen base in `dtype`, peft LoRA adapters (fp32,
    peft's default) of rank r on every linear layer but the output head (target_modules="all-linear").
    qlora: as lora, every adapted linear's base as an NF4 Linear4bitStandIn computing in `dtype`, the rest
    (embeddings, norms, head) in fp32 as peft.prepare_model_for_kbit_training leaves it."""
    silence_libraries()
    cfg = copy.deepcopy(cfg)
    with torch.device("meta"):
        model = build_causal_lm(cfg, attention)
        layers = decoder_layers(model)
        info = {"n_params": sum(p.numel() for p in model.parameters()),
                "layer_params": sum(p.numel() for p in layers[0].parameters())}
        if method != "full":
            from peft import LoraConfig, get_peft_model
            lc = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, bias="none", target_modules="all-linear",
                            task_type="CAUSAL_LM")
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
    return model, info


def materialise(model, method: str, dtype: torch.dtype, checkpointing: str, rest: torch.dtype = torch.float32):
    """Give a `skeleton` storage on the current default device (fake inside VirtualGPU.run): trainable
    parameters in `dtype` (full) or fp32 adapters, frozen ones in `dtype` (`rest` outside the 4-bit layers
    for qlora: fp32 by default); checkpointing "full" (every decoder layer) or "selective" (`selective_policy`)."""
    other = rest if method == "qlora" else dtype

    def dtype_of(mname, p):
        adapter = ".lora_" in f".{mname}"
        return (torch.float32 if adapter else other), adapter or method == "full"
    give_storage(model, dtype_of)
    if checkpointing != "none":
        kw = {"use_reentrant": False}
        if checkpointing == "selective":
            from torch.utils.checkpoint import create_selective_checkpoint_contexts
            kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_policy)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
    return model


# ----------------------------------------------------------------------------- the step
def _nbytes(ps) -> int:
    return sum(p.numel() * p.element_size() for p in ps)


def _sizes(model) -> dict:
    """Byte sizes ZeRO-3 and offload need: one decoder layer's tensors, the biggest single parameter, the
    trainable parameters' bytes and element size."""
    layers = decoder_layers(model)
    params = list(model.parameters())
    train = [p for p in params if p.requires_grad]
    layer = list(layers[0].parameters()) + list(layers[0].buffers())
    return {"gather_bytes": max(_nbytes(layer), max(_nbytes([p]) for p in params)),
            "gather_grad_bytes": max(_nbytes([p for p in layer if p.requires_grad]),
                                     max((_nbytes([p]) for p in train), default=0)),
            "grad_elem_bytes": train[0].element_size() if train else 2,
            "trainable_bytes": _nbytes(train), "weight_bytes": _nbytes(params) + _nbytes(model.buffers())}


def fit_step(model, info: dict, plan) -> dict:
    """One steady-state training step (plan.mode="train": the optimizer's state made first, as the first step
    makes it, then min(2, steps_per_batch) micro-batches of forward and backward - the second one runs beside
    the accumulated gradients - then the optimizer step) or one
    prefill (mode="inference": no_grad forward of (batch, seq) tokens with a KV cache, the logits of the
    last token only, as generate() computes them). Phases: "forward", "backward", "step". Returns the
    model's info plus "states": parameters/gradients/optimizer bytes just after the optimizer step.
    `model` is a `skeleton` (each call needs a fresh one: it is given storage here)."""
    with unpacked_sequences():
        return _fit_step(model, info, plan)


def _fit_step(model, info: dict, plan) -> dict:
    dtype = precision_dtype(plan.precision)
    info = dict(info)
    with phase("load"):
        rest = torch.float32 if getattr(plan, "qlora_rest", "fp32") == "fp32" else dtype
        model = materialise(model, plan.method, dtype, plan.checkpointing if plan.mode == "train" else "none", rest)
        info.update(_sizes(model))
    autocast = cuda_autocast(torch.bfloat16) if plan.precision == "amp" else None
    V = model.config.vocab_size
    if plan.mode == "inference":     # the KV cache outlives the forward: the tracker calls it activations
        model.eval()
        watch(model)
        model.config.use_cache = True
        x = torch.randint(0, V, (plan.batch, plan.seq))
        with torch.no_grad(), phase("forward"), (autocast or _null()):
            out = model(input_ids=x, use_cache=True, logits_to_keep=1)
        del out
        return info
    trainable = [p for p in model.parameters() if p.requires_grad]
    if getattr(plan, "step_in_backward", False):
        return _step_in_backward(model, trainable, info, plan, autocast)
    with phase("load"):
        opt = make_optimizer(trainable, plan.optimizer, plan.precision)
        watch(model, getattr(opt, "inner", opt))
    # every step after the first runs its forward and backward beside the optimizer's state, which the first
    # step creates: one step on zero gradients makes it now, so the phases below are the steady state's
    # (tests/test_fit.py checks this against two real steps)
    with phase("step"):
        for p in trainable:
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
    for i in range(min(2, plan.steps_per_batch)):
        x = torch.randint(0, V, (plan.micro, plan.seq))
        with phase("forward"), (autocast or _null()):
            if getattr(plan, "loss", "full") == "chunked":
                loss = chunked_causal_lm_loss(model, x)
            else:
                loss = model(input_ids=x, labels=x).loss
        with phase("backward"):
            loss.backward()
        del loss, x
    watch(tensors=[p.grad for p in trainable if p.grad is not None], category="gradients")
    with phase("step"):
        opt.step()
        trk = active_trackers()
        info["states"] = {k: v for k, v in trk[-1].breakdown().items()
                          if k in ("parameters", "gradients", "optimizer")} if trk else {}
        opt.zero_grad(set_to_none=True)
    return info


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
    V = model.config.vocab_size
    for _ in range(2):
        x = torch.randint(0, V, (plan.micro, plan.seq))
        with phase("forward"), (autocast or _null()):
            loss = chunked_causal_lm_loss(model, x) if getattr(plan, "loss", "full") == "chunked" else \
                model(input_ids=x, labels=x).loss
        with phase("backward"):
            loss.backward()
        del loss, x
    for h in hooks:
        h.remove()
    trk = active_trackers()
    info["states"] = {k: v for k, v in trk[-1].breakdown().items()
                      if k in ("parameters", "gradients", "optimizer")} if trk else {}
    return info


LOSS_CHUNKS = 8      # torchtune's CEWithChunkedOutputLoss default (num_output_chunks)


def chunked_causal_lm_loss(model, x, chunks: int = LOSS_CHUNKS):
    """Next-token cross-entropy of a causal LM with the output head applied chunk by chunk along the sequence, each
    chunk's logits upcast to fp32 on their own (torchtune's CEWithChunkedOutputLoss): no (B, T, V) logits tensor,
    fp32 or 16-bit, is ever whole. The mean over the B x (T - 1) predicted tokens, as HF's loss with labels=x."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    h = base.get_decoder()(input_ids=x).last_hidden_state[:, :-1]      # (B, T-1, C): positions that predict
    y = x[:, 1:]                                                        # (B, T-1): the next tokens
    head = base.get_output_embeddings()
    total = 0
    for hc, yc in zip(h.chunk(chunks, dim=1), y.chunk(chunks, dim=1)):
        logits = head(hc).float()                                       # (B, T/chunks, V) fp32: one chunk only
        total = total + torch.nn.functional.cross_entropy(logits.flatten(0, 1), yc.flatten(), reduction="sum")
    return total / y.numel()


@contextlib.contextmanager
def unpacked_sequences():
    """While the step runs: transformers' check for packed sequences (several sequences in one row, found from
    position_ids) answers "none", as it does for the full, unpadded rows `fit` runs - with the same temporaries.
    Without this, fake tensors look like a trace to transformers, which then assumes packing and builds a
    (B, 1, T, T) mask that the real run never builds. Masks a real run does build (sliding windows, models that
    always build one) are built as the model builds them."""
    import transformers.masking_utils as mu
    real = mu.find_packed_sequence_indices

    def none_packed(position_ids):
        first = position_ids[:, :1] - 1
        (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
        return None
    mu.find_packed_sequence_indices = none_packed
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = real


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
