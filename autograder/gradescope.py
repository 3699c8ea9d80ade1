"""Gradescope autograders for large classes: the same trusted checks and sandbox as `memlab-grade class`.

    memlab-grade gradescope -a ASSIGNMENT OUT     write OUT/ASSIGNMENT-gradescope.zip

Upload the zip as a programming assignment's autograder (Gradescope's "Autograder configuration", Ubuntu base
image). Gradescope's documented layout (gradescope-autograders.readthedocs.io, "Autograder Specifications"): the
zip holds `setup.sh`, run once when the image is built, and `run_autograder`, run for every submission; the zip is
unpacked into /autograder/source, the learner's files are in /autograder/submission, and the results go to
/autograder/results/results.json as {"score", "output", "tests": [{"name", "score", "max_score", "output"}]}.

Here setup.sh installs Python, bubblewrap and the grading's dependencies only (`requirements.txt`: what grading
imports and what that needs), every version held by the course's `constraints.txt`, whose markers pick the tested
version for the image's Python 3.10-3.13 (CPU PyTorch at the version that built this zip), into /opt/memlab/venv,
readable by every user; another Python is refused in one line.
The course itself is never installed there: run_autograder runs the grader from /autograder/source, which it first
makes private to root, as it does the submission. So the learner's process, whichever line protects it
(bubblewrap where it can run; in Gradescope's containers, where bubblewrap cannot mount /proc, a user of its own:
autograder/sandbox.py), finds no copy of the trusted checks anywhere it can read. run_autograder calls
`python -m autograder.gradescope run`, which grades the submitted notebook exactly as `memlab-grade check` does and
writes one Gradescope test per task, with the teaching message of every check that failed and the line of
protection it ran under.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import zipfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "gradebook.db", "submitted", "autograded", "feedback",
                                ".ipynb_checkpoints", "grades.csv", "flags.json")
# what grading imports (the grader, the harness and every exercise's notebook); setup.sh installs these and what they
# depend on, each pinned to the version of the environment that built the zip, and nothing else
GRADING = ("torch", "numpy", "matplotlib", "ipython", "traitlets", "tqdm", "ipywidgets", "transformers", "accelerate",
           "deepspeed", "peft", "bitsandbytes")
VENV = "/opt/memlab/venv"

SETUP_SH = """#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder image.
set -euo pipefail
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3 python3-venv python3-pip bubblewrap
python3 - <<'CHECK'
import sys
if sys.version_info[:2] not in ((3, 10), (3, 11), (3, 12), (3, 13)):
    sys.exit(f"setup.sh: GPU Memory Lab grades on Python 3.10-3.13; this image's python3 is {sys.version.split()[0]}: "
             f"choose an Ubuntu 22.04 or newer base image")
CHECK
python3 -m venv %(venv)s
PIP=%(venv)s/bin/pip
$PIP install -q --upgrade pip
# CPU PyTorch (graders need no GPU), then what grading imports, each held to the version the course's constraints
# give this Python; the course is not installed: run_autograder runs it from /autograder/source, private to root
$PIP install -q --index-url https://download.pytorch.org/whl/cpu "torch==$(cat /autograder/source/torch-version.txt)"
$PIP install -q -c /autograder/source/constraints.txt -r /autograder/source/requirements.txt
chmod -R a+rX /opt/memlab
""" % {"venv": VENV}

RUN_AUTOGRADER = """#!/usr/bin/env bash
# Gradescope runs this for every submission (the learner's files are in $ROOT/submission).
set -uo pipefail
ROOT="${AUTOGRADER_ROOT:-/autograder}"
PY="${MEMLAB_GRADESCOPE_PYTHON:-%(venv)s/bin/python}"
# the course (trusted checks included) and the submission are root's alone: a learner runs as another user
chmod 700 "$ROOT/source" "$ROOT/submission" 2>/dev/null
cd "$ROOT/source"
PYTHONPATH="$ROOT/source" exec "$PY" -m autograder.gradescope run --root "$ROOT" \
    --assignment "$(cat "$ROOT/source/assignment.txt")"
