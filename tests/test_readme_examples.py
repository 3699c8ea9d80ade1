"""The README's examples run as written: every `python3 course.py fit` and `python3 course.py grade check` command
in its shell blocks (the course's tools from any shell, the check on a `course.py sync` copy, where the README
sends learners), the Python taste of the kit, and the figure the README quotes from the first fit command; the
same check as typed in JupyterLab's terminal (`memlab-grade check`, in my-work/) is shown to be that command."""

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
SHELL = [line.strip() for kind, body in BLOCKS if kind == "bash" for line in body.splitlines()]
COURSE = [c for c in SHELL if c.startswith(("python3 course.py fit", "python3 course.py grade"))]
FIT = [c for c in COURSE if c.startswith("python3 course.py fit")]
TERMINAL = [c for c in SHELL if c.startswith("memlab-grade check")]       # JupyterLab's terminal


def _argv(cmd: str) -> list[str]:
    """A README command as this test runs it: `python3 course.py` is this Python running the repository's
    course.py (the folder the command is run in may be another: paths in it are relative to that folder), a bare
    `memlab-...` is the course's script (on PATH in JupyterLab's terminal)."""
    argv = shlex.split(cmd)
    if argv[:2] == ["python3", "course.py"]:
        return [sys.executable, str(ROOT / "course.py"), *argv[2:]]
    return [str(BIN / argv[0]), *argv[1:]]


def _run(cmd: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    return subprocess.run(_argv(cmd), cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def set_up():
    """`python3 course.py fit/grade` set .venv up first: here it must already be what course.py would install
    (`python3 course.py test` made it so), or the command would install instead of running."""
    import course
    current = course.STAMP.exists() and course.STAMP.read_text() == course.install_key()
    if not current or Path(sys.executable).resolve() != course.PY.resolve():
        msg = ("this Python is not course.py's up-to-date .venv (run the tests with `python3 course.py test`): "
               "course.py fit/grade would install first")
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def test_the_readme_has_the_examples_this_file_runs():
    assert len(FIT) >= 3, COURSE
    assert any(c.startswith("python3 course.py grade check") for c in COURSE), COURSE
    assert TERMINAL, "README.md shows the check as typed in JupyterLab's terminal"
    assert any(kind == "python" for kind, _ in BLOCKS)
    # no shell block shows a bare course script: in a normal shell it is "command not found"
    bare = [c for body in (b for k, b in BLOCKS if k == "bash") for c in body.splitlines()
            if c.strip().startswith(("memlab-fit", "memlab-grade")) and c.strip() not in TERMINAL]
    assert not bare, f"README.md shows {bare}: write them as python3 course.py fit/grade ..."


@pytest.mark.slow
@pytest.mark.parametrize("cmd", FIT)
def test_fit_examples_run_as_written(cmd, set_up):
    out = _run(cmd, ROOT)
    assert out.returncode == 0 and "Traceback" not in out.stderr, f"{cmd}\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    if "--max-seq" in cmd or "--max-batch" in cmd:          # the limit, and what one more token or sequence needs
        assert re.search(r"largest (seq|batch) that fits: [\d,]+ ", out.stdout) and "would need" in out.stdout, \
            out.stdout[:500]
        return
    assert re.search(r": (FITS|FITS \(BORDERLINE\)|DOES NOT FIT): needs ", out.stdout), out.stdout[:500]
    assert "course.py: [1/3]" not in out.stdout, "course.py installed instead of running the command"
    if cmd == FIT[0]:        # the README quotes this command's verdict line
        quoted = re.search(r'the first command printed "([^"]+)"', README.replace("\n", " "))
        assert quoted and quoted.group(1) in out.stdout, \
            f"README quotes {quoted.group(1) if quoted else None!r}; the command printed {out.stdout.splitlines()[0]!r}"


def _check_ran(out: subprocess.CompletedProcess) -> None:
    # an untouched exercise earns nothing, but the command runs and prints its table
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "task1_" in out.stdout and re.search(r"\d+(\.\d+)? */ *\d+", out.stdout), out.stdout[-2000:]


@pytest.mark.slow
def test_grade_check_runs_on_the_working_copy_from_any_shell(tmp_path, set_up):
    """`python3 course.py grade check my-work/exercises/...`, typed in the folder that holds my-work/."""
    import course
    course.sync_work(ROOT, tmp_path / "my-work")
    cmd = next(c for c in COURSE if c.startswith("python3 course.py grade check"))
    _check_ran(_run(cmd, tmp_path, timeout=900))


def test_the_terminal_check_is_the_same_command_from_my_work():
    """`memlab-grade check exercises/...` typed in JupyterLab's terminal (in my-work/, the course's scripts first on
    PATH: course.server_env) is the command above, run from my-work/: the same script `course.py grade` runs, the
    same notebook. (Grading it a second time would add half a minute to the suite for nothing.)"""
    import course
    shell = shlex.split(next(c for c in COURSE if c.startswith("python3 course.py grade check")))
    terminal = shlex.split(TERMINAL[0])
    assert terminal[0] == course.TOOLS["grade"] and shell[2] == "grade" and terminal[1:-1] == shell[3:-1]
    assert Path(shell[-1]) == Path(course.WORK.name) / terminal[-1], (shell, terminal)
    assert course.server_env({"PATH": "/usr/bin"})["PATH"].split(os.pathsep)[0] == str(course.BIN)
    assert (ROOT / terminal[-1]).exists(), f"{terminal[-1]} is not an exercise of the course"


@pytest.mark.slow
def test_the_python_taste_of_the_kit_runs(tmp_path):
    code = next(body for kind, body in BLOCKS if kind == "python")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "peak" in out.stdout.lower()
