"""Lessons read one idea at a time: each code cell holds at most one top-level
definition (a function or a class) and at most 40 lines, then a short demo cell."""

from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))
MAX_LINES = 40
DEFINITIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def python_lines(source: str) -> list[str]:
    """The cell's lines without IPython magics (%...) and shell escapes (!...)."""
    return [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]


def cell_problems(source: str) -> list[str]:
    """Why a code cell breaks the convention (an empty list when it does not)."""
    lines = python_lines(source)
    problems = []
    if len(lines) > MAX_LINES:
        problems.append(f"{len(lines)} lines (at most {MAX_LINES})")
    names = [node.name for node in ast.parse("\n".join(lines)).body if isinstance(node, DEFINITIONS)]
    if len(names) > 1:
        problems.append(f"{len(names)} definitions {names} (at most one)")
    return problems


def test_cell_problems_sees_both_rules():
    two_defs = "def a():\n    pass\n\nclass B:\n    pass\n"
    assert cell_problems(two_defs) == ["2 definitions ['a', 'B'] (at most one)"]
    long_cell = "\n".join(f"x{i} = {i}" for i in range(MAX_LINES + 1))
    assert cell_problems(long_cell) == [f"{MAX_LINES + 1} lines (at most {MAX_LINES})"]
    magics = "%matplotlib inline\n!nvidia-smi\n" + "\n".join(f"x{i} = {i}" for i in range(MAX_LINES))
    assert cell_problems(magics) == []
    nested = "def outer():\n    def inner():\n        pass\n    return inner\n"
    assert cell_problems(nested) == []


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_cells_hold_one_definition_and_at_most_40_lines(path):
    nb = nbformat.read(path, as_version=4)
    offending = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for problem in cell_problems(cell.source):
            offending.append(f"lessons/{path.name} cell {index}: {problem}")
    if offending:
        pytest.fail("split these cells (one definition per cell, at most 40 lines):\n" + "\n".join(offending))
