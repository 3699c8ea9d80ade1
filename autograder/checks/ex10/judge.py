"""Exercise 10's judges (the grader): recompute each answer with the references of refs.py and compare with
exact types; every message teaches, and marks its expected values with expected(...) so that hidden feedback hides
them."""

from __future__ import annotations

from ..common import expected, mb
from .cases import _closed_peak
from .inputs import block_desc
from .refs import arena_of, live_peak, optimum, overlapping_pairs, reference_block, reference_kept_meta, \
    storage_lifetimes

RTOL = 1e-4                     # float32 convolutions and batch norms summed in a different order
LARGE_SLACK = 1.25              # a recorded step's arena against its live-bytes bound


def _problem(task: str, got):
    if not isinstance(got, dict):
        raise AssertionError(f"{task}: the check received {type(got).__name__} instead of its result")
    if "problem" in got:
        raise AssertionError(f"{task}: {got['problem']}")


# ----------------------------------------------------------------------------- task 10.1
def _lifetimes_judge(case, got):
    _problem("task10_1", got)
    if "intervals" in case:
        intervals = [tuple(lt) for lt in case["intervals"]]
        want, bound = live_peak(intervals), got["bound"]
        if bound == want:
            return
        hint = ""
        if not intervals:
            hint = " No tensors: nothing is ever alive, so the bound is 0."
        elif bound == sum(s for s, _, _ in intervals):
            hint = " That is the sum of all the sizes: tensors that never live at the same time can share bytes."
        elif bound == _closed_peak(intervals):
            hint = (" A tensor is alive on [birth, death): one that dies at time t and one born at t are never "
                    "alive together (at equal times, take the frees before the births).")
        else:
            hint = (" The lifetimes come in no particular order: evaluate the live bytes at every birth t, counting "
                    "the sizes with birth <= t < death (or sort all the births and deaths by time).")
        raise AssertionError(f"live_bytes_bound({_short(intervals)}) returned {bound}; the most bytes alive at one "
                             f"moment is {expected(want)}.{hint}")
    events = [tuple(e) for e in case["events"]]
    want, lts = storage_lifetimes(events), [tuple(lt) for lt in got["lifetimes"]]
    allocs = [t for t, e in enumerate(events) if e[0] == "alloc"]
    if len(lts) != len(want):
        hint = (" More than the allocations: a view (\"view\") and an in-place op (\"inplace\") make no new "
                "storage." if len(lts) > len(want) else
                " Fewer than the allocations: every \"alloc\" is a lifetime, an empty tensor's (0 bytes) too, and a "
                "storage id used again after its storage was freed starts a new lifetime.")
        raise AssertionError(f"tensor_lifetimes returned {len(lts)} lifetimes for a trace of {len(events)} events "
                             f"with {expected(len(want))} \"alloc\" events, one lifetime per alloc, in their "
                             f"order.{hint}")
    for i, (g, w) in enumerate(zip(lts, want)):
        if g == w:
            continue
        at = f"lifetime {i} (the alloc at event {allocs[i]}, {events[allocs[i]]!r})"
        if g[0] != w[0] or g[1] != w[1]:
            raise AssertionError(f"tensor_lifetimes: {at} is {g}, expected size and birth {expected(w[:2])}: the "
                                 f"size is the alloc's nbytes, the birth the index of the alloc event.")
        if w[2] == len(events):
            hint = (" This storage is never freed: it is alive to the end of the trace, and a storage alive at the "
                    "end dies at len(events).")
        elif g[2] == w[2] + 1:
            hint = (" One too late: the death is the index of the \"free\" event itself (the storage is alive on "
                    "[birth, death)).")
        elif g[2] < w[2]:
            hint = (" Too early: a storage dies when the LAST tensor on it is freed; a view made from it keeps it "
                    "alive after the tensor that allocated it is gone.")
        else:
            hint = (" Too late: the storage dies at the \"free\" of its last tensor; count only the tensors made "
                    "while THIS storage lived (ids are used again later).")
        raise AssertionError(f"tensor_lifetimes: {at} dies at {g[2]}, expected {expected(w[2])}.{hint}")


def _short(intervals) -> str:
    text = repr(intervals)
    return text if len(text) <= 120 else text[:117] + "..."


