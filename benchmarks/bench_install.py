"""Install the course from a fresh clone under each given Python, as a learner would (`python course.py`), then
run the fast suite, one lesson and one class run with that installation, and report time, disk and results.

    python benchmarks/bench_install.py --python ~/.pyenv/versions/3.10.13/bin/python \
                                       --python ~/.pyenv/versions/3.13.0/bin/python [--write] [--keep DIR]

Each Python gets its own clone of this repository's HEAD (no .venv, no my-work/), where it runs:

1. `python -c "import course; course.setup()"`: .venv created and the course installed with constraints.txt
   (timed; the size of .venv afterwards; the PyTorch build course.py reported);
2. `python course.py test -m "not slow" -n 2`: the fast suite, with that Python's packages;
3. one lesson executed top to bottom where learners run it (tests/test_notebooks.py, lesson 03);
4. one class run: `memlab-grade class` on two submissions of exercise 03 (the solution, which must score full
   marks, and the release as handed out, which must score zero), in the bubblewrap sandbox where there is one.

Downloads come from the package index (pip's cache makes a second run faster); on Linux without an NVIDIA driver
PyTorch's CPU index is tried first and, where it cannot be reached, the default (CUDA) build is installed, several
GB. Nothing is timed in CI: run it by hand on a quiet machine, --write puts the table into benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.readme import write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LESSON = "03_mixed_precision"
EXERCISE = "03_mixed_precision"
MAKE_SUBMISSIONS = f"""import sys, nbformat
sys.path.insert(0, "tests")
import _nb
_, released = _nb.notebooks({EXERCISE!r})
nbformat.write(_nb.submission({EXERCISE!r}), "submissions/solved.ipynb")
nbformat.write(released, "submissions/untouched.ipynb")
"""


def _size(path: Path) -> int:
    return sum(f.lstat().st_size for f in path.rglob("*") if f.is_file() or f.is_symlink())


def _run(cmd: list[str], cwd: Path, log: Path, timeout: float = 3600) -> tuple[int, str, float]:
    """(exit status, output, seconds) of `cmd`, its output also appended to `log`."""
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        rc, text = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, f"timed out after {timeout} s\n{e.stdout or ''}{e.stderr or ''}"
    took = time.perf_counter() - t0
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}   (in {cwd}, exit {rc}, {took:.0f} s)\n{text}\n")
    return rc, text, took


def _pytest_counts(text: str) -> str:
    found = [ln.strip("= ") for ln in text.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    return re.sub(r" in [\d.]+s.*", "", found[-1]) if found else "no pytest summary"


def bench(python: str, work: Path, log: Path, reuse: bool = False) -> dict:
    """Clone, install, test: one row of the table. With `reuse`, a clone already in `work` (from --keep) is brought
    up to this repository's HEAD (git pull) and course.py's setup only installs what changed."""
    version = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                             capture_output=True, text=True, check=True).stdout.strip()
    clone = work / f"clone-{version}"
    reused = reuse and (clone / ".venv").exists()
    if reused:
        subprocess.run(["git", "-C", str(clone), "pull", "-q", "--ff-only", str(ROOT), "HEAD"], check=True)
        shutil.rmtree(clone / "submissions", ignore_errors=True)
    else:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    commit = subprocess.run(["git", "-C", str(clone), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=True).stdout.strip()
    row = {"python": version, "commit": commit, "reused": reused}
    rc, text, took = _run([python, "-c", "import course; course.setup()"], clone, log)
    got = [ln.split("installed ", 1)[1] for ln in text.splitlines() if "[2/3] installed" in ln]
    row.update(install_s=took, install_ok=rc == 0, venv_gib=_size(clone / ".venv") / 2**30 if
               (clone / ".venv").exists() else 0.0, torch=got[0] if got else "-",
               install_says=(text.strip().splitlines() or ["-"])[-1])
    if rc != 0:
        return row
    rc, text, took = _run([python, "course.py", "test", "-m", "not slow", "-n", "2", "-q", "-p", "no:cacheprovider"],
                          clone, log)
    row.update(fast_s=took, fast=_pytest_counts(text), fast_ok=rc == 0)
    py = str(clone / ".venv" / "bin" / "python")
    rc, text, took = _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_notebooks.py", "-k",
                           f"test_lesson_executes_on_cpu and {LESSON}"], clone, log)
    row.update(lesson_s=took, lesson=_pytest_counts(text), lesson_ok=rc == 0)
    (clone / "submissions").mkdir()
    _run([py, "-c", MAKE_SUBMISSIONS], clone, log)
    rc, text, took = _run([str(clone / ".venv" / "bin" / "memlab-grade"), "class", "submissions", "-a", EXERCISE,
                           "--jobs", "2"], clone, log)
    # memlab-grade prints "[1/2] solved     6 / 6  (12 s)" per learner
    got = {who: (float(s), float(m)) for who, s, m in
           re.findall(r"^\[\d+/\d+\] (solved|untouched)\s+(\d+(?:\.\d+)?) / (\d+(?:\.\d+)?)", text, re.M)}
    ok = rc == 0 and set(got) == {"solved", "untouched"} and got["solved"][0] == got["solved"][1] > 0 \
        and got["untouched"][0] == 0
    row.update(class_s=took, class_ok=ok, classrun=", ".join(f"{who} {s:g}/{m:g}" for who, (s, m) in
                                                              sorted(got.items())) or "no scores printed")
    return row


def table(rows: list[dict]) -> str:
    head = ("| Python (clone's commit) | install (s) | .venv | PyTorch | fast suite | lesson " + LESSON[:2]
            + " | class run, exercise " + EXERCISE[:2] + " |\n|---|---|---|---|---|---|---|")
    lines = []
    for r in rows:
        who = f"{r['python']} ({r['commit']})"
        if not r.get("install_ok"):
            lines.append(f"| {who} | failed after {r['install_s']:.0f} | - | - | - | - | - |\n\n"
                         f"course.py said: `{r['install_says']}`")
            continue
        install = f"{r['install_s']:.0f}" + (" (reused: only what changed)" if r.get("reused") else "")
        lines.append(f"| {who} | {install} | {r['venv_gib']:.1f} GiB | {r['torch']} | "
                     f"{r['fast']} ({r['fast_s']:.0f} s) | {r['lesson']} ({r['lesson_s']:.0f} s) | "
                     f"{'ok' if r['class_ok'] else 'FAILED'}: {r['classrun']} ({r['class_s']:.0f} s) |")
    return head + "\n" + "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", action="append", required=True, help="a Python interpreter (repeat for several)")
    ap.add_argument("--write", action="store_true", help="write the table into benchmarks/README.md")
    ap.add_argument("--keep", type=Path, help="work in this folder and keep the clones (default: a temporary one)")
    ap.add_argument("--reuse", action="store_true", help="with --keep: bring a kept clone up to HEAD and run the "
                                                          "steps again instead of cloning and installing afresh")
    args = ap.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    work = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="course-install-"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "bench_install.log"
    rows = []
    try:
        for python in args.python:
            rows.append(bench(python, work, log, reuse=args.reuse))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    command = " ".join(["python benchmarks/bench_install.py", *(f"--python {p}" for p in args.python),
                        *(["--keep DIR", "--reuse"] if args.reuse else []), "--write"])
    text = (f"`{command}` ({datetime.date.today()}, run from commit {head}, {os.cpu_count()} cores, load average "
            f"{load:.1f} at the end; install = `course.py`'s setup in a fresh clone, pip's download cache as it "
            f"was):\n\n" + table(rows))
    print(text)
    if not args.keep:
        print(f"(the commands' output went to {log}, removed with the clones; --keep DIR keeps both)")
    if args.write:
        write_section("install", text)
    ok = all(r.get("install_ok") and r.get("fast_ok") and r.get("lesson_ok") and r.get("class_ok") for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
