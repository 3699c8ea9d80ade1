"""Run one learner's code in a sandbox: its own scratch folder, nothing of the course or the class to read, limits
on time, memory and processes, and nothing left running afterwards.

Two lines of protection, chosen once per grader (`Sandbox.line`; `describe()` says which, in one line):

- **bubblewrap** (`bwrap`, Debian/Ubuntu package `bubblewrap`), where it can run: the learner's process sees a fresh
  root made of read-only system folders, the Python environment (any copy of the course installed into it masked
  by an empty folder), the course's learner-side code staged by the grader, and one writable scratch folder (a
  tmpfs of `Limits.scratch_bytes`); its own PID, network, IPC and user namespaces, so when the sandbox ends every
  process in it ends too; inside, it is uid 65534 without capabilities.
- **a separate user**, where bubblewrap cannot run (Docker's defaults and Gradescope mask /proc, so bubblewrap fails
  with "Can't mount proc"; some hosts refuse user namespaces) and the grader runs as root: the learner's process
  runs as a user of its own (`MEMLAB_SANDBOX_UID`, default 61000, plus one per learner graded at once) that owns
  nothing, with no supplementary groups, `no_new_privs`, rlimits, a fresh scratch folder only it can enter, and its
  own network namespace where the kernel allows it. What it must not read (the course's trusted checks, the
  solutions, the class's submissions, any installed copy of the grader) is checked before grading starts
  (`preflight`): grading refuses, naming the path and the fix, rather than run with it readable. Afterwards every
  process of that user is killed and its files in the shared temporary folders removed.

If neither can run, `line` is "none": a class is not graded (`grade.py` refuses with the fix), and a learner's own
`memlab-grade check` runs as a plain child process, saying it is unprotected.

Run as root with a writable cgroup hierarchy (v1 or v2), each sandbox also gets a cgroup with a memory and a
process limit, whose high-water mark the grader can reset and read (`Session.window_open/close`: the memory one
piece of work took, seen from outside) and whose process limit it can lower to what runs now (`Session.freeze`:
no thread or process can start). In the separate-user line without cgroups, the freeze lowers the learner
process's RLIMIT_NPROC instead (`prlimit`), which the kernel enforces for a user that is not root.

A session (`Sandbox.start`) is a conversation: the grader writes requests on one pipe (MEMLAB_REQUEST_FD in the
child) and reads replies on another (MEMLAB_REPLY_FD), a JSON line each; the reply pipe is read by a thread of the
grader within bounds (`Limits.channel_bytes` in all, MAX_LINE_BYTES a line: a longer line is dropped and counted).
stdout and stderr go to files in the job folder (never to pipes a learner's process could hold open), each capped
by RLIMIT_FSIZE (`Limits.file_bytes`), and the grader reads only their tail (`tail`).
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import resource
import select
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
LINES = ("bubblewrap", "user", "none")
MAX_LINE_BYTES = 8 * 2**20              # one reply line; a longer one is dropped and counted
UID_BASE = 61000                        # the separate-user line's first learner uid (MEMLAB_SANDBOX_UID)
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")     # world-writable folders a learner's user may have left files in


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


# ----------------------------------------------------------------------------- which line can run here
_DETECTED: dict[str, tuple[str, str]] = {}


def _bwrap_works(bwrap: str) -> str | None:
    """None if bubblewrap can start a sandbox like the learner's here, else the reason it cannot (its message)."""
    argv = [bwrap, "--unshare-all", "--uid", "65534", "--gid", "65534", "--die-with-parent", "--new-session",
            "--tmpfs", "/", "--proc", "/proc", "--dev", "/dev", *_system_binds(), "--", "true"]
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]


def _user_works(uid: int) -> str | None:
    """None if this process can start a child as `uid` (root, and the uid exists in this user namespace)."""
    if os.geteuid() != 0:
        return "the grader is not root, so it cannot run learners as a user of their own"
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            os._exit(0)
        except BaseException:       # noqa: BLE001 - the child only reports by its exit code
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return None if os.waitstatus_to_exitcode(status) == 0 else f"setuid({uid}) is refused here"


