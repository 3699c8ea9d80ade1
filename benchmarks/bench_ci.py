"""The test suite itself: time `.ci/run` (the README's test command on two workers, then ruff) in a fresh clone
of this repository's HEAD, as CI runs it, and report the counts pytest printed.

    python benchmarks/bench_ci.py [--write]        # --write puts the result into benchmarks/README.md

The clone creates its own .venv (pip's cache makes that a few minutes on a machine that installed the course
before). Run it on a quiet machine: the figure is wall time on all the cores there are.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.readme import write_section  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="write the result into benchmarks/README.md")
    args = ap.parse_args(argv)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="memlab-ci-") as tmp:
        clone = Path(tmp) / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        t0 = time.perf_counter()
        out = subprocess.run(["bash", ".ci/run"], cwd=clone, capture_output=True, text=True,
                             env={**os.environ, "CI": "true"}, stdin=subprocess.DEVNULL)
        took = time.perf_counter() - t0
    lines = out.stdout.splitlines()
    summary = [ln for ln in lines if re.search(r"\d+ passed", ln)]
    counts = summary[-1].strip("= ") if summary else "no pytest summary line"
    # the ten slowest tests (from --durations in .ci/run): where CI's time goes
    start = next((i for i, ln in enumerate(lines) if "slowest" in ln and "durations" in ln), None)
    slowest = [ln.strip() for ln in lines[start + 1:start + 11]] if start is not None else []
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    text = (f"`python benchmarks/bench_ci.py --write` ({datetime.date.today()}, commit {head}, {os.cpu_count()} "
            f"cores, load average {load:.1f} at the end): `.ci/run` in a fresh clone took **{took / 60:.1f} min** "
            f"(exit {out.returncode}), including creating `.venv` from pip's cache; pytest: {counts}.")
    if slowest:
        text += "\n\nThe ten slowest tests of that run:\n\n" + "\n".join(f"    {ln}" for ln in slowest)
    print(text)
    if out.returncode != 0:
        print(out.stdout[-4000:], out.stderr[-4000:], sep="\n")
    if args.write:
        write_section("ci", text)
    return out.returncode


if __name__ == "__main__":
    sys.exit(main())
