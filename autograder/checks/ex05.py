"""Checks for exercise 05: attention in O(T) memory.

References are naive: `torch.softmax` for the online softmax, and a plain einsum
attention (`naive_attention` below, the whole T_q x T_k matrix) with autograd for the
tiled forward, its logsumexp and its gradients. What a task must not allocate is
measured in the learner's process by `LargestOutput` (the largest tensor any aten op
produces) and the saved-for-backward tensors by `saved_tensors_hooks`.
"""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import memlab

from .common import Task, allclose, expect_type, tasks

SOFTMAX_LIKE = {"softmax", "log_softmax", "logsumexp", "_softmax", "_log_softmax", "scaled_dot_product_attention",
                "_scaled_dot_product_flash_attention_for_cpu", "_safe_softmax"}


def naive_attention(q, k, v, is_causal=False):
    """The reference: memlab's einsum attention with the whole (..., T_q, T_k) matrix; (out, lse (..., T_q))."""
    return memlab.naive_attention(q, k, v, is_causal=is_causal, return_lse=True)


class LargestOutput(TorchDispatchMode):
    """Records the numel of the largest tensor any aten op returns, and the softmax-like ops called."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if name in SOFTMAX_LIKE:
            self.ops.add(name)
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


# ----------------------------------------------------------------------------- task 5.1: online softmax
def _softmax_input(case):
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["rows"], case["n"], generator=g) * case["scale"]
    if case["neg_inf"]:
        mask = torch.rand(case["rows"], case["n"], generator=g) < 0.3
        mask[:, 0] = False                   # every row keeps at least one finite entry
        x = x.masked_fill(mask, float("-inf"))
    if case["rising"]:                       # the row max moves to a later block: the running sum must be rescaled
        x = x + torch.linspace(0, 40, case["n"])
    return x


def _softmax_cases(hidden, r):
    if not hidden:
        return [{"seed": 0, "rows": 3, "n": 10, "block": 4, "scale": 1.0, "neg_inf": False, "rising": True}]
    cases = []
    for neg_inf, rising, scale in ((False, True, 1.0), (True, False, 1.0), (True, True, 30.0), (False, False, 200.0)):
        block = r.choice([3, 5, 7, 16])
        n = block * r.randint(2, 5) + r.randint(1, block - 1)          # a last, partial block
        cases.append({"seed": r.randrange(2**31), "rows": r.randint(1, 5), "n": n, "block": block, "scale": scale,
                      "neg_inf": neg_inf, "rising": rising})
    cases.append({"seed": r.randrange(2**31), "rows": 2, "n": 8, "block": 8, "scale": 1.0, "neg_inf": False,
                  "rising": False})                                  # one block exactly
    cases.append({"seed": r.randrange(2**31), "rows": 2, "n": 5, "block": 16, "scale": 1.0, "neg_inf": True,
                  "rising": True})                                   # block longer than the row
    return cases


def _softmax_run(case, online_softmax):
    x = _softmax_input(case)
    with LargestOutput() as mode:
        out = _tensor("online_softmax(x, block)", online_softmax(x, case["block"]))
    return {"out": out.tolist(), "dtype": str(out.dtype), "ops": sorted(mode.ops)}


def _softmax_judge(case, got):
    expect_type("result", got, dict)
    if got["ops"]:
        raise AssertionError(f"online_softmax called {got['ops']}: compute the running max and sum yourself")
    assert got["dtype"] == "torch.float32", f"online_softmax returned {got['dtype']} for a float32 input"
    want = torch.softmax(_softmax_input(case).double(), dim=-1)
    try:
        allclose("online_softmax(x, block)", got["out"], want, rtol=1e-4, atol=1e-6)
    except AssertionError as e:
        hint = (" When a later block has a larger max m_new, the running sum must be rescaled: "
                "l = l * exp(m_old - m_new) + sum(exp(x_block - m_new)).") if case["rising"] else ""
        hint += " Rows are not a whole number of blocks: is the last, partial block included?" \
            if case["n"] % case["block"] else ""
        raise AssertionError(f"{e} [{case['rows']} rows of {case['n']}, block {case['block']}]{hint}") from None


# ----------------------------------------------------------------------------- task 5.2 and 5.3: attention
def _qkv(case, requires_grad=False):
    """q, k, v of shape (*lead, T, d). For causal cases the later keys point along the queries' common
    direction, so masked scores are far larger than visible ones: a mask applied after the tile's max fails."""
    g = torch.Generator().manual_seed(case["seed"])
    lead, tq, tk, d = case["lead"], case["tq"], case["tk"], case["d"]
    q = torch.randn(*lead, tq, d, generator=g)
    k = torch.randn(*lead, tk, d, generator=g)
    v = torch.randn(*lead, tk, d, generator=g)
    if case["causal"] and case.get("steep", True):
        u = torch.randn(d, generator=g)
        u = u / u.norm()
        q = q * 0.3 + 3 * u
        k = k * 0.3 + (3.0 * torch.arange(tk))[:, None] * u * math.sqrt(d)   # score of key j: about 9 j
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _attn_case(r, causal, tq=None, tk=None, tile=16, lead=None):
    tq = tq or r.randint(3, 6) * tile + r.randint(1, tile - 1)        # not a multiple of the tile
    tk = tq if causal else (tk or r.randint(3, 6) * tile + r.randint(1, tile - 1))
    return {"seed": r.randrange(2**31), "lead": lead if lead is not None else r.choice([[], [2], [2, 3]]),
            "tq": tq, "tk": tk, "d": r.choice([4, 8]), "tile": tile, "causal": causal}


