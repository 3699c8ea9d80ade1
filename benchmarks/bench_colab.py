"""A simulated Colab run: every lesson, and every exercise's solution with its visible tests, executed in a fresh
environment that holds the course's wheel (not this repository) with only the extras the notebook's setup cell
names, as Colab's setup cell installs it.

    python benchmarks/bench_colab.py [--write] [--only 07] [--keep DIR]

What it builds, in a temporary folder outside the repository:

- the course's wheel (`python -m build`), installed non-editable;
- one virtual environment per set of extras the setup cells name (the base kit, [zero], [qlora]), each with
  PyTorch (course.py's pin, standing in for the one Colab has), the kernel machinery Colab runs notebooks with
  (ipykernel, nbclient) and `gpu-memory-lab[EXTRAS]` from the wheel, held to constraints.txt, and nothing else;
- the notebooks, copied beside nothing: the lessons as they are, each exercise as released (exercises/) with its
  solution cells filled in from solutions/ (so the visible tests run against a correct solution; the release has no
  hidden tests).

Each notebook runs top to bottom in the environment its setup cell asks for, from its own folder, with an import
finder that notes which optional packages (DeepSpeed, peft, bitsandbytes) it imported. A notebook that imports one
its setup cell does not install fails with ModuleNotFoundError, as on Colab; the table lists the optional packages
each notebook imported. Nothing here is timed in CI (the
static check is tests/test_colab.py); --write puts the table into benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import nbformat  # noqa: E402

import course  # noqa: E402
from benchmarks.readme import write_section  # noqa: E402
from test_notebooks import WHO_IMPORTS, setup_extras  # noqa: E402

# run inside each environment: execute one notebook with the finder, print one JSON line
DRIVER = r"""
import json, sys, time, nbformat
from nbclient import NotebookClient
path, finder = sys.argv[1], sys.argv[2]
nb = nbformat.read(path, as_version=4)
nb.cells.insert(2, nbformat.v4.new_code_cell(finder))
# the optional packages that were imported (asked for and found: transformers asks for deepspeed and peft
# whether they are installed or not)
nb.cells.append(nbformat.v4.new_code_cell("print('HEAVY:' + repr(sorted(p for p in _who.seen if p in _sys.modules)))"))
t0 = time.time()
error = None
try:
    NotebookClient(nb, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(__import__("pathlib").Path(path).parent)}}).execute()
except Exception as e:                                     # the first failing cell: its error, in one line
    import re
    error = f"{type(e).__name__}: " + re.sub(r"\x1b\[[0-9;]*m", "", (str(e).strip().splitlines() or [""])[-1])[:300]
seen = "".join(o.get("text", "") for o in nb.cells[-1].get("outputs", []))
print(json.dumps({"seconds": time.time() - t0, "error": error, "heavy": seen.strip().removeprefix("HEAVY:")}))
"""


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, **kw)


def build_wheel(out: Path) -> Path:
    res = _run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)])
    if res.returncode != 0:
        raise SystemExit(f"the wheel did not build:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return next(out.glob("gpu_memory_lab-*.whl"))


def make_env(folder: Path, wheel: Path, extras: set[str], log) -> Path:
    """A fresh venv with PyTorch, the kernel machinery and the course's wheel with `extras`; returns its python."""
    t0 = time.perf_counter()
    py = folder / "bin" / "python"
    if not py.exists():                    # --keep DIR: a second run reinstalls the wheel into the same one
        _run([sys.executable, "-m", "venv", str(folder)]).check_returncode()
    target = f"{wheel}[{','.join(sorted(extras))}]" if extras else str(wheel)
    steps = [[course.TORCH_PIN], ["ipykernel", "nbclient", "nbformat"], ["--force-reinstall", "--no-deps", target],
             [target]]
    for args in steps:
        res = _run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args, "-c",
                    str(course.LOCK)])
        if res.returncode != 0:
            raise SystemExit(f"installing {args} into {folder.name} failed:\n{res.stderr[-3000:]}")
    size = sum(f.lstat().st_size for f in folder.rglob("*") if f.is_file()) / 2**30
    log(f"environment {folder.name}: {time.perf_counter() - t0:.0f} s, {size:.1f} GiB")
    where = _run([str(py), "-c", "import memlab; print(memlab.__file__)"], cwd=folder).stdout.strip()
    if not where.startswith(str(folder)):
        raise SystemExit(f"{folder.name} imports memlab from {where}, not from the installed wheel")
    return py


