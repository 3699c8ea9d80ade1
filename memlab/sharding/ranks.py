"""memlab.sharding: start N ranks on one machine, run a function on each, bring plain data back.

    from memlab import sharding
    with sharding.RankGroup(4) as ranks:                 # 4 processes, gloo on CPU (nccl on >= 4 GPUs)
        values = ranks.run(my_module.fn, 128)        # fn(128) on every rank -> [value of rank 0, 1, 2, 3]
        results = ranks.run_tracked(my_module.fn, 128)   # + memory by category and bytes by collective

The ranks are processes started once and reused: each joins one process group
(`torch.distributed.init_process_group`, environment variables RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT set as `torchrun` sets them) and then runs
the functions it is sent. A function must be importable by another process:
defined at the top level of a .py file (a function typed into a notebook cell is
not). What it returns must pickle (plain data: numbers, strings, dicts, lists).

On gloo the ranks are forked from a server process (multiprocessing's "forkserver")
that has imported torch, memlab and the group's `preload` modules once, so a rank starts
in milliseconds instead of re-importing everything; the server lives as long as the
Python process that started it. nccl ranks start as fresh interpreters ("spawn").

Failures are loud and leave nothing behind: when a rank raises, `RankError` names
the rank and carries its traceback; when a rank does not answer within `timeout`
seconds, the ranks still running are named. Either way the whole group is killed
(each rank leads its own process group, so `os.killpg` also takes its children).
If the Python process that started the group dies, the fork server exits and the
ranks die with it (Linux parent-death signal; elsewhere they end when their pipe
closes, between jobs). What the ranks print (DeepSpeed's logging, warnings) goes to
a log per rank, `ranks.log(r)`, not into the notebook.

`CommCounter` (from memlab.sharding.comm) counts the bytes of every collective a rank issues.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from ._rank import _rank_main
from .comm import CommCounter, ring_bytes_sent
from ..core.validate import is_int, pos_float, pos_int

__all__ = ["RankGroup", "RankError", "RankResult", "run", "CommCounter", "ring_bytes_sent"]

_GROUPS: list["RankGroup"] = []       # live groups, closed at interpreter exit


class RankError(RuntimeError):
    """A rank raised, died or did not finish in time. `rank` is the first rank at
    fault (None if the group failed to start), `kind` is 'raised', 'died' or 'timeout'."""

    def __init__(self, message: str, rank: int | None = None, kind: str = "raised", remote_traceback: str = ""):
        super().__init__(message)
        self.rank, self.kind, self.remote_traceback = rank, kind, remote_traceback


@dataclass
class RankResult:
    """What `RankGroup.run_tracked` brings back from one rank (all plain data)."""
    rank: int
    value: object
    peak: int                              # bytes: highest live total while fn ran
    peak_breakdown: dict[str, int]         # category -> bytes at that moment (memlab.CATEGORIES)
    end_breakdown: dict[str, int]          # category -> bytes live when fn returned
    phase_peaks: dict[str, dict[str, int]]  # phase -> {"total": ..., category: ...}
    comm: dict[str, dict[str, int]]        # collective -> {"calls", "bytes", "sent"} (see CommCounter)
    seconds: float                         # wall time of fn on this rank


# ----------------------------------------------------------------------------- the group, seen from the parent
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_callable(fn):
    if not callable(fn):
        raise TypeError(f"fn must be a function, got {type(fn).__name__}")
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    interactive = mod == "__main__" and getattr(sys.modules.get("__main__"), "__file__", None) is None
    if mod is None or interactive or "<locals>" in qual or "<lambda>" in qual:
        raise ValueError(f"fn must be defined at the top level of an importable .py file so that the rank processes "
                         f"can import it; {qual or fn!r} from module {mod!r} cannot be sent to another process "
                         f"(functions typed into a notebook cell, lambdas and nested functions cannot)")


class RankGroup:
    """`world_size` rank processes on this machine, started once, reused for many `run`s.

    Args:
        world_size: number of ranks (>= 1).
        backend: "gloo" (CPU) or "nccl" (one GPU per rank). Default: nccl if this machine has
            at least `world_size` CUDA GPUs, else gloo.
        timeout: seconds a `run` may take before the group is killed (per call; override in `run`).
        threads: torch threads per rank (1 keeps N ranks from fighting over a few cores).
        env: extra environment variables for the ranks. On gloo DS_ACCELERATOR=cpu is set so
            DeepSpeed picks its CPU accelerator without guessing (and without warning about it).
        preload: modules every rank needs (e.g. ("deepspeed",)). gloo ranks are forked from one
            server process (multiprocessing's "forkserver"), started by the first gloo RankGroup
            of this Python process: modules it preloads cost one import for all ranks of all
            groups instead of one per rank. A later group imports what the server lacks in each
            rank, as nccl ranks (fresh interpreters) do.
        wait: False returns at once: the fork server imports `preload` in the background and
            the ranks start at the first `run` (or `wait_ready()`), so a notebook can compute
            something else meanwhile.
    """

    def __init__(self, world_size: int, *, backend: str | None = None, timeout: float = 120.0,
                 threads: int = 1, env: dict[str, str] | None = None, preload: tuple[str, ...] = (),
                 start_timeout: float = 120.0, wait: bool = True):
        pos_int("world_size", world_size)
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
        for name, v in (("timeout", timeout), ("start_timeout", start_timeout)):
            pos_float(name, v, what="a positive number of seconds")
        pos_int("threads", threads)
        if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                                   for k, v in env.items())):
            raise TypeError("env must be a dict of str -> str")
        if isinstance(preload, str) or not all(isinstance(m, str) and m for m in preload):
            raise TypeError(f"preload must be a tuple of module names, got {preload!r}")
        self.world_size, self.backend, self.timeout = world_size, backend, float(timeout)
        self._logdir = tempfile.mkdtemp(prefix="memlab-ranks-")
        self._procs, self._conns, self.closed = [], [], False
        import multiprocessing as mp
        # gloo: one clean server imports torch (and `preload`) once, ranks fork from it. nccl: each rank is a
        # fresh interpreter ("spawn"), so no CUDA or DeepSpeed state chosen for CPU ranks can leak into GPU ranks
        self._ctx = mp.get_context("forkserver" if backend == "gloo" else "spawn")
        if backend == "gloo":
            self._ctx.set_forkserver_preload(["torch", "memlab", *preload])
        self._base = {"MASTER_ADDR": "127.0.0.1", "WORLD_SIZE": str(world_size),
                      "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": str(threads)}
        if backend == "gloo":
            self._base["DS_ACCELERATOR"] = "cpu"
        self._base.update(env or {})
        self._threads, self._preload = threads, tuple(preload)
        self._start_timeout, self._ready = float(start_timeout), False
        if backend == "gloo":
            with self._server_env():
                from multiprocessing import forkserver
                forkserver.ensure_running()              # the server imports `preload` now, in the background
        if wait:
            self.wait_ready()

    def _server_env(self):
        """The server imports with the environment it inherits: give it the ranks' DS_ACCELERATOR
        while it starts, so a preloaded deepspeed picks the same accelerator as the ranks."""
        import contextlib

        @contextlib.contextmanager
        def env():
            saved = os.environ.get("DS_ACCELERATOR")
            if "DS_ACCELERATOR" in self._base:
                os.environ["DS_ACCELERATOR"] = self._base["DS_ACCELERATOR"]
            try:
                yield
            finally:
                if saved is None:
                    os.environ.pop("DS_ACCELERATOR", None)
                else:
                    os.environ["DS_ACCELERATOR"] = saved
        return env()

    def _start(self):
        base = dict(self._base, MASTER_PORT=str(_free_port()))
        with self._server_env():
            for r in range(self.world_size):
                parent, child = self._ctx.Pipe()
                renv = dict(base, RANK=str(r), LOCAL_RANK=str(r))
                p = self._ctx.Process(target=_rank_main, name=f"memlab-rank{r}", daemon=True,
                                      args=(r, self.world_size, self.backend, child, renv, self._threads,
                                            self.log_path(r), self._preload))
                p.start()
                child.close()
                self._procs.append(p)
                self._conns.append(parent)
        _GROUPS.append(self)

    # -------------------------------------------------------------- public
    @property
    def pids(self) -> list[int]:
        """The ranks' process ids (starts them if they were deferred)."""
        self.wait_ready()
        return [p.pid for p in self._procs]

    def log_path(self, rank: int) -> str:
        return os.path.join(self._logdir, f"rank{rank}.log")

    def wait_ready(self) -> "RankGroup":
        """Start the ranks if `wait=False` deferred it, and block until every rank has joined the
        process group (RankError if one fails to)."""
        if self.closed:
            raise RuntimeError("this RankGroup is closed (it was stopped or a rank failed); start a new one")
        if not self._ready:
            if not self._procs:
                self._start()
            self._collect("start", self._start_timeout)
            self._ready = True
        return self

    def log(self, rank: int) -> str:
        """Everything rank `rank` printed (stdout and stderr) so far."""
        if not is_int(rank) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an int in [0, {self.world_size}), got {rank!r}")
        try:
            with open(self.log_path(rank), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """fn(*args, **kwargs) on every rank at once; the return values, rank 0 first."""
        return self._run(fn, args, kwargs, timeout, tracked=False)

    def run_tracked(self, fn, *args, timeout: float | None = None, **kwargs) -> list[RankResult]:
        """Like `run`, with memlab's MemoryTracker and a CommCounter active around fn on
        every rank: live bytes by category (fn labels its model and optimizer with
        `memlab.watch(model, optimizer)`) and bytes by collective come back as RankResults."""
        outs = self._run(fn, args, kwargs, timeout, tracked=True)
        return [RankResult(rank=r, **o) for r, o in enumerate(outs)]

    def close(self):
        """Stop the ranks (politely, then by force). Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for c in self._conns:
            try:
                c.send(None)
            except Exception:                             # noqa: BLE001
                pass
        deadline = time.monotonic() + 5
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def __enter__(self) -> "RankGroup":
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else ("running" if self._ready else "starting at its first run")
        return f"RankGroup(world_size={self.world_size}, backend={self.backend!r}, {state})"

    # -------------------------------------------------------------- internals
    def _kill(self):
        import signal
        for p in self._procs:
            if p.pid is not None and p.exitcode is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)     # the rank and anything it started
                except (ProcessLookupError, PermissionError):
                    pass
                try:
                    p.kill()
                except Exception:                         # noqa: BLE001
                    pass
        for p in self._procs:
            p.join(5)
        for c in self._conns:
            c.close()
        if self in _GROUPS:
            _GROUPS.remove(self)

    def _fail(self, message, rank, kind, tb=""):
        self.closed = True
        self._kill()
        raise RankError(message + "\nThe rank group was stopped; start a new RankGroup to go on.", rank, kind, tb)

    def _run(self, fn, args, kwargs, timeout, tracked):
        if self.closed:
            raise RuntimeError("this RankGroup is closed (it was stopped or a rank failed); start a new one")
        _check_callable(fn)
        self.wait_ready()
        if timeout is not None:
            pos_float("timeout", timeout, what="a positive number of seconds or None")
        task = (fn, args, kwargs, tracked)
        try:
            pickle.dumps(task)
        except Exception as e:                            # noqa: BLE001
            raise TypeError(f"fn and its arguments must pickle to reach the ranks: {e}") from e
        for c in self._conns:
            c.send(task)
        return self._collect(getattr(fn, "__qualname__", "fn"), timeout or self.timeout)

    def _collect(self, what, timeout):
        from multiprocessing.connection import wait
        deadline = time.monotonic() + timeout
        results: dict[int, object] = {}
        pending = {c: r for r, c in enumerate(self._conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending) + list(sentinels), timeout=max(left, 0)) if left > 0 else []
            if not ready:
                late = sorted(pending.values())
                self._fail(f"{what}: rank{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} did not finish "
                           f"within {timeout:g} s (finished: {sorted(results) or 'none'}); a rank waiting in a "
                           f"collective for a peer that never joins hangs like this", late[0], "timeout")
            for obj in ready:
                if obj in sentinels:                      # a rank process ended
                    r = sentinels.pop(obj)
                    conn = self._conns[r]
                    if conn in pending and not conn.poll(0.5):   # ...without sending its answer first
                        code = self._procs[r].exitcode
                        tail = "\n".join(self.log(r).splitlines()[-15:])
                        self._fail(f"{what}: rank {r} died (exit code {code}) before reporting.\n"
                                   f"Last lines of its log:\n{tail}", r, "died")
                    continue
                r = pending.pop(obj)
                try:
                    status, rank, payload = obj.recv()
                except (EOFError, OSError):
                    code = self._procs[r].exitcode
                    self._fail(f"{what}: rank {r} died (exit code {code}) before reporting", r, "died")
                if status == "error":
                    msg, tb = payload
                    self._fail(f"{what}: rank {rank} raised {msg}\n--- traceback on rank {rank} ---\n{tb}",
                               rank, "raised", tb)
                results[rank] = payload
        return [results[r] for r in range(self.world_size)]


def run(fn, *args, world_size: int = 2, backend: str | None = None, timeout: float = 120.0,
        tracked: bool = False, **kwargs) -> list:
    """Start `world_size` ranks, run fn(*args, **kwargs) on each, stop them; the values
    (or RankResults with tracked=True), rank 0 first. See RankGroup."""
    with RankGroup(world_size, backend=backend, timeout=timeout) as g:
        return g.run_tracked(fn, *args, **kwargs) if tracked else g.run(fn, *args, **kwargs)


@atexit.register
def _close_all():
    for g in list(_GROUPS):
        try:
            g._kill()
        except Exception:                                 # noqa: BLE001
            pass
