"""Every exercise's checks in-process (check(): run and judge in this process, no sandbox, no nbgrader).

For each assignment of autograder.checks.CHECKS (but 99_drill, the pipeline's own exercise):
- the source notebook's solution cells and the check module's TASKS agree;
- the solution passes every task's visible and hidden check;
- each spec of tests/submissions/exNN.py (WRONG and RIGHT) fails each cell it must lose with an AssertionError
  that teaches (40 characters or more, no traceback), or with an exception raised by the submission's own code
  (the grader's "your code raised ..."); an exception raised by the check's own code (a KeyError or TypeError
  in autograder/checks/) is a bug in the check, not a verdict. It passes each cell it must keep (a RIGHT spec:
  every cell of the tasks it changes).
  A cell of a task the spec's replacement cannot change is the reference's check again and is not rerun.
The learner's names come from tests/_nb.solution_namespace: the notebook run the way the grader runs it.
Exercise-specific tests (branch coverage of hidden cases, guards, references) live in test_checks_exNN.py."""

from __future__ import annotations

import ast
import importlib
import os
import random
import traceback

import pytest

from _nb import ROOT, graded_cells, solution_cells, solution_namespace, wrong_submission_specs
from autograder.checks import CHECKS
from autograder.checks.common import check

EXERCISES = [a for a in CHECKS if a != "99_drill"]
SPECS = {s.ASSIGNMENT: s for s in wrong_submission_specs()}
KINDS = ("visible", "hidden")

# Tasks whose submissions' cells take seconds each (full-size virtual-GPU runs, forked ranks, timing), measured with
# --durations=0 on 2 CPU cores shared with other jobs: together about 400 of the 450 s all the cells take. Their
# cells run in the full run only; every task's reference checks, visible and hidden (about 100 s), always run.
SLOW_TASKS = {
    "task0_3_copy_bandwidth", "task2_4_checkpointed_gpt", "task4_1_big_batch", "task4_2_eval_no_grad",
    "task4_3_accumulated_loss", "task4_4_optimizer_step", "task6_1_sharded_optimizer", "task6_2_reduce_scatter",
    "task8_1_train_step", "task8_2_state_bytes", "task8_3_cheapest_plan", "task9_2_tp_mlp",
}


# Tasks whose hidden draws cost seconds of memlab.fit to judge: in a test run, the reference and every submission
# get the same hidden draw (fresh each run), so each worker measures its plans once and memlab.fit's cache answers
# the rest. Every other task draws fresh cases for every cell.
SHARED_DRAWS = {"task8_3_cheapest_plan"}

pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def _tasks(assignment: str) -> dict:
    return importlib.import_module(CHECKS[assignment]).TASKS


def _check(assignment: str, task_id: str, hidden: bool, ns: dict, run_id: str = "") -> int:
    task = _tasks(assignment)[task_id]
    missing = [n for n in task.names if n not in ns]
    assert not missing, f"{assignment}: the notebook does not define {missing}, which {task_id} grades"
    r = random.Random(f"{run_id}:{task_id}") if hidden and task_id in SHARED_DRAWS else None
    return check(task, hidden=hidden, r=r, **{n: ns[n] for n in task.names})


def _defines(code: str) -> set[str]:
    """Names a cell binds at its top level (def, class, assignment, import)."""
    names = set()
    for node in ast.parse(code).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def _uses(code: str) -> set[str]:
    return {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)}


def _affected(assignment: str, replace: dict[str, str]) -> set[str]:
    """Task ids whose graded names can behave differently with `replace`: those a replaced cell defines, or a
    solution cell that uses a name a replaced cell defines (and so on). Any other task's check is the
    reference's check again (test_reference_passes)."""
    reference = solution_cells(assignment)
    code = {**reference, **replace}
    changed = set(replace)
    while True:
        names = set().union(*(_defines(code[g]) | _defines(reference[g]) for g in changed))
        more = {g for g in code if g not in changed and _uses(code[g]) & names}
        if not more:
            break
        changed |= more
    names = set().union(*(_defines(code[g]) | _defines(reference[g]) for g in changed))
    return {tid for tid, task in _tasks(assignment).items() if names & set(task.names)}


