"""Exercise 07's runs, in the learner's process. They make the library shortcuts unusable for the learner's
own call: bitsandbytes' quantization functions and peft's entry points raise, and any `bitsandbytes::`
operator reaching the dispatcher is recorded and refused."""

from __future__ import annotations

import contextlib
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..common import memlab_files, no_calls_into
from .inputs import DQ_BLOCK, absmax_input, base_linear, lora_tensors, nf4_input

_BNB_FUNCS = ("quantize_4bit", "dequantize_4bit", "quantize_nf4", "dequantize_nf4", "quantize_fp4",
              "dequantize_fp4", "quantize_blockwise", "dequantize_blockwise", "quantize", "dequantize")


# ----------------------------------------------------------------------------- keeping the libraries out
class _LibraryOps(TorchDispatchMode):
    """Records every bitsandbytes:: operator that reaches the dispatcher."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if getattr(func, "namespace", "") == "bitsandbytes":
            self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _no_bitsandbytes(task):
    """bitsandbytes.functional's quantization entry points raise; its operators are recorded."""
    import bitsandbytes.functional as bf

    def refuse(name):
        def f(*a, **k):
            raise AssertionError(f"{task} asks you to write the quantization yourself: bitsandbytes.functional."
                                 f"{name} (and every bitsandbytes quantization call) is off limits here")
        return f

    saved = {n: getattr(bf, n) for n in _BNB_FUNCS if hasattr(bf, n)}
    for n in saved:
        setattr(bf, n, refuse(n))
    mode = _LibraryOps()
    try:
        with mode, no_calls_into(task, memlab_files("quant/nf4.py", "quant/qlora.py", "quant/llama.py"),
                                 "memlab's quantization and QLoRA helpers"):
            yield mode
    finally:
        for n, f in saved.items():
            setattr(bf, n, f)


@contextlib.contextmanager
def _no_peft(task):
    """If peft is loaded, its LoRA entry points raise; the caller also checks it was not loaded meanwhile."""
    patched = []
    if "peft" in sys.modules:
        import peft
        import peft.tuners.lora as pl
        import peft.tuners.lora.layer as pll

        def refuse(*a, **k):
            raise AssertionError(f"{task} asks you to write the LoRA layer yourself: peft (get_peft_model, "
                                 f"LoraModel, lora.Linear) is off limits here")

        for obj, name in ((peft, "get_peft_model"), (pl.LoraModel, "__init__"), (pll.Linear, "__init__"),
                          (pll.Linear, "forward"), (pll.LoraLayer, "update_layer"), (peft.PeftModel, "__init__")):
            if hasattr(obj, name):
                patched.append((obj, name, getattr(obj, name)))
                setattr(obj, name, refuse)
    try:
        yield
    finally:
        for obj, name, f in reversed(patched):
            setattr(obj, name, f)


def _tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


# ----------------------------------------------------------------------------- task 7.1: NF4 quantize/dequantize
def nf4_run(case, nf4_quantize, nf4_dequantize):
    import bitsandbytes.functional as bf
    x = nf4_input(case)
    bs = case["blocksize"]
    p_ref, st = bf.quantize_4bit(x, blocksize=bs, quant_type="nf4")     # input for the learner's dequantize
    p_ref, am_ref = p_ref.flatten().clone(), st.absmax.clone()
    with _no_bitsandbytes("task7_1_nf4_quantize") as mode:
        res = nf4_quantize(x.clone(), blocksize=bs)
        if not (isinstance(res, tuple) and len(res) == 2):
            raise TypeError(f"nf4_quantize must return a tuple (packed, absmax), got {type(res).__name__}")
        packed, absmax = _tensor("packed", res[0]), _tensor("absmax", res[1])
        deq = _tensor("nf4_dequantize(...)", nf4_dequantize(p_ref.clone(), am_ref.clone(), tuple(x.shape),
                                                           blocksize=bs))
    return {"packed": packed.flatten().tolist(), "packed_dtype": str(packed.dtype), "absmax": absmax.tolist(),
            "absmax_dtype": str(absmax.dtype), "deq": deq.float().flatten().tolist(), "deq_shape": list(deq.shape),
            "deq_dtype": str(deq.dtype), "ops": sorted(mode.ops)}


