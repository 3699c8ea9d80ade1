"""One learner can never affect another: what comes back from a sandbox is read within bounds, judging runs in a
process of its own within a time and memory budget, the learner's writable space is bounded, and the class run
takes only safe, link-free entries. (The whole pipeline against hostile notebooks: test_trusted_grading.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import time
import sys
from pathlib import Path

import pytest

from autograder import grade, sandbox, trusted
from autograder.sandbox import tail
from autograder.trusted import Graded, JudgeBudget, converse, judge_in_process

ROOT = Path(__file__).resolve().parent.parent


def need_bwrap() -> None:
    if sandbox.Sandbox().bwrap:
        return
    msg = "bubblewrap is not installed (apt-get install bubblewrap)"
    if os.environ.get("CI"):
        pytest.fail(f"{msg}; CI must test the sandboxed path")
    pytest.skip(msg)


# ----------------------------------------------------------------------------- the conversation
# A harness that breaks the protocol every way it can, in order: unreadable lines (too deep, an integer too long,
# not JSON, no object, too long), a reply for a probe nobody asked for before "ready", then for the first probe a
# forged reply with the right nonce followed by the "real" one (a second reply), then for the second a reply with
# the wrong nonce before the right one, and a line after "done".
LIAR = """import json, os
req, rep = int(os.environ['MEMLAB_REQUEST_FD']), int(os.environ['MEMLAB_REPLY_FD'])
inbox = os.fdopen(req, 'rb')
def send(b):
    os.write(rep, b + b'\\n')
def get():
    return json.loads(inbox.readline())
