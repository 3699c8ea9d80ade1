"""Exercise 05's judges: each compares what `run` returned with a naive reference computed here (refs.py)
and raises AssertionError with a teaching message; and `corroborate`, which reads task 5.2's large case together
with the memory the sandbox saw it take."""

from __future__ import annotations

import math

import torch

from ..common import allclose, expect_int, expect_type
from .cases import LARGE_FLAG_BYTES, LARGE_SCORES, largest_allowed
from .inputs import qkv, softmax_input
from .refs import naive_attention


# ----------------------------------------------------------------------------- task 5.1: online softmax
def softmax_judge(case, got):
    expect_type("result", got, dict)
    if got["ops"]:
        raise AssertionError(f"online_softmax called {got['ops']}: compute the running max and sum yourself")
    assert got.get("input_changed") is False, (
        "online_softmax changed its input x (an in-place op on x or a view of it): the caller's tensor must come "
        "back as it was; write the result into a new tensor")
    widest = expect_int("the widest reduction", got.get("widest"))
    assert widest <= case["block"], (
        f"online_softmax reduced {widest} entries at once (a max, sum or sort over more than one block of "
        f"{case['block']} columns) [{case['rows']} rows of {case['n']}]: read each row one block at a time, keeping "
        f"the running max m and sum l as you go; after the last block only the elementwise exp(x - m) / l remains")
    dtype = case.get("dtype", "float32")
    assert got["dtype"] == f"torch.{dtype}", f"online_softmax returned {got['dtype']} for a {dtype} input"
    want = torch.softmax(softmax_input(case).double(), dim=-1)
    tol = {"rtol": 1e-4, "atol": 1e-6} if dtype == "float32" else {"rtol": 1e-9, "atol": 1e-12}
    try:
        allclose("online_softmax(x, block)", got["out"], want, **tol)
    except AssertionError as e:
        hint = (" When a later block has a larger max m_new, the running sum must be rescaled: "
                "l = l * exp(m_old - m_new) + sum(exp(x_block - m_new)).") if case["rising"] else ""
        hint += " Rows are not a whole number of blocks: is the last, partial block included?" \
            if _partial_block_dropped(case, got["out"], want) else ""
        if case.get("shift"):
            hint += (" These rows lie hundreds below (or above) zero and far apart from each other: start the "
                     "running max at -inf, not 0, and keep one max per row (a max over all rows underflows "
                     "exp(x - m) to 0 in the lower rows).")
        if dtype == "float64":
            hint += " The input is float64: keep the running max and sum in x's dtype (float32 loses 9 digits)."
        if case.get("inf_first"):
            hint += (f" Rows {case['inf_first']} start with a whole block of -inf: their running max is still -inf "
                     f"after it, and exp(-inf - (-inf)) is NaN; rescale with exp(m - m_new) only where m_new is "
                     f"finite (e.g. subtract a max of 0 where it is -inf).")
        raise AssertionError(f"{e} [{case['rows']} rows of {case['n']}, block {case['block']}]{hint}") from None


def _partial_block_dropped(case, out, want) -> bool:
    """Does the output look as if the last, partial block was left out: either the full blocks hold the softmax
    of the full blocks alone (the partial block missing from the sum), or only the partial block's columns are
    wrong?"""
    full = case["n"] - case["n"] % case["block"]
    try:
        out = torch.as_tensor(out, dtype=torch.float64)
    except (TypeError, ValueError, RuntimeError):
        return False
    if full == case["n"] or full == 0 or out.shape != want.shape:
        return False
    close = lambda a, b: bool(torch.allclose(a, b, rtol=1e-4, atol=1e-6, equal_nan=True))      # noqa: E731
    alone = torch.softmax(softmax_input(case).double()[..., :full], dim=-1)
    return close(out[..., :full], alone) or (close(out[..., :full], want[..., :full])
                                             and not close(out[..., full:], want[..., full:]))


# ----------------------------------------------------------------------------- task 5.2 and 5.3: attention
def _no_full_matrix(case, largest, tile):
    """No tensor larger than one (..., tile, tile) score tile or the (..., T, d) inputs and outputs: a strip of
    one query tile against all the keys (no key tiles) or all the queries against one key tile is too large."""
    bound = largest_allowed(case, tile)
    if largest > bound:
        lead = math.prod(case["lead"]) if case["lead"] else 1
        raise AssertionError(
            f"some operation produced a tensor of {largest} elements; with tile {tile} the largest tensor may be "
            f"{bound} elements: a (..., tile, tile) score tile or a tensor the size of q, k, v or the output "
            f"(scores (..., {case['tq']}, {case['tk']}), {lead * case['tq'] * case['tk']} elements in all). Loop "
            f"over query tiles AND, inside, over key tiles of `tile` keys with the online softmax, so no tensor "
            f"holds a whole row of scores")


def _causal_hint(case):
    return "" if not case.get("steep", True) else (
        " (causal: mask the future keys with -inf BEFORE taking each tile's max; a row's masked scores "
        "here are far larger than its visible ones)") if case["causal"] else ""