# ----------------------------------------------------------------------------- task 10.2
def _plan_judge(case, got):
    _problem("task10_2", got)
    if "too_slow" in got:
        raise AssertionError(f"task10_2: plan_offsets took more than {got['too_slow']} s on "
                             f"{len(case['lifetimes'])} tensors; placing each tensor once, in a sorted order, "
                             f"beside the tensors it is alive with, takes a fraction of a second.")
    lts, a = [tuple(lt) for lt in case["lifetimes"]], case["alignment"]
    offsets, arena = got["offsets"], got["arena"]
    what = _plan_desc(case)
    bad = [(i, o) for i, o in enumerate(offsets) if o < 0 or o % a]
    if bad:
        i, o = bad[0]
        raise AssertionError(f"task10_2 ({what}): offset {o} of tensor {i} is not a non-negative multiple of the "
                             f"alignment {a}; every offset must be (round each gap's start up to the alignment: "
                             f"-(-end // alignment) * alignment).")
    pairs = overlapping_pairs(lts, offsets)
    if pairs:
        i, j = pairs[0]
        raise AssertionError(f"task10_2 ({what}): tensors {i} {lts[i]} at offset {offsets[i]} and {j} {lts[j]} at "
                             f"offset {offsets[j]} are alive together and share bytes ({len(pairs)} such pairs). "
                             f"Two tensors are alive together when both hold bytes and birth_a < death_b and "
                             f"birth_b < death_a; place each tensor clear of every such tensor already placed.")
    real = arena_of(lts, offsets)
    if arena != real:
        summed = lts and arena == sum(s for s, _, _ in lts)
        hint = " That is the sum of the sizes, not the arena of your plan." if summed else ""
        raise AssertionError(f"task10_2 ({what}): you reported an arena of {arena} bytes, but your offsets use "
                             f"{expected(real)}: the arena is max(offset + size) over the tensors that hold bytes "
                             f"(0 if there are none).{hint}")
    if case["kind"] == "small":
        best = optimum(lts, a)
        if arena > best:
            raise AssertionError(
                f"task10_2 ({what}): your arena is {arena} bytes; the best plan needs {expected(best)}, and placing "
                f"the tensors largest first finds it on this trace (whatever the order of equal sizes, lowest or "
                f"best-fitting gap). Sort by size, largest first, and put each tensor into a gap among the tensors "
                f"it is alive with (placing in order of birth, as an allocator must, misses here). Remember that "
                f"a tensor that dies at time t frees its bytes for one born at t.")
    if case["kind"] == "large":
        bound = live_peak(lts)
        if arena > LARGE_SLACK * bound:
            raise AssertionError(f"task10_2 ({what}): your arena of {mb(arena)} is {arena / bound:.2f}x the live-"
                                 f"bytes bound; a planner that reuses the bytes of dead tensors, largest first, stays "
                                 f"within a few percent of it on a training step (the grader allows "
                                 f"{LARGE_SLACK - 1:.0%}).")


def _plan_desc(case) -> str:
    n = len(case["lifetimes"])
    kind = {"small": f"a small trace of {n} tensors", "random": f"a random trace of {n} tensors",
            "large": f"{case.get('what', 'a recorded training step')}, {n} tensors", "empty": "no tensors"}
    return f"{kind[case['kind']]}, alignment {case['alignment']}"


# ----------------------------------------------------------------------------- task 10.3
def _close(got, want) -> bool:
    if got is None or want is None:
        return got is None and want is None
    scale = abs(want[1]) + 1e-6
    return all(abs(g - w) <= RTOL * scale for g, w in zip(got, want))


