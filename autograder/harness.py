"""The learner's side of trusted grading: runs INSIDE the sandbox, never trusted.

    python -m autograder.harness        (started by the grader, autograder/trusted.py)

A conversation with the grader, one JSON line at a time: requests arrive on the pipe in MEMLAB_REQUEST_FD, replies
leave on the pipe in MEMLAB_REPLY_FD (both taken, and their variables removed, before any learner code runs).

1. The job: the exercise's learner-side check module and the notebook code to run (cells in order). No case, hidden
   or visible, is in it: the grader keeps every case until it asks for one.
2. The harness imports the check module, starts an IPython shell (magics work; no history thread), installs its
   guard, replies {"setup": true} and waits for {"go": true}: the grader counts this process's threads now, before
   any learner code, from outside.
3. It runs the notebook's code (an error in one cell is replied as {"cell": i, "where": ..., "error": ...} and the
   next cell runs), then replies {"ready": true}.
4. Then, one at a time, the grader sends a probe {"probe": NONCE, "task": ..., "case": ...}; the harness calls the
   task's `run(case, **learner_names)` and replies {"probe": NONCE, "value": plain data} or {"probe": NONCE,
   "error": text}. The next probe comes only after this reply, so at any moment this process holds at most the case
   it is working on. {"done": true} ends the conversation.

Nothing here decides a score, and nothing here is believed: the grader judges every value against its own
reference, flags a reply it did not ask for, measures each probe's memory from outside (the sandbox's cgroup), and
counts threads and processes from outside before and after each probe, during which it also freezes their
creation. The guard below only turns a thread or process started during a probe into a clear error for an honest
learner (Python's audit hooks and thread start); the freeze outside is what enforces it.
"""

from __future__ import annotations

import _thread
import importlib
import json
import os
import re
import signal
import sys
import threading
import traceback

THREADS_MESSAGE = ("started a thread while the check ran: the grader measures the work done in the thread that calls "
                   "your function, so do all of it there (no threads, no processes, no pools)")
PROCESS_MESSAGE = ("started a process while the check ran: the grader measures the work done in its own process, so "
                   "do all of it there (no subprocess, fork, multiprocessing or pools)")
_PROCESS_EVENTS = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "subprocess.Popen",
                   "os.startfile", "pty.spawn"}
_THREAD_EVENTS = {"_thread.start_new_thread", "_thread.start_joinable_thread"}


def _alarm(signum, frame):
    raise TimeoutError("this check ran past its time limit")


def _learner_error(e: BaseException) -> str:
    """The error as the learner should read it: its type and message, and the line of the learner's cell it came
    from (a syntax error's own line, or the last frame of the traceback that is a notebook cell)."""
    text = re.sub(r" \(<ipython-input-[^>]*>, line \d+\)", "", f"{type(e).__name__}: {e}")
    if isinstance(e, SyntaxError):
        line = e.lineno
    else:
        cells = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename.startswith("<ipython-input-")]
        line = cells[-1] if cells else None
    if line:
        text += f" (line {line} of the cell)"
    return text if len(text) < 2000 else text[:2000] + " ..."


def _install_guard(state: dict) -> None:
    """While state["armed"], refuse to start a thread or a process (the check's own ranks are allowed, from this
    process only, while state["spawns"]): an audit hook (fork, exec, spawn, subprocess; threads on Python 3.12+)
    and the thread-start functions wrapped (every Python)."""
    home = os.getpid()

    def audit(event, args):
        if not state["armed"]:
            return
        if event in _THREAD_EVENTS:
            raise RuntimeError(f"your code {THREADS_MESSAGE}")
        if event in _PROCESS_EVENTS and not (state["spawns"] and event == "os.fork" and os.getpid() == home):
            raise RuntimeError(f"your code {PROCESS_MESSAGE}")

    sys.addaudithook(audit)
    for module in (_thread, threading):
        for name in ("start_new_thread", "_start_new_thread", "start_joinable_thread", "_start_joinable_thread"):
            original = getattr(module, name, None)
            if original is None:
                continue

            def guarded(*args, __original=original, **kwargs):
                if state["armed"]:
                    raise RuntimeError(f"your code {THREADS_MESSAGE}")
                return __original(*args, **kwargs)
            setattr(module, name, guarded)


def _learner_threads() -> int:
    """Python threads other than this one, tqdm's monitor excepted (a library's idle timer, never the learner's
    work): threads started through `threading` and through `_thread` alike (sys._current_frames)."""
    try:
        from tqdm._monitor import TMonitor
    except ImportError:
        TMonitor = None
    monitors = sum(1 for t in threading.enumerate() if TMonitor is not None and type(t) is TMonitor)
    return max(len(sys._current_frames()) - 1 - monitors, 0)


