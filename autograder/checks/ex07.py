"""Checks for exercise 07: NF4 and LoRA by hand.

References are the libraries themselves, computed by the judge: bitsandbytes'
`quantize_4bit` / `dequantize_4bit` (NF4, CPU), its `quantize_blockwise` for the
double quantization of the scales, peft's LoRA layer (`get_peft_model` on a one-Linear
module with the same weights copied in), and for the memory estimator bnb's quantized
tensors plus memlab's tracker on a tiny Llama (transformers + peft, bf16 adapters,
torch.optim.AdamW), with a closed form written plainly below for every other config.

In the learner's process `run` makes the library shortcuts unusable for the learner's
own call: bitsandbytes' quantization functions and peft's entry points raise, and any
`bitsandbytes::` operator reaching the dispatcher is recorded and refused.
"""

from __future__ import annotations

import contextlib
import math
import sys
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memlab

from .common import Task, allclose, expect_int, expect_type, memlab_files, no_calls_into, tasks

NF4_BLOCK, DQ_BLOCK = 64, 256
# The grader judges several learners at once in threads: peft's dropout draws from torch's global RNG and
# transformers patches torch.nn.init while it builds a model, so the judges that use them hold this lock.
_GLOBAL_STATE = threading.RLock()
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
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
        with mode, no_calls_into(task, memlab_files("quant.py", "qlora.py", "llama.py"),
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
def dynamic_code() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic code (256 float32 levels in [-1, 1]): the code of task 7.2."""
    import bitsandbytes.functional as bf
    return bf.create_dynamic_map(signed=True).float()


def _nf4_input(case):
    """The tensor to quantize. kinds: normal; ties (entries exactly on the float32 midpoints between NF4
    levels, every block's absmax a power of two so x / absmax is exact); zeros (block 1 all zeros);
    scales (every block a different magnitude)."""
    g = torch.Generator().manual_seed(case["seed"])
    shape, bs = case["shape"], case["blocksize"]
    n = math.prod(shape)
    if case["kind"] == "ties":
        import bitsandbytes.functional as bf
        code = bf.get_4bit_type("nf4", device="cpu").float()
        mids = (code[:-1] + code[1:]) / 2                              # float32, as bitsandbytes computes them
        x = mids[torch.randint(0, 15, (n,), generator=g)]
        x[::bs] = torch.where(torch.rand(x[::bs].shape, generator=g) < 0.5, -1.0, 1.0)   # absmax 1 in every block
        x = x * 2.0 ** torch.randint(-3, 4, ((n + bs - 1) // bs,), generator=g).repeat_interleave(bs)[:n].float()
    else:
        x = torch.randn(n, generator=g)
        if case["kind"] == "zeros":
            x[bs:2 * bs] = 0.0
        if case["kind"] == "scales":
            x = x * torch.exp(3 * torch.randn((n + bs - 1) // bs, generator=g)).repeat_interleave(bs)[:n]
    x = x.reshape(shape)
    return x.to(torch.bfloat16) if case["dtype"] == "bfloat16" else x


def _nf4_case(r, kind, bs=64, dtype="float32", shape=None):
    if shape is None:
        n = bs * r.randint(2, 9) + r.randint(1, bs - 1)
        rows = r.choice([d for d in (3, 5, 7, 9, 11) if n % d == 0] or [1])
        shape = [rows, n // rows] if rows > 1 else [n]
    return {"seed": r.randrange(2**31), "shape": shape, "blocksize": bs, "dtype": dtype, "kind": kind}


def _nf4_cases(hidden, r):
    if not hidden:
        return [{"seed": 0, "shape": [10, 13], "blocksize": 64, "dtype": "float32", "kind": "normal"},
                {"seed": 1, "shape": [5, 15], "blocksize": 64, "dtype": "float32", "kind": "ties"}]
    odd = 2 * r.randint(20, 300) + 1
    return [_nf4_case(r, "normal"), _nf4_case(r, "scales"), _nf4_case(r, "zeros"), _nf4_case(r, "ties"),
            _nf4_case(r, "normal", bs=32), _nf4_case(r, "scales", bs=128), _nf4_case(r, "normal", dtype="bfloat16"),
            _nf4_case(r, "normal", shape=[odd]),                                     # an odd length
            _nf4_case(r, "normal", shape=[r.randint(3, 40)]),                        # shorter than one block
            _nf4_case(r, "normal", shape=[r.randint(2, 5), 64])]                     # whole blocks only


def _nf4_run(case, nf4_quantize, nf4_dequantize):
    import bitsandbytes.functional as bf
    x = _nf4_input(case)
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


def _unpack(packed: torch.Tensor, n: int, high_first=True) -> torch.Tensor:
    hi, lo = (packed >> 4) & 15, packed & 15
    a, b = (hi, lo) if high_first else (lo, hi)
    return torch.stack([a, b], dim=1).flatten()[:n]


def _nf4_judge(case, got):
    import bitsandbytes.functional as bf
    expect_type("result", got, dict)
    if got["ops"]:
        raise AssertionError(f"your functions called bitsandbytes' operators {got['ops']}: write the quantization "
                             f"yourself (torch only)")
    x = _nf4_input(case)
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
        raise AssertionError(f"absmax has {am.numel()} entries, expected {nb} (ceil({n} / {bs})){hint} {what}")
    if not torch.equal(am, want_am):
        hint = " All your absmax values equal the whole tensor's largest |x|: take the max over each block." \
            if torch.all(am == x.float().abs().max().double()) else " absmax of a block is max |x| over that block."
        allclose("absmax", am, want_am, rtol=0, atol=0)
        raise AssertionError(f"absmax differs {what}.{hint}")
    # packed codes: two per byte, the even element in the high nibble; odd n pads with the code of 0.0
    assert got["packed_dtype"] == "torch.uint8", f"packed must be torch.uint8, got {got['packed_dtype']} {what}"
    packed = torch.tensor(got["packed"], dtype=torch.int64)
    if packed.numel() != p_ref.numel():
        raise AssertionError(f"packed has {packed.numel()} bytes, expected ceil({n} / 2) = {p_ref.numel()}: two "
                             f"4-bit codes per byte {what}")
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
        raise AssertionError(f"code of element {i} is {int(codes[i])}, expected {int(ref_codes[i])} "
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
    try:
        allclose("nf4_dequantize(...)", got["deq"], want.flatten(), rtol=1e-6, atol=1e-7)
    except AssertionError as e:
        raise AssertionError(f"{e} {what}. value = level[code] * absmax of its block; element 2i is in the high "
                             f"nibble of byte i.") from None


# ----------------------------------------------------------------------------- task 7.2: double quantization
def _absmax_input(case):
    g = torch.Generator().manual_seed(case["seed"])
    a = torch.randn(case["blocks"], NF4_BLOCK, generator=g).abs().amax(dim=1)          # absmax of N(0,1) blocks
    if case["spread"]:
        a = a * torch.exp(torch.randn(case["blocks"], generator=g))
    return a.float()


def _bpp_cases(hidden, r):
    if not hidden:
        return [{"n": 4096 * 4096, "blocksize": 64, "double_quant": True}]
    return [{"n": 4096 * 11008, "blocksize": 64, "double_quant": True},
            {"n": r.randint(10_000, 200_000), "blocksize": 64, "double_quant": True},
            {"n": r.randint(10_000, 200_000), "blocksize": 64, "double_quant": False},
            {"n": 2 * r.randint(50, 5000) + 1, "blocksize": r.choice([32, 128]), "double_quant": True},
            {"n": r.randint(3, 63), "blocksize": 64, "double_quant": True},
            {"n": r.randint(1000, 100_000), "blocksize": r.choice([32, 128, 256]), "double_quant": False}]


def _dq_cases(hidden, r):
    if not hidden:
        return {"dq": [{"seed": 0, "blocks": 600, "spread": False}], "bpp": _bpp_cases(False, r)}
    return {"dq": [{"seed": r.randrange(2**31), "blocks": 256 * r.randint(1, 4) + r.randint(1, 255), "spread": False},
                   {"seed": r.randrange(2**31), "blocks": 256 * r.randint(1, 4) + r.randint(1, 255), "spread": True},
                   {"seed": r.randrange(2**31), "blocks": r.randint(2, 200), "spread": True},     # one partial block
                   {"seed": r.randrange(2**31), "blocks": 512, "spread": False}],               # whole blocks only
            "bpp": _bpp_cases(True, r)}


def _dq_cases_list(hidden, r):
    c = _dq_cases(hidden, r)
    return [{"what": "dq", **d} for d in c["dq"]] + [{"what": "bpp", **b} for b in c["bpp"]]


def _dq_run(case, double_quantize, double_dequantize, nf4_bits_per_param):
    import bitsandbytes.functional as bf
    if case["what"] == "bpp":
        with _no_bitsandbytes("task7_2_double_quant") as mode:
            v = nf4_bits_per_param(case["n"], blocksize=case["blocksize"], double_quant=case["double_quant"])
        return {"bpp": float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else repr(v),
                "ops": sorted(mode.ops)}
    a = _absmax_input(case)
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


def _bpp_reference(n, blocksize, double_quant):
    """Storage bits per parameter of an NF4 tensor of n values: the packed codes, plus either one float32
    absmax per block, or (double quantization) one uint8 code per block, one float32 absmax per 256 blocks
    and the float32 offset. The code books are shared constants, not counted. Below 300k values it is
    measured on bitsandbytes' own tensors; above, the same sum is written plainly."""
    if n <= 300_000:
        import bitsandbytes.functional as bf
        p, st = bf.quantize_4bit(torch.randn(n, generator=torch.Generator().manual_seed(n)), blocksize=blocksize, quant_type="nf4",
                                 compress_statistics=double_quant)
        nbytes = p.numel() * p.element_size() + st.absmax.numel() * st.absmax.element_size()
        if double_quant:
            nbytes += st.state2.absmax.numel() * st.state2.absmax.element_size() + st.offset.numel() * 4
        return 8 * nbytes / n
    nb = -(-n // blocksize)
    nbytes = -(-n // 2) + (nb + 4 * -(-nb // DQ_BLOCK) + 4 if double_quant else 4 * nb)
    return 8 * nbytes / n


def _dq_judge(case, got):
    import bitsandbytes.functional as bf
    expect_type("result", got, dict)
    if got["ops"]:
        raise AssertionError(f"your functions called bitsandbytes' operators {got['ops']}: write them yourself")
    if case["what"] == "bpp":
        v = got["bpp"]
        if not isinstance(v, float):
            raise AssertionError(f"nf4_bits_per_param must return a float, got {v}")
        want = _bpp_reference(case["n"], case["blocksize"], case["double_quant"])
        if not math.isclose(v, want, rel_tol=1e-9):
            raise AssertionError(
                f"nf4_bits_per_param({case['n']}, blocksize={case['blocksize']}, double_quant="
                f"{case['double_quant']}) = {v:.6f}, expected {want:.6f}. Count the bytes actually stored: "
                f"ceil(n / 2) bytes of codes, then per block either a float32 absmax or (double quantization) "
                f"a uint8 code, plus one float32 absmax per {DQ_BLOCK} blocks and one float32 offset; round "
                f"every count UP (a partial block still stores its scale).")
        return
    a = _absmax_input(case)
    nb = a.numel()
    nb2 = -(-nb // DQ_BLOCK)
    what = f"[{nb} absmax values]"
    offset = a.mean()
    q_ref, st2 = bf.quantize_blockwise(a - offset, blocksize=DQ_BLOCK)
    if not math.isclose(got["offset"], offset.item(), rel_tol=1e-6):
        raise AssertionError(f"offset = {got['offset']:.7g}, expected the mean of the absmax values "
                             f"{offset.item():.7g} {what}")
    assert got["absmax2_dtype"] == "torch.float32", f"absmax2 must be float32, got {got['absmax2_dtype']}"
    if len(got["absmax2"]) != nb2:
        raise AssertionError(f"absmax2 has {len(got['absmax2'])} entries, expected ceil({nb} / {DQ_BLOCK}) = {nb2}: "
                             f"one per block of {DQ_BLOCK} absmax values, the last block may be shorter {what}")
    try:
        allclose("absmax2", got["absmax2"], st2.absmax, rtol=1e-6, atol=0)
    except AssertionError as e:
        raise AssertionError(f"{e} {what}. absmax2 of a block is max |absmax - offset| over its "
                             f"{DQ_BLOCK} values (subtract the mean first).") from None
    assert got["q_dtype"] == "torch.uint8", f"qabsmax must be torch.uint8, got {got['q_dtype']} {what}"
    q = torch.tensor(got["q"], dtype=torch.int64)
    if q.numel() != nb:
        raise AssertionError(f"qabsmax has {q.numel()} entries, expected one per absmax ({nb}) {what}")
    code = st2.code.double()
    y = ((a - offset).double().view(-1)
         / st2.absmax.double().repeat_interleave(DQ_BLOCK)[:nb])         # the value each code stands for
    dist = (y[:, None] - code[None, :]).abs()
    best = dist.min(dim=1).values
    mine = dist.gather(1, q.clamp(0, 255)[:, None]).squeeze(1)
    ok = (q == q_ref.long()) | (mine <= best + 1e-7)
    if not ok.all():
        i = int((~ok).nonzero()[0])
        raise AssertionError(f"qabsmax[{i}] = {int(q[i])}, expected {int(q_ref[i])}: (absmax - offset) / absmax2 = "
                             f"{y[i].item():.6g} is nearest to code[{int(dist[i].argmin())}] = "
                             f"{code[int(dist[i].argmin())].item():.6g}; {int((~ok).sum())} of {nb} codes off "
                             f"{what}. Store the index of the NEAREST entry of the 256-entry code.")
    want = bf.dequantize_blockwise(q_ref, st2) + offset
    assert got["deq_dtype"] == "torch.float32", f"double_dequantize must return float32, got {got['deq_dtype']}"
    try:
        allclose("double_dequantize(...)", got["deq"], want, rtol=1e-5, atol=1e-6)
    except AssertionError as e:
        raise AssertionError(f"{e} {what}. absmax = code[q] * absmax2[block] + offset.") from None


# ----------------------------------------------------------------------------- task 7.3: LoRA linear
def _lora_cases(hidden, r):
    if not hidden:
        return [{"seed": 0, "d_in": 12, "d_out": 10, "r": 4, "alpha": 8.0, "dropout": 0.0, "bias": True, "lead": [2, 3]},
                {"seed": 1, "d_in": 9, "d_out": 7, "r": 2, "alpha": 16.0, "dropout": 0.25, "bias": False, "lead": [5]}]
    cases = []
    for dropout, bias in ((0.0, True), (0.0, False), (r.choice([0.1, 0.3, 0.5]), True), (0.2, False)):
        rank = r.randint(1, 6)
        alpha = float(r.choice([a for a in (1, 2, 3, 8, 16, 32) if a != rank]))
        cases.append({"seed": r.randrange(2**31), "d_in": r.randint(5, 40), "d_out": r.randint(3, 40), "r": rank,
                      "alpha": alpha, "dropout": dropout, "bias": bias,
                      "lead": r.choice([[r.randint(1, 6)], [2, r.randint(2, 5)]])})
    return cases


def _lora_tensors(case):
    g = torch.Generator().manual_seed(case["seed"] + 7)
    A = torch.randn(case["r"], case["d_in"], generator=g) * 0.3
    B = torch.randn(case["d_out"], case["r"], generator=g) * 0.3
    x = torch.randn(*case["lead"], case["d_in"], generator=g)
    gout = torch.randn(*case["lead"], case["d_out"], generator=g)
    return A, B, x, gout


def _base_linear(case):
    """The pretrained Linear, its weights drawn from the case's seed (no global RNG)."""
    lin = torch.nn.Linear(case["d_in"], case["d_out"], bias=case["bias"])
    g = torch.Generator().manual_seed(case["seed"])
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) / math.sqrt(case["d_in"]))
        if lin.bias is not None:
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) * 0.1)
    return lin


def _lora_run(case, LoRALinear):
    import torch.nn as nn
    base = _base_linear(case)
    A, B, x, gout = _lora_tensors(case)
    had_peft = "peft" in sys.modules
    with _no_peft("task7_3_lora_linear"), _no_bitsandbytes("task7_3_lora_linear") as mode:
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
                "B_zero": bool((b0 == 0).all())}
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
        layer.merge()
        with torch.no_grad():
            out_merged = layer(x.clone())
    grads = {"A": None if layer.lora_A.grad is None else layer.lora_A.grad.tolist(),
             "B": None if layer.lora_B.grad is None else layer.lora_B.grad.tolist(),
             "x": None if xg.grad is None else xg.grad.tolist(),
             "W": base.weight.grad is not None, "b": base.bias is not None and base.bias.grad is not None}
    return {"init": init, "trainable": trainable, "out_init": out_init.tolist(), "out": out.tolist(),
            "grads": grads, "out_eval": out_eval.tolist(), "merged_W": base.weight.detach().tolist(),
            "base_requires_grad": bool(base.weight.requires_grad), "out_merged": out_merged.tolist(),
            "classes": classes, "peft_loaded": (not had_peft) and "peft" in sys.modules, "ops": sorted(mode.ops)}


