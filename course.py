#!/usr/bin/env python3
"""GPU Memory Lab: the two commands.

    python3 course.py start     set up .venv (first run only) and open lesson 01 in JupyterLab
    python3 course.py test      set up .venv (first run only) and run every test

Needs Python 3.10+ and pip. PyTorch is installed first, pinned (COURSE_TORCH
overrides the pin, e.g. COURSE_TORCH="torch" for the newest CUDA build), then
the course package with everything in pyproject.toml.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
TORCH = os.environ.get("COURSE_TORCH", "torch==2.13.0")
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".course-installed"


def run(*cmd: str | Path) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, cwd=ROOT)


def setup() -> None:
    if sys.version_info < (3, 10):
        sys.exit(f"GPU Memory Lab needs Python 3.10 or newer; this is {sys.version.split()[0]}")
    if not PY.exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + TORCH.encode()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == want:
        return
    # torch first, pinned: a loose requirement would pull the newest build and its CUDA wheels
    run(PY, "-m", "pip", "install", "--quiet", TORCH)
    run(PY, "-m", "pip", "install", "--quiet", "-e", ".")
    STAMP.write_text(want)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("start", "test"):
        print(__doc__)
        return 2
    setup()
    if argv[0] == "start":
        # serve the whole course (lessons and exercises), opening lesson 01
        os.execv(str(PY), [str(PY), "-m", "jupyterlab", f"--ServerApp.root_dir={ROOT}",
                           "--LabApp.default_url=/lab/tree/lessons/01_memory_anatomy.ipynb", *argv[1:]])
    # tests: CI and contributors; extra arguments go to pytest (e.g. -m "not slow")
    return subprocess.run([str(PY), "-m", "pytest", "-ra", *argv[1:]], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
