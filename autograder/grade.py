"""Grading commands for GPU Memory Lab (nbgrader underneath).

    memlab-grade release [ASSIGNMENT ...]      regenerate exercises/ from solutions/ (instructors, CI)
    memlab-grade check NOTEBOOK                 grade one notebook locally and print a per-task table (learners)
    memlab-grade class SUBMISSIONS [-a NAME]    autograde a folder of submissions into the gradebook,
                                                write feedback and grades.csv (instructors)

(`python -m autograder.grade ...` is the same.) Every nbgrader call runs in its
own process; in `class` each learner is graded in a separate process with a
time limit, so one broken, endless or hostile notebook cannot stop or corrupt
the grading of the others: it is reported and the rest go on.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "autograder"
CONFIG = HERE / "nbgrader_config.py"
SOURCE = ROOT / "solutions"
RELEASE = ROOT / "exercises"
STUDENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
TASK_SUFFIX = re.compile(r"_(visible|hidden)$")


# ----------------------------------------------------------------------------- nbgrader plumbing
@dataclass
class Course:
    """An nbgrader course: a root folder, a gradebook, and where its config lives."""
    root: Path
    db: Path
    config_dir: Path             # the folder whose nbgrader_config.py nbgrader reads (it is run there)

    @property
    def db_url(self) -> str:
        return f"sqlite:///{self.db}"


MAIN = Course(ROOT, HERE / "gradebook.db", HERE)


def temp_course(tmp: Path) -> Course:
    """A throwaway course in `tmp` with the course's own settings: the learner's
    self-check grades there, leaving the instructor's gradebook alone."""
    (tmp / "solutions").symlink_to(SOURCE, target_is_directory=True)
    cfg = (f"exec(compile(open({str(CONFIG)!r}).read(), {str(CONFIG)!r}, 'exec'), "
           f"{{**globals(), '__file__': {str(CONFIG)!r}}})\n"
           f"c.CourseDirectory.root = {str(tmp)!r}\n"
           f"c.CourseDirectory.release_directory = 'release'\n"
           f"c.CourseDirectory.db_url = 'sqlite:///{tmp / 'gradebook.db'}'\n"
           f"c.CsvExportPlugin.to = {str(tmp / 'grades.csv')!r}\n")
    (tmp / "nbgrader_config.py").write_text(cfg)
    return Course(tmp, tmp / "gradebook.db", tmp)


