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

`Sandbox.start` returns a running Session (session.py: the conversation's pipes, the windows and freezes); what
the grader sees of processes and cgroups from outside, and how it ends them, is procs.py.
"""

from __future__ import annotations

import ctypes
import os
import resource
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from . import procs
from .session import Limits, Outcome, Session, tail  # noqa: F401 - Limits, Outcome and tail: the run's terms

# the parts of /etc a Python process needs; not the whole folder (inside the sandbox, root-owned files
# appear owned by the sandbox's own user, so /etc/shadow and the like must not be there at all)
ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives", "/etc/fonts",
       "/etc/localtime", "/etc/passwd", "/etc/group", "/etc/nsswitch.conf", "/etc/hosts", "/etc/mime.types",
       "/etc/os-release", "/etc/ssl/certs", "/etc/matplotlibrc")
LINES = ("bubblewrap", "user", "none")
UID_BASE = 61000                        # the separate-user line's first learner uid (MEMLAB_SANDBOX_UID)


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


# ----------------------------------------------------------------------------- the sandbox
@dataclass
class Sandbox:
    """How learners are isolated on this machine (decided once). `line`: bubblewrap, user or none."""
    line: str = ""
    why: str = ""                       # why the stronger lines could not run here
    cgroups: list[Path] = field(default_factory=procs.cgroup_dirs)

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
        cgs = procs.make_cgroups(self.cgroups, limits.memory_bytes, limits.processes)
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
