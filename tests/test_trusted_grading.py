"""The grading pipeline against a hostile class: an adversarial corpus of submissions of the
drill exercise (autograder/checks/ex99/) graded in one class run beside an honest and a
blank learner. Every attack scores what it earned (0 for the hostile ones), the honest
learner keeps full marks, the run ends within its limits, and the submissions, the course
code and the other learners' records are untouched."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autograder import grade, sandbox, trusted

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = grade.DRILL
A = "99_drill"
TIMEOUT = 20            # seconds per learner in the corpus run (an honest one takes 1-2 s)
pytestmark = pytest.mark.slow

STORAGE = '''def storage_bytes(shape, dtype):
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=getattr(torch, dtype)).element_size()'''
SOFTMAX = '''def row_softmax(x):
    z = x - x.max(dim=-1, keepdim=True).values
    return z.exp() / z.exp().sum(dim=-1, keepdim=True)'''
FULL = 6.0
# learners who do the work where the grader's in-process recorders cannot see it (another thread, another process)
THREADED_STORAGE = STORAGE.replace("def storage_bytes", "def _sb") + """
import threading
def storage_bytes(s, d):
    out = []
    t = threading.Thread(target=lambda: out.append(_sb(s, d)))
    t.start()
    t.join()
    return out[0]"""
THREADED_SOFTMAX = SOFTMAX.replace("def row_softmax", "def _rs") + """
import threading
def row_softmax(x):
    out = []
    t = threading.Thread(target=lambda: out.append(_rs(x)))
    t.start()
    t.join()
    return out[0]"""
WAITING_THREAD = """import threading, queue
jobs, done = queue.Queue(), queue.Queue()
def worker():
    while True:
        f, a = jobs.get()
        done.put(f(*a))
threading.Thread(target=worker, daemon=True).start()
def ask(f, *a):
    jobs.put((f, a))
    return done.get()"""
RAW_THREAD = """import _thread, queue
def in_raw_thread(f, *a):
    q = queue.Queue()
    _thread.start_new_thread(lambda: q.put(f(*a)), ())
    return q.get()"""
FORKED = """import os, pickle
def in_child(f, *a):
    r, w = os.pipe()
    if os.fork() == 0:
        os.write(w, pickle.dumps(f(*a)))
        os._exit(0)
    os.close(w)
    data = b''
    while chunk := os.read(r, 65536):
        data += chunk
    return pickle.loads(data)"""
# writes a reply of its own for the probe it is given, through the harness's frames, then answers honestly
FORGED_REPLY = """import sys, json
def forge(value):
    f = sys._getframe()
    while f is not None and 'reply' not in f.f_locals:
        f = f.f_back
    if f is not None:
        f.f_locals['reply'](json.dumps({'probe': f.f_locals['probe']['probe'], 'value': value}))"""
# looks everywhere it can read for the trusted side of the checks (a judge, a reference, the case generator)
FIND_TRUSTED = """import glob, os, sys, zipfile
found = []
roots = {p for p in sys.path if p} | {'/', '/usr', '/opt', '/tmp', '/home', '/root', '/srv', '/autograder', '/work',
                                       '/mnt', '/var', os.getcwd()}
try:                                   # every folder bound into this process's view
    roots |= {line.split()[4] for line in open('/proc/self/mountinfo')}
except OSError:
    pass
for root in sorted(roots):
    for depth in range(5):
        pattern = os.path.join(root, *['*'] * depth)
        found += glob.glob(os.path.join(pattern, 'checks', 'ex*', '*.py'))
        for w in glob.glob(os.path.join(pattern, '*.whl')) + glob.glob(os.path.join(pattern, '*.zip')):
            try:
                if any('autograder/checks/ex' in n for n in zipfile.ZipFile(w).namelist()):
                    found.append(w)
            except Exception:
                pass
