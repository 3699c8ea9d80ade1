"""The course's website (`python3 course.py book`, book/build.py): Jupyter Book's table of contents lists every
lesson and exercise, its Colab links name the course's repository, the index is the README's syllabus; a build
with one lesson executed has every page, figures that exist and load, internal links that resolve, an
Open-in-Colab link per notebook page and no solution in the exercises. Checked with an HTML parser, and in headless
Chromium where one is installed (Debian: apt-get install chromium; the `playwright` package drives it)."""

from __future__ import annotations

import functools
import os
import shutil
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

from _nb import ROOT

BOOK = ROOT / "book"
FAST_LESSON = "03"         # a lesson with figures that runs in about 25 s on 2 CPU cores


def _build_module():
    import importlib.util
    spec = importlib.util.spec_from_file_location("course_book_build", BOOK / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


build = _build_module()


def _slug() -> str:
    import memlab
    return memlab.REPO_SLUG


# ----------------------------------------------------------------------------- the sources (fast)
def test_toc_lists_every_lesson_and_exercise():
    toc = yaml.safe_load((BOOK / "_toc.yml").read_text())
    files = [ch["file"] for part in toc["parts"] for ch in part["chapters"]]
    want = [p.removesuffix(".ipynb") for p in build.course_notebooks()]
    assert sorted(files) == sorted(want), ("book/_toc.yml must list every notebook in lessons/ and exercises/: "
                                           f"missing {sorted(set(want) - set(files))}, "
                                           f"stale {sorted(set(files) - set(want))}")
    assert toc["root"] == "index" and not any(f.startswith("solutions/") for f in files)


def test_config_names_the_course_repository_for_colab():
    cfg = yaml.safe_load((BOOK / "_config.yml").read_text())
    assert cfg["repository"]["url"] == f"https://github.com/{_slug()}", "book/_config.yml and memlab.REPO_SLUG differ"
    assert cfg["repository"]["branch"] == "main" and cfg["launch_buttons"]["colab_url"].startswith("https://colab")
    assert cfg["execute"]["execute_notebooks"] == "cache" and cfg["execute"]["raise_on_error"] is True


def test_index_is_the_readme_syllabus():
    page = build.index_page((ROOT / "README.md").read_text(), "*built*")
    assert page.startswith("# GPU Memory Lab") and "## Syllabus" in page and "## Start" not in page
    for rel in build.course_notebooks():
        assert f"]({rel})" in page, f"the syllabus does not link {rel}"
    with pytest.raises(ValueError, match="Syllabus"):
        build.index_page("# no syllabus here\n", "")


def test_the_site_check_finds_build_paths_process_ids_and_foreign_installs(tmp_path):
    """build.site_problems on pages that show what the site must not: a path of the build machine, a profiler
    line with process ids, a library's "pip install kernels"; a package the course uses may be named."""
    html = tmp_path / "out" / "_build" / "html"
    (html / "lessons").mkdir(parents=True)
    bad = (f"<p>{ROOT}/.venv/lib/python3.11/site-packages/torch/utils/checkpoint.py:238: UserWarning</p>"
           "<pre>USDT:2026-11-28 13:58:45 8875:8875 SyncActivityProfilerHandler.cpp:52] profiler_start</pre>"
           "<pre>Failed to load CPU gemm_4bit_forward: Please make sure you already `pip install kernels`</pre>")
    (html / "lessons" / "bad.html").write_text(f"<html><body>{bad}</body></html>")
    (html / "lessons" / "good.html").write_text("<html><script>var p = '/.venv/';</script><body><p>`pip install "
                                                "flash-attn --no-build-isolation` installs it; `pip install -q "
                                                "gpu-memory-lab[qlora]`</p></body></html>")
    found = build.site_problems(html)
    assert all(f.startswith("lessons/bad.html: ") for f in found), found
    said = " | ".join(found)
    for what in ("the course's folder on the build machine", "a Python environment's path", "a process id",
                 "tells readers to install kernels"):
        assert what in said, (what, found)


def test_lessons_are_run_longest_first_by_their_measured_times(tmp_path):
    """The order the lessons run in comes from benchmarks/README.md's table of measured times (bench_notebooks.py),
    so that two workers finish together."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "README.md").write_text(
        "| notebook | seconds | result |\n|---|---|---|\n| lessons/00_a.ipynb | 16.1 | ok |\n"
        "| lessons/04_b.ipynb | 54.0 | ok |\n| solutions/04_b/04_b.ipynb | 24.6 | ok |\n")
    assert build.expected_seconds(tmp_path) == {"lessons/00_a.ipynb": 16.1, "lessons/04_b.ipynb": 54.0}
    assert build.expected_seconds(tmp_path / "nowhere") == {}
    assert set(build.expected_seconds()) <= {f"lessons/{p.name}" for p in (ROOT / "lessons").glob("*.ipynb")}


def test_book_command_is_wired_into_course_py(capsys):
    import course
    assert "book" in course.COMMANDS
    with pytest.raises(SystemExit):
        build.main(["--execute", "42"])                       # no such lesson: argparse's error, exit 2
    assert "no lesson numbered ['42']" in capsys.readouterr().err


# ----------------------------------------------------------------------------- a real build (slow)
class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.imgs, self.links, self.ids = [], [], set()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "img" and a.get("src"):
            self.imgs.append(a["src"])
        if tag == "a" and a.get("href"):
            self.links.append(a["href"])


@functools.lru_cache(maxsize=None)
def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


@pytest.fixture(scope="session")
def site(tmp_path_factory, worker_id) -> Path:
    """One build per test run: under pytest-xdist the first worker to need it builds it (about a minute) in the
    run's shared temporary folder, and the others wait for it and read it (pytest-xdist's own recipe)."""
    if shutil.which("jupyter-book", path=str(Path(sys.executable).parent)) is None:
        msg = "Jupyter Book is not installed in this environment (pip install -e '.[book]')"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    if worker_id == "master":                               # no pytest-xdist: this process is the whole run
        return build.build(tmp_path_factory.mktemp("book"), [FAST_LESSON], log=lambda s: None)
    from filelock import FileLock
    shared = tmp_path_factory.getbasetemp().parent          # this run's folder, above every worker's own
    built = shared / "book-site.txt"                        # the path of the built site, once built
    with FileLock(str(shared / "book-site.lock")):
        if not built.exists():
            out = shared / "book"
            out.mkdir()
            built.write_text(str(build.build(out, [FAST_LESSON], log=lambda s: None)))
    return Path(built.read_text())


def _pages(html: Path) -> list[Path]:
    return [html / "index.html"] + [html / (p.removesuffix(".ipynb") + ".html") for p in build.course_notebooks()]


@pytest.mark.slow
def test_every_page_is_built_with_its_images_links_and_colab_button(site):
    pages = _pages(site)
    missing = [p.relative_to(site).as_posix() for p in pages if not p.exists()]
    assert not missing, f"pages not built: {missing}"
    broken = []
    for page in pages:
        parsed = _parse(page)
        for src in parsed.imgs:
            if urlsplit(src).scheme in ("http", "https", "data"):
                continue
            if not (page.parent / unquote(urlsplit(src).path)).is_file():
                broken.append(f"{page.relative_to(site)}: image {src}")
        for href in parsed.links:
            parts = urlsplit(href)
            if parts.scheme or href.startswith("mailto:"):
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.is_file():
                broken.append(f"{page.relative_to(site)}: link {href}")
            elif parts.fragment and target.suffix == ".html" and parts.fragment not in _parse(target).ids:
                broken.append(f"{page.relative_to(site)}: link {href} (no such anchor)")
    assert not broken, "broken internal images or links:\n" + "\n".join(broken[:40])

    for rel in build.course_notebooks():
        page = site / (rel.removesuffix(".ipynb") + ".html")
        colab = f"https://colab.research.google.com/github/{_slug()}/blob/main/{rel}"
        assert colab in _parse(page).links, f"{page.relative_to(site)} has no Open-in-Colab link {colab}"
    index_links = {(site / unquote(urlsplit(h).path)).resolve() for h in _parse(site / "index.html").links
                   if not urlsplit(h).scheme and urlsplit(h).path}
    assert {p.resolve() for p in pages[1:]} <= index_links, "the index (syllabus) links every lesson and exercise"


@pytest.mark.slow
def test_the_site_shows_no_build_machine_paths_process_ids_or_foreign_installs(site):
    """Outputs carry what the lesson printed: no path of the machine that built the site, no process ids, no
    library telling readers to install a package the course does not use (fixed where they come from: memlab's
    NOISE, the lesson's own code)."""
    found = build.site_problems(site)
    assert not found, "\n".join(found[:20])


@pytest.mark.slow
def test_executed_lesson_has_its_figures_and_exercises_have_no_solutions(site):
    lesson = next(site.glob(f"lessons/{FAST_LESSON}_*.html"))
    figures = [s for s in _parse(lesson).imgs if "_images/" in s]
    assert figures, f"{lesson.name}: no figure in the executed lesson"
    for src in figures:
        assert (lesson.parent / src).stat().st_size > 1000, f"{src} is not a real figure"
    index = (site / "index.html").read_text()
    assert f"lessons {FAST_LESSON}" in index, "the index says which lessons were run"
    for page in site.glob("exercises/*/*.html"):
        text = page.read_text()
        assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text, f"{page.name} shows a solution"
        assert "NotImplementedError" in text, f"{page.name} is not the released exercise"
        assert 'class="output' not in text, f"{page.name}: exercises are shown without outputs"


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if shutil.which(name):
            return shutil.which(name)
    return None


@pytest.mark.slow
def test_pages_render_their_figures_in_headless_chromium(site):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("no browser check: the `playwright` package is not installed (pip install playwright); the "
                    "HTML parser checks above still ran")
    exe = _chromium()
    if exe is None:
        pytest.skip("no browser check: no Chromium on this machine (Debian/Ubuntu: apt-get install chromium); the "
                    "HTML parser checks above still ran")
    problems, seen_figures = [], 0
    titles = {p.removesuffix(".ipynb"): _notebook_title(ROOT / p) for p in build.course_notebooks()}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, args=["--no-sandbox"])
        try:
            # a laptop's window for every page; a phone's (390 px) for the index and the lessons
            for width, height, pages in ((1280, 800, _pages(site)),
                                         (390, 844, [q for q in _pages(site) if "exercises" not in q.parts])):
                page = browser.new_page(viewport={"width": width, "height": height})
                failed: list[str] = []
                errors: list[str] = []
                page.on("requestfailed", lambda r: failed.append(r.url) if r.url.startswith("file:") else None)
                page.on("pageerror", lambda e: errors.append(str(e)))       # an uncaught script error
                for path in pages:
                    failed.clear()
                    errors.clear()
                    where = f"{path.relative_to(site)} at {width} px"
                    page.goto(path.as_uri(), wait_until="load")
                    look = page.evaluate(_LOOK)
                    for img in look["imgs"]:
                        if img["src"].startswith("file:"):
                            seen_figures += "/_images/" in img["src"]
                            if not img["ok"]:
                                problems.append(f"{where}: image did not render: {img['src']}")
                            elif img["right"] > look["main_right"] + 1:
                                problems.append(f"{where}: image wider than the text column: {img['src']}")
                    problems += [f"{where}: could not load {u}" for u in failed]
                    problems += [f"{where}: script error: {e}" for e in errors]
                    if look["scroll_width"] > look["width"] + 1:
                        problems.append(f"{where}: the page is {look['scroll_width']} px wide, wider than the "
                                        f"window: it scrolls sideways")
                    title = page.title()
                    if not title or "404" in title:
                        problems.append(f"{where}: no title ({title!r})")
                    rel = path.relative_to(site).as_posix().removesuffix(".html")
                    if rel in titles and _plain(look["h1"].rstrip("#")) != _plain(titles[rel]):
                        problems.append(f"{where}: heading {look['h1']!r}, the notebook's title is {titles[rel]!r}")
                    if rel.startswith("lessons/"):
                        if not look["code_cells"] or look["highlighted"] < look["code_cells"]:
                            problems.append(f"{where}: {look['code_cells']} code cells, {look['highlighted']} "
                                            "highlighted")
                        if look["stderr"]:
                            problems.append(f"{where}: {look['stderr']} output(s) on stderr (library noise?)")
                    if rel.startswith(f"lessons/{FAST_LESSON}_") and not look["outputs"]:
                        problems.append(f"{where}: the executed lesson shows no outputs")
                page.close()
        finally:
            browser.close()
    assert not problems, "\n".join(problems[:40])
    assert seen_figures, "no figure was rendered on any page"


