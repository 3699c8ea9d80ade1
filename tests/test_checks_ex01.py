"""Exercise 01's own check tests (tests/test_checks.py runs every exercise's solution and wrong submissions):
memlab's tracker is refused inside the tasks that ask for the learner's own measurement."""

from __future__ import annotations

import pytest

from autograder.checks import ex01


def test_tracker_is_refused_inside_the_tasks():
    def profile_phases(model, optimizer, x, y):
        with memlab.MemoryTracker():
            pass

    import memlab
    with pytest.raises(AssertionError, match="MemoryTracker is not allowed"):
        ex01.TASKS["task1_2_profile_phases"].run(ex01.TASKS["task1_2_profile_phases"].cases(False, None)[0],
                                                 profile_phases=profile_phases)
