"""Run one learner's code in a sandbox: its own scratch folder, no network, limits on
time, memory and processes, and nothing left running afterwards.

On Linux with bubblewrap (`bwrap`, Debian/Ubuntu package `bubblewrap`) the learner's
process sees a fresh root made of read-only system folders, the Python environment,
the course code staged by the grader, and one writable scratch folder; it has its
own PID, network, IPC and user namespaces, so when the sandbox ends every process
in it ends too; inside, the learner is uid 65534 (`nobody`) without capabilities.
Run as root, the grader also puts each sandbox in its own cgroup (memory and
process limits). Without bubblewrap it
falls back to a plain child process with resource limits and says which
protections are missing (`Sandbox.missing`).

The learner's only writable folder is its scratch folder: with bubblewrap a fresh tmpfs of bounded size
(`Limits.scratch_bytes`) at /scratch, without it a folder of the job directory. The job directory itself
(stdout and stderr) is mounted read-only. The job itself (what to run, the hidden cases) comes in on stdin
(`run(stdin=...)`), which the learner's process reads to its end before any learner code runs, so no file
holds it there. Results come back on a pipe the grader holds (the
channel, `run(channel=True)`), never through a file the learner can write. stdout and stderr go to files in the
job directory (never to pipes that a learner's process could hold open), each capped by RLIMIT_FSIZE
(`Limits.file_bytes`), and the grader reads only their tail (`tail`).

A memory window (`WINDOW`): the harness may ask the grader to watch one piece of work from outside. It writes
`{"window": "open", "for": KEY}` on the channel and waits for the grader's acknowledgement (a byte on a second
pipe, MEMLAB_ACK_FD); the grader resets the cgroup's high-water mark to what the sandbox holds now. After the
work, `{"window": "close", "for": KEY}`: the grader reads the mark again, and `Outcome.memory_growth[KEY]` is how
far the sandbox's memory rose above where it stood when the window opened, the rest of the run left out.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

CGROUP_V1 = Path("/sys/fs/cgroup")
# the parts of /etc a Python process needs; not the whole folder (inside the sandbox, root-owned files
# appear owned by the sandbox's own user, so /etc/shadow and the like must not be there at all)
ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/fonts",
       "/etc/localtime", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/hosts", "/etc/mime.types",
       "/etc/os-release", "/etc/ssl/certs", "/etc/matplotlibrc")


@dataclass(frozen=True)
class Limits:
    wall_s: float = 1800.0              # the whole learner: wall-clock seconds
    memory_bytes: int = 6 * 2**30       # resident memory of all its processes (cgroup) or address space (rlimit)
    processes: int = 256                # processes and threads
    scratch_bytes: int = 1 * 2**30      # the learner's writable folder (a tmpfs with bubblewrap)
    file_bytes: int = 64 * 2**20        # the largest file it may write (RLIMIT_FSIZE), stdout and stderr included
    channel_bytes: int = 64 * 2**20     # the most the grader reads from the result channel

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
    channel: bytes = b""                # what the process wrote to the result channel (at most channel_bytes)
    channel_truncated: bool = False     # it wrote more, and the rest was read and dropped
    memory_peak: int | None = None      # the most memory its processes held at once (its cgroup's record); None
                                        # without a memory cgroup
    memory_growth: dict[str, int] = field(default_factory=dict)   # memory window -> the most the sandbox's
                                        # memory rose above where it stood when the window opened (cgroup)


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


WINDOW = b'{"window": '       # how a memory window's line starts (see the module's docstring)


class _Drain(threading.Thread):
    """Reads a pipe to its end, keeping the first `cap` bytes and dropping the rest (so a learner who writes
    without end neither blocks on a full pipe nor fills the grader's memory). A complete line that starts with
    WINDOW and is short goes to `window(line)` as well, as it arrives."""

    def __init__(self, fd: int, cap: int, window=None):
        super().__init__(daemon=True)
        self.fd, self.cap, self.data, self.truncated = fd, cap, bytearray(), False
        self.window, self.head = window, b""      # head: the first bytes of the line being read

    def run(self):
        try:
            while chunk := os.read(self.fd, 1 << 16):
                room = self.cap - len(self.data)
                if room > 0:
                    self.data += chunk[:room]
                if len(chunk) > max(room, 0):
                    self.truncated = True
                if self.window:
                    self._lines(chunk)
        except OSError:
            pass
        finally:
            os.close(self.fd)

    def _lines(self, chunk: bytes) -> None:
        *done, rest = chunk.split(b"\n")
        for piece in done:
            line, self.head = self.head + piece[:512], b""
            if line.startswith(WINDOW) and len(line) < 512:
                self.window(line)
        if len(self.head) < 512:
            self.head += rest[:512]


class _Windows:
    """The grader's side of the memory windows of one run: reset the cgroup's mark when a window opens, read it
    when it closes, and acknowledge every window line at once (never blocking on a reader that does not read)."""

    def __init__(self, cgroups: list[Path], ack_fd: int):
        self.cgroups, self.ack_fd = cgroups, ack_fd
        self.open: dict[str, object] = {}        # key -> the function that reads the growth since it opened
        self.growth: dict[str, int] = {}
        self.peak_before = 0      # the run's high-water mark before the last reset (a v1 reset loses it)

    def __call__(self, line: bytes) -> None:
        try:
            msg = json.loads(line)
            what, key = msg.get("window"), msg.get("for")
            if isinstance(key, str) and len(self.open) < 64:
                if what == "open" and key not in self.open:      # the first opening counts: a later one is ignored
                    self.peak_before = max(self.peak_before, _memory_peak(self.cgroups) or 0)
                    self.open[key] = _reset_mark(self.cgroups)
                elif what == "close" and self.open.get(key):     # the last closing counts: the mark only grows
                    self.growth[key] = self.open[key]()
        except (ValueError, AttributeError, OSError):
            pass
        try:
            os.write(self.ack_fd, b"\n")
        except OSError:     # the pipe is full (nobody reads the acknowledgements) or closed
            pass

    def close(self) -> None:
        for read in self.open.values():
            if hasattr(read, "fd"):
                os.close(read.fd)
        os.close(self.ack_fd)


def _reset_mark(cgroups: list[Path]):
    """Reset the memory cgroup's high-water mark to what it holds now; returns a function that reads how far it
    has risen since (bytes), or None if this kernel cannot reset it (cgroup v2 before Linux 6.12)."""
    for cg in cgroups:
        v1 = cg / "memory.max_usage_in_bytes"
        if v1.exists():                                    # v1: writing 0 resets it to the current usage
            v1.write_text("0")
            base = int(v1.read_text())
            return lambda: int(v1.read_text()) - base
        v2 = cg / "memory.peak"
        if v2.exists():                                    # v2: a write resets it for reads through the same file
            fd = os.open(v2, os.O_RDWR)
            try:
                os.write(fd, b"reset\n")
                base = int(os.pread(fd, 64, 0))
            except (OSError, ValueError):
                os.close(fd)
                return None
            read = lambda: int(os.pread(fd, 64, 0)) - base        # noqa: E731
            read.fd = fd
            return read
    return None


def _bwrap() -> str | None:
    return None if os.environ.get("MEMLAB_NO_BWRAP") else shutil.which("bwrap")


def _cgroup_dirs() -> list[Path]:
    """Writable cgroup v1 memory and pids hierarchies, or one v2 root; [] if none."""
    if os.geteuid() != 0:
        return []
    v1 = [CGROUP_V1 / "memory", CGROUP_V1 / "pids"]
    if all(d.is_dir() and os.access(d, os.W_OK) for d in v1):
        return v1
    if (CGROUP_V1 / "cgroup.controllers").exists() and os.access(CGROUP_V1, os.W_OK):
        return [CGROUP_V1]
    return []


@dataclass
class Sandbox:
    """How learners are isolated on this machine (decided once)."""
    bwrap: str | None = field(default_factory=_bwrap)
    cgroups: list[Path] = field(default_factory=_cgroup_dirs)

    @property
    def missing(self) -> list[str]:
        """Protections this machine cannot give; empty when fully sandboxed."""
        gaps = []
        if not self.bwrap:
            gaps += ["filesystem isolation (the learner's code can read and write whatever this user can)",
                     "network isolation", "a PID namespace (a process that detaches may outlive the time limit)"]
        if not self.cgroups:
            gaps.append("a cgroup (memory is limited per process by address space, processes by RLIMIT_NPROC"
                        + (", which root ignores)" if os.geteuid() == 0 else ")"))
        return gaps

    def warning(self) -> str | None:
        if not self.missing:
            return None
        how = ("install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap) and grade as root for cgroups"
               if sys.platform.startswith("linux") else "grade on Linux with bubblewrap for full isolation")
        return "warning: learners are graded without " + "; without ".join(self.missing) + f". To fix: {how}."

    # ------------------------------------------------------------------ command line
    def workdir(self, job_dir: Path) -> Path:
        """The learner's writable folder as its process sees it: HOME, TMPDIR and the current folder."""
        return Path("/scratch") if self.bwrap else Path(job_dir) / "scratch"

    def _bwrap_argv(self, argv: list[str], job_dir: Path, binds: list[Path], env: dict[str, str],
                    limits: Limits) -> list[str]:
        cmd = [self.bwrap, "--unshare-all", "--uid", "65534", "--gid", "65534", "--die-with-parent", "--new-session",
               "--clearenv", "--tmpfs", "/", "--proc", "/proc", "--dev", "/dev",
               "--size", str(limits.scratch_bytes), "--tmpfs", "/tmp"]
        for d in ("/usr", "/opt", *ETC):
            if Path(d).exists():
                cmd += ["--ro-bind", d, d]
        for d in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
            p = Path(d)
            if p.is_symlink():
                cmd += ["--symlink", os.readlink(p), d]
            elif p.is_dir():
                cmd += ["--ro-bind", d, d]
        for b in binds:
            cmd += ["--ro-bind", str(b), str(b)]
        work = self.workdir(job_dir)
        cmd += ["--ro-bind", str(job_dir), str(job_dir),
                "--size", str(limits.scratch_bytes), "--tmpfs", str(work), "--chdir", str(work)]
        for k, v in env.items():
            cmd += ["--setenv", k, v]
        return cmd + ["--", *argv]

    # ------------------------------------------------------------------ run
    def run(self, argv: list[str], job_dir: Path, binds: list[Path], env: dict[str, str], limits: Limits,
            channel: bool = False, stdin: bytes | None = None) -> Outcome:
        """Run argv with `workdir(job_dir)` as its only writable folder and job_dir read-only; returns when every
        process of it has ended. With channel=True the process finds a pipe's write end in the file descriptor
        named by the environment variable MEMLAB_CHANNEL_FD; what it writes there is Outcome.channel. `stdin` is
        what the process reads on its standard input (a pipe, then end of file); without it, nothing."""
        job_dir = Path(job_dir)
        out, err = job_dir / "stdout.txt", job_dir / "stderr.txt"
        work = self.workdir(job_dir)
        env = dict(env, HOME=str(work), TMPDIR=str(work))
        if not self.bwrap:
            work.mkdir(exist_ok=True)
        cgs = []
        for root in self.cgroups:
            cg = root / f"memlab-{uuid.uuid4().hex[:12]}"
            try:
                cg.mkdir()
                if root.name == "memory":
                    (cg / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
                    (cg / "memory.memsw.limit_in_bytes").exists() and \
                        (cg / "memory.memsw.limit_in_bytes").write_text(str(limits.memory_bytes))
                elif root.name == "pids":
                    (cg / "pids.max").write_text(str(limits.processes))
                else:  # v2
                    (cg / "memory.max").write_text(str(limits.memory_bytes))
                    (cg / "pids.max").write_text(str(limits.processes))
                cgs.append(cg)
            except OSError:
                if cg.exists():
                    cg.rmdir()
        pipe = os.pipe() if channel else None
        ack = os.pipe() if channel else None            # the grader acknowledges each memory window line here
        if pipe:
            env["MEMLAB_CHANNEL_FD"], env["MEMLAB_ACK_FD"] = str(pipe[1]), str(ack[0])
            os.set_blocking(ack[1], False)
        if self.bwrap:
            cmd = self._bwrap_argv(argv, job_dir, binds, env, limits)
            child_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        else:
            # a go-between process, so that the learner's parent is not the grader itself
            cmd = [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:], "
                   "close_fds=False))", *argv]
            child_env = dict(env, PATH=os.environ.get("PATH", "/usr/bin:/bin"))

        def preexec():
            for cg in cgs:
                (cg / "cgroup.procs").write_text(str(os.getpid()))
            if not cgs:
                resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
                if os.geteuid() != 0:
                    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))

        t0 = time.monotonic()
        timed_out = False
        drain = None
        with open(out, "wb") as fo, open(err, "wb") as fe:
            try:
                proc = subprocess.Popen(cmd, cwd=job_dir, stdin=subprocess.DEVNULL if stdin is None else
                                        subprocess.PIPE, stdout=fo, stderr=fe,
                                        env=child_env, start_new_session=True, preexec_fn=preexec,
                                        pass_fds=(pipe[1], ack[0]) if pipe else ())
            finally:
                if pipe:
                    os.close(pipe[1])
                    os.close(ack[0])
            windows = None
            if stdin is not None:
                threading.Thread(target=_feed, args=(proc.stdin, stdin), daemon=True).start()
            if pipe:
                windows = _Windows(cgs, ack[1])
                drain = _Drain(pipe[0], limits.channel_bytes, windows)
                drain.start()
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            spaces = _pid_namespaces_below(proc.pid) if self.bwrap else set()
            peak = _memory_peak(cgs)
            if peak is not None and windows:
                peak = max(peak, windows.peak_before)
            _kill_all(proc, cgs)
            _wait_until_empty(spaces)
        got, cut, growth = b"", False, {}
        if drain:
            drain.join(timeout=5)     # every writer has ended; one that escaped the sandbox is not waited for
            got, cut, growth = bytes(drain.data), drain.truncated or drain.is_alive(), dict(windows.growth)
            if not drain.is_alive():
                windows.close()
        return Outcome(None if timed_out else proc.returncode, timed_out, time.monotonic() - t0, out, err, got, cut,
                       peak, growth)


