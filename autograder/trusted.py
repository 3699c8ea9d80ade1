"""Trusted grading of one notebook: the score is decided here, outside the learner's process.

1. The grader reads the learner's notebook as data and builds the code to run:
   the release notebook's locked cells (setup, helpers) as released, each solution
   cell from the learner's notebook (matched by grade_id), and any extra code cells
   the learner added. Test cells are never taken from the learner: the checks come
   from `autograder/checks/exNN/`, points from the release notebook.
2. It draws the check cases (visible: fixed seed; hidden: fresh randomness) and keeps
   them. The learner's code runs in a sandbox (`autograder/sandbox.py`) under
   `autograder/harness.py`, which holds only the learner side of the checks
   (LEARNER_SIDE). After the notebook's cells have run, the grader hands over one case
   at a time and reads its reply (`converse`): a reply it did not ask for is flagged,
   each case's memory is measured from outside (the sandbox's cgroup), and threads and
   processes are counted from outside before and after each case, during which their
   creation is frozen.
3. After the sandbox has ended, it judges each result against the checks'
   own references, in a judging process of its own (trusted code, forked from a
   server that has torch loaded) with a time and memory budget per learner, and gives
   each test cell its points if every case of it passed. A failed check keeps its
   teaching message for the feedback. Whatever a learner's results hold (any size,
   any nesting, a judge that runs too long or runs out of memory), the failure is that
   learner's own: it never stops or changes the grading of another.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import os
import re
import resource
import secrets
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .checks.common import Task, hide, reveal, rng
from .sandbox import Limits, Sandbox, tail

ROOT = Path(__file__).resolve().parent.parent
MAX_NOTEBOOK_BYTES = 20 * 2**20
MAX_LINE_BYTES = 8 * 2**20          # one result line; a longer one is that check's error
MAX_REASON_CHARS = 2000             # a feedback message (it may quote the learner's values)
TEST_CELL = re.compile(r"^(?P<task>.+)_(?P<kind>visible|hidden)$")
# Case generators may use torch's global state (seeds, default dtype): cases are drawn one learner at a time.
# Judging runs in a process of its own per learner, so it needs no lock.
CASES_LOCK = threading.Lock()
# The judging processes are forked from a server started once, with torch and the checks' plumbing loaded
# (cheap to fork, no grader threads or locks inherited).
_JUDGES = multiprocessing.get_context("forkserver")
_JUDGES.set_forkserver_preload(["torch", "autograder.checks.common"])


@dataclass(frozen=True)
class JudgeBudget:
    """What judging one learner may take: seconds of wall time and bytes of address space."""
    seconds: float = 600.0
    memory_bytes: int = 8 * 2**30

    def __post_init__(self):
        if isinstance(self.seconds, bool) or not isinstance(self.seconds, (int, float)) or self.seconds <= 0:
            raise ValueError(f"seconds must be a positive number, got {self.seconds!r}")
        if isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int) or self.memory_bytes < 2**28:
            raise ValueError(f"memory_bytes must be an int of at least 256 MiB, got {self.memory_bytes!r}")


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
            out.append({"where": gid or "locked cell", "code": cell_source(c), "locked": True})
        out += [{"where": "your own cell", "code": s} for s in extras.get(gid, [])]
    return out


# Patterns in a learner's own code that tamper with how it is measured. They cannot all be prevented inside the
# learner's process, so a cell that shows one is flagged for the instructor (grades.csv's flags column and the
# class output), whatever it scored. autograder/README.md lists them with the risk that remains.
TAMPERING = (
    (re.compile(r"_pop_mode|_disable_current_modes|_set_dispatch_mode|_push_mode|_len_torch_dispatch_stack|"
                r"_DisableTorchDispatch|_unset_dispatch_mode|_DisableFuncTorch|DisableTorchFunction|"
                r"_disabled_torch_dispatch_impl|_ExcludeDispatchKeyGuard|_AutoDispatchBelow"),
     "switches the grader's dispatch modes off"),
    (re.compile(r"\bsys\.modules\b|\bimportlib\.reload\b"), "replaces modules (sys.modules)"),
    (re.compile(r"\bsys\.(setprofile|settrace)\b|\bthreading\.setprofile\b"), "replaces the profiler hooks"),
    (re.compile(r"\bctypes\b|\bcffi\b"), "calls C directly (ctypes)"),
    (re.compile(r"\bgc\.(get_objects|get_referrers|get_referents)\b"), "walks the garbage collector's objects"),
    (re.compile(r"/proc/self|MEMLAB_(CHANNEL|ACK|REQUEST|REPLY)|\bos\.(write|read|dup2?|fdopen|open)\s*\("),
     "uses file descriptors directly"),
    (re.compile(r"/proc/(?!self)|\bos\.getppid\b|\bpsutil\b"), "looks at other processes (/proc)"),
    (re.compile(r"\bautograder\b"), "reaches into the grader's modules"),
    (re.compile(r"__globals__|__code__|__closure__|\bfunc_globals\b|cell_contents"),
     "rewrites functions' code or globals"),
    (re.compile(r"\b_getframe\b|\bf_back\b|\bf_locals\b|\bf_globals\b|\btb_frame\b|\bgi_frame\b|"
                r"\b_current_frames\b|\binspect\.(stack|currentframe|getouterframes)\b"),
     "walks the call stack (the grader's frames)"),
    (re.compile(r"\baddaudithook\b|\bsys\.monitoring\b"), "installs interpreter hooks"),
    (re.compile(r"\b(setattr|delattr)\s*\(\s*(memlab|torch|autograder|sys|builtins)\b"),
     "patches a library or builtins"),
)


def tampering(cells: list[dict]) -> list[str]:
    """The flags of the learner's own cells (solution cells and cells the learner added): 'cell: what'."""
    out = []
    for c in cells:
        if c.get("locked"):
            continue
        for pattern, what in TAMPERING:
            if pattern.search(c["code"]):
                out.append(f"{c['where']}: {what}")
    return sorted(set(out))