def _peft_reference(case):
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

    model = get_peft_model(One(_base_linear(case)), LoraConfig(r=case["r"], lora_alpha=case["alpha"],
                                                               lora_dropout=case["dropout"],
                                                               target_modules=["proj"]))
    lin = model.base_model.model.proj
    A, B, x, gout = _lora_tensors(case)
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


def _lora_judge(case, got):
    with _GLOBAL_STATE:
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
                             f"as the pretrained one (ΔW = BA = 0); a random B changes the model before training {what}")
    if not init["A_nonzero"]:
        raise AssertionError(f"lora_A is all zeros after __init__: with A = 0 and B = 0 both gradients are zero and "
                             f"nothing ever trains. Initialise A like nn.Linear (kaiming_uniform_, a=√5) {what}")
    if got["base_requires_grad"] or got["grads"]["W"] or got["grads"]["b"]:
        raise AssertionError(f"the base weight is trainable (requires_grad or a .grad after backward): freeze "
                             f"base.weight and base.bias with requires_grad_(False); only A and B train {what}")
    want_tr = sorted([["lora_A", [r, d_in]], ["lora_B", [d_out, r]]])
    if got["trainable"] != want_tr:
        raise AssertionError(f"the trainable parameters are {got['trainable']}, expected exactly {want_tr} {what}")
    base = _base_linear(case)
    A, B, x, gout = _lora_tensors(case)
    with torch.no_grad():
        allclose("output right after __init__ (eval mode)", got["out_init"], base(x), rtol=1e-5, atol=1e-6)
    ref = _peft_reference(case)
    s = case["alpha"] / r
    hint = (f" The adapter adds (alpha / r) · B A x = {s:g} · B A x (alpha = {case['alpha']:g}, r = {r}), "
            f"with dropout on x in the adapter path only (nn.Dropout, called once, on the input of A).")
    for name, g_, w in (("output (train mode)", got["out"], ref["out"]), ("output (eval mode)", got["out_eval"],
                                                                           ref["out_eval"])):
        try:
            allclose(name, g_, w, rtol=1e-5, atol=1e-6)
        except AssertionError as e:
            raise AssertionError(f"{e} {what}.{hint}") from None
    for k in ("A", "B", "x"):
        if got["grads"][k] is None:
            raise AssertionError(f"no gradient reached {k} {what}")
        try:
            allclose(f"grad of {k}", got["grads"][k], ref[k], rtol=1e-4, atol=1e-6)
        except AssertionError as e:
            raise AssertionError(f"{e} {what}.{hint}") from None
    try:
        allclose("base.weight after merge()", got["merged_W"], ref["merged_W"], rtol=1e-5, atol=1e-6)
    except AssertionError as e:
        raise AssertionError(f"{e} {what}. merge() adds (alpha / r) · B @ A to base.weight in place.") from None
    try:
        allclose("output after merge() (eval mode)", got["out_merged"], ref["out_eval"], rtol=1e-4, atol=1e-5)
    except AssertionError as e:
        raise AssertionError(f"{e} {what}. After merge() the forward must not add the adapter a second time.") \
            from None


