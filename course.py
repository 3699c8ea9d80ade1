#!/usr/bin/env python3
"""GPU Memory Lab: the two commands.

    python3 course.py start [JUPYTERLAB OPTIONS]   set up .venv (first run only), copy the lessons and
                                                   exercises into my-work/ and open lesson 01 there
    python3 course.py start --instructor [...]     JupyterLab in the repository root with nbgrader's
                                                   Formgrader on the course's gradebook (instructors)
    python3 course.py test [PYTEST OPTIONS]        set up .venv (first run only) and run every test
    python3 course.py book [--no-execute]          build the course's website (Jupyter Book) into
                                                   _build/book/_build/html (book/build.py --help)
    python3 course.py sync                         only bring my-work/ up to date (what start does first)
    python3 course.py lock                         write constraints.txt from .venv: the versions tested
    python3 course.py help                         this text

`start` passes its options (all but --instructor) to JupyterLab, for example on a remote machine or in a
container:

    python3 course.py start --no-browser --ip=0.0.0.0 --port=8888

(then open the URL with the token that JupyterLab prints). Run as root, `start` adds --allow-root, without
which JupyterLab refuses to start. The server's PATH begins with .venv's scripts folder, so `memlab-grade`
works in JupyterLab's terminal.

A learner's JupyterLab shows none of nbgrader's instructor panels (Formgrader, Create Assignment, the
course and assignment lists); the notebook toolbar's Validate button stays. `start --instructor` shows them all.

my-work/ is your working copy, ignored by git: you open and edit the notebooks there, so `git pull` never
conflicts with your work. Each `start` copies notebooks that are new in the course, and replaces a copy only
if you never changed it; a notebook you changed is never overwritten (rename or delete yours to get the
course's current version on the next start).

Needs Python 3.10+ and pip. PyTorch is installed first, pinned; on Linux without an NVIDIA driver the
CPU-only build from PyTorch's CPU index (a few hundred MB instead of several GB), falling back to the default
index when that one cannot be reached. COURSE_TORCH overrides the choice (pip arguments, e.g.
COURSE_TORCH="torch==2.13.0" for the default build, COURSE_TORCH="torch" for the newest). Then the course package
with all its extras (pip install -e ".[all]"), held to the versions in constraints.txt, the ones the course's tests
ran with (COURSE_CONSTRAINTS=none installs the newest versions pyproject.toml allows). With `uv` on the PATH (pip
install uv), course.py installs with it, much faster; COURSE_INSTALLER=pip keeps pip.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
import venv
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
TORCH_PIN = "torch==2.13.0"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH = os.environ.get("COURSE_TORCH")      # None: course.py chooses (torch_choice)
EXTRAS = "all"                     # pyproject.toml: course (JupyterLab, nbgrader, pytest), zero, qlora
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / ("python.exe" if os.name == "nt" else "python")
STAMP = VENV / ".course-installed"
WORK = ROOT / "my-work"            # the learner's working copy (.gitignore lists it)
COPIED = ("lessons", "exercises")  # the folders copied into it
MANIFEST = ".course-copies.json"   # in WORK: {path: sha256 of the course's file when it was copied}
LOCK = ROOT / "constraints.txt"    # the versions the tests ran with (`course.py lock` writes it from .venv)
UNLOCKED = ("torch", "triton", "nvidia-")   # PyTorch is pinned and chosen per machine (torch_choice)
FIRST_LESSON = "lessons/01_memory_anatomy.ipynb"
COMMANDS = ("start", "test", "sync", "book", "lock", "help")
INSTRUCTOR = "--instructor"        # start's own option: nbgrader's instructor panels, in the repository root
EXCHANGE = ROOT / "autograder" / "work" / "exchange"   # nbgrader's exchange (autograder/nbgrader_config.py)
LEARNER_CONFIG = VENV / "course-learner-config"        # JUPYTER_CONFIG_PATH of a learner's server
# nbgrader 0.9's instructor parts, switched off in a learner's server: its server extensions (as its
# jupyter_server_config.d/nbgrader.json enables them) and its JupyterLab plugins (ids in its labextension).
# The learner keeps nbgrader.server_extensions.validate_assignment and @jupyter/nbgrader:validate-assignment.
NBGRADER_INSTRUCTOR_SERVER = ("nbgrader.server_extensions.formgrader", "nbgrader.server_extensions.course_list",
                              "nbgrader.server_extensions.assignment_list")
NBGRADER_INSTRUCTOR_LAB = ("@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment",
                           "@jupyter/nbgrader:course-list", "@jupyter/nbgrader:assignment-list",
                           "@jupyter/nbgrader:menu")


class CourseError(Exception):
    """A failure with a one-line hint that says what to do."""


def say(msg: str) -> None:
    print(f"course.py: {msg}", flush=True)


# ----------------------------------------------------------------------------- the environment
def _size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += (Path(dirpath) / f).lstat().st_size
            except OSError:
                pass
    return total


def installer() -> list[str]:
    """The command that installs into .venv: `uv pip install` when uv is on the PATH (unless COURSE_INSTALLER=pip),
    else pip."""
    uv = shutil.which("uv")
    if uv and os.environ.get("COURSE_INSTALLER", "uv") != "pip":
        return [uv, "pip", "install", "--python", str(PY)]
    return [str(PY), "-m", "pip", "install", "--disable-pip-version-check"]


def _pip(args: list[str], hint: str, what: str = "installing") -> None:
    cmd = [*installer(), *args]
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT)
    t0 = time.monotonic()
    while True:             # a line every 30 s: unpacking large wheels is silent for minutes
        try:
            rc = proc.wait(timeout=30)
            break
        except subprocess.TimeoutExpired:
            say(f"still {what} ({time.monotonic() - t0:.0f} s so far)")
    if rc != 0:
        raise CourseError(hint)


def has_nvidia_driver() -> bool:
    return shutil.which("nvidia-smi") is not None or Path("/proc/driver/nvidia/version").exists()


def _reachable(url: str, timeout: float = 8.0) -> bool:
    import urllib.request
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/torch/", method="HEAD"), timeout=timeout):
            return True
    except Exception:       # noqa: BLE001 - any failure means: use the default index
        return False


def torch_choice(environ: dict[str, str] | None = None, *, linux_x86: bool | None = None,
                 driver: bool | None = None, reachable=None) -> tuple[list[str], str]:
    """(pip arguments for PyTorch, why): COURSE_TORCH if set; else on Linux x86-64 with no NVIDIA driver the CPU
    build from PyTorch's CPU index when it answers; else the pinned default build."""
    environ = os.environ if environ is None else environ
    if environ.get("COURSE_TORCH"):
        return shlex.split(environ["COURSE_TORCH"]), "COURSE_TORCH as given"
    if linux_x86 is None:
        linux_x86 = sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
    if not linux_x86:
        return [TORCH_PIN], "the default build (a few hundred MB here)"
    if driver if driver is not None else has_nvidia_driver():
        return [TORCH_PIN], ("an NVIDIA driver is present: the CUDA build, a wheel of about 0.5 GB plus NVIDIA's "
                             "CUDA libraries, several GB in all")
    if (reachable or _reachable)(CPU_INDEX):
        return [TORCH_PIN, "--index-url", CPU_INDEX], (
            f"no NVIDIA driver found: the CPU-only build from {CPU_INDEX}, a few hundred MB "
            f"(for the CUDA build: COURSE_TORCH={TORCH_PIN})")
    return [TORCH_PIN], (f"no NVIDIA driver found, but {CPU_INDEX} cannot be reached: the default build from the "
                         f"default index, which on Linux is the CUDA build, several GB")


