"""Exercise 03's own check tests (tests/test_checks.py runs every exercise's solution and wrong submissions):
the hidden cases exercise every branch of the spec in every draw."""

from __future__ import annotations

import random

import pytest
import torch

from memlab.kit.ex03 import drive_scaler, param_groups, plan_inputs
from autograder.checks.ex03.cases import amp_cases, scaler_cases
from autograder.checks.ex03.refs import reference_amp
from autograder.checks.ex03.run import amp_run


def _gradscaler(plan):
    return torch.amp.GradScaler("cpu", **{k: plan[k] for k in ("init_scale", "growth_factor", "backoff_factor",
                                                                 "growth_interval")})


@pytest.mark.slow
def test_hidden_scaler_plans_cover_every_branch():
    # in every draw: growth, backoff after an injected NaN that follows growth_interval - 1 clean steps,
    # growth twice in a row, a skipped first step, inf / -inf / NaN, explicit unscale_ on a clean and a skipped step
    for seed in range(4):
        grow, first = [p for p in scaler_cases(True, random.Random(seed)) if p["kind"] == "plan"]
        assert {v for p in (grow, first) for _, v, _, _ in p["inject"]} == {"inf", "-inf", "nan"}
        steps = drive_scaler(_gradscaler(grow), grow)["steps"]
        g = grow["growth_interval"]
        ran = [s["ran"] for s in steps]
        assert ran[:g - 1] == [True] * (g - 1) and not ran[g - 1], "the NaN after g - 1 clean steps must skip"
        assert sum(s["after"] > s["used"] for s in steps) >= 3
        assert any(s["explicit"] is not None and s["ran"] for s in steps)
        assert any(s["explicit"] is not None and not s["ran"] for s in steps)
        steps = drive_scaler(_gradscaler(first), first)["steps"]
        assert not steps[0]["ran"] and any(s["ran"] for s in steps)


@pytest.mark.slow
def test_hidden_amp_cases_overflow_and_clip():
    for seed in range(3):
        cases = amp_cases(True, random.Random(seed))
        assert {c["dtype"] for c in cases} == {"float16", "bfloat16"} and min(c["micro"] for c in cases) == 1
        assert any(c["max_norm"] is None for c in cases) and any(c["max_norm"] for c in cases)
        clip_overflow = [c for c in cases if c["init_scale"] >= 2 ** 20]
        ref = reference_amp(clip_overflow[0])
        assert ref["scales"][0] < ref["used"][0], "the first step must overflow and be skipped"
        assert ref["delta"].norm() > 0


def test_hidden_scaler_plans_have_several_param_groups():
    # in every draw: 2 or 3 groups, an inf/NaN injected in group 0 and one in a later group (never the last parameter)
    for seed in range(20):
        for p in [p for p in scaler_cases(True, random.Random(seed)) if p["kind"] == "plan"]:
            model, opt, _ = plan_inputs(p)
            assert len(opt.param_groups) == p["groups"] in (2, 3)
            assert [len(g["params"]) for g in opt.param_groups] == [len(g["params"]) for g in
                                                                   param_groups(model, p["groups"])]
        grow = scaler_cases(True, random.Random(seed))[0]
        model, opt, _ = plan_inputs(grow)
        group_of = {i: gi for gi, g in enumerate(opt.param_groups) for i, q in enumerate(model.parameters())
                    if any(q is r for r in g["params"])}
        injected = {group_of[pi] for _, _, pi, _ in grow["inject"]}
        assert 0 in injected and max(injected) > 0
        assert all(pi != len(group_of) - 1 for _, _, pi, _ in grow["inject"])


def _amp_step_summed(model, optimizer, scaler, micro_batches, *, dtype=torch.float16, max_norm=None):
    """The mistake of lesson 04: one backward on the summed micro-batch losses (every graph alive together)."""
    k = len(micro_batches)
    summed = 0
    for x, y in micro_batches:
        with torch.autocast(x.device.type, dtype=dtype):
            summed = summed + model(x, y) / k
    scaler.scale(summed).backward()
    if max_norm is not None:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return summed.item()


def _amp_step(model, optimizer, scaler, micro_batches, *, dtype=torch.float16, max_norm=None):
    k = len(micro_batches)
    total = 0.0
    for x, y in micro_batches:
        with torch.autocast(x.device.type, dtype=dtype):
            loss = model(x, y) / k
        scaler.scale(loss).backward()
        total += loss.item()
    if max_norm is not None:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total


