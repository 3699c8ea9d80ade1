"""Class grading throughput and the sandbox's cost per learner, on the drill exercise.

    python benchmarks/bench_grading.py [--learners 8] [--integrity-only] [--ex08-judges N] [--class-of N]

Prints: the wall time of one class run with --jobs 1 and with --jobs 2 (same
submissions, scores compared), and the time to grade one learner with the
bubblewrap sandbox and with no sandbox (MEMLAB_SANDBOX=none), with the grader's
per-probe work (a memory window, a freeze of thread and process creation and a
process count, seen from outside) timed on its own. Then what the integrity checks
cost one learner beside that learner's whole grading (target: under 10%): the
tampering scan of the cells, on exercise 05's reference notebook, and exercise 05's
watched large case: its run, warm and in one thread as the sandbox runs it, and its
judging; with the memory growth its window saw for the reference and for a learner
who computes the whole score matrix in numpy.
With --class-of N: N honest drill learners graded in one class run with --jobs 2: the wall time and the grading
process's own peak memory (its maximum resident set, before and after).
With --ex08-judges N: N copies of exercise 08's solution graded in one class run (--jobs 2), once with every
judge measuring memlab.fit's runs afresh (MEMLAB_FIT_CACHE='') and once with the judges sharing one folder of them
(the default); the sandboxes do the same work both times, so the difference is the judges'.
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
    ap.add_argument("--integrity-only", action="store_true", help="only what the integrity checks cost")
    ap.add_argument("--ex08-judges", type=int, default=0, metavar="N",
                    help="only exercise 08's class run of N learners, without and with the judges' shared folder")
    ap.add_argument("--class-of", type=int, default=0, metavar="N",
                    help="only a class of N drill learners with --jobs 2: wall time and the grader's memory")
    a = ap.parse_args()
    if a.learners < 2:
        raise SystemExit("--learners must be at least 2")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if a.integrity_only:
            return integrity_overhead(tmp, stage_course_code(tmp / "stage"))
        if a.ex08_judges:
            return ex08_judges(tmp, a.ex08_judges)
        if a.class_of:
            return class_of(tmp, a.class_of)
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
        for label, line in (("bubblewrap sandbox", "bubblewrap"), ("no sandbox", "none")):
            box = sandbox.Sandbox(line=line)
            if line == "bubblewrap" and not box.bwrap:
                print(f"  {label}: bwrap cannot run here")
                continue
            times = sorted(grade_notebook(one, ex, stage=stage, sandbox=box).seconds for _ in range(3))
            print(f"  {label:<26} {times[1]:.2f} s")
        print(f"  the grader's own work per probe (window, freeze, count, thaw): {per_probe(tmp) * 1e3:.2f} ms")
        integrity_overhead(tmp, stage)


def per_probe(tmp: Path) -> float:
    """Seconds of the grader's own work around one probe, median of 50, in a sandbox that answers at once."""
    from autograder.trusted import python_binds
    code = ("import os\nreq = os.fdopen(int(os.environ['MEMLAB_REQUEST_FD']), 'rb')\n"
            "rep = int(os.environ['MEMLAB_REPLY_FD'])\nos.write(rep, b'up\\n')\n"
            "for line in req:\n    os.write(rep, b'ok\\n')\n")
    job = tmp / "per-probe"
    job.mkdir(exist_ok=True)
    s = sandbox.Sandbox().start([sys.executable, "-c", code], job, python_binds(), {}, sandbox.Limits())
    ts = []
    try:
        s.receive(30)
        for _ in range(50):
            t0 = time.perf_counter()
            s.processes()
            s.freeze()
            s.window_open()
            s.send({"probe": 1})
            s.receive(30)
            s.window_close()
            s.thaw()
            s.processes()
            ts.append(time.perf_counter() - t0)
    finally:
        s.finish()
    return sorted(ts)[25]


def class_of(tmp: Path, n: int) -> None:
    """n honest drill learners in one class run, --jobs 2: wall time and the grading process's peak memory."""
    import resource
    course = grade.drill_course(tmp / "course")
    subs = tmp / "subs"
    subs.mkdir()
    for i in range(n):
        (subs / f"learner{i:02d}.ipynb").write_text(json.dumps(solved(course)))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    res = grade.grade_class(subs, "99_drill", timeout=120, course=course, jobs=2, log=lambda s: None)
    sec = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    full = sum(sum(p for p, _ in g.values()) == 6 for g in res.graded.values())
    print(f"a class of {n}, --jobs 2, {os.cpu_count()} cores: {sec:.1f} s ({sec / n:.2f} s per learner), "
          f"full marks {full} of {n}; the grading process's peak resident memory {before / 1024:.0f} MiB before, "
          f"{after / 1024:.0f} MiB after")


