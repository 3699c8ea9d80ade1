"""Grading commands for GPU Memory Lab.

    memlab-grade release [ASSIGNMENT ...]            regenerate exercises/ from solutions/ (instructors, CI)
    memlab-grade check NOTEBOOK [-a ASSIGNMENT]       grade one notebook as the class run would (learners)
    memlab-grade class SUBMISSIONS -a ASSIGNMENT      grade a folder of submissions into nbgrader's gradebook,
                      [--jobs N] [--timeout S]        write feedback and grades.csv (instructors)
    memlab-grade public DEST                          the learner-facing copy of the course (no solutions)
    memlab-grade gradescope -a ASSIGNMENT OUT         a Gradescope autograder zip running the same checks
                                                      and sandbox (large classes; autograder/gradescope.py)

(the command line is autograder/cli.py; `python -m autograder ...` is the same.) Scores are decided by trusted code
in this process: each learner's code runs in its own sandbox (autograder/sandbox.py)
that returns plain data, which is judged here against the checks' own references
(autograder/trusted.py). Only this process writes the gradebook, feedback and CSV,
after the learner's sandbox has ended. See autograder/README.md.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from . import gradebook
from .checks import CHECKS
from .sandbox import Limits, Sandbox
from .trusted import (Exercise, Graded, NotGradable, grade_notebook, installed_graders, python_binds, read_notebook,
                      stage_course_code)

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "autograder"
CONFIG = HERE / "nbgrader_config.py"
SOURCE = ROOT / "solutions"
RELEASE = ROOT / "exercises"
STUDENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")      # matched whole (fullmatch): no newline at the end
TASK_SUFFIX = re.compile(r"_(visible|hidden)$")


# ----------------------------------------------------------------------------- courses and exercises
@dataclass
class Course:
    """An nbgrader course: a root folder, a gradebook, where its config lives, and its release notebooks."""
    root: Path
    db: Path
    config_dir: Path             # the folder whose nbgrader_config.py nbgrader reads (it is run there)
    release: Path = RELEASE

    @property
    def db_url(self) -> str:
        return f"sqlite:///{self.db}"


MAIN = Course(ROOT, HERE / "gradebook.db", HERE)


def temp_course(tmp: Path, source: Path = SOURCE, release: Path = RELEASE) -> Course:
    """A throwaway course in `tmp` with the course's own settings and `source` as its nbgrader source,
    leaving the instructor's gradebook alone. Its releases are graded from `release`."""
    if source.is_dir():
        (tmp / "solutions").symlink_to(source, target_is_directory=True)
    cfg = (f"exec(compile(open({str(CONFIG)!r}).read(), {str(CONFIG)!r}, 'exec'), "
           f"{{**globals(), '__file__': {str(CONFIG)!r}}})\n"
           f"c.CourseDirectory.root = {str(tmp)!r}\n"
           f"c.CourseDirectory.release_directory = 'release'\n"
           f"c.CourseDirectory.db_url = 'sqlite:///{tmp / 'gradebook.db'}'\n")
    (tmp / "nbgrader_config.py").write_text(cfg)
    return Course(tmp, tmp / "gradebook.db", tmp, release)


DRILL = ROOT / "tests" / "fixtures" / "solutions"


def drill_course(tmp: Path) -> Course:
    """A throwaway course holding only the drill exercise (99_drill, autograder/checks/ex99/), released:
    what the pipeline's own tests and benchmarks grade."""
    tmp.mkdir(parents=True, exist_ok=True)
    course = temp_course(tmp, DRILL, tmp / "release")
    generate(course, "99_drill")
    return course


def nbgrader(course: Course, *args: str, timeout: float | None = 600) -> subprocess.CompletedProcess:
    """Run one nbgrader command (trusted data only) in the course's config folder."""
    env = dict(os.environ)
    # nbgrader runs `alembic` by name: make this interpreter's scripts folder come first
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course.config_dir, capture_output=True,
                          text=True, env=env, timeout=timeout, stdin=subprocess.DEVNULL)


