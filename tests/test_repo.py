"""The repository's own promises: one README test command; the conda environment
lists exactly what course.py installs (pyproject's dependencies and its "all"
extras); a non-editable install (Colab) carries every package and builds without
a warning."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:          # Python 3.10: pip vendors the same parser
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def _names(reqs):
    return sorted(re.split(r"[<>=!~ \[]", r.strip(), maxsplit=1)[0].lower() for r in reqs)


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _expand(py, extra):
    """The requirements of one extra, with self-references (gpu-memory-lab[a,b]) expanded."""
    out = []
    for req in py["optional-dependencies"][extra]:
        m = re.fullmatch(r"\s*gpu-memory-lab\[([^\]]+)\]\s*", req)
        out += [r for e in m.group(1).split(",") for r in _expand(py, e.strip())] if m else [req]
    return out


def test_environment_yml_matches_pyproject():
    py = _pyproject()["project"]
    env = (ROOT / "environment.yml").read_text()
    deps = yaml.safe_load(env)["dependencies"]
    pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    listed = [p for p in pip if not p.startswith("-")]        # "-e ." installs the course itself
    want = py["dependencies"] + _expand(py, "all")
    assert _names(listed) == _names(want), (
        f"environment.yml pip packages {_names(listed)} differ from pyproject dependencies + extra 'all' "
        f"{_names(want)}")
    gpu = py["optional-dependencies"]["gpu"]
    for pkg in gpu:
        assert f"# - {pkg}" in env, f"the GPU-only extra {pkg} should appear commented out in environment.yml"


def test_extras_all_covers_every_extra_but_gpu_and_course_py_installs_it():
    py = _pyproject()["project"]
    extras = set(py["optional-dependencies"]) - {"all", "gpu"}
    m = re.fullmatch(r"gpu-memory-lab\[([^\]]+)\]", py["optional-dependencies"]["all"][0])
    assert m and set(m.group(1).split(",")) == extras, f"extra 'all' should name every extra but gpu: {sorted(extras)}"
    course = (ROOT / "course.py").read_text()
    assert re.search(r'^EXTRAS = "all"', course, re.M), "course.py should install the course with its 'all' extra"


def test_base_dependencies_stay_light():
    """The Colab setup cell installs the base package: no instructor or tool packages in it."""
    base = _names(_pyproject()["project"]["dependencies"])
    heavy = {"jupyterlab", "nbgrader", "nbclient", "pytest", "deepspeed", "bitsandbytes", "peft", "flash-attn"}
    assert not heavy & set(base), f"move {sorted(heavy & set(base))} into an extra of pyproject.toml"


def test_every_python_package_is_packaged():
    """A non-editable install (pip install git+..., as on Colab) gets only the packages pyproject names."""
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for top in ("memlab", "autograder")
             for p in (ROOT / top).rglob("__init__.py")}
    assert found <= listed, f"pyproject.toml [tool.setuptools] packages lacks {sorted(found - listed)}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    m = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\s*\n(.+?)\n```", readme)
    assert m, "README.md must show the test command in a code block right after <!-- test-command -->"
    assert m.group(1).strip() in ci, f".ci/run must call the README's test command: {m.group(1).strip()!r}"


def test_benchmark_sections_are_rewritten_between_their_markers(tmp_path):
    from benchmarks.readme import write_section
    page = tmp_path / "README.md"
    page.write_text("# B\n<!-- bench:ci -->\nold line\n<!-- /bench:ci -->\nafter\n")
    write_section("ci", "new line", readme=page)
    assert page.read_text() == "# B\n<!-- bench:ci -->\nnew line\n<!-- /bench:ci -->\nafter\n"
    with pytest.raises(ValueError, match="exactly one"):
        write_section("notebooks", "x", readme=page)
    with pytest.raises(ValueError, match="name"):
        write_section("Bad Name", "x", readme=page)
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    for name in ("ci", "notebooks"):      # the sections the scripts write exist once each
        assert readme.count(f"<!-- bench:{name} -->") == 1 and readme.count(f"<!-- /bench:{name} -->") == 1


def test_every_data_file_of_memlab_is_package_data():
    """A non-editable install (Colab, pip) carries only the files package-data names: every shipped config,
    recording and text under memlab/ must be matched, or a lesson fails outside the repository."""
    import fnmatch
    data = _pyproject()["tool"]["setuptools"]["package-data"]
    missing = []
    for f in sorted((ROOT / "memlab").rglob("*")):
        if not f.is_file() or f.suffix in (".py", ".pyc") or "__pycache__" in f.parts:
            continue
        rel = f.relative_to(ROOT)
        ok = any(rel.parent.as_posix().startswith(pkg.replace(".", "/"))
                 and fnmatch.fnmatch(rel.relative_to(pkg.replace(".", "/")).as_posix(), pattern)
                 for pkg, patterns in data.items() for pattern in patterns)
        if not ok:
            missing.append(str(rel))
    assert not missing, f"pyproject.toml [tool.setuptools.package-data] does not ship {missing}"


@pytest.mark.slow
def test_the_wheel_and_sdist_build_and_the_wheel_works_outside_the_repository(tmp_path):
    """A release is one command: `python -m build` makes a wheel and an sdist that twine accepts, and the wheel,
    installed away from this checkout, imports and finds its package data (configs, texts, recordings)."""
    import subprocess
    import sys
    import zipfile
    dist = tmp_path / "dist"
    out = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # setuptools' warnings (a data folder not named as a package, a deprecated field) are what `pip install` shows
    # on Colab; "byte-compiling is disabled" only echoes PYTHONDONTWRITEBYTECODE
    warned = [line for line in (out.stdout + out.stderr).splitlines()
              if re.search(r"warning", line, re.I) and "byte-compiling is disabled" not in line]
    assert not warned, "building the course warns:\n" + "\n".join(warned[:10])
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in dist.iterdir())
    out = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, wheels + sdists)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    names = zipfile.ZipFile(wheels[0]).namelist()
    shipped = [f.relative_to(ROOT).as_posix() for f in sorted((ROOT / "memlab").rglob("*"))
               if f.is_file() and f.suffix not in (".py", ".pyc") and "__pycache__" not in f.parts]
    assert shipped and not [f for f in shipped if f not in names], "the wheel lacks some of memlab's data files"
    site = tmp_path / "site"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                          str(site), str(wheels[0])], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    probe = ("import sys, pathlib, memlab, autograder.cli\n"
             "assert pathlib.Path(memlab.__file__).is_relative_to(sys.argv[1]), memlab.__file__\n"
             "from memlab.core.texts import shipped_text\nassert len(shipped_text()) > 1000\n"
             "from memlab.fitting.plan import load_config\nload_config('llama-2-7b')\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", probe, str(site)], cwd=tmp_path, capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(site)}, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-1000:] + out.stderr[-2000:]


def test_no_course_file_goes_through_a_legacy_module_path():
    """memlab's old flat paths (memlab.estimate, memlab.models, memlab.dist, ...) stay importable for a learner's
    older notebook only: every file of the course names the grouped path (memlab.core.estimate, memlab.sharding)."""
    import re
    from memlab import LEGACY_MODULES
    names = "|".join(sorted(LEGACY_MODULES, key=len, reverse=True))
    dotted = re.compile(rf"(?<![\w.])memlab\.({names})\b(?!\.py)|memlab/dist/")
    imported = re.compile(rf"from memlab import [^\n]*\b({names})\b")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    found = []
    for f in tracked:
        if f in ("memlab/__init__.py", "tests/test_repo.py") or not f.endswith((".py", ".ipynb", ".md", ".toml")):
            continue
        text = (ROOT / f).read_text(encoding="utf-8", errors="replace")
        found += [f"{f}: {m[0]}" for m in (*dotted.finditer(text), *imported.finditer(text))]
    assert not found, f"use the grouped paths: {found[:10]} ({len(found)} in all)"


def test_a_legacy_module_path_still_imports_the_same_module_and_warns_once():
    code = ("import warnings\nwarnings.simplefilter('always')\nimport memlab\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    from memlab.models import GPT\n    import memlab.models as m\n    import memlab.dist.zero as z\n"
            "    assert m is memlab.core.models and GPT is memlab.GPT and z is memlab.sharding.zero\n"
            "    assert memlab.estimate is memlab.core.estimate\n"
            "print(sorted(str(x.message).split(' is now')[0] for x in w if x.category is FutureWarning))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['memlab.dist', 'memlab.estimate', 'memlab.models']", out.stdout
