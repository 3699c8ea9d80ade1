"""Exercise 03's checks in-process (check(), no sandbox): the reference solution passes every task, each
plausible-wrong submission fails the cells it must lose with a teaching message, correct alternatives pass,
and the hidden cases exercise every branch of the spec in every draw."""

from __future__ import annotations

import math
import random

import nbformat
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memlab
from _nb import ROOT, grade_id, is_solution, solved_code
from autograder.checks import ex03
from autograder.checks.common import check
from autograder.checks.ex03_cases import amp_cases, scaler_cases
from autograder.checks.ex03_ref import drive_scaler, reference_amp
from submissions import ex03 as wrong

NAMES = {"task3_1_loss_scaler": "DynamicLossScaler", "task3_2_amp_step": "amp_step",
         "task3_3_dtype_report": "dtype_report"}


def _define(code: str, name: str):
    ns = {"torch": torch, "nn": nn, "F": F, "math": math, "memlab": memlab}
    exec(compile(code, f"<{name}>", "exec"), ns)
    return ns[name]


def _solution_cells() -> dict[str, str]:
    nb = nbformat.read(ROOT / "solutions" / wrong.ASSIGNMENT / f"{wrong.ASSIGNMENT}.ipynb", as_version=4)
    return {grade_id(c): solved_code(c.source) for c in nb.cells if is_solution(c)}


REFERENCE = _solution_cells()


def test_every_task_has_a_check():
    assert set(REFERENCE) == set(NAMES) == set(ex03.TASKS)


@pytest.mark.parametrize("task", sorted(NAMES))
@pytest.mark.parametrize("hidden", [False, True])
def test_reference_passes(task, hidden):
    assert check(ex03.TASKS[task], hidden=hidden, **{NAMES[task]: _define(REFERENCE[task], NAMES[task])})


CELLS = [(name, gid, gid in spec.get("must_keep", []), spec["replace"].get(gid.rsplit("_", 1)[0]))
         for name, spec in wrong.WRONG.items() for gid in spec["must_lose"] + spec.get("must_keep", [])]
CELLS = [c for c in CELLS if c[3] is not None]        # cells of the tasks a spec replaces


@pytest.mark.slow
@pytest.mark.parametrize("name,gid,keeps,code", CELLS, ids=[f"{c[0]}-{c[1]}" for c in CELLS])
def test_wrong_and_alternative_submissions(name, gid, keeps, code):
    task, kind = gid.rsplit("_", 1)
    fn = _define(code, NAMES[task])
    if keeps:
        check(ex03.TASKS[task], hidden=kind == "hidden", **{NAMES[task]: fn})
        return
    with pytest.raises(AssertionError) as info:
        check(ex03.TASKS[task], hidden=kind == "hidden", **{NAMES[task]: fn})
    assert len(str(info.value)) > 40, f"{name}: the failure message should teach, got {info.value!r}"


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