def _block_judge(case, got):
    _problem("task10_3", got)
    desc = block_desc(case)
    if case.get("predict_only"):
        want = reference_kept_meta(case)
    else:
        want = reference_block(case)
        _judge_block(case, got, want, desc)
    params, kept = got["predicted"]
    if params != want["param_bytes"]:
        hint = ""
        stats = 4 * 2 * (case["c_in"] + case["c_out"])
        if params == want["param_bytes"] + stats:
            hint = " The running mean and variance are buffers, not parameters: they get no gradient."
        elif params == want["param_bytes"] - stats:
            hint = " Each batch norm has a weight and a bias per channel: parameters too."
        raise AssertionError(f"block_bytes for {desc}: you predict {params} parameter bytes, the block has "
                             f"{expected(want['param_bytes'])}: 9 * c_in (depthwise) + c_in * c_out (pointwise) + "
                             f"2 * (c_in + c_out) (the batch norms' weights and biases), 4 bytes each.{hint}")
    tol = 16 * (case["c_in"] + case["c_out"]) + 64          # the batch norms' per-channel statistics, the loss
    if abs(kept - want["kept"]) > tol:
        one = 4 * case["batch"] * want["side"] ** 2
        hint = ""
        if kept in (2 * one * case["c_out"], one * (case["c_in"] + case["c_out"])):
            hint = (" Two tensors per block is the standard convolution's count; a separable block is two "
                    "conv + batch norm + ReLU layers: each keeps its batch norm's input and its ReLU's output.")
        elif kept > want["kept"]:
            hint = (" Too many: the input x is made before the block (not counted), and the depthwise conv's "
                    "output has the OUTPUT side: side' = ceil(side / stride) = (side - 1) // stride + 1.")
        raise AssertionError(f"block_bytes for {desc}: you predict {kept} bytes kept for backward, the grader "
                             f"measured {expected(want['kept'])} (within {tol} bytes, the batch norms' statistics). "
                             f"Count the four (batch, channels, side', side') fp32 tensors the forward keeps.{hint}")


def _judge_block(case, got, want, desc):
    c_in, c_out = case["c_in"], case["c_out"]
    if got.get("shape") != want["shape"]:
        raise AssertionError(f"task10_3 ({desc}): the output has shape {tuple(got.get('shape') or ())}, expected "
                             f"{expected(tuple(want['shape']))}: a 3x3 depthwise conv with padding 1 and the stride, "
                             f"then a 1x1 pointwise conv to c_out channels.")
    if got["param_bytes"] != want["param_bytes"]:
        extra, hint = got["param_bytes"] - want["param_bytes"], ""
        if extra == 4 * (c_in + c_out):
            hint = (" That is one bias per conv output channel: a conv followed by batch norm needs no bias (the "
                    "norm subtracts the mean, and its own bias takes the role): bias=False.")
        elif extra >= 4 * 9 * c_in * (c_in - 1):
            hint = " Is the 3x3 conv depthwise? groups=c_in gives each channel one 3x3 filter of its own."
        elif extra < 0:
            hint = " Each batch norm keeps a weight and a bias per channel (affine=True, the default)."
        raise AssertionError(f"task10_3 ({desc}): the block holds {mb(got['param_bytes'])} of parameters, the "
                             f"design holds {expected(mb(want['param_bytes']))}.{hint}")
    if not (got["filters"]["dw"] and got["filters"]["pw"]):
        raise AssertionError(f"task10_3 ({desc}): the block needs a depthwise filter of shape (c_in, 1, 3, 3) and a "
                             f"pointwise one of shape (c_out, c_in, 1, 1) (nn.Conv2d weights); found "
                             f"{[k for k, v in got['filters'].items() if v] or 'neither'}.")
    slack = 8 * (c_in + c_out)
    if got["kept"] > want["kept"] + slack:
        raise AssertionError(
            f"task10_3 ({desc}): the forward keeps {mb(got['kept'])} for backward; the design keeps "
            f"{expected(mb(want['kept']))}. Put the stride on the depthwise conv, so that every tensor after it "
            f"has the output's side, and keep nothing the backward does not need.")
    for key, what in (("out", "the output"), ("x_grad", "the input's gradient"),
                      ("dw_grad", "the depthwise filter's gradient"), ("pw_grad", "the pointwise filter's gradient")):
        if not _close(got.get(key), want[key]):
            raise AssertionError(f"task10_3 ({desc}): {what} differs from the reference block's (with the grader's "
                                 f"filters). The order is depthwise 3x3 conv (stride, padding 1, groups=c_in) -> "
                                 f"BatchNorm2d -> ReLU -> 1x1 conv -> BatchNorm2d -> ReLU, in training mode.")
    stats = got["stats"]
    for which, (mean, var) in zip(("depthwise", "pointwise"), want["stats"]):
        if not any(len(m) == len(mean) and _same(m, mean) for m in stats) or \
                not any(len(v) == len(var) and _same(v, var) for v in stats):
            raise AssertionError(f"task10_3 ({desc}): after one training step the {which} batch norm's running "
                                 f"statistics differ from one update's. A forward run twice (a checkpoint "
                                 f"recomputing it in backward) updates them twice: keep batch norm out of "
                                 f"recomputed regions (lesson 02).")


def _same(a, b) -> bool:
    return all(abs(x - y) <= 1e-5 * (abs(y) + 1) for x, y in zip(a, b))