# ----------------------------------------------------------------------------- task 7.2: double quantization
def dq_run(case, double_quantize, double_dequantize, nf4_bits_per_param):
    import bitsandbytes.functional as bf
    if case["what"] == "bpp":
        with _no_bitsandbytes("task7_2_double_quant") as mode:
            v = nf4_bits_per_param(case["n"], blocksize=case["blocksize"], double_quant=case["double_quant"])
        return {"bpp": float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v),
                "ops": sorted(mode.ops)}
    a = absmax_input(case)
    code = bf.create_dynamic_map(signed=True)
    q_ref, st2 = bf.quantize_blockwise(a - a.mean(), blocksize=DQ_BLOCK)
    with _no_bitsandbytes("task7_2_double_quant") as mode:
        res = double_quantize(a.clone(), code.clone())
        if not (isinstance(res, tuple) and len(res) == 3):
            raise TypeError(f"double_quantize must return a tuple (qabsmax, absmax2, offset), got {type(res).__name__}")
        q, a2, off = _tensor("qabsmax", res[0]), _tensor("absmax2", res[1]), res[2]
        deq = _tensor("double_dequantize(...)", double_dequantize(q_ref.clone(), st2.absmax.clone(), a.mean(),
                                                                  code.clone()))
    return {"q": q.tolist(), "q_dtype": str(q.dtype), "absmax2": a2.tolist(), "absmax2_dtype": str(a2.dtype),
            "offset": float(off), "deq": deq.tolist(), "deq_dtype": str(deq.dtype), "ops": sorted(mode.ops)}


# ----------------------------------------------------------------------------- task 7.3: LoRA linear
def lora_run(case, LoRALinear):
    import torch.nn as nn
    base = base_linear(case)
    A, B, x, gout = lora_tensors(case)
    had_peft = "peft" in sys.modules
    with _no_peft("task7_3_lora_linear"), _no_bitsandbytes("task7_3_lora_linear") as mode:
        torch.manual_seed(case["seed"] + 3)                     # A's initialisation: reproducible per case
        layer = LoRALinear(base, case["r"], case["alpha"], case["dropout"])
        if not isinstance(layer, nn.Module):
            raise TypeError(f"LoRALinear(...) must be an nn.Module, got {type(layer).__name__}")
        classes = sorted({c.__module__ for m in layer.modules() for c in type(m).__mro__})
        for name in ("base", "lora_A", "lora_B"):
            if not hasattr(layer, name):
                raise AttributeError(f"LoRALinear must have an attribute `{name}`")
        if layer.base is not base:
            raise AssertionError("LoRALinear must keep the Linear it was given as `self.base` (not a copy)")
        a0, b0 = _tensor("lora_A", layer.lora_A), _tensor("lora_B", layer.lora_B)
        init = {"A_shape": list(a0.shape), "B_shape": list(b0.shape), "A_nonzero": bool((a0 != 0).any()),
                "B_zero": bool((b0 == 0).all()),
                "A_absmax": float(a0.detach().abs().max()) if a0.numel() else 0.0,
                "A_rms": float(a0.detach().double().pow(2).mean().sqrt()) if a0.numel() else 0.0,
                "A_finite": bool(torch.isfinite(a0.detach()).all())}
        trainable = sorted([n, list(p.shape)] for n, p in layer.named_parameters() if p.requires_grad)
        layer.eval()
        with torch.no_grad():
            out_init = layer(x.clone())
        with torch.no_grad():
            layer.lora_A.copy_(A)
            layer.lora_B.copy_(B)
        layer.train()
        xg = x.clone().requires_grad_(True)
        torch.manual_seed(case["seed"] + 1)                     # the dropout mask: same draw as the reference
        out = layer(xg)
        out.backward(gout)
        layer.eval()
        with torch.no_grad():
            out_eval = layer(x.clone())
        weight, ptr = base.weight, base.weight.data_ptr()
        layer.merge()
        merged_in_place = base.weight is weight and weight.data_ptr() == ptr
        with torch.no_grad():
            out_merged = layer(x.clone())
    grads = {"A": None if layer.lora_A.grad is None else layer.lora_A.grad.tolist(),
             "B": None if layer.lora_B.grad is None else layer.lora_B.grad.tolist(),
             "x": None if xg.grad is None else xg.grad.tolist(),
             "W": base.weight.grad is not None, "b": base.bias is not None and base.bias.grad is not None}
    return {"init": init, "trainable": trainable, "out_init": out_init.tolist(), "out": out.tolist(),
            "grads": grads, "out_eval": out_eval.tolist(), "merged_W": weight.detach().tolist(),
            "merged_in_place": merged_in_place,
            "base_requires_grad": bool(base.weight.requires_grad), "out_merged": out_merged.tolist(),
            "classes": classes, "peft_loaded": (not had_peft) and "peft" in sys.modules, "ops": sorted(mode.ops)}


# ----------------------------------------------------------------------------- task 7.4: QLoRA memory
def qlora_run(case, qlora_memory):
    with _no_bitsandbytes("task7_4_qlora_memory") as mode:
        res = qlora_memory(dict(case["cfg"]), r=case["r"], batch=case["batch"], seq=case["seq"],
                           checkpointing=case["checkpointing"])
    if not isinstance(res, dict):
        raise TypeError(f"qlora_memory must return a dict, got {type(res).__name__}")
    return {"res": {str(k): (v if type(v) is int else repr(v)) for k, v in res.items()}, "ops": sorted(mode.ops)}
