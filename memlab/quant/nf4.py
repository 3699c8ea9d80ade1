"""Quantized weights: what they cost in bytes, what they lose in accuracy, and a
memory-exact stand-in for bitsandbytes' 4-bit Linear on the virtual GPU.

Bits per parameter of block-wise 4-bit quantization (Dettmers et al. 2023,
"QLoRA: Efficient Finetuning of Quantized LLMs", sections 2-3):

    no double quantization   4 + 32/64                 = 4.5     (one fp32 absmax per 64 weights)
    double quantization      4 + 8/64 + 32/(64*256)   ~= 4.127   (absmax in 8 bits, one fp32 scale
                                                                   per 256 of them, and one fp32 offset)

`nf4_bytes` is the exact byte count of what `bitsandbytes.functional.quantize_4bit`
keeps for one tensor (packed codes, absmax, the nested state, and the two small code
tables each QuantState owns; read off bitsandbytes 0.50, and tests/test_quant.py checks
it against the installed version); `quant_state_bytes` measures the same on a real QuantState.

The integer round trips (`absmax_roundtrip`, `zeropoint_roundtrip`) return the
dequantized tensor, so their error can be compared with bitsandbytes' NF4/FP4
(`bnb_roundtrip`) on the same weights. None of them packs codes: that is the
exercise.

Importing this module imports only torch; bitsandbytes, transformers and peft are
imported inside the functions that need them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.validate import flag, one_of, pos_int

__all__ = ["BLOCKSIZE", "DQ_BLOCKSIZE", "bits_per_param", "nf4_bytes", "quant_state_bytes", "adam8bit_state_bytes",
           "Roundtrip", "absmax_roundtrip", "zeropoint_roundtrip", "bnb_roundtrip", "relative_error",
           "Linear4bitStandIn"]

BLOCKSIZE = 64        # weights per absmax (QLoRA's NF4 default; bitsandbytes' quantize_4bit default)
DQ_BLOCKSIZE = 256    # absmax values per second-level scale in double quantization (QLoRA section 3)
_NF4_CODE = 16        # entries of the 4-bit code table (fp32) each QuantState owns
_DYNAMIC_CODE = 256   # entries of the 8-bit dynamic map (fp32) copied into each nested state


# ----------------------------------------------------------------------------- formulas
def bits_per_param(blocksize: int = BLOCKSIZE, double_quant: bool = False, code_bits: int = 4,
                   scale_bits: int = 32, dq_bits: int = 8, dq_blocksize: int = DQ_BLOCKSIZE) -> float:
    """Storage bits per weight of block-wise quantization, for a long tensor.

    Without double quantization each block of `blocksize` weights carries one
    `scale_bits` absmax: code_bits + scale_bits / blocksize (4 + 32/64 = 4.5).
    With it (QLoRA section 3) the absmax values are themselves quantized to
    `dq_bits` in blocks of `dq_blocksize`, each with one fp32 scale:
    code_bits + dq_bits / blocksize + 32 / (blocksize * dq_blocksize)
    (4 + 8/64 + 32/16384 = 4.127). Per-tensor constants (the offset, code tables) are left out.
    """
    for n, v in (("blocksize", blocksize), ("code_bits", code_bits), ("scale_bits", scale_bits),
                 ("dq_bits", dq_bits), ("dq_blocksize", dq_blocksize)):
        pos_int(n, v)
    flag("double_quant", double_quant)
    if not double_quant:
        return code_bits + scale_bits / blocksize
    return code_bits + dq_bits / blocksize + 32 / (blocksize * dq_blocksize)


def nf4_bytes(numel: int, blocksize: int = BLOCKSIZE, double_quant: bool = True) -> dict[str, int]:
    """Exact bytes bitsandbytes keeps for one tensor of `numel` weights quantized
    with `quantize_4bit(..., blocksize, compress_statistics=double_quant)` (NF4 or FP4):

        codes      ceil(numel / 2)  uint8: two 4-bit codes per byte
        absmax     n_blocks = ceil(numel / blocksize) values: fp32, or uint8 with double quantization
        absmax2    ceil(n_blocks / 256) fp32 (double quantization only)
        offset     one fp32: the mean subtracted from absmax before quantizing it (double quantization only)
        tables     the 16-entry fp32 code table, plus the 256-entry fp32 dynamic map of the nested state
    """
    pos_int("numel", numel)
    pos_int("blocksize", blocksize)
    flag("double_quant", double_quant)
    n_blocks = -(-numel // blocksize)
    out = {"codes": (numel + 1) // 2, "absmax": n_blocks * (1 if double_quant else 4), "absmax2": 0, "offset": 0,
           "tables": 4 * _NF4_CODE}
    if double_quant:
        out["absmax2"] = 4 * -(-n_blocks // DQ_BLOCKSIZE)
        out["offset"] = 4
        out["tables"] += 4 * _DYNAMIC_CODE
    return out


def quant_state_bytes(packed: torch.Tensor, quant_state) -> dict[str, int]:
    """The bytes of a real bitsandbytes 4-bit tensor, by role (the keys of `nf4_bytes`)."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be the packed uint8 tensor quantize_4bit returned, got {type(packed).__name__}")
    if not hasattr(quant_state, "absmax") or not hasattr(quant_state, "blocksize"):
        raise TypeError(f"quant_state must be a bitsandbytes QuantState, got {type(quant_state).__name__}")
    nb = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
    s2 = quant_state.state2
    return {"codes": nb(packed), "absmax": nb(quant_state.absmax), "absmax2": nb(s2.absmax) if s2 else 0,
            "offset": nb(quant_state.offset), "tables": nb(quant_state.code) + (nb(s2.code) if s2 else 0)}