found = [p for p in found if os.path.basename(p) in ('judge.py', 'refs.py', 'cases.py') or p.endswith(('.whl', '.zip'))]
raise RuntimeError(f'TRUSTED SIDE FOUND: {sorted(set(found))[:5]}')"""
# rewrites the grader's judge where another process's folder shows it (/proc/<pid>/cwd, /proc/<pid>/root)
REWRITE_THROUGH_PROC = """import os
for pid in os.listdir('/proc'):
    for link in ('cwd', 'root'):
        try:
            base = os.readlink(f'/proc/{pid}/{link}')
        except OSError:
            continue
        for rel in ('autograder/checks/ex99/judge.py', 'source/autograder/checks/ex99/judge.py'):
            try:
                with open(os.path.join(base, rel), 'a') as f:
                    f.write('\\ndef bytes_judge(case, got):\\n    return None\\n')
            except OSError:
                pass"""


def drill_course(tmp: Path) -> grade.Course:
    return grade.drill_course(tmp)


def make(course, storage: str | None = STORAGE, softmax: str | None = SOFTMAX, extra_before: str | None = None,
         edit=None) -> dict:
    """The release notebook with its two solution cells filled (None: left as released)."""
    nb = json.loads((course.release / A / f"{A}.ipynb").read_text())
    for c in nb["cells"]:
        gid = c["metadata"].get("nbgrader", {}).get("grade_id")
        if gid == "task99_1_storage_bytes" and storage is not None:
            c["source"] = storage
        if gid == "task99_2_row_softmax" and softmax is not None:
            c["source"] = softmax
    if extra_before is not None:   # a cell the learner added before the first solution
        i = next(i for i, c in enumerate(nb["cells"]) if c["metadata"].get("nbgrader", {}).get("solution"))
        nb["cells"].insert(i, {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [],
                               "source": extra_before})
    if edit:
        edit(nb)
    return nb


def _hashes(*folders: Path) -> dict[str, str]:
    out = {}
    for d in folders:
        for f in sorted(d.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                out[str(f)] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


# ----------------------------------------------------------------------------- the corpus
def corpus(course, targets: dict[str, str]) -> dict[str, tuple[dict | str, float]]:
    """learner id -> (notebook or raw text, points it must score)."""
    t = targets

    def edit_points(nb):
        for c in nb["cells"]:
            m = c["metadata"].get("nbgrader", {})
            if m.get("grade"):
                m["points"] = 100

    def edit_locked(nb):   # a learner who "fixed" the locked setup cell and a test cell to pass
        for c in nb["cells"]:
            m = c["metadata"].get("nbgrader", {})
            if m.get("grade_id") == "setup":
                c["source"] = "import torch\ndef check(*a, **k):\n    return 1\nclass ex99:\n    TASKS = {}"
            if m.get("grade"):
                c["source"] = "print('passed')"

    def delete_locked(nb):  # deleted the setup and test cells; the solutions are right
        nb["cells"] = [c for c in nb["cells"] if c["metadata"].get("nbgrader", {}).get("solution")
                       or c["cell_type"] == "markdown"]

    def duplicate_ids(nb):  # a second, wrong copy of a solution cell, and duplicated test cells
        cells = nb["cells"]
        i = next(i for i, c in enumerate(cells) if c["metadata"].get("nbgrader", {}).get("grade_id")
                 == "task99_1_storage_bytes")
        wrong = copy.deepcopy(cells[i])
        wrong["source"] = "def storage_bytes(shape, dtype):\n    return 0"
        cells.insert(i + 1, wrong)
        cells.extend(copy.deepcopy([c for c in cells if c["metadata"].get("nbgrader", {}).get("grade")]))

    def colab_v5(nb):       # nbformat 4.5 with cell ids and Colab metadata: must grade normally
        nb["nbformat_minor"] = 5
        nb["metadata"]["colab"] = {"provenance": [], "name": "99_drill.ipynb"}
        nb["metadata"]["accelerator"] = "GPU"
        for i, c in enumerate(nb["cells"]):
            c["id"] = f"cell-{i}"
            c["metadata"]["id"] = f"colab{i}"

    return {
        "honest": (make(course), FULL),
        "blank": (make(course, None, None), 0),
        # -- replacing or fooling the checks
        "patch_checks": (make(course, "from autograder.checks import ex99, common\n"
                                      "for _t in list(ex99.TASKS):\n"
                                      "    ex99.TASKS[_t] = ex99.TASKS[_t].__class__(_t, (), lambda h, r: [{}], "
                                      "lambda c: 0, lambda c, g: None)\n"
                                      "common.check = lambda *a, **k: 1\n" + "def storage_bytes(s, d):\n    return 0",
                             "def row_softmax(x):\n    return x"), 0),
        "rebind_ex99": (make(course, "class ex99:\n    TASKS = {}\ndef check(*a, **k):\n    return 1\n"
                                     "def storage_bytes(s, d):\n    return -1", "row_softmax = None"), 0),
        "always_equal_int": (make(course, "class Eq(int):\n    def __eq__(self, o):\n        return True\n"
                                          "    __hash__ = int.__hash__\n"
                                          "def storage_bytes(s, d):\n    return Eq(1)", None), 0),
        "always_equal_tensor": (make(course, None, "class Eq(list):\n    def __eq__(self, o):\n        return True\n"
                                                   "class T(torch.Tensor):\n    def tolist(self):\n"
                                                   "        return Eq([0.0])\n"
                                                   "def row_softmax(x):\n    return torch.zeros(1).as_subclass(T)"), 0),
        "patch_torch": (make(course, "torch.Tensor.__eq__ = lambda a, b: True\ntorch.allclose = lambda *a, **k: True\n"
                                     "torch.isclose = lambda a, b, **k: torch.ones_like(a, dtype=torch.bool)\n"
                                     "def storage_bytes(s, d):\n    return 0", "def row_softmax(x):\n    return x"), 0),
        "input_transformer": (make(course, extra_before="get_ipython().input_transformers_post.append("
                                                         "lambda lines: ['pass\\n'])"), 0),
        "ast_transformer": (make(course, extra_before="import ast\nclass Nop(ast.NodeTransformer):\n"
                                                       "    def visit_Module(self, node):\n"
                                                       "        return ast.Module(body=[ast.Pass()], type_ignores=[])\n"
                                                       "get_ipython().ast_transformers.append(Nop())"), 0),
        "wrapped_run_cell": (make(course, extra_before="ip = get_ipython()\n"
                                                        "ip.run_cell = lambda *a, **k: None\n"
                                                        "ip.run_cell_async = None"), 0),
        "fake_results": (make(course, "import glob, json\nfor i in range(50):\n"
                                      "    for g in ('task99_1_storage_bytes_visible', 'task99_1_storage_bytes_hidden',"
                                      " 'task99_2_row_softmax_visible', 'task99_2_row_softmax_hidden'):\n"
                                      "        open('results.jsonl', 'a').write(json.dumps({'key': f'{g}/{i}', "
                                      "'value': 0}) + '\\n')\n"
                                      "def storage_bytes(s, d):\n    return 0",
                             "def row_softmax(x):\n    return x"), 0),
        "calls_references": (make(course, "from autograder.checks.ex99.refs import reference_bytes\n"
                                          "def storage_bytes(s, d):\n"
                                          "    return reference_bytes({'shape': list(s), 'dtype': str(d)[6:]})",
                                  None), 0),
        # -- reading what it must not read
        "read_solutions": (make(course, f"src = open({t['solution']!r}).read()\n"
                                        f"exec(src)   # would define correct functions if the file could be read",
                                "db = open({!r}, 'rb').read()".format(t["gradebook"])), 0),
        "network": (make(course, "import socket\ns = socket.create_connection(('127.0.0.1', {}), timeout=2)\n"
                                 "def storage_bytes(s, d):\n    return 0".format(t["port"]), None), 0),
        # -- writing what it must not write
        "vandal": (make(course, "import os\n"
                                + "".join(f"try:\n    open({p!r}, 'w').write('owned')\nexcept OSError:\n    pass\n"
                                          for p in (t["other_submission"], t["gradebook"], t["csv"], t["sentinel"]))
                                + f"try:\n    open({t['checks']!r}, 'a').write('\\nTASKS = {{}}\\n')\n"
                                  f"except OSError:\n    pass\n"
                                + "def storage_bytes(s, d):\n    return 0", None), 0),
        # -- ending or hanging the grader
        "system_exit": (make(course, "def storage_bytes(s, d):\n    raise SystemExit(0)",
                             "def row_softmax(x):\n    raise KeyboardInterrupt"), 0),
        "os_exit_in_cell": (make(course, "import os\nos._exit(0)"), 0),
        "os_exit_in_test": (make(course, "import os\ndef storage_bytes(s, d):\n    os._exit(0)", None), 0),
        "kills_grader": (make(course, "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)", None), 0),
        "endless": (make(course, "while True:\n    pass"), 0),
        "detached": (make(course, "import subprocess, sys\n"
                                  "subprocess.Popen([sys.executable, '-c', "
                                  "'import time; time.sleep(600)  # memlab-orphan'], start_new_session=True)\n"
                                  "import os, time\nif os.fork() == 0:\n    os.setsid()\n"
                                  "    time.sleep(600)\n"
                                  "time.sleep(600)   # waits for its timeout idle: 'endless' burns the CPU"), 0),
        "fork_bomb": (make(course, "import os, time\nkids = []\nfor _ in range(600):\n    try:\n"
                                   "        pid = os.fork()\n    except OSError:\n        break\n"
                                   "    if pid == 0:\n        time.sleep(20)\n        os._exit(0)\n"
                                   "    kids.append(pid)\n"
                                   "def storage_bytes(s, d):\n    return 0", None), 0),
        "memory_bomb": (make(course, "hog = []\nfor _ in range(64):\n    hog.append(bytearray(2**28))\n"
                                     "def storage_bytes(s, d):\n    return 0", None), 0),
        # -- flooding or forging what comes back: only the flooder's own row may change
        "forged_channel": (make(course, "import os\n"
                                        "deep = b'{\"key\": \"task99_1_storage_bytes_visible/0\", \"value\": ' "
                                        "+ b'[' * 200000 + b']' * 200000 + b'}\\n'\n"
                                        "huge = b'{\"key\": \"task99_1_storage_bytes_hidden/0\", \"value\": ' "
                                        "+ b'9' * 6000 + b'}\\n'\n"
                                        "for fd in os.listdir('/proc/self/fd'):\n"
                                        "    try:\n"
                                        "        if os.readlink(f'/proc/self/fd/{fd}').startswith('pipe:'):\n"
                                        "            os.write(int(fd), deep + huge + b'not json\\n')\n"
                                        "    except OSError:\n"
                                        "        pass\n"
                                        "def storage_bytes(s, d):\n    return 0", None), 0),
        "stderr_flood": (make(course, extra_before="import sys\nfor _ in range(200):\n"
                                                    "    sys.stderr.write('x' * 2**20)\n"), FULL),
        "scratch_flood": (make(course, extra_before="with open('flood', 'wb') as f:\n"
                                                     "    for _ in range(2048):\n"
                                                     "        f.write(b'x' * 2**20)\n"), FULL),
        # -- honest work in odd shapes: must keep every point
        "noisy_but_right": (make(course, "import sys, warnings, logging\nwarnings.warn('a warning')\n"
                                         "print('to stderr', file=sys.stderr)\nlogging.getLogger().error('logged')\n"
                                         "from tqdm.auto import tqdm\nfor _ in tqdm(range(3)):\n    pass\n" + STORAGE,
                                 "import warnings\n"
                                 + SOFTMAX.replace("    z =", "    warnings.warn('noisy')\n    z =")),
                             FULL),
        "edited_locked_cells": (make(course, edit=edit_locked), FULL),
        "deleted_locked_cells": (make(course, edit=delete_locked), FULL),
        "changed_points": (make(course, "def storage_bytes(s, d):\n    return 0", edit=edit_points), 3),
        "duplicate_ids": (make(course, edit=duplicate_ids), FULL),
        "colab_nbformat5": (make(course, edit=colab_v5), FULL),
        "half_done": (make(course, softmax=None), 3),
        "syntax_error": (make(course, "def storage_bytes(shape, dtype):\n    n = (1\n    return n"), 3),
        "malformed_json": ("{ \"cells\": [ this is not json", None),
        # -- escaping the in-process recorders: a thread or a process does the work
        "thread_does_the_work": (make(course, THREADED_STORAGE, THREADED_SOFTMAX), 0),
        "waiting_thread": (make(course, WAITING_THREAD + "\n" + STORAGE.replace("def storage_bytes", "def _sb")
                                + "\ndef storage_bytes(s, d):\n    return ask(_sb, s, d)",
                                SOFTMAX.replace("def row_softmax", "def _rs") + "\ndef row_softmax(x):\n"
                                "    return ask(_rs, x)"), 0),
        "raw_thread": (make(course, RAW_THREAD + "\n" + STORAGE.replace("def storage_bytes", "def _sb")
                            + "\ndef storage_bytes(s, d):\n    return in_raw_thread(_sb, s, d)",
                            SOFTMAX.replace("def row_softmax", "def _rs")
                            + "\ndef row_softmax(x):\n    return in_raw_thread(_rs, x)"), 0),
        "process_does_the_work": (make(course, FORKED + "\n" + STORAGE.replace("def storage_bytes", "def _sb")
                                       + "\ndef storage_bytes(s, d):\n    return in_child(_sb, s, d)",
                                       SOFTMAX.replace("def row_softmax", "def _rs")
                                       + "\ndef row_softmax(x):\n    return torch.tensor(in_child("
                                       "lambda x: _rs(x).tolist(), x))"), 0),
        "left_a_process": (make(course, extra_before="import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', "
                                                      "'import time; time.sleep(60)'])"), 0),
        # -- the harness's frames, its channel and the trusted side
        "forged_reply": (make(course, FORGED_REPLY + "\n" + STORAGE.replace("def storage_bytes", "def _sb")
                              + "\ndef storage_bytes(s, d):\n    forge(0)\n    return _sb(s, d)",
                              SOFTMAX.replace("def row_softmax", "def _rs")
                              + "\ndef row_softmax(x):\n    forge([[0.0]])\n    return _rs(x)"), 0),
        "looks_for_references": (make(course, extra_before=FIND_TRUSTED), FULL),
        "rewrites_judge_through_proc": (make(course, REWRITE_THROUGH_PROC + "\ndef storage_bytes(s, d):\n"
                                                                            "    return 0", None), 0),
    }


def need_bwrap(why: str) -> None:
    """Skip without bubblewrap on a contributor's machine; fail in CI (CI=true), which installs it (.ci/run)."""
    if sandbox.Sandbox().bwrap:
        return
    msg = f"bubblewrap is not installed (apt-get install bubblewrap): {why}"
    if os.environ.get("CI"):
        pytest.fail(f"{msg}; CI must test the sandboxed path")
    pytest.skip(msg)