""" % {"venv": VENV}


def requirements(roots=GRADING) -> list[str]:
    """The names of `roots` and of everything they depend on in this environment (markers evaluated here), torch
    excepted (setup.sh takes the CPU build): what the image installs; the versions come from constraints.txt."""
    from packaging.requirements import Requirement
    seen, todo, out = set(), list(roots), []
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if key != "torch" and not key.startswith(("nvidia-", "triton")):
            out.append(dist.metadata["Name"])
        for raw in dist.requires or []:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return sorted(out, key=str.lower)


# ----------------------------------------------------------------------------- building the zip
def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def build(assignment: str, out: Path, release: Path | None = None) -> Path:
    """Write OUT/ASSIGNMENT-gradescope.zip for `assignment` (its release notebook from `release`, default
    exercises/). Returns the zip's path."""
    from .grade import RELEASE, exercise
    release = Path(release or RELEASE)
    ex = exercise(assignment, release)              # SystemExit naming the choices for an unknown assignment
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise SystemExit(f"OUT must be a folder, got the file {out}")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="memlab-gradescope-") as tmp:
        src = Path(tmp)
        for name in ("memlab", "autograder"):
            shutil.copytree(ROOT / name, src / name, ignore=IGNORE)
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(ROOT / name, src / name)
        shutil.copytree(release / assignment, src / "exercises" / assignment, ignore=IGNORE)
        (src / "assignment.txt").write_text(assignment + "\n")
        torch_version = (_version("torch") or "2.13.0").split("+")[0]
        (src / "torch-version.txt").write_text(torch_version + "\n")
        (src / "requirements.txt").write_text("\n".join(requirements()) + "\n")
        shutil.copy(ROOT / "constraints.txt", src / "constraints.txt")
        (src / "setup.sh").write_text(SETUP_SH)
        (src / "run_autograder").write_text(RUN_AUTOGRADER)
        path = out / f"{assignment}-gradescope.zip"
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            for f in sorted(src.rglob("*")):
                if f.is_file():
                    info = zipfile.ZipInfo.from_file(f, f.relative_to(src).as_posix())
                    if f.name in ("setup.sh", "run_autograder"):
                        info.external_attr = 0o755 << 16
                    with open(f, "rb") as fh:
                        z.writestr(info, fh.read(), zipfile.ZIP_DEFLATED)
    print(f"{path}: upload it as the autograder of {assignment} ({ex.release.name}); learners submit that notebook")
    return path


# ----------------------------------------------------------------------------- grading one submission
def find_submission(folder: Path, notebook_name: str) -> Path:
    """The learner's notebook in Gradescope's submission folder: the one named like the release notebook, else the
    only notebook there."""
    named = [p for p in folder.rglob(notebook_name) if p.is_file()]
    if named:
        return named[0]
    nbs = sorted(p for p in folder.rglob("*.ipynb") if p.is_file() and ".ipynb_checkpoints" not in p.parts)
    if len(nbs) == 1:
        return nbs[0]
    found = [p.name for p in nbs] or "none"
    raise FileNotFoundError(f"submit the notebook {notebook_name} (found {found})")


def results(graded, assignment: str) -> dict:
    """Gradescope's results.json from a Graded: one test per task, its score and, if it lost points, why."""
    from .grade import TASK_SUFFIX, by_task
    why: dict[str, list[str]] = {}
    for gid, msg in sorted(graded.reasons.items()):
        why.setdefault(TASK_SUFFIX.sub("", gid), []).append(f"{gid}: {msg}")
    tests = [{"name": task, "number": str(i + 1), "score": s, "max_score": m,
              "output": "\n".join(why.get(task, [])) or ("all checks passed" if s == m else ""),
              "visibility": "visible"}
             for i, (task, (s, m)) in enumerate(by_task(graded.scores).items())]
    notes = ([graded.note] if graded.note else []) + [f"error in {e}" for e in graded.cell_errors]
    if getattr(graded, "protection", None):
        notes.append(graded.protection)
    if graded.flags:
        notes.append("flagged for your instructor: " + "; ".join(graded.flags))
    return {"score": sum(t["score"] for t in tests), "output": "\n".join([f"{assignment}"] + notes),
            "tests": tests, "visibility": "visible", "stdout_visibility": "hidden"}


def run(root: Path, assignment: str) -> dict:
    """Grade root/submission into root/results/results.json; returns what it wrote. Any failure to grade still
    writes a results file with a score of 0 and the reason, so Gradescope shows the learner what went wrong."""
    from .grade import check_notebook, exercise
    root = Path(root)
    release = root / "source" / "exercises"
    out = root / "results" / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        ex = exercise(assignment, release)
        nb = find_submission(root / "submission", ex.release.name)
        res = results(check_notebook(nb, assignment, release=release), assignment)
    except (SystemExit, FileNotFoundError) as e:
        res = {"score": 0, "output": f"{assignment}: not graded: {e}", "tests": [], "visibility": "visible"}
    out.write_text(json.dumps(res, indent=1))
    return res


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m autograder.gradescope", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write OUT/ASSIGNMENT-gradescope.zip")
    b.add_argument("out")
    b.add_argument("-a", "--assignment", required=True)
    r = sub.add_parser("run", help="grade ROOT/submission into ROOT/results/results.json (Gradescope calls this)")
    r.add_argument("--root", default="/autograder")
    r.add_argument("--assignment", required=True)
    a = p.parse_args(argv)
    if a.cmd == "build":
        build(a.assignment, Path(a.out))
    else:
        res = run(Path(a.root), a.assignment)
        print(f"{res['score']:g} points; results in {Path(a.root) / 'results' / 'results.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
