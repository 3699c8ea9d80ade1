"""Build the course's website with Jupyter Book: every lesson with its outputs and figures, the released
exercises (no solutions), the README's syllabus as the index, an Open-in-Colab button on each notebook page.

    python3 course.py book                    execute the lessons (cached: a lesson runs again only when its
                                              code changed) and build _build/book/_build/html/index.html
    python3 course.py book --no-execute       no lesson runs: code and prose only, in a minute
    python3 course.py book --execute 00 03    run only these lessons; the others are shown without outputs
    python3 course.py book --jobs 1           run one lesson at a time, with all of torch's threads

(`.venv/bin/python book/build.py ...` is the same.) The sources are staged into _build/book/src (this folder's
_config.yml and _toc.yml, lessons/, exercises/ and index.md made from README.md), so the tracked notebooks are
never written. The lessons run first, two at a time on a machine with two or more cores, each printing one line
with its time as it finishes; a lesson whose code has not changed since it last ran comes from the execution cache
(_build/book/cache, Jupyter Book's own), and the line says so. Then Jupyter Book builds the pages from the cache,
with a line every 30 seconds. Nothing is downloaded: no network needed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
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


def default_jobs() -> int:
    """Lessons run at once: two where there are two cores or more (each kernel then gets its share of the threads)."""
    return 2 if (os.cpu_count() or 1) >= 2 else 1


def what_was_built(executed: list[str], jobs: int = 1) -> str:
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
    how = (f", {jobs} lessons at a time with {kernel_threads(jobs)} CPU thread(s) each" if jobs > 1 and
           len(executed) > 1 else "")
    return (f"*The outputs on these pages come from running {which} on {date} on {platform.system()} "
            f"{platform.machine()}, {dev}, {tv}{how}; lessons not run show code only. The exercises are shown as "
            f"released, without solutions and without outputs.*")


def kernel_threads(jobs: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, jobs))


def _copy_if_changed(src: Path, dest: Path) -> None:
    """Copy only when the bytes differ, so Sphinx rebuilds only the pages that changed."""
    if not dest.exists() or dest.read_bytes() != src.read_bytes():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest)


def _write_if_changed(dest: Path, text: str) -> None:
    if not dest.exists() or dest.read_text() != text:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)


def stage(out: Path, executed: list[str], root: Path = ROOT, jobs: int = 1) -> Path:
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
    for extra in ("_ext", "_static"):           # the site's own Sphinx extension and style sheet
        for f in sorted((BOOK / extra).glob("*.*")):
            if f.suffix in (".py", ".css"):
                _copy_if_changed(f, src / extra / f.name)
    _write_if_changed(src / "index.md", index_page((root / "README.md").read_text(), what_was_built(executed, jobs)))
    return src


def expected_seconds(root: Path = ROOT) -> dict[str, float]:
    """{"lessons/NN_x.ipynb": seconds}: each lesson's run time as benchmarks/bench_notebooks.py last wrote it into
    benchmarks/README.md (empty when there is no such table)."""
    page = root / "benchmarks" / "README.md"
    text = page.read_text() if page.exists() else ""
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| (lessons/\S+\.ipynb) \| ([\d.]+) \|", text, re.M)}


# Run in a fresh interpreter per lesson: execute one staged notebook exactly as myst-nb's cache mode does
# (jupyter_cache's single_nb_execution, in the notebook's folder) and write the executed notebook as JSON.
_RUN_ONE = """
import json, sys, nbformat
from jupyter_cache.executors.utils import single_nb_execution
path, out, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3])
nb = nbformat.read(path, as_version=4)
res = single_nb_execution(nb, cwd=str(__import__("pathlib").Path(path).parent), timeout=timeout, allow_errors=False,
                          meta_override=True)
err = None if res.err is None else (res.exc_string or repr(res.err))[-3000:]
with open(out, "w") as f:
    json.dump({"nb": res.nb, "seconds": res.time, "error": err}, f)