job = get()
send(json.dumps({'setup': True}).encode())
assert get() == {'go': True}
send(b'{"cell": 0, "where": ' + b'[' * 100000 + b']' * 100000 + b'}')
send(b'{"probe": "a", "value": ' + b'9' * 5000 + b'}')
send(b'not json')
send(b'[1, 2]')
send(b'{"probe": "' + b'x' * (9 * 2**20) + b'"}')
send(json.dumps({'probe': 'guess', 'value': 1}).encode())
send(json.dumps({'cell': 1, 'where': 'mine', 'error': 'E'}).encode())
send(json.dumps({'ready': True}).encode())
p = get()
send(json.dumps({'probe': p['probe'], 'value': 'forged'}).encode())
send(json.dumps({'probe': p['probe'], 'value': 'real'}).encode())
p = get()
send(json.dumps({'probe': 'not-' + p['probe'], 'value': 0}).encode())
send(json.dumps({'probe': p['probe'], 'value': 2}).encode())
assert get() == {'done': True}
send(json.dumps({'probe': 'late', 'value': 3}).encode())
"""


def test_the_grader_reads_only_the_reply_it_asked_for(tmp_path):
    """converse() against a harness that lies: unreadable lines are dropped and counted, every line the grader did
    not ask for is counted (the grader flags it), a probe answered twice is spoiled whichever answer was true, and
    a reply with another nonce is not taken as the answer."""
    box = sandbox.Sandbox()
    session = box.start([sys.executable, "-c", LIAR], tmp_path, trusted.python_binds(), {}, sandbox.Limits(wall_s=60))
    try:
        probes = [{"key": "t_visible/0", "task": "t", "case": 1}, {"key": "t_hidden/0", "task": "t", "case": 2}]
        c = converse(session, {"module": "m", "cells": [], "case_timeout": 10}, probes, 10)
    finally:
        out = session.finish()
    assert out.returncode == 0, tail(out.stderr)
    assert c.cell_errors == [{"cell": 1, "where": "mine", "error": "E"}], c.cell_errors
    assert c.dropped + out.dropped == 5, (c.dropped, out.dropped)
    assert "written twice" in c.results["t_visible/0"]["error"], c.results
    assert c.results["t_hidden/0"].get("value") == 2, c.results
    assert c.unasked == 4, c.unasked       # "guess" before ready, the second reply, the wrong nonce, "late"


SILENT = """import os, time
req, rep = int(os.environ['MEMLAB_REQUEST_FD']), int(os.environ['MEMLAB_REPLY_FD'])
inbox = os.fdopen(req, 'rb')
os.write(rep, b'{"setup": true}\\n')
inbox.readline()
inbox.readline()
os.write(rep, b'{"ready": true}\\n')
inbox.readline()
time.sleep(600)
"""


def test_a_harness_that_never_answers_costs_only_its_own_time(tmp_path, monkeypatch):
    """A process that reads its probe and never replies: the grader stops waiting after the case's time limit (and
    its margin, cut to 2 s here), says so, and runs none of the later probes."""
    monkeypatch.setattr(trusted, "REPLY_MARGIN", 2)
    box = sandbox.Sandbox()
    t0 = time.monotonic()
    session = box.start([sys.executable, "-c", SILENT], tmp_path, trusted.python_binds(), {},
                        sandbox.Limits(wall_s=60))
    try:
        c = converse(session, {"module": "m", "cells": [], "case_timeout": 1},
                     [{"key": "t_visible/0", "task": "t", "case": 1}, {"key": "t_visible/1", "task": "t", "case": 2}],
                     1)
    finally:
        session.finish()
    assert time.monotonic() - t0 < 40
    assert "time limit" in c.results["t_visible/0"]["error"] and "t_visible/1" not in c.results, c.results
    assert "did not run" in c.note, c.note


# ----------------------------------------------------------------------------- judging in its own process
def _plan(task_id):
    return {f"{task_id}_visible": (task_id, [{"n": 1}])}


@pytest.mark.parametrize("task_id,got,budget,want", [
    ("right", 2, JudgeBudget(), None),
    ("right", 5, JudgeBudget(), "should be 2"),
    ("slow", 2, JudgeBudget(seconds=3), "took longer than 3 s"),
    ("hog", 2, JudgeBudget(memory_bytes=2**31), "memory budget"),
])
def test_judging_is_bounded_per_learner(task_id, got, budget, want):
    graded = Graded()
    results = {f"{task_id}_visible/0": {"key": f"{task_id}_visible/0", "value": got}}
    judge_in_process("_judge_fixtures", _plan(task_id), {f"{task_id}_visible": 1.0}, results, graded, budget)
    if want is None:
        assert graded.scores == {f"{task_id}_visible": (1.0, 1.0)} and graded.reasons == {}
    else:
        assert graded.scores == {f"{task_id}_visible": (0.0, 1.0)}
        assert want in graded.reasons[f"{task_id}_visible"], graded.reasons


def test_judge_budget_checks_its_inputs():
    with pytest.raises(ValueError, match="seconds"):
        JudgeBudget(seconds=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        JudgeBudget(memory_bytes=True)


# ----------------------------------------------------------------------------- the sandbox's bounds
def _sandboxed(tmp_path, code: str, limits: sandbox.Limits):
    box = sandbox.Sandbox()
    job = tmp_path / "job"
    job.mkdir()
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    return box.run([sys.executable, "-c", code], job, trusted.python_binds(), env, limits, channel=True), job


def test_scratch_stdout_and_channel_are_bounded(tmp_path):
    need_bwrap()
    mib = 2**20
    code = ("import os, sys\n"
            "fd = int(os.environ['MEMLAB_CHANNEL_FD'])\n"
            "os.write(fd, b'first line\\n')\n"
            "try:\n"
            "    with open('flood', 'wb') as f:\n"
            "        for _ in range(64):\n"
            "            f.write(b'x' * (1 << 20))\n"
            "    os.write(fd, b'scratch: unbounded\\n')\n"
            "except OSError as e:\n"
            "    os.write(fd, b'scratch: full\\n')\n"
            "import signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "try:\n"
            "    for _ in range(64):\n"
            "        sys.stdout.buffer.write(b'y' * (1 << 20)); sys.stdout.flush()\n"
            "    os.write(fd, b'stdout: unbounded\\n')\n"
            "except OSError:\n"
            "    os.write(fd, b'stdout: capped\\n')\n"
            "for _ in range(16):\n"
            "    os.write(fd, b'z' * (1 << 20))\n")
    limits = sandbox.Limits(wall_s=60, scratch_bytes=8 * mib, file_bytes=4 * mib, channel_bytes=2 * mib)
    out, job = _sandboxed(tmp_path, code, limits)
    lines = out.channel.split(b"\n")
    assert lines[:3] == [b"first line", b"scratch: full", b"stdout: capped"], lines[:3]
    assert out.channel_truncated and len(out.channel) == 2 * mib
    assert (job / "stdout.txt").stat().st_size <= 4 * mib
    assert not (job / "scratch").exists() and not (job / "flood").exists()   # the scratch was a tmpfs


def test_the_job_folder_is_read_only_inside(tmp_path):
    need_bwrap()
    code = ("import os, pathlib\nfd = int(os.environ['MEMLAB_CHANNEL_FD'])\n"
            "job = pathlib.Path(os.environ['JOB'])\n"
            "try:\n    (job / 'job.json').write_text('forged')\n    os.write(fd, b'wrote')\n"
            "except OSError:\n    os.write(fd, b'refused')\n")
    box = sandbox.Sandbox()
    job = tmp_path / "job"
    job.mkdir()
    (job / "job.json").write_text("{}")
    out = box.run([sys.executable, "-c", code], job, trusted.python_binds(), {"JOB": str(job)},
                  sandbox.Limits(wall_s=60), channel=True)
    assert out.channel == b"refused" and (job / "job.json").read_text() == "{}"


@pytest.mark.parametrize("cgroups", [True, False], ids=["with_cgroups", "pid_namespace_only"])
def test_nothing_the_learner_started_is_alive_when_run_returns(tmp_path, cgroups):
    """A learner that detaches two ways (a new session, a double fork) and then hangs: the moment run() returns,
    none of its processes is left, with or without cgroups to sweep (without them only the PID namespace ends
    them, and the kernel does that after bubblewrap's death, not at once)."""
    need_bwrap()
    tag = f"memlab-stray-{os.getpid()}-{cgroups}"
    code = ("import os, subprocess, sys, time\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)  # {tag}'], "
            "start_new_session=True)\n"
            "if os.fork() == 0:\n    os.setsid()\n"
            f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(600)  # {tag}'])\n"
            "time.sleep(1)\nwhile True:\n    pass\n")
    box = sandbox.Sandbox()
    if not cgroups:
        box.cgroups = []
    for i in range(2):
        job = tmp_path / f"job{i}"
        job.mkdir()
        out = box.run([sys.executable, "-c", code], job, trusted.python_binds(), {}, sandbox.Limits(wall_s=3))
        left = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True).stdout.split()
        if left:
            subprocess.run(["pkill", "-9", "-f", tag])
        assert out.timed_out and not left, f"run {i}: processes outlived the sandbox: {left}"