def detect_line() -> tuple[str, str]:
    """(line, why the stronger lines cannot run): MEMLAB_SANDBOX (bubblewrap, user, none) forces one;
    MEMLAB_NO_BWRAP=1 skips bubblewrap. Decided once per process."""
    forced = os.environ.get("MEMLAB_SANDBOX", "")
    key = f"{forced}|{os.environ.get('MEMLAB_NO_BWRAP', '')}|{_uid_base()}"
    if key in _DETECTED:
        return _DETECTED[key]
    if forced and forced not in LINES:
        raise ValueError(f"MEMLAB_SANDBOX must be one of {', '.join(LINES)}, got {forced!r}")
    why = []
    bwrap = shutil.which("bwrap")
    if forced in ("", "bubblewrap") and not os.environ.get("MEMLAB_NO_BWRAP"):
        if bwrap is None:
            why.append("bubblewrap is not installed")
        else:
            failed = _bwrap_works(bwrap)
            if failed is None:
                _DETECTED[key] = ("bubblewrap", "")
                return _DETECTED[key]
            why.append(f"bubblewrap cannot run here ({failed})")
    elif os.environ.get("MEMLAB_NO_BWRAP") or forced in ("user", "none"):
        why.append("bubblewrap switched off (MEMLAB_SANDBOX / MEMLAB_NO_BWRAP)")
    if forced in ("", "user", "bubblewrap") and sys.platform.startswith("linux"):
        failed = _user_works(_uid_base())
        if failed is None:
            _DETECTED[key] = ("user", "; ".join(why))
            return _DETECTED[key]
        why.append(failed)
    _DETECTED[key] = ("none", "; ".join(why))
    return _DETECTED[key]


def _uid_base() -> int:
    raw = os.environ.get("MEMLAB_SANDBOX_UID", str(UID_BASE))
    if not raw.isdigit() or not 1000 <= int(raw) <= 2**31 - 4096:
        raise ValueError(f"MEMLAB_SANDBOX_UID must be a uid from 1000 to 2**31 - 4096, got {raw!r}")
    return int(raw)