"""


def execute_lessons(src: Path, executed: list[str], cache_path: Path, timeout: int, jobs: int, log=print) -> list[str]:
    """Run the staged lessons numbered `executed` into Jupyter Book's execution cache (jupyter-cache), `jobs` at
    a time, printing one line per lesson as it finishes: its time, or that its code has not changed since it ran
    (the cache). Returns the failures (empty: every lesson ran)."""
    from jupyter_cache import get_cache
    from jupyter_cache.base import CacheBundleIn
    import nbformat
    cache = get_cache(str(cache_path))
    paths = [p for n in executed for p in sorted(src.glob(f"lessons/{n}_*.ipynb"))]
    todo = []
    for path in paths:
        rel = path.relative_to(src).as_posix()
        try:
            record = cache.match_cache_notebook(nbformat.read(path, as_version=4))
        except KeyError:
            todo.append(path)
            continue
        ran = record.data.get("execution_seconds")
        log(f"  {rel}: unchanged since it ran on {record.created:%Y-%m-%d %H:%M} UTC"
            + (f" ({ran:.0f} s): outputs from the cache" if ran else ": outputs from the cache"))
    if not todo:
        return []
    # longest first, so that two workers finish together: the time of the lesson's last run in this cache, else the
    # one benchmarks/bench_notebooks.py wrote into benchmarks/README.md, else first (unknown: maybe long)
    took = expected_seconds()
    for record in cache.list_cache_records():
        rel = Path(record.uri).relative_to(src).as_posix() if Path(record.uri).is_relative_to(src) else record.uri
        took[rel] = float(record.data.get("execution_seconds") or took.get(rel, 0.0))
    todo.sort(key=lambda p: -took.get(p.relative_to(src).as_posix(), float("inf")))
    env = {**os.environ, "OMP_NUM_THREADS": str(kernel_threads(jobs)), "MKL_NUM_THREADS": str(kernel_threads(jobs))} \
        if jobs > 1 else dict(os.environ)
    log(f"running {len(todo)} lesson(s), {min(jobs, len(todo))} at a time"
        + (f", {env['OMP_NUM_THREADS']} CPU thread(s) each" if jobs > 1 else "") + ":")
    failures, lock = [], threading.Lock()

    def run(path: Path) -> None:
        rel = path.relative_to(src).as_posix()
        with tempfile.TemporaryDirectory(prefix="book-run-") as tmp:
            out = Path(tmp) / "executed.json"
            t0 = time.monotonic()
            proc = subprocess.run([sys.executable, "-c", _RUN_ONE, str(path), str(out), str(timeout)], cwd=path.parent,
                                  env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
            took = time.monotonic() - t0
            result = json.loads(out.read_text()) if out.exists() else {"error": proc.stderr[-3000:] or "no output"}
        with lock:
            if result["error"]:
                failures.append(f"{rel}:\n{result['error']}")
                log(f"  {rel}: FAILED after {took:.0f} s")
                return
            nb = nbformat.from_dict(result["nb"])
            cache.cache_notebook_bundle(CacheBundleIn(nb, str(path), data={"execution_seconds": result["seconds"]}),
                                        check_validity=False, overwrite=True)
            log(f"  {rel}: ran in {result['seconds']:.0f} s")

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(run, todo))
    return failures


def jupyter_book() -> list[str]:
    exe = Path(sys.executable).parent / ("jupyter-book.exe" if os.name == "nt" else "jupyter-book")
    if not exe.exists():
        raise SystemExit("Jupyter Book is not installed in this environment: .venv/bin/python -m pip install -e "
                         "\".[book]\" (or run `python3 course.py book`, which installs the course's extras)")
    return [str(exe)]


def build(out: Path = OUT, executed: list[str] | None = None, log=print, jobs: int | None = None) -> Path:
    """Stage, run the lessons asked for (execute_lessons) and build the website into out/_build/html; returns the
    folder holding index.html."""
    t_all = time.monotonic()
    executed = lesson_numbers() if executed is None else list(executed)
    jobs = default_jobs() if jobs is None else jobs
    unknown = sorted(set(executed) - set(lesson_numbers()))
    if unknown:
        raise ValueError(f"executed: no lesson numbered {unknown}; the lessons are {lesson_numbers()}")
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a whole number of at least 1, got {jobs!r}")
    src = stage(out, executed, jobs=jobs)
    cmd = jupyter_book() + ["build", str(src), "--path-output", str(out), "--builder", "html"]
    if executed:
        config = yaml.safe_load((src / "_config.yml").read_text())["execute"]
        failures = execute_lessons(src, executed, out / "cache", int(config.get("timeout", 1200)), jobs, log)
        if failures:
            raise SystemExit("a lesson failed to run, so the website was not built:\n" + "\n\n".join(failures))
    log("building the pages with Jupyter Book" + (" (outputs from the cache)" if executed else " (no outputs)")
        + f"; log: {out / 'build.log'}")
    t0 = time.monotonic()
    # --path-output: Jupyter Book writes into <path-output>/_build/html
    proc = subprocess.Popen(cmd, cwd=src, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    last = time.monotonic()
    for line in proc.stdout:
        lines.append(line)
        if "Executing notebook" in line:          # myst-nb found no cached outputs: it runs the lesson itself
            log(f"  {line.strip()}")
        if time.monotonic() - last >= 30:
            last = time.monotonic()
            log(f"  still building ({last - t0:.0f} s so far)")
    rc = proc.wait()
    text = "".join(lines)
    (out / "build.log").write_text(text)
    html = out / "_build" / "html"
    failed = [line for line in text.splitlines() if "Execution Failed" in line or "Executing notebook failed" in line]
    if rc != 0 or not (html / "index.html").exists() or failed:
        tail = "\n".join(text.splitlines()[-40:])
        raise SystemExit(f"the website did not build (log: {out / 'build.log'}):\n{tail}")
    log(f"built the pages in {time.monotonic() - t0:.0f} s ({time.monotonic() - t_all:.0f} s in all): open "
        f"{html / 'index.html'}")
    for problem in site_problems(html):          # fix these where they come from (a lesson, memlab's NOISE)
        log(f"warning: the site shows {problem}")
    return html


class _Text(HTMLParser):
    """A page's visible text: everything outside <script> and <style>."""

    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("script", "style"):
            self._skip += 1

    def handle_endtag(self, tag):
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def course_packages(root: Path = ROOT) -> set[str]:
    """The packages the course installs or names (pyproject.toml's dependencies and extras, flash-attn included),
    normalised: an instruction to `pip install` one of these belongs on the site."""
    try:
        import tomllib
    except ModuleNotFoundError:          # Python 3.10: pip vendors the same parser
        from pip._vendor import tomli as tomllib
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for rs in project.get("optional-dependencies", {}).values() for r in rs]
    return {_norm(re.split(r"[<>=!~ \[;@]", r.strip(), maxsplit=1)[0]) for r in reqs} | {_norm(project["name"])}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# a line PyTorch's profiler (kineto) writes with the date and the process:thread ids; "pid 1234" and the like