def _reference_rows(case):
    """The large case's sampled query rows, naively in float64: (..., rows, d) and (..., rows)."""
    q, k, v = [t.double() for t in qkv(case)]
    rows = torch.tensor(case["rows"])
    s = q[..., rows, :] @ k.transpose(-1, -2) / math.sqrt(case["d"])          # (..., rows, T_k)
    if case["causal"]:
        s = s.masked_fill(torch.arange(case["tk"])[None, :] > rows[:, None], float("-inf"))
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def tiled_judge(case, got):
    expect_type("result", got, dict)
    if got["ops"]:
        raise AssertionError(f"tiled_attention called {got['ops']}: the point is the online softmax over tiles")
    out, lse = _reference_rows(case) if "rows" in case else \
        naive_attention(*[t.double() for t in qkv(case)], is_causal=case["causal"])
    shape = f"q {case['lead'] + [case['tq'], case['d']]}, k/v {case['lead'] + [case['tk'], case['d']]}"
    for name, g, w in (("out", got["out"], out), ("lse", got["lse"], lse)):
        allclose(name, g, w, rtol=1e-3, atol=1e-4,
                 hint=f" [{shape}, tile {case['tile']}, causal={case['causal']}]{_causal_hint(case)}")
    _no_full_matrix(case, got["largest"], case["tile"])


def flash_judge(case, got):
    expect_type("result", got, dict)
    if got["ops"]:
        raise AssertionError(f"FlashAttention called {got['ops']}: use your online softmax over tiles")
    q, k, v = [t.double().requires_grad_(True) for t in qkv(case)]
    out, lse = naive_attention(q, k, v, is_causal=case["causal"])
    g = torch.Generator().manual_seed(case["seed"] + 1)
    out.backward(torch.randn(out.shape, generator=g).double())
    allclose("FlashAttention output", got["out"], out.detach(), rtol=1e-3, atol=1e-4)
    for name, gg, t in zip(("dq", "dk", "dv"), got["grads"], (q, k, v)):
        if gg is None:
            raise AssertionError(f"{name} is None: backward must return a gradient for q, k and v "
                                 f"(and None for is_causal)")
        allclose(name, gg, t.grad, rtol=2e-3, atol=2e-4,
                 hint=f" [causal={case['causal']}]. Recompute each tile's probabilities P = exp(S - lse) from the "
                      f"saved logsumexp; dS = P * (dP - D) with D = rowsum(dO * O).{_causal_hint(case)}")
    lead = case["lead"]
    allowed = [lead + [case["tq"], case["d"]], lead + [case["tk"], case["d"]], lead + [case["tq"]]]
    extra = [s for s in got["saved"] if s not in allowed]
    if extra or len(got["saved"]) != 5:
        raise AssertionError(f"forward saved tensors of shapes {got['saved']}; save exactly q, k, v, the output "
                             f"and the logsumexp {lead + [case['tq']]} with ctx.save_for_backward, and recompute "
                             f"the probabilities in backward")
    tiles = got.get("tiles") or []
    if tiles:           # the tile your forward passed to tiled_attention bounds both passes
        _no_full_matrix(case, got["largest"], max(expect_type("tile", t, int) for t in tiles))
    else:               # tiled_attention was not called: no tensor of half the scores or more
        lead = math.prod(case["lead"]) if case["lead"] else 1
        full = lead * case["tq"] * case["tk"]
        if got["largest"] * 2 >= full:
            raise AssertionError(f"some operation produced a tensor of {got['largest']} elements, at least half the "
                                 f"{full}-element score matrix (..., {case['tq']}, {case['tk']}): work tile by "
                                 f"tile so no tensor holds all the scores")
    if case.get("growth"):
        p1, p2 = (expect_type("peak", p, int) for p in got["peaks"])
        # linear terms double with T, T x T terms quadruple; at these sizes a kept score matrix gives > 3x
        assert p2 <= 2.6 * p1, (f"the peak of forward + backward grew {p2 / p1:.2f}x when T doubled "
                                f"({case['tq']} -> {2 * case['tq']}): O(T) memory grows about 2x. Something of "
                                f"size T_q x T_k is alive during the step")


# ----------------------------------------------------------------------------- task 5.2's large case, from outside
def corroborate(runs) -> list[str]:
    """Task 5.2's large case seen from outside: the learner's process reported no tensor larger than a score
    tile, yet while that case ran (its memory window, sandbox.py) the sandbox's memory rose by half the whole
    (LEAD, T, T) fp32 score matrix or more. Then something held the scores where the tracker could not see them (a
    dispatch mode switched off, work done outside torch): flag it for the instructor. `runs` holds (task id, case,
    value, the case's memory growth in bytes or None) for every case. The grader looks for `corroborate` in the
    package's judge.py (the trusted side)."""
    MiB = 2**20
    for tid, case, value, growth in runs:
        if tid != "task5_2_tiled_attention" or not case.get("watched") or not isinstance(value, dict) \
                or growth is None:
            continue
        largest = value.get("largest")
        if isinstance(largest, int) and largest <= largest_allowed(case, case["tile"]) \
                and growth >= LARGE_FLAG_BYTES:
            return [f"task5_2_tiled_attention: while the large case ran, the sandbox's memory grew by "
                    f"{growth / MiB:.0f} MiB, enough for much of its whole score matrix ({LARGE_SCORES / MiB:.0f} "
                    f"MiB), while your code reported no tensor larger than a score tile"]
    return []