# what a reader sees, measured in the browser: the page's width against the window, the title, code cells and
# their syntax highlighting, outputs (stderr ones counted), images and the text column's right edge
_LOOK = """() => {
  const main = document.querySelector('main') || document.body;
  const r = main.getBoundingClientRect();
  return {
    width: window.innerWidth, scroll_width: document.documentElement.scrollWidth,
    h1: (document.querySelector('main h1') || {textContent: ''}).textContent.trim(),
    code_cells: document.querySelectorAll('.cell .cell_input').length,
    highlighted: document.querySelectorAll('.cell .cell_input .highlight').length,
    outputs: document.querySelectorAll('.cell_output').length,
    stderr: document.querySelectorAll('.cell_output .stderr').length,
    main_right: r.right,
    imgs: Array.from(document.images).map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0,
                                                 right: i.getBoundingClientRect().right})),
  };
}"""


def _plain(title: str) -> str:
    """A heading as text: Sphinx's typographic quotes and markdown's code and emphasis marks left out."""
    for fancy, plain in (("\u2019", "'"), ("\u2018", "'"), ("\u201c", '"'), ("\u201d", '"')):
        title = title.replace(fancy, plain)
    return " ".join(title.replace("`", "").replace("*", "").split())


def _notebook_title(path: Path) -> str:
    import nbformat
    return nbformat.read(path, as_version=4).cells[0].source.splitlines()[0].removeprefix("# ").strip()


def test_staged_config_runs_only_the_lessons_asked_for(tmp_path):
    """The staged config is what Jupyter Book reads: only the lessons asked for run, exercises never, and
    --no-execute turns execution off."""
    src = build.stage(tmp_path, [FAST_LESSON])
    excluded = yaml.safe_load((src / "_config.yml").read_text())["execute"]["exclude_patterns"]
    assert "exercises/*/*.ipynb" in excluded and f"lessons/{FAST_LESSON}_*" not in excluded
    assert all(f"lessons/{n}_*" in excluded for n in build.lesson_numbers() if n != FAST_LESSON)
    assert sorted(p.relative_to(src).as_posix() for p in src.rglob("*.ipynb")) == sorted(build.course_notebooks())
    off = yaml.safe_load((build.stage(tmp_path, []) / "_config.yml").read_text())
    assert off["execute"]["execute_notebooks"] == "off"
