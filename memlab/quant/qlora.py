"""LoRA and QLoRA on Llama-shaped models: parameter counts and a memory estimator
(the models themselves are built by `memlab.quant.llama`).

Notation: V vocabulary, C hidden size, F MLP width, L layers, H heads, kv = the
width of k_proj/v_proj (num_key_value_heads * C / H), r the LoRA rank, B*T tokens.

LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models", section 4.1):
a frozen W (out x in) plus B (out x r) @ A (r x in) scaled by alpha / r; A and B train,
so each adapted projection adds r * (in + out) trainable parameters.

QLoRA (Dettmers et al. 2023) as the usual recipe runs it, which `qlora_bytes` assumes:
the projections in NF4 (`memlab.quant.nf4_bytes`), `peft.prepare_model_for_kbit_training`
(which casts every other parameter - embeddings, norms, lm_head - to fp32, so the
residual stream and the activations are fp32), peft LoRA adapters in fp32, AdamW.

Importing this module imports nothing heavy; transformers loads inside llama_7b_config.
"""

from __future__ import annotations

from dataclasses import dataclass

from .nf4 import BLOCKSIZE, nf4_bytes
from ..core.estimate import llama_param_groups
from ..core.track import format_bytes
from ..core.validate import number_in, pos_int

__all__ = ["PROJECTIONS", "ATTENTION", "llama_7b_config", "projection_shapes", "llama_param_count",
           "lora_param_count", "QLoRAEstimate", "qlora_bytes", "galore_bytes", "PAGED_MIN_NUMEL", "paged_state_bytes"]

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = PROJECTIONS[:4]


def llama_7b_config(**kw):
    """Llama-2-7B's shapes (Touvron et al. 2023) as a `transformers.LlamaConfig`: 6.74B parameters."""
    from transformers import LlamaConfig
    base = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                tie_word_embeddings=False, use_cache=False)
    base.update(kw)
    return LlamaConfig(**base)