def stage(dest: Path, only: list[str]) -> list[tuple[str, Path]]:
    """(repository path, staged copy) of every lesson and every solved exercise (release + solutions)."""
    import _nb
    out = []
    for src in sorted((ROOT / "lessons").glob("*.ipynb")):
        if not only or src.name[:2] in only:
            out.append((src.relative_to(ROOT).as_posix(), src))
    for src in sorted((ROOT / "exercises").glob("*/*.ipynb")):
        if not only or src.name[:2] in only:
            out.append((src.relative_to(ROOT).as_posix(), src))
    staged = []
    for rel, src in out:
        copy = dest / rel
        copy.parent.mkdir(parents=True, exist_ok=True)
        if rel.startswith("exercises/"):
            nbformat.write(_nb.submission(src.parent.name), copy)          # solved, visible tests only
        else:
            shutil.copyfile(src, copy)
        staged.append((rel, copy))
    return staged


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="write the table into benchmarks/README.md")
    ap.add_argument("--only", nargs="+", metavar="NN", default=[], help="only these lesson/exercise numbers")
    ap.add_argument("--keep", type=Path, help="work in this folder and keep it (default: a temporary one)")
    args = ap.parse_args(argv)
    work = args.keep.resolve() if args.keep else Path(tempfile.mkdtemp(prefix="course-colab-"))
    work.mkdir(parents=True, exist_ok=True)
    log = print
    head = _run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT).stdout.strip()
    # the notebooks and the wheel come from the working tree, which may hold what is not committed yet
    if _run(["git", "status", "--porcelain", "--", "lessons", "exercises", "solutions", "memlab", "autograder",
             "pyproject.toml"], cwd=ROOT).stdout.strip():
        head += " plus uncommitted changes"
    rows, t_all = [], time.perf_counter()
    try:
        wheel = build_wheel(work / "dist")
        log(f"built {wheel.name}")
        notebooks = stage(work / "notebooks", args.only)
        wants = {rel: frozenset(setup_extras(nbformat.read(copy, as_version=4).cells[1].source) or ())
                 for rel, copy in notebooks}
        envs = {}
        for extras in sorted(set(wants.values()), key=sorted):
            name = "env-" + ("-".join(sorted(extras)) or "base")
            envs[extras] = make_env(work / name, wheel, set(extras), log)
        for rel, copy in notebooks:
            extras = wants[rel]
            res = _run([str(envs[extras]), "-c", DRIVER, str(copy), WHO_IMPORTS], cwd=copy.parent,
                       env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")})
            try:
                got = json.loads(res.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                got = {"seconds": 0.0, "error": f"driver failed: {res.stderr.strip()[-300:]}", "heavy": "?"}
            row = {"notebook": rel, "extras": ",".join(sorted(extras)) or "base", **got}
            rows.append(row)
            log(f"{rel:<60} [{row['extras']}] {row['seconds']:6.1f} s  "
                f"{'ok' if not row['error'] else 'FAILED: ' + row['error']}  imported {row['heavy']}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    failed = [r for r in rows if r["error"]]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = (f"`python benchmarks/bench_colab.py --write` ({datetime.date.today()}, commit {head}, Python "
            f"{sys.version.split()[0]}, {os.cpu_count()} cores, load average {load:.1f} at the end; "
            f"{(time.perf_counter() - t_all) / 60:.1f} min in all, the environments included): "
            f"**{len(rows) - len(failed)} of {len(rows)} notebooks ran** in a fresh environment holding the "
            f"course's wheel and only the extras their setup cell names.\n\n"
            "| notebook | setup cell installs | seconds | result | optional packages imported |\n"
            "|---|---|---|---|---|\n"
            + "\n".join(f"| {r['notebook']} | {r['extras']} | {r['seconds']:.1f} | "
                        f"{'ok' if not r['error'] else 'FAILED: ' + r['error'].replace('|', '/')} | "
                        f"{r['heavy'].strip('[]').replace(chr(39), '') or '-'} |" for r in rows))
    print(text)
    if args.write and not args.only:
        write_section("colab", text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
