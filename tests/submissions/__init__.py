"""Plausible-wrong submissions per exercise (exNN.py: WRONG and RIGHT) and the helpers they share."""

from __future__ import annotations


def solution_cells(assignment: str) -> dict[str, str]:
    """grade_id -> the solution cell's code as a learner who solved it would leave it (markers gone)."""
    from _nb import grade_id, is_solution, notebooks, solved_code
    src, _ = notebooks(assignment)
    return {grade_id(c): solved_code(c.source) for c in src.cells if is_solution(c)}


def edit(code: str, old: str, new: str) -> str:
    """The solution with one mistake made in it; fails loudly when the solution no longer has `old`."""
    assert old in code, f"the solution no longer contains {old!r}: update this wrong submission"
    return code.replace(old, new)


def both(task: str) -> list[str]:
    """The visible and hidden test cells of a task."""
    return [f"{task}_visible", f"{task}_hidden"]