@pytest.mark.parametrize("seed", range(3))
def test_amp_memory_case_separates_one_graph_from_all(seed):
    """The step-peak bound (reference peak + half a micro-batch's graph) has room for a correct step and none for
    one that keeps every micro-batch's graph until a single backward, in every draw."""
    cases = [c for c in amp_cases(True, random.Random(seed)) if c["memory"] and not c.get("watched")]
    assert len(cases) == 1 and cases[0]["micro"] >= 3
    c = cases[0]
    ref = reference_amp(c)
    bound = max(ref["growth"]) + ref["graph"] // 2
    good = max(amp_run(c, _amp_step)["peak_growth"])
    bad = max(amp_run(c, _amp_step_summed)["peak_growth"])
    assert good <= bound - ref["graph"] // 4, (good, bound)
    assert bad >= bound + ref["graph"], (bad, bound)


def test_amp_run_records_the_forward_dtype_and_device_type():
    c = [c for c in amp_cases(True, random.Random(0)) if c["dtype"] == "bfloat16"][0]
    got = amp_run(c, _amp_step)
    assert got["forward"] == [["bfloat16", ["cpu"]]]


# ----------------------------------------------------------------------------- the step as if on CUDA
def test_the_step_as_if_on_cuda_follows_its_inputs():
    """The model and micro-batches report cuda:0 (their arithmetic on the CPU): a step that takes autocast's device
    type from its inputs runs its Linear layers in the dtype it is given; one that names "cpu" asks for "cpu" and
    runs them in fp32, as it would on a GPU."""
    from autograder.checks.ex03.run import amp_on_cuda
    c = amp_cases(False, random.Random(0))[0]
    assert amp_on_cuda(c, _amp_step) == {"autocast": ["cuda"], "forward": [c["dtype"]]}

    def on_cpu(model, optimizer, scaler, micro_batches, *, dtype=torch.float16, max_norm=None):
        for x, y in micro_batches:
            assert x.device.type == "cuda" and next(model.parameters()).is_cuda
            with torch.autocast("cpu", dtype=dtype):
                loss = model(x, y) / len(micro_batches)
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        return 0.0
    assert amp_on_cuda(c, on_cpu) == {"autocast": ["cpu"], "forward": ["float32"]}
    assert torch.amp.autocast_mode.autocast.__init__.__qualname__ == "autocast.__init__"   # put back


# ----------------------------------------------------------------------------- the watched case, from outside
@pytest.mark.usefixtures("one_thread")                 # tests/conftest.py
def test_every_hidden_draw_has_one_watched_step_that_fp32_would_outgrow_by_150_mib():
    """One watched case per draw. Measured with memlab's tracker in this process: the reference step's peak growth,
    and the same step run without autocast (fp32 activations), which grows by 150 MiB more."""
    from memlab.core.track import MemoryTracker
    from autograder.checks.ex03.inputs import amp_setup
    watched = [c for c in amp_cases(True, random.Random(3)) if c.get("watched")]
    assert len(watched) == 1
    c = watched[0]
    growth = {}
    for name, step in (("amp", _amp_step), ("fp32", _fp32_step)):
        model, opt, scaler, batches = amp_setup(c)
        tracker = MemoryTracker(model, opt, timeline=False)
        with tracker:
            before = tracker.current
            step(model, opt, scaler, batches[0], dtype=torch.bfloat16)
            growth[name] = tracker.peak - before
    assert growth["fp32"] - growth["amp"] >= 150 * 2**20, growth


def _fp32_step(model, optimizer, scaler, micro_batches, *, dtype=None, max_norm=None):
    """The step without autocast: activations in fp32."""
    for x, y in micro_batches:
        (model(x, y) / len(micro_batches)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return 0.0


def test_corroborate_flags_a_window_the_tracker_did_not_see():
    """judge.corroborate with made-up runs: an honest watched step (window = the tracker's peak, the inputs and a
    little) is not flagged; a window of the step's size while the tracker saw nothing is; a case without a window
    (growth None) and a small case are never flagged."""
    from autograder.checks.ex03.cases import input_bytes
    from autograder.checks.ex03.judge import corroborate
    cases = amp_cases(True, random.Random(5))
    (w,) = [c for c in cases if c.get("watched")]
    small = cases[0]
    MiB = 2**20
    seen, inputs = 151 * MiB, input_bytes(w)
    honest = {"peak_growth": [seen]}
    assert corroborate([("task3_2_amp_step", w, honest, seen + inputs + 8 * MiB)]) == []
    assert corroborate([("task3_2_amp_step", w, {"peak_growth": [0]}, 158 * MiB)])           # hidden from it
    assert corroborate([("task3_2_amp_step", w, {"peak_growth": [seen]}, 2 * (seen + inputs) + 65 * MiB)])
    assert corroborate([("task3_2_amp_step", w, {"peak_growth": [0]}, None)]) == []
    assert corroborate([("task3_2_amp_step", small, {"peak_growth": [0]}, 500 * MiB)]) == []
    assert corroborate([("task3_2_amp_step", w, None, 500 * MiB)]) == []                    # the case raised
