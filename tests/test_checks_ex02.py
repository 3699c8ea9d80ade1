"""Exercise 02's checks in-process (run + judge, no sandbox): the reference solution
passes every check, every plausible-wrong submission of tests/submissions/ex02.py
fails the cells it must lose with a teaching message and keeps the ones it must keep,
every correct alternative keeps full marks, and the checks' references agree with
brute force."""

from __future__ import annotations

import random

import nbformat
import pytest
import torch

from _nb import ROOT, grade_id, is_solution, solved_code
from autograder.checks import ex02, ex02_refs
from autograder.checks.common import check
from submissions import ex02 as wrong

NB = nbformat.read(ROOT / "solutions" / wrong.ASSIGNMENT / f"{wrong.ASSIGNMENT}.ipynb", as_version=4)
REFERENCE = {grade_id(c): solved_code(c.source) for c in NB.cells if is_solution(c)}
# the locked code cells a learner's solution may rely on (imports, the cost model), minus the device report and
# the notebook's thread setting (a test must not change the process it runs in)
GIVEN = [c.source.replace("print(memlab.describe(device))", "").replace("torch.set_num_threads(1)", "")
         for c in NB.cells if grade_id(c) in ("setup", "task2_3_model")]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is as fast, and far steadier when other jobs share the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _names(task: str, replace: dict[str, str]) -> dict:
    ns: dict = {}
    for src in GIVEN:
        exec(compile(src, "<given>", "exec"), ns)
    exec(compile(replace.get(task, REFERENCE[task]), f"<{task}>", "exec"), ns)
    return {n: ns[n] for n in ex02.TASKS[task].names}


def test_solution_has_one_cell_per_task():
    assert set(REFERENCE) == set(ex02.TASKS)


@pytest.mark.parametrize("task", sorted(ex02.TASKS))
@pytest.mark.parametrize("hidden", [False, True])
def test_reference_passes(task, hidden):
    assert check(ex02.TASKS[task], hidden=hidden, **_names(task, {})) >= 1


CELLS = [(name, gid, spec) for specs in (wrong.WRONG, wrong.RIGHT) for name, spec in specs.items()
         for gid in spec["must_lose"] + spec.get("must_keep", [])]


@pytest.mark.parametrize("name,gid,spec", CELLS, ids=[f"{n}-{g}" for n, g, _ in CELLS])
def test_submission_cell(name, gid, spec):
    task, kind = gid.rsplit("_", 1)
    names = _names(task, spec["replace"])
    if gid in spec.get("must_keep", []):
        check(ex02.TASKS[task], hidden=kind == "hidden", **names)
        return
    with pytest.raises(AssertionError) as info:
        check(ex02.TASKS[task], hidden=kind == "hidden", **names)
    assert len(str(info.value)) > 40, f"{name}: the failure message should teach, got {info.value!r}"


def test_state_search_matches_brute_force():
    r = random.Random(0)
    for _ in range(300):
        n = r.randint(0, 8)
        m = [r.randint(1, 40) for _ in range(n)]
        c = [r.randint(0, 9) for _ in range(n)]
        budget = r.randint(0, sum(m) + 3)
        assert ex02_refs.search_min_cost(m, c, budget) == ex02_refs.brute_force_plan(m, c, budget)[0]


def test_round_robin_segments():
    for n in range(1, 60):
        s = next(s for s in range(1, n + 1) if s * s >= n)
        segs = ex02_refs.round_robin_segments(n, s)
        sizes = [b - a for a, b in segs]
        assert len(segs) == s and segs[0][0] == 0 and segs[-1][1] == n and max(sizes) - min(sizes) <= 1
    assert ex02_refs.round_robin_segments(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_hidden_cases_cover_every_branch():
    from autograder.checks.common import rng
    for _ in range(3):
        k_cases = ex02.TASKS["task2_1_checkpoint_every_k"].cases(True, rng(True))
        stacks = [c for c in k_cases if "k" in c]
        assert {c["container"] for c in stacks} == {"Sequential", "ModuleList", "list"}
        assert any(not c["x_grad"] for c in stacks) and any(c["k"] == 1 for c in stacks)
        assert any(c["n"] % c["k"] and c["k"] < c["n"] for c in stacks) and any(c["k"] >= c["n"] for c in stacks)
        plan = ex02.TASKS["task2_3_plan_checkpoints"].cases(True, rng(True))
        assert any(len(c["m"]) == 1 for c in plan) and any(c["timed"] for c in plan)
        assert any(c["budget"] == ex02_refs.min_peak(c["m"]) for c in plan if len(c["m"]) <= 10)
        gpt = ex02.TASKS["task2_4_checkpointed_gpt"].cases(True, rng(True))
        assert {c["cfg"]["pos"] for c in gpt} == {"learned", "rope"} and {c["cfg"]["attn"] for c in gpt} == {"sdpa", "math"}
        assert any(c["cfg"]["dropout"] > 0 for c in gpt)
