#!/usr/bin/env python3
"""GPU Memory Lab: the two commands.

    python3 course.py start [JUPYTERLAB OPTIONS]   set up .venv (first run only), copy the lessons and
                                                   exercises into my-work/ and open lesson 01 there
    python3 course.py start --instructor [...]     JupyterLab in the repository root with nbgrader's
                                                   Formgrader on the course's gradebook (instructors)
    python3 course.py test [PYTEST OPTIONS]        set up .venv (first run only) and run every test
    python3 course.py book [--no-execute]          build the course's website (Jupyter Book) into
                                                   _build/book/_build/html (book/build.py --help)
    python3 course.py fit MODEL [OPTIONS]          will it fit? the course's memlab-fit (--help: every option)
    python3 course.py grade check NOTEBOOK         grade an exercise as the class run would (memlab-grade)
    python3 course.py sync                         only bring my-work/ up to date (what start does first)
    python3 course.py lock                         write constraints.txt: the versions tested, and the newest
                                                   that install on each other supported Python
    python3 course.py help                         this text

`start` passes its options (all but --instructor) to JupyterLab, for example on a remote machine or in a
container:

    python3 course.py start --no-browser --ip=0.0.0.0 --port=8888

(then open the URL with the token that JupyterLab prints). Run as root, `start` adds --allow-root, without
which JupyterLab refuses to start. The server's PATH begins with .venv's scripts folder, so `memlab-grade` and
`memlab-fit` work in JupyterLab's terminal; in any other shell, `python3 course.py grade ...` and
`python3 course.py fit ...` run the same commands (they set up .venv first if needed).

A learner's JupyterLab shows none of nbgrader's buttons and panels (Validate, Formgrader, Create Assignment,
the course and assignment lists: `course.py grade check` grades an exercise) and no news pop-ups;
`start --instructor` shows nbgrader's parts.

my-work/ is your working copy, ignored by git: you open and edit the notebooks there, so `git pull` never
conflicts with your work. Each `start` copies notebooks that are new in the course, and replaces a copy only
if you never changed it; a notebook you changed is never overwritten (rename or delete yours to get the
course's current version on the next start).

Needs Python 3.10, 3.11, 3.12 or 3.13 with pip (another version gets a one-line refusal before anything is
downloaded). PyTorch is installed first, pinned; on Linux without an NVIDIA driver the
CPU-only build from PyTorch's CPU index (a few hundred MB instead of several GB), falling back to the default
index when that one cannot be reached. COURSE_TORCH overrides the choice (pip arguments, e.g.
COURSE_TORCH="torch==2.13.0" for the default build, COURSE_TORCH="torch" for the newest); it then says which
version and build it got. Then the course package with all its extras (pip install -e ".[all]"), held to the
versions in constraints.txt: the ones the course's tests ran with, and for a package whose tested version does not
install on your Python, the newest that does (COURSE_CONSTRAINTS=none installs the newest versions pyproject.toml
allows). With `uv` on the PATH (pip install uv), course.py installs with it, much faster; COURSE_INSTALLER=pip
keeps pip. When an install fails, course.py says in one line what the installer reported: a version conflict, no
release for this Python, the network or the disk.
"""

import os
import platform
import shutil
import sys

# The Pythons the course installs on: constraints.txt holds versions for each (course.py lock) and a test resolves
# it for each; course.py refuses any other before it downloads anything. This part of the file runs on Python 3.6
# and newer, so that an older python3 (Ubuntu 18.04's 3.6, 20.04's 3.8) gets the one-line refusal, not an error.
SUPPORTED = ((3, 10), (3, 11), (3, 12), (3, 13))


def _versions(pythons=SUPPORTED, last="or"):
    names = [f"{a}.{b}" for a, b in pythons]
    return ", ".join(names[:-1]) + f" {last} {names[-1]}" if len(names) > 1 else names[0]


def python_refusal(version=None, command="start", which=shutil.which):
    """None on a supported Python; else one line that names the versions that work and, when one is on the PATH,
    the command to type with it. (Written for any Python 3.6+, like everything above the check below it.)"""
    version = tuple(sys.version_info[:3] if version is None else version)
    if tuple(version[:2]) in SUPPORTED:
        return None
    found = next((f"python{a}.{b}" for a, b in reversed(SUPPORTED) if which(f"python{a}.{b}")), None)
    how = (f"run `{found} course.py {command}` (found on your PATH)" if found else
           "install one (python.org, your system's packages, pyenv, or `uv python install 3.12`) and run course.py "
           "with it")
    return (f"GPU Memory Lab runs on Python {_versions()}; this is Python {'.'.join(map(str, version))} "
            f"({sys.executable}): {how}")