def _cells(assignment: str):
    """(spec kind, spec name, test cell, must lose) of every cell a spec's replacement can change."""
    spec = SPECS.get(assignment)
    out = []
    for kind in ("WRONG", "RIGHT"):
        for name, w in getattr(spec, kind, {}).items():
            affected = _affected(assignment, w["replace"])
            lose = list(w.get("must_lose", []))
            keep = [g for g in w.get("must_keep", []) if g.rsplit("_", 1)[0] in affected]
            if kind == "RIGHT":                         # a correct alternative keeps every point
                keep += [f"{t}_{k}" for t in sorted(affected) for k in KINDS if f"{t}_{k}" not in keep]
            out += [(kind, name, g, True) for g in lose] + [(kind, name, g, False) for g in keep]
    return out




# ----------------------------------------------------------------------------- the notebook and TASKS agree
@pytest.mark.parametrize("assignment", EXERCISES)
def test_solution_cells_and_tasks_agree(assignment):
    tasks, cells = _tasks(assignment), solution_cells(assignment)
    assert set(graded_cells(assignment)) == {f"{t}_{k}" for t in tasks for k in KINDS}, (
        f"{assignment}: the graded test cells are not one visible and one hidden cell per task of TASKS")
    assert set(cells) <= set(tasks), f"{assignment}: solution cells {sorted(set(cells) - set(tasks))} grade no task"
    defined = {g: _defines(code) for g, code in cells.items()}
    every = set().union(*defined.values())
    for tid, task in tasks.items():
        assert set(task.names) <= every, (
            f"{assignment}: {tid} grades {sorted(set(task.names) - every)}, which no solution cell defines")
        if tid in cells:
            assert defined[tid] & set(task.names), f"{assignment}: the cell {tid} defines none of {task.names}"
        else:               # graded again on another half (08: the cheapest plan grades task 8.2's plan_for)
            assert any(set(tasks[t].names) == set(task.names) for t in cells), (
                f"{assignment}: {tid} has no solution cell and grades names no task with a cell grades")


# ----------------------------------------------------------------------------- the solution passes
@pytest.mark.parametrize("assignment,task_id,kind", [(a, t, k) for a in EXERCISES for t in _tasks(a) for k in KINDS])
def test_reference_passes(assignment, task_id, kind, testrun_uid):
    assert _check(assignment, task_id, kind == "hidden", solution_namespace(assignment), testrun_uid) >= 1


# ----------------------------------------------------------------------------- wrong and right submissions
SUBMISSIONS = [pytest.param(a, kind, name, g, lose, marks=[pytest.mark.slow] * (g.rsplit("_", 1)[0] in SLOW_TASKS))
               for a in EXERCISES for kind, name, g, lose in _cells(a)]


@pytest.mark.parametrize("assignment,kind,name,cell,lose", SUBMISSIONS,
                         ids=[f"{p.values[0][:2]}-{p.values[2]}-{p.values[3]}" for p in SUBMISSIONS])
def test_submission_cell(assignment, kind, name, cell, lose, testrun_uid):
    spec = getattr(SPECS[assignment], kind)[name]
    task_id, visibility = cell.rsplit("_", 1)
    ns = solution_namespace(assignment, spec["replace"])
    if not lose:
        _check(assignment, task_id, visibility == "hidden", ns, testrun_uid)
        return
    try:
        _check(assignment, task_id, visibility == "hidden", ns, testrun_uid)
    except AssertionError as e:
        error = e
    except Exception as e:       # noqa: BLE001 - a crash in the submission's code (a loss), or in the check (a bug)
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "site-packages" not in f.filename]
        where = " > ".join(f"{os.path.relpath(f.filename, ROOT) if os.sep in f.filename else f.filename}:{f.lineno}"
                           for f in frames[-3:])       # a notebook cell's frames are named by its grade id
        checks = str(ROOT / "autograder" / "checks")
        kit_report = type(e).__module__.startswith("memlab.kit")   # e.g. RanksFailed: a learner's rank raised
        in_learner_code = any(os.sep not in f.filename for f in frames)   # raised while the learner's code ran
        assert kit_report or in_learner_code or (frames and not frames[-1].filename.startswith(checks)), (
            f"{name}: {cell}: the check itself raised {type(e).__name__} ({where}) instead of failing with an "
            f"AssertionError: {str(e)[:300]}")
        return                   # the submission's own code raised: the grader says "your code raised ..."
    else:
        pytest.fail(f"{name} passed {cell}, which it must lose")
    message = str(error)
    assert type(error) is AssertionError, f"{name}: {cell} raised {type(error).__name__}, not AssertionError"
    assert len(message) >= 40, f"{name}: {cell} fails without a message that teaches: {message!r}"
    assert "Traceback (most recent call last)" not in message, f"{name}: {cell}'s message carries a traceback"
