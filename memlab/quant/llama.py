"""Llama models for the quantization lesson: a tiny real one loaded through
transformers' BitsAndBytesConfig (CPU), a full-size one for the virtual GPU built
from shapes alone (4-bit projections as `memlab.quant.Linear4bitStandIn`, adapters
from peft), one training step with phase marks, and what a model stores by kind.

Importing this module imports only torch; transformers, peft and bitsandbytes load
inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import tempfile
import warnings

import torch
import torch.nn as nn

from .qlora import PROJECTIONS, _dims, _targets
from .nf4 import Linear4bitStandIn
from ..core.track import phase
from ..core.validate import number_in, one_of, pos_int

__all__ = ["silence_libraries", "quant_tensors", "stored_bytes", "tiny_llama", "finetune_llama", "causal_lm_step"]


# ----------------------------------------------------------------------------- what a model stores
def quant_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors bitsandbytes keeps outside parameters and buffers: each 4-bit
    weight's QuantState (absmax, offset, code tables, nested state) and each 8-bit
    weight's row scales `SCB`. Register them with a tracker so they count:
    `memlab.watch(tensors=quant_tensors(model), category="parameters")`."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    out = []
    for m in model.modules():
        w = m.__dict__.get("_parameters", {}).get("weight")
        qs = getattr(w, "quant_state", None)
        if qs is not None:
            out += [t for t in (qs.absmax, qs.code, qs.offset) if t is not None]
            if qs.state2 is not None:
                out += [t for t in (qs.state2.absmax, qs.state2.code) if t is not None]
        scb = getattr(w, "SCB", None)
        if isinstance(scb, torch.Tensor):
            out.append(scb)
    return out


def stored_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes a model keeps, by kind, each storage counted once:

      quantized     int8/uint8 weights (4-bit codes, 8-bit weights)
      constants     quantization constants (absmax, nested state, code tables, row scales)
      trainable     floating-point parameters with requires_grad (e.g. LoRA adapters)
      frozen        floating-point parameters without (embeddings, norms, a frozen base)
      buffers       other buffers (e.g. rotary tables)
      total
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    seen: set[int] = set()
    out = dict.fromkeys(("quantized", "constants", "trainable", "frozen", "buffers"), 0)

    def add(t, kind):
        st = t.untyped_storage()
        if st._cdata not in seen:
            seen.add(st._cdata)
            out[kind] += st.nbytes()

    for p in model.parameters():
        add(p, "quantized" if not p.is_floating_point() else ("trainable" if p.requires_grad else "frozen"))
    for t in quant_tensors(model):
        add(t, "constants")
    for m in model.modules():
        stand_in = isinstance(m, Linear4bitStandIn)
        for name, b in m.named_buffers(recurse=False):
            if b is not None:
                add(b, "constants" if stand_in else "buffers")
    out["total"] = sum(out.values())
    return out


# ----------------------------------------------------------------------------- quiet libraries
class _DropRecords(logging.Filter):
    def filter(self, record):
        return False


def silence_libraries():
    """Keep bitsandbytes/transformers/peft/DeepSpeed chatter out of lesson outputs:
    transformers' logging to errors only and no progress bars, the DeepSpeed
    accelerator banner dropped, and these libraries' warnings ignored. Call once."""
    with contextlib.suppress(ImportError):
        import transformers
        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    for name in ("DeepSpeed", "bitsandbytes", "peft", "accelerate"):
        lg = logging.getLogger(name)
        if not any(isinstance(f, _DropRecords) for f in lg.filters):
            lg.addFilter(_DropRecords())
        # a filter sees only its own logger's records; the level also holds the modules' loggers below it
        # (bitsandbytes.backends.cpu.ops warns at import when an optional CPU kernel package is missing)
        lg.setLevel(max(lg.level, logging.ERROR))
    for module in ("bitsandbytes", "peft", "transformers", "accelerate", "deepspeed"):
        warnings.filterwarnings("ignore", module=module + r"(\..*)?")
    warnings.filterwarnings("ignore", message=r"MatMul8bitLt")


# ----------------------------------------------------------------------------- models
def tiny_llama(quant: str | None = None, *, dtype: torch.dtype = torch.float32, double_quant: bool = True,
               compute_dtype: torch.dtype = torch.bfloat16, device: str = "cpu", seed: int = 0, **config_kw):
    """A randomly initialised `LlamaForCausalLM` from `memlab.core.models.tiny_llama_config(**config_kw)`.

    quant=None builds it in `dtype`. quant="nf4", "fp4" or "int8" saves it to a temporary
    folder and loads it back with `transformers.BitsAndBytesConfig` (load_in_4bit with that
    quant type, `bnb_4bit_use_double_quant=double_quant`, `bnb_4bit_compute_dtype=compute_dtype`;
    or load_in_8bit), onto `device`: the path a downloaded checkpoint takes, without a download.
    """
    one_of("quant", quant, (None, "nf4", "fp4", "int8"), what="None, 'nf4', 'fp4' or 'int8'")
    one_of("dtype", dtype, (torch.float32, torch.float16, torch.bfloat16), what="torch.float32, float16 or bfloat16")
    one_of("device", device, ("cpu", "cuda"), what="'cpu' or 'cuda'")
    silence_libraries()
    from transformers import BitsAndBytesConfig, LlamaForCausalLM
    from ..core.models import tiny_llama_config
    config_kw.setdefault("use_cache", False)
    cfg = tiny_llama_config(**config_kw)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype)
    if quant is None:
        return model.to(device)
    if quant == "int8":
        qc = BitsAndBytesConfig(load_in_8bit=True)
    else:
        qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_compute_dtype=compute_dtype,
                                bnb_4bit_use_double_quant=double_quant)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        del model
        return LlamaForCausalLM.from_pretrained(d, quantization_config=qc, dtype=dtype, device_map=device)