@dataclass
class Graded:
    scores: dict[str, tuple[float, float]] = field(default_factory=dict)   # grade_id -> (score, max)
    flags: list[str] = field(default_factory=list)                         # tampering patterns in the learner's cells
    reasons: dict[str, str] = field(default_factory=dict)                  # grade_id -> why points were lost
    cell_errors: list[str] = field(default_factory=list)                   # errors raised by the learner's cells
    note: str | None = None                                                # the run as a whole (time-out ...)
    seconds: float = 0.0
    memory_peak: int | None = None                                         # the sandbox cgroup's peak (bytes)
    memory_growth: dict[str, int] = field(default_factory=dict)            # each case's key -> its memory
                                                                           # growth seen from outside (bytes)
    protection: str | None = None                                          # the sandbox's line (Sandbox.describe)

    @property
    def total(self) -> tuple[float, float]:
        return sum(s for s, _ in self.scores.values()), sum(m for _, m in self.scores.values())


# The learner side of each exercise's checks: what the sandbox may load. Everything else of a check package (its
# cases, refs and judge: the trusted side) stays with the grader and is never copied where a learner's process runs.
LEARNER_SIDE = ("__init__.py", "inputs.py", "run.py")
PROTOCOL_SECONDS = 120          # a harness that takes longer than this to start (before any learner code) is broken
REPLY_MARGIN = 15               # seconds past a case's own time limit (the harness's alarm) before the grader stops


