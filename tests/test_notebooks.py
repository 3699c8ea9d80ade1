"""Notebooks are source: every lesson executes top to bottom on CPU, and every
tracked notebook is committed clean, with the course's setup cell and badge."""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import nbformat
import pytest

import memlab

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))
ALL = LESSONS + sorted((ROOT / "solutions").glob("*/*.ipynb")) + sorted((ROOT / "exercises").glob("*/*.ipynb"))
SETUP = '''# Setup: on Colab install the course kit; then pick the device and say what we found.
import sys, subprocess
if "google.colab" in sys.modules:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q",
                    "{target}"], check=True)
import torch
import memlab
torch.manual_seed(0)
device = memlab.pick_device()
print(memlab.describe(device))
ON_GPU = device.type == "cuda"'''
GIT = f"git+https://github.com/{memlab.REPO_SLUG}"
# the Colab install target: the base kit, or the kit with the extras a notebook needs
TARGET = re.compile(r"(?:gpu-memory-lab\[(?P<extras>[a-z,]+)\] @ )?" + re.escape(GIT))
HEAVY = {"deepspeed": "zero", "peft": "qlora", "bitsandbytes": "qlora"}    # package -> the extra that installs it


WHO_IMPORTS = f"""import importlib.abc as _abc, sys as _sys
class _Who(_abc.MetaPathFinder):
    seen = {{}}
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in {set(HEAVY)!r} and top not in self.seen:
            f = _sys._getframe(1)
            while f is not None and str(f.f_globals.get("__name__", "")).startswith(("importlib", "_frozen")):
                f = f.f_back
            self.seen[top] = str(f.f_globals.get("__name__", "?")) if f is not None else "?"
_who = _Who()
_sys.meta_path.insert(0, _who)"""


def setup_extras(source: str) -> set[str] | None:
    """The extras a setup cell installs on Colab (empty: the base kit), or None if it is not the course's cell."""
    for m in re.finditer(r'"([^"]*github\.com[^"]*)"', source):
        t = TARGET.fullmatch(m[1])
        if t and source.startswith(SETUP.format(target=m[1])):
            return set(filter(None, (t["extras"] or "").split(",")))
    return None


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


@pytest.mark.parametrize("path", ALL, ids=_rel)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"{_rel(path)}: cells {dirty} carry outputs or execution counts; strip them before committing"


@pytest.mark.parametrize("path", ALL, ids=_rel)
def test_header_badge_and_setup_cell(path):
    nb = nbformat.read(path, as_version=4)
    head = nb.cells[0]
    assert head.cell_type == "markdown" and head.source.startswith("# "), f"{_rel(path)}: first cell must be a title"
    # learners open the released exercise, so a solution's badge points there too
    target = _rel(path).replace("solutions/", "exercises/", 1)
    assert memlab.colab_badge(target) in head.source, (
        f"{_rel(path)}: the header needs the Colab badge built from memlab.REPO_SLUG: {memlab.colab_badge(target)}")
    setup = nb.cells[1]
    assert setup.cell_type == "code" and setup_extras(setup.source) is not None, (
        f"{_rel(path)}: the second cell must be the course's setup cell (see tests/test_notebooks.py SETUP), "
        f"installing {GIT} or gpu-memory-lab[EXTRAS] @ {GIT}")


def test_every_syllabus_link_points_at_a_notebook():
    readme = (ROOT / "README.md").read_text()
    for link in re.findall(r"\]\((lessons/[^)]+\.ipynb|exercises/[^)]+\.ipynb)\)", readme):
        assert (ROOT / link).exists(), f"README links to {link}, which does not exist"


@pytest.fixture(scope="module")
def working_copy(tmp_path_factory) -> Path:
    """The learner's working copy, made as `python3 course.py start` makes it: lessons run where learners run
    them (no data/ or course files beside them)."""
    import course
    dest = tmp_path_factory.mktemp("copy") / "my-work"
    course.sync_work(ROOT, dest)
    return dest


@pytest.mark.slow
@pytest.mark.parametrize("path", LESSONS, ids=_rel)
def test_lesson_executes_on_cpu(path, working_copy):
    from nbclient import NotebookClient
    copy = working_copy / path.relative_to(ROOT)
    nb = nbformat.read(copy, as_version=4)
    # which optional packages the lesson's own code (or memlab) imports: Colab's setup cell must install them. A
    # finder inserted after the setup cell notes, for each, the module whose import statement first asked for it;
    # transformers, accelerate and peft import them on their own when they are installed (optional integrations)
    extras = setup_extras(nb.cells[1].source)
    nb.cells.insert(2, nbformat.v4.new_code_cell(WHO_IMPORTS))
    nb.cells.append(nbformat.v4.new_code_cell("print('HEAVY:' + repr(_who.seen))"))
    t0 = time.time()
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(copy.parent)}}).execute()
    took = time.time() - t0
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    print(f"{_rel(path)} executed in {took:.1f} s")
    line = "".join(o.get("text", "") for o in nb.cells[-1].outputs).strip()
    seen = ast.literal_eval(line.removeprefix("HEAVY:"))          # {package: the module that first imported it}
    need = {HEAVY[p] for p, who in seen.items() if not who.startswith(("transformers", "accelerate", "peft"))}
    assert need <= extras, (f"{_rel(path)} imports {seen} (package: importing module): on Colab its setup cell "
                            f"must install gpu-memory-lab[{','.join(sorted(need | extras))}] @ {GIT}, "
                            f"it installs {sorted(extras) or 'the base kit'}")