def main() -> int:
    # the two pipes, taken before anything else (their variables are removed)
    request_fd = int(os.environ.pop("MEMLAB_REQUEST_FD"))
    reply_fd = int(os.environ.pop("MEMLAB_REPLY_FD"))
    write, read = os.write, os.read
    pending = bytearray()

    def receive() -> dict | None:
        """The next request line, or None at the end of the pipe."""
        while b"\n" not in pending:
            chunk = read(request_fd, 1 << 16)
            if not chunk:
                return None
            pending.extend(chunk)
        i = pending.index(b"\n")
        line = bytes(pending[:i])
        del pending[:i + 1]
        return json.loads(line)

    def reply(text: str) -> None:
        data = (text + "\n").encode()
        while data:
            data = data[write(reply_fd, data):]

    job = receive()
    devnull = os.open(os.devnull, os.O_RDONLY)      # the learner's code reads an empty stdin, as under Jupyter
    os.dup2(devnull, 0)
    os.close(devnull)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # a file over the size limit fails to grow; no signal kills us
    checks = importlib.import_module(job["module"])
    from autograder.checks.common import encode
    tasks = dict(checks.TASKS)
    # every grader and memlab module's names as imported, put back before each check runs: a notebook that
    # replaces a check's measuring helper (module attribute assignment) changes nothing the check calls
    guarded = [(vars(m), dict(vars(m))) for name, m in list(sys.modules.items())
               if m is not None and name.split(".")[0] in ("autograder", "memlab")]

    import builtins
    shadows = set(vars(builtins))

    def restore_names():
        for namespace, names in guarded:
            for k in [k for k in namespace if k not in names and k in shadows]:
                del namespace[k]        # a new global named like a builtin (len, sum, ...) would shadow it
            namespace.update(names)

    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config
    config = Config()
    config.HistoryManager.enabled = False           # no history database, no history-saving thread
    shell = InteractiveShell.instance(config=config)
    ns = shell.user_ns
    state = {"armed": False, "spawns": False}
    _install_guard(state)
    reply(json.dumps({"setup": True}))
    go = receive()
    if not (isinstance(go, dict) and go.get("go") is True):
        return 1

    for i, cell in enumerate(job["cells"]):
        try:
            r = shell.run_cell(cell["code"], store_history=False, silent=False)
            err = r.error_in_exec or r.error_before_exec
        except BaseException as e:  # SystemExit, KeyboardInterrupt raised outside IPython's own handling
            err = e
        if err is not None:
            reply(json.dumps({"cell": i, "where": cell["where"], "error": _learner_error(err)}))
    case_timeout = max(1, int(job["case_timeout"]))
    del job
    reply(json.dumps({"ready": True}))

    signal.signal(signal.SIGALRM, _alarm)
    while True:
        probe = receive()
        if not isinstance(probe, dict) or probe.get("done"):
            break
        restore_names()
        head = json.dumps({"probe": probe.get("probe")})[:-1]
        task = tasks.get(probe.get("task"))
        missing = [n for n in task.names if n not in ns] if task else []
        running = _learner_threads()
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(1)      # as the judge: no thread pool grows while the check runs
        if running:
            line = head + ', "error": ' + json.dumps(
                f"this check did not run: {running} thread(s) that your notebook started were still running: the "
                f"grader measures the work done in the thread that calls your function, so do all of it there (no "
                f"threads, processes or pools)") + "}"
        elif task is None:
            line = head + ', "error": ' + json.dumps(f"no task {probe.get('task')!r} in this exercise") + "}"
        elif missing:
            line = head + ', "error": ' + json.dumps(f"your notebook does not define {', '.join(missing)} (did its "
                                                     f"cell run without errors?)") + "}"
        else:
            state["spawns"] = task.spawns
            state["armed"] = True
            signal.alarm(case_timeout)
            try:
                line = head + ', "value": ' + encode(task.run(probe["case"], **{n: ns[n] for n in task.names})) + "}"
            except BaseException as e:  # the learner's exception, SystemExit and KeyboardInterrupt included
                extra = {"trace": traceback.format_exc(limit=-3)[-1500:]} \
                    if not isinstance(e, (AssertionError, TimeoutError, TypeError, ValueError)) else {}
                line = head + ', "error": ' + json.dumps(_learner_error(e)) + \
                    "".join(f', "{k}": {json.dumps(v)}' for k, v in extra.items()) + "}"
            finally:
                signal.alarm(0)
                state["armed"] = False
        del probe
        reply(line)
    return 0


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    os._exit(main())
