"""The README's examples run as written: every `memlab-fit` and `memlab-grade check` command in its shell blocks
(the check from a `course.py sync` copy, where the README sends learners), the Python taste of the kit, and the
figure the README quotes from the first `memlab-fit` command."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent
BLOCKS = re.findall(r"```(bash|python)\n(.*?)```", README, re.S)
COMMANDS = [line.strip() for kind, body in BLOCKS if kind == "bash" for line in body.splitlines()
            if line.strip().startswith(("memlab-fit", "memlab-grade check"))]


def _run(cmd: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    argv = shlex.split(cmd)
    argv[0] = str(BIN / argv[0])
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def test_the_readme_has_the_examples_this_file_runs():
    assert sum(c.startswith("memlab-fit") for c in COMMANDS) >= 3, COMMANDS
    assert any(c.startswith("memlab-grade check") for c in COMMANDS), COMMANDS
    assert any(kind == "python" for kind, _ in BLOCKS)


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [c for c in COMMANDS if c.startswith("memlab-fit")])
def test_memlab_fit_examples_run_as_written(cmd):
    out = _run(cmd, ROOT)
    assert out.returncode == 0 and "Traceback" not in out.stderr, f"{cmd}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    assert re.search(r": (FITS|FITS \(BORDERLINE\)|DOES NOT FIT): needs ", out.stdout), out.stdout[:500]
    if cmd == COMMANDS[0]:        # the README quotes this command's verdict line
        quoted = re.search(r'the first command printed "([^"]+)"', README.replace("\n", " "))
        assert quoted and quoted.group(1) in out.stdout, \
            f"README quotes {quoted.group(1) if quoted else None!r}; the command printed {out.stdout.splitlines()[0]!r}"


@pytest.mark.slow
def test_memlab_grade_check_runs_from_the_working_copy(tmp_path):
    import course
    course.sync_work(ROOT, tmp_path / "my-work")
    cmd = next(c for c in COMMANDS if c.startswith("memlab-grade check"))
    out = _run(cmd, tmp_path / "my-work", timeout=900)
    # an untouched exercise earns nothing, but the command runs and prints its table
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "task1_" in out.stdout and re.search(r"\d+(\.\d+)? */ *\d+", out.stdout), out.stdout[-2000:]


@pytest.mark.slow
def test_the_python_taste_of_the_kit_runs(tmp_path):
    code = next(body for kind, body in BLOCKS if kind == "python")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "peak" in out.stdout.lower()
