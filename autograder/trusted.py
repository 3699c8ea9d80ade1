"""Trusted grading of one notebook: the score is decided here, outside the learner's process.

1. The grader reads the learner's notebook as data and builds the code to run:
   the release notebook's locked cells (setup, helpers) as released, each solution
   cell from the learner's notebook (matched by grade_id), and any extra code cells
   the learner added. Test cells are never taken from the learner: the checks come
   from `autograder/checks/exNN.py`, points from the release notebook.
2. It draws the check cases (visible: fixed seed; hidden: fresh randomness) and
   runs the learner's code on them in a sandbox (`autograder/sandbox.py`,
   `autograder/harness.py`), which returns plain data.
3. After the sandbox has ended, it judges each result against the checks'
   own references, here, and gives each test cell its points if every case of it
   passed. A failed check keeps its teaching message for the feedback.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .checks.common import Task, rng
from .sandbox import Limits, Sandbox

ROOT = Path(__file__).resolve().parent.parent
MAX_NOTEBOOK_BYTES = 20 * 2**20
MAX_RESULTS_BYTES = 200 * 2**20
TEST_CELL = re.compile(r"^(?P<task>.+)_(?P<kind>visible|hidden)$")
# Judges use torch's global state (seeds, default dtype, patched init functions in transformers): the sandboxes
# of several learners run at once, but their results are judged one learner at a time.
JUDGE_LOCK = threading.Lock()


class NotGradable(Exception):
    """The notebook cannot be graded at all (not JSON, not a notebook, too large)."""


def nbgrader_meta(cell: dict) -> dict:
    m = cell.get("metadata", {}).get("nbgrader", {})
    return m if isinstance(m, dict) else {}


def cell_source(cell: dict) -> str:
    s = cell.get("source", "")
    if isinstance(s, list):
        s = "".join(x for x in s if isinstance(x, str))
    return s if isinstance(s, str) else ""


def read_notebook(path: Path) -> dict:
    """A notebook as plain JSON data, or NotGradable saying why."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise NotGradable(f"cannot read {path.name}: {e.strerror}")
    if size > MAX_NOTEBOOK_BYTES:
        raise NotGradable(f"the notebook is {size} bytes, more than {MAX_NOTEBOOK_BYTES}; clear its outputs")
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise NotGradable(f"not a readable notebook ({type(e).__name__}: {e})")
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list) or nb.get("nbformat") != 4:
        raise NotGradable("not a Jupyter notebook in format 4 (no list of cells)")
    nb["cells"] = [c for c in nb["cells"] if isinstance(c, dict)]
    return nb


@dataclass(frozen=True)
class Exercise:
    """What grading an assignment needs: its release notebook (cells, points) and its checks."""
    name: str
    release: Path                         # the release notebook (locked cells, points, grade ids)
    module: str                           # the check module, imported in the grader and in the sandbox

    @property
    def template(self) -> dict:
        return read_notebook(self.release)

    def tasks(self) -> dict[str, Task]:
        return importlib.import_module(self.module).TASKS

    def graded_cells(self) -> dict[str, float]:
        """grade_id -> points of every graded test cell of the release notebook."""
        return {nbgrader_meta(c)["grade_id"]: float(nbgrader_meta(c).get("points", 0))
                for c in self.template["cells"] if nbgrader_meta(c).get("grade")}


