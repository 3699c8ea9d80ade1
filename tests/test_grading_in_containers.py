"""Grading where bubblewrap cannot run, as in Docker's defaults and on Gradescope: root, a PID namespace of its own,
/proc masked as Docker masks it, a root file system of its own (where the kernel refuses new user namespaces, so
bubblewrap cannot start), Python readable by every user as in an image, and the course checkout out of sight
(tests/_container.py sets this up in a private mount namespace; nothing on the machine changes).

The grader must say so in one line and fall back to its second line, a user of its own per learner, with the same
results: the honest notebook keeps full marks, the blank one scores 0, and every attack on the pipeline (one per
mechanism: a forged reply through the harness's frames, work done in a thread and in a process, a search for the
trusted checks, a judge rewritten through /proc/<pid>/cwd, another learner's files) scores 0 or is flagged, with the
course's files unchanged. The Gradescope zip is run by its own run_autograder."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from autograder import grade, gradescope
from test_trusted_grading import (A, FIND_TRUSTED, FORGED_REPLY, FORKED, FULL, REWRITE_THROUGH_PROC, SOFTMAX,
                                  STORAGE, THREADED_SOFTMAX, THREADED_STORAGE, make)

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow
# the image's Python: this interpreter, or another one's virtual environment (MEMLAB_IMAGE_PYTHON=.../bin/python,
# e.g. a Python 3.10 environment as Ubuntu 22.04's images have; benchmarks/README.md records such a run)
IMAGE_PYTHON = Path(os.environ.get("MEMLAB_IMAGE_PYTHON", sys.executable))


def image_binds() -> list[Path]:
    """The image Python's environment and its interpreter's prefix, for the container's root."""
    if IMAGE_PYTHON == Path(sys.executable):
        return []
    prefix = subprocess.run([str(IMAGE_PYTHON), "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
                            capture_output=True, text=True, check=True).stdout.split()
    return [Path(p) for p in prefix]


def need_container() -> None:
    """Root and util-linux's unshare: what the emulation needs (CI has both)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("bwrap") is None:
        msg = "the container-like line needs root, unshare and bubblewrap (to see it fail)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def in_container(command: list[str], env: dict, binds: list[Path], timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `command` in the container-like root (tests/_container.py): Python and this virtual environment, the
    folders `binds`, nothing of the course checkout."""
    argv = ["unshare", "--mount", "--pid", "--fork", "--mount-proc", sys.executable, str(ROOT / "tests" /
            "_container.py"), sys.prefix, *[x for b in binds for x in ("--bind", str(b))], "--", *command]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)


def _hashes(folder: Path) -> dict[str, str]:
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.rglob("*"))
            if f.is_file() and "__pycache__" not in f.parts}


HOSTILE = {   # grade_id of a solution cell -> code, for the one hostile Gradescope submission
    "storage": FORGED_REPLY + "\n" + STORAGE.replace("def storage_bytes", "def _sb")
    + "\ndef storage_bytes(s, d):\n    forge(0)\n    return _sb(s, d)",
    "softmax": THREADED_SOFTMAX,
}


