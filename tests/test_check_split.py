"""Each exercise's checks are split in two: the learner side (`__init__.py`, `inputs.py`, `run.py`, with
checks/common.py), the only part the sandbox receives, and the trusted side (`cases.py`, `refs.py`, `judge.py`),
which the grader and the learner's own kernel import when a task's `cases` or `judge` is first called. These tests
show that the learner side stands alone and never reaches for the trusted side."""

from __future__ import annotations

import ast
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from autograder.checks import CHECKS

ROOT = Path(__file__).resolve().parents[1]
CHECKS_DIR = ROOT / "autograder" / "checks"
LEARNER_FILES = ("__init__.py", "inputs.py", "run.py")
TRUSTED = ("cases", "refs", "judge")

# Run in a fresh interpreter whose only course code is the staged copy: import every package, check its tasks and
# that their trusted parts cannot be reached. Prints {module: {task id: [problems]}} as JSON.
PROBE = r"""
import importlib, json, random, sys
stage, modules = sys.argv[1], json.loads(sys.argv[2])
report = {}
for module in modules:
    pkg = importlib.import_module(module)
    tasks = report[module] = {}
    if not pkg.__file__.startswith(stage):
        tasks["<import>"] = [f"imported from {pkg.__file__}, not from the staged copy"]
        continue
    for tid, task in pkg.TASKS.items():
        problems = tasks[tid] = []
        if not callable(task.run) or getattr(task.run, "__module__", None) != module + ".run":
            problems.append(f"run is {task.run!r}, not a function of {module}.run")
        if not task.names or not all(isinstance(n, str) and n.isidentifier() for n in task.names):
            problems.append(f"names {task.names!r}")
        for role, call in (("cases", lambda: task.cases(False, random.Random(0))),
                           ("judge", lambda: task.judge({}, None))):
            try:
                call()
            except ModuleNotFoundError as e:
                if e.name != f"{module}.{role}":
                    problems.append(f"{role}: ModuleNotFoundError for {e.name}, not {module}.{role}")
            except BaseException as e:
                problems.append(f"{role}: raised {type(e).__name__}: {e}, not ModuleNotFoundError")
            else:
                problems.append(f"{role}: ran in the sandbox's copy")
loaded = sorted(m for m in sys.modules if m.rpartition(".")[2] in ("cases", "refs", "judge")
                and m.startswith("autograder."))
print(json.dumps({"report": report, "trusted_loaded": loaded}))
"""


def _stage(dst: Path) -> None:
    """What the sandbox receives of the course: memlab, and of autograder only the checks' learner side."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "memlab", dst / "memlab", ignore=ignore)
    (dst / "autograder" / "checks").mkdir(parents=True)
    shutil.copy(ROOT / "autograder" / "__init__.py", dst / "autograder" / "__init__.py")
    for f in ("__init__.py", "common.py"):
        shutil.copy(CHECKS_DIR / f, dst / "autograder" / "checks" / f)
    for module in CHECKS.values():
        name = module.rpartition(".")[2]
        (dst / "autograder" / "checks" / name).mkdir()
        for f in LEARNER_FILES:
            assert (CHECKS_DIR / name / f).is_file(), f"{module} has no {f}: every package has the learner-side files"
            shutil.copy(CHECKS_DIR / name / f, dst / "autograder" / "checks" / name / f)


def test_the_learner_side_imports_alone_and_cannot_reach_the_trusted_side(tmp_path):
    """Every package imports from a copy of its learner side alone, every task's `run` and `names` are there, and
    its `cases` and `judge` fail with ModuleNotFoundError for the trusted module they name."""
    stage = tmp_path / "stage"
    _stage(stage)
    env = dict(os.environ, PYTHONPATH=str(stage))
    out = subprocess.run([sys.executable, "-c", PROBE, str(stage), json.dumps(list(CHECKS.values()))], cwd=stage,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["trusted_loaded"] == [], f"the learner side loaded trusted modules: {got['trusted_loaded']}"
    for module, tasks in got["report"].items():
        expected = set(importlib.import_module(module).TASKS)        # the course's own copy, in this process
        assert set(tasks) == expected, f"{module}: the staged copy has tasks {sorted(tasks)}, not {sorted(expected)}"
        for tid, problems in tasks.items():
            assert problems == [], f"{module} {tid}: {problems}"
    assert set(got["report"]) == set(CHECKS.values())


def _imported(node: ast.AST, package: str) -> list[str]:
    """The absolute module names an import statement reaches (`from . import cases` reaches package.cases)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = package.split(".")
            base = base[:len(base) - node.level + 1]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        return [mod] + [f"{mod}.{a.name}" for a in node.names]
    return []


@pytest.mark.parametrize("module", sorted(CHECKS.values()))
def test_no_learner_side_file_imports_the_trusted_side(module):
    """No import statement in a learner-side file (at module level or inside a function) names an exercise's
    cases, refs or judge module."""
    name = module.rpartition(".")[2]
    files = [CHECKS_DIR / name / f for f in LEARNER_FILES] + [CHECKS_DIR / "common.py", CHECKS_DIR / "__init__.py"]
    for path in files:
        package = module if path.parent.name == name else "autograder.checks"
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target in _imported(node, package):
                parts = target.split(".")
                assert not (parts[:2] == ["autograder", "checks"] and len(parts) >= 4 and parts[3] in TRUSTED), (
                    f"{path.relative_to(ROOT)}:{node.lineno} imports {target}: the learner side must not import "
                    f"the trusted side (name the function as a string in Task instead)")
