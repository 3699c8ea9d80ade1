"""Plausible-wrong submissions per exercise (exNN.py: WRONG and RIGHT) and the helpers they share."""

from __future__ import annotations


def solution_cells(assignment: str) -> dict[str, str]:
    """grade_id -> the solution cell's code as a learner who solved it would leave it (markers gone)."""
    import _nb
    return _nb.solution_cells(assignment)


def edit(code: str, old: str, new: str) -> str:
    """The solution with one mistake made in it; fails loudly when the solution no longer has `old`."""
    assert old in code, f"the solution no longer contains {old!r}: update this wrong submission"
    return code.replace(old, new)


def both(task: str) -> list[str]:
    """The visible and hidden test cells of a task."""
    return [f"{task}_visible", f"{task}_hidden"]