def run_corpus(tmp: Path) -> dict:
    """Grade the whole corpus in one class run, two learners at a time."""
    course = drill_course(tmp / "course")
    subs = tmp / "submissions"
    subs.mkdir()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    sentinel = tmp / "sentinel.txt"
    sentinel.write_text("untouched")
    targets = {"solution": str(FIXTURE / A / f"{A}.ipynb"), "gradebook": str(course.db),
               "csv": str(course.root / "grades.csv"), "other_submission": str(subs / "honest.ipynb"),
               "sentinel": str(sentinel), "checks": str(ROOT / "autograder" / "checks" / "ex99" / "__init__.py"),
               "port": listener.getsockname()[1]}
    entries = corpus(course, targets)
    for sid, (nb, _) in entries.items():
        (subs / f"{sid}.ipynb").write_text(nb if isinstance(nb, str) else json.dumps(nb))
    # entries that are no learner: a name ending in a newline, a folder holding a link to another's notebook
    (subs / "newline\n.ipynb").write_text(json.dumps(make(course)))
    (subs / "linker").mkdir()
    (subs / "linker" / f"{A}.ipynb").symlink_to(subs / "honest.ipynb")
    before = _hashes(subs, ROOT / "autograder", ROOT / "memlab", FIXTURE)
    t0 = time.monotonic()
    log = []
    res = grade.grade_class(subs, A, timeout=TIMEOUT, course=course, jobs=2, memory_gb=2, log=log.append)
    seconds = time.monotonic() - t0
    listener.close()
    return {"res": res, "entries": entries, "course": course, "subs": subs, "before": before, "seconds": seconds,
           "sentinel": sentinel, "log": log}