def code_to_run(template: dict, learner: dict) -> list[dict]:
    """The cells the sandbox runs, in order: locked code as released, solutions and
    extra cells from the learner, no test cells."""
    solutions: dict[str, str] = {}
    extras: dict[str | None, list[str]] = {}
    known = {nbgrader_meta(c).get("grade_id") for c in template["cells"]} - {None}
    anchor = None
    for c in learner["cells"]:
        if c.get("cell_type") != "code":
            continue
        gid = nbgrader_meta(c).get("grade_id")
        if gid in known:
            anchor = gid
            if nbgrader_meta(c).get("solution") and gid not in solutions:
                solutions[gid] = cell_source(c)   # the first cell with that id; duplicates are ignored
        elif not nbgrader_meta(c):
            extras.setdefault(anchor, []).append(cell_source(c))
    out = [{"where": "your own cell", "code": s} for s in extras.get(None, [])]
    for c in template["cells"]:
        m = nbgrader_meta(c)
        if c.get("cell_type") != "code":
            continue
        gid = m.get("grade_id")
        if m.get("solution"):
            out.append({"where": gid, "code": solutions.get(gid, "")})
        elif not m.get("grade"):
            out.append({"where": gid or "locked cell", "code": cell_source(c)})
        out += [{"where": "your own cell", "code": s} for s in extras.get(gid, [])]
    return out


@dataclass
class Graded:
    scores: dict[str, tuple[float, float]] = field(default_factory=dict)   # grade_id -> (score, max)
    reasons: dict[str, str] = field(default_factory=dict)                  # grade_id -> why points were lost
    cell_errors: list[str] = field(default_factory=list)                   # errors raised by the learner's cells
    note: str | None = None                                                # the run as a whole (time-out ...)
    seconds: float = 0.0

    @property
    def total(self) -> tuple[float, float]:
        return sum(s for s, _ in self.scores.values()), sum(m for _, m in self.scores.values())


def stage_course_code(dst: Path) -> Path:
    """A copy of the code the sandbox may see: memlab and the grader's learner-side modules."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "gradebook.db", "submitted", "autograded", "feedback")
    shutil.copytree(ROOT / "memlab", dst / "memlab", ignore=ignore)
    (dst / "autograder").mkdir(parents=True)
    for f in ("__init__.py", "harness.py"):
        shutil.copy(ROOT / "autograder" / f, dst / "autograder" / f)
    shutil.copytree(ROOT / "autograder" / "checks", dst / "autograder" / "checks", ignore=ignore)
    return dst


def python_binds() -> list[Path]:
    """Folders the sandbox needs to run this Python with its packages (read-only)."""
    keep = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    for p in sys.path:
        if p and Path(p).is_dir():
            rp = Path(p).resolve()
            if not any(rp == k or k in rp.parents for k in keep) and ROOT not in (rp, *rp.parents):
                keep.add(rp)
    keep.add(Path(os.path.realpath(sys.executable)).parent)
    return sorted(keep)


def grade_notebook(path: Path, exercise: Exercise, *, stage: Path, sandbox: Sandbox | None = None,
                   limits: Limits | None = None, case_timeout: float = 300) -> Graded:
    """Grade one learner's notebook. Raises NotGradable for a file that is no notebook."""
    sandbox = sandbox or Sandbox()
    limits = limits or Limits()
    learner = read_notebook(path)
    template = exercise.template
    tasks = exercise.tasks()
    points = exercise.graded_cells()
    probes, plan = [], {}
    for gid in points:
        m = TEST_CELL.match(gid)
        if not m or m["task"] not in tasks:
            raise SystemExit(f"{exercise.name}: graded cell {gid!r} has no check in {exercise.module}.TASKS")
        task, hidden = tasks[m["task"]], m["kind"] == "hidden"
        with JUDGE_LOCK:                   # case generators may use torch's global state too
            cases = task.cases(hidden, rng(hidden))
        plan[gid] = (task, cases)
        probes += [{"key": f"{gid}/{i}", "task": task.id, "case": c} for i, c in enumerate(cases)]
    job = {"module": exercise.module, "cells": code_to_run(template, learner), "probes": probes,
           "case_timeout": case_timeout}
    graded = Graded()
    with tempfile.TemporaryDirectory(prefix="memlab-learner-") as tmp:
        scratch = Path(tmp)
        (scratch / "job.json").write_text(json.dumps(job))
        n = "1"     # one thread, as the judge uses: the same summation order on both sides
        env = {"PYTHONPATH": str(stage), "HOME": str(scratch), "TMPDIR": "/tmp" if sandbox.bwrap else tmp,
               "MPLBACKEND": "Agg", "MPLCONFIGDIR": str(scratch / ".mpl"), "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONNOUSERSITE": "1", "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "LANG": "C.UTF-8",
               "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1"}
        argv = [sys.executable, "-m", "autograder.harness", str(scratch)]
        out = sandbox.run(argv, scratch, [stage, *python_binds()], env, limits)
        graded.seconds = out.seconds
        results = _read_results(scratch / "results.jsonl")
        graded.cell_errors = [f"{e.get('where')}: {e.get('error')}" for e in _read_lines(scratch / "cells.jsonl")
                              if isinstance(e, dict)][:20]
        if out.timed_out:
            graded.note = f"timed out after {limits.wall_s:g} s: checks that had not finished score 0"
        elif out.returncode not in (0, None) and len(results) < len(probes):
            tail = out.stderr.read_text(errors="replace")[-600:] if out.stderr.exists() else ""
            graded.note = f"the grading process ended early (exit code {out.returncode}) {tail.strip()[-300:]}"
    with JUDGE_LOCK:
        _judge_all(plan, points, results, graded)
    return graded