def assignments(release: Path = RELEASE) -> list[str]:
    return sorted(p.name for p in release.iterdir() if p.is_dir() and any(p.glob("*.ipynb"))) \
        if release.is_dir() else []


def exercise(name: str, release: Path = RELEASE) -> Exercise:
    names = assignments(release)
    if name not in names:
        raise SystemExit(f"unknown assignment {name!r}; choose one of {names}")
    if name not in CHECKS:
        raise SystemExit(f"assignment {name!r} has no checks: add it to CHECKS in autograder/checks/__init__.py")
    nbs = sorted((release / name).glob("*.ipynb"))
    return Exercise(name, nbs[0], CHECKS[name])


def generate(course: Course, assignment: str) -> None:
    out = nbgrader(course, "generate_assignment", assignment, "--force", "--create")
    if out.returncode != 0:
        raise SystemExit(f"nbgrader generate_assignment {assignment} failed:\n{out.stdout}\n{out.stderr}")


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


def reasons(graded: Graded) -> str:
    lines = [f"- {gid}: {why}" for gid, why in sorted(graded.reasons.items())]
    if graded.note:
        lines.insert(0, f"- {graded.note}")
    lines += [f"- error in {e}" for e in graded.cell_errors]
    return ("Why points were lost:\n" + "\n".join(lines)) if lines else ""


def _assignment_of(notebook: Path, release: Path = RELEASE) -> str:
    """The assignment a notebook belongs to, from its file name (NN_name.ipynb)."""
    for name in assignments(release):
        if (release / name / notebook.name).exists():
            return name
    raise SystemExit(f"{notebook.name} does not match any exercise notebook; expected one of "
                     f"{[p.name for a in assignments(release) for p in (release / a).glob('*.ipynb')]} "
                     f"(a renamed file: pass -a ASSIGNMENT)")


# ----------------------------------------------------------------------------- commands
def cmd_release(names: list[str]) -> None:
    course = MAIN
    for name in names or sorted(p.name for p in SOURCE.iterdir() if p.is_dir()):
        generate(course, name)
        print(f"released {name} -> {(RELEASE / name).relative_to(ROOT)}")


def check_notebook(notebook: Path, assignment: str | None = None, timeout: float = 1800,
                   release: Path = RELEASE) -> Graded:
    """Grade one notebook exactly as the class run does (sandbox included); nothing is written."""
    if not notebook.is_file():
        raise SystemExit(f"no such notebook: {notebook}")
    ex = exercise(assignment or _assignment_of(notebook, release), release)
    sandbox = Sandbox()
    print(sandbox.describe(), file=sys.stderr)
    if not sandbox.protected:
        print("warning: your notebook runs unprotected here: fine for checking your own work, never for grading a "
              "class", file=sys.stderr)
    print(f"grading {notebook.name} as {ex.name}: the whole notebook runs, hidden tests included "
          f"(a minute or more; at most {timeout:.0f} s)...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="memlab-check-") as tmp:
        stage = stage_course_code(Path(tmp) / "course")
        _open_to_learners(Path(tmp), sandbox, stage, [])
        try:
            return grade_notebook(notebook, ex, stage=stage, sandbox=sandbox, limits=Limits(wall_s=timeout))
        except NotGradable as e:
            raise SystemExit(f"could not grade {notebook}: {e}")


def cmd_check(notebook: str, assignment: str | None, timeout: float) -> None:
    graded = check_notebook(Path(notebook).resolve(), assignment, timeout)
    print(f"{Path(notebook).name}\n{table(graded.scores)}")
    why = reasons(graded)
    if why:
        print("\n" + why)
    if graded.flags:
        print("\nFlagged for your instructor (code that tampers with how it is measured):\n"
              + "\n".join(f"- {f}" for f in graded.flags))


def _open_to_learners(tmp: Path, sandbox: Sandbox, stage: Path, private: list[Path]) -> None:
    """Separate-user line: let learners' users reach the staged learner-side code (and nothing else of `tmp`), then
    check that they can read what Python needs and none of the course's trusted files, the solutions, the tests,
    `private` (submissions, the gradebook) or a copy of the grader installed into the environment (SystemExit with
    the fix otherwise). Nothing to do in the other lines."""
    if sandbox.line != "user":
        return
    os.chmod(tmp, 0o711)
    secret = [ROOT / "autograder" / "checks", ROOT / "solutions", ROOT / "tests", *private, *installed_graders()]
    needed = [Path(os.path.realpath(sys.executable)), *python_binds(), stage / "autograder" / "harness.py"]
    sandbox.preflight([p for p in secret if p.exists()], needed)


@dataclass
class ClassResult:
    graded: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)      # not graded at all, and why
    notes: dict[str, str] = field(default_factory=dict)       # graded, with a note (time-out, early exit)
    reasons: dict[str, dict[str, str]] = field(default_factory=dict)   # learner -> grade_id -> why points were lost
    flags: dict[str, list[str]] = field(default_factory=dict)          # learner -> tampering patterns in its cells
    skipped: dict[str, str] = field(default_factory=dict)     # entries of the folder that are no learner