def every_submission_scores_what_it_earned(corpus_run):
    res, entries = corpus_run["res"], corpus_run["entries"]
    wrong = {}
    for sid, (_, want) in entries.items():
        if want is None:
            continue
        got = sum(s for s, _ in res.graded.get(sid, {}).values()) if sid in res.graded else None
        if got != want:
            wrong[sid] = (got, want, res.failed.get(sid) or res.notes.get(sid))
    assert not wrong, f"learner: (scored, should score, note): {wrong}\nlog: {corpus_run['log']}"
    assert "malformed_json" in res.failed and "not a readable notebook" in res.failed["malformed_json"]
    assert "unreadable" in res.notes.get("forged_channel", ""), res.notes.get("forged_channel")
    assert set(res.skipped) >= {repr("newline\n.ipynb"), "linker"}, res.skipped
    assert "newline" not in res.graded and "linker" not in res.graded
    for sid in ("endless", "detached"):
        assert "timed out" in res.notes.get(sid, ""), (sid, res.notes.get(sid))
    for sid in ("thread_does_the_work", "waiting_thread", "raw_thread"):
        why = " ".join(res.reasons.get(sid, {}).values())
        assert "thread" in why and "calls your function" in why, (sid, res.reasons.get(sid))
    for sid in ("process_does_the_work", "left_a_process"):
        assert "process" in " ".join(res.reasons.get(sid, {}).values()), (sid, res.reasons.get(sid))