def _feed(pipe, data: bytes) -> None:
    """Write data to the process's stdin and close it; a process that ends without reading it all is no error."""
    try:
        pipe.write(data)
    except OSError:
        pass
    finally:
        try:
            pipe.close()
        except OSError:
            pass


def _memory_peak(cgroups: list[Path]) -> int | None:
    """The memory cgroup's high-water mark of resident memory (v1 memory.max_usage_in_bytes, v2 memory.peak)."""
    for cg in cgroups:
        for name in ("memory.max_usage_in_bytes", "memory.peak"):
            try:
                return int((cg / name).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return None


def _pid_namespaces_below(pid: int) -> set[str]:
    """The PID namespaces of pid's children that are not ours: bubblewrap's sandbox, whose processes all end
    when its first process does. Empty if /proc cannot tell (the sandbox has already ended)."""
    ours = os.readlink("/proc/self/ns/pid")
    found = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == pid:
                ns = os.readlink(d / "ns" / "pid")
                if ns != ours:
                    found.add(ns)
        except (OSError, IndexError, ValueError):
            continue
    return found


def _wait_until_empty(spaces: set[str], timeout: float = 10.0) -> None:
    """Kill every process left in these PID namespaces and wait until none is left. The kernel ends them when
    the namespace's first process ends, but not before that process's parent (bubblewrap) is gone, and not at
    once; a grader that moved on at once could still see a learner's process alive."""
    deadline = time.monotonic() + timeout
    while spaces and time.monotonic() < deadline:
        left = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if os.readlink(d / "ns" / "pid") in spaces:
                    left.append(int(d.name))
            except OSError:
                continue
        if not left:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.02)


def _kill_all(proc: subprocess.Popen, cgroups: list[Path]) -> None:
    """End the sandbox's process group, then every process left in its cgroups, then the cgroups."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    for cg in cgroups:
        for _ in range(100):
            try:
                pids = [int(p) for p in (cg / "cgroup.procs").read_text().split()]
            except OSError:
                break
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        try:
            cg.rmdir()
        except OSError:
            pass
