"""Write trusted scores into nbgrader's gradebook, feedback and grades.csv.

Only the grader calls these, after a learner's sandbox has ended. The gradebook is
nbgrader's own SQLite database, so Formgrader, manual grading, `release_feedback`
and nbgrader's exports keep working on it. The autograded notebook written for
Formgrader and feedback is the release notebook with the learner's solution cells
and, under each test cell, the grader's verdict: hidden test code is never shown.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import re
import sys
from pathlib import Path

from .trusted import TEST_CELL, Exercise, Graded, cell_source, nbgrader_meta

# nbgrader's Gradebook runs `alembic` by name: this interpreter's scripts folder must come first on PATH
_BIN = str(Path(sys.executable).parent)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = os.pathsep.join([_BIN, os.environ.get("PATH", "")])

HIDDEN = "# Hidden tests: new inputs are drawn on every run, and the grader checks your code against its own reference."


def ensure_assignment(db_url: str, exercise: Exercise) -> None:
    """Create or update the assignment, its notebook and its cells from the release notebook."""
    import nbformat
    from nbgrader.api import Gradebook
    from nbgrader.preprocessors import SaveCells
    with Gradebook(db_url) as gb:
        gb.update_or_create_assignment(exercise.name)
    nb = nbformat.reads(json.dumps(exercise.template), as_version=4)
    res = {"nbgrader": {"db_url": db_url, "assignment": exercise.name, "notebook": exercise.release.stem}}
    SaveCells().preprocess(nb, res)


def autograded_notebook(exercise: Exercise, learner: dict, graded: Graded) -> dict:
    """The release notebook with the learner's solutions and the grader's verdict under each test cell."""
    sols = {}
    for c in learner["cells"]:
        gid = nbgrader_meta(c).get("grade_id")
        if nbgrader_meta(c).get("solution") and gid not in sols:
            sols[gid] = cell_source(c)
    nb = copy.deepcopy(exercise.template)
    for c in nb["cells"]:
        m = nbgrader_meta(c)
        gid = m.get("grade_id")
        if c.get("cell_type") != "code":
            continue
        c["execution_count"] = None
        c["outputs"] = []
        if m.get("solution"):
            c["source"] = sols.get(gid, "")
        elif m.get("grade") and gid in graded.scores:
            score, pts = graded.scores[gid]
            if TEST_CELL.match(gid) and TEST_CELL.match(gid)["kind"] == "hidden":
                c["source"] = HIDDEN
            if gid in graded.reasons:
                c["outputs"] = [{"output_type": "error", "ename": "AssertionError",
                                 "evalue": graded.reasons[gid],
                                 "traceback": [f"AssertionError: {graded.reasons[gid]}"]}]
            else:
                c["outputs"] = [{"output_type": "stream", "name": "stdout", "text": f"passed: {score:g} / {pts:g}\n"}]
    if graded.note or graded.cell_errors:
        lines = ([graded.note] if graded.note else []) + [f"error in {e}" for e in graded.cell_errors]
        nb["cells"].append({"cell_type": "markdown", "metadata": {}, "id": "grader-notes",
                            "source": "**Grader's notes**\n\n" + "\n".join(f"- `{_md(x)}`" for x in lines)})
    return nb


def name_test_cells(feedback: Path) -> None:
    """nbgrader's feedback pages list each graded cell as "Test cell": name it by its grade id (the task's id and
    visible or hidden) instead, in every page under `feedback`."""
    for page in feedback.rglob("*.html"):
        html = page.read_text(encoding="utf-8")
        named = re.sub(r'<a href="#([\w.-]+)">Test cell</a>', r'<a href="#\1">\1</a>', html)
        if named != html:
            page.write_text(named, encoding="utf-8")


def _md(text: str) -> str:
    return re.sub(r"[`\r\n]+", " ", text)[:500]


def record(course, exercise: Exercise, student: str, learner: dict, graded: Graded) -> None:
    """The learner's submitted copy, its scores and its autograded notebook, written by the grader."""
    import warnings
    from nbgrader.api import Gradebook, MissingEntry
    warnings.filterwarnings("ignore", message=".*not in session.*")   # nbgrader's own add_submission, harmless
    nb_name = exercise.release.name
    for folder, nb in (("submitted", learner), ("autograded", autograded_notebook(exercise, learner, graded))):
        dest = course.root / "autograder" / folder / student / exercise.name
        dest.mkdir(parents=True, exist_ok=True)
        (dest / nb_name).write_text(json.dumps(nb, indent=1), encoding="utf-8")
    with Gradebook(course.db_url) as gb:
        gb.update_or_create_student(student)
        try:
            gb.remove_submission(exercise.name, student)
        except MissingEntry:
            pass
        sub = gb.add_submission(exercise.name, student)
        for nb in sub.notebooks:
            for g in nb.grades:
                if g.name in graded.scores:
                    g.auto_score = graded.scores[g.name][0]
                    g.needs_manual_grade = False     # scored here, as nbgrader's SaveAutoGrades marks autograded cells
        gb.db.commit()


def scores(course, assignment: str, student: str) -> dict[str, tuple[float, float]]:
    """{grade_id: (score, max_score)} of one graded submission, read back from the gradebook."""
    from nbgrader.api import Gradebook, MissingEntry
    with Gradebook(course.db_url) as gb:
        try:
            sub = gb.find_submission(assignment, student)
        except MissingEntry:
            return {}
        return {g.name: (float(g.score), float(g.max_score)) for nb in sub.notebooks for g in nb.grades}


def _flags_path(course) -> Path:
    return course.db.with_name(course.db.stem + "-flags.json")


def record_flags(course, assignment: str, student: str, flags: list[str]) -> None:
    """Keep a learner's tampering flags beside the gradebook (gradebook-flags.json next to gradebook.db, ignored by
    git and never copied into the learners' copy), for grades.csv."""
    path = _flags_path(course)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        data = {}
    data.setdefault(assignment, {})[student] = list(flags)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")


def export_csv(course, path: Path) -> int:
    """grades.csv: one row per learner and assignment graded, a column per task, the score, and `flags` (the
    tampering patterns found in the learner's cells, '; '-separated; empty for most). Returns the row count."""
    from nbgrader.api import Gradebook
    try:
        flags = json.loads(_flags_path(course).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        flags = {}
    rows, task_cols = [], set()
    with Gradebook(course.db_url) as gb:
        for a in gb.assignments:
            for sub in a.submissions:
                row = {"student": sub.student.id, "assignment": a.name}
                for nb in sub.notebooks:
                    for g in nb.grades:
                        m = TEST_CELL.match(g.name)
                        col = m["task"] if m else g.name
                        row[col] = row.get(col, 0.0) + float(g.score)
                        task_cols.add(col)
                row["score"] = float(sub.score)
                row["max_score"] = float(sub.max_score)
                row["flags"] = "; ".join(flags.get(a.name, {}).get(sub.student.id, []))
                rows.append(row)
    cols = ["student", "assignment", *sorted(task_cols), "score", "max_score", "flags"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="")
        w.writeheader()
        for r in sorted(rows, key=lambda r: (r["assignment"], r["student"])):
            w.writerow({k: (f"{v:g}" if isinstance(v, float) else v) for k, v in r.items()})
    return len(rows)
