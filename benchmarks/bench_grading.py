"""Class grading throughput and the sandbox's cost per learner, on the drill exercise.

    python benchmarks/bench_grading.py [--learners 8]

Prints: the wall time of one class run with --jobs 1 and with --jobs 2 (same
submissions, scores compared), and the time to grade one learner with the
bubblewrap sandbox and with the plain-process fallback (MEMLAB_NO_BWRAP=1).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from autograder import grade, sandbox  # noqa: E402
from autograder.trusted import grade_notebook, stage_course_code  # noqa: E402

MARKERS = re.compile(r"^\s*### (BEGIN|END) SOLUTION\s*$", re.M)


def solved(course: grade.Course) -> dict:
    """The drill's source notebook with the solution markers removed: an honest learner."""
    nb = json.loads((grade.DRILL / "99_drill" / "99_drill.ipynb").read_text())
    for c in nb["cells"]:
        src = "".join(c["source"]) if isinstance(c["source"], list) else c["source"]
        c["source"] = MARKERS.sub("", src)
    return nb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--learners", type=int, default=8)
    a = ap.parse_args()
    if a.learners < 2:
        raise SystemExit("--learners must be at least 2")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        course = grade.drill_course(tmp / "course")
        subs = tmp / "subs"
        subs.mkdir()
        for i in range(a.learners):
            (subs / f"learner{i:02d}.ipynb").write_text(json.dumps(solved(course)))
        runs = {}
        for jobs in (1, 2):
            t0 = time.perf_counter()
            res = grade.grade_class(subs, "99_drill", timeout=120, course=course, jobs=jobs, log=lambda s: None)
            runs[jobs] = (time.perf_counter() - t0, res.graded)
        same = runs[1][1] == runs[2][1]
        print(f"class run, {a.learners} learners, {os.cpu_count()} cores:")
        for jobs, (sec, _) in runs.items():
            print(f"  --jobs {jobs}: {sec:6.1f} s  ({sec / a.learners:.2f} s per learner)")
        print(f"  speed-up --jobs 2 vs 1: {runs[1][0] / runs[2][0]:.2f}x; identical scores: {same}")
        stage = stage_course_code(tmp / "stage")
        ex = grade.exercise("99_drill", course.release)
        one = subs / "learner00.ipynb"
        print("one learner, graded alone (median of 3):")
        for label, env in (("bubblewrap sandbox", None), ("plain process (fallback)", "1")):
            if env:
                os.environ["MEMLAB_NO_BWRAP"] = env
            box = sandbox.Sandbox()
            if label.startswith("bubble") and not box.bwrap:
                print(f"  {label}: bwrap not installed")
                continue
            times = sorted(grade_notebook(one, ex, stage=stage, sandbox=box).seconds for _ in range(3))
            print(f"  {label:<26} {times[1]:.2f} s")
        os.environ.pop("MEMLAB_NO_BWRAP", None)


if __name__ == "__main__":
    main()