def the_run_ends_within_its_limits(corpus_run):
    n = len(corpus_run["entries"])
    # two learners at a time, each capped at TIMEOUT seconds: the whole run is far below n * TIMEOUT
    assert corpus_run["seconds"] < n * TIMEOUT / 2 + 120, corpus_run["seconds"]
    orphans = subprocess.run(["pgrep", "-f", "memlab-orphan"], capture_output=True, text=True).stdout.split()
    assert not orphans, f"processes a learner started outlived its grading: {orphans}"
    # it says what it is doing, phase by phase, from the first seconds to the export
    phases = ["learner notebook(s) found", "grading ", "writing each learner's feedback", "exporting "]
    at = [next((i for i, line in enumerate(corpus_run["log"]) if p in line), None) for p in phases]
    assert None not in at and at == sorted(at), f"phase lines {phases} in order, got {corpus_run['log'][:4]}"


def nothing_outside_the_attackers_rows_changed(corpus_run):
    after = _hashes(corpus_run["subs"], ROOT / "autograder", ROOT / "memlab", FIXTURE)
    changed = [k for k in corpus_run["before"] if after.get(k) != corpus_run["before"][k]]
    assert not changed, f"a learner changed files it must not touch: {changed}"
    assert corpus_run["sentinel"].read_text() == "untouched"
    course = corpus_run["course"]
    rows = (course.root / "grades.csv").read_text().splitlines()
    assert rows[0].startswith("student,assignment,task99_1_storage_bytes,task99_2_row_softmax"), rows[0]
    by_sid = {r.split(",")[0]: r for r in rows[1:]}
    assert len(by_sid) == len(rows) - 1, "one row per learner and assignment"
    assert by_sid["honest"] == "honest,99_drill,3,3,6,6,", by_sid["honest"]      # the last column: no flags
    assert rows[0].endswith(",score,max_score,flags"), rows[0]
    for sid, what in (("forged_channel", "uses file descriptors directly"), ("calls_references", "grader's modules"),
                      ("patch_checks", "grader's modules"), ("forged_reply", "did not ask for"),
                      ("forged_reply", "call stack"), ("rewrites_judge_through_proc", "other processes")):
        assert what in by_sid[sid], (sid, by_sid[sid])
    flagged = {sid for sid, r in by_sid.items() if not r.endswith(",")}
    assert not flagged & {"honest", "noisy_but_right", "edited_locked_cells", "colab_nbformat5"}, flagged
    assert "malformed_json" not in by_sid
    html = (course.root / "autograder" / "feedback" / "honest" / A / f"{A}.html").read_text()
    assert "6.0 / 6.0" in html or "Score: 6" in html, "honest learner's feedback shows full marks"


