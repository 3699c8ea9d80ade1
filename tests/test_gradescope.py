"""The Gradescope autograder: the zip has Gradescope's layout, and its run_autograder, run in a folder laid out as
Gradescope lays it out, gives every notebook the same scores as `memlab-grade check` (the same trusted checks and
sandbox), one Gradescope test per task with the teaching messages."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from autograder import gradescope, grade
from test_trusted_grading import A, FULL, make, need_bwrap

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gradescope")
    course = grade.drill_course(tmp / "course")
    zip_path = gradescope.build(A, tmp / "out", release=course.release)
    return course, zip_path, tmp


def test_the_zip_has_gradescopes_layout(built):
    _, zip_path, _ = built
    with zipfile.ZipFile(zip_path) as z:
        names = set(z.namelist())
        modes = {i.filename: i.external_attr >> 16 for i in z.infolist()}
    assert {"setup.sh", "run_autograder", "assignment.txt", "constraints.txt", "pyproject.toml",
            f"exercises/{A}/{A}.ipynb", "autograder/grade.py", "memlab/__init__.py"} <= names
    assert modes["setup.sh"] & 0o111 and modes["run_autograder"] & 0o111, "both scripts must be executable"
    assert not any("gradebook.db" in n or n.startswith("solutions/") or n.startswith("tests/") for n in names), \
        "the zip must carry no gradebook, no solutions and no test corpus"
    for script in ("setup.sh", "run_autograder"):
        with zipfile.ZipFile(zip_path) as z:
            text = z.read(script).decode()
        assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0, f"{script}: bash syntax"


def _gradescope_run(zip_path: Path, root: Path, notebook: dict | None, name: str = f"{A}.ipynb") -> dict:
    """Lay out /autograder as Gradescope does (source unzipped, the submission's files, results/) under root and
    run run_autograder with this interpreter standing in for setup.sh's environment."""
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(root / "source")
    (root / "submission").mkdir(parents=True)
    if notebook is not None:
        (root / "submission" / name).write_text(json.dumps(notebook))
    shutil.copy(root / "source" / "run_autograder", root / "run_autograder")
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), MEMLAB_GRADESCOPE_PYTHON=sys.executable)
    out = subprocess.run(["bash", str(root / "run_autograder")], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads((root / "results" / "results.json").read_text())


@pytest.mark.parametrize("who", ["wrong", "nothing"])
def test_run_autograder_scores_as_memlab_grade_check(built, who):
    """The wrong submission is compared with memlab-grade check's own run. (The solution, the blank release and a
    hostile notebook, as Gradescope really runs them, in a container where bubblewrap cannot run:
    tests/test_grading_in_containers.py.)"""
    need_bwrap("grading runs learner code")
    course, zip_path, tmp = built
    nb = {"solution": make(course), "blank": make(course, None, None),
          "wrong": make(course, softmax="def row_softmax(x):\n    return x.exp() / x.exp().sum()"),
          "nothing": None}[who]
    res = _gradescope_run(zip_path, tmp / who, nb, name="my_work.ipynb" if who == "solution" else f"{A}.ipynb")
    if who == "nothing":
        assert res["score"] == 0 and "submit the notebook" in res["output"], res
        return
    tasks = {t["name"]: (t["score"], t["max_score"]) for t in res["tests"]}
    assert set(tasks) == {"task99_1_storage_bytes", "task99_2_row_softmax"}, tasks
    assert res["score"] == sum(s for s, _ in tasks.values())
    if who == "wrong":
        nb_path = tmp / "wrong.ipynb"
        nb_path.write_text(json.dumps(nb))
        assert tasks == grade.by_task(grade.check_notebook(nb_path, A, release=course.release).scores)
        lost = [t for t in res["tests"] if t["score"] < t["max_score"]]
        assert lost and all(len(t["output"]) >= 40 for t in lost), "each lost task shows the check's message"
        assert 0 < res["score"] < FULL
    else:
        assert res["score"] == {"solution": FULL, "blank": 0}[who], res


def test_the_image_installs_only_what_grading_needs_every_version_held(built):
    """setup.sh installs what grading imports and what that needs (requirements.txt: names) with the course's
    constraints.txt, which holds a version of every one of them for each Python 3.10-3.13 (tests/test_course.py
    resolves that file per Python); not JupyterLab, pytest or the book's tools; the course itself never."""
    import re
    _, zip_path, _ = built
    with zipfile.ZipFile(zip_path) as z:
        wanted = z.read("requirements.txt").decode().split()
        held = z.read("constraints.txt").decode()
        setup = z.read("setup.sh").decode()
    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()             # noqa: E731 - PEP 503 names
    pinned = {norm(line.split("==")[0]) for line in held.splitlines() if "==" in line and not line.startswith("#")}
    assert wanted and all("==" not in w for w in wanted)
    assert {norm(w) for w in wanted} <= pinned, sorted({norm(w) for w in wanted} - pinned)
    assert not {norm(w) for w in wanted} & {"jupyterlab", "pytest", "ruff", "jupyter-book", "nbgrader"}
    assert "-c /autograder/source/constraints.txt" in setup and "3.10-3.13" in setup
    assert "/autograder/source[" not in setup and "pip install -q -e" not in setup, "the course is never installed"


def test_an_unknown_assignment_is_refused_with_the_choices(tmp_path):
    with pytest.raises(SystemExit, match="unknown assignment"):
        gradescope.build("no_such_exercise", tmp_path)