def _has_link(entry: Path) -> bool:
    """Whether anything under `entry` (itself included) is a symbolic link; links are never followed."""
    if entry.is_symlink():
        return True
    if entry.is_dir():
        for dirpath, dirnames, filenames in os.walk(entry, followlinks=False):
            if any(Path(dirpath, n).is_symlink() for n in dirnames + filenames):
                return True
    return False


def collect(submissions: Path, ex: Exercise) -> tuple[dict[str, Path], dict[str, str], dict[str, str]]:
    """Each learner's notebook. Accepted layouts, per learner: SUBMISSIONS/<id>.ipynb,
    SUBMISSIONS/<id>/<nb>.ipynb, SUBMISSIONS/<id>/<assignment>/<nb>.ipynb.
    Returns (found, failed, skipped)."""
    found: dict[str, Path] = {}
    failed: dict[str, str] = {}
    skipped: dict[str, str] = {}
    entries = sorted(submissions.iterdir())
    named: dict[str, list[str]] = {}
    for entry in entries:
        sid = entry.stem if entry.is_file() and not entry.is_symlink() and entry.suffix == ".ipynb" else entry.name
        named.setdefault(sid, []).append(entry.name + ("/" if entry.is_dir() and not entry.is_symlink() else ""))
    for entry in entries:
        sid = entry.stem if entry.is_file() and not entry.is_symlink() else entry.name
        if len(named.get(sid, ())) > 1 and not entry.name.startswith("."):
            failed[sid] = f"two entries name this learner ({' and '.join(named[sid])}): keep one and grade again"
            continue
        shown = repr(entry.name) if not entry.name.isprintable() else entry.name
        if entry.name.startswith("."):
            skipped[shown] = "hidden file"
            continue
        if _has_link(entry):
            skipped[shown] = "holds a symbolic link (links are not followed)"
            continue
        if entry.is_file() and entry.suffix != ".ipynb":
            skipped[shown] = "not a notebook (.ipynb)"
            continue
        if not STUDENT_ID.fullmatch(sid):
            skipped[shown] = "learner id must be letters, digits, '_', '.', '-' (at most 64 characters)"
            continue
        if entry.is_file():
            found[sid] = entry
            continue
        nb = ex.release.name
        cands = [entry / ex.name / nb, entry / nb] + sorted(entry.glob("*.ipynb"))
        hit = next((c for c in cands if c.is_file()), None)
        if hit is None:
            failed[sid] = f"no notebook found (looked for {nb} in {entry.name}/ and {entry.name}/{ex.name}/)"
        else:
            found[sid] = hit
    return found, failed, skipped


