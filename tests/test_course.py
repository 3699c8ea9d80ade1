"""The first hour: course.py's commands, hints, JupyterLab command line and server
environment, the learner's working copy, the GPU recorder's refusal without CUDA,
the loader of recorded GPU numbers, and library noise kept out of outputs.
Nothing here creates a virtual environment or starts JupyterLab."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import course
import memlab
from memlab.hardware import recorded

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- commands
def test_unknown_command_fails_with_a_message(capsys):
    assert course.main(["strat"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'strat'" in err and "start" in err and "test" in err


def test_unknown_command_exit_status_from_the_shell():
    out = subprocess.run([sys.executable, str(ROOT / "course.py"), "bogus"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "unknown command 'bogus'" in out.stderr


def test_help_documents_the_jupyterlab_options(capsys):
    assert course.main(["help"]) == 0
    doc = capsys.readouterr().out
    for word in ("--no-browser", "--ip", "--port", "--allow-root", "my-work", "memlab-grade"):
        assert word in doc, f"course.py help should mention {word}"
    assert course.main([]) == 2                                    # no command: usage, non-zero


def test_failures_become_one_line_hints(capsys, monkeypatch):
    def broken():
        raise course.CourseError(".venv has no pip: remove it (rm -rf .venv) and run the command again")
    monkeypatch.setattr(course, "setup", broken)
    assert course.main(["test"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("course.py: .venv has no pip")


def test_venv_without_python_or_pip_gets_a_recreate_hint(tmp_path, monkeypatch):
    venv_dir = tmp_path / ".venv"
    venv_dir.mkdir()
    monkeypatch.setattr(course, "VENV", venv_dir)
    monkeypatch.setattr(course, "PY", venv_dir / "bin" / "python")
    monkeypatch.setattr(course, "STAMP", venv_dir / ".course-installed")
    with pytest.raises(course.CourseError, match=r"rm -rf \.venv"):
        course.setup()                                             # .venv without a python
    (venv_dir / "bin").mkdir()
    (venv_dir / "bin" / "python").write_text("")
    monkeypatch.setattr(course, "_has_pip", lambda: False)
    with pytest.raises(course.CourseError, match=r"no pip.*rm -rf \.venv"):
        course.setup()                                             # a python without pip


def test_pip_failure_names_what_to_do(monkeypatch, capsys):
    monkeypatch.setattr(course, "installer", lambda: [sys.executable, "-c", "raise SystemExit(1)", "--"])
    with pytest.raises(course.CourseError, match="internet connection"):
        course._pip(["torch==0"], "pip could not install PyTorch: check the internet connection")


# what pip 23 and uv 0.13 printed on this machine for each cause (abridged to the lines diagnose reads)
PIP_CONFLICT = """ERROR: Cannot install nbconvert because these package versions have conflicting dependencies.

The conflict is caused by:
    beautifulsoup4 4.15.0 depends on soupsieve>=1.6.1
    The user requested (constraint) soupsieve==4.1.3