if __name__ == "__main__" and python_refusal():       # before anything that needs a supported Python
    if sys.argv[1:2] in (["help"], ["-h"], ["--help"]):
        print(__doc__)
        sys.exit(0)
    print("course.py: " + python_refusal(command=(sys.argv[1:2] or ["start"])[0]), file=sys.stderr)
    sys.exit(1)

import collections  # noqa: E402  (from here on: Python 3.10+)
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import venv  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

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
UNLOCKED = ("torch", "triton", "nvidia-", "cuda-")   # PyTorch and its CUDA libraries: pinned and chosen per machine
FIRST_LESSON = "lessons/01_memory_anatomy.ipynb"
TOOLS = {"fit": "memlab-fit", "grade": "memlab-grade"}   # course.py fit/grade run these scripts from .venv
COMMANDS = ("start", "test", "sync", "book", *TOOLS, "lock", "help")
INSTRUCTOR = "--instructor"        # start's own option: nbgrader's instructor panels, in the repository root
EXCHANGE = ROOT / "autograder" / "work" / "exchange"   # nbgrader's exchange (autograder/nbgrader_config.py)
LEARNER_CONFIG = VENV / "course-learner-config"        # JUPYTER_CONFIG_PATH of a learner's server
INSTRUCTOR_CONFIG = VENV / "course-instructor-config"  # ... and of the instructor's
# nbgrader 0.9's parts, switched off in a learner's server: its server extensions (as its
# jupyter_server_config.d/nbgrader.json enables them) and its JupyterLab plugins (ids in its labextension). The
# Validate button goes too: it runs nbgrader's in-kernel check, shows on every lesson, and is not the grade
# (`course.py grade check` is).
NBGRADER_INSTRUCTOR_SERVER = ("nbgrader.server_extensions.formgrader", "nbgrader.server_extensions.course_list",
                              "nbgrader.server_extensions.assignment_list",
                              "nbgrader.server_extensions.validate_assignment")
NBGRADER_INSTRUCTOR_LAB = ("@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment",
                           "@jupyter/nbgrader:course-list", "@jupyter/nbgrader:assignment-list",
                           "@jupyter/nbgrader:menu", "@jupyter/nbgrader:validate-assignment")
# JupyterLab's news and update pop-ups ("official Jupyter news"), which cover figures: off in both servers
LAB_NEWS = ("@jupyterlab/apputils-extension:announcements",)


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


# What pip and uv print when an install fails, by cause (checked in this order: a failed download also reports
# "no matching distribution", so the network and the disk come first)
_DISK = ("No space left on device", "[Errno 28]")
_NETWORK = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
            "Name or service not known", "Max retries exceeded", "ConnectTimeout", "ReadTimeoutError",
            "Network is unreachable", "Connection refused", "SSLError", "dns error", "error sending request",
            "operation timed out", "Could not connect")
_CONFLICT = ("ResolutionImpossible", "conflicting dependencies", "No solution found when resolving")
_NO_RELEASE = re.compile(r"(?:Could not find a version that satisfies the requirement|"
                         r"No matching distribution found for) (\S+)")
_WRONG_PYTHON = re.compile(r"requires a different Python: (\S+) not in '([^']+)'|"
                           r"Ignored the following versions that require a different python version")


