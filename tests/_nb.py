"""Test helpers: build learner submissions from the source and release notebooks."""

from __future__ import annotations

import copy
import importlib
import pkgutil
import re
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
SOLUTION_MARKERS = re.compile(r"^\s*### (BEGIN|END) SOLUTION\s*$")


def grade_id(cell) -> str | None:
    return cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")


def is_solution(cell) -> bool:
    return bool(cell.get("metadata", {}).get("nbgrader", {}).get("solution"))


def solved_code(source: str) -> str:
    """A solution cell as a learner who solved it would leave it: markers gone."""
    return "\n".join(line for line in source.splitlines() if not SOLUTION_MARKERS.match(line))


def notebooks(assignment: str) -> tuple[nbformat.NotebookNode, nbformat.NotebookNode]:
    name = f"{assignment}.ipynb"
    src = nbformat.read(ROOT / "solutions" / assignment / name, as_version=4)
    rel = nbformat.read(ROOT / "exercises" / assignment / name, as_version=4)
    return src, rel


def submission(assignment: str, replace: dict[str, str] | None = None, solve: bool = True):
    """The release notebook with every solution cell filled from the source
    (solve=True) except the cells in `replace` (grade_id -> code)."""
    replace = dict(replace or {})
    src, rel = notebooks(assignment)
    answers = {grade_id(c): solved_code(c.source) for c in src.cells if is_solution(c)}
    unknown = set(replace) - set(answers)
    if unknown:
        raise KeyError(f"{assignment}: no solution cells named {sorted(unknown)}; have {sorted(answers)}")
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
    src, _ = notebooks(assignment)
    return {grade_id(c): float(c.metadata["nbgrader"]["points"]) for c in src.cells
            if c.get("metadata", {}).get("nbgrader", {}).get("grade")}


def wrong_submission_specs():
    """Every tests/submissions/exNN.py module."""
    import submissions
    mods = []
    for info in pkgutil.iter_modules(submissions.__path__):
        if info.name.startswith("ex"):
            mods.append(importlib.import_module(f"submissions.{info.name}"))
    return mods


def solution_namespace(source, replace: dict[str, str] | None = None) -> dict:
    """The learner's names as the source notebook at `source` defines them: the setup cell, then every solution
    cell (solved), with the cells in `replace` (grade id -> code) swapped for other code."""
    replace = replace or {}
    ns: dict = {}
    for cell in nbformat.read(source, as_version=4).cells:
        gid = grade_id(cell)
        if gid == "setup":
            exec(compile(cell.source, "setup", "exec"), ns)
        elif is_solution(cell):
            exec(compile(replace.get(gid, solved_code(cell.source)), gid, "exec"), ns)
    return ns
