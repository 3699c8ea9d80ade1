"""The course's models: an MLP chain and a small GPT you can read in one sitting.

Both take `model(x)` -> output and `model(x, targets)` -> scalar loss, so one
training step (`train_step`) serves every lesson. Shape comments use
B = batch, T = sequence length, C = n_embd, V = vocab, H = heads, hd = C // H.

`GPTConfig` has presets: `tiny()` for CPU lessons, `gpt2_small()`,
`gpt2_medium()`, `llama_7b()` (Llama-2-7B's shapes: RMSNorm, SwiGLU, RoPE, no
biases, untied embeddings) and `llama3_8b()` (Llama-3.1-8B: the same plus
grouped-query attention) for the virtual GPU. A preset's keyword overrides are
applied before the derived sizes (the MLP width) are computed, so
`GPTConfig.llama_7b(n_embd=5120)` gets the MLP width of width 5120.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .track import phase
from .virtual_gpu import cuda_autocast
from .validate import is_int, one_of, pos_int

__all__ = ["MLP", "GPTConfig", "GPT", "train_step", "tiny_llama_config"]


# ----------------------------------------------------------------------------- MLP chain
class MLP(nn.Module):
    """A chain of `depth` Linear(width, width) + activation layers between an input
    and an output projection: the simplest model whose activation memory we can
    predict by hand.

        x (B, d_in) -> Linear -> act -> [Linear -> act] * (depth-1) -> Linear -> (B, d_out)
    """

    def __init__(self, d_in: int = 256, width: int = 512, depth: int = 4, d_out: int = 10,
                 act: str = "relu", bias: bool = True):
        super().__init__()
        for name, v in (("d_in", d_in), ("width", width), ("depth", depth), ("d_out", d_out)):
            pos_int(name, v)
        one_of("act", act, ("relu", "gelu", "tanh"), what="'relu', 'gelu' or 'tanh'")
        self.d_in, self.width, self.depth, self.d_out, self.act_name = d_in, width, depth, d_out, act
        act_cls = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}[act]
        layers: list[nn.Module] = []
        dims = [d_in] + [width] * depth
        for i in range(depth):
            layers += [nn.Linear(dims[i], dims[i + 1], bias=bias), act_cls()]
        layers.append(nn.Linear(width, d_out, bias=bias))
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        out = self.layers(x)                                  # (B, d_out)
        if targets is None:
            return out
        return F.cross_entropy(out, targets)


# ----------------------------------------------------------------------------- GPT
@dataclass
class GPTConfig:
    vocab_size: int = 256        # V: tokens (256 = raw bytes, no tokenizer needed)
    block_size: int = 128        # longest sequence T the model accepts
    n_layer: int = 4             # transformer blocks
    n_head: int = 4              # attention heads H (n_embd must divide by it)
    n_embd: int = 128            # C: width of the residual stream
    n_kv_head: int | None = None  # key/value heads (grouped-query attention, Ainslie et al. 2023); None = n_head
    mlp_hidden: int | None = None  # MLP inner width F; None = derived: 4*C (gelu), or Llama's rule (swiglu):
    mlp_multiplier: float = 1.0  #   F = int(mlp_multiplier * int(8*C/3)) rounded up to a multiple of
    mlp_multiple_of: int = 256   #   mlp_multiple_of (Meta's llama model.py: ffn_dim_multiplier, multiple_of)
    mlp: str = "gelu"            # "gelu" (GPT-2) or "swiglu" (Llama)
    norm: str = "layernorm"      # "layernorm" (GPT-2) or "rmsnorm" (Llama)
    pos: str = "learned"         # "learned" position table (GPT-2) or "rope" (Llama)
    rope_theta: float = 10000.0  # RoPE base (Llama 2: 10000; Llama 3: 500000)
    attn: str = "sdpa"           # "sdpa" (F.scaled_dot_product_attention: flash/efficient kernels)
                                 # or "math" (explicit softmax(QK^T)V: stores the (B, H, T, T) scores)
    bias: bool = True            # biases in Linear and LayerNorm
    dropout: float = 0.0         # dropout probability (0 = no dropout masks stored)
    tie_weights: bool = True     # share the token embedding with the output head

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            pos_int(f"GPTConfig.{name}", getattr(self, name))
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if not is_int(self.n_kv_head) or self.n_kv_head < 1 or self.n_head % self.n_kv_head:
            raise ValueError(f"GPTConfig.n_kv_head must be a positive int that divides n_head ({self.n_head}), "
                             f"got {self.n_kv_head!r}")
        pos_int("GPTConfig.mlp_multiple_of", self.mlp_multiple_of)
        if not self.mlp_multiplier > 0:
            raise ValueError(f"GPTConfig.mlp_multiplier must be > 0, got {self.mlp_multiplier!r}")
        for name, allowed in (("mlp", ("gelu", "swiglu")), ("norm", ("layernorm", "rmsnorm")),
                              ("pos", ("learned", "rope")), ("attn", ("sdpa", "math"))):
            one_of(f"GPTConfig.{name}", getattr(self, name), allowed)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.mlp_hidden is None:
            if self.mlp == "gelu":
                self.mlp_hidden = 4 * self.n_embd
            else:  # Llama: 2/3 of 4C, times a multiplier, rounded up (11008 for C=4096; Llama 3: 14336)
                f, m = int(self.mlp_multiplier * int(8 * self.n_embd / 3)), self.mlp_multiple_of
                self.mlp_hidden = m * math.ceil(f / m)
        else:
            pos_int("GPTConfig.mlp_hidden", self.mlp_hidden, what="a positive int or None")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def _preset(cls, base: dict, kw: dict) -> "GPTConfig":
        # overrides go in before __post_init__, so derived sizes (the MLP width) follow them
        return cls(**{**base, **kw})

    @classmethod
    def tiny(cls, **kw) -> "GPTConfig":
        """~0.8M parameters: trains on a laptop CPU in seconds."""
        return cls._preset({}, kw)

    @classmethod
    def gpt2_small(cls, **kw) -> "GPTConfig":
        """GPT-2 124M (Radford et al. 2019) shapes."""
        return cls._preset(dict(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768), kw)

    @classmethod
    def gpt2_medium(cls, **kw) -> "GPTConfig":
        """GPT-2 350M shapes."""
        return cls._preset(dict(vocab_size=50257, block_size=1024, n_layer=24, n_head=16, n_embd=1024), kw)

    @classmethod
    def llama_7b(cls, **kw) -> "GPTConfig":
        """Llama-2-7B shapes (Touvron et al. 2023): 6.74B parameters."""
        return cls._preset(dict(vocab_size=32000, block_size=4096, n_layer=32, n_head=32, n_embd=4096,
                                mlp="swiglu", norm="rmsnorm", pos="rope", bias=False, tie_weights=False), kw)

    @classmethod
    def llama3_8b(cls, **kw) -> "GPTConfig":
        """Llama-3.1-8B shapes (Meta's config.json: hidden 4096, 32 layers, 32 query and 8 key/value heads,
        MLP 14336 = ffn_dim_multiplier 1.3 and multiple_of 1024, vocabulary 128256, RoPE theta 500000):
        8,030,261,248 parameters. block_size is 8192 here (the real context is 131072; it only sizes
        this model's RoPE tables, which are buffers, not parameters)."""
        return cls._preset(dict(vocab_size=128256, block_size=8192, n_layer=32, n_head=32, n_kv_head=8,
                                n_embd=4096, mlp_multiplier=1.3, mlp_multiple_of=1024, mlp="swiglu",
                                norm="rmsnorm", pos="rope", rope_theta=500000.0, bias=False,
                                tie_weights=False), kw)


class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019), as in Llama."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021) on (B, H, T, hd), rotate-half form."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)          # the tables are fp32 buffers
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        kv = cfg.n_kv_head * cfg.head_dim                                   # key/value width
        self.qkv = nn.Linear(cfg.n_embd, cfg.n_embd + 2 * kv, bias=cfg.bias)  # C -> C + 2 kv (3C without GQA)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, rope=None):
        B, T, C = x.shape
        H, KV, hd = self.cfg.n_head, self.cfg.n_kv_head, self.cfg.head_dim
        q, k, v = self.qkv(x).split([C, KV * hd, KV * hd], dim=2)   # (B, T, C), 2 x (B, T, KV*hd)
        q = q.view(B, T, H, hd).transpose(1, 2)                # (B, H, T, hd)
        k = k.view(B, T, KV, hd).transpose(1, 2)               # (B, KV, T, hd)
        v = v.view(B, T, KV, hd).transpose(1, 2)
        if rope is not None:
            q, k = _rope(q, *rope), _rope(k, *rope)
        if self.cfg.attn == "sdpa":
            # fused kernel: never materialises the (T, T) scores for backward; enable_gqa lets
            # H query heads share KV key/value heads without copying them
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KV != H,
                                               dropout_p=self.cfg.dropout if self.training else 0.0)
        else:
            if KV != H:                                        # explicit attention: copy k, v per query head
                k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(C // H))   # (B, H, T, T)
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
            att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)  # saved: (B, H, T, T)
            att = self.drop(att)
            y = att @ v                                                  # (B, H, T, hd)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.drop(self.proj(y))


class MLPBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        hid = cfg.mlp_hidden
        self.up = nn.Linear(cfg.n_embd, hid, bias=cfg.bias)                 # C -> F
        self.gate = nn.Linear(cfg.n_embd, hid, bias=cfg.bias) if self.swiglu else None
        self.down = nn.Linear(hid, cfg.n_embd, bias=cfg.bias)               # F -> C
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        if self.swiglu:
            h = F.silu(self.gate(x)) * self.up(x)                          # (B, T, F)
        else:
            h = F.gelu(self.up(x))                                          # (B, T, F)
        return self.drop(self.down(h))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        norm = (lambda: nn.LayerNorm(cfg.n_embd, bias=cfg.bias)) if cfg.norm == "layernorm" \
            else (lambda: RMSNorm(cfg.n_embd))
        self.ln1, self.attn, self.ln2, self.mlp = norm(), CausalSelfAttention(cfg), norm(), MLPBlock(cfg)

    def forward(self, x, rope=None):
        x = x + self.attn(self.ln1(x), rope)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A decoder-only transformer (nanoGPT-like). `model(idx)` -> logits (B, T, V);
    `model(idx, targets)` -> mean cross-entropy loss."""

    def __init__(self, cfg: GPTConfig | None = None):
        super().__init__()
        cfg = cfg or GPTConfig()
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"cfg must be a GPTConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)                   # V x C
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd) if cfg.pos == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias) if cfg.norm == "layernorm" else RMSNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)         # C -> V
        if cfg.tie_weights:
            self.head.weight = self.wte.weight
        self.apply(self._init_weights)                                         # GPT-2's init (as nanoGPT)
        if cfg.pos == "rope":
            hd = cfg.head_dim
            inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
            ang = torch.outer(torch.arange(cfg.block_size).float(), inv)      # (block_size, hd/2)
            ang = torch.cat((ang, ang), dim=-1)
            self.register_buffer("rope_cos", ang.cos(), persistent=False)
            self.register_buffer("rope_sin", ang.sin(), persistent=False)

    @staticmethod
    def _init_weights(m: nn.Module):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def num_params(self) -> int:
        """Distinct parameters (a tied embedding counts once)."""
        return sum(p.numel() for p in self.parameters())

    def embed(self, idx: torch.Tensor):
        """(B, T) token ids -> ((B, T, C) the first block's input, rope): token (+ learned position) embeddings,
        and for RoPE the (cos, sin) tables sliced to T, each (T, head_dim); None for learned positions."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.cfg.block_size}")
        x = self.wte(idx)                                                      # (B, T, C)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        rope = (self.rope_cos[:T], self.rope_sin[:T]) if self.cfg.pos == "rope" else None
        return self.drop(x), rope

    def run_blocks(self, x: torch.Tensor, rope) -> torch.Tensor:
        """(B, T, C) -> (B, T, C) through every block. The one method a checkpointed GPT overrides (lesson and
        exercise 02): each block keeps its activations here; a checkpointed block keeps only its input."""
        for block in self.blocks:
            x = block(x, rope)
        return x

    def features(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, C): the final norm's output, which the head turns into logits."""
        return self.ln_f(self.run_blocks(*self.embed(idx)))

    def loss(self, h: torch.Tensor, targets: torch.Tensor, loss_chunks: int = 1) -> torch.Tensor:
        """Mean cross-entropy of the head on features h (B, T, C) against targets (B, T). `loss_chunks` > 1
        computes it over that many chunks of positions, each under a checkpoint: only one chunk's (B, T/k, V)
        logits and log-softmax exist at a time, in forward and in backward (they are recomputed), instead of
        the whole (B, T, V) - the same loss and gradients."""
        pos_int("loss_chunks", loss_chunks)
        if loss_chunks == 1:
            logits = self.head(h)                                              # (B, T, V)
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        from torch.utils.checkpoint import checkpoint
        total = 0.0
        for h_c, t_c in zip(h.chunk(loss_chunks, dim=1), targets.chunk(loss_chunks, dim=1)):
            total = total + checkpoint(self._chunk_loss_sum, h_c, t_c, use_reentrant=False)
        return total / targets.numel()                                        # the mean over all B*T tokens

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, loss_chunks: int = 1):
        """(B, T) ids -> logits (B, T, V), or with targets the mean loss (see `loss` for `loss_chunks`)."""
        pos_int("loss_chunks", loss_chunks)
        h = self.features(idx)                                                 # (B, T, C)
        if targets is None:
            return self.head(h)                                                # (B, T, V)
        return self.loss(h, targets, loss_chunks)

    def _chunk_loss_sum(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(h)                                                  # (B, T/k, V)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")


# ----------------------------------------------------------------------------- one training step
def train_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, x: torch.Tensor, y: torch.Tensor,
               *, autocast_dtype: torch.dtype | None = None, scaler=None, set_to_none: bool = True) -> float:
    """forward -> backward -> optimizer step, with memlab phase marks.

    Returns the loss as a Python float (never the tensor: holding it would keep
    the graph alive); on the virtual GPU's fake tensors, nan. `autocast_dtype`
    runs the forward under torch.autocast on x's device (on the virtual GPU with
    CUDA's op lists, `memlab.core.virtual_gpu.cuda_autocast`); `scaler` is a
    torch.amp.GradScaler for fp16 (on the virtual GPU: `gpu.grad_scaler()`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    with phase("forward"):
        if autocast_dtype is not None:
            with (cuda_autocast(autocast_dtype) if _is_fake(x) else torch.autocast(x.device.type,
                                                                                   dtype=autocast_dtype)):
                loss = model(x, y)
        else:
            loss = model(x, y)
    with phase("backward"):
        (scaler.scale(loss) if scaler is not None else loss).backward()
    value = loss.detach().float().item() if loss.device.type != "meta" and not _is_fake(loss) else float("nan")
    del loss
    if optimizer is not None:
        with phase("step"):
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=set_to_none)
    return value


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


def tiny_llama_config(**kw):
    """A small `transformers.LlamaConfig` (for the Hugging Face / peft lessons)."""
    from transformers import LlamaConfig  # imported here: transformers is heavy
    base = dict(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    base.update(kw)
    return LlamaConfig(**base)
