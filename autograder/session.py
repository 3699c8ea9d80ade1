"""A learner's running sandbox (what `Sandbox.start` returns): the conversation's two pipes, the memory windows
and freezes only the grader controls, and the end. Limits and Outcome describe a run.

The grader writes requests on one pipe (MEMLAB_REQUEST_FD in the child) and reads replies on another
(MEMLAB_REPLY_FD), a JSON line each; the reply pipe is read by a thread of the grader within bounds
(`Limits.channel_bytes` in all, MAX_LINE_BYTES a line: a longer line is dropped and counted). stdout and stderr go
to files in the job folder, each capped by RLIMIT_FSIZE (`Limits.file_bytes`), of which the grader reads only the
tail (`tail`)."""

from __future__ import annotations

import json
import os
import queue
import resource
import select
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import procs

MAX_LINE_BYTES = 8 * 2**20              # one reply line; a longer one is dropped and counted


@dataclass(frozen=True)
class Limits:
    wall_s: float = 1800.0              # the whole learner: wall-clock seconds
    memory_bytes: int = 6 * 2**30       # resident memory of all its processes (cgroup) or address space (rlimit)
    processes: int = 256                # processes and threads
    scratch_bytes: int = 1 * 2**30      # the learner's writable folder (a tmpfs with bubblewrap)
    file_bytes: int = 64 * 2**20        # the largest file it may write (RLIMIT_FSIZE), stdout and stderr included
    channel_bytes: int = 64 * 2**20     # the most the grader reads from the reply channel

    def __post_init__(self):
        if not (isinstance(self.wall_s, (int, float)) and self.wall_s > 0):
            raise ValueError(f"wall_s must be a positive number of seconds, got {self.wall_s!r}")
        if not (isinstance(self.memory_bytes, int) and self.memory_bytes >= 2**28):
            raise ValueError(f"memory_bytes must be an int of at least 256 MiB, got {self.memory_bytes!r}")
        if not (isinstance(self.processes, int) and self.processes >= 16):
            raise ValueError(f"processes must be an int >= 16, got {self.processes!r}")
        for name in ("scratch_bytes", "file_bytes", "channel_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 2**20:
                raise ValueError(f"{name} must be an int of at least 1 MiB, got {v!r}")


@dataclass
class Outcome:
    returncode: int | None
    timed_out: bool
    seconds: float
    stdout: Path
    stderr: Path
    channel: bytes = b""                # run(): what the process wrote to its channel (at most channel_bytes)
    channel_truncated: bool = False     # it wrote more, and the rest was read and dropped
    memory_peak: int | None = None      # the most memory its processes held at once (its cgroup's record); None
                                        # without a memory cgroup
    dropped: int = 0                    # reply lines too long to read


def tail(path: Path, n: int = 2000) -> str:
    """The last n bytes of a file the learner's process wrote, as text ("" if there is none); never the whole file."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read(n).decode("utf-8", errors="replace")
    except OSError:
        return ""


class Session:
    """A learner's running sandbox: requests go out one JSON line at a time (`send`), replies come back one line at a
    time (`receive`), and the grader alone opens and closes memory windows and freezes process creation."""

    def __init__(self, box, proc: subprocess.Popen, limits: Limits, cgroups: list[Path], uid: int | None,
                 stdout: Path, stderr: Path, reply_fd: int, request_fd: int | None, work: Path):
        self.box, self.proc, self.limits, self.cgroups, self.uid = box, proc, limits, cgroups, uid
        self.stdout, self.stderr, self.work = stdout, stderr, work
        self.t0 = time.monotonic()
        self.deadline = self.t0 + limits.wall_s
        self.request_fd = request_fd
        if request_fd is not None:
            os.set_blocking(request_fd, False)
        self.lines: queue.Queue = queue.Queue()
        self.data = bytearray()
        self.truncated, self.dropped = False, 0
        self.peak_before = 0              # the high-water mark before the last window reset (a reset loses it)
        self._window = None
        self._reader = threading.Thread(target=self._read, args=(reply_fd,), daemon=True)
        self._reader.start()
        self.timed_out = False

    # ------------------------------------------------------------------ the reply channel
    def _read(self, fd: int) -> None:
        """Read the reply pipe to its end: complete lines go to `lines` (a longer line than MAX_LINE_BYTES is
        dropped and counted), at most channel_bytes in all (the rest is read and dropped), then None for the end."""
        head, skipping, total = bytearray(), False, 0
        try:
            while chunk := os.read(fd, 1 << 16):
                total += len(chunk)
                if self.request_fd is None and len(self.data) < self.limits.channel_bytes:
                    self.data += chunk[:self.limits.channel_bytes - len(self.data)]
                if total > self.limits.channel_bytes:
                    self.truncated = True
                    continue
                *done, rest = chunk.split(b"\n")
                for piece in done:
                    if skipping or len(head) + len(piece) > MAX_LINE_BYTES:
                        self.dropped += 1
                    else:
                        self.lines.put(bytes(head + piece))
                    head, skipping = bytearray(), False
                if not skipping:
                    head += rest
                    if len(head) > MAX_LINE_BYTES:
                        head, skipping = bytearray(), True
        except OSError:
            pass
        finally:
            os.close(fd)
            self.lines.put(None)

    def receive(self, timeout: float) -> bytes | None | bool:
        """The next reply line (bytes); None once the process has closed the channel (ended); False if nothing came
        within `timeout` seconds (or before the whole run's deadline)."""
        wait = min(timeout, self.deadline - time.monotonic())
        if wait <= 0:
            return False
        try:
            return self.lines.get(timeout=wait)
        except queue.Empty:
            return False

    def send(self, message: dict, timeout: float = 30) -> bool:
        """Write one JSON line to the request pipe; False if the process no longer reads it (ended, or never read
        within `timeout`)."""
        if self.request_fd is None:
            return False
        data = (json.dumps(message) + "\n").encode()
        end = time.monotonic() + timeout
        while data:
            try:
                n = os.write(self.request_fd, data)
                data = data[n:]
            except BlockingIOError:
                if time.monotonic() > end or self.proc.poll() is not None:
                    return False
                select.select([], [self.request_fd], [], 0.1)
            except OSError:
                return False
        return True

    # ------------------------------------------------------------------ what the grader sees from outside
    def processes(self) -> int:
        """How many processes of the learner run now besides the one the sandbox started, seen from /proc."""
        return len(self._learner_processes()) - 1

    def _learner_processes(self) -> list[int]:
        if self.uid is not None:
            return procs.processes_of(self.uid)
        tree = procs.process_tree()
        top = tree.get(self.proc.pid, [])
        if self.box.line == "bubblewrap":          # bubblewrap -> its init in the sandbox -> the learner's processes
            top = tree.get(top[0], []) if top else []
        found, todo = [], list(top)
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo += tree.get(pid, [])
        return found

    def window_open(self) -> None:
        """Reset the cgroup's memory high-water mark to what the sandbox holds now (no-op without a cgroup)."""
        self.peak_before = max(self.peak_before, procs.memory_peak(self.cgroups) or 0)
        self._window = procs.reset_mark(self.cgroups)

    def window_close(self) -> int | None:
        """How far the sandbox's memory rose above where it stood when the window opened (bytes), or None."""
        read, self._window = self._window, None
        if read is None:
            return None
        try:
            return read()
        finally:
            if hasattr(read, "fd"):
                os.close(read.fd)

    def freeze(self, extra: int = 0) -> bool:
        """From now on the sandbox may hold at most `extra` more threads and processes than it does now: its cgroup's
        process limit, or (separate user, no cgroup) the learner process's RLIMIT_NPROC. False if neither is here."""
        for cg in self.cgroups:
            if (cg / "pids.max").exists():
                try:
                    now = int((cg / "pids.current").read_text())
                    (cg / "pids.max").write_text(str(min(now + extra, self.limits.processes)))
                    return True
                except (OSError, ValueError):
                    return False
        if self.uid is not None:
            n = sum(procs.threads(p) for p in procs.processes_of(self.uid))
            try:
                resource.prlimit(self.proc.pid, resource.RLIMIT_NPROC, (n + extra, n + extra))
                return True
            except OSError:
                return False
        return False

    def thaw(self) -> None:
        for cg in self.cgroups:
            if (cg / "pids.max").exists():
                try:
                    (cg / "pids.max").write_text(str(self.limits.processes))
                except OSError:
                    pass
                return
        if self.uid is not None:
            try:
                resource.prlimit(self.proc.pid, resource.RLIMIT_NPROC, (self.limits.processes,) * 2)
            except OSError:
                pass

    # ------------------------------------------------------------------ the end
    def wait(self, timeout: float | None = None) -> None:
        """Wait for the process to end, at most `timeout` seconds (default: until the run's deadline)."""
        left = self.deadline - time.monotonic() if timeout is None else min(timeout, self.deadline - time.monotonic())
        try:
            self.proc.wait(timeout=max(left, 0.001))
        except subprocess.TimeoutExpired:
            if timeout is None or time.monotonic() >= self.deadline:
                self.timed_out = True

    def finish(self) -> Outcome:
        """End every process of the sandbox (whatever it started, detached or not), its cgroups and its user's
        leftovers; returns the Outcome. Safe to call once the process has ended on its own."""
        if self.proc.poll() is None and time.monotonic() >= self.deadline:
            self.timed_out = True
        spaces = procs.pid_namespaces_below(self.proc.pid) if self.box.line == "bubblewrap" else set()
        peak = procs.memory_peak(self.cgroups)
        if peak is not None:
            peak = max(peak, self.peak_before)
        if self._window is not None:
            self.window_close()
        procs.kill_all(self.proc, self.cgroups)
        procs.wait_until_empty(spaces)
        if self.uid is not None:
            procs.sweep_user(self.uid)
            self.box._give_uid(self.uid)
        if self.request_fd is not None:
            os.close(self.request_fd)
            self.request_fd = None
        self._reader.join(timeout=5)   # every writer has ended; one that escaped the sandbox is not waited for
        rc = None if self.timed_out else self.proc.returncode
        return Outcome(rc, self.timed_out, time.monotonic() - self.t0, self.stdout, self.stderr, bytes(self.data),
                       self.truncated or self._reader.is_alive(), peak, self.dropped)