def integrity_overhead(tmp: Path, stage: Path) -> None:
    """The scan and the watched case against one whole grading of exercise 05's reference solution."""
    import random
    import nbformat
    import torch
    from autograder.checks.common import encode
    from autograder.checks.ex05 import TASKS, cases
    from autograder.trusted import code_to_run, read_notebook, tampering
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from _nb import solution_namespace, submission
    from test_grading_containment import NUMPY_ATTENTION
    name = "05_efficient_attention"
    ex = grade.exercise(name)
    graded = {}
    for label, subs in (("reference", {}), ("numpy", {"task5_2_tiled_attention": NUMPY_ATTENTION})):
        nb = tmp / f"ex05_{label}.ipynb"
        nbformat.write(submission(name, subs), nb)
        graded[label] = grade_notebook(nb, ex, stage=stage)
    whole = graded["reference"]
    cells = code_to_run(ex.template, read_notebook(tmp / "ex05_reference.ipynb"))
    t0 = time.perf_counter()
    for _ in range(100):
        tampering(cells)
    scan = (time.perf_counter() - t0) / 100
    torch.set_num_threads(1)
    task = TASKS["task5_2_tiled_attention"]
    fn = solution_namespace(name, {})["tiled_attention"]
    r = random.Random(0)
    warm, case = cases.attn_cases(True, r)[0], cases.large_case(r)
    task.run(warm, tiled_attention=fn)            # in the sandbox the large case runs after five smaller ones
    runs, judged = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        value = json.loads(encode(task.run(case, tiled_attention=fn)))
        runs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        task.judge(case, value)
        judged.append(time.perf_counter() - t0)
    large = sorted(runs)[1] + sorted(judged)[1]
    growth = {k: max(g.memory_growth.values(), default=None) for k, g in graded.items()}   # the large case's
    print(f"integrity checks, exercise 05's reference ({whole.seconds:.1f} s in its sandbox, flags "
          f"{whole.flags or 'none'}):")
    print(f"  tampering scan of {len(cells)} cells: {scan * 1e3:.2f} ms ({100 * scan / whole.seconds:.3f}%)")
    print(f"  the watched large case of task 5.2 ({case['lead'][0]} x {case['tq']} x {case['tk']}): run "
          f"{sorted(runs)[1]:.3f} s + judge {sorted(judged)[1]:.3f} s = {large:.3f} s "
          f"({100 * large / whole.seconds:.1f}% of the learner's sandbox time)")
    mib = {k: "none (no cgroup)" if v is None else f"{v / 2**20:.1f} MiB" for k, v in growth.items()}
    print(f"  its memory window grew by {mib['reference']} for the reference and {mib['numpy']} for the numpy "
          f"learner (flagged at {cases.LARGE_FLAG_BYTES / 2**20:.0f} MiB: numpy learner flagged "
          f"{bool(graded['numpy'].flags)}, reference flagged {bool(whole.flags)})")


def ex08_judges(tmp: Path, n: int) -> None:
    """Exercise 08's class run of n copies of the solution, judges without and with a shared memlab.fit folder."""
    import nbformat
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from _nb import submission
    name = "08_capstone"
    subs = tmp / "ex08"
    subs.mkdir()
    for i in range(n):
        nbformat.write(submission(name), subs / f"learner{i:02d}.ipynb")
    print(f"exercise 08, {n} copies of the solution, --jobs 2, {os.cpu_count()} cores:")
    for label, env in (("each judge measures afresh (MEMLAB_FIT_CACHE='')", ""),
                       ("the judges share one folder (default)", None)):
        if env is None:
            os.environ.pop("MEMLAB_FIT_CACHE", None)
        else:
            os.environ["MEMLAB_FIT_CACHE"] = env
        (tmp / f"course-{len(label)}").mkdir()
        course = grade.temp_course(tmp / f"course-{len(label)}")
        t0 = time.perf_counter()
        res = grade.grade_class(subs, name, timeout=1800, course=course, jobs=2, log=lambda s: None)
        sec = time.perf_counter() - t0
        full = sum(sum(p for p, _ in g.values()) == sum(t for _, t in g.values()) for g in res.graded.values())
        print(f"  {label:<50} {sec:6.1f} s ({sec / n:.1f} s per learner); full marks: {full} of {n}")


if __name__ == "__main__":
    main()