def test_the_sandbox_reports_its_memory_peak_from_outside(tmp_path):
    """The cgroup's high-water mark comes back with the outcome (None without cgroups): what a learner's process
    held, whatever that process says about itself."""
    need_bwrap()
    box = sandbox.Sandbox()
    if not box.cgroups:
        pytest.skip("no writable memory cgroup here (grade as root)")
    peaks = []
    for i, mib in enumerate((16, 700)):
        job = tmp_path / f"job{i}"
        job.mkdir()
        code = f"b = bytearray({mib} * 2**20)\nfor j in range(0, len(b), 4096):\n    b[j] = 1\n"
        out = box.run([sys.executable, "-c", code], job, trusted.python_binds(), {}, sandbox.Limits(wall_s=60))
        assert out.returncode == 0, out
        peaks.append(out.memory_peak)
    assert peaks[0] < 200 * 2**20 <= 700 * 2**20 <= peaks[1], peaks
    box.cgroups = []
    job = tmp_path / "job_none"
    job.mkdir()
    out = box.run([sys.executable, "-c", "pass"], job, trusted.python_binds(), {}, sandbox.Limits())
    assert out.memory_peak is None


PHASES = """import os
req = os.fdopen(int(os.environ['MEMLAB_REQUEST_FD']), 'rb')
rep = int(os.environ['MEMLAB_REPLY_FD'])
def touch(mib):
    b = bytearray(mib * 2**20)
    for j in range(0, len(b), 4096):
        b[j] = 1
    return b
held = touch(300)                                  # held before any window opens: never counted
os.write(rep, b'holding\\n')
for line in req:
    x = touch(int(line))
    del x
    os.write(rep, b'done\\n')
"""


