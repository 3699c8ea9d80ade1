"""Class grading throughput and the sandbox's cost per learner, on the drill exercise.

    python benchmarks/bench_grading.py [--learners 8]

Prints: the wall time of one class run with --jobs 1 and with --jobs 2 (same
submissions, scores compared), and the time to grade one learner with the
bubblewrap sandbox and with the plain-process fallback (MEMLAB_NO_BWRAP=1).
Then what the integrity checks cost one learner beside that learner's whole grading
(target: under 10%): the tampering scan of the cells, on exercise 05's reference
notebook, and exercise 05's large case (the one the cgroup's memory peak
corroborates), run alone in one thread as the sandbox runs it.
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
        integrity_overhead(tmp, stage)


def integrity_overhead(tmp: Path, stage: Path) -> None:
    """The scan and the corroborated case against one whole grading of exercise 05's reference solution."""
    import random
    import nbformat
    import torch
    from autograder.checks.ex05 import TASKS, cases
    from autograder.trusted import code_to_run, read_notebook, tampering
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from _nb import solution_namespace, submission
    name = "05_efficient_attention"
    nb = tmp / "ex05_reference.ipynb"
    nbformat.write(submission(name), nb)
    ex = grade.exercise(name)
    whole = grade_notebook(nb, ex, stage=stage)
    cells = code_to_run(ex.template, read_notebook(nb))
    t0 = time.perf_counter()
    for _ in range(100):
        tampering(cells)
    scan = (time.perf_counter() - t0) / 100
    torch.set_num_threads(1)
    fn = solution_namespace(name, {})["tiled_attention"]
    case = cases.large_case(random.Random(0))
    t0 = time.perf_counter()
    TASKS["task5_2_tiled_attention"].run(case, tiled_attention=fn)
    large = time.perf_counter() - t0
    print(f"integrity checks, exercise 05's reference ({whole.seconds:.1f} s in its sandbox, memory peak "
          f"{(whole.memory_peak or 0) / 2**30:.2f} GiB, flags {whole.flags or 'none'}):")
    print(f"  tampering scan of {len(cells)} cells: {scan * 1e3:.2f} ms ({100 * scan / whole.seconds:.3f}%)")
    print(f"  the corroborated large case of task 5.2: {large:.2f} s ({100 * large / whole.seconds:.1f}% of the "
          f"learner's sandbox time, which includes it)")


if __name__ == "__main__":
    main()