_PROCESS_IDS = re.compile(r"(?:USDT|STAGE|INFO|WARNING|ERROR):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ |"
                          r"\bpid[ =:]+\d{2,}", re.I)
_PIP_INSTALL = re.compile(r"\bpip3? install((?:\s+[^\s`'\"]+)+)")


def site_problems(html: Path, root: Path = ROOT) -> list[str]:
    """What no reader should see on the built pages: a path of the machine that built them (the course's folder,
    the build folder, the home folder, a Python environment), a process id (PyTorch's profiler lines), or an
    instruction to install a package the course does not use (a library's own hint, like bitsandbytes'
    "pip install kernels"). One line per finding: the page, what, an excerpt."""
    needles = {str(root): "the course's folder on the build machine", str(html.parent.parent): "the build folder",
               "site-packages": "a Python environment's path", "/.venv/": "a Python environment's path",
               sys.prefix: "the build's Python environment"}
    home = str(Path.home())
    if len(home) > 1:
        needles[home] = "the home folder of the build machine"
    allowed = course_packages(root)
    found = []
    for page in sorted(html.rglob("*.html")):
        parser = _Text()
        parser.feed(page.read_text(encoding="utf-8", errors="replace"))
        text = "".join(parser.parts)
        rel = page.relative_to(html).as_posix()

        def excerpt(i: int) -> str:
            return " ".join(text[max(0, i - 60):i + 80].split())
        for needle, what in needles.items():
            i = text.find(needle)
            if i >= 0:
                found.append(f"{rel}: {what}: ...{excerpt(i)}...")
        for m in _PROCESS_IDS.finditer(text):
            found.append(f"{rel}: a process id: ...{excerpt(m.start())}...")
        for m in _PIP_INSTALL.finditer(text):
            names = [t for t in m.group(1).split() if not t.startswith("-")][:1]
            pkg = _norm(re.split(r"[<>=!~\[;@]", names[0], maxsplit=1)[0]) if names else ""
            if pkg and pkg not in allowed and not pkg.startswith((".", "/")):
                found.append(f"{rel}: tells readers to install {pkg}, which the course does not use: "
                             f"...{excerpt(m.start())}...")
    return found


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="course.py book", description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no-execute", action="store_true", help="run no lesson (code and prose only)")
    g.add_argument("--execute", nargs="+", metavar="NN", help="run only these lessons (default: all, cached)")
    p.add_argument("--jobs", type=int, default=default_jobs(),
                   help=f"lessons run at once (default {default_jobs()}: two where there are two cores)")
    p.add_argument("--out", type=Path, default=OUT, help=f"output folder (default {OUT.relative_to(ROOT)})")
    a = p.parse_args(argv)
    executed = [] if a.no_execute else a.execute
    try:
        build(a.out.resolve(), executed, jobs=a.jobs)
    except ValueError as e:
        p.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
