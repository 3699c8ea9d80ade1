"""Build the course's website with Jupyter Book: every lesson with its outputs and figures, the released
exercises (no solutions), the README's syllabus as the index, an Open-in-Colab button on each notebook page.

    python3 course.py book                    execute the lessons (cached: a lesson runs again only when its
                                              code changed) and build _build/book/_build/html/index.html
    python3 course.py book --no-execute       no lesson runs: code and prose only, in a minute
    python3 course.py book --execute 00 03    run only these lessons; the others are shown without outputs

(`.venv/bin/python book/build.py ...` is the same.) The sources are staged into _build/book/src (this folder's
_config.yml and _toc.yml, lessons/, exercises/ and index.md made from README.md), so the tracked notebooks are
never written; Jupyter Book's execution cache is _build/book/cache. Nothing is downloaded: no network needed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

BOOK = Path(__file__).resolve().parent
ROOT = BOOK.parent
OUT = ROOT / "_build" / "book"
LESSON = re.compile(r"^(\d\d)_\w+\.ipynb$")


def course_notebooks(root: Path = ROOT) -> list[str]:
    """The notebooks the website shows, as repository paths: lessons/NN_*.ipynb, exercises/NN_*/NN_*.ipynb."""
    found = sorted(p.relative_to(root).as_posix() for p in (root / "lessons").glob("*.ipynb"))
    found += sorted(p.relative_to(root).as_posix() for p in (root / "exercises").glob("*/*.ipynb"))
    return found


def lesson_numbers(root: Path = ROOT) -> list[str]:
    return [m.group(1) for p in sorted((root / "lessons").glob("*.ipynb")) if (m := LESSON.match(p.name))]


def index_page(readme: str, built: str) -> str:
    """index.md: the README's title and opening (up to its first "## " section), then its Syllabus section,
    whose links name the notebooks by their repository paths (the staged book keeps those paths)."""
    parts = re.split(r"(?m)^(?=## )", readme)
    syllabus = next((p for p in parts[1:] if p.startswith("## Syllabus")), None)
    if syllabus is None:
        raise ValueError("README.md has no '## Syllabus' section to make the website's index from")
    return (parts[0].rstrip() + "\n\n" + syllabus.rstrip() + "\n\n" + built + "\n")


def what_was_built(executed: list[str]) -> str:
    """One line on the index saying where and how the outputs on these pages were made (true for any build)."""
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    if not executed:
        return f"*These pages were built on {date} without running the lessons: code and prose, no outputs.*"
    try:
        import torch
        dev = (f"CUDA GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
               else f"CPU only ({os.cpu_count()} logical cores)")
        tv = f"PyTorch {torch.__version__}"
    except ImportError:
        dev, tv = f"{os.cpu_count()} logical cores", "no PyTorch"
    which = "every lesson" if executed == lesson_numbers() else "lessons " + ", ".join(executed)
    return (f"*The outputs on these pages come from running {which} on {date} on {platform.system()} "
            f"{platform.machine()}, {dev}, {tv}; lessons not run show code only. The exercises are shown as "
            f"released, without solutions and without outputs.*")


def _copy_if_changed(src: Path, dest: Path) -> None:
    """Copy only when the bytes differ, so Sphinx rebuilds only the pages that changed."""
    if not dest.exists() or dest.read_bytes() != src.read_bytes():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)


def _write_if_changed(dest: Path, text: str) -> None:
    if not dest.exists() or dest.read_text() != text:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)


def stage(out: Path, executed: list[str], root: Path = ROOT) -> Path:
    """Lay out the book's sources in out/src and return that folder. `executed`: lesson numbers to run
    (empty: none)."""
    src = out / "src"
    notebooks = course_notebooks(root)
    for rel in notebooks:
        _copy_if_changed(root / rel, src / rel)
    for old in list(src.glob("lessons/*.ipynb")) + list(src.glob("exercises/*/*.ipynb")):
        if old.relative_to(src).as_posix() not in notebooks:     # gone from the course
            old.unlink()
    config = yaml.safe_load((BOOK / "_config.yml").read_text())
    ex = config["execute"]
    ex["cache"] = str(out / "cache")
    if executed:
        ex["exclude_patterns"] = list(ex.get("exclude_patterns", [])) + [
            f"lessons/{n}_*" for n in lesson_numbers(root) if n not in executed]
    else:
        ex["execute_notebooks"] = "off"
    _write_if_changed(src / "_config.yml", yaml.safe_dump(config, sort_keys=False))
    _copy_if_changed(BOOK / "_toc.yml", src / "_toc.yml")
    _write_if_changed(src / "index.md", index_page((root / "README.md").read_text(), what_was_built(executed)))
    return src


def jupyter_book() -> list[str]:
    exe = Path(sys.executable).parent / ("jupyter-book.exe" if os.name == "nt" else "jupyter-book")
    if not exe.exists():
        raise SystemExit("Jupyter Book is not installed in this environment: .venv/bin/python -m pip install -e "
                         "\".[book]\" (or run `python3 course.py book`, which installs the course's extras)")
    return [str(exe)]


def build(out: Path = OUT, executed: list[str] | None = None, log=print) -> Path:
    """Stage and build the website into out/_build/html; returns the folder holding index.html."""
    executed = lesson_numbers() if executed is None else list(executed)
    unknown = sorted(set(executed) - set(lesson_numbers()))
    if unknown:
        raise ValueError(f"executed: no lesson numbered {unknown}; the lessons are {lesson_numbers()}")
    src = stage(out, executed)
    what = "no lesson runs" if not executed else f"running lessons {', '.join(executed)} (cached)"
    log(f"building the website with Jupyter Book ({what}) from {src} ...")
    t0 = time.monotonic()
    # --path-output: Jupyter Book writes into <path-output>/_build/html
    cmd = jupyter_book() + ["build", str(src), "--path-output", str(out), "--builder", "html"]
    res = subprocess.run(cmd, cwd=src, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    (out / "build.log").write_text(res.stdout + res.stderr)
    html = out / "_build" / "html"
    failed = [line for line in (res.stdout + res.stderr).splitlines() if "Execution Failed" in line
              or "Executing notebook failed" in line]
    if res.returncode != 0 or not (html / "index.html").exists() or failed:
        tail = "\n".join((res.stdout + res.stderr).splitlines()[-40:])
        raise SystemExit(f"the website did not build (log: {out / 'build.log'}):\n{tail}")
    log(f"built in {time.monotonic() - t0:.0f} s: open {html / 'index.html'}")
    return html


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="course.py book", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no-execute", action="store_true", help="run no lesson (code and prose only)")
    g.add_argument("--execute", nargs="+", metavar="NN", help="run only these lessons (default: all, cached)")
    p.add_argument("--out", type=Path, default=OUT, help=f"output folder (default {OUT.relative_to(ROOT)})")
    a = p.parse_args(argv)
    executed = [] if a.no_execute else a.execute
    try:
        build(a.out.resolve(), executed)
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