def stage_course_code(dst: Path) -> Path:
    """A copy of the code the sandbox may see, readable by every user: memlab, the harness, and the learner side of
    each exercise's checks (LEARNER_SIDE, plus checks/common.py and checks/__init__.py)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "gradebook.db", "submitted", "autograded", "feedback")
    shutil.copytree(ROOT / "memlab", dst / "memlab", ignore=ignore)
    checks = dst / "autograder" / "checks"
    checks.mkdir(parents=True)
    for f in ("__init__.py", "harness.py"):
        shutil.copy(ROOT / "autograder" / f, dst / "autograder" / f)
    for f in ("__init__.py", "common.py"):
        shutil.copy(ROOT / "autograder" / "checks" / f, checks / f)
    for package in sorted((ROOT / "autograder" / "checks").iterdir()):
        if package.is_dir() and (package / "__init__.py").is_file():
            (checks / package.name).mkdir()
            for f in LEARNER_SIDE:
                if (package / f).is_file():
                    shutil.copy(package / f, checks / package.name / f)
    for d, dirs, files in os.walk(dst):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    return dst


def python_binds() -> list[Path]:
    """Folders the sandbox needs to run this Python with its packages (read-only): the interpreter's prefixes and
    the package folders on sys.path (site-packages, dist-packages, eggs). Never the current folder, this course
    or a folder that holds it, so `python -m autograder` run from anywhere sees exactly what
    `memlab-grade` sees. (A copy of the grader installed into site-packages is masked in the sandbox.)"""
    keep = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    for p in sys.path:
        if not p or not Path(p).is_dir():
            continue
        rp = Path(p).resolve()
        if any(rp == k or k in rp.parents for k in keep):
            continue
        if rp.name in ("site-packages", "dist-packages") or rp.suffix == ".egg":
            if rp != ROOT and ROOT not in rp.parents and rp not in ROOT.parents:
                keep.add(rp)
    keep.add(Path(os.path.realpath(sys.executable)).parent)
    return sorted(keep)


def installed_graders() -> list[Path]:
    """Copies of the grader's checks installed into this Python's package folders (a non-editable install): what a
    learner's process must not read."""
    out = []
    for b in python_binds():
        for site in [b, *b.glob("lib/python3*/site-packages"), *b.glob("lib/python3*/dist-packages")]:
            if (site / "autograder" / "checks").is_dir():
                out.append(site / "autograder")
    return sorted(set(out))


# A reply that tells of a thread or process the kernel refused to start (the grader froze their creation)
_REFUSED = re.compile(r"can't start new thread|Resource temporarily unavailable|BlockingIOError|\[Errno 11\]")
THREAD_HINT = (": the grader measures the work done in the thread that calls your function, so while a check runs "
               "no thread or process may start; do all of the work there")


@dataclass
class Conversation:
    """What came back from one learner's harness: each probe's reply line (by key), cell errors, and what broke the
    protocol (replies nobody asked for, lines that could not be read)."""
    results: dict = field(default_factory=dict)
    cell_errors: list = field(default_factory=list)
    unasked: int = 0
    dropped: int = 0
    growth: dict = field(default_factory=dict)
    note: str | None = None


def _parse(raw: bytes):
    try:
        r = json.loads(raw.decode("utf-8", errors="replace"))
    except (ValueError, RecursionError):          # ValueError covers JSONDecodeError and the int digits limit
        return None
    return r if isinstance(r, dict) else None


def converse(session, job: dict, probes: list[dict], case_timeout: float) -> Conversation:
    """Drive one learner's harness (harness.py): send the job, let the notebook's code run, then hand over one
    probe at a time, each inside a memory window and a freeze of thread and process creation (the kernel refuses
    them: Session.freeze), counting the learner's processes from outside before and after (a process the notebook
    left running fails the case). Never blocks past the session's deadline."""
    c = Conversation()
    answered: dict[str, str] = {}          # nonce -> key of every probe already answered

    def next_line(timeout, nonce=None):
        """The next readable line that is not a reply to another probe (those are counted as unasked, and a second
        reply to an answered probe spoils that probe's result); None at the end, False on time-out."""
        end = time.monotonic() + timeout
        while True:
            raw = session.receive(max(end - time.monotonic(), 0))
            if raw is None or raw is False:
                return raw
            r = _parse(raw)
            if r is None:
                c.dropped += 1
            elif "probe" in r and (nonce is None or r["probe"] != nonce):
                c.unasked += 1
                if isinstance(r["probe"], str) and r["probe"] in answered:
                    c.results[answered[r["probe"]]] = {"error": "this check's result was written twice: results "
                                                                "were tampered with"}
            else:
                return r

    if not session.send(job):
        c.note = "the grading process did not start"
        return c
    hello = next_line(PROTOCOL_SECONDS)
    if not (isinstance(hello, dict) and hello.get("setup") is True):
        c.note = f"the grading process ended before your notebook ran {tail(session.stderr, 600).strip()[-300:]}"
        return c
    baseline = session.processes()
    if not session.send({"go": True}):
        c.note = "the grading process ended before your notebook ran"
        return c
    while True:
        r = next_line(max(session.deadline - time.monotonic(), 0))
        if r is None or r is False:
            c.note = ("your notebook ran past its time limit" if r is False else "your notebook ended the grading "
                      "process (exit, os._exit, a crash or running out of memory)") + ": no check ran"
            return c
        if "cell" in r:
            if len(c.cell_errors) < 100:
                c.cell_errors.append(r)
        elif r.get("ready") is True:
            break
        else:
            c.unasked += 1
    for p in probes:
        key = p["key"]
        others = session.processes()
        if others > baseline:
            c.results[key] = {"error": _stray(others - baseline, before=True)}
            continue
        nonce = secrets.token_hex(8)
        session.freeze(64 if p.get("spawns") else 0)
        session.window_open()
        sent = session.send({"probe": nonce, "task": p["task"], "case": p["case"]})
        r = next_line(case_timeout + REPLY_MARGIN, nonce) if sent else None
        growth = session.window_close()
        session.thaw()
        if growth is not None:
            c.growth[key] = growth
        if not isinstance(r, dict):
            if r is False:
                c.results[key] = {"error": f"this check ran past its time limit ({case_timeout:g} s)"}
            c.note = (f"a check ran past its time limit ({case_timeout:g} s)" if r is False else
                      "your code ended the grading process (exit, os._exit, a crash or running out of memory)") + \
                ": the checks after it did not run"
            return c
        if r.get("probe") != nonce:                # a line of another kind where the reply was due
            c.unasked += 1
            r = {"error": "no result came back for this check"}
        after = session.processes()
        if after > baseline:
            r = {"error": _stray(after - baseline, before=False)}
        elif "error" in r and _REFUSED.search(str(r.get("error", ""))):
            r = dict(r, error=str(r["error"])[:1500] + THREAD_HINT)
        c.results[key] = r
        answered[nonce] = key
    session.send({"done": True})
    session.wait(10)
    while next_line(0.2) not in (None, False):    # anything still in the pipe after the last probe
        c.unasked += 1
    return c


