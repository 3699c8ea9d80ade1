"""Exercise 04's own check tests (tests/test_checks.py runs every exercise's solution and wrong submissions):
the clinic's patients shown in the notebook are the grader's reference scripts, each patient as it came in
fails its check, and the hidden cases of tasks 4.5 and 4.6 cover every branch in every draw."""

from __future__ import annotations

import inspect
import random

import pytest

from memlab import clinic
from _nb import grade_id, source_notebook
from autograder.checks import ex04
from autograder.checks.common import check
from autograder.checks.ex04.cases import leak_cases, max_batch_cases
from autograder.checks.ex04.refs import reference_max_batch


def _check(task_id, ns, hidden):
    task = ex04.TASKS[task_id]
    return check(task, hidden=hidden, **{n: ns[n] for n in task.names})


def test_patients_are_the_graders_references():
    cells = {grade_id(c): c.source for c in source_notebook("04_oom_clinic").cells}
    for gid, fn in [("task4_1_big_batch", clinic.train_big_batch), ("task4_2_eval_no_grad", clinic.evaluate),
                    ("task4_3_accumulated_loss", clinic.train_accumulated),
                    ("task4_4_optimizer_step", clinic.train_1b3)]:
        assert inspect.getsource(fn).strip() in cells[f"{gid}_patient"], f"{gid}: the notebook shows another script"


@pytest.mark.slow
@pytest.mark.parametrize("task_id,original", [("task4_1_big_batch", clinic.train_big_batch),
                                              ("task4_2_eval_no_grad", clinic.evaluate),
                                              ("task4_3_accumulated_loss", clinic.train_accumulated),
                                              ("task4_4_optimizer_step", clinic.train_1b3)])
def test_originals_fail_their_checks(task_id, original):
    """Each patient as it came in runs out of memory at full size: handing it back unchanged earns nothing."""
    with pytest.raises(AssertionError, match="still runs out of memory"):
        _check(task_id, {ex04.TASKS[task_id].names[0]: original}, False)


def test_max_batch_cases_cover_every_branch():
    for seed in range(5):
        cases = max_batch_cases(True, random.Random(seed))
        answers = [reference_max_batch(c) for c in cases]
        limits = [c["limit"] for c in cases]
        assert 0 in answers and 1 in answers
        assert any(a == lim and lim & (lim - 1) for a, lim in zip(answers, limits)), "limit not a power of two"
        assert any(a == lim - 1 for a, lim in zip(answers, limits))
        assert any(a & (a - 1) == 0 and a > 2 for a in answers)
        assert any(a > 2 and (a + 1) & a == 0 for a in answers) and any(a > 2 and (a - 1) & (a - 2) == 0
                                                                        for a in answers)


def test_leak_cases_cover_every_leak_and_trap():
    for seed in range(5):
        cases = leak_cases(True, random.Random(seed))
        assert {c["kind"] for c in cases} == {"outputs", "grads", "inputs", "eval", "hook", "none_adam", "none_sgd"}
        assert min(c["n_steps"] for c in cases) == 3
