"""References for exercise 07, computed by the judge (never the solution's code); the inputs they share with
the runs are rebuilt from the case by cases.py.

Tasks 7.1-7.3: bitsandbytes' own NF4 code tables and quantization, peft's LoRA layer on a one-Linear module.

Task 7.4 (QLoRA memory). Model states: a real tiny Llama (transformers, bf16) whose projections bitsandbytes
quantizes (NF4, double quantization: the bytes of the tensors it returns), peft LoRA adapters in bf16 on all
seven projections, and one AdamW step under memlab's tracker (`measured_states`); at full size the same
per-tensor sums written plainly (`states_closed_form`, itself compared with the measurement on every tiny case).

Activations (`measured_activations`): memlab.quant.llama.finetune_llama(method="qlora") builds the model from
the config (transformers' LlamaForCausalLM, the projections as memlab.quant.Linear4bitStandIn, which allocates
what bitsandbytes' Linear4bit allocates, peft LoRA); every other parameter and the adapters are cast to bf16,
the recipe of the task. One training step runs under memlab.MemoryTracker:

  kept        the tracker's `activations` category when the forward phase ends: every tensor the forward
              made that is still alive, i.e. what autograd saved for the backward (and checkpoint's inputs);
  recomputed  with checkpointing, the largest growth of the live bytes across one layer's recomputation in
              the backward, less the layer's output (checkpoint's early stop is turned off so that the
              recomputation returns normally; it then holds exactly what the layer saves again);
  activations kept + recomputed.

A tiny config is measured on real CPU tensors at its own depth. A full-size config runs on memlab.VirtualGPU
(fake tensors): cut to 1 and 2 layers, and extended linearly to L layers, as memlab.sharding.zero_scale.per_gpu_peaks
does (every layer after the first is the same, so `kept` grows by the same bytes per layer and `recomputed`
is the same for every L >= 2); tests/test_checks_ex07.py checks that extension against a full-depth run.
Measurements are cached per case, so a class's learners share them.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint

import memlab

from .cases import GLOBAL_STATE
from .inputs import DQ_BLOCK, NF4_BLOCK, base_linear, lora_tensors

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_STATES: dict = {}
_ACTS: dict = {}


# ----------------------------------------------------------------------------- tasks 7.2 and 7.3
def bpp_reference(n, blocksize, double_quant):
    """Storage bits per parameter of an NF4 tensor of n values: the packed codes, plus either one float32
    absmax per block, or (double quantization) one uint8 code per block, one float32 absmax per 256 blocks
    and the float32 offset. The code books are shared constants, not counted. Below 300k values it is
    measured on bitsandbytes' own tensors; above, the same sum is written plainly."""
    if n <= 300_000:
        import bitsandbytes.functional as bf
        p, st = bf.quantize_4bit(torch.randn(n, generator=torch.Generator().manual_seed(n)), blocksize=blocksize,
                                 quant_type="nf4", compress_statistics=double_quant)
        nbytes = p.numel() * p.element_size() + st.absmax.numel() * st.absmax.element_size()
        if double_quant:
            nbytes += st.state2.absmax.numel() * st.state2.absmax.element_size() + st.offset.numel() * 4
        return 8 * nbytes / n
    nb = -(-n // blocksize)
    nbytes = -(-n // 2) + (nb + 4 * -(-nb // DQ_BLOCK) + 4 if double_quant else 4 * nb)
    return 8 * nbytes / n


def peft_reference(case):
    """peft's LoRA layer on a one-Linear module with the same base weights, A and B; output and
    gradients in train mode (dropout mask drawn after the same seed), eval output, merged weight."""
    import torch.nn as nn
    from peft import LoraConfig, get_peft_model

    class One(nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.proj = lin

        def forward(self, x):
            return self.proj(x)

    model = get_peft_model(One(base_linear(case)), LoraConfig(r=case["r"], lora_alpha=case["alpha"],
                                                               lora_dropout=case["dropout"],
                                                               target_modules=["proj"]))
    lin = model.base_model.model.proj
    A, B, x, gout = lora_tensors(case)
    with torch.no_grad():
        lin.lora_A["default"].weight.copy_(A)
        lin.lora_B["default"].weight.copy_(B)
    model.train()
    xg = x.clone().requires_grad_(True)
    torch.manual_seed(case["seed"] + 1)
    out = model(xg)
    out.backward(gout)
    model.eval()
    with torch.no_grad():
        out_eval = model(x.clone())
    lin.merge()
    return {"out": out.detach(), "A": lin.lora_A["default"].weight.grad, "B": lin.lora_B["default"].weight.grad,
            "x": xg.grad, "out_eval": out_eval, "merged_W": lin.base_layer.weight.detach().clone()}


# ----------------------------------------------------------------------------- task 7.4: model states
def proj_shapes(cfg):
    """(d_out, d_in) of the seven projections of one Llama decoder layer."""
    C, F = cfg["hidden"], cfg["intermediate"]
    kv = cfg["kv_heads"] * (C // cfg["heads"])
    return [(C, C), (kv, C), (kv, C), (C, C), (F, C), (F, C), (C, F)]


def states_closed_form(cfg, r):
    """The model-state bytes, tensor by tensor: bitsandbytes' NF4 tensors with double quantization per
    projection (codes, uint8 scales, fp32 absmax2, fp32 offset), bf16 embeddings/lm_head/norms, bf16
    adapters and gradients, AdamW's bf16 exp_avg and exp_avg_sq and a 4-byte step per adapter tensor."""
    C, L, V = cfg["hidden"], cfg["layers"], cfg["vocab"]
    nf4 = 0
    for o, i in proj_shapes(cfg):
        n = o * i
        blocks = -(-n // NF4_BLOCK)
        nf4 += -(-n // 2) + blocks + 4 * -(-blocks // DQ_BLOCK) + 4
    n_ad = L * sum(r * (o + i) for o, i in proj_shapes(cfg))
    return {"base_nf4": L * nf4, "base_16bit": 2 * (2 * V * C + (2 * L + 1) * C), "adapters": 2 * n_ad,
            "gradients": 2 * n_ad, "optimizer": 4 * n_ad + 4 * (L * 7 * 2)}


def _key(cfg, *rest):
    return (tuple(sorted(cfg.items())), *rest)


def llama_config(cfg, seq=64):
    from transformers import LlamaConfig
    return LlamaConfig(hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                       num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                       num_key_value_heads=cfg["kv_heads"], vocab_size=cfg["vocab"],
                       max_position_embeddings=max(64, seq), tie_word_embeddings=False, use_cache=False)


def measured_states(cfg, r):
    """Model-state bytes of a real tiny Llama: each projection quantized by bitsandbytes (NF4, double
    quantization; the bytes of the tensors it returns), the other weights in bf16, peft LoRA adapters in
    bf16 on all seven projections, one AdamW step measured by memlab's tracker."""
    key = _key(cfg, r)
    with GLOBAL_STATE:
        if key not in _STATES:
            _STATES[key] = _measure_states(cfg, r)
    return dict(_STATES[key])


def _measure_states(cfg, r):
    import bitsandbytes.functional as bf
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM(llama_config(cfg)).to(torch.bfloat16)
    nf4 = base16 = 0
    for name, p in model.named_parameters():
        if name.split(".")[-2] in PROJ:
            q, st = bf.quantize_4bit(p.detach().float(), blocksize=NF4_BLOCK, quant_type="nf4",
                                     compress_statistics=True)
            nf4 += q.nbytes + st.absmax.nbytes + st.state2.absmax.nbytes + st.offset.nbytes
        else:
            base16 += p.nbytes
    pm = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=list(PROJ)),
                        autocast_adapter_dtype=False)
    trainable = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    ids = torch.randint(0, cfg["vocab"], (2, 8), generator=torch.Generator().manual_seed(0))
    tracker = memlab.MemoryTracker(pm, opt)
    with tracker:
        pm(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    bd = tracker.breakdown()
    return {"base_nf4": int(nf4), "base_16bit": int(base16), "adapters": sum(p.nbytes for p in trainable),
            "gradients": bd["gradients"], "optimizer": bd["optimizer"]}


# ----------------------------------------------------------------------------- task 7.4: activations
def qlora_model(cfg, r, seq, checkpointing):
    """finetune_llama(method="qlora") with everything but the 4-bit projections in bf16."""
    from memlab.quant.llama import finetune_llama
    from memlab.quant import Linear4bitStandIn
    model = finetune_llama(llama_config(cfg, seq), "qlora", r=r, checkpointing=checkpointing,
                           dtype=torch.bfloat16)
    for m in model.modules():
        if not isinstance(m, Linear4bitStandIn):
            for p in m._parameters.values():
                if p is not None and p.is_floating_point():
                    p.data = p.data.to(torch.bfloat16)
    return model


def _tensors(out):
    return [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]


def activation_step(cfg, r, batch, seq, checkpointing, out):
    """One QLoRA training step (forward, backward, AdamW step); writes `kept` and `recomputed` (bytes,
    see the module docstring) into `out`. Runs inside a MemoryTracker (VirtualGPU.run makes one)."""
    tracker = memlab.core.track.active_trackers()[-1]
    model = qlora_model(cfg, r, seq, checkpointing)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    tracker.watch(model, opt)
    state = {"backward": False, "recomputed": 0}
    def counted(fn):              # fn is the layer's forward; a checkpoint calls it again in the backward
        def f(*a, **k):
            if not state["backward"]:
                return fn(*a, **k)
            before = tracker.current
            out = fn(*a, **k)         # the whole layer runs again (early stop off): its output is returned
            grown = tracker.current - before - sum(t.untyped_storage().nbytes() for t in _tensors(out))
            state["recomputed"] = max(state["recomputed"], grown)
            return out
        return f
    for layer in model.get_base_model().model.layers:
        if checkpointing:             # transformers' layers call self._gradient_checkpointing_func(forward, ...)
            layer._gradient_checkpointing_func = (lambda fn, *a, _ck=layer._gradient_checkpointing_func, **k:
                                                  _ck(counted(fn), *a, **k))
    ids = torch.randint(0, cfg["vocab"], (batch, seq))
    with memlab.phase("forward"), torch.utils.checkpoint.set_checkpoint_early_stop(False):
        loss = model(input_ids=ids, labels=ids).loss
    out["kept"] = tracker.breakdown()["activations"]
    state["backward"] = True
    with memlab.phase("backward"):
        loss.backward()
    del loss
    with memlab.phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["recomputed"] = state["recomputed"] if checkpointing else 0


def measure_tiny(cfg, r, batch, seq, checkpointing):
    """{"kept", "recomputed", "activations"} of a tiny config, real CPU tensors, at its own depth."""
    out: dict = {}
    with memlab.MemoryTracker():
        activation_step(cfg, r, batch, seq, checkpointing, out)
    return out


def measure_virtual(cfg, r, batch, seq, checkpointing):
    """The same on memlab.VirtualGPU, from 1- and 2-layer cuts extended linearly to cfg["layers"]."""
    gpu = memlab.VirtualGPU(capacity_gb=2**20)
    cuts = []
    for k in (1, 2):
        out: dict = {}
        gpu.run(activation_step, dict(cfg, layers=k), r, batch, seq, checkpointing, out)
        cuts.append(out)
    L = cfg["layers"]
    kept = cuts[0]["kept"] + (L - 1) * (cuts[1]["kept"] - cuts[0]["kept"])
    return {"kept": kept, "recomputed": cuts[0 if L == 1 else 1]["recomputed"]}


def measured_activations(cfg, r, batch, seq, checkpointing, virtual):
    """Measured activation bytes (see the module docstring), cached per case across learners."""
    key = _key(cfg, r, batch, seq, bool(checkpointing), bool(virtual))
    with GLOBAL_STATE:
        if key not in _ACTS:
            m = (measure_virtual if virtual else measure_tiny)(cfg, r, batch, seq, checkpointing)
            _ACTS[key] = {"kept": m["kept"], "recomputed": m["recomputed"],
                          "activations": m["kept"] + m["recomputed"]}
    return dict(_ACTS[key])
