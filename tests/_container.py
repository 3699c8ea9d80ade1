"""Run a command as in a container (Docker's defaults, Gradescope): root, a PID namespace of its own, /proc masked
the way Docker masks it (so bubblewrap fails with "Can't mount proc"), and a root file system of its own holding
only what an image holds: the system folders, Python and the virtual environment (world-readable, as an image's
are), a fresh /tmp, and the folders named with --bind. The course checkout is not in it.

    unshare --mount --pid --fork --mount-proc PYTHON tests/_container.py VENV [--bind PATH ...] -- COMMAND ...

Only mounts in this process's own mount namespace change; nothing on the machine does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SYSTEM = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def bind(new: Path, path: Path, *, recursive: bool = False) -> None:
    """Show `path` at the same place under the new root (its parents made as plain folders of mode 755)."""
    if not (path.is_symlink() and path.parent == Path("/")):      # /bin -> usr/bin stays a link, as in the image
        path = Path(os.path.realpath(path))
    target = new / path.relative_to("/")
    if path.is_symlink():
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        os.symlink(os.readlink(path), target)
        return
    if path.is_dir():
        target.mkdir(parents=True, exist_ok=True, mode=0o755)
    else:
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        target.touch()
    mount("--rbind" if recursive else "--bind", str(path), str(target))


def main(argv: list[str]) -> int:
    cut = argv.index("--")
    venv, extra, command = Path(argv[0]), [], argv[cut + 1:]
    i = 1
    while i < cut:
        if argv[i] == "--bind":
            extra.append(Path(argv[i + 1]))
            i += 2
        else:
            raise SystemExit(f"unknown option {argv[i]!r}")
    new = Path("/mnt")                             # covered by a private tmpfs in this mount namespace only
    mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(new))
    for d in SYSTEM:
        if Path(d).exists() or Path(d).is_symlink():
            bind(new, Path(d))
    for d in (Path(sys.base_prefix).resolve(), Path(os.path.realpath(sys.executable)).parent, venv, *extra):
        bind(new, d)
    bind(new, Path("/dev"), recursive=True)
    bind(new, Path("/sys"), recursive=True)        # the cgroups the grader uses
    for d, mode in (("tmp", 0o1777), ("var/tmp", 0o1777), ("root", 0o700), ("proc", 0o555), ("run", 0o755)):
        if not (new / d).exists():                 # root's home stays open where Python itself lives in it
            (new / d).mkdir(parents=True, mode=0o755)
            os.chmod(new / d, mode)
        elif d in ("tmp", "var/tmp"):
            os.chmod(new / d, mode)
    mount("-t", "proc", "proc", str(new / "proc"))
    for masked in ("acpi", "scsi", "kcore"):       # Docker's masked paths (one is enough for bubblewrap to fail)
        if (new / "proc" / masked).is_dir():
            mount("-t", "tmpfs", "-o", "ro", "tmpfs", str(new / "proc" / masked))
        elif (new / "proc" / masked).exists():
            mount("--bind", "/dev/null", str(new / "proc" / masked))
    cwd = os.getcwd()
    os.chroot(new)
    os.chdir(cwd if Path(cwd).is_dir() else "/")
    os.environ["HOME"] = "/root"
    os.execvp(command[0], command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
