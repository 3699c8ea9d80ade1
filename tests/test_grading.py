"""The grading commands: exercises/ is exactly what nbgrader generates from solutions/,
a learner's self-check prints the table and the reasons for lost points, a renamed
file is graded with -a, and the learner-facing copy carries no solutions."""

from __future__ import annotations

import filecmp
import json
import re
import subprocess

import pytest

from _nb import ROOT
from autograder import cli, grade
from test_trusted_grading import A, drill_course, make

pytestmark = pytest.mark.slow


def test_exercises_match_a_fresh_generate_assignment(tmp_path):
    course = grade.temp_course(tmp_path)
    for name in sorted(p.name for p in (ROOT / "solutions").iterdir() if p.is_dir()):
        grade.generate(course, name)
        for nb in (ROOT / "solutions" / name).glob("*.ipynb"):
            fresh = tmp_path / "release" / name / nb.name
            committed = ROOT / "exercises" / name / nb.name
            assert committed.exists(), f"{committed} is missing: run `memlab-grade release {name}`"
            assert filecmp.cmp(fresh, committed, shallow=False), (
                f"{committed.relative_to(ROOT)} is stale: solutions/ changed after it was generated. "
                f"Run `memlab-grade release {name}` and commit the result (never edit exercises/ by hand).")


def test_learner_check_prints_the_table_and_the_reasons(tmp_path, capsys, monkeypatch):
    course = drill_course(tmp_path / "course")
    monkeypatch.setattr(grade, "RELEASE", course.release)
    nb = tmp_path / "my renamed copy.ipynb"
    softmax = "def row_softmax(x):\n    return x.exp() / x.exp().sum(-1, keepdim=True)"
    nb.write_text(json.dumps(make(course, softmax=softmax)))
    with pytest.raises(SystemExit, match="pass -a ASSIGNMENT"):
        grade.check_notebook(nb, release=course.release)
    graded = grade.check_notebook(nb, A, release=course.release)
    out = grade.table(graded.scores) + "\n" + grade.reasons(graded)
    assert "task99_1_storage_bytes  3 / 3" in out, out
    assert "task99_2_row_softmax    1 / 3" in out, out        # right on small logits, overflows on big ones
    assert "subtract each row's max" in out, "the reason for the lost points teaches the fix"


def test_check_rejects_a_notebook_of_no_exercise(tmp_path):
    bogus = tmp_path / "homework.ipynb"
    bogus.write_text(json.dumps({"cells": [], "nbformat": 4, "nbformat_minor": 5, "metadata": {}}))
    with pytest.raises(SystemExit, match="does not match any exercise"):
        cli.main(["check", str(bogus)])


def test_public_copy_has_no_solutions(tmp_path):
    cli.main(["public", str(tmp_path / "pub")])
    pub = tmp_path / "pub"
    assert (pub / "exercises").is_dir() and (pub / "lessons").is_dir() and (pub / "memlab").is_dir()
    assert not (pub / "solutions").exists() and not (pub / "tests").exists()
    assert not any("BEGIN SOLUTION" in p.read_text() for p in pub.rglob("*.ipynb"))
    assert grade.assignments(pub / "exercises") == grade.assignments()
    readme = (pub / "README.md").read_text()
    assert "## Start" in readme and "## Doing an exercise" in readme and "memlab-grade check" in readme
    for gone in ("## Test", "course.py test", "memlab-grade release", "## For instructors", "## Contributing",
                 "tests/", "solutions/", "CONTRIBUTING"):
        assert gone not in readme, f"the learner's README still says {gone!r}"
    cut = re.search(r"\s\(\s*\)|;\s*\)|\(\s*;|\s\.\s", readme)     # what is cut leaves whole sentences behind
    assert cut is None, readme[max(cut.start() - 80, 0):cut.end() + 80]


def test_public_copy_holds_no_gradebook_flags_or_grades(tmp_path):
    """A class run leaves the gradebook, its flags (learner ids and what they did) and grades.csv in the course;
    none of them reaches the learners' copy, and git ignores all of them."""
    made = [ROOT / "autograder" / "gradebook.db", ROOT / "autograder" / "gradebook-flags.json", ROOT / "grades.csv"]
    fresh = [p for p in made if not p.exists()]
    try:
        for p in fresh:
            p.write_text("{}")
        cli.main(["public", str(tmp_path / "pub")])
        names = {p.name for p in (tmp_path / "pub").rglob("*")}
        assert not names & {"gradebook.db", "gradebook-flags.json", "flags.json", "grades.csv"}, names
        ignored = subprocess.run(["git", "check-ignore", *map(str, made)], cwd=ROOT, capture_output=True, text=True)
        assert len(ignored.stdout.split()) == len(made), ignored.stdout
    finally:
        for p in fresh:
            p.unlink()
