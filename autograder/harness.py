"""The learner's side of trusted grading: runs INSIDE the sandbox, never trusted.

    python -m autograder.harness < JOB

The job, read from stdin to its end before any learner code runs (so no file in the
sandbox holds it, and the learner's code finds stdin empty), holds the notebook code to run,
in order, and the probes: for each check case, the task id and the case's plain-data
inputs. This process imports the exercise's check module first, runs the notebook code
in an IPython shell (magics work; an error in one cell is recorded and the next cell
runs), then calls each task's `run(case, **learner_names)`. It writes one JSON line per
cell error ({"cell": i, "where": ..., "error": text}) and per case ({"key": ..., "value":
plain data} or {"key": ..., "error": text}) to the result channel: a pipe the grader
holds, whose descriptor (MEMLAB_CHANNEL_FD) is taken, and closed under its number,
before any learner code runs. A case marked "watched" runs inside a memory window: the harness asks the grader
to reset the sandbox cgroup's memory mark before it and to read it after (see sandbox.py), and waits for each
acknowledgement on a second pipe (MEMLAB_ACK_FD), so the grader sees that case's memory alone, from outside this
process. Nothing here decides a score: the grader reads these
lines after this process and every process it started have ended, and judges each
value against a reference it computes itself.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import sys
import traceback


def _alarm(signum, frame):
    raise TimeoutError("this check ran past its time limit")


def _learner_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) < 2000 else text[:2000] + " ..."


def main() -> int:
    job = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)      # the learner's code reads an empty stdin, as under Jupyter
    os.dup2(devnull, 0)
    os.close(devnull)
    # the channel, the check module and the encoder are bound here, before any learner code runs
    fd = int(os.environ.pop("MEMLAB_CHANNEL_FD"))
    channel = os.fdopen(os.dup(fd), "w", encoding="utf-8")
    os.close(fd)
    ack_fd = os.environ.pop("MEMLAB_ACK_FD", None)
    ack = None
    if ack_fd is not None:
        ack = os.dup(int(ack_fd))
        os.close(int(ack_fd))

    def window(what: str, key: str) -> None:
        """Open or close the grader's memory window for `key`, and wait (at most 10 s) until it has."""
        if ack is None:
            return
        channel.write(json.dumps({"window": what, "for": key}) + "\n")
        channel.flush()
        if select.select([ack], [], [], 10)[0]:
            os.read(ack, 1)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # a file over the size limit fails to grow; no signal kills us
    checks = importlib.import_module(job["module"])
    from autograder.checks.common import encode
    tasks = dict(checks.TASKS)
    results = cell_log = channel
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
    shell = InteractiveShell.instance()
    ns = shell.user_ns
    for i, cell in enumerate(job["cells"]):
        try:
            r = shell.run_cell(cell["code"], store_history=False, silent=False)
            err = r.error_in_exec or r.error_before_exec
        except BaseException as e:  # SystemExit, KeyboardInterrupt raised outside IPython's own handling
            err = e
        if err is not None:
            cell_log.write(json.dumps({"cell": i, "where": cell["where"], "error": _learner_error(err)}) + "\n")
            cell_log.flush()

    signal.signal(signal.SIGALRM, _alarm)
    for probe in job["probes"]:
        restore_names()
        task = tasks[probe["task"]]
        line = {"key": probe["key"]}
        missing = [n for n in task.names if n not in ns]
        if missing:
            line["error"] = f"your notebook does not define {', '.join(missing)} (did its cell run without errors?)"
        else:
            watched = isinstance(probe["case"], dict) and probe["case"].get("watched") is True
            if watched:
                window("open", probe["key"])
            signal.alarm(max(1, int(job["case_timeout"])))
            try:
                line["value"] = json.loads(encode(task.run(probe["case"], **{n: ns[n] for n in task.names})))
            except BaseException as e:  # the learner's exception, SystemExit and KeyboardInterrupt included
                line["error"] = _learner_error(e)
                if not isinstance(e, (AssertionError, TimeoutError, TypeError, ValueError)):
                    line["trace"] = traceback.format_exc(limit=-3)[-1500:]
            finally:
                signal.alarm(0)
                if watched:
                    window("close", probe["key"])
        results.write(json.dumps(line) + "\n")
        results.flush()
    return 0


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)
    os._exit(main())