def _swap_meta(module: nn.Module, name: str, dtype: torch.dtype, trainable: bool, buffer: bool = False):
    t = (module._buffers if buffer else module._parameters)[name]
    new = torch.zeros(t.shape, dtype=dtype if t.is_floating_point() else t.dtype)
    if buffer:
        module._buffers[name] = new
        return new
    # assign directly: a meta Parameter cannot be swapped for a fake one through .to()
    module._parameters[name] = nn.Parameter(new, requires_grad=trainable)
    return module._parameters[name]


def give_storage(model: nn.Module, dtype_of) -> None:
    """Swap every meta parameter and buffer of `model` for zeros on the current default device (fake tensors
    inside `VirtualGPU.run`). dtype_of(module_name, meta_param) -> (dtype, trainable) for floating parameters;
    integer ones keep their dtype. A parameter shared by two modules (an input embedding tied to the output
    head) stays one tensor, as in the real model."""
    swapped = {}
    for mname, m in model.named_modules():
        for pname, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) in swapped:
                m._parameters[pname] = swapped[id(p)]
            elif p.device.type == "meta":
                dtype, trainable = dtype_of(mname, p)
                swapped[id(p)] = _swap_meta(m, pname, dtype if p.is_floating_point() else p.dtype, trainable)
        for bname, b in list(m._buffers.items()):
            if b is not None and b.device.type == "meta":
                _swap_meta(m, bname, b.dtype, False, buffer=True)


def _causal_sdpa() -> str:
    """transformers' sdpa attention, registered under a second name whose mask function builds only the masks a
    real run without padding builds: none for plain causal attention (sdpa runs with is_causal=True), and the
    (B, 1, T, T) boolean mask for a sliding window shorter than the sequence (Mistral, Gemma-2, Qwen2 with
    use_sliding_window), as transformers' own sdpa_mask does. (transformers treats fake tensors like a trace
    and would build a mask in every case.) Only for full, unpadded sequences."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    def mask(*args, **kwargs):
        local = kwargs.get("local_size")
        kv_length = kwargs.get("kv_length", args[2] if len(args) > 2 else None)
        if local is None or kv_length is None or kv_length < local:
            return None                      # what _ignore_causal_mask_sdpa decides for an unpadded batch
        kwargs["allow_is_causal_skip"] = False
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register("memlab_causal_sdpa", sdpa_attention_forward)
    AttentionMaskInterface.register("memlab_causal_sdpa", mask)
    return "memlab_causal_sdpa"


def finetune_llama(cfg, method: str = "qlora", *, r: int = 16, targets=PROJECTIONS, lora_alpha: int | None = None,
                   lora_dropout: float = 0.0, checkpointing: bool = True, double_quant: bool = True,
                   dtype: torch.dtype = torch.bfloat16):
    """A LlamaForCausalLM set up for fine-tuning, built on the meta device and then
    given real storage on the current default device - so inside `VirtualGPU.run` its
    tensors are fake and a 7B model costs nothing. Values are zeros: it models bytes.

    method="full": every parameter in `dtype`, all trainable.
    method="lora": frozen base in `dtype`, peft LoRA adapters (fp32, peft's default) on `targets`.
    method="qlora": the projections as `Linear4bitStandIn` (NF4 bytes, compute in `dtype`),
    embeddings/norms/lm_head in fp32 as `peft.prepare_model_for_kbit_training` leaves them, fp32 adapters.
    Returns the model (a peft model for lora/qlora); checkpointing uses use_reentrant=False.
    """
    one_of("method", method, ("full", "lora", "qlora"), what="'full', 'lora' or 'qlora'")
    _dims(cfg)
    pos_int("r", r)
    number_in("lora_dropout", lora_dropout, 0, 1, what="in [0, 1)")
    silence_libraries()
    from transformers import LlamaForCausalLM
    cfg = copy.deepcopy(cfg)
    cfg._attn_implementation = _causal_sdpa()
    with torch.device("meta"):          # shapes only; the adapters are made on meta too
        model = LlamaForCausalLM(cfg)
        if method != "full":
            from peft import LoraConfig, get_peft_model
            lc = LoraConfig(r=r, lora_alpha=lora_alpha or 2 * r, lora_dropout=lora_dropout, bias="none",
                            target_modules=_targets(targets), task_type="CAUSAL_LM")
            model = get_peft_model(model, lc)
    other = torch.float32 if method == "qlora" else dtype
    for mname, m in list(model.named_modules()):
        for cname, child in list(m.named_children()):
            if method == "qlora" and cname in PROJECTIONS + ("base_layer",) and type(child) is nn.Linear:
                setattr(m, cname, Linear4bitStandIn(child.in_features, child.out_features, compute_dtype=dtype,
                                                    quant_dtype=dtype, double_quant=double_quant))
    def dtype_of(mname, p):
        adapter = ".lora_" in f".{mname}"
        return (torch.float32 if adapter else other), adapter or method == "full"
    give_storage(model, dtype_of)
    if checkpointing:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def causal_lm_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, input_ids: torch.Tensor) -> float:
    """One language-model training step with memlab phase marks: forward with
    labels=input_ids, backward, optimizer step, zero_grad(set_to_none=True)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long or input_ids.dim() != 2:
        raise TypeError("input_ids must be a (batch, seq) torch.long tensor")
    with phase("forward"):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    with phase("backward"):
        loss.backward()
    from torch._subclasses.fake_tensor import FakeTensor
    value = float("nan") if isinstance(loss, FakeTensor) else loss.item()
    del loss
    if optimizer is not None:
        with phase("step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return value