def adam8bit_state_bytes(numel: int, min_8bit_size: int = 4096, blocksize: int = 256) -> int:
    """Optimizer-state bytes of one parameter tensor under bitsandbytes' Adam8bit/AdamW8bit
    (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization"; block size and
    threshold as in bitsandbytes 0.50's `Optimizer2State.init_state`):
    two uint8 moments plus one fp32 absmax per moment per `blocksize` values,
    2 * numel + 8 * ceil(numel / blocksize) (about 2.03 bytes/param); tensors with fewer than
    `min_8bit_size` elements keep fp32 moments, 8 * numel. The two 256-entry fp32 quantization
    maps are shared by all tensors (2 KiB once) and not counted here."""
    pos_int("numel", numel)
    pos_int("min_8bit_size", min_8bit_size)
    pos_int("blocksize", blocksize)
    if numel < min_8bit_size:
        return 8 * numel
    return 2 * numel + 2 * 4 * -(-numel // blocksize)

# ----------------------------------------------------------------------------- round trips and error
@dataclass
class Roundtrip:
    """A tensor quantized and dequantized again, with its storage cost."""
    name: str
    x_hat: torch.Tensor        # dequantized values, same shape and dtype as the input
    bits_per_param: float      # codes + scales (+ zero points), per weight


def _check_x(x):
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point torch.Tensor, got {type(x).__name__}")
    if x.numel() == 0:
        raise ValueError("x must not be empty")


def _blocks(x, blocksize):
    """Flatten x (row-major) and cut it into blocks; the last block is padded with zeros."""
    flat = x.detach().reshape(-1).float()
    if blocksize is None:
        return flat.unsqueeze(0), 0
    pos_int("blocksize", blocksize)
    pad = (-flat.numel()) % blocksize
    return F.pad(flat, (0, pad)).view(-1, blocksize), pad


def _unblock(blocks, pad, x):
    flat = blocks.reshape(-1)
    return (flat[:flat.numel() - pad] if pad else flat).view(x.shape).to(x.dtype)


def absmax_roundtrip(x: torch.Tensor, bits: int = 8, blocksize: int | None = None) -> Roundtrip:
    """Symmetric ("absmax") integer quantization and back, per tensor or per block.

    s = absmax / (2^(bits-1) - 1);  q = round(x / s) in [-(2^(bits-1) - 1), 2^(bits-1) - 1];  x_hat = q * s.
    One fp32 scale per tensor (blocksize=None) or per `blocksize` consecutive weights
    of the flattened tensor: bits + 32 / blocksize bits per weight.
    """
    _check_x(x)
    pos_int("bits", bits)
    if bits < 2:
        raise ValueError(f"bits must be >= 2 for a signed grid, got {bits}")
    blocks, pad = _blocks(x, blocksize)
    qmax = 2 ** (bits - 1) - 1
    scale = blocks.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / qmax
    q = torch.round(blocks / scale).clamp(-qmax, qmax)
    per = 32 / (blocksize or x.numel())
    return Roundtrip(f"int{bits} absmax" + (f", blocks of {blocksize}" if blocksize else ", per tensor"),
                     _unblock(q * scale, pad, x), bits + per)


def zeropoint_roundtrip(x: torch.Tensor, bits: int = 8, blocksize: int | None = None) -> Roundtrip:
    """Asymmetric (zero-point) integer quantization and back, per tensor or per block.

    s = (max - min) / (2^bits - 1);  z = round(-min / s);  q = clamp(round(x / s) + z, 0, 2^bits - 1);
    x_hat = (q - z) * s. All 2^bits codes are used and the grid fits [min, max] even when it is
    not centred on zero. Storage: bits per weight + a fp32 scale and a `bits`-bit zero point per block.
    """
    _check_x(x)
    pos_int("bits", bits)
    blocks, pad = _blocks(x, blocksize)
    levels = 2 ** bits - 1
    lo, hi = blocks.amin(dim=1, keepdim=True), blocks.amax(dim=1, keepdim=True)
    scale = ((hi - lo) / levels).clamp_min(torch.finfo(torch.float32).tiny)
    zero = torch.round(-lo / scale)
    q = (torch.round(blocks / scale) + zero).clamp(0, levels)
    per = (32 + bits) / (blocksize or x.numel())
    return Roundtrip(f"int{bits} zero-point" + (f", blocks of {blocksize}" if blocksize else ", per tensor"),
                     _unblock((q - zero) * scale, pad, x), bits + per)


def bnb_roundtrip(x: torch.Tensor, quant_type: str = "nf4", blocksize: int = BLOCKSIZE,
                  double_quant: bool = False) -> Roundtrip:
    """bitsandbytes' `quantize_4bit` then `dequantize_4bit` on x's device; bits per
    weight measured from the stored tensors (codes, absmax, nested state and offset;
    the constant code tables are left out, as in the paper's 4.127)."""
    _check_x(x)
    one_of("quant_type", quant_type, ("nf4", "fp4"), what="'nf4' or 'fp4'")
    import bitsandbytes.functional as bnbF
    packed, qs = bnbF.quantize_4bit(x, blocksize=blocksize, quant_type=quant_type, compress_statistics=double_quant)
    x_hat = bnbF.dequantize_4bit(packed, qs)
    b = quant_state_bytes(packed, qs)
    bits = 8 * (b["codes"] + b["absmax"] + b["absmax2"] + b["offset"]) / x.numel()
    return Roundtrip(quant_type.upper() + (" + double quant" if double_quant else ""), x_hat, bits)


def relative_error(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """||x - x_hat|| / ||x|| (Frobenius norms, in fp64)."""
    for n, t in (("x", x), ("x_hat", x_hat)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(t).__name__}")
    if x.shape != x_hat.shape:
        raise ValueError(f"x and x_hat must have the same shape, got {tuple(x.shape)} and {tuple(x_hat.shape)}")
    x, x_hat = x.detach().double(), x_hat.detach().double()
    return float((x - x_hat).norm() / x.norm().clamp_min(1e-300))


# ----------------------------------------------------------------------------- a memory-exact 4-bit Linear
class _Dequant4bitMatmul(torch.autograd.Function):
    """y = x @ W^T with W dequantized on the fly, allocating what bitsandbytes'
    MatMul4Bit allocates on its dequantize-then-F.linear path (bitsandbytes 0.50,
    `_dequant_linear_fallback` and `MatMul4Bit.backward`): in the forward the fp32
    absmax (twice with double quantization: decoded, then + offset) and the (out, in)
    weight in the compute dtype; in the backward the fp32 absmax (offset added in place)
    and the weight in the quantized-from dtype. Like MatMul4Bit it saves no activation
    for backward: the frozen weight needs no input to compute the input's gradient.
    (On CUDA, bitsandbytes 0.50 uses a fused kernel instead when a batch has at most
    1536 tokens, which makes no (out, in) weight in the forward.)"""

    @staticmethod
    def forward(ctx, x, layer):
        if ctx is not None:
            ctx.layer = layer
        absmax = layer._absmax_temps()                                                          # alive until the end
        w = torch.zeros(layer.out_features, layer.in_features, dtype=x.dtype, device=x.device)  # (out, in)
        out = F.linear(x, w)
        del absmax, w
        return out

    @staticmethod
    def backward(ctx, grad_out):
        layer = ctx.layer
        absmax = layer._absmax_temps(in_place=True)
        w = torch.zeros(layer.out_features, layer.in_features, dtype=layer.quant_dtype, device=grad_out.device)
        del absmax                                   # freed once the weight is dequantized
        return torch.matmul(grad_out, w.to(grad_out.dtype)), None


class Linear4bitStandIn(nn.Module):
    """Holds exactly the storages `bitsandbytes.nn.Linear4bit` holds after
    quantization, and allocates what its forward and backward allocate, but keeps
    no values: its output is zeros. Use it where bitsandbytes cannot run, e.g. under
    FakeTensorMode on `memlab.VirtualGPU` (Params4bit cannot wrap a fake tensor).

    Stored, for W of shape (out_features, in_features), n = out * in (see `nf4_bytes`):
      weight   uint8 ((n + 1) // 2, 1), frozen: the packed codes (a Parameter, as Params4bit is)
      absmax   (n_blocks,) uint8 with double quantization, fp32 without
      absmax2  (ceil(n_blocks / 256),) fp32, offset () fp32, code2 (256,) fp32: double quantization only
      code     (16,) fp32: the NF4/FP4 table
    In bitsandbytes these live in `weight.quant_state`; here they are buffers, so
    `MemoryTracker` counts them with the parameters. Forward: x is cast to
    `compute_dtype`, multiplied, and the result cast back to x's dtype (Linear4bit.forward).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, *,
                 compute_dtype: torch.dtype = torch.bfloat16, quant_dtype: torch.dtype = torch.bfloat16,
                 blocksize: int = BLOCKSIZE, double_quant: bool = True, device=None):
        super().__init__()
        pos_int("in_features", in_features)
        pos_int("out_features", out_features)
        pos_int("blocksize", blocksize)
        for n, dt in (("compute_dtype", compute_dtype), ("quant_dtype", quant_dtype)):
            one_of(n, dt, (torch.float32, torch.float16, torch.bfloat16), what="torch.float32, float16 or bfloat16")
        if bias:
            raise ValueError("bias=True is not modelled (Llama's projections have no bias)")
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype, self.quant_dtype = compute_dtype, quant_dtype
        self.blocksize, self.double_quant = blocksize, bool(double_quant)
        n = in_features * out_features
        nb = -(-n // blocksize)
        kw = dict(device=device)
        self.weight = nn.Parameter(torch.zeros((n + 1) // 2, 1, dtype=torch.uint8, **kw), requires_grad=False)
        self.register_buffer("absmax", torch.zeros(nb, dtype=torch.uint8 if double_quant else torch.float32, **kw))
        self.register_buffer("code", torch.zeros(_NF4_CODE, **kw))
        if double_quant:
            self.register_buffer("absmax2", torch.zeros(-(-nb // DQ_BLOCKSIZE), **kw))
            self.register_buffer("offset", torch.zeros((), **kw))
            self.register_buffer("code2", torch.zeros(_DYNAMIC_CODE, **kw))

    def _absmax_temps(self, in_place: bool = False) -> list[torch.Tensor]:
        """The fp32 absmax a dequantization decodes first (double quantization only):
        forward, decoded and decoded + offset; backward, offset added in place."""
        if not self.double_quant:
            return []
        absmax = torch.zeros(self.absmax.shape, device=self.absmax.device)
        return [absmax.add_(self.offset)] if in_place else [absmax, absmax + self.offset]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp_dtype = x.dtype
        x = x.to(self.compute_dtype)
        if torch.is_grad_enabled() and x.requires_grad:
            out = _Dequant4bitMatmul.apply(x, self)
        else:                                    # no graph: the same allocations, nothing kept
            out = _Dequant4bitMatmul.forward(None, x, self)
        return out.to(inp_dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"compute_dtype={self.compute_dtype}, "
                f"double_quant={self.double_quant} (memory stand-in: outputs are zeros)")