# ----------------------------------------------------------------------------- task 7.4: QLoRA memory
KEYS = ("base_nf4", "base_16bit", "adapters", "gradients", "optimizer", "activations", "total")


def _proj_shapes(cfg):
    """(d_out, d_in) of the seven projections of one Llama decoder layer."""
    C, F = cfg["hidden"], cfg["intermediate"]
    kv = cfg["kv_heads"] * (C // cfg["heads"])
    return [(C, C), (kv, C), (kv, C), (C, C), (F, C), (F, C), (C, F)]


def _qlora_closed_form(cfg, r, batch, seq, checkpointing):
    """The accounting of the task text, written out term by term."""
    C, F, L, H, V = cfg["hidden"], cfg["intermediate"], cfg["layers"], cfg["heads"], cfg["vocab"]
    kv = cfg["kv_heads"] * (C // H)
    nf4 = 0
    for o, i in _proj_shapes(cfg):
        n = o * i
        blocks = -(-n // NF4_BLOCK)
        nf4 += -(-n // 2) + blocks + 4 * -(-blocks // DQ_BLOCK) + 4      # codes, uint8 scales, absmax2, offset
    nf4 *= L
    base16 = 2 * (V * C + V * C + (2 * L + 1) * C)                    # embeddings, lm_head, norms in bf16
    n_ad = L * sum(r * (o + i) for o, i in _proj_shapes(cfg))
    adapters = 2 * n_ad
    grads = 2 * n_ad
    optimizer = 2 * 2 * n_ad + 4 * (L * 7 * 2)                        # exp_avg, exp_avg_sq in bf16 + a step per tensor
    BT = batch * seq
    layer = 2 * BT * (6 * C + 2 * kv + 4 * F + 7 * r) + 4 * batch * H * seq
    outside = 2 * 2 * BT * C + 4 * BT * V
    acts = (L * 2 * BT * C + layer if checkpointing else L * layer) + outside
    d = {"base_nf4": nf4, "base_16bit": base16, "adapters": adapters, "gradients": grads, "optimizer": optimizer,
         "activations": acts}
    d["total"] = sum(d.values())
    return d


_MEASURED: dict = {}


def _qlora_measured(cfg, r):
    """Model-state bytes of a real tiny Llama: each projection quantized by bitsandbytes (NF4, double
    quantization; the bytes of the tensors it returns), the other weights in bf16, peft LoRA adapters in
    bf16 on all seven projections, one AdamW step measured by memlab's tracker."""
    key = (tuple(sorted(cfg.items())), r)
    if key in _MEASURED:
        return _MEASURED[key]
    import bitsandbytes.functional as bf
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    lc = LlamaConfig(hidden_size=cfg["hidden"], intermediate_size=cfg["intermediate"],
                     num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                     num_key_value_heads=cfg["kv_heads"], vocab_size=cfg["vocab"], max_position_embeddings=64,
                     tie_word_embeddings=False)
    model = LlamaForCausalLM(lc).to(torch.bfloat16)
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
    out = {"base_nf4": int(nf4), "base_16bit": int(base16), "adapters": sum(p.nbytes for p in trainable),
           "gradients": bd["gradients"], "optimizer": bd["optimizer"]}
    _MEASURED[key] = out
    return out


TINY = {"hidden": 40, "intermediate": 88, "layers": 2, "heads": 4, "kv_heads": 2, "vocab": 97}
LLAMA_7B = {"hidden": 4096, "intermediate": 11008, "layers": 32, "heads": 32, "kv_heads": 32, "vocab": 32000}


def _qlora_cases(hidden, r):
    if not hidden:
        return [{"cfg": TINY, "r": 3, "batch": 2, "seq": 9, "checkpointing": False, "measure": True},
                {"cfg": TINY, "r": 3, "batch": 2, "seq": 9, "checkpointing": True, "measure": False}]
    heads = r.choice([2, 3, 4, 6])
    C = heads * 2 * r.randint(3, 7)                                  # head size even (RoPE), C no power of two
    tiny = {"hidden": C, "intermediate": r.randint(2 * C, 3 * C) | 1, "layers": r.randint(1, 3), "heads": heads,
            "kv_heads": r.choice([k for k in (1, 2, 3, heads) if heads % k == 0]), "vocab": r.randint(50, 150)}
    return [{"cfg": tiny, "r": r.randint(1, 5), "batch": r.randint(1, 3), "seq": r.randint(5, 20),
             "checkpointing": r.random() < 0.5, "measure": True},
            {"cfg": LLAMA_7B, "r": r.choice([8, 16, 64]), "batch": r.randint(1, 4), "seq": r.choice([512, 1000, 2048]),
             "checkpointing": True, "measure": False},
            {"cfg": LLAMA_7B, "r": r.choice([8, 16, 64]), "batch": r.randint(1, 4), "seq": r.choice([512, 1000, 2048]),
             "checkpointing": False, "measure": False},
            {"cfg": {"hidden": 5120, "intermediate": 13824, "layers": 40, "heads": 40, "kv_heads": 40,
                     "vocab": 32000}, "r": r.randint(2, 40), "batch": r.randint(1, 3), "seq": r.randint(100, 999),
             "checkpointing": r.random() < 0.5, "measure": False},
            {"cfg": tiny, "r": r.randint(1, 5), "batch": r.randint(1, 3), "seq": r.randint(5, 20),
             "checkpointing": True, "measure": False},
            {"cfg": tiny, "r": r.randint(1, 5), "batch": r.randint(1, 3), "seq": r.randint(5, 20),
             "checkpointing": False, "measure": False}]


def _qlora_run(case, qlora_memory):
    with _no_bitsandbytes("task7_4_qlora_memory") as mode:
        res = qlora_memory(dict(case["cfg"]), r=case["r"], batch=case["batch"], seq=case["seq"],
                           checkpointing=case["checkpointing"])
    if not isinstance(res, dict):
        raise TypeError(f"qlora_memory must return a dict, got {type(res).__name__}")
    return {"res": {str(k): (v if type(v) is int else repr(v)) for k, v in res.items()}, "ops": sorted(mode.ops)}


_HINTS = {
    "base_nf4": "per projection matrix of n = d_out * d_in weights: ceil(n/2) bytes of codes + ceil(n/64) uint8 "
                "scales + 4 * ceil(ceil(n/64) / 256) bytes of absmax2 + a 4-byte offset; seven projections per layer",
    "base_16bit": "embeddings V*C, lm_head V*C (not tied) and 2L+1 RMSNorm weights of C, all in bf16",
    "adapters": "r * (d_in + d_out) per projection, 7 projections per layer (q and k/v differ with grouped-query "
                "attention: k and v have d_out = kv_heads * C / heads), 2 bytes each",
    "gradients": "one bf16 gradient per adapter parameter",
    "optimizer": "AdamW keeps exp_avg and exp_avg_sq in the parameter's dtype (bf16: 2 + 2 bytes) and a 4-byte "
                 "step per adapter tensor (2 tensors per projection)",
    "activations": "see the accounting in the task text; with checkpointing every layer keeps its bf16 input and "
                   "ONE layer's activations are alive again during its recomputation",
    "total": "the sum of the six other entries",
}


def _qlora_judge(case, got):
    with _GLOBAL_STATE:
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
    want = _qlora_closed_form(cfg, case["r"], case["batch"], case["seq"], case["checkpointing"])
    if case["measure"]:
        measured = _qlora_measured(cfg, case["r"])
        for k, v in measured.items():      # the closed form is itself checked against the measurement
            assert want[k] == v, f"internal: closed form {k} = {want[k]} but measured {v}"
        for k, v in measured.items():
            if res[k] != v:
                raise AssertionError(f"{k} = {res[k]} bytes, but a real tiny Llama measures {v} bytes "
                                     f"(bitsandbytes' tensors and memlab's tracker) {what}. Hint: {_HINTS[k]}.")
    for k in KEYS:
        if res[k] != want[k]:
            raise AssertionError(f"{k} = {res[k]} bytes, expected {want[k]} {what}. Hint: {_HINTS[k]}.")


TASKS = tasks(
    Task("task7_1_nf4_quantize", ("nf4_quantize", "nf4_dequantize"), _nf4_cases, _nf4_run, _nf4_judge),
    Task("task7_2_double_quant", ("double_quantize", "double_dequantize", "nf4_bits_per_param"), _dq_cases_list,
         _dq_run, _dq_judge),
    Task("task7_3_lora_linear", ("LoRALinear",), _lora_cases, _lora_run, _lora_judge),
    Task("task7_4_qlora_memory", ("qlora_memory",), _qlora_cases, _qlora_run, _qlora_judge),
)
