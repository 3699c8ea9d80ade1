"""Exercise 01's checks in-process (run + judge, no sandbox): the reference solution
passes every check, every plausible-wrong submission of tests/submissions/ex01.py
fails the cells it must lose with a teaching message and keeps the ones it must keep."""

from __future__ import annotations

import nbformat
import pytest
import torch

from _nb import ROOT, grade_id, is_solution, solved_code
from autograder.checks import ex01
from autograder.checks.common import check
from submissions import ex01 as wrong

NB = nbformat.read(ROOT / "solutions" / wrong.ASSIGNMENT / f"{wrong.ASSIGNMENT}.ipynb", as_version=4)
REFERENCE = {grade_id(c): solved_code(c.source) for c in NB.cells if is_solution(c)}
SETUP = next(c.source for c in NB.cells if grade_id(c) == "setup").replace("print(memlab.describe(device))", "")


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _define(replace: dict[str, str]) -> dict:
    """The solution's namespace, with the cells in `replace` swapped (later tasks use LiveBytes)."""
    ns: dict = {}
    exec(compile(SETUP, "<setup>", "exec"), ns)
    for gid, code in REFERENCE.items():
        exec(compile(replace.get(gid, code), f"<{gid}>", "exec"), ns)
    return ns


def _names(task, ns):
    return {n: ns[n] for n in ex01.TASKS[task].names}


def test_solution_has_one_cell_per_task():
    assert set(REFERENCE) == set(ex01.TASKS)


@pytest.mark.parametrize("task", sorted(ex01.TASKS))
@pytest.mark.parametrize("hidden", [False, True])
def test_reference_passes(task, hidden):
    assert check(ex01.TASKS[task], hidden=hidden, **_names(task, _define({}))) >= 1


CELLS = [(name, gid) for name, spec in wrong.WRONG.items() for gid in spec["must_lose"] + spec.get("must_keep", [])]


@pytest.mark.parametrize("name,gid", CELLS, ids=[f"{n}-{g}" for n, g in CELLS])
def test_wrong_submission(name, gid):
    spec = wrong.WRONG[name]
    task, kind = gid.rsplit("_", 1)
    ns = _define(spec["replace"])
    if gid in spec.get("must_keep", []):
        check(ex01.TASKS[task], hidden=kind == "hidden", **_names(task, ns))
        return
    with pytest.raises(AssertionError) as info:
        check(ex01.TASKS[task], hidden=kind == "hidden", **_names(task, ns))
    assert len(str(info.value)) > 40, f"{name}: the failure message should teach, got {info.value!r}"


def test_tracker_is_refused_inside_the_tasks():
    def profile_phases(model, optimizer, x, y):
        with memlab.MemoryTracker():
            pass

    import memlab
    with pytest.raises(AssertionError, match="MemoryTracker is not allowed"):
        ex01.TASKS["task1_2_profile_phases"].run(ex01.TASKS["task1_2_profile_phases"].cases(False, None)[0],
                                                 profile_phases=profile_phases)