def _system_binds() -> list[str]:
    out = []
    for d in ("/usr", "/opt", *ETC):
        if Path(d).exists():
            out += ["--ro-bind", d, d]
    for d in ("/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
        p = Path(d)
        if p.is_symlink():
            out += ["--symlink", os.readlink(p), d]
        elif p.is_dir():
            out += ["--ro-bind", d, d]
    return out


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


# ----------------------------------------------------------------------------- the sandbox
@dataclass
class Sandbox:
    """How learners are isolated on this machine (decided once). `line`: bubblewrap, user or none."""
    line: str = ""
    why: str = ""                       # why the stronger lines could not run here
    cgroups: list[Path] = field(default_factory=_cgroup_dirs)

    def __post_init__(self):
        if not self.line:
            self.line, self.why = detect_line()
        if self.line not in LINES:
            raise ValueError(f"line must be one of {LINES}, got {self.line!r}")
        self._uids = list(range(_uid_base(), _uid_base() + 4096)) if self.line == "user" else []
        self._uid_lock = threading.Lock()

    @property
    def bwrap(self) -> str | None:
        return shutil.which("bwrap") if self.line == "bubblewrap" else None

    @property
    def protected(self) -> bool:
        return self.line != "none"

    @property
    def missing(self) -> list[str]:
        """Protections this machine cannot give; empty when fully sandboxed."""
        gaps = []
        if self.line == "none":
            gaps += ["filesystem isolation (the learner's code can read and write whatever this user can)",
                     "network isolation", "a PID namespace (a process that detaches may outlive the time limit)"]
        elif self.line == "user":
            gaps += ["a PID namespace (the learner's user is swept afterwards instead)",
                     "network isolation where the kernel refuses a network namespace"]
        if not self.cgroups:
            gaps.append("a cgroup (memory is limited per process by address space, and no memory is seen from "
                        "outside)")
        return gaps

    def describe(self) -> str:
        """The line of protection, in one line."""
        cg = "cgroup limits" if self.cgroups else "rlimits (no writable cgroup: run as root for cgroups)"
        if self.line == "bubblewrap":
            return f"sandbox: bubblewrap (namespaces, read-only system, no network), {cg}"
        if self.line == "user":
            return (f"sandbox: a separate user per learner (uid {_uid_base()}+, no_new_privs, own scratch), {cg}; "
                    f"bubblewrap not used: {self.why}")
        return f"sandbox: NONE - learners' code runs unprotected ({self.why})"

    def warning(self) -> str | None:
        if self.line == "bubblewrap" and self.cgroups:
            return None
        how = ("install bubblewrap where user namespaces and /proc mounts work (Debian/Ubuntu: apt-get install "
               "bubblewrap), or grade as root" if sys.platform.startswith("linux") else "grade on Linux")
        return "warning: learners are graded without " + "; without ".join(self.missing) + f". To fix: {how}."

    def refusal(self) -> str | None:
        """Why a class must not be graded here (one line with the fix), or None."""
        if self.line != "none":
            return None
        return (f"memlab-grade: no sandbox can run here ({self.why}): grade where bubblewrap works (apt-get install "
                f"bubblewrap), or as root inside the container so that each learner runs as a user of its own")

    def workdir(self, job_dir: Path) -> Path:
        """The learner's writable folder as its process sees it: HOME, TMPDIR and the current folder."""
        return Path("/scratch") if self.line == "bubblewrap" else Path(job_dir) / "scratch"

    # ------------------------------------------------------------------ the separate user's preflight
    def preflight(self, private: list[Path], needed: list[Path]) -> None:
        """Separate-user line only: raise SystemExit, naming the first path and the fix, if a learner's user could
        read anything in `private` (a folder: list it; a file: open it) or could not read what it needs."""
        if self.line != "user":
            return
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                os.setgroups([])
                os.setgid(_uid_base())
                os.setuid(_uid_base())
                bad = ""
                for p in private:
                    try:
                        os.listdir(p) if Path(p).is_dir() else open(p, "rb").close()
                        bad = f"private {p}"
                        break
                    except OSError:
                        continue
                for p in needed if not bad else ():
                    if not os.access(p, os.R_OK | (os.X_OK if Path(p).is_dir() else 0)):
                        bad = f"needed {p}"
                        break
                os.write(w, bad.encode())
            finally:
                os._exit(0)
        os.close(w)
        got = b""
        while chunk := os.read(r, 4096):
            got += chunk
        os.close(r)
        os.waitpid(pid, 0)
        what, _, path = got.decode().partition(" ")
        if what == "private":
            raise SystemExit(f"memlab-grade: learners would run as uid {_uid_base()}+, which can read {path}: make it "
                             f"private to root (chmod -R go-rwx {path}), or grade where bubblewrap works")
        if what == "needed":
            raise SystemExit(f"memlab-grade: learners would run as uid {_uid_base()}+, which cannot read {path}: put "
                             f"Python and its packages where every user can read them (e.g. a venv under /opt), or "
                             f"grade where bubblewrap works")

    # ------------------------------------------------------------------ starting a learner
    def _take_uid(self) -> int:
        with self._uid_lock:
            return self._uids.pop(0)

    def _give_uid(self, uid: int) -> None:
        with self._uid_lock:
            self._uids.insert(0, uid)

    def _bwrap_argv(self, argv: list[str], job_dir: Path, binds: list[Path], env: dict[str, str],
                    limits: Limits, masks: tuple[Path, ...] = ()) -> list[str]:
        cmd = [self.bwrap, "--unshare-all", "--uid", "65534", "--gid", "65534", "--die-with-parent", "--new-session",
               "--clearenv", "--tmpfs", "/", "--proc", "/proc", "--dev", "/dev",
               "--size", str(limits.scratch_bytes), "--tmpfs", "/tmp", *_system_binds()]
        for b in binds:
            cmd += ["--ro-bind", str(b), str(b)]
        for m in masks:       # a copy of the grader installed into the environment (pip install .): an empty folder
            cmd += ["--tmpfs", str(m)]
        work = self.workdir(job_dir)
        cmd += ["--ro-bind", str(job_dir), str(job_dir),
                "--size", str(limits.scratch_bytes), "--tmpfs", str(work), "--chdir", str(work)]
        for k, v in env.items():
            cmd += ["--setenv", k, v]
        return cmd + ["--", *argv]

    def _make_cgroups(self, limits: Limits) -> list[Path]:
        cgs = []
        for root in self.cgroups:
            cg = root / f"memlab-{uuid.uuid4().hex[:12]}"
            try:
                cg.mkdir()
                if root.name == "memory":
                    (cg / "memory.limit_in_bytes").write_text(str(limits.memory_bytes))
                    if (cg / "memory.memsw.limit_in_bytes").exists():
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
        return cgs

    def start(self, argv: list[str], job_dir: Path, binds: list[Path], env: dict[str, str], limits: Limits,
              conversation: bool = True, masks: tuple[Path, ...] = ()) -> Session:
        """Start argv with `workdir(job_dir)` as its only writable folder; returns the running Session. With
        conversation=True the process finds the read end of the request pipe in MEMLAB_REQUEST_FD and the write
        end of the reply pipe in MEMLAB_REPLY_FD. `masks`: folders inside `binds` that bubblewrap shows empty (a
        copy of the grader installed into site-packages). Without any sandbox line (`none`) it runs as a plain
        child."""
        job_dir = Path(job_dir)
        work = self.workdir(job_dir)
        env = dict(env, HOME=str(work), TMPDIR=str(work))
        uid = None
        if self.line == "user":
            uid = self._take_uid()
            os.chmod(job_dir, 0o711)       # the learner may enter the job folder to reach its scratch, not list it
            work.mkdir(mode=0o700, exist_ok=True)
            os.chown(work, uid, uid)
        elif self.line == "none":
            work.mkdir(exist_ok=True)
        cgs = self._make_cgroups(limits)
        req = os.pipe() if conversation else None
        rep = os.pipe()
        env["MEMLAB_REPLY_FD" if conversation else "MEMLAB_CHANNEL_FD"] = str(rep[1])
        if req:
            env["MEMLAB_REQUEST_FD"] = str(req[0])
        if self.line == "bubblewrap":
            cmd = self._bwrap_argv(argv, job_dir, binds, env, limits, masks)
            child_env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        elif self.line == "user":
            cmd, child_env = argv, dict(env, PATH="/usr/local/bin:/usr/bin:/bin")
        else:
            # a go-between process, so that the learner's parent is not the grader itself
            cmd = [sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:], "
                   "close_fds=False))", *argv]
            child_env = dict(env, PATH=os.environ.get("PATH", "/usr/bin:/bin"))
        libc = ctypes.CDLL(None, use_errno=True) if uid is not None else None
        memory_cgroup = any((cg / "memory.limit_in_bytes").exists() or (cg / "memory.max").exists() for cg in cgs)

        def preexec():
            for cg in cgs:
                (cg / "cgroup.procs").write_text(str(os.getpid()))
            if not memory_cgroup:
                resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
            if uid is not None:
                libc.unshare(0x40000000)                      # CLONE_NEWNET: no network, where the kernel allows it
                libc.prctl(38, 1, 0, 0, 0)                    # PR_SET_NO_NEW_PRIVS: no setuid program raises it
                resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
                os.umask(0o077)
                os.chdir(work)
            elif os.geteuid() != 0 and not cgs:
                resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))

        out, err = job_dir / "stdout.txt", job_dir / "stderr.txt"
        fo, fe = open(out, "wb"), open(err, "wb")
        try:
            proc = subprocess.Popen(cmd, cwd=job_dir if uid is None else None, stdin=subprocess.DEVNULL, stdout=fo,
                                    stderr=fe, env=child_env, start_new_session=True, preexec_fn=preexec,
                                    pass_fds=(rep[1], req[0]) if req else (rep[1],))
        except BaseException:
            for fd in (*rep, *(req or ())):
                os.close(fd)
            for cg in cgs:
                cg.rmdir()
            if uid is not None:
                self._give_uid(uid)
            raise
        finally:
            fo.close()
            fe.close()
            os.close(rep[1])
            if req:
                os.close(req[0])
        return Session(self, proc, limits, cgs, uid, out, err, rep[0], req[1] if req else None, work)

    def run(self, argv: list[str], job_dir: Path, binds: list[Path], env: dict[str, str], limits: Limits,
            channel: bool = False, masks: tuple[Path, ...] = ()) -> Outcome:
        """Run argv to its end (or its time limit) with nothing to talk about: what it wrote to the pipe in
        MEMLAB_CHANNEL_FD comes back as Outcome.channel."""
        s = self.start(argv, Path(job_dir), binds, env, limits, conversation=False, masks=masks)
        s.wait()
        return s.finish()