def _stray(processes: int, before: bool) -> str:
    when = "before it started" if before else "after it returned"
    return (f"this check failed: {processes} process(es) that your notebook started were still running {when}: the "
            f"grader measures the work done in the thread that calls your function, so do all of it there (no "
            f"threads, processes or pools)")


def grade_notebook(path: Path, exercise: Exercise, *, stage: Path, sandbox: Sandbox | None = None,
                   limits: Limits | None = None, case_timeout: float = 300,
                   budget: JudgeBudget | None = None, fit_cache: Path | None = None) -> Graded:
    """Grade one learner's notebook. Raises NotGradable for a file that is no notebook. `fit_cache`: a folder the
    judge keeps memlab.fit's runs in (MEMLAB_FIT_CACHE), shared by the judges of one class run; never in the
    sandbox's reach."""
    sandbox = sandbox or Sandbox()
    limits = limits or Limits()
    budget = budget or JudgeBudget()
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
        with CASES_LOCK:                   # case generators may use torch's global state
            cases = task.cases(hidden, rng(hidden))
        plan[gid] = (task.id, cases)
        probes += [{"key": f"{gid}/{i}", "task": task.id, "case": c, "spawns": task.spawns}
                   for i, c in enumerate(cases)]
    cells = code_to_run(template, learner)
    job = {"module": exercise.module, "cells": cells, "case_timeout": case_timeout}
    graded = Graded(flags=tampering(cells), protection=sandbox.describe())
    with tempfile.TemporaryDirectory(prefix="memlab-learner-") as tmp:
        job_dir = Path(tmp)
        work = sandbox.workdir(job_dir)
        n = "1"     # one thread, as the judge uses: the same summation order on both sides
        # MALLOC_MMAP_THRESHOLD_: every allocation of 128 KiB or more is a fresh mapping, returned when freed, so the
        # memory a case's window sees from outside is that case's own (not pages a freed tensor left resident)
        env = {"PYTHONPATH": str(stage), "MPLBACKEND": "Agg", "MPLCONFIGDIR": str(work / ".mpl"),
               "MALLOC_MMAP_THRESHOLD_": "131072",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1", "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n,
               "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1", "TOKENIZERS_PARALLELISM": "false"}
        argv = [sys.executable, "-m", "autograder.harness"]
        session = sandbox.start(argv, job_dir, [stage, *python_binds()], env, limits, masks=tuple(installed_graders()))
        try:
            talk = converse(session, job, probes, case_timeout)
        finally:
            out = session.finish()
        graded.seconds = out.seconds
        graded.memory_peak, graded.memory_growth = out.memory_peak, talk.growth
        results = talk.results
        graded.cell_errors = [f"{e.get('where')}: {e.get('error')}"[:MAX_REASON_CHARS] for e in talk.cell_errors][:20]
        notes = []
        if out.timed_out:
            notes.append(f"timed out after {limits.wall_s:g} s: checks that had not finished score 0")
        elif talk.note:
            notes.append(talk.note)
        dropped = talk.dropped + out.dropped
        if out.channel_truncated or dropped:
            notes.append(f"your notebook's results were too large or malformed ({dropped} line(s) unreadable"
                         + (f", more than {limits.channel_bytes} bytes in all" if out.channel_truncated else "")
                         + "): those checks score 0")
        if talk.unasked:
            graded.flags = sorted(set(graded.flags) | {
                f"the grading channel: {talk.unasked} line(s) the grader did not ask for (forged results?)"})
        graded.note = "; ".join(notes) or None
    judge_in_process(exercise.module, plan, points, results, graded, budget, fit_cache)
    _errors_to_their_tasks(graded, talk.cell_errors)
    return graded