def _attn_cases(hidden, r):
    if not hidden:
        return [{"seed": 1, "lead": [2], "tq": 40, "tk": 40, "d": 8, "tile": 16, "causal": False},
                {"seed": 2, "lead": [2], "tq": 40, "tk": 40, "d": 8, "tile": 16, "causal": True}]
    return [_attn_case(r, False), _attn_case(r, True), _attn_case(r, False, lead=[2, 2]),
            _attn_case(r, True, lead=[]), _attn_case(r, False, tq=r.randint(70, 90), tk=r.randint(20, 30))]


def _no_full_matrix(case, largest):
    lead = math.prod(case["lead"]) if case["lead"] else 1
    full = lead * case["tq"] * case["tk"]
    if largest * 2 >= full:
        raise AssertionError(f"some operation produced a tensor of {largest} elements, at least half the "
                             f"{full}-element score matrix (..., {case['tq']}, {case['tk']}): work tile by tile "
                             f"(tile {case['tile']}) so no tensor holds all the scores")


def _tiled_run(case, tiled_attention):
    q, k, v = _qkv(case)
    with LargestOutput() as mode:
        res = tiled_attention(q, k, v, is_causal=case["causal"], tile=case["tile"])
    if not (isinstance(res, tuple) and len(res) == 2):
        raise TypeError(f"tiled_attention must return a tuple (out, lse), got {type(res).__name__}")
    out, lse = _tensor("out", res[0]), _tensor("lse", res[1])
    return {"out": out.tolist(), "lse": lse.tolist(), "largest": mode.largest, "ops": sorted(mode.ops)}


def _causal_hint(case):
    return "" if not case.get("steep", True) else (" (causal: mask the future keys with -inf BEFORE taking each tile's max; a row's masked scores "
            "here are far larger than its visible ones)") if case["causal"] else ""


def _tiled_judge(case, got):
    expect_type("result", got, dict)
    if got["ops"]:
        raise AssertionError(f"tiled_attention called {got['ops']}: the point is the online softmax over tiles")
    out, lse = naive_attention(*[t.double() for t in _qkv(case)], is_causal=case["causal"])
    shape = f"q {case['lead'] + [case['tq'], case['d']]}, k/v {case['lead'] + [case['tk'], case['d']]}"
    for name, g, w in (("out", got["out"], out), ("lse", got["lse"], lse)):
        try:
            allclose(name, g, w, rtol=1e-3, atol=1e-4)
        except AssertionError as e:
            raise AssertionError(f"{e} [{shape}, tile {case['tile']}, causal={case['causal']}]"
                                 f"{_causal_hint(case)}") from None
    _no_full_matrix(case, got["largest"])


def _flash_cases(hidden, r):
    # plain random inputs: gradients through the steep causal inputs of task 5.2 are ill-conditioned in fp32
    if not hidden:
        return [{"seed": 3, "lead": [2], "tq": 40, "tk": 40, "d": 8, "tile": 16, "causal": True, "steep": False}]
    cases = [_attn_case(r, False), _attn_case(r, True), _attn_case(r, False, tq=r.randint(70, 90),
                                                                     tk=r.randint(20, 30), lead=[2])]
    # the peak of forward + backward, measured at T and 2T: linear in T, not quadratic
    growth = {"seed": r.randrange(2**31), "lead": [2], "tq": 128, "tk": 128, "d": 8, "tile": 16,
              "causal": False, "growth": True}
    return [dict(c, steep=False) for c in cases + [growth]]