def _has_pip() -> bool:
    return subprocess.run([str(PY), "-m", "pip", "--version"], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def _make_venv() -> None:
    say("[1/3] creating .venv, a Python environment for the course inside this folder")
    try:
        venv.EnvBuilder(with_pip=True).create(VENV)
    except (subprocess.CalledProcessError, OSError) as e:
        shutil.rmtree(VENV, ignore_errors=True)
        raise CourseError(f"could not create .venv with pip ({type(e).__name__}); on Debian/Ubuntu install "
                          f"the venv module (sudo apt install python3-venv) and run the command again") from e


def setup() -> None:
    """Create .venv and install the course into it; a no-op when nothing changed since the last run."""
    if sys.version_info < (3, 10):
        raise CourseError(f"GPU Memory Lab needs Python 3.10 or newer; this is {sys.version.split()[0]}: "
                          f"run course.py with a newer python3")
    if VENV.exists() and not PY.exists():
        raise CourseError(f"{VENV.name}/ exists but has no {PY.relative_to(VENV)} (made by another Python or "
                          f"on another machine?): remove it (rm -rf .venv) and run the command again")
    if not VENV.exists():
        _make_venv()
    locked = LOCK.exists() and os.environ.get("COURSE_CONSTRAINTS") != "none"
    key = f"{TORCH or TORCH_PIN}|{EXTRAS}|{locked}"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (LOCK.read_bytes() if locked else b"")
                          + key.encode()).hexdigest()
    if STAMP.exists() and STAMP.read_text() == want:
        return
    if not _has_pip():
        raise CourseError(".venv has no pip (it was created without it, or is damaged): remove it "
                          "(rm -rf .venv) and run the command again; course.py recreates it")
    # torch first, pinned: a loose requirement would pull the newest build and its CUDA wheels
    torch_args, why = torch_choice()
    say(f"[2/3] installing PyTorch ({' '.join(torch_args)}): {why}")
    _pip(torch_args, f"the installer could not install PyTorch ({' '.join(torch_args)}), see its message above: "
                     f"check the internet connection and free disk space; if no build exists for Python "
                     f"{platform.python_version()} here, try COURSE_TORCH=torch for the newest one",
         what="installing PyTorch")
    say(f"[3/3] installing the course and its tools (-e \".[{EXTRAS}]\"): JupyterLab, nbgrader, transformers, "
        f"DeepSpeed, peft, bitsandbytes and their dependencies, about 1 GB more")
    _pip(["-e", f".[{EXTRAS}]", *(["-c", str(LOCK)] if locked else [])],
         "the installer could not install the course's packages, see its message above: check the internet "
         "connection and free disk space, then run the command again (finished downloads are cached)",
         what="installing the course's packages")
    STAMP.write_text(want)
    say(f"ready: .venv holds {_size(VENV) / 2**30:.1f} GiB")