def _errors_to_their_tasks(graded: Graded, cell_errors: list[dict]) -> None:
    """An error raised by a task's own solution cell (a syntax error, a failed import) is that task's first
    reason, in each of its rows that lost points, said once; it leaves the list of other cells' errors."""
    first: dict[str, str] = {}
    for e in cell_errors:
        first.setdefault(str(e.get("where")), str(e.get("error"))[:MAX_REASON_CHARS])
    routed = set()
    for gid, (score, top) in graded.scores.items():
        task = TEST_CELL.match(gid)["task"]
        if task in first and score < top:
            why = graded.reasons.get(gid, "")
            tail_ = "" if not why or "does not define" in why else f" (then: {why})"
            graded.reasons[gid] = f"your cell {task} raised {first[task]} when it ran: fix that first{tail_}"
            routed.add(task)
    graded.cell_errors = [c for c in graded.cell_errors if c.split(":", 1)[0] not in routed]


def judge_in_process(module: str, plan: dict, points: dict, results: dict, graded: Graded,
                     budget: JudgeBudget, fit_cache: Path | None = None) -> None:
    """Judge one learner's results in a process of its own within `budget`; fills graded.scores/reasons. If the
    judging process runs out of time or memory, or dies, every test cell of this learner scores 0 with a note."""
    recv, send = _JUDGES.Pipe(duplex=False)
    proc = _JUDGES.Process(target=_judge_child, args=(send, module, plan, points, results, graded.note,
                                                      budget.memory_bytes, graded.memory_growth,
                                                      None if fit_cache is None else str(fit_cache)), daemon=True)
    proc.start()
    send.close()
    got, late = None, False
    try:
        if recv.poll(budget.seconds):
            got = recv.recv()
        else:
            late = True
    except (EOFError, OSError):
        got = None
    finally:
        recv.close()
        if proc.is_alive():
            proc.kill()
        proc.join()
    if isinstance(got, tuple) and len(got) == 3:
        graded.scores, graded.reasons, flags = got
        graded.flags = sorted(set(graded.flags) | set(flags))
        return
    why = (f"judging your results took longer than {budget.seconds:g} s" if late else
           f"judging your results failed (exit code {proc.exitcode}: out of memory, or a crash)")
    graded.scores = {gid: (0.0, points[gid]) for gid in plan}
    graded.reasons = {gid: why + ": these checks score 0" for gid in plan}
    graded.note = "; ".join(x for x in (graded.note, why) if x)


def _judge_child(conn, module: str, plan: dict, points: dict, results: dict, note: str | None,
                 memory_bytes: int, memory_growth: dict[str, int] | None = None, fit_cache: str | None = None) -> None:
    """In the judging process: judge every case with one CPU thread, as the learner's code ran (float reductions
    then add up in the same order on both sides, so an optimizer that divides by tiny gradients cannot amplify
    a summation-order difference). Then the check module's `corroborate`, if it has one, sets what the sandbox saw
    from outside (a watched case's memory growth) beside what the learner's process reported, and names what
    disagrees."""
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    if fit_cache:
        os.environ["MEMLAB_FIT_CACHE"] = fit_cache
    import torch
    torch.set_num_threads(1)
    tasks = importlib.import_module(module).TASKS
    try:
        judges = importlib.import_module(f"{module}.judge")
    except ModuleNotFoundError:
        judges = None
    graded = Graded(note=note)
    _judge_cases({gid: (tasks[tid], cases) for gid, (tid, cases) in plan.items()}, points, results, graded)
    flags = []
    if memory_growth and hasattr(judges, "corroborate"):
        runs = [(tid, case, results.get(f"{gid}/{i}", {}).get("value"), memory_growth.get(f"{gid}/{i}"))
                for gid, (tid, cases) in plan.items() for i, case in enumerate(cases)]
        try:
            flags = [str(f)[:MAX_REASON_CHARS] for f in judges.corroborate(runs)]
        except Exception as e:      # a result too malformed to read was judged already; say so, do not stop
            flags = [f"corroboration could not read the results ({type(e).__name__})"]
    conn.send((graded.scores, graded.reasons, flags))
    conn.close()