def _dims(cfg):
    names = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    if not all(hasattr(cfg, n) for n in names):
        raise TypeError(f"cfg must be a Llama-shaped config (a transformers.LlamaConfig with {', '.join(names)}), "
                        f"got {type(cfg).__name__}")
    V, C, F, L, H = (getattr(cfg, n) for n in names)
    for n, v in zip(names, (V, C, F, L, H)):
        pos_int(f"cfg.{n}", v)
    kvh = getattr(cfg, "num_key_value_heads", None) or H
    return V, C, F, L, H, kvh * (C // H), bool(getattr(cfg, "tie_word_embeddings", False))


def projection_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each projection of one decoder layer."""
    _, C, F, _, _, kv, _ = _dims(cfg)
    return {"q_proj": (C, C), "k_proj": (C, kv), "v_proj": (C, kv), "o_proj": (C, C),
            "gate_proj": (C, F), "up_proj": (C, F), "down_proj": (F, C)}


def llama_param_count(cfg) -> dict[str, int]:
    """Parameters of a LlamaForCausalLM by group: embed (V*C), lm_head (V*C unless tied),
    norms ((2L + 1) * C), projections (L * (2C^2 + 2C*kv + 3CF)), total: `memlab.core.estimate.llama_param_groups`
    read from the config (head_dim = C / H)."""
    V, C, F, L, H, _, tied = _dims(cfg)
    kvh = getattr(cfg, "num_key_value_heads", None) or H
    return llama_param_groups(L, H, kvh, C // H, C, F, V, tied=tied)


def _targets(targets):
    if isinstance(targets, str) or not isinstance(targets, (list, tuple, set, frozenset)) or not targets:
        raise ValueError(f"targets must be a non-empty list of projection names from {PROJECTIONS}, got {targets!r}")
    bad = [t for t in targets if t not in PROJECTIONS]
    if bad:
        raise ValueError(f"unknown target module(s) {bad}; choose from {PROJECTIONS}")
    return [t for t in PROJECTIONS if t in targets]


def lora_param_count(cfg, r: int, targets=ATTENTION) -> int:
    """Trainable LoRA parameters: L * sum over targets of r * (in + out) (Hu et al. 2021)."""
    pos_int("r", r)
    shapes = projection_shapes(cfg)
    L = _dims(cfg)[3]
    return L * sum(r * sum(shapes[t]) for t in _targets(targets))


# ----------------------------------------------------------------------------- the estimator
@dataclass
class QLoRAEstimate:
    """A predicted QLoRA training step. The first four are exact for the recipe (see
    `qlora_bytes`); `peak` is the largest of the candidates, each a sum of the tensors
    alive at that moment, and `breakdown` says what is alive at the predicted peak."""
    parameters: int      # NF4 projections (codes + constants) + fp32 embed/norms/lm_head/adapters + rotary tables
    gradients: int       # the adapters' gradients, after the backward
    optimizer: int       # AdamW state of the adapters, after the step
    activations: int     # what the forward keeps for the backward
    peak: int
    phase: str           # "backward" or "step"
    breakdown: dict[str, int]
    candidates: dict[str, int]

    def __str__(self):
        return (f"predicted peak {format_bytes(self.peak)} in {self.phase}: "
                + ", ".join(f"{k} {format_bytes(v)}" for k, v in self.breakdown.items()))


def _layer_activation_bytes(cfg, r, targets, lora_dropout, mask_bytes):
    """Bytes per token one decoder layer (not the first) keeps for backward, fp32 stream.

    Counted from transformers' LlamaDecoderLayer (sdpa attention) and peft's lora.Linear:
    each RMSNorm keeps its input (C) and rsqrt (1 fp32); attention keeps q and k after RoPE
    and v (C + 2 kv), its output (C) and a logsumexp per head (H); the SwiGLU MLP keeps
    gate's output (silu's input), silu's output and up's output (3F). A frozen 4-bit
    projection keeps nothing. Each adapter keeps A's output (r) for B, and an input for A:
    without dropout the tensor the projection reads (one for q/k/v, one for gate/up;
    o_proj's is attention's output, kept anyway; down_proj's is silu * up, F); with
    dropout each adapter keeps its own dropped copy (in) and mask (in * mask_bytes).
    """
    _, C, F, _, H, kv, _ = _dims(cfg)
    a = 4
    ins = {t: i for t, (i, _) in projection_shapes(cfg).items()}
    n = a * (C + 1) + a * (C + 2 * kv) + a * C + a * H + a * (C + 1) + 3 * a * F     # norms, attention, MLP
    n += a * r * len(targets)                                                      # A's outputs
    if lora_dropout > 0:
        n += sum(ins[t] * (a + mask_bytes) for t in targets)
    else:
        n += a * C * any(t in targets for t in ("q_proj", "k_proj", "v_proj"))
        n += a * C * any(t in targets for t in ("gate_proj", "up_proj"))
        n += a * F * ("down_proj" in targets)
    return n


def qlora_bytes(cfg, *, r: int = 16, targets=PROJECTIONS, batch: int = 1, seq: int = 512,
                checkpointing: bool = True, double_quant: bool = True, blocksize: int = BLOCKSIZE,
                lora_dropout: float = 0.0, mask_bytes: int = 1, optimizer_bytes: int = 8,
                first_step: bool = True, foreach: bool = False) -> QLoRAEstimate:
    """Bytes of one QLoRA training step of a Llama-shaped model (the recipe in the module docstring).

    parameters   projections in NF4 (`nf4_bytes`: 4.127 bits/param with double quantization),
                 embed + lm_head + norms in fp32, adapters in fp32, two rotary tables (C/H/2 fp32 each)
    gradients    4 bytes per adapter parameter
    optimizer    `optimizer_bytes` per adapter parameter (AdamW's two fp32 moments: 8) + a 4-byte
                 `step` per adapter tensor. PyTorch creates it in the first step (first_step=True:
                 none during forward and backward)
    activations  per token, L layers of `_layer_activation_bytes` (layer 0 keeps its input's norm
                 (C + 1 fp32) and, with dropout, the q/k/v masks less: its input needs no gradient),
                 or with per-layer checkpointing only each layer's fp32 input (C); plus the final
                 norm's input and rsqrt, log_softmax's (B*T, V) fp32 output and the int64 targets
                 (B*T of them; T + 1 with batch 1: the padded labels' storage),
                 per sequence the RoPE cos/sin (2 T C/H fp32) and, checkpointing, the position ids
                 (T int64), and two scalars.
    peak         the largest of these moments, each the sum of what is alive then: the backward's
                 start (the two (B*T, V) fp32 gradients of the loss beside the activations); the last
                 layer's MLP backward (three (B*T, F) fp32 gradients; the loss's tensors and the final
                 norm's are gone), with checkpointing after that layer's recomputation (+ its
                 activations); and the optimizer step (states + scratch,
                 `memlab.core.estimate.optimizer_step_temp_bytes`). Not counted: the dequantized weight a
                 4-bit matmul makes for an instant (at most C*F compute-dtype elements). Measured on the
                 tracker: exact with adapters on attention only; with adapters on the MLP the real peak
                 comes at another moment (down_proj's adapter frees its input first) and this errs high,
                 by 2-8% on the tiny Llama (benchmarks/quant.md), less when the loss or weights dominate.
    mask_bytes   dropout's mask per element: 1 on CUDA (a bool mask), 4 on the CPU and the virtual
                 GPU (PyTorch's CPU dropout keeps a float mask).
    Assumes no padding (the causal mask is sdpa's is_causal) and at least one of q/k/v adapted.
    """
    from ..core.estimate import optimizer_step_temp_bytes
    V, C, F, L, H, kv, tied = _dims(cfg)
    tg = _targets(targets)
    if not any(t in tg for t in ("q_proj", "k_proj", "v_proj")):
        raise ValueError("qlora_bytes assumes at least one of q_proj/k_proj/v_proj is adapted")
    for n, v in (("batch", batch), ("seq", seq), ("blocksize", blocksize), ("optimizer_bytes", optimizer_bytes)):
        pos_int(n, v)
    number_in("lora_dropout", lora_dropout, 0, 1, what="in [0, 1)")
    if mask_bytes not in (1, 2, 4):
        raise ValueError(f"mask_bytes must be 1 (CUDA bool mask), 2 or 4 (CPU float mask), got {mask_bytes!r}")
    shapes = projection_shapes(cfg)
    n_lora = lora_param_count(cfg, r, tg)
    counts = llama_param_count(cfg)
    quant = L * sum(sum(nf4_bytes(i * o, blocksize, double_quant).values()) for i, o in shapes.values())
    P = quant + 4 * (counts["embed"] + counts["lm_head"] + counts["norms"]) + 4 * n_lora + 2 * 4 * (C // H // 2)
    G = 4 * n_lora
    O = optimizer_bytes * n_lora + 4 * 2 * L * len(tg)
    O_before = 0 if first_step else O
    N, hd = batch * seq, C // H
    layer = _layer_activation_bytes(cfg, r, tg, lora_dropout, mask_bytes)
    first_less = 4 * (C + 1) + (mask_bytes * C * sum(t in tg for t in ("q_proj", "k_proj", "v_proj"))
                                if lora_dropout > 0 else 0)
    # final norm in + rsqrt, log_softmax out, and the int64 targets: the labels padded by one and shifted
    # (with batch 1 the shifted slice is already contiguous, so the padded (1, T + 1) storage is kept)
    loss_side = N * (4 * C + 4 + 4 * V) + 8 * (seq + 1 if batch == 1 else N)
    outside = loss_side + 2 * seq * hd * 4 + 8
    A = (L * N * 4 * C + 8 * seq if checkpointing else L * N * layer - N * first_less) + outside
    targets_bytes = 8 * (seq + 1 if batch == 1 else N)
    cands = {"backward start": P + O_before + A + 2 * 4 * N * V}
    freed = N * (4 * V + 4 * C + 4)                          # log_softmax out, final norm in + rsqrt
    mlp_grads = 3 * 4 * N * F                                 # three (B*T, F) fp32 gradients in the MLP's backward
    if checkpointing:
        cands["backward, last layer recomputed"] = P + O_before + A - freed + N * layer + mlp_grads
    else:   # the targets are gone too; the gradient arriving from above (B*T, C) is alive
        cands["backward, last layer's MLP"] = P + O_before + A - freed - targets_bytes - 4 + mlp_grads + 4 * N * C
    numels = [n for t in tg for n in (r * shapes[t][0], shapes[t][1] * r)]
    cands["step"] = P + G + O + optimizer_step_temp_bytes(numels, "adam", foreach)
    where = max(cands, key=cands.get)
    if where == "step":
        bd = {"parameters": P, "gradients": G, "optimizer": O, "activations": 0,
              "temporaries": cands[where] - P - G - O}
    elif where == "backward start":
        bd = {"parameters": P, "gradients": 0, "optimizer": O_before, "activations": A, "temporaries": 2 * 4 * N * V}
    else:
        kept = A - freed - (0 if checkpointing else targets_bytes + 4)
        bd = {"parameters": P, "gradients": 0, "optimizer": O_before, "activations": kept,
              "temporaries": cands[where] - P - O_before - kept}
    return QLoRAEstimate(P, G, O, A, cands[where], "step" if where == "step" else "backward", bd, cands)


# ----------------------------------------------------------------------------- GaLore, by formula
def galore_bytes(cfg, r: int, *, targets=PROJECTIONS, weight_bytes: int = 2, grad_bytes: int = 2,
                 state_bytes: int = 2, per_layer_update: bool = False) -> dict[str, int]:
    """Model-state bytes of full-parameter training with GaLore-Adam (Zhao et al. 2024, "GaLore: Memory-Efficient
    LLM Training by Gradient Low-Rank Projection", section 4.2 and Table 1), by formula: no GaLore package needed.

    Every weight trains. For each targeted (m x n) weight, m <= n its shorter side, Adam's two moments live in the
    projected space, r x n each, beside the projector P (m x r): `state_bytes * (2 n r + m r)` instead of
    `state_bytes * 2 m n`. The other parameters (embeddings, norms, lm_head) keep ordinary Adam (2 moments each),
    as the paper applies GaLore to the attention and MLP matrices only (section 5.1). Gradients are full size for
    every weight, or, with `per_layer_update` (section 4.3: each weight is updated during the backward pass and its
    gradient freed), only the largest single weight's. Returns parameters, gradients, optimizer and their total;
    the activations and the periodic SVD of each gradient (Algorithm 2) come on top."""
    pos_int("r", r)
    for n, v in (("weight_bytes", weight_bytes), ("grad_bytes", grad_bytes), ("state_bytes", state_bytes)):
        pos_int(n, v)
    if not isinstance(per_layer_update, bool):
        raise TypeError(f"per_layer_update must be a bool, got {type(per_layer_update).__name__}")
    tg = _targets(targets)
    V, C, F, L, H, kv, tied = _dims(cfg)
    shapes = projection_shapes(cfg)
    too_big = [t for t in tg if r > min(shapes[t])]
    if too_big:
        raise ValueError(f"r must be at most the shorter side of every targeted weight, got r={r} for {too_big} "
                         f"(shapes {[shapes[t] for t in too_big]})")
    counts = llama_param_count(cfg)
    projected = sum(i * o for t in tg for i, o in [shapes[t]])
    galore_states = L * sum(2 * max(shapes[t]) * r + min(shapes[t]) * r for t in tg)
    plain = counts["total"] - L * projected                       # parameters with ordinary Adam
    largest = max([V * C, *(i * o for i, o in shapes.values())])
    grads = grad_bytes * (largest if per_layer_update else counts["total"])
    out = {"parameters": weight_bytes * counts["total"], "gradients": grads,
           "optimizer": state_bytes * (galore_states + 2 * plain)}
    out["total"] = sum(out.values())
    return out


# ----------------------------------------------------------------------------- paged optimizer state
PAGED_MIN_NUMEL = 100_000   # bitsandbytes 0.50, Optimizer8bit.get_state_buffer: smaller tensors get ordinary state


def paged_state_bytes(numels, *, eight_bit: bool = False, min_8bit_size: int = 4096) -> dict[str, int]:
    """Adam state of bitsandbytes' paged optimizers (PagedAdamW, PagedAdamW8bit) for parameter tensors of
    `numels` values, split by where it is allocated (bitsandbytes/optim/optimizer.py, 0.50):

    paged    the two moments of every tensor of at least PAGED_MIN_NUMEL values, allocated by `F.get_paged`
             in CUDA unified memory (cudaMallocManaged), outside PyTorch's caching allocator: 8 bytes per
             value, or 2 with `eight_bit` (tensors under `min_8bit_size` values keep fp32 moments)
    device   everything else as ordinary GPU tensors: the moments of smaller tensors and the 8-bit
             optimizers' fp32 absmax per block of 256 (`memlab.quant.adam8bit_state_bytes`).
    """
    if isinstance(numels, (str, bytes)) or not hasattr(numels, "__iter__"):
        raise TypeError(f"numels must be an iterable of positive ints, got {type(numels).__name__}")
    if not isinstance(eight_bit, bool):
        raise TypeError(f"eight_bit must be a bool, got {type(eight_bit).__name__}")
    pos_int("min_8bit_size", min_8bit_size)
    from .nf4 import adam8bit_state_bytes
    out = {"paged": 0, "device": 0}
    for n in numels:
        pos_int("numels[i]", n)
        total = adam8bit_state_bytes(n, min_8bit_size) if eight_bit else 8 * n
        moments = 2 * n if eight_bit and n >= min_8bit_size else 8 * n
        where = "paged" if n >= PAGED_MIN_NUMEL else "device"
        out[where] += moments
        out["device"] += total - moments
    return out
