"""Run a command as in a container (Docker's defaults, Gradescope): root, a PID namespace of its own, /proc masked
the way Docker masks it (so bubblewrap fails with "Can't mount proc"), Python readable by every user as in an image,
and the course checkout hidden but for its virtual environment (an image installs the dependencies, not the course).

    unshare --mount --pid --fork --mount-proc PYTHON tests/_container.py REPO -- COMMAND ...

Only mounts in this process's own mount namespace change; nothing on the machine does."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def open_up(folder: Path, scratch: Path) -> None:
    """Make `folder` enterable and listable by every user without touching it: its entries are bound unchanged into a
    tmpfs of mode 755 mounted over it."""
    keep = scratch / folder.as_posix().strip("/").replace("/", "_")
    keep.mkdir(parents=True)
    mount("--bind", str(folder), str(keep))
    mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(folder))
    for e in os.scandir(keep):
        target = folder / e.name
        if e.is_dir(follow_symlinks=False):
            target.mkdir()
        elif e.is_symlink():
            os.symlink(os.readlink(e.path), target)
            continue
        else:
            target.touch()
        mount("--bind", e.path, str(target))


def hide_except(repo: Path, keep: str, scratch: Path) -> None:
    """Cover `repo` with an empty tmpfs and bind back only `keep` (its virtual environment)."""
    saved = scratch / "repo"
    saved.mkdir()
    mount("--bind", str(repo), str(saved))
    mount("-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(repo))
    (repo / keep).mkdir()
    mount("--bind", str(saved / keep), str(repo / keep))


def main(argv: list[str]) -> int:
    repo = Path(argv[0]).resolve()
    command = argv[argv.index("--") + 1:]
    scratch = Path(f"/tmp/memlab-container-{os.getpid()}")
    scratch.mkdir(mode=0o700)
    mount("-t", "tmpfs", "-o", "mode=0700", "tmpfs", str(scratch))
    mount("-t", "tmpfs", "-o", "ro", "tmpfs", "/proc/acpi")          # what Docker does to /proc (masked paths)
    needed = {Path(sys.base_prefix).resolve(), Path(os.path.realpath(sys.executable)).parent,
              repo / ".venv"}
    for path in needed:
        for folder in reversed([path, *path.parents]):
            mode = folder.stat().st_mode
            if folder != Path("/") and not (mode & stat.S_IXOTH and mode & stat.S_IROTH) and folder.is_dir():
                open_up(folder, scratch)
    hide_except(repo, ".venv", scratch)
    os.execvp(command[0], command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
