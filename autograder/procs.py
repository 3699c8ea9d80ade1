"""What the grader sees of a learner's processes from outside: /proc (processes, their tree, threads, PID
namespaces) and cgroups (limits, the memory high-water mark), and how it ends them all. Plumbing for sandbox.py
and session.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path

CGROUP_V1 = Path("/sys/fs/cgroup")
SHARED_TMP = ("/tmp", "/var/tmp", "/dev/shm")     # world-writable folders a learner's user may have left files in


def cgroup_dirs() -> list[Path]:
    """Writable cgroup v1 memory and pids hierarchies, or one v2 root; [] if none."""
    if os.geteuid() != 0:
        return []
    v1 = [CGROUP_V1 / "memory", CGROUP_V1 / "pids"]
    if all(d.is_dir() and os.access(d, os.W_OK) for d in v1):
        return v1
    if (CGROUP_V1 / "cgroup.controllers").exists() and os.access(CGROUP_V1, os.W_OK):
        return [CGROUP_V1]
    return []


def make_cgroups(roots: list[Path], memory_bytes: int, processes: int) -> list[Path]:
    """A fresh cgroup under each root with a memory and a process limit; [] where none can be made."""
    cgs = []
    for root in roots:
        cg = root / f"memlab-{uuid.uuid4().hex[:12]}"
        try:
            cg.mkdir()
            if root.name == "memory":
                (cg / "memory.limit_in_bytes").write_text(str(memory_bytes))
                if (cg / "memory.memsw.limit_in_bytes").exists():
                    (cg / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
            elif root.name == "pids":
                (cg / "pids.max").write_text(str(processes))
            else:  # v2
                (cg / "memory.max").write_text(str(memory_bytes))
                (cg / "pids.max").write_text(str(processes))
            cgs.append(cg)
        except OSError:
            if cg.exists():
                cg.rmdir()
    return cgs


def stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def children(pid: int) -> list[int]:
    """The children of pid, oldest first."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            s = stat(int(d.name))
            if s and int(s[1]) == pid:
                out.append((int(s[19]), int(d.name)))
    return [p for _, p in sorted(out)]


def process_tree() -> dict[int, list[int]]:
    """parent pid -> its children's pids, from one pass over /proc."""
    tree: dict[int, list[int]] = {}
    for d in os.scandir("/proc"):
        if d.name.isdigit():
            s = stat(int(d.name))
            if s:
                tree.setdefault(int(s[1]), []).append(int(d.name))
    return tree


def processes_of(uid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if d.stat().st_uid == uid:
                    out.append(int(d.name))
            except OSError:
                continue
    return out


def threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def reset_mark(cgroups: list[Path]):
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


def memory_peak(cgroups: list[Path]) -> int | None:
    """The memory cgroup's high-water mark of resident memory (v1 memory.max_usage_in_bytes, v2 memory.peak)."""
    for cg in cgroups:
        for name in ("memory.max_usage_in_bytes", "memory.peak"):
            try:
                return int((cg / name).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return None


def pid_namespaces_below(pid: int) -> set[str]:
    """The PID namespaces of pid's children that are not ours: bubblewrap's sandbox, whose processes all end
    when its first process does. Empty if /proc cannot tell (the sandbox has already ended)."""
    ours = os.readlink("/proc/self/ns/pid")
    found = set()
    for child in children(pid):
        try:
            ns = os.readlink(f"/proc/{child}/ns/pid")
            if ns != ours:
                found.add(ns)
        except OSError:
            continue
    return found


def wait_until_empty(spaces: set[str], timeout: float = 10.0) -> None:
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


def kill_all(proc: subprocess.Popen, cgroups: list[Path]) -> None:
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


def sweep_user(uid: int, timeout: float = 10.0) -> None:
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
        if os.waitstatus_to_exitcode(status) == 3 and not processes_of(uid):
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