def no_trusted_file_is_within_reach(corpus_run):
    """The learner who searched sys.path and the whole file system it can see for a judge, a reference or a case
    generator (loose or in a wheel) found none."""
    course = corpus_run["course"]
    nb = json.loads((course.root / "autograder" / "autograded" / "looks_for_references" / A / f"{A}.ipynb")
                    .read_text())
    text = json.dumps(nb)
    assert "TRUSTED SIDE FOUND: []" in text, text[text.find("TRUSTED SIDE"):][:600]


def feedback_teaches_without_leaking_hidden_tests(corpus_run):
    course = corpus_run["course"]
    why = corpus_run["res"].reasons["syntax_error"]
    for gid in ("task99_1_storage_bytes_visible", "task99_1_storage_bytes_hidden"):   # the error first, once, in
        assert why[gid].startswith("your cell task99_1_storage_bytes raised SyntaxError"), why  # the task's rows
        assert "line 2 of the cell" in why[gid] and "your code raised your" not in why[gid], why
    page = (course.root / "autograder" / "feedback" / "syntax_error" / A / f"{A}.html").read_text()
    assert ">task99_1_storage_bytes_visible</a>" in page and ">Test cell</a>" not in page, "tasks named in summary"
    nb = json.loads((course.root / "autograder" / "autograded" / "half_done" / A / f"{A}.ipynb").read_text())
    text = json.dumps(nb)
    assert "hidden=True" not in text, "hidden test source must not reach the feedback"
    assert "not done yet" in text
    assert str(ROOT) not in text, "the grader's file paths must not reach the feedback"


