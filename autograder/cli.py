"""memlab-grade: the grading commands on the command line (`python -m autograder ...` is the same).

    memlab-grade release [ASSIGNMENT ...]            regenerate exercises/ from solutions/ (instructors, CI)
    memlab-grade check NOTEBOOK [-a ASSIGNMENT]       grade one notebook as the class run would (learners)
    memlab-grade class SUBMISSIONS -a ASSIGNMENT      grade a folder of submissions into nbgrader's gradebook,
                      [--jobs N] [--timeout S]        write feedback and grades.csv (instructors)
    memlab-grade public DEST                          the learner-facing copy of the course (no solutions)
    memlab-grade gradescope -a ASSIGNMENT OUT         a Gradescope autograder zip running the same checks
                                                      and sandbox (large classes; autograder/gradescope.py)

The commands themselves are in grade.py and gradescope.py; this file only reads the command line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from . import gradescope
from .grade import assignments, cmd_check, cmd_class, cmd_public, cmd_release


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="memlab-grade", description="Grading commands for GPU Memory Lab.")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("release", help="regenerate exercises/ from solutions/")
    r.add_argument("assignments", nargs="*", help="default: all")
    c = sub.add_parser("check", help="grade one notebook and print a per-task score table with reasons")
    c.add_argument("notebook")
    c.add_argument("-a", "--assignment", help="the assignment, when the file was renamed")
    c.add_argument("--timeout", type=float, default=1800, help="seconds for the whole notebook (default 1800)")
    k = sub.add_parser("class", help="grade a folder of submissions (instructors)")
    k.add_argument("submissions")
    k.add_argument("-a", "--assignment", required=True, help=f"one of {assignments()}")
    k.add_argument("--timeout", type=float, default=1800, help="seconds per learner (default 1800)")
    k.add_argument("--jobs", type=int, default=1, help="learners graded at once (default 1)")
    k.add_argument("--memory-gb", type=float, default=6, help="memory per learner in GiB (default 6)")
    u = sub.add_parser("public", help="write the learner-facing copy of the course (no solutions) to DEST")
    u.add_argument("dest")
    g = sub.add_parser("gradescope", help="write OUT/ASSIGNMENT-gradescope.zip: a Gradescope autograder running "
                                          "the same checks and sandbox (large classes)")
    g.add_argument("out")
    g.add_argument("-a", "--assignment", required=True, help=f"one of {assignments()}")
    a = p.parse_args(argv)
    if a.cmd == "release":
        cmd_release(a.assignments)
    elif a.cmd == "check":
        cmd_check(a.notebook, a.assignment, a.timeout)
    elif a.cmd == "class":
        cmd_class(a.submissions, a.assignment, a.timeout, a.jobs, a.memory_gb)
    elif a.cmd == "gradescope":
        gradescope.build(a.assignment, Path(a.out))
    else:
        cmd_public(a.dest)