def _judge_all(plan: dict, points: dict, results: dict, graded: Graded) -> None:
    """Judge with one CPU thread, as the learner's code ran: float reductions then add up in the same order on
    both sides, so an optimizer that divides by tiny gradients (Adam) cannot amplify a summation-order difference."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _judge_cases(plan, points, results, graded)
    finally:
        torch.set_num_threads(threads)


def _judge_cases(plan: dict, points: dict, results: dict, graded: Graded) -> None:
    for gid, (task, cases) in plan.items():
        graded.scores[gid] = (points[gid], points[gid])
        for i, case in enumerate(cases):
            why = _judge(task, case, results.get(f"{gid}/{i}"), graded.note)
            if why and TEST_CELL.match(gid)["kind"] == "hidden":
                why = redact(why)
            if why:
                graded.scores[gid] = (0.0, points[gid])
                graded.reasons[gid] = why
                break


_EXPECTED = re.compile(r"\b(expected|want(?:ed)?|reference(?: value)?|should be)(\s*(?:is|was|=|:)?\s*)"
                       r"[-+]?(?:\d[\d_,]*\.?\d*(?:e[-+]?\d+)?|inf|nan)", re.I)


def redact(message: str) -> str:
    """A hidden check's message without the expected numbers (the inputs are drawn anew each run anyway)."""
    return _EXPECTED.sub(lambda m: f"{m[1]}{m[2]}[hidden]", message)


def _read_lines(path: Path) -> list:
    if not path.exists() or path.stat().st_size > MAX_RESULTS_BYTES:
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _read_results(path: Path) -> dict[str, dict]:
    """key -> result line; a key written twice is marked as tampered with."""
    seen: dict[str, dict] = {}
    for r in _read_lines(path):
        if not isinstance(r, dict) or not isinstance(r.get("key"), str):
            continue
        k = r["key"]
        seen[k] = {"error": "this check's result was written twice: results were tampered with"} if k in seen else r
    return seen


def _judge(task: Task, case, result: dict | None, note: str | None) -> str | None:
    """None if the case passed, else the reason (a teaching message, never the expected value's source)."""
    if result is None:
        return note or "this check did not run: your code ended the grading process before it (exit, os._exit, " \
                       "a crash or running out of memory)"
    if "error" in result:
        err = str(result["error"])
        if err.startswith("NotImplementedError"):
            return "not done yet: your code raised NotImplementedError"
        return f"your code raised {err}" if not str(result["error"]).startswith("this check") \
            else str(result["error"])
    if "value" not in result:
        return "no result came back for this check"
    try:
        task.judge(case, result["value"])
    except AssertionError as e:
        return str(e) or "wrong result"
    except Exception as e:  # a malformed value the judge could not read
        return f"your result could not be checked ({type(e).__name__}: {str(e)[:300]})"
    return None
