"""Formulas that predict the bytes before we measure them.

Every function states its source and its assumptions. Byte counts are exact
storage bytes (no allocator rounding); `memlab.MemoryTracker` measures the same
quantity, so a prediction and a measurement can be compared to the byte.

Notation: P = parameter bytes, G = gradient bytes, O = optimizer-state bytes,
B = batch, T = sequence length, C = width (n_embd), V = vocabulary,
u = B*T*C*4 bytes (one fp32 activation of the residual stream).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .models import GPTConfig
from .validate import flag, one_of, pos_int

__all__ = ["param_count", "mlp_param_count", "gpt_param_count", "llama_param_groups", "LAYOUTS", "Layout",
           "BYTES_PER_PARAM", "layout_bytes_per_param", "model_state_bytes", "gpt_param_numels",
           "optimizer_step_temp_bytes", "mlp_activation_bytes", "gpt_activation_bytes",
           "korthikanti_activation_bytes", "zero_model_state_bytes", "Estimate", "mlp_peak_bytes",
           "gpt_peak_bytes", "chen_segment_peak"]

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")


# ----------------------------------------------------------------------------- parameters
def mlp_param_count(d_in: int, width: int, depth: int, d_out: int, bias: bool = True) -> int:
    """Parameters of `memlab.MLP`: depth hidden Linear layers plus an output layer."""
    for n, v in (("d_in", d_in), ("width", width), ("depth", depth), ("d_out", d_out)):
        pos_int(n, v)
    dims = [d_in] + [width] * depth + [d_out]
    return sum(a * b + (b if bias else 0) for a, b in zip(dims[:-1], dims[1:]))


def gpt_param_count(cfg: GPTConfig) -> int:
    """Parameters of `memlab.GPT` (a tied embedding counts once).

    Per block: attention 2C^2 + 2*C*kv with kv = n_kv_head * C / n_head the key/value width
    (4C^2 without grouped-query attention; + C + 2kv + C biases), MLP 2CF (gelu) or 3CF (swiglu)
    (+F+C biases), two norms 2C each (LayerNorm with bias) or C (RMSNorm).
    The familiar 12*L*C^2 rule is this with F = 4C, no GQA and small terms dropped.
    Llama-3.1-8B (`GPTConfig.llama3_8b()`): 8,030,261,248.
    """
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
    C, F, V, L = cfg.n_embd, cfg.mlp_hidden, cfg.vocab_size, cfg.n_layer
    kv = cfg.n_kv_head * cfg.head_dim
    norm = (2 * C if cfg.bias else C) if cfg.norm == "layernorm" else C
    attn = 2 * C * C + 2 * C * kv + (2 * C + 2 * kv if cfg.bias else 0)
    mlp = (3 if cfg.mlp == "swiglu" else 2) * C * F + ((2 if cfg.mlp == "swiglu" else 1) * F + C if cfg.bias else 0)
    block = attn + mlp + 2 * norm
    emb = V * C + (cfg.block_size * C if cfg.pos == "learned" else 0)
    head = 0 if cfg.tie_weights else V * C
    return L * block + emb + norm + head


def llama_param_groups(n_layer: int, n_head: int, n_kv_head: int, head_dim: int, hidden: int, ffn: int,
                       vocab: int, *, tied: bool = False) -> dict[str, int]:
    """Parameters of a Llama decoder (transformers' LlamaForCausalLM: no biases, RMSNorm, SwiGLU), by group:

      embed        V*C
      lm_head      V*C (0 when tied to the embedding)
      norms        (2L + 1) * C: two RMSNorms per layer and the final one
      projections  L * (2*C*H*d + 2*C*H_kv*d + 3*C*F): q and o, k and v, gate, up and down
      total        their sum

    with L=n_layer, H=n_head, H_kv=n_kv_head, d=head_dim, C=hidden, F=ffn, V=vocab. The one Llama counter:
    `memlab.attention.llama_param_count` and `memlab.quant.qlora.llama_param_count` are this.
    Llama-2-7B (32, 32, 32, 128, 4096, 11008, 32000): 6,738,415,616.
    """
    for name, val in (("n_layer", n_layer), ("n_head", n_head), ("n_kv_head", n_kv_head),
                      ("head_dim", head_dim), ("hidden", hidden), ("ffn", ffn), ("vocab", vocab)):
        pos_int(name, val)
    if n_head % n_kv_head:
        raise ValueError(f"n_head ({n_head}) must be a multiple of n_kv_head ({n_kv_head})")
    flag("tied", tied)
    C, L = hidden, n_layer
    out = {"embed": vocab * C, "lm_head": 0 if tied else vocab * C, "norms": (2 * L + 1) * C,
           "projections": L * (2 * C * n_head * head_dim + 2 * C * n_kv_head * head_dim + 3 * C * ffn)}
    out["total"] = sum(out.values())
    return out


def param_count(model_or_cfg) -> int:
    """Parameters of an nn.Module (counted), a GPTConfig (formula)."""
    import torch
    if isinstance(model_or_cfg, GPTConfig):
        return gpt_param_count(model_or_cfg)
    if isinstance(model_or_cfg, torch.nn.Module):
        return sum(p.numel() for p in model_or_cfg.parameters())
    raise TypeError(f"model_or_cfg must be an nn.Module or a GPTConfig, got {type(model_or_cfg).__name__}")


# ----------------------------------------------------------------------------- model states
@dataclass(frozen=True)
class Layout:
    """Where a training setup keeps its model states: bytes per parameter of each copy."""
    what: str
    weights: int      # the weights the forward reads
    grads: int        # the .grad the backward writes
    master: int       # an fp32 master copy of the weights that the optimizer updates (0: none)
    grad_accum: int   # an fp32 gradient-accumulation buffer beside the 16-bit grads (0: none)
    state: int        # bytes of one optimizer-state element (Adam keeps 2 per parameter, momentum 1)
    transient: int    # 16-bit weight copies alive during forward/backward only (autocast's cast cache)
    source: str


# The training layouts (precision= in this module), each with its source. A variant not listed: Megatron's
# "float16 param, fp32 grads" (18 B/param with Adam), where the backward accumulates straight into the fp32
# buffer and no 16-bit gradient is kept. The 16-bit layouts have the same bytes in fp16 (which needs a loss
# scaler) and in bf16.
LAYOUTS: dict[str, Layout] = {
    "fp32": Layout("fp32 weights, gradients and optimizer state", 4, 4, 0, 0, 4, 0,
                   "PyTorch's default"),
    "amp": Layout("torch.autocast: fp32 weights, gradients and state; matmuls get 16-bit weight copies", 4, 4, 0,
                  0, 4, 2, "PyTorch AMP (torch.autocast); the copies live in autocast's cast cache"),
    "bf16_master": Layout("16-bit weights and gradients; the optimizer updates an fp32 master copy", 2, 2, 4, 0, 4,
                          0, "Micikevicius et al. 2018, 'Mixed Precision Training'; the ZeRO paper's 2 + 2 + K "
                          "with K = 12 (Rajbhandari et al. 2020); DeepSpeed's fp16/bf16 optimizer"),
    "bf16_master_fp32_grads": Layout("16-bit weights and gradients, an fp32 master copy and an fp32 "
                                     "gradient-accumulation buffer", 2, 2, 4, 4, 4, 0,
                                     "Megatron-LM ('float16 param, float16 grads': 20 B/param, Megatron Core "
                                     "'Distributed Optimizer' guide), Nanotron; the Ultra-Scale Playbook's 20 "
                                     "(Tazi et al. 2025)"),
    "bf16": Layout("pure bf16: weights, gradients and optimizer state all 16-bit", 2, 2, 0, 0, 2, 0,
                   "stale small updates, lesson 03; Zamirai et al. 2020"),
}
PRECISIONS = tuple(LAYOUTS)
_STATES = {"sgd": 0, "momentum": 1, "adam": 2}    # optimizer-state elements per parameter
BYTES_PER_PARAM = {(p, o): L.weights + L.grads + L.master + L.grad_accum + k * L.state
                   for p, L in LAYOUTS.items() for o, k in _STATES.items()}


def _optimizer(optimizer):
    if optimizer == "adamw":             # AdamW keeps exactly Adam's state (decoupled weight decay is in place)
        return "adam"
    one_of("optimizer", optimizer, OPTIMIZERS)
    return optimizer


def layout_bytes_per_param(precision: str = "fp32", optimizer: str = "adam") -> dict[str, int]:
    """Bytes per parameter of each copy a layout keeps (`LAYOUTS[precision]`), with the optimizer's state
    elements counted: {"weights", "grads", "master", "grad_accum", "optimizer state", "transient copies"}."""
    one_of("precision", precision, PRECISIONS)
    L = LAYOUTS[precision]
    return {"weights": L.weights, "grads": L.grads, "master": L.master, "grad_accum": L.grad_accum,
            "optimizer state": _STATES[_optimizer(optimizer)] * L.state, "transient copies": L.transient}


def model_state_bytes(n_params: int, precision: str = "fp32", optimizer: str = "adam") -> dict[str, int]:
    """Bytes of weights, gradients and optimizer state for `n_params` parameters in a training layout
    (`LAYOUTS`; optimizer "sgd", "momentum", "adam" or "adamw").

    Categories as memlab's tracker labels them: "parameters" = the weights the model reads; "gradients" =
    .grad plus any fp32 accumulation buffer; "optimizer" = the fp32 master copy plus the optimizer's state.
    autocast's 16-bit weight copies are transient (activations), not model states. Assumes PyTorch's
    optimizers and `zero_grad(set_to_none=True)` *not yet called* (gradients exist). Adam's scalar `step`
    tensors (4 bytes per parameter tensor) are ignored here.
    """
    pos_int("n_params", n_params)
    b = layout_bytes_per_param(precision, optimizer)
    return {"parameters": b["weights"] * n_params, "gradients": (b["grads"] + b["grad_accum"]) * n_params,
            "optimizer": (b["master"] + b["optimizer state"]) * n_params}


def optimizer_step_temp_bytes(param_numels: list[int], optimizer: str = "adam", foreach: bool = False,
                              bytes_per_element: int = 4, fused: bool = False) -> int:
    """Scratch memory of one `optimizer.step()` (torch.optim, PyTorch 2.x): a transient of the step, on top of
    the model states, not part of them.

    Adam/AdamW, foreach=False (the CPU default): tensor by tensor, `denom = (exp_avg_sq.sqrt() /
    bias_correction2_sqrt).add_(eps)` holds two temporaries of that tensor's size (the sqrt and the quotient),
    while the previous tensor's `denom` is still alive (the loop variable is rebound only afterwards):
    max over i of 2 n_i + n_(i-1), in the optimizer's parameter order.
    Adam/AdamW, foreach=True (the CUDA default): `_foreach_sqrt(exp_avg_sqs)` makes one temporary of *every*
    parameter at once -> 1 x all parameters (4 B/param in fp32, 2 in bf16).
    fused=True: one kernel per group updates in place -> 0.
    SGD (with or without momentum, steady state): updates in place -> 0.
    """
    optimizer = _optimizer(optimizer)
    if not param_numels:
        raise ValueError("param_numels must list the numel of each parameter tensor")
    if optimizer != "adam" or fused:
        return 0
    if foreach:
        return bytes_per_element * sum(param_numels)
    n = list(param_numels)
    return bytes_per_element * max(2 * n[i] + (n[i - 1] if i else 0) for i in range(len(n)))


def zero_model_state_bytes(n_params: int, n_gpus: int, stage: int, optimizer_bytes_per_param: int = 12) -> float:
    """Per-GPU model-state bytes under ZeRO (Rajbhandari et al. 2020, "ZeRO: Memory
    Optimizations Toward Training Trillion Parameter Models", section 5 and Fig. 1).

    Mixed-precision Adam: 2-byte fp16 weights and 2-byte fp16 grads, plus K = 12
    bytes/param of optimizer state (fp32 master weights, momentum, variance). The
    paper uses K = 12 throughout:
      stage 0 (plain data parallel): (2 + 2 + K) * Psi         = 16 Psi
      stage 1 (optimizer states)   : 4 Psi + K Psi / N_d
      stage 2 (+ gradients)        : 2 Psi + (2 + K) Psi / N_d
      stage 3 (+ parameters)       : (2 + 2 + K) Psi / N_d
    DeepSpeed's `estimate_zero2_model_states_mem_needs` (no offload) is a different
    count: since DeepSpeed PR 5099 (2024) it returns 2 Psi + 18 Psi / N (fp16 weights
    replicated; fp16 grads, fp32 grads, fp32 weights and both moments partitioned,
    its code comment says); older versions returned 4 Psi + 16 Psi / N (fp16 weights
    and grads replicated, fp32 weights, grads and moments partitioned), which is
    neither a ZeRO stage of the paper nor a different K.
    """
    pos_int("n_params", n_params)
    pos_int("n_gpus", n_gpus)
    one_of("stage", stage, (0, 1, 2, 3))
    psi, n, k = n_params, n_gpus, optimizer_bytes_per_param
    return {0: (4 + k) * psi, 1: 4 * psi + k * psi / n, 2: 2 * psi + (2 + k) * psi / n,
            3: (4 + k) * psi / n}[stage]


# ----------------------------------------------------------------------------- activations
def mlp_activation_bytes(batch: int, d_in: int, width: int, depth: int, d_out: int, act: str = "relu",
                         precision: str = "fp32") -> int:
    """Bytes autograd saves for backward in one forward of `memlab.MLP` with
    cross-entropy, excluding the input batch.

    fp32: each hidden layer keeps one (B, width) tensor (ReLU/tanh save their
    output, which the next Linear also saves as its input); GELU saves its
    input too (two tensors). The loss keeps log_softmax's (B, d_out) output.
    amp (CPU/CUDA autocast to a 2-byte type): activations are 2 bytes, the
    first Linear saves a 2-byte copy of the input batch, every other Linear a
    2-byte copy of its weight (from autocast's cast cache; the first layer's copy
    is not needed for backward and dies with the cache), and the loss upcasts
    the logits to fp32.
    """
    for n, v in (("batch", batch), ("d_in", d_in), ("width", width), ("depth", depth), ("d_out", d_out)):
        pos_int(n, v)
    one_of("act", act, ("relu", "gelu", "tanh"))
    one_of("precision", precision, ("fp32", "amp"))
    per_layer = (2 if act == "gelu" else 1) * batch * width
    if precision == "fp32":
        return 4 * depth * per_layer + 4 * batch * d_out + 4  # + total_weight scalar of nll_loss
    weights = mlp_param_count(d_in, width, depth, d_out, bias=False) - d_in * width   # not the first layer's
    return 2 * depth * per_layer + 2 * batch * d_in + 2 * weights + 4 * batch * d_out + 4


def gpt_activation_bytes(cfg: GPTConfig, batch: int, seq: int) -> int:
    """Bytes autograd saves for backward in one fp32 forward of `memlab.GPT`
    (sdpa attention, GELU MLP, LayerNorm, no dropout), excluding the inputs.

    Per block, in units of u = B*T*C*4 bytes, the tensors kept are: the input
    ln1's output (1), the qkv projection (3, kept whole because q, k, v are
    views of it), the attention output (1), the residual after attention (1),
    ln2's output (1), the MLP's up-projection (F/C, saved by GELU), GELU's
    output (F/C) and the block output (1, the next block's ln1 input):
    16 u for F = 4C. Plus
    LayerNorm's mean and rstd (2 x 2 x B*T*4) and the attention kernel's
    logsumexp (B*H*T*4). Outside the blocks: the embedding sum (u), ln_f's
    output (u) and stats, log_softmax's (B, T, V) output, the position index.

    Compare Korthikanti et al. (2022), 34*s*b*h + 5*a*s^2*b bytes per layer for
    fp16 with dropout: their 34 (in 2-byte units: 17 u) counts dropout masks,
    and the 5*a*s^2*b term is the (s x s) attention scores, which a fused
    attention kernel never stores. See `korthikanti_activation_bytes`.
    """
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
    pos_int("batch", batch)
    pos_int("seq", seq)
    if cfg.attn != "sdpa" or cfg.mlp != "gelu" or cfg.norm != "layernorm" or cfg.dropout or cfg.pos != "learned" \
            or cfg.n_kv_head != cfg.n_head:
        raise ValueError("gpt_activation_bytes models the default block (attn='sdpa', mlp='gelu', "
                         "norm='layernorm', pos='learned', dropout=0, n_kv_head=n_head); got a different GPTConfig")
    B, T, C, V, H, F, L = batch, seq, cfg.n_embd, cfg.vocab_size, cfg.n_head, cfg.mlp_hidden, cfg.n_layer
    u = B * T * C * 4
    per_block = 8 * u + 2 * B * T * F * 4 + 2 * 2 * B * T * 4 + B * H * T * 4
    outside = u + (u + 2 * B * T * 4) + B * T * V * 4 + T * 8 + 4
    return L * per_block + outside


def korthikanti_activation_bytes(seq: int, batch: int, hidden: int, heads: int, layers: int = 1) -> int:
    """Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
    Transformer Models", eq. (1): activation bytes per transformer layer with
    16-bit activations, dropout, no parallelism: s*b*h*(34 + 5*a*s/h)."""
    for n, v in (("seq", seq), ("batch", batch), ("hidden", hidden), ("heads", heads), ("layers", layers)):
        pos_int(n, v)
    s, b, h, a = seq, batch, hidden, heads
    return layers * (34 * s * b * h + 5 * a * s * s * b)


# ----------------------------------------------------------------------------- peak of a training step
@dataclass
class Estimate:
    """A predicted training step: the peak and what is live at it."""
    peak: int                       # bytes
    phase: str                      # "forward", "backward" or "step"
    breakdown: dict[str, int]       # category -> bytes at the predicted peak
    candidates: dict[str, int]      # the peak of each phase

    def __str__(self):
        from .track import format_bytes
        return f"predicted peak {format_bytes(self.peak)} in {self.phase}: " + ", ".join(
            f"{k} {format_bytes(v)}" for k, v in self.breakdown.items())


def mlp_peak_bytes(batch: int, d_in: int, width: int, depth: int, d_out: int, *, act: str = "relu",
                   optimizer: str = "adam", precision: str = "fp32", foreach: bool = False,
                   first_step: bool = False, fused: bool = False) -> Estimate:
    """Peak bytes of one `memlab.train_step` of `memlab.MLP` (cross-entropy,
    zero_grad(set_to_none=True) after the step), counting the input batch
    (fp32 x, int64 labels) created for the step.

    Walks the step as autograd runs it: forward layer by layer (a Linear's
    output and its activation's output are alive together), backward from the
    loss (each Linear allocates grad_input, grad_weight and grad_bias while its
    incoming gradient is alive; saved tensors are freed once their last user
    has run), then the optimizer step (state + scratch, see
    `optimizer_step_temp_bytes`). `first_step=True`: no optimizer state yet
    before the step (PyTorch creates it lazily inside the first step()).
    """
    for n, v in (("batch", batch), ("d_in", d_in), ("width", width), ("depth", depth), ("d_out", d_out)):
        pos_int(n, v)
    one_of("act", act, ("relu", "gelu", "tanh"))
    optimizer = _optimizer(optimizer)
    one_of("precision", precision, ("fp32", "amp"))
    dims = [d_in] + [width] * depth + [d_out]
    numels = []
    for a, b in zip(dims[:-1], dims[1:]):
        numels += [a * b, b]
    n_params = sum(numels)
    state = model_state_bytes(n_params, precision, optimizer)
    P = state["parameters"]
    O_full = state["optimizer"] + (4 * len(numels) if optimizer == "adam" else 0)  # + Adam's step scalars
    O = 0 if first_step else O_full
    b = 4 if precision == "fp32" else 2           # bytes of a hidden activation
    X = batch * d_in * 4 + batch * 8               # input batch: fp32 features, int64 labels
    Bw, Bo = batch * width * b, batch * d_out
    gelu = act == "gelu"
    base = P + O + X
    amp = precision == "amp"

    # ---- forward. Under autocast every Linear's weight and bias get a 2-byte copy in autocast's
    # cache, alive until the autocast region ends; a copy stays after that only if backward needs it
    # (the weight of every Linear but the first, whose input needs no gradient).
    saved = 0                                      # bytes saved for backward so far
    cache = 0                                      # autocast's cast cache (amp only)
    kept = 0                                       # weight copies that outlive the cache
    fwd_peak = 0
    for i in range(depth):
        if amp:
            cache += 2 * (dims[i] * width + width)
            kept += 2 * dims[i] * width if i > 0 else 0
            saved += 2 * batch * d_in if i == 0 else 0          # 2-byte copy of the fp32 input
        fwd_peak = max(fwd_peak, base + saved + cache + 2 * Bw)  # Linear out + activation out
        saved += Bw * (2 if gelu else 1)
    if amp:
        cache += 2 * (width * d_out + d_out)
        kept += 2 * width * d_out
    logits = Bo * b
    lsm = Bo * 4
    up = Bo * 4 if amp else 0                       # autocast runs the loss in fp32: upcast copy
    fwd_peak = max(fwd_peak, base + saved + cache + logits + up + lsm)
    saved += kept + lsm + 4                         # weight copies, log_softmax output, nll's total_weight
    fwd_end = base + saved + 4                      # + the loss scalar

    # ---- backward (grads are fp32: they match the fp32 parameters)
    G = 0
    live_saved = saved
    bwd_peak = fwd_end + 2 * Bo * 4                 # nll grad and log_softmax grad together
    live_saved -= lsm + 4
    g_in = Bo * 4 if not amp else Bo * 2            # gradient arriving at the last Linear
    for i in reversed(range(depth + 1)):
        n_in, n_out = dims[i], dims[i + 1]
        gw = 4 * (n_in * n_out + n_out)
        gx = batch * n_in * b if i > 0 else 0       # no grad for the input batch
        if amp:
            # mm gives a 2-byte grad_weight; the cast's backward turns it into the fp32
            # .grad after the incoming gradient and the cached 2-byte weight are freed
            half = 2 * (n_in * n_out + n_out)
            bwd_peak = max(bwd_peak, base + G + live_saved + g_in + gx + half)
            live_saved -= 2 * n_in * n_out if i > 0 else 2 * batch * d_in   # the saved copy is released
            bwd_peak = max(bwd_peak, base + G + live_saved + gx + half + gw)
        else:
            bwd_peak = max(bwd_peak, base + G + live_saved + g_in + gx + gw)
        G += gw
        if i == 0:
            break
        # activation backward for hidden layer i-1: grad w.r.t. its pre-activation.
        # GELU saved its input, not its output: the output (saved only by the
        # Linear above) is released before GELU's backward runs.
        if gelu:
            live_saved -= Bw
        bwd_peak = max(bwd_peak, base + G + live_saved + gx + Bw)
        live_saved -= Bw                            # its saved tensor is released
        g_in = Bw

    # ---- optimizer step
    temp = optimizer_step_temp_bytes(numels, optimizer, foreach, fused=fused)
    step_peak = P + O_full + X + G + temp
    cands = {"forward": fwd_peak, "backward": bwd_peak, "step": step_peak}
    ph = max(cands, key=cands.get)
    if ph == "step":
        bd = {"parameters": P, "gradients": G, "optimizer": O_full, "activations": 0, "temporaries": X + temp}
    elif ph == "forward":
        bd = {"parameters": P, "gradients": 0, "optimizer": O, "activations": saved, "temporaries": X}
    else:
        bd = {"parameters": P, "gradients": 0, "optimizer": O, "activations": saved,
              "temporaries": bwd_peak - P - O - saved}
    return Estimate(cands[ph], ph, bd, cands)


def gpt_param_numels(cfg: GPTConfig) -> list[int]:
    """numel of each parameter tensor of `memlab.GPT` with the default block (learned positions, LayerNorm,
    GELU MLP, no GQA), in model.parameters() order: what `optimizer_step_temp_bytes` needs."""
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
    if cfg.mlp != "gelu" or cfg.norm != "layernorm" or cfg.pos != "learned" or cfg.n_kv_head != cfg.n_head:
        raise ValueError("gpt_param_numels lists the default block (mlp='gelu', norm='layernorm', pos='learned', "
                         "n_kv_head=n_head); got a different GPTConfig")
    C, F, V = cfg.n_embd, cfg.mlp_hidden, cfg.vocab_size
    b = cfg.bias
    norm = [C, C] if b else [C]
    lin = lambda i, o: [i * o] + ([o] if b else [])  # noqa: E731
    block = norm + lin(C, 3 * C) + lin(C, C) + norm + lin(C, F) + lin(F, C)
    return [V * C, cfg.block_size * C] + block * cfg.n_layer + norm + ([] if cfg.tie_weights else [V * C])


def gpt_peak_bytes(cfg: GPTConfig, batch: int, seq: int, *, optimizer: str = "adam", foreach: bool = False,
                   first_step: bool = False, fused: bool = False) -> Estimate:
    """Peak bytes of one fp32 `memlab.train_step` of `memlab.GPT` (default block,
    see `gpt_activation_bytes`), counting the int64 input and target tokens.

    Candidates: the end of the forward (all activations, logits and
    log_softmax's output alive together), the start of the backward (two
    (B, T, V) gradients), the last block's MLP backward (its up-projection
    gradient of B*T*F*4 beside the residual gradient), and the optimizer step
    (its scratch: `optimizer_step_temp_bytes`).
    """
    if not isinstance(cfg, GPTConfig):
        raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
    optimizer = _optimizer(optimizer)
    A = gpt_activation_bytes(cfg, batch, seq)
    B, T, C, V, F = batch, seq, cfg.n_embd, cfg.vocab_size, cfg.mlp_hidden
    n_params = gpt_param_count(cfg)
    state = model_state_bytes(n_params, "fp32", optimizer)
    P = state["parameters"]
    numels = gpt_param_numels(cfg)
    n_tensors = len(numels)
    O_full = state["optimizer"] + (4 * n_tensors if optimizer == "adam" else 0)
    O = 0 if first_step else O_full
    X = 2 * B * T * 8
    base = P + O + X
    u = B * T * C * 4
    logits = B * T * V * 4
    fwd_peak = base + A - 4 + logits                       # logits and log_softmax output together
    bwd_start = base + A + 2 * logits                      # nll grad + log_softmax grad
    head_done = A - logits - 2 * u - 2 * B * T * 4         # log_softmax out, ln_f out and input, stats freed
    g_head = V * C * 4 + (2 * C * 4 if cfg.bias else C * 4)
    bwd_block = base + head_done + g_head + u + B * T * F * 4 + F * C * 4 + C * 4
    # optimizer step
    temp = optimizer_step_temp_bytes(numels, optimizer, foreach, fused=fused)
    step_peak = P + O_full + X + P + temp
    cands = {"forward": fwd_peak, "backward": max(bwd_start, bwd_block), "step": step_peak}
    ph = max(cands, key=cands.get)
    if ph == "step":
        bd = {"parameters": P, "gradients": P, "optimizer": O_full, "activations": 0, "temporaries": X + temp}
    else:
        bd = {"parameters": P, "gradients": 0, "optimizer": O, "activations": A,
              "temporaries": cands[ph] - P - O - A}
    return Estimate(cands[ph], ph, bd, cands)


# ----------------------------------------------------------------------------- checkpointing
def chen_segment_peak(n_layers: int, segment: int, input_bytes: float, layer_bytes: float,
                      checkpoint_last: bool = True) -> float:
    """Peak activation bytes of a chain of `n_layers` identical layers cut into
    segments of `segment` layers, each segment checkpointed (Chen et al. 2016,
    "Training Deep Nets with Sublinear Memory Cost").

    Each checkpointed segment keeps only its input (`input_bytes`); in the
    backward one segment at a time is recomputed and holds `layer_bytes` per
    layer (everything a layer saves for backward). So

        peak = n_segments * input_bytes + segment * layer_bytes

    segment = n_layers with checkpoint_last=False is no checkpointing (n * layer_bytes);
    segment = 1 is per-layer checkpointing (n * input + one layer): still linear in n;
    segment = sqrt(n) gives 2 sqrt(n) units when input_bytes == layer_bytes: O(sqrt(n)).
    `checkpoint_last=False` models torch's checkpoint_sequential, which runs the
    last segment without a checkpoint (its activations are stored, not its input).
    Ignores the few tensors alive only for an instant (gradients in flight).
    """
    for name, v in (("n_layers", n_layers), ("segment", segment)):
        pos_int(name, v)
    if segment > n_layers:
        raise ValueError(f"segment ({segment}) cannot be longer than n_layers ({n_layers})")
    if input_bytes < 0 or layer_bytes < 0:
        raise ValueError("input_bytes and layer_bytes must be >= 0")
    n_seg = math.ceil(n_layers / segment)
    stashed = (n_seg if checkpoint_last else n_seg - 1) * input_bytes
    return stashed + segment * layer_bytes