@pytest.fixture(scope="module")
def zipped(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("containers")
    course = grade.drill_course(tmp / "course")
    return course, gradescope.build(A, tmp / "out", release=course.release), tmp


@pytest.mark.parametrize("who", ["solution", "blank", "hostile"])
def test_gradescope_as_it_runs_there(zipped, who):
    """run_autograder in the container-like run: the one-line sandbox message names the separate-user line and why
    bubblewrap could not run; results.json is Gradescope's; the scores are as with bubblewrap. The solution is
    submitted under another name, as the only notebook of the submission."""
    need_container()
    course, zip_path, tmp = zipped
    root = tmp / who / "autograder"
    with zipfile.ZipFile(zip_path) as z:
        z.extractall(root / "source")
    (root / "submission").mkdir(parents=True)
    nb = {"solution": make(course), "blank": make(course, None, None),
          "hostile": make(course, HOSTILE["storage"], HOSTILE["softmax"], extra_before=FIND_TRUSTED)}[who]
    (root / "submission" / ("my_work.ipynb" if who == "solution" else f"{A}.ipynb")).write_text(json.dumps(nb))
    before = _hashes(root / "source")
    env = dict(os.environ, AUTOGRADER_ROOT=str(root), MEMLAB_GRADESCOPE_PYTHON=str(IMAGE_PYTHON))
    out = in_container(["bash", str(root / "source" / "run_autograder")], env, [root, *image_binds()])
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads((root / "results" / "results.json").read_text())
    assert set(res) >= {"score", "output", "tests"} and all(
        set(t) >= {"name", "score", "max_score", "output"} for t in res["tests"]), res
    assert "separate user" in res["output"] and "bubblewrap cannot run here" in res["output"], res["output"]
    assert _hashes(root / "source") == before, "a learner changed the grader's files"
    if who == "solution":
        assert res["score"] == FULL, res
    elif who == "blank":
        assert res["score"] == 0, res
    else:
        assert res["score"] == 0, res
        assert "flagged" in res["output"] and "did not ask for" in res["output"], res["output"]
        assert "TRUSTED SIDE FOUND: []" in res["output"], res["output"]


DRIVER = """import json, sys
from pathlib import Path
from autograder import grade
root = Path(sys.argv[1])
course = grade.Course(root, root / 'gradebook.db', root, root / 'release')
res = grade.grade_class(Path(sys.argv[2]), '99_drill', timeout=40, course=course, jobs=2, memory_gb=2, log=print)
print('RESULT ' + json.dumps({'graded': {k: sum(s for s, _ in v.values()) for k, v in res.graded.items()},
                              'flags': res.flags, 'reasons': res.reasons, 'failed': res.failed}))
"""


def test_a_class_graded_in_a_container(tmp_path):
    """memlab-grade class in the container-like run, one learner per attack on the pipeline beside an honest one:
    each learner runs as a user of its own, cannot read another's notebook or the grader's files, and the attacks
    score 0 or are flagged."""
    need_container()
    src = tmp_path / "src"                     # the course's code where only root can read it, as on Gradescope
    for name in ("autograder", "memlab"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "gradebook.db"))
    course = grade.drill_course(tmp_path / "course")
    subs = tmp_path / "subs"
    subs.mkdir()
    other = subs / "honest.ipynb"
    learners = {
        "honest": (make(course), FULL),
        "forged_reply": (make(course, HOSTILE["storage"], SOFTMAX), 3),
        "thread_does_the_work": (make(course, THREADED_STORAGE, THREADED_SOFTMAX), 0),
        "process_does_the_work": (make(course, FORKED + "\n" + STORAGE.replace("def storage_bytes", "def _sb")
                                       + "\ndef storage_bytes(s, d):\n    return in_child(_sb, s, d)", None), 0),
        "looks_for_references": (make(course, extra_before=FIND_TRUSTED), FULL),
        "rewrites_judge_through_proc": (make(course, REWRITE_THROUGH_PROC + "\ndef storage_bytes(s, d):\n"
                                                                            "    return 0", None), 0),
        "reads_another_learner": (make(course, "import json\n"
                                               f"for c in json.load(open({str(other)!r}))['cells']:\n"
                                               "    if 'def storage_bytes' in ''.join(c['source']):\n"
                                               "        exec(''.join(c['source']))", None), 0),
    }
    for sid, (nb, _) in learners.items():
        (subs / f"{sid}.ipynb").write_text(json.dumps(nb))
    before = _hashes(src) | _hashes(subs)
    env = dict(os.environ, PYTHONPATH=str(src))
    out = in_container([sys.executable, "-c", DRIVER, str(course.root), str(subs)], env, [tmp_path], timeout=900)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-2000:]
    assert "separate user" in out.stdout.splitlines()[0], out.stdout[:500]
    got = json.loads(out.stdout.split("RESULT ", 1)[1])
    wrong = {sid: (got["graded"].get(sid), want) for sid, (_, want) in learners.items()
             if got["graded"].get(sid) != want}
    assert not wrong, (wrong, got)
    assert "did not ask for" in " ".join(got["flags"].get("forged_reply", [])), got["flags"]
    assert "other processes" in " ".join(got["flags"].get("rewrites_judge_through_proc", [])), got["flags"]
    assert "thread" in " ".join(got["reasons"]["thread_does_the_work"].values())
    assert _hashes(src) | _hashes(subs) == before, "a learner changed files it must not touch"
    autograded = course.root / "autograder" / "autograded" / "looks_for_references" / A / f"{A}.ipynb"
    assert "TRUSTED SIDE FOUND: []" in autograded.read_text()