def grade_class(submissions: Path, assignment: str, timeout: float = 1800, course: Course = MAIN, jobs: int = 1,
                memory_gb: float = 6, log=print) -> ClassResult:
    if not submissions.is_dir():
        raise SystemExit(f"SUBMISSIONS must be a folder of learners' notebooks, got {submissions}")
    if not isinstance(jobs, int) or jobs < 1:
        raise SystemExit(f"--jobs must be a whole number >= 1, got {jobs!r}")
    ex = exercise(assignment, course.release)
    found, failed, skipped = collect(submissions, ex)
    if not found and not failed:
        raise SystemExit(f"no submissions in {submissions}: expected <learner>.ipynb, <learner>/{ex.release.name} or "
                         f"<learner>/{ex.name}/{ex.release.name}")
    res = ClassResult(failed=dict(failed), skipped=skipped)
    sandbox = Sandbox()
    if sandbox.refusal():
        raise SystemExit(sandbox.refusal())
    log(sandbox.describe())
    log(f"{ex.name}: {len(found)} learner notebook(s) found, {len(skipped)} other entries skipped; registering the "
        f"assignment in the gradebook...")
    gradebook.ensure_assignment(course.db_url, ex)
    limits = Limits(wall_s=timeout, memory_bytes=int(memory_gb * 2**30))
    learners = {}
    for sid, path in found.items():
        try:
            learners[sid] = read_notebook(path)      # read once: what is graded is what is recorded
        except NotGradable as e:
            res.failed[sid] = str(e)
    log(f"grading {len(learners)} learner(s), {jobs} at a time, each in its own sandbox (the whole notebook runs; "
        f"at most {timeout:.0f} s each); a line per learner as each finishes")
    with tempfile.TemporaryDirectory(prefix="memlab-class-") as tmp:
        stage = stage_course_code(Path(tmp) / "course")
        copies = Path(tmp) / "submissions"
        copies.mkdir(mode=0o700)
        _open_to_learners(Path(tmp), sandbox, stage, [submissions, course.db])
        for sid, nb in learners.items():
            (copies / f"{sid}.ipynb").write_text(__import__("json").dumps(nb), encoding="utf-8")
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            # the judges share memlab.fit's runs (exercise 08 draws its cases and judges plans with it) with the case
            # generation in this process, in a folder outside the sandbox's reach: MEMLAB_FIT_CACHE's if it is set
            # (empty: none), else memlab.fit's own cache in the grader's user folder (memlab/fitting/run.py)
            env_cache = os.environ.get("MEMLAB_FIT_CACHE")
            fit_cache = Path(env_cache) if env_cache else None
            futs = {pool.submit(grade_notebook, copies / f"{sid}.ipynb", ex, stage=stage, sandbox=sandbox,
                                limits=limits, fit_cache=fit_cache): sid for sid in learners}
            for i, fut in enumerate(as_completed(futs), 1):
                sid = futs[fut]
                try:
                    g = fut.result()
                    gradebook.record(course, ex, sid, learners[sid], g)
                    res.graded[sid] = gradebook.scores(course, ex.name, sid)
                except NotGradable as e:
                    res.failed[sid] = str(e)
                    log(f"[{i}/{len(futs)}] {sid:<24} NOT GRADED: {e}")
                    continue
                except Exception as e:  # noqa: BLE001 - one learner's failure is that learner's row, never the class's
                    res.failed[sid] = f"grading failed ({type(e).__name__}: {str(e)[:300]})"
                    log(f"[{i}/{len(futs)}] {sid:<24} NOT GRADED: {res.failed[sid]}")
                    continue
                res.reasons[sid] = dict(g.reasons)
                gradebook.record_flags(course, ex.name, sid, g.flags)     # [] clears an earlier run's flags
                if g.flags:
                    res.flags[sid] = list(g.flags)
                if g.note:
                    res.notes[sid] = g.note
                s, m = g.total
                note = f"  {g.note}" if g.note else ""
                flagged = f"  FLAGGED: {'; '.join(g.flags)}" if g.flags else ""
                log(f"[{i}/{len(futs)}] {sid:<24} {s:g} / {m:g}  ({g.seconds:.0f} s){note}{flagged}")
    if res.graded:
        log(f"writing each learner's feedback page (nbgrader generate_feedback, {len(res.graded)} learner(s))...")
        fb = nbgrader(course, "generate_feedback", ex.name, "--force")
        if fb.returncode != 0:
            log(f"warning: feedback generation failed:\n{fb.stderr[-2000:]}")
        gradebook.name_test_cells(course.root / "autograder" / "feedback")
    log(f"exporting {course.root / 'grades.csv'}...")
    gradebook.export_csv(course, course.root / "grades.csv")
    return res