def _peak_fwd_bwd(FlashAttention, case, t):
    """Tracker peak of FlashAttention forward + backward at sequence length t (inputs made before tracking)."""
    c = dict(case, tq=t, tk=t)
    q, k, v = _qkv(c, requires_grad=True)
    tracker = memlab.MemoryTracker()
    with tracker:
        FlashAttention.apply(q, k, v, c["causal"]).sum().backward()
    return tracker.peak


def _flash_run(case, FlashAttention):
    if not (isinstance(FlashAttention, type) and issubclass(FlashAttention, torch.autograd.Function)):
        raise TypeError("FlashAttention must be a subclass of torch.autograd.Function")
    q, k, v = _qkv(case, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(list(t.shape))
        return t

    g = torch.Generator().manual_seed(case["seed"] + 1)
    with LargestOutput() as mode:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _tensor("FlashAttention.apply(...)", FlashAttention.apply(q, k, v, case["causal"]))
        fwd_largest = mode.largest
        dout = torch.randn(out.shape, generator=g)
        out.backward(dout)
    grads = [t.grad.tolist() if t.grad is not None else None for t in (q, k, v)]
    peaks = [_peak_fwd_bwd(FlashAttention, case, t) for t in (case["tq"], 2 * case["tq"])] \
        if case.get("growth") else None
    return {"out": out.tolist(), "grads": grads, "saved": saved, "fwd_largest": fwd_largest,
            "largest": mode.largest, "ops": sorted(mode.ops), "peaks": peaks}


def _flash_judge(case, got):
    expect_type("result", got, dict)
    if got["ops"]:
        raise AssertionError(f"FlashAttention called {got['ops']}: use your online softmax over tiles")
    q, k, v = [t.double().requires_grad_(True) for t in _qkv(case)]
    out, lse = naive_attention(q, k, v, is_causal=case["causal"])
    g = torch.Generator().manual_seed(case["seed"] + 1)
    out.backward(torch.randn(out.shape, generator=g).double())
    allclose("FlashAttention output", got["out"], out.detach(), rtol=1e-3, atol=1e-4)
    for name, gg, t in zip(("dq", "dk", "dv"), got["grads"], (q, k, v)):
        if gg is None:
            raise AssertionError(f"{name} is None: backward must return a gradient for q, k and v "
                                 f"(and None for is_causal)")
        try:
            allclose(name, gg, t.grad, rtol=2e-3, atol=2e-4)
        except AssertionError as e:
            raise AssertionError(f"{e} [causal={case['causal']}]. Recompute each tile's probabilities "
                                 f"P = exp(S - lse) from the saved logsumexp; dS = P * (dP - D) with "
                                 f"D = rowsum(dO * O).{_causal_hint(case)}") from None
    lead = case["lead"]
    allowed = [lead + [case["tq"], case["d"]], lead + [case["tk"], case["d"]], lead + [case["tq"]]]
    extra = [s for s in got["saved"] if s not in allowed]
    if extra or len(got["saved"]) != 5:
        raise AssertionError(f"forward saved tensors of shapes {got['saved']}; save exactly q, k, v, the output "
                             f"and the logsumexp {lead + [case['tq']]} with ctx.save_for_backward, and recompute "
                             f"the probabilities in backward")
    _no_full_matrix(case, got["largest"])
    if case.get("growth"):
        p1, p2 = (expect_type("peak", p, int) for p in got["peaks"])
        # linear terms double with T, T x T terms quadruple; at these sizes a kept score matrix gives > 3x
        assert p2 <= 2.6 * p1, (f"the peak of forward + backward grew {p2 / p1:.2f}x when T doubled "
                                f"({case['tq']} -> {2 * case['tq']}): O(T) memory grows about 2x. Something of "
                                f"size T_q x T_k is alive during the step")


TASKS = tasks(
    Task("task5_1_online_softmax", ("online_softmax",), _softmax_cases, _softmax_run, _softmax_judge),
    Task("task5_2_tiled_attention", ("tiled_attention",), _attn_cases, _tiled_run, _tiled_judge),
    Task("task5_3_flash_function", ("FlashAttention",), _flash_cases, _flash_run, _flash_judge),
)
