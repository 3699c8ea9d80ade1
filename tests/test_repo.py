"""The repository's own promises: one README test command, and the conda
environment lists exactly pyproject's dependencies."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

try:
    import tomllib
except ModuleNotFoundError:          # Python 3.10: pip vendors the same parser
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def _names(reqs):
    return sorted(re.split(r"[<>=!~ \[]", r.strip(), maxsplit=1)[0].lower() for r in reqs)


def test_environment_yml_matches_pyproject():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = (ROOT / "environment.yml").read_text()
    deps = yaml.safe_load(env)["dependencies"]
    pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    listed = [p for p in pip if not p.startswith("-")]        # "-e ." installs the course itself
    assert _names(listed) == _names(py["dependencies"]), (
        f"environment.yml pip packages {_names(listed)} differ from pyproject dependencies {_names(py['dependencies'])}")
    gpu = py["optional-dependencies"]["gpu"]
    for pkg in gpu:
        assert f"# - {pkg}" in env, f"the GPU-only extra {pkg} should appear commented out in environment.yml"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    m = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\s*\n(.+?)\n```", readme)
    assert m, "README.md must show the test command in a code block right after <!-- test-command -->"
    assert m.group(1).strip() in ci, f".ci/run must call the README's test command: {m.group(1).strip()!r}"
