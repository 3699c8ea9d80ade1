"""memlab.profiling: torch.profiler's memory timeline read back agrees with memlab's tracker on the same step,
the phases come out in order, and bad input is refused."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from memlab import MLP, MemoryTracker, phase
from memlab.profiling import MemoryTimeline, phase_spans, read_memory_timeline


def _step(model, opt):
    x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))       # made inside the measured block, as in lesson 01
    with phase("forward"):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    with phase("backward"):
        loss.backward()
    del loss, x, y
    with phase("step"):
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One steady MLP + Adam step measured by the tracker, the same step profiled, and its timeline file."""
    torch.manual_seed(0)
    model = MLP(d_in=32, width=64, depth=3, d_out=10)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False)
    _step(model, opt)                                                  # creates Adam's state
    tracker = MemoryTracker(model, opt)
    with tracker:
        _step(model, opt)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True,
                 with_stack=True) as prof:
        _step(model, opt)
    path = tmp_path_factory.mktemp("prof") / "timeline.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)                 # deprecated in recent torch, still works
        prof.export_memory_timeline(str(path), device="cpu")
    return model, opt, tracker, prof, path


def test_timeline_peak_and_model_states_match_the_tracker(profiled):
    model, opt, tracker, prof, path = profiled
    tl = read_memory_timeline(path, prof)
    assert isinstance(tl, MemoryTimeline)
    # the same storages at the same moment: equal up to a few 0-dim scalars the profiler also sees in step()
    assert abs(tl.peak - tracker.peak) <= 64, (tl.at_peak(), tracker.peak_breakdown)
    at = tl.at_peak()
    assert sum(at.values()) == tl.peak
    assert at["parameter"] == sum(p.nbytes for p in model.parameters())
    state = sum(t.untyped_storage().nbytes() for s in opt.state.values() for t in s.values())
    assert at["optimizer_state"] == state
    assert {"parameter", "optimizer_state", "activation", "gradient", "unknown"} <= set(tl.by_category)
    assert all(len(col) == len(tl.times_ms) for col in tl.by_category.values())
    assert tl.times_ms == sorted(tl.times_ms) and tl.times_ms[0] >= 0


def test_without_prof_times_start_at_the_first_sample(profiled):
    *_, path = profiled
    tl = read_memory_timeline(str(path))
    assert tl.times_ms[0] == 0


def test_phase_spans_are_in_order_and_inside_the_timeline(profiled):
    *_, tracker, prof, path = profiled
    spans = phase_spans(prof)
    assert list(spans) == ["forward", "backward", "step"]
    (f0, f1), (b0, b1), (s0, s1) = spans.values()
    assert 0 <= f0 < f1 <= b0 < b1 <= s0 < s1
    tl = read_memory_timeline(path, prof)
    i = tl.totals.index(tl.peak)
    lo, hi = spans[tracker.peak_phase]
    assert lo <= tl.times_ms[i] <= hi, "the profiler's peak falls in the phase where the tracker saw its peak"


def test_empty_timeline():
    tl = MemoryTimeline([], {"parameter": []})
    assert tl.peak == 0 and tl.at_peak() == {"parameter": 0} and tl.totals == []


def test_bad_input(profiled, tmp_path):
    *_, prof, path = profiled
    with pytest.raises(TypeError, match="path"):
        read_memory_timeline(3)
    with pytest.raises(ValueError, match="path"):
        read_memory_timeline(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="path"):
        read_memory_timeline(str(path).replace(".json", ".html"))
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps([[1, 2], [[0, 1], [0, 2]]]))
    with pytest.raises(ValueError, match="not a memory timeline"):
        read_memory_timeline(wrong)
    with pytest.raises(TypeError, match="prof"):
        read_memory_timeline(path, prof="not a profile")
    with pytest.raises(TypeError, match="prof"):
        phase_spans(object())
    with pytest.raises(ValueError, match="prof"):
        phase_spans(profile(activities=[ProfilerActivity.CPU]))       # never entered: no results
