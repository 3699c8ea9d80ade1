"""Colab: every notebook's setup cell installs what that notebook imports, checked without running anything.

On Colab a notebook's setup cell installs the course's kit with the extras it names (gpu-memory-lab[zero] @ git+...,
see tests/test_notebooks.py's SETUP); everything else it imports must be in the base package or on Colab already.
This test reads each lesson and each exercise (the source notebook's cells without its hidden tests: the cells
a learner runs and the visible tests) and finds the optional packages (DeepSpeed, peft, bitsandbytes) they reach:

- imported by a cell;
- imported anywhere in a course module a cell names in an import statement (`from memlab.kit import ex07 as kit`:
  memlab/kit/ex07.py, its functions' imports included), and in every module of an exercise's checks package
  (`from autograder.checks import ex07`: a visible test's `check(ex07.TASKS[...])` runs its cases, run, refs and
  judge, which import their libraries inside functions);
- imported at module level by any course module those load (`import memlab` loads memlab's packages).

A package's own import of an optional integration (transformers importing peft when it is installed) does not
count; nor can a static reading see an import made by a function reached only through calls into the kit
(memlab.fit building a peft model): the lessons' run with an import finder (tests/test_notebooks.py) and the
simulated Colab run (benchmarks/bench_colab.py) catch those.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import nbformat
import pytest

from test_notebooks import GIT, HEAVY, setup_extras

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("*/*.ipynb"))
COURSE = ("memlab", "autograder")
HIDDEN = re.compile(r"### BEGIN HIDDEN TESTS.*?### END HIDDEN TESTS", re.S)
CHECKS = re.compile(r"autograder\.checks\.ex\d\d$")


def _rel(p: Path) -> str:
    return str(p.relative_to(ROOT))


def _file(module: str) -> Path | None:
    """The source file of a course module (a package's __init__.py), or None if `module` is not one."""
    base = ROOT.joinpath(*module.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def _absolute(module: str, node: ast.ImportFrom) -> str:
    """The absolute module an ImportFrom in `module` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = module if _file(module) and _file(module).name == "__init__.py" else module.rpartition(".")[0]
    parts = package.split(".")
    base = parts[:len(parts) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(module: str, tree: ast.AST) -> list[tuple[str, bool]]:
    """(absolute module, at module level?) of every import statement in `tree`; `from a import b` gives a.b when
    that is a course module, else a."""
    out = []
    top = set(map(id, getattr(tree, "body", [])))

    def visit(node, level_0):
        for child in ast.iter_child_nodes(node):
            at_top = level_0 and id(child) in top
            if isinstance(child, ast.Import):
                out.extend((a.name, at_top) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = _absolute(module, child)
                for a in child.names:
                    sub = f"{base}.{a.name}"
                    out.append((sub if base.startswith(COURSE) and _file(sub) else base, at_top))
            # a module's top-level `if`/`try` blocks run at import too
            visit(child, at_top and isinstance(child, (ast.If, ast.Try)))
    visit(tree, True)
    return out


@functools.lru_cache(maxsize=None)
def _module_imports(module: str) -> tuple[tuple[str, bool], ...]:
    f = _file(module)
    return tuple(_imports(module, ast.parse(f.read_text()))) if f else ()


def _submodules(package: str) -> list[str]:
    folder = ROOT.joinpath(*package.split("."))
    return [package] + sorted(f"{package}.{p.stem}" for p in folder.glob("*.py") if p.stem != "__init__")


def _loaded(modules: set[str]) -> set[str]:
    """The course modules importing `modules` loads (their module-level imports, transitively, parents included)."""
    seen, todo = set(), list(modules)
    while todo:
        m = todo.pop()
        parts = m.split(".")
        for i in range(1, len(parts) + 1):             # importing a.b.c runs a and a.b first
            name = ".".join(parts[:i])
            if name not in seen and name.startswith(COURSE) and _file(name):
                seen.add(name)
                todo += [dep for dep, top in _module_imports(name) if top]
    return seen


def notebook_code(path: Path) -> str:
    """The code a learner runs: every code cell, the hidden tests left out (cell magics and shell lines too)."""
    nb = nbformat.read(path, as_version=4)
    cells = [HIDDEN.sub("", c.source) for c in nb.cells if c.cell_type == "code"]
    return "\n".join(line for cell in cells for line in cell.splitlines() if not line.lstrip().startswith(("%", "!")))


def reached(path: Path) -> dict[str, str]:
    """{optional package: where it is imported} for the notebook at `path` (see the module docstring)."""
    code = notebook_code(path)
    direct = [m for m, _ in _imports("__main__", ast.parse(code))]
    found: dict[str, str] = {}
    for m in direct:
        if m.split(".")[0] in HEAVY:
            found.setdefault(m.split(".")[0], "the notebook")
    named = {m for m in direct if m.startswith(COURSE) and _file(m) and m not in COURSE}
    entries = set()
    for m in named:
        entries.update(_submodules(m) if CHECKS.match(m) else [m])
    for m in sorted(entries):
        for dep, _ in _module_imports(m):
            if dep.split(".")[0] in HEAVY:
                found.setdefault(dep.split(".")[0], m)
    for m in sorted(_loaded(entries | {m for m in direct if m in COURSE})):
        for dep, top in _module_imports(m):
            if top and dep.split(".")[0] in HEAVY:
                found.setdefault(dep.split(".")[0], f"{m} (at import)")
    return found


@pytest.mark.parametrize("path", LESSONS + SOLUTIONS, ids=_rel)
def test_setup_cell_installs_what_the_notebook_imports(path):
    nb = nbformat.read(path, as_version=4)
    extras = setup_extras(nb.cells[1].source)
    assert extras is not None, f"{_rel(path)}: the second cell is not the course's setup cell"
    seen = reached(path)
    need = {HEAVY[p] for p in seen}
    assert need <= extras, (f"{_rel(path)} imports {seen} (package: where): on Colab its setup cell must install "
                            f"gpu-memory-lab[{','.join(sorted(need | extras))}] @ {GIT}, it installs "
                            f"{sorted(extras) or 'the base kit'}")


def test_the_release_installs_what_its_source_does():
    """Learners open exercises/: its setup cell is the source's (memlab-grade release copies it)."""
    for src in SOLUTIONS:
        rel = ROOT / "exercises" / src.relative_to(ROOT / "solutions")
        a, b = (setup_extras(nbformat.read(p, as_version=4).cells[1].source) for p in (src, rel))
        assert a == b, f"{_rel(rel)} installs {b}, its source {_rel(src)} installs {a}: run memlab-grade release"


def test_the_finder_sees_what_it_must():
    """The reading above, on known cases: exercise 07's checks and kit import bitsandbytes inside functions, lesson
    06 imports DeepSpeed in a cell, and `import memlab` alone imports no optional package."""
    ex07 = reached(ROOT / "solutions" / "07_qlora" / "07_qlora.ipynb")
    assert "bitsandbytes" in ex07 and (ex07["bitsandbytes"].startswith(("autograder.checks.ex07", "memlab.kit.ex07")))
    assert reached(ROOT / "lessons" / "06_zero_and_sharding.ipynb").get("deepspeed") == "the notebook"
    assert not {dep for m in _loaded({"memlab"}) for dep, top in _module_imports(m) if top
                and dep.split(".")[0] in HEAVY}, "importing memlab imports an optional package"