def test_a_memory_window_sees_one_pieces_growth_from_outside(tmp_path):
    """The grader resets the cgroup's high-water mark when it opens a window and reads it when it closes it: the
    growth is that piece's memory alone, not what the process held before (300 MiB here). The learner's process
    has no say in when a window opens or closes. Without a cgroup there is no growth."""
    need_bwrap()
    box = sandbox.Sandbox()
    if not box.cgroups:
        pytest.skip("no writable memory cgroup here (grade as root)")

    def windows(box, job):
        s = box.start([sys.executable, "-c", PHASES], job, trusted.python_binds(), {}, sandbox.Limits(wall_s=60))
        grown = []
        try:
            assert s.receive(30) == b"holding"
            for mib in (8, 200):
                s.window_open()
                assert s.send(mib) and s.receive(30) == b"done"
                grown.append(s.window_close())
        finally:
            out = s.finish()
        return grown, out

    (small, big), out = windows(box, tmp_path)
    assert small < 40 * 2**20, small
    assert 200 * 2**20 <= big < 260 * 2**20, big
    assert out.memory_peak > 500 * 2**20                      # the whole run's peak holds both
    box.cgroups = []
    job = tmp_path / "none"
    job.mkdir()
    assert windows(box, job)[0] == [None, None]


FORKER = """import os, threading
req = os.fdopen(int(os.environ['MEMLAB_REQUEST_FD']), 'rb')
rep = int(os.environ['MEMLAB_REPLY_FD'])
os.write(rep, b'up\\n')
for line in req:
    got = []
    try:
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
        got.append('thread')
    except RuntimeError:
        pass
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        got.append('process')
    except OSError:
        pass
    os.write(rep, (' '.join(got) or 'none').encode() + b'\\n')
"""


def test_a_frozen_sandbox_starts_no_thread_or_process(tmp_path):
    """While a probe runs the grader freezes the sandbox (its cgroup's process limit, or the learner user's
    RLIMIT_NPROC): the kernel refuses a new thread and a new process, whatever the learner's code does around the
    harness's own guards; thawed, both start again."""
    need_bwrap()
    box = sandbox.Sandbox()
    if not box.cgroups:
        pytest.skip("no writable cgroup here (grade as root)")
    s = box.start([sys.executable, "-c", FORKER], tmp_path, trusted.python_binds(), {}, sandbox.Limits(wall_s=60))
    try:
        assert s.receive(30) == b"up"                 # frozen once the process runs, as the grader does
        assert s.freeze()
        assert s.send("x") and s.receive(30) == b"none"
        s.thaw()
        assert s.send("x") and s.receive(30) == b"thread process"
    finally:
        s.finish()


def test_a_memory_growth_the_learners_process_did_not_report_is_flagged():
    """Exercise 05's large case judged in the judging process with its window's growth beside it: an honest tiled
    pass (largest tensor a tile) that grew a few MiB is not flagged; the same report with a growth of the score
    matrix's size is; a result that already fails its memory bound is judged, not flagged; no growth (no cgroup),
    no flag."""
    import random
    from autograder.checks.ex05 import cases as c5
    case = c5.large_case(random.Random(0))
    assert case["watched"] is True
    gid = "task5_2_tiled_attention_hidden"
    plan = {gid: ("task5_2_tiled_attention", [case])}
    tile = case["lead"][0] * case["tile"] ** 2
    for largest, growth, flagged in ((tile, 6 * 2**20, False), (tile, c5.LARGE_SCORES, True),
                                     (tile, c5.LARGE_FLAG_BYTES - 1, False),
                                     (case["lead"][0] * case["tq"] * case["tk"], c5.LARGE_SCORES, False),
                                     (tile, None, False)):
        graded = Graded(memory_growth={} if growth is None else {f"{gid}/0": growth})
        results = {f"{gid}/0": {"key": f"{gid}/0", "value": {"out": [], "lse": [], "largest": largest, "ops": []}}}
        judge_in_process("autograder.checks.ex05", plan, {gid: 1.0}, results, graded, JudgeBudget())
        assert bool(graded.flags) == flagged, (largest, growth, graded.flags)
        assert graded.scores[gid] == (0.0, 1.0)       # the empty rows fail their check either way