def _judge_cases(plan: dict, points: dict, results: dict, graded: Graded) -> None:
    for gid, (task, cases) in plan.items():
        graded.scores[gid] = (points[gid], points[gid])
        for i, case in enumerate(cases):
            why = _judge(task, case, results.get(f"{gid}/{i}"), graded.note)
            if why:   # expected values marked by the judge: shown in a visible cell, [hidden] in a hidden one
                why = redact(hide(why)) if TEST_CELL.match(gid)["kind"] == "hidden" else reveal(why)
            if why:
                graded.scores[gid] = (0.0, points[gid])
                graded.reasons[gid] = why if len(why) <= MAX_REASON_CHARS else why[:MAX_REASON_CHARS] + " [...]"
                break


# after "expected" (or "want", "should be" ...): a number or a size, a tuple, a list, or a quoted value
_EXPECTED = re.compile(r"\b(expected|want(?:ed)?|reference(?: value)?|should be)(\s*(?:is|was|=|:)?\s*)"
                       r"(?:[-+]?(?:\d(?:[\d_]|,\d)*(?:\.\d+)?(?:e[-+]?\d+)?|inf|nan)(?:\s*[KMG]i?B\b)?"
                       r"|\([^()]{0,200}\)|\[[^\[\]]{0,200}\]"
                       r"|'[^']{0,200}'(?!\w)|\"[^\"]{0,200}\"(?!\w))", re.I)                        # a quoted value
# any value at all: a bracketed or quoted group holding a digit, then any standalone number (with its unit)
_GROUP = re.compile(r"\([^()]{0,300}\)|\[[^\[\]]{0,300}\]|(?<!\w)'[^']{0,300}'(?!\w)|(?<!\w)\"[^\"]{0,300}\"(?!\w)")
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d(?:[\d_]|,\d)*(?:\.\d+)?(?:e[-+]?\d+)?|inf|nan)"
                     r"(?:\s*(?:[KMGT]i?B|bytes?)\b)?(?![\w]|-bit|-way)")


def redact(message: str) -> str:
    """A hidden check's message, structurally: every standalone number (with its unit) and every bracketed or quoted
    value that holds a digit becomes [hidden], whoever computed it (the reference's expected value, or the
    learner's own result on the hidden case, which tells of the case too). What stays is the teaching text."""
    message = _EXPECTED.sub(lambda m: f"{m[1]}{m[2]}[hidden]", message)
    message = _GROUP.sub(lambda m: "[hidden]" if any(ch.isdigit() for ch in m[0]) else m[0], message)
    return _NUMBER.sub("[hidden]", message)


def _judge(task: Task, case, result: dict | None, note: str | None) -> str | None:
    """None if the case passed, else the reason (a teaching message, never the expected value's source)."""
    if result is None:
        return note or "this check did not run: your code ended the grading process before it (exit, os._exit, " \
                       "a crash or running out of memory)"
    if "error" in result:
        err = str(result["error"])
        if err.startswith("NotImplementedError"):
            return "not done yet: your code raised NotImplementedError"
        return err if err.startswith(("this check", "your notebook", "your code")) else f"your code raised {err}"
    if "value" not in result:
        return "no result came back for this check"
    try:
        task.judge(case, result["value"])
    except AssertionError as e:
        return str(e) or "wrong result"
    except MemoryError:
        return "judging your result ran out of the judge's memory budget (is it far larger than the task asks?)"
    except Exception as e:  # a malformed value the judge could not read
        return f"your result could not be checked ({type(e).__name__}: {str(e)[:300]})"
    return None
