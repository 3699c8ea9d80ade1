"""Exercise 01's own check tests (tests/test_checks.py runs every exercise's solution and wrong submissions):
memlab's tracker is refused inside the tasks that ask for the learner's own measurement, however it is reached;
task 1.5's cases and its hidden feedback."""

from __future__ import annotations

import pytest

from autograder.checks import ex01


def test_tracker_is_refused_inside_the_tasks():
    def profile_phases(model, optimizer, x, y):
        with memlab.MemoryTracker():
            pass

    import memlab
    task = ex01.TASKS["task1_2_profile_phases"]
    case = task.cases(False, None)[0]
    with pytest.raises(AssertionError, match="MemoryTracker is not allowed"):
        task.judge(case, task.run(case, profile_phases=profile_phases))


def _live_bytes_variants():
    """memlab's tracker passed off as task 1.1's LiveBytes: the class itself, a factory, and a mode of the task's
    shape that delegates to one whose __enter__ was taken before the check ran."""
    import memlab
    from torch.utils._python_dispatch import TorchDispatchMode
    enter, leave = memlab.MemoryTracker.__enter__, memlab.MemoryTracker.__exit__

    class Delegating(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.t = memlab.MemoryTracker(timeline=False)

        current = property(lambda self: self.t.current)
        peak = property(lambda self: self.t.peak)

        def reset_peak(self):
            self.t.reset_peak()

        def __enter__(self):
            enter(self.t)
            return self

        def __exit__(self, *exc):
            return leave(self.t, *exc)

    return {"the class": memlab.MemoryTracker, "a factory": lambda: memlab.MemoryTracker(timeline=False),
            "a delegating mode": Delegating}


@pytest.mark.parametrize("variant", ["the class", "a factory", "a delegating mode"])
def test_memlabs_tracker_is_not_a_live_bytes(variant):
    """Each variant loses task 1.1 for what it is (memlab's tracker, whose numbers are right), in the visible case
    and in a hidden draw."""
    from autograder.checks.common import rng
    from autograder.checks.ex01.judge import _live_judge
    task = ex01.TASKS["task1_1_live_bytes"]
    cls = _live_bytes_variants()[variant]
    for case in task.cases(False, None) + task.cases(True, rng(True)):
        got = task.run(case, LiveBytes=cls)
        with pytest.raises(AssertionError, match="build the measurement yourself"):
            _live_judge(case, got)


def test_a_tracker_entered_through_a_captured_method_is_refused_in_tasks_1_2_to_1_4():
    """forbid_memlab_tracker replaces MemoryTracker.__enter__; a method taken before that still reaches the
    tracker, and the calls into memlab/core/track.py give it away."""
    import memlab
    enter, leave = memlab.MemoryTracker.__enter__, memlab.MemoryTracker.__exit__

    def profile_phases(model, optimizer, x, y):
        t = memlab.MemoryTracker(timeline=False)
        enter(t)
        leave(t, None, None, None)
        return {"forward": 0, "backward": 0, "step": 0}

    task = ex01.TASKS["task1_2_profile_phases"]
    case = task.cases(False, None)[0]
    with pytest.raises(AssertionError, match="build the measurement yourself"):
        task.judge(case, task.run(case, profile_phases=profile_phases))


def test_estimate_hidden_feedback_hides_the_measured_peak_and_still_teaches():
    """A hidden 1.5 message as the grader shows it (the marked value hidden, then every number redacted) names
    neither the measured peak nor the estimate, and says where the peak falls and which way the estimate is off."""
    from autograder.checks.common import hide, mb, rng
    from autograder.checks.ex01.judge import _estimate_judge
    from autograder.checks.ex01.refs import measure_mlp_peak
    from autograder.trusted import redact
    case = ex01.TASKS["task1_5_estimate_peak"].cases(True, rng(True))[0]
    want = measure_mlp_peak(*case)
    for got, way in ((int(want * 0.8), "below"), (int(want * 1.2), "above")):
        with pytest.raises(AssertionError) as e:
            _estimate_judge(case, got)
        shown = redact(hide(str(e.value)))
        for secret in (str(want), mb(want), str(got), mb(got)):
            assert secret not in shown, (secret, shown)
        assert way in shown and "peak falls in the backward pass" in shown, shown


def _phases(batch, d_in, width, depth, d_out, optimizer, first_step):
    """(forward + backward, optimizer step) peaks by the lesson's accounting, and Adam's state bytes."""
    dims = [d_in] + [width] * depth + [d_out]
    shapes = list(zip(dims[:-1], dims[1:]))
    n = sum(a * b + b for a, b in shapes)
    state = 8 * n + 8 * len(shapes) if optimizer == "adam" else 0
    x = 4 * batch * d_in + 8 * batch
    fb = 4 * n + (0 if first_step else state) + x + 4 * (depth + 2) * batch * width + 4 * batch * d_out
    step = 8 * n + state + x + (8 * max(a * b for a, b in shapes) if optimizer == "adam" else 0)
    return fb, step, state


def test_estimate_cases_pair_adam_state_with_both_phases():
    """Every run has, for the first step and for the steady state, an Adam case whose peak is the optimizer step
    and one whose peak is forward + backward, with Adam's state a large part of it: a state term wrong in either
    phase of either step moves the estimate by 15% or more, three times the 5% tolerance."""
    from autograder.checks.common import rng
    from autograder.checks.ex01.refs import measure_mlp_peak
    for i in range(20):
        cases = ex01.TASKS["task1_5_estimate_peak"].cases(True, rng(True))
        worst = {}                       # mistake -> the largest relative error it makes in this run
        for c in cases:
            if c[5] != "adam":
                continue
            fb, step, state = _phases(*c)
            peak = max(fb, step)
            first = c[6]
            wrong = {("no state in the step", first): max(fb, step - state),
                     ("state in forward + backward", first): max(fb + state, step) if first else peak,
                     ("no state in forward + backward", first): max(fb - state, step) if not first else peak}
            for k, v in wrong.items():
                worst[k] = max(worst.get(k, 0), abs(v - peak) / peak)
            if i == 0:                                                     # the accounting matches the tracker
                assert abs(measure_mlp_peak(*c) - peak) <= 0.02 * peak, c
        for k in [("no state in the step", True), ("no state in the step", False),
                  ("state in forward + backward", True), ("no state in forward + backward", False)]:
            assert worst.get(k, 0) >= 0.15, (k, cases)


def test_every_run_has_a_case_whose_peak_is_late_in_the_backward_pass():
    """Late in the backward pass every gradient but the first Linear's exists: in every run one case makes that the
    peak, so an estimate that only counts the start of the backward pass is off by far more than the tolerance."""
    from autograder.checks.common import rng
    from autograder.checks.ex01.refs import measure_mlp_peak
    for _ in range(5):
        c = ex01.TASKS["task1_5_estimate_peak"].cases(True, rng(True))[0]   # the late-backward case comes first
        assert c[5] == "sgd" and c[6] and c[0] < c[2], c          # SGD's first step, batch narrower than width
        fb, step, _ = _phases(*c)
        assert max(fb, step) <= 0.92 * measure_mlp_peak(*c), c