def nbgrader(course: Course, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    """Run one nbgrader command in its own process, in the course's config folder."""
    cmd = [sys.executable, "-m", "nbgrader", *args]
    env = dict(os.environ)
    # nbgrader runs `alembic` by name: make this interpreter's scripts folder come first
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    # its own process group, so a time-out also stops the kernel it started
    proc = subprocess.Popen(cmd, cwd=course.config_dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def assignments() -> list[str]:
    return sorted(p.name for p in SOURCE.iterdir() if p.is_dir() and any(p.glob("*.ipynb")))


def _check_assignment(name: str) -> str:
    names = assignments()
    if name not in names:
        raise SystemExit(f"unknown assignment {name!r}; choose one of {names}")
    return name


def generate(course: Course, assignment: str) -> None:
    out = nbgrader(course, "generate_assignment", assignment, "--force", "--create")
    if out.returncode != 0:
        raise SystemExit(f"nbgrader generate_assignment {assignment} failed:\n{out.stdout}\n{out.stderr}")


def scores(course: Course, assignment: str, student: str) -> dict[str, tuple[float, float]]:
    """{grade_id: (score, max_score)} of one autograded submission."""
    from nbgrader.api import Gradebook, MissingEntry
    with Gradebook(course.db_url) as gb:
        try:
            sub = gb.find_submission(assignment, student)
        except MissingEntry:
            return {}
        return {g.name: (float(g.score), float(g.max_score)) for nb in sub.notebooks for g in nb.grades}


def by_task(grades: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """Sum visible and hidden test cells into one row per task id."""
    out: dict[str, list[float]] = {}
    for gid, (s, m) in sorted(grades.items()):
        row = out.setdefault(TASK_SUFFIX.sub("", gid), [0.0, 0.0])
        row[0] += s
        row[1] += m
    return {k: (v[0], v[1]) for k, v in out.items()}


def table(grades: dict[str, tuple[float, float]]) -> str:
    rows = by_task(grades)
    w = max([len("task")] + [len(k) for k in rows])
    lines = [f"{'task':<{w}}  score", f"{'-' * w}  -----"]
    lines += [f"{k:<{w}}  {s:g} / {m:g}" for k, (s, m) in rows.items()]
    tot_s, tot_m = sum(s for s, _ in rows.values()), sum(m for _, m in rows.values())
    lines += [f"{'-' * w}  -----", f"{'total':<{w}}  {tot_s:g} / {tot_m:g}"]
    return "\n".join(lines)


def _assignment_of(notebook: Path) -> str:
    """The assignment a notebook belongs to, from its file name (NN_name.ipynb)."""
    stem = notebook.stem
    for name in assignments():
        if (SOURCE / name / f"{stem}.ipynb").exists():
            return name
    raise SystemExit(f"{notebook.name} does not match any exercise notebook; expected one of "
                     f"{[p.name for a in assignments() for p in (SOURCE / a).glob('*.ipynb')]}")


def _autograde_one(course: Course, assignment: str, student: str, timeout: float) -> str | None:
    """Autograde one learner in its own process. Returns an error text or None."""
    try:
        out = nbgrader(course, "autograde", assignment, "--student", student, "--force", "--create",
                       timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:g} s"
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-8:]
        return "nbgrader autograde failed: " + " | ".join(tail)
    return None


# ----------------------------------------------------------------------------- commands
def cmd_release(names: list[str]) -> None:
    for name in names or assignments():
        generate(MAIN, _check_assignment(name))
        print(f"released {name} -> {(RELEASE / name).relative_to(ROOT)}")


def check_notebook(notebook: Path, timeout: float = 1800) -> dict[str, tuple[float, float]]:
    """Grade one notebook in a throwaway course; returns {grade_id: (score, max)}."""
    if not notebook.is_file():
        raise SystemExit(f"no such notebook: {notebook}")
    assignment = _assignment_of(notebook)
    with tempfile.TemporaryDirectory(prefix="memlab-check-") as tmp:
        course = temp_course(Path(tmp))
        generate(course, assignment)
        dest = course.root / "autograder" / "submitted" / "learner" / assignment
        dest.mkdir(parents=True)
        shutil.copy(notebook, dest / notebook.name)
        err = _autograde_one(course, assignment, "learner", timeout)
        if err:
            raise SystemExit(f"could not grade {notebook}: {err}")
        return scores(course, assignment, "learner")


def cmd_check(notebook: str, timeout: float) -> None:
    grades = check_notebook(Path(notebook).resolve(), timeout)
    print(f"{Path(notebook).name}\n{table(grades)}")


@dataclass
class ClassResult:
    graded: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def _collect(submissions: Path, assignment: str) -> tuple[dict[str, Path], dict[str, str]]:
    """Find each learner's notebook. Accepted layouts, per learner:
    SUBMISSIONS/<id>.ipynb, SUBMISSIONS/<id>/<nb>.ipynb, SUBMISSIONS/<id>/<assignment>/<nb>.ipynb."""
    expected = sorted(p.name for p in (SOURCE / assignment).glob("*.ipynb"))
    found: dict[str, Path] = {}
    bad: dict[str, str] = {}
    for entry in sorted(submissions.iterdir()):
        sid = entry.stem if entry.is_file() else entry.name
        if entry.name.startswith("."):
            continue
        if not STUDENT_ID.match(sid):
            bad[entry.name] = "learner id must be letters, digits, '_', '.', '-' (at most 64 characters)"
            continue
        if entry.is_file():
            if entry.suffix == ".ipynb":
                found[sid] = entry
            continue
        cands = [entry / assignment / n for n in expected] + [entry / n for n in expected]
        cands += sorted(entry.glob("*.ipynb"))
        hit = next((c for c in cands if c.is_file()), None)
        if hit is None:
            bad[sid] = f"no notebook found (looked for {expected} in {entry.name}/ and {entry.name}/{assignment}/)"
        else:
            found[sid] = hit
    return found, bad


def grade_class(submissions: Path, assignment: str, timeout: float = 1800, course: Course = MAIN) -> ClassResult:
    if not submissions.is_dir():
        raise SystemExit(f"SUBMISSIONS must be a folder of learners' notebooks, got {submissions}")
    _check_assignment(assignment)
    generate(course, assignment)
    found, bad = _collect(submissions, assignment)
    res = ClassResult(failed=dict(bad))
    nb_name = sorted(p.name for p in (SOURCE / assignment).glob("*.ipynb"))[0]
    for sid, path in found.items():
        dest = course.root / "autograder" / "submitted" / sid / assignment
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        try:
            json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            res.failed[sid] = f"not a readable notebook ({type(e).__name__}: {e})"
            continue
        shutil.copy(path, dest / nb_name)
        err = _autograde_one(course, assignment, sid, timeout)
        got = scores(course, assignment, sid)
        if err and not got:
            res.failed[sid] = err
        else:
            res.graded[sid] = got
            if err:
                res.failed[sid] = f"graded with errors: {err}"
    if res.graded:
        fb = nbgrader(course, "generate_feedback", assignment, "--force")
        if fb.returncode != 0:
            print(f"warning: feedback generation failed:\n{fb.stderr[-2000:]}", file=sys.stderr)
    ex = nbgrader(course, "export")
    if ex.returncode != 0:
        print(f"warning: CSV export failed:\n{ex.stderr[-2000:]}", file=sys.stderr)
    return res


def cmd_class(submissions: str, assignment: str, timeout: float) -> None:
    res = grade_class(Path(submissions).resolve(), assignment, timeout)
    for sid, grades in res.graded.items():
        s = sum(v[0] for v in grades.values())
        m = sum(v[1] for v in grades.values())
        print(f"{sid:<24} {s:g} / {m:g}")
    for sid, why in res.failed.items():
        print(f"{sid:<24} NOT GRADED: {why}" if sid not in res.graded else f"{sid:<24} note: {why}")
    print(f"gradebook: {MAIN.db}\nfeedback:  {MAIN.root / 'autograder' / 'feedback'}\ngrades:    "
          f"{ROOT / 'grades.csv'}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="memlab-grade", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("release", help="regenerate exercises/ from solutions/")
    r.add_argument("assignments", nargs="*", help=f"default: all ({', '.join(assignments())})")
    c = sub.add_parser("check", help="grade one notebook and print a per-task score table")
    c.add_argument("notebook")
    c.add_argument("--timeout", type=float, default=1800, help="seconds for the whole notebook (default 1800)")
    k = sub.add_parser("class", help="autograde a folder of submissions (instructors)")
    k.add_argument("submissions")
    k.add_argument("-a", "--assignment", required=True, help=f"one of {assignments()}")
    k.add_argument("--timeout", type=float, default=1800, help="seconds per learner (default 1800)")
    a = p.parse_args(argv)
    if a.cmd == "release":
        cmd_release(a.assignments)
    elif a.cmd == "check":
        cmd_check(a.notebook, a.timeout)
    else:
        cmd_class(a.submissions, a.assignment, a.timeout)


if __name__ == "__main__":
    main()