def test_the_hostile_corpus(tmp_path):
    """One class run of the corpus, then every property asked of it; all are checked and all failures reported.
    (One test, not four on a shared fixture: a class run is costly, and a test is the one unit pytest-xdist never
    splits across workers.)"""
    need_bwrap("the corpus needs the sandbox, and without it a hostile submission could damage this machine")
    run = run_corpus(tmp_path)
    failures = []
    for check in (every_submission_scores_what_it_earned, the_run_ends_within_its_limits,
                  nothing_outside_the_attackers_rows_changed, feedback_teaches_without_leaking_hidden_tests,
                  no_trusted_file_is_within_reach):
        try:
            check(run)
        except AssertionError as e:
            failures.append(f"{check.__name__}: {e}")
    assert not failures, "\n\n".join(failures)


def test_sandbox_sees_no_course_files_and_no_network(tmp_path):
    need_bwrap("the fallback is tested in test_fallback_warns")
    box = sandbox.Sandbox()
    probe = ("import os, socket, json\n"
             f"seen = {{p: os.path.exists(p) for p in "
             f"{[str(ROOT / 'solutions'), str(ROOT / 'autograder'), __file__]!r}}}\n"
             "seen['shadow'] = os.access('/etc/shadow', os.R_OK)\n"
             "try:\n    socket.create_connection(('127.0.0.1', 22), timeout=1); seen['net'] = True\n"
             "except OSError:\n    seen['net'] = False\n"
             "seen['uid'] = os.getuid(); print(json.dumps(seen))")
    out = box.run([sys.executable, "-c", probe], tmp_path, trusted.python_binds(), {}, sandbox.Limits(wall_s=30))
    seen = json.loads(out.stdout.read_text())
    assert seen == {str(ROOT / "solutions"): False, str(ROOT / "autograder"): False, __file__: False,
                    "shadow": False, "net": False, "uid": 65534}, seen


def test_without_a_sandbox_a_class_is_refused_and_a_check_says_it_is_unprotected(monkeypatch, tmp_path, capsys):
    """No line of protection (MEMLAB_SANDBOX=none stands in for a machine with neither bubblewrap nor root): a class
    run refuses in one line naming the fix, before grading anyone; a learner's own check still runs, saying so."""
    monkeypatch.setenv("MEMLAB_SANDBOX", "none")
    box = sandbox.Sandbox()
    assert box.line == "none" and "filesystem isolation" in box.warning()
    course = drill_course(tmp_path / "course")
    subs = tmp_path / "subs"
    subs.mkdir()
    (subs / "a.ipynb").write_text(json.dumps(make(course)))
    with pytest.raises(SystemExit) as refused:
        grade.grade_class(subs, A, course=course, log=lambda s: None)
    assert "no sandbox can run here" in str(refused.value) and "bubblewrap" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert not (course.root / "grades.csv").exists()
    nb = tmp_path / f"{A}.ipynb"
    nb.write_text(json.dumps(make(course)))
    g = grade.check_notebook(nb, A, timeout=60, release=course.release)
    assert g.total == (FULL, FULL), (g.scores, g.reasons, g.note)
    assert "unprotected" in capsys.readouterr().err


def test_the_separate_user_line_refuses_while_a_learner_could_read_the_checks(monkeypatch, tmp_path):
    """The second line (a user of its own per learner, where bubblewrap cannot run) checks before grading that the
    learner's user can read none of the trusted checks, the solutions, the tests or the class, and that it can read
    Python: here the course checkout is world-readable (or Python lives under root's home), so it refuses in one
    line naming the path and the fix."""
    if os.geteuid() != 0:
        pytest.skip("the separate-user line needs root")
    monkeypatch.setenv("MEMLAB_SANDBOX", "user")
    course = drill_course(tmp_path / "course")
    subs = tmp_path / "subs"
    subs.mkdir()
    (subs / "a.ipynb").write_text(json.dumps(make(course)))
    with pytest.raises(SystemExit) as refused:
        grade.grade_class(subs, A, course=course, log=lambda s: None)
    msg = str(refused.value)
    assert "\n" not in msg and "uid" in msg and ("chmod" in msg or "cannot read" in msg), msg


