"""Exercise 03's checks, called directly (no nbgrader): the reference solution
passes every check, and every plausible-wrong submission fails the checks of
its task with an AssertionError (a teaching message, not a crash)."""

from __future__ import annotations

import math

import nbformat
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memlab
from _nb import ROOT, grade_id, is_solution, solved_code
from autograder.checks import ex03
from submissions import ex03 as wrong

NAMES = {"task3_1_loss_scaler": "DynamicLossScaler", "task3_2_amp_step": "amp_step",
         "task3_3_dtype_report": "dtype_report"}
CHECKS = {"task3_1_loss_scaler": ex03.check_task3_1, "task3_2_amp_step": ex03.check_task3_2,
          "task3_3_dtype_report": ex03.check_task3_3}


def _define(code: str, name: str):
    ns = {"torch": torch, "nn": nn, "F": F, "math": math, "memlab": memlab}
    exec(compile(code, f"<{name}>", "exec"), ns)
    return ns[name]


def _solution_cells() -> dict[str, str]:
    nb = nbformat.read(ROOT / "solutions" / wrong.ASSIGNMENT / f"{wrong.ASSIGNMENT}.ipynb", as_version=4)
    return {grade_id(c): solved_code(c.source) for c in nb.cells if is_solution(c)}


REFERENCE = _solution_cells()


def test_solution_has_one_cell_per_task():
    assert set(REFERENCE) == set(NAMES)


@pytest.mark.parametrize("task", sorted(NAMES))
@pytest.mark.parametrize("hidden", [False, True])
def test_reference_passes(task, hidden):
    CHECKS[task](_define(REFERENCE[task], NAMES[task]), hidden=hidden)


WRONG_CASES = [(name, task, code) for name, spec in wrong.WRONG.items() for task, code in spec["replace"].items()]


@pytest.mark.parametrize("name,task,code", WRONG_CASES, ids=[c[0] for c in WRONG_CASES])
def test_wrong_submission_fails_its_checks(name, task, code):
    fn = _define(code, NAMES[task])
    for hidden in (False, True):
        with pytest.raises(AssertionError) as info:
            CHECKS[task](fn, hidden=hidden)
        assert len(str(info.value)) > 40, f"{name}: the failure message should teach, got {info.value!r}"


def test_grad_scaler_works_on_cpu():
    # the checks compare with torch.amp.GradScaler("cpu"): it must exist and skip + back off on inf
    s = torch.amp.GradScaler("cpu", init_scale=4.0)
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    s.scale((p * 2).sum()).backward()
    p.grad[0] = float("inf")
    s.step(opt)
    s.update()
    assert torch.equal(p.detach(), torch.ones(2)) and s.get_scale() == 2.0


def test_tracker_totals_match_hooks_reference():
    # the dtype split (saved-tensor hooks) and the totals (memlab's tracker) describe the same bytes
    for dt in (None, torch.float16, torch.bfloat16):
        for kind in ("mlp", "gpt"):
            case = ex03.ReportCase(seed=5, kind=kind, batch=3, dtype=dt)
            totals = ex03.tracker_totals(*case.build(), dtype=dt)
            split = ex03.reference_dtype_report(*case.build(), dtype=dt)
            assert {k: sum(v.values()) for k, v in split.items()} == totals, (kind, dt)