def diagnose(output: str, python: str | None = None) -> str | None:
    """The cause of a failed install and what to do, in words, from the installer's output (None: not a cause it
    recognises)."""
    python = python or platform.python_version()
    again = "run the command again (finished downloads are kept)"
    if any(n in output for n in _DISK):
        return f"the disk is full (the installer says: No space left on device): free some space, then {again}"
    if any(n in output for n in _NETWORK):
        return ("the network failed (the installer could not reach the package index): check the connection, then "
                + again)
    unpin = "COURSE_CONSTRAINTS=none installs without the course's pins"
    lines = [ln.strip() for ln in output.splitlines()]
    if any(n in output for n in _CONFLICT):
        why = [ln for ln in lines if ln.startswith(("The user requested", "Because", "And because"))
               or (" depends on " in ln and not ln.startswith("ERROR"))]
        return (f"a version conflict, not the network: no set of versions fits together on Python {python}"
                + (f" ({'; '.join(why[:3])})" if why else "") + f"; {unpin}")
    m = _NO_RELEASE.search(output)
    if m and "(from versions: none)" not in output:
        older = " (releases that need another Python were skipped)" if _WRONG_PYTHON.search(output) else ""
        return (f"a version conflict, not the network: no release of {m.group(1)} installs on Python {python}"
                f"{older}; {unpin}")
    m = _WRONG_PYTHON.search(output)
    if m and m.group(1):
        return (f"a version conflict, not the network: a package needs Python {m.group(2)}, this is {m.group(1)}; "
                f"the course runs on Python {_versions()}")
    return None


def _pip(args: list[str], hint: str, what: str = "installing") -> None:
    """Run the installer with `args`, a line every 30 s while it works; on failure raise CourseError with the cause
    the installer reported (diagnose), else `hint`. Its stderr is shown as it comes and kept for the diagnosis;
    stdout (pip's progress bars) goes straight to the terminal."""
    cmd = [*installer(), *args]
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE)
    tail: collections.deque[str] = collections.deque(maxlen=400)

    def pump() -> None:
        for raw in iter(proc.stderr.readline, b""):
            line = raw.decode(errors="replace")
            sys.stderr.write(line)
            sys.stderr.flush()
            tail.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    t0 = time.monotonic()
    while True:             # a line every 30 s: unpacking large wheels is silent for minutes
        try:
            rc = proc.wait(timeout=30)
            break
        except subprocess.TimeoutExpired:
            say(f"still {what} ({time.monotonic() - t0:.0f} s so far)")
    reader.join(timeout=10)
    if rc != 0:
        cause = diagnose("".join(tail))
        raise CourseError(f"{what} failed: {cause}" if cause else hint)


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


