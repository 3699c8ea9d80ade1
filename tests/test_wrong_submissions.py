"""Every exercise, graded for real by nbgrader in a class run (sandbox, one process per learner, trusted judge):
the solution earns full marks, the untouched release earns nothing, and a notebook packing plausible-wrong
submissions of tests/submissions/exNN.py scores what their specs say.

Every spec, wrong or right, is judged cell by cell in every run by tests/test_checks.py, with the same check
code in-process; a class run costs a sandbox and a full notebook per learner, so here each exercise grades three
learners: the reference, the untouched release, and one notebook packing as many wrong specs as can share it.
The correct alternatives are judged in-process by tests/test_checks.py, like every wrong spec.

Each exercise is one test: a class run is costly, and a test function is the one unit pytest-xdist never splits
across workers (grouping marks are not honoured by every pytest-xdist and pytest pair)."""

from __future__ import annotations

import re

from pathlib import Path

import nbformat
import pytest

from _nb import ROOT, submission, graded_cells, wrong_submission_specs
from autograder import grade

SPECS = wrong_submission_specs()
pytestmark = pytest.mark.slow


def pack(specs: dict) -> dict[str, dict]:
    """Put wrong submissions that edit different solution cells and lose different test cells into one
    learner's notebook: every learner graded costs a sandbox and a full run of the notebook, and CI time
    is finite. Each spec is still judged on its own cells: it must lose its `must_lose` cells, and keep
    its `must_keep` cells except those another spec in the same notebook must lose. A spec marked
    `"alone": True` (its task calls another task's function) gets a notebook of its own.
    Returns {learner name: {"replace": {...}, "specs": [spec names], "lost": {spec: cells the others lose}}}."""
    groups: list[dict] = []
    for name, w in specs.items():
        lose = set(w.get("must_lose", []))
        for g in groups:
            if not (g["replace"].keys() & w["replace"].keys() or lose & g["lose"] or w.get("alone")
                    or g["alone"]):
                g["replace"].update(w["replace"])
                g["lose"] |= lose
                g["specs"].append(name)
                break
        else:
            groups.append({"replace": dict(w["replace"]), "lose": set(lose), "specs": [name],
                           "alone": bool(w.get("alone"))})
    return {"+".join(g["specs"]): {"replace": g["replace"], "specs": g["specs"],
                                  "lost": {n: g["lose"] - set(specs[n].get("must_lose", [])) for n in g["specs"]}}
            for g in groups}


def _released(spec) -> bool:
    return (ROOT / "exercises" / spec.ASSIGNMENT / f"{spec.ASSIGNMENT}.ipynb").exists()


def sample(spec) -> list[dict]:
    """The packed learner a class run grades beside the reference and the untouched release: the first packed
    wrong notebook (the one holding the most wrong specs)."""
    return list(pack(spec.WRONG).values())[:1]


def class_run(spec, tmp: Path):
    subs = tmp / "submissions"
    subs.mkdir()
    nbformat.write(submission(spec.ASSIGNMENT), subs / "reference.ipynb")
    nbformat.write(submission(spec.ASSIGNMENT, solve=False), subs / "untouched.ipynb")
    learner, excused = {}, {}        # spec name -> the learner whose notebook carries it, cells not judged
    for i, group in enumerate(sample(spec)):
        nbformat.write(submission(spec.ASSIGNMENT, group["replace"]), subs / f"learner{i:02d}.ipynb")
        learner.update({name: f"learner{i:02d}" for name in group["specs"]})
        excused.update(group["lost"])
    course_dir = tmp / "course"
    course_dir.mkdir()
    res = grade.grade_class(subs, spec.ASSIGNMENT, timeout=1800, course=grade.temp_course(course_dir),
                           jobs=2, log=lambda line: None)
    return res, learner, excused


def reference_problems(spec, res) -> list[str]:
    if "reference" not in res.graded:
        return [f"the reference solution was not graded: {res.failed.get('reference')}"]
    got = res.graded["reference"]
    return [f"the solution lost points on {g}: {got.get(g)} ({res.reasons.get('reference', {}).get(g)})"
            for g, pts in graded_cells(spec.ASSIGNMENT).items() if got.get(g, (0, 0))[0] != pts]


def untouched_problems(spec, res) -> list[str]:
    got = res.graded.get("untouched")
    if got is None:
        return [f"the untouched release was not graded: {res.failed.get('untouched')}"]
    return [f"an untouched exercise earned {s} points on {g}" for g, (s, _) in got.items() if s]


def leaks(reason: str) -> bool:
    """Whether a hidden cell's feedback states a value (a standalone number, with or without its unit: digits inside
    a name such as float64 or task0_1 are no value): the learner's own result on a hidden case tells of the case as
    much as the reference's does. The line of the learner's own cell that raised an error is no hidden value."""
    from autograder.trusted import _NUMBER
    return bool(_NUMBER.search(re.sub(r"\(line \d+ of the cell\)", "", reason)))


def wrong_problems(spec, res, learner, excused) -> list[str]:
    want = graded_cells(spec.ASSIGNMENT)
    problems = []
    for name, w in spec.WRONG.items():
        if name not in learner:
            continue
        who = learner[name]
        got = res.graded.get(who)
        if got is None:
            problems.append(f"{name}: not graded ({res.failed.get(who)})")
            continue
        for gid in w["must_lose"]:
            if got.get(gid, (None,))[0] != 0:
                problems.append(f"{name}: {gid} should score 0, scored {got.get(gid)}")
            elif len(res.reasons.get(who, {}).get(gid) or "") < 40:
                problems.append(f"{name}: {gid} lost its points without a message that teaches: "
                                f"{res.reasons.get(who, {}).get(gid)!r}")
            elif gid.endswith("_hidden") and leaks(res.reasons[who][gid]):
                problems.append(f"{name}: {gid}'s hidden feedback states a value: {res.reasons[who][gid]!r}")
        for gid in w.get("must_keep", []):
            if gid not in excused[name] and got.get(gid, (None,))[0] != want[gid]:
                problems.append(f"{name} ({who}): {gid} should keep {want[gid]} points, scored {got.get(gid)} "
                                f"({res.reasons.get(who, {}).get(gid) or res.notes.get(who)})")
    return problems


@pytest.mark.parametrize("spec", SPECS, ids=[s.ASSIGNMENT for s in SPECS])
def test_class_run_scores_every_learner_as_specified(spec, tmp_path):
    if not _released(spec):
        pytest.fail(f"exercises/{spec.ASSIGNMENT} is missing: run `memlab-grade release {spec.ASSIGNMENT}`")
    res, learner, excused = class_run(spec, tmp_path)
    problems = (reference_problems(spec, res) + untouched_problems(spec, res)
                + wrong_problems(spec, res, learner, excused))
    assert learner, f"{spec.ASSIGNMENT}: the class run graded no wrong submission"
    assert not res.flags.get("reference"), f"{spec.ASSIGNMENT}: the reference solution was flagged: {res.flags}"
    assert not problems, f"{spec.ASSIGNMENT}:\n" + "\n".join(problems)


def test_specs_name_real_cells():
    for spec in SPECS:
        cells = graded_cells(spec.ASSIGNMENT)
        for name, w in spec.WRONG.items():
            assert w["must_lose"], f"{spec.ASSIGNMENT}/{name}: a wrong submission must lose something"
            for gid in w["must_lose"] + w.get("must_keep", []):
                assert gid in cells, f"{spec.ASSIGNMENT}/{name}: {gid} is not a graded cell ({sorted(cells)})"