NUMPY_ATTENTION = '''import numpy as np

def tiled_attention(q, k, v, is_causal=False, tile=64):
    # the whole score matrix in numpy: memlab's tracker (a torch dispatch mode) never sees it
    Q, K, V = (t.detach().numpy() for t in (q, k, v))
    s = Q @ np.swapaxes(K, -1, -2) / np.sqrt(Q.shape[-1])
    if is_causal:
        s = np.where(np.arange(K.shape[-2])[None, :] > np.arange(Q.shape[-2])[:, None], -np.inf, s)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    out = (p / l) @ V
    return torch.from_numpy(out.astype(np.float32)), torch.from_numpy((m + np.log(l))[..., 0].astype(np.float32))'''


@pytest.mark.slow
def test_attention_computed_where_the_tracker_cannot_see_is_flagged(tmp_path):
    """A learner who computes the whole score matrix in numpy passes exercise 05's in-process memory bound (the
    tracker sees no torch tensor of it); the memory window around the large case gives it away (the numpy pass
    grows it by the score matrix and its copies) and the learner is flagged."""
    need_bwrap()
    if not sandbox.Sandbox().cgroups:
        pytest.skip("no writable memory cgroup here (grade as root)")
    import nbformat
    from _nb import submission
    name = "05_efficient_attention"
    nb = tmp_path / "numpy.ipynb"
    nbformat.write(submission(name, {"task5_2_tiled_attention": NUMPY_ATTENTION}), nb)
    g = trusted.grade_notebook(nb, grade.exercise(name), stage=trusted.stage_course_code(tmp_path / "stage"))
    assert g.scores["task5_2_tiled_attention_hidden"][0] > 0, g.reasons      # the in-process bound was fooled
    from autograder.checks.ex05 import cases as c5
    growth = max(g.memory_growth.values())         # the large case's window: every case has one
    assert growth >= c5.LARGE_SCORES, g.memory_growth
    assert any(f.startswith("task5_2_tiled_attention: while the large case ran") for f in g.flags), g.flags


def test_limits_check_their_inputs():
    for name in ("scratch_bytes", "file_bytes", "channel_bytes"):
        with pytest.raises(ValueError, match=name):
            sandbox.Limits(**{name: 1000})


def test_binds_never_include_the_current_folder_or_the_course(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT.parent)
    monkeypatch.setattr(sys, "path", [str(ROOT.parent), str(ROOT), "", *sys.path])
    binds = trusted.python_binds()
    for b in binds:
        assert b not in (ROOT, ROOT.parent) and ROOT.parent not in b.parents or b.is_relative_to(Path(sys.prefix)) \
            or b == Path(os.path.realpath(sys.executable)).parent, f"{b} would show the course to learners"
    assert not any(b in (ROOT, ROOT.parent) for b in binds)


# ----------------------------------------------------------------------------- which entries are learners
def test_collect_skips_unsafe_names_and_anything_holding_a_link(tmp_path):
    ex = grade.Exercise("99_drill", tmp_path / "release" / "99_drill.ipynb", "autograder.checks.ex99")
    subs = tmp_path / "subs"
    subs.mkdir()
    nb = json.dumps({"cells": [], "nbformat": 4, "metadata": {}, "nbformat_minor": 4})
    (subs / "alice.ipynb").write_text(nb)
    (subs / "bob\n.ipynb").write_text(nb)                    # a newline at the end of the id
    (subs / "carol").mkdir()
    (subs / "carol" / "99_drill.ipynb").write_text(nb)
    (subs / "mallory").mkdir()
    (subs / "mallory" / "99_drill").symlink_to(subs / "carol")          # someone else's folder
    (subs / "eve.ipynb").symlink_to(subs / "alice.ipynb")
    found, failed, skipped = grade.collect(subs, ex)
    assert set(found) == {"alice", "carol"} and not failed
    assert set(skipped) == {repr("bob\n.ipynb"), "mallory", "eve.ipynb"}, skipped
    assert "link" in skipped["mallory"] and "link" in skipped["eve.ipynb"]


