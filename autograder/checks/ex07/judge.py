"""Exercise 07's judges: the learner's NF4 codes, scales and dequantized values against bitsandbytes', the double
quantization and bits per parameter against bitsandbytes' tensors, the LoRA layer against peft's, and the QLoRA
memory estimate against the bytes memlab measures (refs.py)."""

from __future__ import annotations

import math

import torch

from ..common import allclose, expect_int, expect_type, expected
from .cases import GLOBAL_STATE
from .inputs import DQ_BLOCK, absmax_input, base_linear, lora_tensors, nf4_input
from .refs import bpp_reference, measured_activations, measured_states, peft_reference, states_closed_form


# ----------------------------------------------------------------------------- task 7.1: NF4 quantize/dequantize
def _unpack(packed: torch.Tensor, n: int, high_first=True) -> torch.Tensor:
    hi, lo = (packed >> 4) & 15, packed & 15
    a, b = (hi, lo) if high_first else (lo, hi)
    return torch.stack([a, b], dim=1).flatten()[:n]


def nf4_judge(case, got):
    import bitsandbytes.functional as bf
    expect_type("result", got, dict)
    if got["ops"]:
        raise AssertionError(f"your functions called bitsandbytes' operators {got['ops']}: write the quantization "
                             f"yourself (torch only)")
    x = nf4_input(case)
    bs, n = case["blocksize"], x.numel()
    nb = -(-n // bs)
    what = f"[{case['dtype']} input of shape {case['shape']} ({n} values), blocksize {bs}, case '{case['kind']}']"
    p_ref, st = bf.quantize_4bit(x, blocksize=bs, quant_type="nf4")
    p_ref = p_ref.flatten()
    # absmax: one per block, exactly
    assert got["absmax_dtype"] == "torch.float32", f"absmax must be float32, got {got['absmax_dtype']} {what}"
    am = torch.tensor(got["absmax"], dtype=torch.float64)
    want_am = st.absmax.double()
    if am.shape != want_am.shape:
        hint = " One absmax per block of `blocksize` values, the last block may be shorter." if am.numel() != nb else ""
        raise AssertionError(f"absmax has {am.numel()} entries, expected {expected(nb)} (ceil({n} / {bs}))"
                             f"{hint} {what}")
    if not torch.equal(am, want_am):
        hint = " All your absmax values equal the whole tensor's largest |x|: take the max over each block." \
            if torch.all(am == x.float().abs().max().double()) else " absmax of a block is max |x| over that block."
        _same("absmax", am, want_am, 0, 0, what, hint)
    # packed codes: two per byte, the even element in the high nibble; odd n pads with the code of 0.0
    assert got["packed_dtype"] == "torch.uint8", f"packed must be torch.uint8, got {got['packed_dtype']} {what}"
    packed = torch.tensor(got["packed"], dtype=torch.int64)
    if packed.numel() != p_ref.numel():
        raise AssertionError(f"packed has {packed.numel()} bytes, expected ceil({n} / 2) = "
                             f"{expected(p_ref.numel())}: two 4-bit codes per byte {what}")
    if packed.min() < 0 or packed.max() > 255:
        raise AssertionError(f"packed holds values outside 0..255 {what}")
    ref_codes = _unpack(p_ref.long(), n)
    # the accepted code of each element: bitsandbytes' own, or the one x / absmax gives where
    # x * (1 / absmax) (bitsandbytes' rounding for whole blocks) lands on the other side of a midpoint
    code = bf.get_4bit_type("nf4", device="cpu").float()
    mids = (code[:-1] + code[1:]) / 2
    xf = torch.nn.functional.pad(x.float().flatten(), (0, nb * bs - n)).view(nb, bs)
    scaled = torch.clamp(xf / st.absmax.clamp(min=1e-38)[:, None], -1, 1).flatten()[:n]
    alt = torch.bucketize(scaled, mids)
    codes = _unpack(packed, n)
    ok = (codes == ref_codes) | (codes == alt)
    if not ok.all():
        i = int((~ok).nonzero()[0])
        hint = ""
        if torch.equal(_unpack(packed, n, high_first=False), ref_codes):
            hint = " The nibbles are swapped: element 2i goes in the HIGH 4 bits of byte i, element 2i+1 in the low 4."
        elif case["kind"] == "ties":
            hint = (" These values lie exactly on a midpoint between two NF4 levels: bitsandbytes gives the LOWER "
                    "level (code = number of midpoints strictly below x / absmax; midpoints computed in float32 as "
                    "(levels[:-1] + levels[1:]) / 2).")
        else:
            lin = torch.linspace(-1, 1, 16)
            if torch.equal(codes, (scaled[:, None] - lin).abs().argmin(-1)):
                hint = " Your codes follow an evenly spaced int4 grid: NF4's 16 levels are the normal quantiles."
            else:
                hint = " Scale each value by its block's absmax, then pick the nearest of NF4's 16 levels."
        raise AssertionError(f"code of element {i} is {int(codes[i])}, not bitsandbytes' "
                             f"(x = {x.flatten()[i].item():.6g}, x / absmax = {scaled[i].item():.6g}); "
                             f"{int((~ok).sum())} of {n} codes differ {what}.{hint}")
    if n % 2 and (int(packed[-1]) & 15) != (int(p_ref[-1]) & 15):
        raise AssertionError(f"{n} is odd: the low nibble of the last byte is padding and bitsandbytes stores the "
                             f"code of 0.0 there ({int(p_ref[-1]) & 15}), you stored {int(packed[-1]) & 15} {what}")
    # dequantize bitsandbytes' own packed codes and absmax
    # bitsandbytes' dequantization in float32, asked for an even 1-D length (an odd last dimension sends it
    # to a torch.compile'd fallback that takes seconds per shape); the padding value is dropped
    st.dtype, st.shape = torch.float32, torch.Size([n + n % 2])
    want = bf.dequantize_4bit(p_ref.view(-1, 1), st).flatten()[:n]
    assert got["deq_shape"] == list(x.shape), f"nf4_dequantize returned shape {got['deq_shape']}, expected " \
                                              f"{list(x.shape)} (the `shape` argument) {what}"
    assert got["deq_dtype"] == "torch.float32", f"nf4_dequantize must return float32, got {got['deq_dtype']} {what}"
    _same("nf4_dequantize(...)", got["deq"], want.flatten(), 1e-6, 1e-7, what,
          " value = level[code] * absmax of its block; element 2i is in the high nibble of byte i.")


def _same(name, got, want, rtol, atol, what, hint=""):
    """common.allclose against the library's values, its message (which names the learner's value, never the
    library's) followed by which case it was and a hint."""
    allclose(name, got, want, rtol=rtol, atol=atol, hint=f" {what}.{hint}")


# ----------------------------------------------------------------------------- task 7.2: double quantization
def dq_judge(case, got):
    import bitsandbytes.functional as bf
    expect_type("result", got, dict)
    if got["ops"]:
        raise AssertionError(f"your functions called bitsandbytes' operators {got['ops']}: write them yourself")
    if case["what"] == "bpp":
        v = got["bpp"]
        if not isinstance(v, float):
            raise AssertionError(f"nf4_bits_per_param must return a float, got {v}")
        want = bpp_reference(case["n"], case["blocksize"], case["double_quant"])
        if not math.isclose(v, want, rel_tol=1e-9):
            raise AssertionError(
                f"nf4_bits_per_param({case['n']}, blocksize={case['blocksize']}, double_quant="
                f"{case['double_quant']}) = {v:.6f} is {'too low' if v < want else 'too high'}. Count the bytes "
                f"actually stored: "
                f"ceil(n / 2) bytes of codes, then per block either a float32 absmax or (double quantization) "
                f"a uint8 code, plus one float32 absmax per {DQ_BLOCK} blocks and one float32 offset; round "
                f"every count UP (a partial block still stores its scale).")
        return
    a = absmax_input(case)
    nb = a.numel()
    nb2 = -(-nb // DQ_BLOCK)
    what = f"[{nb} absmax values]"
    offset = a.mean()
    q_ref, st2 = bf.quantize_blockwise(a - offset, blocksize=DQ_BLOCK)
    if not math.isclose(got["offset"], offset.item(), rel_tol=1e-6):
        raise AssertionError(f"offset = {got['offset']:.7g} is not the mean of the absmax values {what}")
    assert got["absmax2_dtype"] == "torch.float32", f"absmax2 must be float32, got {got['absmax2_dtype']}"
    if len(got["absmax2"]) != nb2:
        raise AssertionError(f"absmax2 has {len(got['absmax2'])} entries, expected ceil({nb} / {DQ_BLOCK}) = "
                             f"{expected(nb2)}: one per block of {DQ_BLOCK} absmax values, the last block may be "
                             f"shorter {what}")
    _same("absmax2", got["absmax2"], st2.absmax, 1e-6, 0, what,
          f" absmax2 of a block is max |absmax - offset| over its {DQ_BLOCK} values (subtract the mean first; "
          f"the largest MAGNITUDE, which may lie below the mean).")
    assert got["q_dtype"] == "torch.uint8", f"qabsmax must be torch.uint8, got {got['q_dtype']} {what}"
    q = torch.tensor(got["q"], dtype=torch.int64)
    if q.numel() != nb:
        raise AssertionError(f"qabsmax has {q.numel()} entries, expected one per absmax ({expected(nb)}) {what}")
    code = st2.code.double()
    y = ((a - offset).double().view(-1)
         / st2.absmax.double().repeat_interleave(DQ_BLOCK)[:nb])         # the value each code stands for
    dist = (y[:, None] - code[None, :]).abs()
    best = dist.min(dim=1).values
    mine = dist.gather(1, q.clamp(0, 255)[:, None]).squeeze(1)
    ok = (q == q_ref.long()) | (mine <= best + 1e-7)
    if not ok.all():
        i = int((~ok).nonzero()[0])
        raise AssertionError(f"qabsmax[{i}] = {int(q[i])} is not the nearest code of (absmax - offset) / absmax2 = "
                             f"{y[i].item():.6g}; {int((~ok).sum())} of {nb} codes off "
                             f"{what}. Store the index of the NEAREST entry of the 256-entry code.")
    want = bf.dequantize_blockwise(q_ref, st2) + offset
    assert got["deq_dtype"] == "torch.float32", f"double_dequantize must return float32, got {got['deq_dtype']}"
    _same("double_dequantize(...)", got["deq"], want, 1e-5, 1e-6, what,
          " absmax = code[q] * absmax2[block] + offset.")


# ----------------------------------------------------------------------------- task 7.3: LoRA linear
def lora_judge(case, got):
    with GLOBAL_STATE:
        _lora_judge_locked(case, got)


def _lora_judge_locked(case, got):
    expect_type("result", got, dict)
    what = (f"[d_in {case['d_in']}, d_out {case['d_out']}, r {case['r']}, alpha {case['alpha']}, "
            f"dropout {case['dropout']}, bias {case['bias']}]")
    lib = [c for c in got["classes"] if c.split(".")[0] in ("peft", "bitsandbytes")]
    if lib or got["peft_loaded"] or got["ops"]:
        raise AssertionError(f"LoRALinear uses {lib or got['ops'] or 'peft'}: write the layer with torch.nn only")
    init = got["init"]
    r, d_in, d_out = case["r"], case["d_in"], case["d_out"]
    if init["A_shape"] != [r, d_in] or init["B_shape"] != [d_out, r]:
        raise AssertionError(f"lora_A must have shape (r, d_in) = {[r, d_in]} and lora_B (d_out, r) = {[d_out, r]}, "
                             f"got {init['A_shape']} and {init['B_shape']} {what}")
    if not init["B_zero"]:
        raise AssertionError(f"lora_B is not all zeros after __init__: B = 0 makes the adapted layer start exactly "
                             f"as the pretrained one (ΔW = BA = 0); a random B changes the model before training "
                             f"{what}")
    if not init["A_nonzero"]:
        raise AssertionError(f"lora_A is all zeros after __init__: with A = 0 and B = 0 both gradients are zero and "
                             f"nothing ever trains. Initialise A like nn.Linear (kaiming_uniform_, a=√5) {what}")
    bound = 1 / math.sqrt(d_in)         # nn.Linear's (and peft's) kaiming_uniform_(a=√5): U(-1/√d_in, 1/√d_in)
    if not init["A_finite"] or init["A_absmax"] > bound * (1 + 1e-6):
        raise AssertionError(f"lora_A's initial entries are too large (or not finite): nn.Linear's initialisation, "
                             f"kaiming_uniform_(A, a=√5), draws them from U(-1/√d_in, 1/√d_in); a standard normal "
                             f"or a plain kaiming_uniform_ without a=√5 starts the adapter at the wrong scale {what}")
    if r * d_in >= 2048 and not 0.8 <= init["A_rms"] / (bound / math.sqrt(3)) <= 1.2:
        raise AssertionError(f"the spread of lora_A's initial entries (their root mean square) is not that of "
                             f"U(-1/√d_in, 1/√d_in) over {r * d_in} entries: initialise A with "
                             f"nn.init.kaiming_uniform_(A, a=math.sqrt(5)), like nn.Linear's weight {what}")
    if got["base_requires_grad"] or got["grads"]["W"] or got["grads"]["b"]:
        raise AssertionError(f"the base weight is trainable (requires_grad or a .grad after backward): freeze "
                             f"base.weight and base.bias with requires_grad_(False); only A and B train {what}")
    want_tr = sorted([["lora_A", [r, d_in]], ["lora_B", [d_out, r]]])
    if got["trainable"] != want_tr:
        raise AssertionError(f"the trainable parameters are {got['trainable']}, expected exactly "
                             f"{expected(want_tr)} {what}")
    base = base_linear(case)
    A, B, x, gout = lora_tensors(case)
    mag = _lora_magnitudes(case, base, A, B, x, gout)
    n = d_in + d_out + r + x.numel() // d_in + 4      # the longest sum any entry is made of
    with torch.no_grad():
        _near("output right after __init__ (eval mode)", got["out_init"], base(x), mag["out_init"], n, what,
              " Right after __init__ B = 0, so the layer must return base(x) exactly as the pretrained Linear.")
    ref = peft_reference(case)
    s = case["alpha"] / r
    hint = (f" The adapter adds (alpha / r) · B A x = {s:g} · B A x (alpha = {case['alpha']:g}, r = {r}), "
            f"with dropout on x in the adapter path only (nn.Dropout, called once, on the input of A).")
    _near("output (train mode)", got["out"], ref["out"], mag["out"], n, what, hint)
    _near("output (eval mode)", got["out_eval"], ref["out_eval"], mag["out"], n, what, hint)
    for k in ("A", "B", "x"):
        if got["grads"][k] is None:
            raise AssertionError(f"no gradient reached {k} {what}")
        _near(f"grad of {k}", got["grads"][k], ref[k], mag[k], n, what, hint)
    if got.get("merged_in_place") is not True:
        raise AssertionError(f"merge() replaced base.weight (a new tensor or Parameter) instead of adding "
                             f"(alpha / r) · B @ A to it in place {what}: the optimizer, a tied module or a saved "
                             f"reference still holds the old weight; use base.weight.add_(...) under torch.no_grad()")
    _near("base.weight after merge()", got["merged_W"], ref["merged_W"], mag["W"], n, what,
          " merge() adds (alpha / r) · B @ A to base.weight in place.")
    _near("output after merge() (eval mode)", got["out_merged"], ref["out_eval"], mag["out"], n, what,
          " After merge() the forward must not add the adapter a second time.")


U32 = 2.0 ** -24            # float32's unit roundoff


def _lora_magnitudes(case, base, A, B, x, gout):
    """For every compared quantity, the same computation on the absolute values of all its terms (float64, the
    dropout's 1 / (1 - p) included): the size of the terms each entry sums, to scale its rounding tolerance."""
    s, k = case["alpha"] / case["r"], 1 / (1 - case["dropout"])
    W, A, B = base.weight.detach().double().abs(), A.double().abs(), B.double().abs()
    b = base.bias.detach().double().abs() if base.bias is not None else 0.0
    x, g = x.double().abs(), gout.double().abs()
    xs, gs = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    return {"out_init": x @ W.T + b, "out": x @ W.T + b + s * k * (x @ A.T) @ B.T,
            "A": s * k * (gs @ B).T @ xs, "B": s * k * gs.T @ (xs @ A.T),
            "x": g @ W + s * k * (g @ B) @ A, "W": W + s * B @ A}


def _near(name, got, want, mag, n, what, hint=""):
    """got within float32 rounding of want (both float32 computations, in any order of evaluation): each entry
    within 4 n u times the size of the terms it sums (n the longest sum, u float32's unit roundoff). Compared in
    float64; the message names the entry and the learner's value, not the reference's."""
    g = torch.tensor(got, dtype=torch.float64)
    w = want.detach().double() if isinstance(want, torch.Tensor) else torch.tensor(want, dtype=torch.float64)
    if g.shape != w.shape:
        raise AssertionError(f"{name} has shape {tuple(g.shape)}, expected {tuple(w.shape)} {what}")
    tol = 4 * n * U32 * mag.double() + 1e-30
    bad = ~((g - w).abs() <= tol)
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(f"{name} differs from peft's at flat index {i} (yours: {g.flatten()[i].item():.6g}; "
                             f"{int(bad.sum())} of {bad.numel()} entries off by more than float32 rounding) "
                             f"{what}.{hint}")


# ----------------------------------------------------------------------------- task 7.4: QLoRA memory
KEYS = ("base_nf4", "base_16bit", "adapters", "gradients", "optimizer", "activations", "total")
STATES = KEYS[:5]
TINY_TOL = 32            # activations of a tiny case (real CPU tensors): the text's count is 8 to 16 bytes under the
                         # measurement; every term of the text is larger than this in every tiny case (cases.py)


def act_tol(case) -> int:
    """Bytes the activations may differ from the measurement. Tiny cases: TINY_TOL, smaller than each term the
    text counts (the smallest, the logsumexp and the RoPE tables, are >= 64 bytes there). Full size on the
    virtual GPU, which rounds every storage up to 512 bytes: 512 bytes for each of about 20 storages per layer
    and 10 outside (tests/test_checks_ex07.py); the tiny cases of the same run still catch any missing term."""
    return 512 * (20 * case["cfg"]["layers"] + 10) if case["virtual"] else TINY_TOL


_HINTS = {
    "base_nf4": "per projection matrix of n = d_out * d_in weights: ceil(n/2) bytes of codes + ceil(n/64) uint8 "
                "scales + 4 * ceil(ceil(n/64) / 256) bytes of absmax2 + a 4-byte offset; seven projections per layer",
    "base_16bit": "embeddings V*C, lm_head V*C (not tied) and 2L+1 RMSNorm weights of C, all in bf16",
    "adapters": "r * (d_in + d_out) per projection, 7 projections per layer (q and k/v differ with grouped-query "
                "attention: k and v have d_out = kv_heads * C / heads), 2 bytes each",
    "gradients": "one bf16 gradient per adapter parameter",
    "optimizer": "AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype (bf16: 2 + 2 bytes) and a 4-byte "
                 "step per adapter tensor (2 tensors per projection)",
}


def _activation_hint(case, got, m):
    """The likely mistake behind a wrong activation count, from the measured parts."""
    cfg, BT = case["cfg"], case["batch"] * case["seq"]
    logits = 4 * BT * cfg["vocab"]
    close = lambda v: abs(got - v) <= act_tol(case)                                    # noqa: E731
    if case["checkpointing"] and close(m["kept"]):
        return ("you counted what the forward keeps, but not the layer that is recomputed during the backward: "
                "with checkpointing add one layer's full activations")
    if close(m["activations"] - logits):
        return "the fp32 log-softmax output of the loss (4 * batch * seq * vocab bytes) is missing"
    lse = 4 * cfg["heads"] * BT * (1 if case["checkpointing"] else cfg["layers"])
    if close(m["activations"] - lse):
        return "sdpa's float32 logsumexp (4 bytes per head and token, in every layer that keeps its activations) " \
               "is missing"
    if close(m["activations"] - 4 * case["seq"] * (cfg["hidden"] // cfg["heads"])):
        return "the RoPE cos/sin tables the model builds for the sequence (2 * 2 * seq * head size bytes) are missing"
    if case["checkpointing"] and got > 2 * m["activations"]:
        return "checkpointing is on: each layer keeps only its bf16 input, not its full activations"
    if not case["checkpointing"] and got < m["activations"] / 2:
        return "checkpointing is off: every layer keeps its full activations"
    return ("count each term of the task text: per layer the two RMSNorms' fp32 inputs and rsqrt, their bf16 "
            "outputs, q/k/v after RoPE (k and v are C_kv wide), the attention output and its fp32 logsumexp, "
            "the four MLP tensors of width F, the seven rank-r adapter intermediates; layer 0 keeps less")


def qlora_judge(case, got):
    with GLOBAL_STATE:
        _qlora_judge_locked(case, got)


def _qlora_judge_locked(case, got):
    expect_type("result", got, dict)
    if got["ops"]:
        raise AssertionError(f"qlora_memory called bitsandbytes' operators {got['ops']}: compute the bytes by formula")
    res = got["res"]
    missing = [k for k in KEYS if k not in res]
    if missing:
        raise AssertionError(f"qlora_memory must return the keys {list(KEYS)}; missing {missing}")
    for k in KEYS:
        expect_int(k, res[k])
    cfg = case["cfg"]
    what = (f"[config {cfg}, r {case['r']}, batch {case['batch']}, seq {case['seq']}, "
            f"checkpointing {case['checkpointing']}]")
    states = states_closed_form(cfg, case["r"])
    source = "the same sums over bitsandbytes' and peft's tensors give"
    if not case["virtual"]:
        measured = measured_states(cfg, case["r"])
        for k, v in measured.items():      # the closed form is itself checked against the measurement
            assert states[k] == v, f"internal: closed form {k} = {states[k]} but measured {v}"
        states, source = measured, "a real tiny Llama measures (bitsandbytes' tensors and memlab's tracker)"
    for k in STATES:
        if res[k] != states[k]:
            raise AssertionError(f"{k} = {res[k]} bytes is {'fewer' if res[k] < states[k] else 'more'} than "
                                 f"{source} {what}. Hint: {_HINTS[k]}.")
    m = measured_activations(cfg, case["r"], case["batch"], case["seq"], case["checkpointing"], case["virtual"])
    where = ("memlab's tracker on the virtual GPU (1- and 2-layer cuts of this config, extended to its depth)"
             if case["virtual"] else "memlab's tracker on a tiny QLoRA Llama (transformers + peft) on the CPU")
    if abs(res["activations"] - m["activations"]) > act_tol(case):
        parts = "what the forward keeps" + (" + one recomputed layer" if case["checkpointing"] else "")
        side = "fewer" if res["activations"] < m["activations"] else "more"
        raise AssertionError(f"activations = {res['activations']} bytes is {side} than {where} measures ({parts}; "
                             f"tolerance {act_tol(case)} bytes) {what}. Hint: "
                             f"{_activation_hint(case, res['activations'], m)}.")
    own = sum(res[k] for k in KEYS[:6])
    if res["total"] != own:
        raise AssertionError(f"total = {res['total']}, but your six other entries sum to {own} {what}")