class Session:
    """A learner's running sandbox: requests go out one JSON line at a time (`send`), replies come back one line at a
    time (`receive`), and the grader alone opens and closes memory windows and freezes process creation."""

    def __init__(self, box: Sandbox, proc: subprocess.Popen, limits: Limits, cgroups: list[Path], uid: int | None,
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
            return _processes_of(self.uid)
        tree = _process_tree()
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
        self.peak_before = max(self.peak_before, _memory_peak(self.cgroups) or 0)
        self._window = _reset_mark(self.cgroups)

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
            n = sum(_threads(p) for p in _processes_of(self.uid))
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
        spaces = _pid_namespaces_below(self.proc.pid) if self.box.line == "bubblewrap" else set()
        peak = _memory_peak(self.cgroups)
        if peak is not None:
            peak = max(peak, self.peak_before)
        if self._window is not None:
            self.window_close()
        _kill_all(self.proc, self.cgroups)
        _wait_until_empty(spaces)
        if self.uid is not None:
            _sweep_user(self.uid)
            self.box._give_uid(self.uid)
        if self.request_fd is not None:
            os.close(self.request_fd)
            self.request_fd = None
        self._reader.join(timeout=5)   # every writer has ended; one that escaped the sandbox is not waited for
        rc = None if self.timed_out else self.proc.returncode
        return Outcome(rc, self.timed_out, time.monotonic() - self.t0, self.stdout, self.stderr, bytes(self.data),
                       self.truncated or self._reader.is_alive(), peak, self.dropped)


# ----------------------------------------------------------------------------- /proc and cgroups
def _stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _children(pid: int) -> list[int]:
    """The children of pid, oldest first."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            s = _stat(int(d.name))
            if s and int(s[1]) == pid:
                out.append((int(s[19]), int(d.name)))
    return [p for _, p in sorted(out)]


def _process_tree() -> dict[int, list[int]]:
    """parent pid -> its children's pids, from one pass over /proc."""
    tree: dict[int, list[int]] = {}
    for d in os.scandir("/proc"):
        if d.name.isdigit():
            s = _stat(int(d.name))
            if s:
                tree.setdefault(int(s[1]), []).append(int(d.name))
    return tree


def _processes_of(uid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if d.stat().st_uid == uid:
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _reset_mark(cgroups: list[Path]):
    """Reset the memory cgroup's high-water mark to what it holds now; returns a function that reads how far it
    has risen since (bytes), or None if this kernel cannot reset it (cgroup v2 before Linux 6.12) or there is no
    memory cgroup."""
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
    for child in _children(pid):
        try:
            ns = os.readlink(f"/proc/{child}/ns/pid")
            if ns != ours:
                found.add(ns)
        except OSError:
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


def _sweep_user(uid: int, timeout: float = 10.0) -> None:
    """Kill every process of `uid` (as that user: kill(-1) reaches exactly its own processes, detached ones too)
    until none is left, then remove what it left in the shared temporary folders."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = os.fork()
        if pid == 0:
            try:
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
                os._exit(0)
            except ProcessLookupError:
                os._exit(3)                                  # no process of this user is left
            except BaseException:                            # noqa: BLE001 - report by exit code only
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) == 3 and not _processes_of(uid):
            break
        time.sleep(0.02)
    for top in SHARED_TMP:
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for e in entries:
            try:
                if e.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if e.is_dir(follow_symlinks=False):
                    shutil.rmtree(e.path, ignore_errors=True)
                else:
                    os.unlink(e.path)
            except OSError:
                continue