# ----------------------------------------------------------------------------- hidden messages
@pytest.mark.parametrize("message, redacted", [
    ("flops 12, expected 24.", "flops [hidden], expected [hidden]."),
    ("nbytes 1,024, expected 2,048, from the shapes", "nbytes [hidden], expected [hidden], from the shapes"),
    ("bound 'memory-bound', expected 'compute-bound': below the ridge", "bound 'memory-bound', expected [hidden]: "
     "below the ridge"),
    ("has shape (3, 4), expected (4, 3)", "has shape [hidden], expected [hidden]"),
    ("order [1, 2], expected [2, 1]", "order [hidden], expected [hidden]"),
    ("peak 1.5 GiB, expected 2.25 GiB here", "peak [hidden], expected [hidden] here"),
    ("ratio 0.3, should be 0.5; want = 1e-3", "ratio [hidden], should be [hidden]; want = [hidden]"),
    ("your estimate is 12% above the measured 3141592 bytes", "your estimate is [hidden]% above the measured [hidden]"),
    ("task1_5 with float16 and 8-bit AdamW: count (no threads)", "task1_5 with float16 and 8-bit AdamW: count "
     "(no threads)"),
    ("expected a positive number of GB/s", "expected a positive number of GB/s"),       # no value: unchanged
    ("concatenating the ranks' outputs gives the full layer's output (2 ranks)",          # apostrophes are no quotes
     "concatenating the ranks' outputs gives the full layer's output [hidden]"),
])
def test_hidden_messages_lose_every_value(message, redacted):
    assert trusted.redact(message) == redacted


def test_only_hidden_cells_are_redacted():
    from autograder.checks.common import expected

    class Task:
        def judge(self, case, value):
            raise AssertionError(f"got {value}, expected {expected(case)}: count every byte")
    graded = Graded()
    plan = {"task1_1_x_visible": (Task(), [7]), "task1_1_x_hidden": (Task(), [7])}
    results = {"task1_1_x_visible/0": {"value": 3}, "task1_1_x_hidden/0": {"value": 3}}
    trusted._judge_cases(plan, {"task1_1_x_visible": 1, "task1_1_x_hidden": 2}, results, graded)
    assert graded.reasons["task1_1_x_visible"] == "got 3, expected 7: count every byte"
    assert graded.reasons["task1_1_x_hidden"] == "got [hidden], expected [hidden]: count every byte"
    assert graded.scores == {"task1_1_x_visible": (0.0, 1), "task1_1_x_hidden": (0.0, 2)}


def test_the_notebooks_check_reveals_visible_and_hides_hidden_expected_values():
    from autograder.checks.common import Task, check, expected

    def judge(case, got):
        raise AssertionError(f"nbytes {got}, expected {expected(case * 4)}")
    task = Task(id="task1_1_x", names=(), cases=lambda hidden, r: [r.randint(10, 99)], run=lambda case, **names: 0,
                judge=judge)
    for hidden, want in ((False, r"nbytes 0, expected \d+$"), (True, r"nbytes 0, expected \[hidden\]$")):
        with pytest.raises(AssertionError, match=want):
            check(task, hidden=hidden)


def test_every_judge_marks_the_expected_values_it_states():
    """A value a judge writes right after "expected" is marked with expected(...), so that hidden feedback can
    hide it, unless it is derived from the case's own inputs (a shape, a count the learner was given)."""
    import re
    allowed = ("case[", "len(case", "tuple(w.shape)", "tuple(shape)", "list(KEYS)")
    unmarked = []
    for judge in sorted((ROOT / "autograder" / "checks").glob("ex*/judge.py")):
        for m in re.finditer(r"expected (?:exactly )?\{(?!expected\()([^}]*)\}", judge.read_text()):
            if not m[1].startswith(allowed):
                unmarked.append(f"{judge.parent.name}: expected {{{m[1]}}}")
    assert not unmarked, f"mark these with expected(...) (autograder/checks/common.py): {unmarked}"