def torch_report() -> str:
    """Which PyTorch .venv holds, in words: version and build (CPU-only, CUDA x.y, ROCm), asked of .venv's python."""
    probe = ("import torch; print(torch.__version__); print(torch.version.cuda or ''); "
             "print(getattr(torch.version, 'hip', None) or '')")
    out = subprocess.run([str(PY), "-c", probe], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        tail = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise CourseError(f"PyTorch was installed but does not import ({tail}): remove .venv (rm -rf .venv) and "
                          f"run the command again")
    version, cuda, hip = (out.stdout.splitlines() + ["", "", ""])[:3]
    build = (f"the CUDA {cuda} build" if cuda else f"the ROCm {hip} build" if hip
             else "the default macOS build (CPU and Apple's MPS)" if sys.platform == "darwin"
             else "the CPU-only build")
    return f"PyTorch {version}, {build}"


def install_key() -> str:
    """What .venv must have been installed from (pyproject.toml, constraints.txt, the PyTorch choice): setup()
    installs again when it differs from the stamp it wrote last time."""
    locked = LOCK.exists() and os.environ.get("COURSE_CONSTRAINTS") != "none"
    key = f"{TORCH or TORCH_PIN}|{EXTRAS}|{locked}"
    return hashlib.sha256((ROOT / "pyproject.toml").read_bytes() + (LOCK.read_bytes() if locked else b"")
                          + key.encode()).hexdigest()


def setup() -> None:
    """Create .venv and install the course into it; a no-op when nothing changed since the last run."""
    refusal = python_refusal()
    if refusal:
        raise CourseError(refusal)
    if VENV.exists() and not PY.exists():
        raise CourseError(f"{VENV.name}/ exists but has no {PY.relative_to(VENV)} (made by another Python or "
                          f"on another machine?): remove it (rm -rf .venv) and run the command again")
    if not VENV.exists():
        _make_venv()
    locked = LOCK.exists() and os.environ.get("COURSE_CONSTRAINTS") != "none"
    want = install_key()
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
    say(f"[2/3] installed {torch_report()}")
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


def _toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:          # Python 3.10: pip vendors the same parser
        from pip._vendor import tomli as tomllib
    return tomllib.loads(path.read_text())


def course_requirements(pyproject: Path = ROOT / "pyproject.toml", extras: str = EXTRAS) -> list[str]:
    """What setup() installs, as requirement lines: PyTorch's pin, pyproject's dependencies and the requirements of
    `extras`, with the course's references to its own extras (gpu-memory-lab[a,b]) expanded."""
    project = _toml(pyproject)["project"]
    optional = project.get("optional-dependencies", {})

    def expand(extra: str) -> list[str]:
        out = []
        for req in optional[extra]:
            m = re.fullmatch(r"\s*gpu-memory-lab\[([^\]]+)\]\s*", req)
            out += [r for e in m.group(1).split(",") for r in expand(e.strip())] if m else [req]
        return out

    return [TORCH_PIN, *project["dependencies"], *(r for e in extras.split(",") for r in expand(e))]


def uv_command() -> list[str]:
    """uv, the resolver `course.py lock` and the lock's test use: .venv's (the course's tools install it), else one
    on the PATH."""
    if PY.exists() and subprocess.run([str(PY), "-m", "uv", "--version"], cwd=ROOT,
                                      capture_output=True).returncode == 0:
        return [str(PY), "-m", "uv"]
    if shutil.which("uv"):
        return [shutil.which("uv")]
    raise CourseError("this needs uv, one of the course's tools: run `python3 course.py test` first (it installs "
                      "them into .venv), or pip install uv")


# uv pip compile's options for both: no uv.toml of the user's, no Python downloaded to build a source package (the
# running one builds DeepSpeed's metadata), only name==version lines out
UV_COMPILE = ("--no-config", "--no-python-downloads", "--quiet", "--no-header", "--no-annotate")


def resolve(python: str, constraints: Path = LOCK, platform_tag: str = "x86_64-manylinux_2_28",
            uv: list[str] | None = None) -> subprocess.CompletedProcess:
    """Resolve what setup() installs for Python `python` ("3.10": its first release, 3.10.0) on `platform_tag`,
    held to `constraints`, without installing anything: uv reads each package's metadata from the index (no wheel
    is downloaded). The pins it would install are the output; a conflict is a non-zero return code."""
    with _requirements_file() as reqs:
        return subprocess.run([*(uv or uv_command()), "pip", "compile", *UV_COMPILE, "--python-version", python,
                               "--python-platform", platform_tag, str(reqs), "-c", str(constraints)],
                              cwd=ROOT, capture_output=True, text=True)


@contextlib.contextmanager
def _requirements_file():
    """course_requirements() in a temporary requirements file: yields its path."""
    with tempfile.TemporaryDirectory(prefix="course-lock-") as tmp:
        path = Path(tmp) / "requirements.in"
        path.write_text("\n".join(course_requirements()) + "\n")
        yield path


LOCK_HEADER = """\
# The versions GPU Memory Lab installs (python3 course.py lock writes this file; course.py installs with
# `-c constraints.txt`; PyTorch is pinned in course.py). Each is the version the course's tests ran with wherever it
# installs; a line with a marker (python_full_version, sys_platform) gives the newest version for the Pythons or
# platforms where the tested one does not install, or a package only they need. tests/test_course.py resolves
# this file for Python {versions}.
"""


def write_lock(uv: list[str] | None = None) -> Path:
    """constraints.txt from what .venv holds now (run it after the tests pass on a fresh environment), extended to
    every supported Python and platform: uv resolves the course's requirements once for all of them ("universal"),
    preferring .venv's versions, so a package whose tested version needs a newer Python gets a second line with a
    marker and the newest version that installs on the older one."""
    if not PY.exists():
        raise CourseError("no .venv yet: run `python3 course.py test` first, then lock what it tested")
    freeze = subprocess.run([str(PY), "-m", "pip", "freeze", "--exclude-editable"], cwd=ROOT, check=True,
                            capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory(prefix="course-lock-") as tmp, _requirements_file() as reqs:
        out = Path(tmp) / "constraints.txt"
        out.write_text("\n".join(lock_lines(freeze)) + "\n")      # uv keeps these versions wherever they install
        low = "{}.{}".format(*SUPPORTED[0])
        res = subprocess.run([*(uv or uv_command()), "pip", "compile", *UV_COMPILE, "--universal",
                              "--python-version", low, str(reqs), "-o", str(out)], cwd=ROOT, capture_output=True,
                             text=True)
        if res.returncode != 0:
            raise CourseError("uv found no versions for every supported Python: "
                              + " ".join(res.stderr.split())[-600:])
        lines = [ln.strip() for ln in out.read_text().splitlines() if ln.strip() and not ln.startswith(("#", "-"))]
    kept = [ln for ln in lines if not _lock_name(ln).startswith(UNLOCKED) and _lock_name(ln) != "gpu-memory-lab"]
    kept.sort(key=lambda ln: (_lock_name(ln), ln.lower()))
    LOCK.write_text(LOCK_HEADER.format(versions=_versions(last="and")) + "\n".join(kept) + "\n")
    return LOCK


def _lock_name(line: str) -> str:
    return re.split(r"[=<>!~ ;\[]", line, maxsplit=1)[0].lower().replace("_", "-").replace(".", "-")


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
    `learner_config` (write_learner_config, or write_instructor_config) first on JUPYTER_CONFIG_PATH."""
    env = dict(os.environ if environ is None else environ)
    env["PATH"] = os.pathsep.join([str(BIN)] + [p for p in env.get("PATH", "").split(os.pathsep) if p])
    env["VIRTUAL_ENV"] = str(VENV)
    env.pop("PYTHONHOME", None)
    if learner_config is not None:
        rest = [p for p in env.get("JUPYTER_CONFIG_PATH", "").split(os.pathsep) if p and p != str(learner_config)]
        env["JUPYTER_CONFIG_PATH"] = os.pathsep.join([str(learner_config)] + rest)
    return env


def _page_config(path: Path, plugins: tuple[str, ...]) -> None:
    (path / "labconfig").mkdir(parents=True, exist_ok=True)
    lab = {"disabledExtensions": {name: True for name in plugins}}
    (path / "labconfig" / "page_config.json").write_text(json.dumps(lab, indent=1) + "\n")


def write_learner_config(path: Path = LEARNER_CONFIG) -> Path:
    """A Jupyter config folder that switches nbgrader's parts (Validate included) and JupyterLab's news pop-ups off,
    the supported way: server extensions in jupyter_server_config.json (ServerApp.jpserver_extensions), JupyterLab
    plugins in labconfig/page_config.json (disabledExtensions, what `jupyter labextension disable` writes). A server
    with `path` on JUPYTER_CONFIG_PATH (server_env) reads both; nothing outside `path` is changed."""
    _page_config(path, NBGRADER_INSTRUCTOR_LAB + LAB_NEWS)
    server = {"ServerApp": {"jpserver_extensions": {name: False for name in NBGRADER_INSTRUCTOR_SERVER}}}
    (path / "jupyter_server_config.json").write_text(json.dumps(server, indent=1) + "\n")
    return path


def write_instructor_config(path: Path = INSTRUCTOR_CONFIG) -> Path:
    """The instructor's Jupyter config folder: only JupyterLab's news pop-ups off; every nbgrader part stays on."""
    _page_config(path, LAB_NEWS)
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
           learner_config: Path = LEARNER_CONFIG, instructor_config: Path = INSTRUCTOR_CONFIG,
           environ: dict[str, str] | None = None) -> tuple[list[str], Path, dict[str, str]]:
    """(command, folder to run it in, environment) of the JupyterLab server.
    Learner: rooted in the working copy, lesson 01 opened, nbgrader's parts and the news off (learner_config).
    Instructor: run in and rooted at the course root, where nbgrader_config.py is: Formgrader reads the config
    of the server's working folder (autograder/nbgrader_config.py: the gradebook, the exchange) and needs the
    course inside the server's root folder; every nbgrader part is on (instructor_config: only the news is off)."""
    if instructor:
        cmd = jupyter_command(options, as_root=as_root, environ=environ, root_dir=course_root, default_url="/lab")
        return cmd, course_root, server_env(environ, instructor_config)
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
        write_instructor_config()
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
    refusal = python_refusal(command=command)
    if refusal:             # before anything is created or downloaded
        print(f"course.py: {refusal}", file=sys.stderr)
        return 1
    if command == "lock":
        try:
            lock = write_lock()
            pins = [ln for ln in lock.read_text().splitlines() if ln and not ln.startswith("#")]
            say(f"wrote {lock.name}: {len(pins)} lines, {sum(';' in ln for ln in pins)} of them with a marker")
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
        if command in TOOLS:        # the course's commands from any shell, run where the user typed them
            exe = BIN / (TOOLS[command] + (".exe" if os.name == "nt" else ""))
            return subprocess.run([str(exe), *rest]).returncode
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