def test_a_copy_of_the_grader_installed_into_site_packages_is_out_of_reach(tmp_path, monkeypatch):
    """A non-editable install (pip install ., the Colab route) puts the whole grader, trusted side included, into
    site-packages, which the sandbox must bind for Python to run: bubblewrap shows that folder empty, so a learner
    who searches every folder it can see, sys.path and every mount point included, finds no judge, reference or
    case generator; and the separate-user line refuses to grade while such a copy is readable."""
    need_bwrap("the bubblewrap line masks the installed copy")
    site = tmp_path / "env" / "lib" / "python3.x" / "site-packages"          # laid out as pip lays it out
    shutil.copytree(ROOT / "autograder", site / "autograder", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "gpu_memory_lab-0.1.0.dist-info").mkdir()
    monkeypatch.syspath_prepend(str(site))
    assert trusted.installed_graders() == [site / "autograder"]
    course = drill_course(tmp_path / "course")
    nb = tmp_path / f"{A}.ipynb"
    nb.write_text(json.dumps(make(course, extra_before=FIND_TRUSTED)))
    g = grade.check_notebook(nb, A, timeout=120, release=course.release)
    assert g.total == (FULL, FULL), (g.scores, g.reasons, g.note)
    (found,) = [e for e in g.cell_errors if "TRUSTED SIDE FOUND" in e]
    assert "TRUSTED SIDE FOUND: [] " in found, found
    if os.geteuid() == 0:                         # the same copy where every user can read it, as in an image
        import tempfile
        with tempfile.TemporaryDirectory() as shared:
            os.chmod(shared, 0o755)
            shutil.copytree(site, Path(shared) / "site-packages")
            for d, _, files in os.walk(shared):
                os.chmod(d, 0o755)
            with pytest.raises(SystemExit, match="can read .*site-packages/autograder"):
                sandbox.Sandbox(line="user").preflight([Path(shared) / "site-packages" / "autograder"], [])


def test_two_entries_for_one_learner_are_refused(tmp_path):
    """x.ipynb beside x/: neither is graded (which one counts would be a guess); the row names both."""
    course = drill_course(tmp_path / "course")
    subs = tmp_path / "subs"
    (subs / "zed").mkdir(parents=True)
    (subs / "zed.ipynb").write_text(json.dumps(make(course)))
    (subs / "zed" / f"{A}.ipynb").write_text(json.dumps(make(course, None, None)))
    ex = grade.exercise(A, course.release)
    found, failed, skipped = grade.collect(subs, ex)
    assert "zed" not in found and "zed.ipynb" in failed["zed"] and "zed/" in failed["zed"], failed


def test_jobs_give_the_same_scores_as_one_job(tmp_path):
    course = drill_course(tmp_path / "course")
    subs = tmp_path / "subs"
    subs.mkdir()
    for sid, nb in {"a": make(course), "b": make(course, softmax=None)}.items():
        (subs / f"{sid}.ipynb").write_text(json.dumps(nb))
    one = grade.grade_class(subs, A, timeout=60, course=course, jobs=1, log=lambda s: None).graded
    two = grade.grade_class(subs, A, timeout=60, course=course, jobs=2, log=lambda s: None).graded
    assert one == two and sum(s for s, _ in one["a"].values()) == FULL


def test_class_refuses_an_empty_folder_and_an_unknown_assignment(tmp_path):
    course = drill_course(tmp_path / "course")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no submissions"):
        grade.grade_class(tmp_path / "empty", A, course=course)
    with pytest.raises(SystemExit, match="unknown assignment"):
        grade.grade_class(tmp_path / "empty", "42_nothing", course=course)


SNOOP = '''import glob, os, sys
found = [sys.stdin.read(), " ".join(sys.argv)]
for path in glob.glob("/tmp/**", recursive=True) + glob.glob("/proc/self/fd/*"):
    try:
        real = os.path.realpath(path)
        found.append(path + ":" + (open(real, errors="replace").read(20000) if os.path.isfile(real) else real))
    except Exception:
        found.append(path)
raise RuntimeError("FOUND " + " | ".join(found))
'''


def test_no_file_or_stream_in_the_sandbox_holds_the_job(tmp_path):
    """The job (the notebook's code and every hidden case) reaches the harness on stdin, read to its end before any
    learner code runs: a cell that reads stdin, argv, every file under /tmp (where the job folder is) and every
    open descriptor that is a file finds no hidden case, and the learner is still graded in full."""
    course = drill_course(tmp_path / "course")
    nb = tmp_path / f"{A}.ipynb"
    nb.write_text(json.dumps(make(course, extra_before=SNOOP)))
    g = grade.check_notebook(nb, A, timeout=60, release=course.release)
    assert g.total == (FULL, FULL), (g.scores, g.reasons, g.note)
    (err,) = [e for e in g.cell_errors if "FOUND" in e]
    assert "probes" not in err and "_hidden" not in err and "stdout.txt" in err, err
