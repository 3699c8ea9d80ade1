"""Test helpers: build learner submissions from the source and release notebooks."""

from __future__ import annotations

import ast
import copy
import importlib
import pkgutil
import re
from pathlib import Path

import nbformat
import torch

ROOT = Path(__file__).resolve().parent.parent
SOLUTION_MARKERS = re.compile(r"^\s*### (BEGIN|END) SOLUTION\s*$")


def grade_id(cell) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def is_solution(cell) -> bool:
    return bool(cell.get("metadata", {}).get("nbgrader", {}).get("solution"))


def solved_code(source: str) -> str:
    """A solution cell as a learner who solved it would leave it: markers gone."""
    return "\n".join(line for line in source.splitlines() if not SOLUTION_MARKERS.match(line))


def source_notebook(assignment: str) -> nbformat.NotebookNode:
    return nbformat.read(ROOT / "solutions" / assignment / f"{assignment}.ipynb", as_version=4)


def solution_cells(assignment: str) -> dict[str, str]:
    """grade_id -> the source notebook's solution cell as a learner who solved it would leave it (markers gone)."""
    return {grade_id(c): solved_code(c.source) for c in source_notebook(assignment).cells if is_solution(c)}


def _known(assignment: str, replace: dict[str, str], answers: dict[str, str]) -> None:
    unknown = set(replace) - set(answers)
    if unknown:
        raise KeyError(f"{assignment}: no solution cells named {sorted(unknown)}; have {sorted(answers)}")


def notebooks(assignment: str) -> tuple[nbformat.NotebookNode, nbformat.NotebookNode]:
    """The source notebook (solutions/) and the release notebook (exercises/)."""
    rel = nbformat.read(ROOT / "exercises" / assignment / f"{assignment}.ipynb", as_version=4)
    return source_notebook(assignment), rel


def submission(assignment: str, replace: dict[str, str] | None = None, solve: bool = True):
    """The release notebook with every solution cell filled from the source
    (solve=True) except the cells in `replace` (grade_id -> code)."""
    replace = dict(replace or {})
    _, rel = notebooks(assignment)
    answers = solution_cells(assignment)
    _known(assignment, replace, answers)
    nb = copy.deepcopy(rel)
    for cell in nb.cells:
        gid = grade_id(cell)
        if is_solution(cell):
            if gid in replace:
                cell.source = replace.pop(gid)
            elif solve:
                cell.source = answers[gid]
    return nb


def graded_cells(assignment: str) -> dict[str, float]:
    """grade_id -> points of every graded test cell."""
    return {grade_id(c): float(c.metadata["nbgrader"]["points"]) for c in source_notebook(assignment).cells
            if c.get("metadata", {}).get("nbgrader", {}).get("grade")}


def wrong_submission_specs():
    """Every tests/submissions/exNN.py module."""
    import submissions
    mods = []
    for info in pkgutil.iter_modules(submissions.__path__):
        if info.name.startswith("ex"):
            mods.append(importlib.import_module(f"submissions.{info.name}"))
    return mods


def _binds_names(code: str) -> bool:
    """False for a cell that only shows something (print(...), diagnose(...)): it defines nothing a check calls."""
    return any(not isinstance(node, ast.Expr) for node in ast.parse(code).body)


def learner_code(assignment: str, replace: dict[str, str] | None = None) -> list[tuple[str, str]]:
    """(where, code) of the cells the grader runs for a learner, in notebook order: the locked cells (the setup
    cell, the given helpers; cells that only display something are left out) and every solution cell, solved,
    with the cells in `replace` (grade id -> code) swapped for other code. Test cells are never run."""
    replace = dict(replace or {})
    _known(assignment, replace, solution_cells(assignment))
    out = []
    for cell in source_notebook(assignment).cells:
        meta = cell.get("metadata", {}).get("nbgrader", {})
        if cell.cell_type != "code" or meta.get("grade"):
            continue
        gid = grade_id(cell) or "locked cell"
        if is_solution(cell):
            out.append((gid, replace.get(gid, solved_code(cell.source))))
        elif _binds_names(cell.source):
            out.append((gid, cell.source))
    return out


def solution_namespace(assignment: str, replace: dict[str, str] | None = None) -> dict:
    """The learner's names as the grader's run of the source notebook defines them (see `learner_code`). The
    process is left as it was: a setup cell's torch.set_num_threads is undone."""
    ns: dict = {}
    threads = torch.get_num_threads()
    try:
        for where, code in learner_code(assignment, replace):
            exec(compile(code, where, "exec"), ns)
    finally:
        torch.set_num_threads(threads)
    return ns
