"""Every exercise, graded for real by nbgrader: the solution earns full marks, the
untouched release earns nothing, and each plausible-wrong submission loses
exactly the points its spec says (tests/submissions/exNN.py)."""

from __future__ import annotations

import tempfile
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


# one xdist group per exercise: under `pytest -n 2 --dist loadgroup` (.ci/run) the class runs of different
# exercises go to different workers, and each runs once
@pytest.fixture(scope="module", params=[pytest.param(s, marks=pytest.mark.xdist_group(f"wrong-{s.ASSIGNMENT}"))
                                        for s in SPECS], ids=[s.ASSIGNMENT for s in SPECS])
def graded(request):
    """Grade the reference, the untouched release and every wrong submission of
    one exercise in a single nbgrader class run (one process per learner)."""
    spec = request.param
    if not _released(spec):
        pytest.fail(f"exercises/{spec.ASSIGNMENT} is missing: run `memlab-grade release {spec.ASSIGNMENT}`")
    with tempfile.TemporaryDirectory(prefix="memlab-wrong-") as tmp:
        tmp = Path(tmp)
        subs = tmp / "submissions"
        subs.mkdir()
        nbformat.write(submission(spec.ASSIGNMENT), subs / "reference.ipynb")
        nbformat.write(submission(spec.ASSIGNMENT, solve=False), subs / "untouched.ipynb")
        learner, excused = {}, {}        # spec name -> the learner whose notebook carries it, cells not judged
        for i, group in enumerate([*pack(spec.WRONG).values(), *pack(getattr(spec, "RIGHT", {})).values()]):
            nbformat.write(submission(spec.ASSIGNMENT, group["replace"]), subs / f"learner{i:02d}.ipynb")
            learner.update({name: f"learner{i:02d}" for name in group["specs"]})
            excused.update(group["lost"])
        course_dir = tmp / "course"
        course_dir.mkdir()
        res = grade.grade_class(subs, spec.ASSIGNMENT, timeout=1800, course=grade.temp_course(course_dir),
                               jobs=2, log=lambda line: None)
        res.learner, res.excused = learner, excused
        yield spec, res


def test_reference_solution_scores_full_marks(graded):
    spec, res = graded
    assert "reference" in res.graded, f"the reference solution was not graded: {res.failed.get('reference')}"
    got = res.graded["reference"]
    want = graded_cells(spec.ASSIGNMENT)
    lost = {g: got.get(g) for g, pts in want.items() if got.get(g, (0, 0))[0] != pts}
    assert not lost, f"{spec.ASSIGNMENT}: the solution lost points on {lost}"


def test_untouched_exercise_scores_zero(graded):
    spec, res = graded
    got = res.graded.get("untouched")
    assert got is not None, f"the untouched release was not graded: {res.failed.get('untouched')}"
    earned = {g: s for g, (s, _) in got.items() if s}
    assert not earned, f"{spec.ASSIGNMENT}: an untouched exercise earned points on {earned}"


def test_wrong_submissions_lose_their_points(graded):
    spec, res = graded
    want = graded_cells(spec.ASSIGNMENT)
    problems = []
    for name, w in spec.WRONG.items():
        who = res.learner[name]
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
        for gid in w.get("must_keep", []):
            if gid in res.excused[name]:
                continue
            if got.get(gid, (None,))[0] != want[gid]:
                problems.append(f"{name} ({who}): {gid} should keep {want[gid]} points, scored {got.get(gid)} "
                                f"({res.reasons.get(who, {}).get(gid) or res.notes.get(who)})")
    assert not problems, f"{spec.ASSIGNMENT}:\n" + "\n".join(problems)


def test_correct_alternatives_score_full_marks(graded):
    spec, res = graded
    want = graded_cells(spec.ASSIGNMENT)
    problems = {name: {g: res.graded.get(res.learner[name], {}).get(g) for g, pts in want.items()
                       if res.graded.get(res.learner[name], {}).get(g, (0, 0))[0] != pts}
                for name in getattr(spec, "RIGHT", {})}   # correct alternatives: every point kept
    problems = {k: v for k, v in problems.items() if v}
    assert not problems, f"{spec.ASSIGNMENT}: correct alternatives lost points: {problems}"


def test_specs_name_real_cells():
    for spec in SPECS:
        cells = graded_cells(spec.ASSIGNMENT)
        for name, w in spec.WRONG.items():
            assert w["must_lose"], f"{spec.ASSIGNMENT}/{name}: a wrong submission must lose something"
            for gid in w["must_lose"] + w.get("must_keep", []):
                assert gid in cells, f"{spec.ASSIGNMENT}/{name}: {gid} is not a graded cell ({sorted(cells)})"