def cmd_class(submissions: str, assignment: str, timeout: float, jobs: int, memory_gb: float) -> None:
    t0 = time.monotonic()
    res = grade_class(Path(submissions).resolve(), assignment, timeout, jobs=jobs, memory_gb=memory_gb)
    for sid, why in sorted(res.failed.items()):
        print(f"{sid:<24} NOT GRADED: {why}")
    for name, why in sorted(res.skipped.items()):
        print(f"{name:<24} skipped: {why}")
    print(f"graded {len(res.graded)} learners in {time.monotonic() - t0:.0f} s with --jobs {jobs}\n"
          f"gradebook: {MAIN.db}\nfeedback:  {MAIN.root / 'autograder' / 'feedback'}\ngrades:    {ROOT / 'grades.csv'}")
    if res.failed:
        sys.exit(1)


PUBLIC = ["README.md", "course.py", "pyproject.toml", "constraints.txt", "environment.yml", "nbgrader_config.py",
          "memlab", "lessons", "exercises", "autograder", "benchmarks", ".gitignore"]


# the README sections a learner's copy keeps (by their "## " heading); the rest is for contributors and instructors
PUBLIC_SECTIONS = ("Start", "Syllabus", "Will it fit?", "Doing an exercise", "On Colab", "Licence")


def public_readme(text: str) -> str:
    """The learner's README: the full README's opening and the sections in PUBLIC_SECTIONS (no tests, no
    release, no solutions, no contributor's map)."""
    parts = re.split(r"(?m)^(?=## )", text)
    keep = "".join([parts[0]] + [p for p in parts[1:] if p[3:].startswith(PUBLIC_SECTIONS)])
    return _without_missing(keep)


_MISSING = r"`(?:tests|solutions)/[^`]*`|\btests/|course\.py test\b|CONTRIBUTING"


def _without_missing(text: str) -> str:
    """Markdown without what points at files a learner's copy does not hold (tests/, solutions/, the test command):
    a clause after ';' inside parentheses goes, else the whole sentence; fenced code is left alone."""
    out = []
    for block in re.split(r"(\n\s*\n)", text):
        if block.lstrip().startswith("```") or not re.search(_MISSING, block):
            out.append(block)
            continue
        block = re.sub(rf";\s*[^;()]*(?:{_MISSING})[^;()]*(?=\))", "", block)
        sentences = re.split(r"(?<=[.!?])(\s+)(?=[`A-Z(*])", block)
        out.append("".join(x for x in sentences if not re.search(_MISSING, x)).rstrip(" \n") +
                   ("\n" if block.endswith("\n") else ""))
    return "".join(out)


def cmd_public(dest: str) -> None:
    """The learner-facing copy: everything but the nbgrader source (solutions) and the graders' test corpus."""
    out = Path(dest).resolve()
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"DEST must be a new or empty folder, got {out}")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "gradebook*", "submitted", "autograded", "feedback",
                                    ".ipynb_checkpoints", "work", "grades.csv", "flags.json", "release", "source")
    for name in PUBLIC:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, out / name, ignore=ignore)
        elif src.is_file():
            out.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, out / name)
    (out / "README.md").write_text(public_readme((ROOT / "README.md").read_text()))
    print(f"learner-facing copy in {out}: lessons, exercises, memlab, the checks; no solutions/ and no tests/")
