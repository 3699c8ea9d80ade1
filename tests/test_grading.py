"""The grading commands end to end: a learner's self-check prints a table,
exercises/ is exactly what nbgrader generates from solutions/, and a class
with broken and hostile submissions is graded without harm to the others."""

from __future__ import annotations

import filecmp
import tempfile
from pathlib import Path

import nbformat
import pytest

from _nb import ROOT, submission
from autograder import grade

pytestmark = pytest.mark.slow
A = "01_memory_profiler"


def test_exercises_match_a_fresh_generate_assignment(tmp_path):
    course = grade.temp_course(tmp_path)
    for name in grade.assignments():
        grade.generate(course, name)
        for nb in (ROOT / "solutions" / name).glob("*.ipynb"):
            fresh = tmp_path / "release" / name / nb.name
            committed = ROOT / "exercises" / name / nb.name
            assert committed.exists(), f"{committed} is missing: run `memlab-grade release {name}`"
            assert filecmp.cmp(fresh, committed, shallow=False), (
                f"{committed.relative_to(ROOT)} is stale: solutions/ changed after it was generated. "
                f"Run `memlab-grade release {name}` and commit the result (never edit exercises/ by hand).")


def test_learner_check_prints_a_per_task_table(tmp_path, capsys):
    nb = tmp_path / f"{A}.ipynb"
    nbformat.write(submission(A), nb)
    grade.main(["check", str(nb)])
    out = capsys.readouterr().out
    assert "task1_1_live_bytes" in out and "total" in out, out
    assert "17 / 17" in out, f"the full solution should score 17 / 17:\n{out}"


def test_check_rejects_a_notebook_of_no_exercise(tmp_path):
    bogus = tmp_path / "homework.ipynb"
    nbformat.write(nbformat.v4.new_notebook(), bogus)
    with pytest.raises(SystemExit, match="does not match any exercise"):
        grade.main(["check", str(bogus)])


def _code_nb(code: str):
    """A release notebook whose first solution cell is replaced by `code`."""
    return submission(A, {"task1_1_live_bytes": code})


HOSTILE = {
    # the kernel kills the nbgrader process that started it
    "kills_grader": "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
    # never finishes: stopped by the per-learner time limit
    "endless": "while True:\n    pass",
    # exits the kernel
    "exits": "import os\nos._exit(3)",
}


def test_class_grading_survives_broken_and_hostile_submissions(tmp_path):
    subs = tmp_path / "subs"
    subs.mkdir()
    nbformat.write(submission(A), subs / "alice.ipynb")                      # fine
    (subs / "bob").mkdir()
    nbformat.write(submission(A, solve=False), subs / "bob" / f"{A}.ipynb")  # nothing done
    (subs / "carol.ipynb").write_text("{ this is not json")                    # corrupt file
    (subs / "bad id!.ipynb").write_text("{}")                                  # unusable learner id
    for sid, code in HOSTILE.items():
        nbformat.write(_code_nb(code), subs / f"{sid}.ipynb")
    nbformat.write(submission(A), subs / "zed.ipynb")                        # graded after the hostile ones
    (tmp_path / "course").mkdir()
    res = grade.grade_class(subs, A, timeout=40, course=grade.temp_course(tmp_path / "course"))
    print({k: v[:200] for k, v in res.failed.items()})

    full = sum(v[1] for v in res.graded["alice"].values())
    for good in ("alice", "zed"):
        assert sum(v[0] for v in res.graded[good].values()) == full, f"{good} lost points: {res.graded[good]}"
    assert sum(v[0] for v in res.graded["bob"].values()) == 0
    assert "carol" in res.failed and "not a readable notebook" in res.failed["carol"]
    assert "bad id!.ipynb" in res.failed
    for sid in HOSTILE:
        earned = sum(v[0] for v in res.graded.get(sid, {}).values())
        assert sid in res.failed or earned < full, f"{sid}: {res.graded.get(sid)} {res.failed.get(sid)}"
    assert "timed out" in res.failed["endless"]
    csv = (tmp_path / "course" / "grades.csv").read_text()
    assert "alice" in csv and "zed" in csv, csv
    feedback = list((tmp_path / "course" / "autograder" / "feedback" / "alice").rglob("*.html"))
    assert feedback, "alice should have an HTML feedback file"
