"""Fast tests of exercise 04's checks (autograder/checks/ex04.py), without nbgrader:
the source notebook's solutions pass every check, each plausible-wrong submission
of tests/submissions/ex04.py fails the checks of the cells it must lose, and the
clinic's patients shown in the notebook are the grader's reference scripts."""

from __future__ import annotations

import inspect

import nbformat
import pytest

from _nb import ROOT, grade_id, is_solution, solved_code
from autograder.checks import ex04
from submissions import ex04 as wrong

SOURCE = ROOT / "solutions" / "04_oom_clinic" / "04_oom_clinic.ipynb"
CHECKS = {  # task id -> (function the learner writes, its check)
    "task4_1_big_batch": ("train_big_batch_fixed", ex04.check_task4_1),
    "task4_2_eval_no_grad": ("evaluate_fixed", ex04.check_task4_2),
    "task4_3_accumulated_loss": ("train_accumulated_fixed", ex04.check_task4_3),
    "task4_4_optimizer_step": ("train_1b3_fixed", ex04.check_task4_4),
    "task4_5_find_max_batch_size": ("find_max_batch_size", ex04.check_task4_5),
    "task4_6_leak_detector": ("detect_leak", ex04.check_task4_6),
}


def _notebook():
    return nbformat.read(SOURCE, as_version=4)


def _namespace(replace: dict[str, str] | None = None) -> dict:
    """The learner's functions as the notebook defines them (setup cell, then every solution cell, with the
    cells in `replace` swapped for other code)."""
    replace = replace or {}
    ns: dict = {}
    nb = _notebook()
    for cell in nb.cells:
        gid = grade_id(cell)
        if gid == "setup":
            exec(compile(cell.source, "setup", "exec"), ns)
        elif is_solution(cell):
            exec(compile(replace.get(gid, solved_code(cell.source)), gid, "exec"), ns)
    return ns


def test_every_task_has_a_check():
    ids = {grade_id(c) for c in _notebook().cells if is_solution(c)}
    assert ids == set(CHECKS)


def test_patients_are_the_graders_references():
    cells = {grade_id(c): c.source for c in _notebook().cells}
    for gid, fn in [("task4_1_big_batch", ex04.train_big_batch), ("task4_2_eval_no_grad", ex04.evaluate),
                    ("task4_3_accumulated_loss", ex04.train_accumulated),
                    ("task4_4_optimizer_step", ex04.train_1b3)]:
        assert inspect.getsource(fn).strip() in cells[f"{gid}_patient"], f"{gid}: the notebook shows another script"


def test_reference_solutions_pass():
    ns = _namespace()
    for gid, (name, check) in CHECKS.items():
        check(ns[name], hidden=True)


@pytest.mark.parametrize("name", sorted(wrong.WRONG))
def test_wrong_submission_fails(name):
    spec = wrong.WRONG[name]
    ns = _namespace(spec["replace"])
    tasks = {gid.rsplit("_", 1)[0] for gid in spec["must_lose"]}
    for task in tasks:                # the hidden check (nbgrader's harness also runs the visible one)
        fn, check = CHECKS[task]
        with pytest.raises(AssertionError):
            check(ns[fn], hidden=True)


def test_originals_fail_their_checks():
    """Each patient as it came in runs out of memory at full size: handing it back unchanged earns nothing."""
    for check, original in [(ex04.check_task4_1, ex04.train_big_batch), (ex04.check_task4_2, ex04.evaluate),
                            (ex04.check_task4_3, ex04.train_accumulated), (ex04.check_task4_4, ex04.train_1b3)]:
        with pytest.raises(AssertionError, match="still runs out of memory"):
            check(original, hidden=False)