def lock_lines(freeze: str) -> list[str]:
    """`pip freeze` output as constraints: name==version lines, sorted, without PyTorch and its CUDA packages
    (course.py pins and chooses those per machine), editable installs or local paths."""
    out = []
    for line in freeze.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "-e")) or "==" not in line or " @ " in line:
            continue
        name = line.split("==")[0].lower().replace("_", "-")
        if name.startswith(UNLOCKED) or name == "gpu-memory-lab":
            continue
        out.append(line)
    return sorted(out, key=str.lower)


def write_lock() -> Path:
    """constraints.txt from what .venv holds now: run it after the tests pass on a fresh environment."""
    if not PY.exists():
        raise CourseError("no .venv yet: run `python3 course.py test` first, then lock what it tested")
    freeze = subprocess.run([str(PY), "-m", "pip", "freeze", "--exclude-editable"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    LOCK.write_text("# The versions GPU Memory Lab's tests ran with (python3 course.py lock writes this file from\n"
                    "# .venv). course.py installs with `-c constraints.txt`; PyTorch is pinned in course.py.\n"
                    + "\n".join(lock_lines(freeze)) + "\n")
    return LOCK


# ----------------------------------------------------------------------------- the working copy
def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def course_files(src: Path = ROOT) -> list[str]:
    """The files copied into the working copy: everything under lessons/ and exercises/ except hidden files
    (.ipynb_checkpoints) and caches, as sorted POSIX paths relative to `src`."""
    out = []
    for top in COPIED:
        for p in sorted((src / top).rglob("*")):
            rel = p.relative_to(src)
            if p.is_file() and not any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                out.append(rel.as_posix())
    return out


@dataclass
class SyncReport:
    added: list[str] = field(default_factory=list)      # new in the course: copied
    updated: list[str] = field(default_factory=list)    # changed in the course, copy untouched: replaced
    kept: list[str] = field(default_factory=list)       # changed in the course AND by the learner: left alone

    def lines(self, dest: Path) -> list[str]:
        out = []
        if self.added:
            names = ", ".join(self.added) if len(self.added) <= 4 else "lessons/ and exercises/"
            out.append(f"{dest.name}/: copied {len(self.added)} new file(s): {names}")
        if self.updated:
            out.append(f"{dest.name}/: updated {len(self.updated)} file(s) you had not changed: "
                       + ", ".join(self.updated))
        for rel in self.kept:
            out.append(f"{dest.name}/{rel}: the course has a newer version; your changed copy is kept "
                       f"(rename it and run start again to get the new one beside it)")
        return out


def sync_work(src: Path = ROOT, dest: Path = WORK) -> SyncReport:
    """Bring the working copy `dest` up to date with the course in `src` without ever overwriting a file the
    learner changed: new course files are copied; a copy is replaced only while its bytes are still exactly
    those copied (so the learner never touched it); otherwise it is kept and reported."""
    if not isinstance(src, Path) or not isinstance(dest, Path):
        raise TypeError("src and dest must be pathlib.Path objects")
    manifest_path = dest / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        manifest = {}
    report = SyncReport()
    for rel in course_files(src):
        s, d = src / rel, dest / rel
        new = _sha(s)
        if not d.exists():
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(s, d)
            manifest[rel] = new
            report.added.append(rel)
        elif rel in manifest and manifest[rel] != new:       # the course changed this file since it was copied
            if _sha(d) == manifest[rel]:                     # ... and the copy is untouched: safe to replace
                shutil.copyfile(s, d)
                manifest[rel] = new
                report.updated.append(rel)
            else:
                report.kept.append(rel)
    dest.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return report


# ----------------------------------------------------------------------------- JupyterLab
def running_as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def server_env(environ: dict[str, str] | None = None, learner_config: Path | None = None) -> dict[str, str]:
    """The JupyterLab server's environment: .venv's scripts folder first on PATH (kernels and terminals
    inherit it, so `memlab-grade` and `python` are the course's), VIRTUAL_ENV set as `activate` does, and
    `learner_config` (write_learner_config) first on JUPYTER_CONFIG_PATH for a learner's server."""
    env = dict(os.environ if environ is None else environ)
    env["PATH"] = os.pathsep.join([str(BIN)] + [p for p in env.get("PATH", "").split(os.pathsep) if p])
    env["VIRTUAL_ENV"] = str(VENV)
    env.pop("PYTHONHOME", None)
    if learner_config is not None:
        rest = [p for p in env.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep) if p and p != str(learner_config)]
        env["JUPYTER_CONFIG_PATH"] = os.pathsep.join([str(learner_config)] + rest)
    return env


def write_learner_config(path: Path = LEARNER_CONFIG) -> Path:
    """A Jupyter config folder that switches nbgrader's instructor parts off, the supported way: server
    extensions in jupyter_server_config.json (ServerApp.jpserver_extensions), JupyterLab plugins in
    labconfig/page_config.json (disabledExtensions, what `jupyter labextension disable` writes). A server with
    `path` on JUPYTER_CONFIG_PATH (server_env) reads both; nothing outside `path` is changed."""
    (path / "labconfig").mkdir(parents=True, exist_ok=True)
    server = {"ServerApp": {"jpserver_extensions": {name: False for name in NBGRADER_INSTRUCTOR_SERVER}}}
    lab = {"disabledExtensions": {name: True for name in NBGRADER_INSTRUCTOR_LAB}}
    (path / "jupyter_server_config.json").write_text(json.dumps(server, indent=1) + "\n")
    (path / "labconfig" / "page_config.json").write_text(json.dumps(lab, indent=1) + "\n")
    return path


TERMINAL_RC = VENV / "course-bashrc"       # what bash reads in JupyterLab's terminal (write_terminal_rc)


def write_terminal_rc(path: Path = TERMINAL_RC) -> Path:
    """The terminal's bash start-up file: the user's ~/.bashrc first (prompt, aliases, pyenv or conda), then the
    course's environment first on PATH, whatever ~/.bashrc did to it."""
    path.write_text("# written by course.py start: JupyterLab's terminal reads this instead of ~/.bashrc\n"
                    '[ -f "$HOME/.bashrc" ] && . "$HOME/.bashrc"\n'
                    f"export VIRTUAL_ENV={shlex.quote(str(VENV))}\n"
                    f'export PATH={shlex.quote(str(BIN))}:"$PATH"\n'
                    "hash -r 2>/dev/null\n")
    return path


def jupyter_command(options: list[str], *, as_root: bool, environ: dict[str, str] | None = None,
                    root_dir: Path = WORK, default_url: str = f"/lab/tree/{FIRST_LESSON}") -> list[str]:
    """The JupyterLab command line: the working copy as root folder, lesson 01 opened, `options` passed on."""
    env = os.environ if environ is None else environ
    cmd = [str(PY), "-m", "jupyterlab", f"--ServerApp.root_dir={root_dir}", f"--LabApp.default_url={default_url}"]
    if os.name != "nt" and not any(o.startswith("--ServerApp.terminado_settings") for o in options):
        # JupyterLab's terminal is a login shell when the server's output is not a terminal (nohup, a
        # container), and a login shell reads /etc/profile, which on Debian/Ubuntu resets PATH: ask for a
        # plain interactive shell. bash also reads ~/.bashrc, where pyenv or conda put their own python first:
        # it gets TERMINAL_RC, which reads ~/.bashrc and then puts the course's scripts first again.
        shell = env.get("SHELL") or shutil.which("bash") or "sh"
        argv = [shell, "--rcfile", str(TERMINAL_RC)] if Path(shell).name == "bash" else [shell]
        cmd.append(f"--ServerApp.terminado_settings=shell_command={json.dumps(argv)}")
    if as_root and "--allow-root" not in options:
        cmd.append("--allow-root")
    return cmd + list(options)


def server(options: list[str], *, instructor: bool, as_root: bool, course_root: Path = ROOT, work: Path = WORK,
           learner_config: Path = LEARNER_CONFIG, environ: dict[str, str] | None = None
           ) -> tuple[list[str], Path, dict[str, str]]:
    """(command, folder to run it in, environment) of the JupyterLab server.
    Learner: rooted in the working copy, lesson 01 opened, nbgrader's instructor parts off (learner_config).
    Instructor: run in and rooted at the course root, where nbgrader_config.py is: Formgrader reads the config
    of the server's working folder (autograder/nbgrader_config.py: the gradebook, the exchange) and needs the
    course inside the server's root folder; every nbgrader part is on."""
    if instructor:
        cmd = jupyter_command(options, as_root=as_root, environ=environ, root_dir=course_root, default_url="/lab")
        return cmd, course_root, server_env(environ)
    cmd = jupyter_command(options, as_root=as_root, environ=environ, root_dir=work)
    return cmd, work, server_env(environ, learner_config)


def start(options: list[str]) -> int:
    instructor = INSTRUCTOR in options
    options = [o for o in options if o != INSTRUCTOR]
    if not instructor:
        for line in sync_work().lines(WORK):
            say(line)
        write_learner_config()
    else:
        # nbgrader's exchange (release/collect between accounts on one machine); Formgrader warns without it
        EXCHANGE.mkdir(parents=True, exist_ok=True)
    as_root = running_as_root()
    if as_root:
        say("running as root (a container or cloud VM?): passing --allow-root to JupyterLab")
    write_terminal_rc()
    cmd, cwd, env = server(options, instructor=instructor, as_root=as_root)
    if instructor:
        say("opening JupyterLab in the repository root for the instructor: Nbgrader -> Formgrader shows the "
            "gradebook autograder/gradebook.db (stop it with Ctrl-C)")
    else:
        say(f"opening JupyterLab in {WORK.name}/ (your working copy; stop it with Ctrl-C)")
    if os.name == "nt":
        return subprocess.run(cmd, cwd=cwd, env=env).returncode
    os.chdir(cwd)
    os.execve(cmd[0], cmd, env)
    return 0  # not reached


# ----------------------------------------------------------------------------- the website
def book(options: list[str]) -> int:
    """Build the website with Jupyter Book (book/build.py, run by .venv's python; its options pass through)."""
    if subprocess.run([str(PY), "-c", "import jupyter_book"], cwd=ROOT, capture_output=True).returncode != 0:
        say("installing Jupyter Book into .venv (the course's 'book' extra)")
        _pip(["-e", ".[book]"], "the installer could not install Jupyter Book, see its message above: check the "
                                "internet connection, then run the command again", what="installing Jupyter Book")
    return subprocess.run([str(PY), str(ROOT / "book" / "build.py"), *options], cwd=ROOT).returncode


# ----------------------------------------------------------------------------- main
def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    if command in ("help", "-h", "--help"):
        print(__doc__)
        return 0
    if command not in COMMANDS:
        print(f"course.py: unknown command {command!r}; the commands are: {', '.join(COMMANDS)} "
              f"(python3 course.py help)", file=sys.stderr)
        return 2
    if command == "sync":
        if rest:
            print(f"course.py: sync takes no options, got {rest}", file=sys.stderr)
            return 2
        for line in sync_work().lines(WORK) or [f"{WORK.name}/ is up to date"]:
            say(line)
        return 0
    if command == "lock":
        try:
            say(f"wrote {write_lock().name} ({len(lock_lines(LOCK.read_text()))} pinned packages)")
            return 0
        except CourseError as e:
            print(f"course.py: {e}", file=sys.stderr)
            return 1
    try:
        setup()
        if command == "start":
            return start(rest)
        if command == "book":
            return book(rest)
        # tests: CI and contributors; extra arguments go to pytest (e.g. -m "not slow")
        return subprocess.run([str(PY), "-m", "pytest", "-ra", *rest], cwd=ROOT).returncode
    except CourseError as e:
        print(f"course.py: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ncourse.py: interrupted; run the same command again to go on (pip keeps what it downloaded)",
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