ERROR: ResolutionImpossible: for help visit https://pip.pypa.io/en/latest/topics/dependency-resolution/
"""
PIP_NO_RELEASE = """ERROR: Ignored the following versions that require a different python version: 2.3.0 \
Requires-Python >=3.11
ERROR: Could not find a version that satisfies the requirement numpy==2.4.6 (from versions: 2.2.5, 2.2.6)
ERROR: No matching distribution found for numpy==2.4.6
"""
UV_CONFLICT = """  x No solution found when resolving dependencies:
  `-> Because the requested Python version (>=3.10) does not satisfy Python>=3.11 and numpy==2.4.6 depends on
      Python>=3.11, we can conclude that numpy==2.4.6 cannot be used.
"""
PIP_OFFLINE = """WARNING: Retrying (Retry(total=4)) after connection broken by 'NewConnectionError(...: \
Failed to establish a new connection: [Errno -3] Temporary failure in name resolution')': /simple/numpy/
ERROR: Could not find a version that satisfies the requirement numpy==2.4.6 (from versions: none)
ERROR: No matching distribution found for numpy==2.4.6
"""
PIP_DISK = "ERROR: Could not install packages due to an OSError: [Errno 28] No space left on device\n"


@pytest.mark.parametrize("output, cause", [
    (PIP_CONFLICT, "a version conflict, not the network: no set of versions fits together on Python 3.10.13"),
    (PIP_NO_RELEASE, "a version conflict, not the network: no release of numpy==2.4.6 installs on Python 3.10.13 "
                     "(releases that need another Python were skipped)"),
    (UV_CONFLICT, "a version conflict, not the network"),
    (PIP_OFFLINE, "the network failed"),
    (PIP_DISK, "the disk is full"),
    ("ERROR: something else entirely\n", None)])
def test_an_install_failure_names_its_cause(output, cause):
    said = course.diagnose(output, python="3.10.13")
    if cause is None:
        assert said is None
    else:
        assert said.startswith(cause) and "\n" not in said, said
    if cause and "conflict" in cause:
        assert "network" not in said.split("not the network")[1] and "COURSE_CONSTRAINTS=none" in said
    if said and "conflict is caused" in output:
        assert "The user requested (constraint) soupsieve==4.1.3" in said       # pip's own reason, quoted


def test_the_installers_message_reaches_the_hint_and_the_terminal(monkeypatch, capsys):
    """pip's stderr is shown as it comes and read for the cause: a conflict is not reported as the network."""
    script = f"import sys; sys.stderr.write({PIP_CONFLICT!r}); raise SystemExit(1)"
    monkeypatch.setattr(course, "installer", lambda: [sys.executable, "-c", script, "--"])
    with pytest.raises(course.CourseError) as err:
        course._pip(["x"], "check the internet connection", what="installing the course's packages")
    assert str(err.value).startswith("installing the course's packages failed: a version conflict, not the network")
    assert "internet" not in str(err.value)
    assert "ResolutionImpossible" in capsys.readouterr().err


@pytest.mark.parametrize("version", [(3, 9, 18), (3, 14, 0), (3, 8, 10)])
def test_an_unsupported_python_is_refused_in_one_line(version):
    said = course.python_refusal(version, command="start", which=lambda name: None)
    assert said.startswith("GPU Memory Lab runs on Python 3.10, 3.11, 3.12 or 3.13; this is Python "
                           + ".".join(map(str, version))) and "\n" not in said
    found = course.python_refusal(version, command="test",
                                  which=lambda n: f"/usr/bin/{n}" if n == "python3.12" else None)
    assert "run `python3.12 course.py test`" in found
    for ok in course.SUPPORTED:
        assert course.python_refusal((*ok, 0)) is None


def _old_python() -> str | None:
    for exe in [shutil.which(f"python3.{m}") for m in (6, 7, 8, 9)] + sorted(
            str(p) for p in Path.home().glob(".pyenv/versions/3.[6789].*/bin/python")):
        if exe and subprocess.run([exe, "-c", "import sys; assert sys.version_info < (3, 10)"],
                                  capture_output=True).returncode == 0:
            return exe
    return None


def test_an_old_python_gets_the_refusal_before_anything_happens():
    """The real thing: course.py run by Python 3.6-3.9 (the oldest installed here) prints the one line and stops;
    it creates and downloads nothing (it does not get as far as .venv)."""
    exe = _old_python()
    if exe is None:
        pytest.skip("no Python 3.6-3.9 on this machine")
    out = subprocess.run([exe, str(ROOT / "course.py"), "start"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 1 and out.stdout == "", (out.stdout, out.stderr)
    line, = out.stderr.splitlines()
    assert line.startswith("course.py: GPU Memory Lab runs on Python 3.10, 3.11, 3.12 or 3.13; this is Python 3.")


def test_the_installed_pytorch_is_named_with_its_build(monkeypatch):
    import torch
    monkeypatch.setattr(course, "PY", Path(sys.executable))
    said = course.torch_report()
    assert said.startswith(f"PyTorch {torch.__version__}, the ")
    build = ("CUDA" if torch.version.cuda else "macOS" if sys.platform == "darwin" else "CPU-only")
    assert build in said
    monkeypatch.setattr(course, "PY", Path(sys.executable).parent / "no-such-python")
    with pytest.raises((course.CourseError, OSError)):
        course.torch_report()


def test_fit_and_grade_run_the_courses_tools_from_any_folder(tmp_path, monkeypatch):
    """`python3 course.py fit ...` and `grade ...` run .venv's memlab-fit and memlab-grade with the arguments as
    given, in the folder where they were typed (no PATH needed)."""
    calls = []
    monkeypatch.setattr(course, "setup", lambda: calls.append("setup"))
    monkeypatch.setattr(course.subprocess, "run",
                        lambda cmd, **kw: calls.append((cmd, kw)) or subprocess.CompletedProcess(cmd, 3))
    monkeypatch.chdir(tmp_path)
    assert course.main(["fit", "llama-2-7b", "--gpu", "T4-16GB"]) == 3
    assert course.main(["grade", "check", "my.ipynb"]) == 3
    (fit, kw1), (grade, _) = calls[1], calls[3]
    assert calls[0] == calls[2] == "setup"
    assert fit == [str(course.BIN / "memlab-fit"), "llama-2-7b", "--gpu", "T4-16GB"] and "cwd" not in kw1
    assert grade == [str(course.BIN / "memlab-grade"), "check", "my.ipynb"]
    for tool in course.TOOLS.values():
        assert f"{tool} = " in (ROOT / "pyproject.toml").read_text(), f"pyproject.toml installs no {tool} script"


# ----------------------------------------------------------------------------- JupyterLab
def test_running_as_root_adds_allow_root(monkeypatch):
    monkeypatch.setattr(course.os, "geteuid", lambda: 0, raising=False)
    assert course.running_as_root()
    monkeypatch.setattr(course.os, "geteuid", lambda: 1000, raising=False)
    assert not course.running_as_root()
    assert "--allow-root" in course.jupyter_command([], as_root=True)
    assert "--allow-root" not in course.jupyter_command([], as_root=False)
    assert course.jupyter_command(["--allow-root"], as_root=True).count("--allow-root") == 1


def test_jupyter_command_opens_lesson_01_in_the_working_copy_and_passes_options_on():
    opts = ["--no-browser", "--ip=0.0.0.0", "--port", "8888"]
    cmd = course.jupyter_command(opts, as_root=False, environ={"SHELL": "/bin/bash"})
    assert cmd[-4:] == opts
    assert f"--ServerApp.root_dir={course.WORK}" in cmd
    assert "--LabApp.default_url=/lab/tree/lessons/01_memory_anatomy.ipynb" in cmd
    assert (ROOT / "lessons" / "01_memory_anatomy.ipynb").exists()
    if os.name != "nt":   # a plain (not login) shell, so /etc/profile cannot reset PATH in the terminal
        assert f'--ServerApp.terminado_settings=shell_command=["/bin/bash", "--rcfile", "{course.TERMINAL_RC}"]' in cmd
        cmd = course.jupyter_command([], as_root=False, environ={"SHELL": "/bin/zsh"})
        assert '--ServerApp.terminado_settings=shell_command=["/bin/zsh"]' in cmd


@pytest.mark.skipif(os.name == "nt" or not shutil.which("bash"), reason="bash start-up files")
def test_the_terminals_python_is_the_courses_whatever_bashrc_does(tmp_path):
    """A ~/.bashrc that puts another python first (as pyenv and conda init do): the terminal's bash still finds
    the course's python first, and the user's .bashrc still ran."""
    home = tmp_path / "home"
    other = tmp_path / "other-python"
    for d in (home, other):
        d.mkdir()
    (other / "python").write_text("#!/bin/sh\necho other\n")
    (other / "python").chmod(0o755)
    (home / ".bashrc").write_text(f'export PATH={other}:"$PATH"\nexport FROM_BASHRC=yes\n')
    rc = course.write_terminal_rc(tmp_path / "course-bashrc")
    out = subprocess.run(["bash", "--rcfile", str(rc), "-i", "-c", 'command -v python; echo "$FROM_BASHRC"'],
                         env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                         timeout=30)
    lines = out.stdout.split()
    assert lines == [str(course.BIN / "python"), "yes"], (out.stdout, out.stderr)


def test_server_path_starts_with_the_course_environment():
    env = course.server_env({"PATH": os.pathsep.join(["/usr/bin", "/bin"]), "PYTHONHOME": "/elsewhere"})
    parts = env["PATH"].split(os.pathsep)
    assert parts[0] == str(course.BIN) and parts[1:] == ["/usr/bin", "/bin"]
    assert env["VIRTUAL_ENV"] == str(course.VENV) and "PYTHONHOME" not in env
    assert (course.BIN / "memlab-grade").name == "memlab-grade"  # the script pyproject installs there
    assert 'memlab-grade = "autograder.cli:main"' in (ROOT / "pyproject.toml").read_text()


def test_learner_and_instructor_servers_differ_only_where_they_should(tmp_path):
    env = {"PATH": "/usr/bin", "SHELL": "/bin/bash", "JUPYTER_CONFIG_PATH": "/theirs"}
    cfg = course.write_learner_config(tmp_path / "cfg")
    cmd, cwd, learner_env = course.server(["--port=9"], instructor=False, as_root=False, work=tmp_path / "w",
                                          learner_config=cfg, environ=env)
    assert cwd == tmp_path / "w" and f"--ServerApp.root_dir={tmp_path / 'w'}" in cmd and cmd[-1] == "--port=9"
    assert learner_env["JUPYTER_CONFIG_PATH"].split(os.pathsep) == [str(cfg), "/theirs"]
    server_cfg = json.loads((cfg / "jupyter_server_config.json").read_text())["ServerApp"]["jpserver_extensions"]
    assert server_cfg == {name: False for name in course.NBGRADER_INSTRUCTOR_SERVER}
    lab_cfg = json.loads((cfg / "labconfig" / "page_config.json").read_text())["disabledExtensions"]
    assert {"@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:validate-assignment"} <= set(lab_cfg)
    assert "@jupyterlab/apputils-extension:announcements" in lab_cfg                  # no news pop-ups
    icfg = course.write_instructor_config(tmp_path / "icfg")
    cmd, cwd, inst_env = course.server([], instructor=True, as_root=False, course_root=tmp_path, environ=env,
                                       instructor_config=icfg)
    assert cwd == tmp_path and f"--ServerApp.root_dir={tmp_path}" in cmd      # where nbgrader_config.py is
    assert inst_env["JUPYTER_CONFIG_PATH"].split(os.pathsep) == [str(icfg), "/theirs"]
    inst_lab = json.loads((icfg / "labconfig" / "page_config.json").read_text())["disabledExtensions"]
    assert list(inst_lab) == list(course.LAB_NEWS)                            # only the news: nbgrader all on
    assert not (icfg / "jupyter_server_config.json").exists()
    assert course.INSTRUCTOR not in cmd


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    """A JupyterLab server started as course.py starts it, on a free local port, with a known token."""

    def __init__(self, tmp: Path, **kw):
        import secrets
        self.port, self.token = _free_port(), secrets.token_hex(16)
        opts = ["--no-browser", f"--port={self.port}", "--ServerApp.ip=127.0.0.1",
                f"--IdentityProvider.token={self.token}"]
        # the user's own ~/.jupyter stays out of it
        environ = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp / "jupyter-config"),
                   "JUPYTER_RUNTIME_DIR": str(tmp / "jupyter-runtime")}
        cmd, cwd, env = course.server(opts, as_root=course.running_as_root(), environ=environ, **kw)
        self.log = open(tmp / f"server-{self.port}.log", "w")
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)

    def get(self, path: str) -> tuple[int, str]:
        import urllib.error
        import urllib.request
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     headers={"Authorization": f"token {self.token}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def wait(self, timeout: float = 120) -> None:
        import time
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            assert self.proc.poll() is None, f"JupyterLab exited: {Path(self.log.name).read_text()[-3000:]}"
            try:
                if self.get("/api/status")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"JupyterLab did not answer in {timeout} s: {Path(self.log.name).read_text()[-3000:]}")

    def page_config(self) -> dict:
        status, html = self.get("/lab")
        assert status == 200, html[:500]
        m = re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>', html, re.S)
        return json.loads(m.group(1))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.mark.slow
def test_formgrader_lists_a_class_run_and_learners_do_not_get_it(tmp_path):
    """After `memlab-grade class`, the instructor's server (`course.py start --instructor`) shows the graded
    submissions in Formgrader, none flagged for manual grading (every cell is autograded), and no exchange
    warning; a learner's server (`course.py start`) serves no Formgrader and loads no instructor plugin."""
    from autograder import grade
    from test_trusted_grading import A, make
    root = tmp_path / "course"
    drill = grade.drill_course(root)
    subs = tmp_path / "submissions"
    subs.mkdir()
    (subs / "ada.ipynb").write_text(json.dumps(make(drill)))                            # full marks
    (subs / "bob.ipynb").write_text(json.dumps(make(drill, storage=None, softmax=None)))  # as released: zero
    res = grade.grade_class(subs, A, timeout=120, course=drill, jobs=2, log=lambda s: None)
    assert not res.failed and set(res.graded) == {"ada", "bob"}
    course.EXCHANGE.mkdir(parents=True, exist_ok=True)                  # as `start --instructor` does

    srv = _Server(tmp_path, instructor=True, course_root=root,
                  instructor_config=course.write_instructor_config(tmp_path / "ic"))
    try:
        srv.wait()
        status, body = srv.get(f"/formgrader/api/submissions/{A}")
        assert status == 200, body[:1000]
        rows = {r["student"]: r for r in json.loads(body)}
        assert set(rows) == {"ada", "bob"} and all(r["autograded"] for r in rows.values())
        assert (rows["ada"]["score"], rows["ada"]["max_score"], rows["bob"]["score"]) == (6.0, 6.0, 0.0)
        assert not [s for s, r in rows.items() if r["needs_manual_grade"]], "autograded cells need no manual grade"
        status, body = srv.get(f"/formgrader/api/submitted_notebooks/{A}/{A}")
        notebooks = json.loads(body)
        assert status == 200 and len(notebooks) == 2 and not any(n["needs_manual_grade"] for n in notebooks)
        status, page = srv.get(f"/formgrader/submissions/{notebooks[0]['id']}/")     # the graded notebook opens
        assert status == 200 and "task99_1_storage_bytes" in page, page[:1000]
        status, page = srv.get("/formgrader/manage_assignments")
        warnings = re.findall(r'<div class="alert alert-warning" id="(warning-[^"]+)">\s*(.*?)</div>', page, re.S)
        assert status == 200 and not warnings, warnings                       # the exchange warning included
        status, body = srv.get("/formgrader/api/assignments")
        assert status == 200 and [a["name"] for a in json.loads(body)] == [A]
        disabled = srv.page_config().get("disabledExtensions", [])
        assert not [p for p in disabled if p.startswith("@jupyter/nbgrader")], disabled
        assert set(course.LAB_NEWS) <= set(disabled), disabled
    finally:
        srv.stop()

    work = tmp_path / "my-work"
    work.mkdir()
    srv = _Server(tmp_path, instructor=False, work=work, learner_config=course.write_learner_config(tmp_path / "lc"))
    try:
        srv.wait()
        for path in ("/formgrader", "/formgrader/api/assignments", "/formgrader/manage_assignments"):
            assert srv.get(path)[0] == 404, f"a learner's server serves {path}"
        import nbgrader
        status, body = srv.get(f"/nbgrader_version?version={nbgrader.__version__}")   # Validate's server side too
        assert status == 404, body[:500]
        disabled = srv.page_config().get("disabledExtensions", [])
        assert set(course.NBGRADER_INSTRUCTOR_LAB) | set(course.LAB_NEWS) <= set(disabled), disabled
        assert "@jupyter/nbgrader:validate-assignment" in disabled
    finally:
        srv.stop()


# ----------------------------------------------------------------------------- the working copy
def _nb(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_sync_adds_new_files_and_never_overwrites_a_changed_one(tmp_path):
    src, dest = tmp_path / "course", tmp_path / "my-work"
    _nb(src / "lessons" / "01_a.ipynb", "course v1 of 01")
    _nb(src / "lessons" / "02_b.ipynb", "course v1 of 02")
    _nb(src / "exercises" / "01_x" / "01_x.ipynb", "exercise v1")
    _nb(src / "lessons" / ".ipynb_checkpoints" / "01_a-checkpoint.ipynb", "autosave")
    first = course.sync_work(src, dest)
    assert sorted(first.added) == ["exercises/01_x/01_x.ipynb", "lessons/01_a.ipynb", "lessons/02_b.ipynb"]
    assert not (dest / "lessons" / ".ipynb_checkpoints").exists()

    (dest / "lessons" / "01_a.ipynb").write_text("my notes and outputs")           # the learner works
    _nb(src / "lessons" / "01_a.ipynb", "course v2 of 01")                           # the course moves on
    _nb(src / "lessons" / "02_b.ipynb", "course v2 of 02")                           # (02 untouched by learner)
    _nb(src / "lessons" / "03_c.ipynb", "course v1 of 03")                           # a new lesson
    second = course.sync_work(src, dest)
    assert (dest / "lessons" / "01_a.ipynb").read_text() == "my notes and outputs"
    assert second.kept == ["lessons/01_a.ipynb"]
    assert second.updated == ["lessons/02_b.ipynb"]
    assert (dest / "lessons" / "02_b.ipynb").read_text() == "course v2 of 02"
    assert second.added == ["lessons/03_c.ipynb"] and (dest / "lessons" / "03_c.ipynb").read_text() == "course v1 of 03"
    assert any("01_a.ipynb" in line and "kept" in line for line in second.lines(dest))

    (dest / "lessons" / "01_a.ipynb").rename(dest / "lessons" / "01_a-mine.ipynb")  # how to get the new one
    third = course.sync_work(src, dest)
    assert third.added == ["lessons/01_a.ipynb"] and (dest / "lessons" / "01_a-mine.ipynb").exists()
    assert course.sync_work(src, dest).lines(dest) == []                              # nothing new: silent


def test_sync_checks_its_arguments():
    with pytest.raises(TypeError, match="pathlib.Path"):
        course.sync_work("lessons", Path("x"))


def test_working_copy_of_the_course_grades_and_links(tmp_path):
    from autograder import grade
    work = tmp_path / "my-work"
    report = course.sync_work(ROOT, work)
    lessons = sorted(p.name for p in (ROOT / "lessons").glob("*.ipynb"))
    assert lessons and all(f"lessons/{n}" in report.added for n in lessons)
    exercises = sorted(work.glob("exercises/*/*.ipynb"))
    assert exercises
    for nb_path in exercises:             # `memlab-grade check my-work/exercises/...` finds it by its file name
        assert grade._assignment_of(nb_path) == nb_path.parent.name
    for nb_path in sorted(work.rglob("*.ipynb")):
        nb = nbformat.read(nb_path, as_version=4)
        assert "import memlab" in nb.cells[1].source       # the installed package, not a path into the repo
        for cell in nb.cells:
            if cell.cell_type != "markdown":
                continue
            for link in re.findall(r"\]\(([^)#\s]+\.(?:ipynb|md|py|png))\)", cell.source):
                if "://" not in link:
                    assert (nb_path.parent / link).exists(), f"{nb_path.relative_to(work)} links to {link}"


# ----------------------------------------------------------------------------- recorded GPU numbers
def test_record_gpu_refuses_without_cuda(tmp_path):
    out = tmp_path / "rec"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "record_gpu.py"), "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode != 0
    assert "needs a CUDA GPU" in res.stderr and "nothing was written" in res.stderr
    assert not out.exists()


def _fake_meta(gpu="Tesla T4", date="2030-01-01 00:00 UTC"):
    return {"gpu": gpu, "total_memory_bytes": 15 * 2**30, "compute_capability": "7.5", "driver": "999.1",
            "cuda": "12.9", "torch": "9.9.9", "date": date, "command": "python benchmarks/record_gpu.py"}


def test_no_recording_is_said_plainly(tmp_path):
    assert recorded.load(directory=tmp_path) is None
    assert recorded.load(directory=tmp_path / "missing") is None
    assert recorded.show("fragmentation", directory=tmp_path) == recorded.NO_RECORDING
    assert "record_gpu.py" in recorded.NO_RECORDING
    assert "'A100'" in recorded.show(gpu="A100", directory=tmp_path)


def test_recording_round_trip_is_labelled(tmp_path):
    """A synthetic recording (test data only, never committed) written by the recorder's own writer."""
    from benchmarks.record_gpu import write_recording
    exps = {"fragmentation": {"steps": [{"what": "8 blocks of 5 MiB", "allocated_bytes": 40 * 2**20,
                                         "reserved_bytes": 40 * 2**20}]},
            "matmul": {"rows": [{"format": "fp16", "ms": 2.5, "tflops": 55.0}]}}
    path = write_recording(_fake_meta(), exps, tmp_path)
    assert path.name == "tesla-t4.json"
    write_recording(_fake_meta("NVIDIA A100-SXM4-80GB", "2031-01-01 00:00 UTC"), exps, tmp_path)
    rec = recorded.load(directory=tmp_path)
    assert rec.gpu == "NVIDIA A100-SXM4-80GB"                       # the newest by default
    rec = recorded.load("t4", directory=tmp_path)
    assert rec.gpu == "Tesla T4" and rec.snapshot is None
    text = recorded.show("fragmentation", gpu="T4", directory=tmp_path)
    first = text.splitlines()[0]
    for part in ("RECORDED on Tesla T4", "driver 999.1", "CUDA 12.9", "torch 9.9.9", "not measured on this machine"):
        assert part in first
    assert "40.00 MiB" in text and "8 blocks of 5 MiB" in text
    with pytest.raises(ValueError, match="must be one of"):
        rec.show("nonsense")


def test_recorded_checks_its_inputs(tmp_path):
    with pytest.raises(ValueError, match="gpu"):
        recorded.load(gpu="")
    with pytest.raises(TypeError, match="directory"):
        recorded.load(directory="memlab/hardware/recordings")
    with pytest.raises(ValueError, match="gpu_name"):
        recorded.file_stem("  ")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        recorded.load(directory=tmp_path)
    (tmp_path / "broken.json").write_text(json.dumps({"schema": 1, "meta": {}, "experiments": {}}))
    with pytest.raises(ValueError, match="missing"):
        recorded.load(directory=tmp_path)


def test_committed_recordings_load_and_are_labelled():
    for path in recorded.available():      # none until a GPU run is committed
        rec = recorded.Recording.from_file(path)
        assert rec.show().startswith(f"RECORDED on {rec.gpu}")


# ----------------------------------------------------------------------------- library noise
def test_known_library_noise_is_dropped_and_other_warnings_kept():
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    for name in memlab.core.device.NOISE:
        logger = logging.getLogger(name)
        # only memlab.core.device's own filter: other code in this process (a lesson's silence_libraries) may have
        # added filters of its own to these loggers
        saved, level = logger.filters[:], logger.level
        logger.filters = [f for f in saved if isinstance(f, memlab.core.device._DropMessages)]
        logger.setLevel(logging.WARNING)
        logger.addHandler(handler)
        try:
            logger.warning(f"{memlab.core.device.NOISE[name][0]} (as the library says it)")
            logger.warning("a warning that matters")
        finally:
            logger.removeHandler(handler)
            logger.filters, logger.level = saved, level
    assert [r.getMessage() for r in seen] == ["a warning that matters"] * len(memlab.core.device.NOISE)


def test_a_fresh_process_that_imports_memlab_shows_no_library_noise():
    """As a notebook's kernel runs it (pytest resets warning filters around each test, so in a process of its own):
    a library's internal deprecation warning is dropped and another warning kept, and PyTorch's profiler, which
    writes "USDT:<date> <pid>:<tid> SyncActivityProfilerHandler.cpp:52] profiler_start" to stderr for every
    profile (lesson 01 showed it), prints nothing."""
    code = ("import memlab, torch, warnings\n"
            "from torch.profiler import profile, ProfilerActivity\n"
            "warnings.warn('`is_gradient_checkpointing` is deprecated and will be removed in v6.', FutureWarning)\n"
            "warnings.warn('a deprecation that matters', FutureWarning)\n"
            "with profile(activities=[ProfilerActivity.CPU], profile_memory=True):\n"
            "    torch.randn(8, 8) @ torch.randn(8, 8)\n"
            "print('profiled')")
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0 and "profiled" in out.stdout, out.stderr[-2000:]
    assert "a deprecation that matters" in out.stderr and "is_gradient_checkpointing" not in out.stderr, out.stderr
    assert "profiler_start" not in out.stderr and not re.search(r"\d+:\d+ \w+\.cpp", out.stderr), out.stderr


@pytest.mark.slow
def test_deepspeed_accelerator_message_is_gone_after_import_memlab():
    pytest.importorskip("deepspeed")
    code = ("{}from deepspeed.accelerator import get_accelerator; print(get_accelerator().device_name())")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    runs = {label: subprocess.run([sys.executable, "-c", code.format(pre)], capture_output=True, text=True,
                                  env=env, timeout=300)
            for label, pre in (("plain", ""), ("memlab", "import memlab; "))}
    plain, quiet = (runs[k].stdout + runs[k].stderr for k in ("plain", "memlab"))
    if "Setting accelerator to CPU" not in plain:
        pytest.skip("this DeepSpeed release does not print the message")
    assert "Setting accelerator to CPU" not in quiet and "cpu" in quiet


# ----------------------------------------------------------------------------- which PyTorch, and progress
def test_torch_choice_cpu_build_without_a_driver_and_its_fallbacks():
    args, why = course.torch_choice({}, linux_x86=True, driver=False, reachable=lambda url: True)
    assert args == [course.TORCH_PIN, "--index-url", course.CPU_INDEX] and "no NVIDIA driver" in why
    assert "COURSE_TORCH=" in why, "say how to get the CUDA build instead"
    args, why = course.torch_choice({}, linux_x86=True, driver=False, reachable=lambda url: False)
    assert args == [course.TORCH_PIN] and "cannot be reached" in why
    args, why = course.torch_choice({}, linux_x86=True, driver=True, reachable=lambda url: 1 / 0)
    assert args == [course.TORCH_PIN] and "CUDA build" in why          # a driver: the index is not even asked
    args, _ = course.torch_choice({}, linux_x86=False, driver=False, reachable=lambda url: 1 / 0)
    assert args == [course.TORCH_PIN]                                  # macOS, Windows, ARM: the default build
    args, why = course.torch_choice({"COURSE_TORCH": "torch==2.12.0 --index-url https://x"}, linux_x86=True,
                                    driver=False, reachable=lambda url: 1 / 0)
    assert args == ["torch==2.12.0", "--index-url", "https://x"] and "COURSE_TORCH" in why


def test_installer_prefers_uv_unless_told_otherwise(monkeypatch):
    monkeypatch.setattr(course.shutil, "which", lambda name: "/usr/bin/uv" if name == "uv" else None)
    monkeypatch.delenv("COURSE_INSTALLER", raising=False)
    assert course.installer()[:3] == ["/usr/bin/uv", "pip", "install"] and str(course.PY) in course.installer()
    monkeypatch.setenv("COURSE_INSTALLER", "pip")
    assert course.installer()[1:4] == ["-m", "pip", "install"]
    monkeypatch.setattr(course.shutil, "which", lambda name: None)
    monkeypatch.delenv("COURSE_INSTALLER")
    assert course.installer()[1:4] == ["-m", "pip", "install"]


def test_a_long_install_says_it_is_still_working(monkeypatch, capsys):
    monkeypatch.setattr(course, "installer", lambda: [sys.executable, "-c", "import time; time.sleep(0.5)", "--"])
    real_popen = course.subprocess.Popen

    class QuickWait(real_popen):                  # make the 30-second heartbeat fire at once
        def wait(self, timeout=None):
            if timeout == 30 and not getattr(self, "_beat", False):
                self._beat = True
                raise subprocess.TimeoutExpired(self.args, timeout)
            return super().wait()
    monkeypatch.setattr(course.subprocess, "Popen", QuickWait)
    course._pip(["x"], "hint", what="installing PyTorch")
    assert "still installing PyTorch" in capsys.readouterr().out


def test_lock_keeps_pinned_lines_without_pytorch_or_local_installs():
    freeze = ("torch==2.13.0+cpu\nnvidia-cublas-cu12==12.4.5.8\ntriton==3.1.0\nZebra==1.0\n-e git+https://x#egg=y\n"
              "gpu_memory_lab==0.1.0\nlocal @ file:///tmp/local\naccelerate==1.15.0\ncuda-bindings==13.5.0\n"
              "# a comment\n")
    assert course.lock_lines(freeze) == ["accelerate==1.15.0", "Zebra==1.0"]


def _lock():
    """constraints.txt as packaging Requirements: one exact pin each, a marker where it applies to some Pythons."""
    from packaging.requirements import Requirement
    reqs = [Requirement(line) for line in course.LOCK.read_text().splitlines() if line and not line.startswith("#")]
    assert reqs and all(len(r.specifier) == 1 and next(iter(r.specifier)).operator == "==" for r in reqs), \
        "constraints.txt holds name==version lines, each with an optional marker"
    return reqs


def _env(python: str, platform_tag: str = "x86_64-manylinux_2_28") -> dict[str, str]:
    """The marker environment of CPython `python` (e.g. 3.10.0) on Linux x86-64, for packaging's Marker.evaluate."""
    assert platform_tag == "x86_64-manylinux_2_28"
    return {"python_version": ".".join(python.split(".")[:2]), "python_full_version": python, "os_name": "posix",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "platform_release": "", "platform_version": "", "implementation_version": python, "extra": ""}


def test_the_lock_is_what_the_tests_run_with():
    """The lines of constraints.txt that apply to this Python name the versions installed here (course.py installs
    with it): a package upgraded by hand without `course.py lock` shows up as a difference, so the lock never
    claims versions no test ran."""
    from importlib.metadata import PackageNotFoundError, version
    reqs = _lock()
    assert not any(r.name.lower().startswith(course.UNLOCKED) for r in reqs), "PyTorch is pinned by course.py"
    here = [r for r in reqs if r.marker is None or r.marker.evaluate()]
    names = [r.name.lower() for r in here]
    assert len(names) == len(set(names)), "two lines of constraints.txt apply to the same package here"
    differ = []
    for r in here:
        want = next(iter(r.specifier)).version
        try:
            got = version(r.name)
        except PackageNotFoundError:
            continue                       # a package of another platform's environment
        if got != want:
            differ.append(f"{r.name}: installed {got}, locked {want}")
    assert not differ, "installed versions differ from constraints.txt (run python3 course.py lock after the " \
        "tests pass): " + "; ".join(differ[:10])


def test_the_lock_resolves_on_every_supported_python():
    """What course.py installs, held to constraints.txt, resolves for the first release of every supported Python on
    Linux x86-64 (uv reads the packages' metadata from the index; nothing is downloaded or installed), PyTorch's pin
    included, and every package it resolves is pinned by a line for that Python (PyTorch's CUDA libraries aside)."""
    from concurrent.futures import ThreadPoolExecutor
    from packaging.requirements import Requirement
    try:
        uv = course.uv_command()
    except course.CourseError as e:
        pytest.fail(str(e))
    pythons = [f"{a}.{b}.0" for a, b in course.SUPPORTED]
    with ThreadPoolExecutor(len(pythons)) as pool:
        results = dict(zip(pythons, pool.map(lambda v: course.resolve(v, uv=uv), pythons)))
    offline = [v for v, r in results.items() if r.returncode and course.diagnose(r.stderr, v) and
               course.diagnose(r.stderr, v).startswith("the network")]
    if offline and not os.environ.get("CI"):
        pytest.skip(f"the package index cannot be reached: {results[offline[0]].stderr.strip()[-300:]}")
    failed = {v: " ".join(r.stderr.split())[-800:] for v, r in results.items() if r.returncode}
    assert not failed, f"constraints.txt does not resolve on Python {sorted(failed)}: {failed}"
    lock = _lock()
    for python, res in results.items():
        got = {Requirement(ln).name.lower().replace("_", "-"): ln.split("==")[1].split(";")[0].strip()
               for ln in res.stdout.splitlines() if "==" in ln and not ln.startswith("#")}
        assert got.get("torch") == course.TORCH_PIN.split("==")[1], f"Python {python}: {course.TORCH_PIN} not resolved"
        pinned = {r.name.lower().replace("_", "-").replace(".", "-") for r in lock
                  if r.marker is None or r.marker.evaluate(_env(python))}
        loose = sorted(n for n in got if n.replace(".", "-") not in pinned and not n.startswith(course.UNLOCKED))
        assert not loose, f"Python {python}: constraints.txt pins no version of {loose} (run python3 course.py lock)"


def test_setup_installs_with_the_lock(monkeypatch, tmp_path, capsys):
    calls = []
    monkeypatch.setattr(course, "_pip", lambda args, hint, what="": calls.append(args))
    monkeypatch.setattr(course, "STAMP", tmp_path / "stamp")
    monkeypatch.setattr(course, "_has_pip", lambda: True)
    monkeypatch.setattr(course, "torch_choice", lambda: (["torch==2.13.0"], "test"))
    monkeypatch.setattr(course, "torch_report", lambda: "PyTorch 2.13.0+cpu, the CPU-only build")
    monkeypatch.setattr(course, "_size", lambda p: 0)
    course.setup()
    assert calls[-1] == ["-e", ".[all]", "-c", str(course.LOCK)]
    out = capsys.readouterr().out.splitlines()
    step2 = [i for i, line in enumerate(out) if line.startswith("course.py: [2/3]")]
    assert out[step2[-1]] == "course.py: [2/3] installed PyTorch 2.13.0+cpu, the CPU-only build", out
    monkeypatch.setenv("COURSE_CONSTRAINTS", "none")
    course.setup()                          # the key changed: installs again, unlocked
    assert calls[-1] == ["-e", ".[all]"]
