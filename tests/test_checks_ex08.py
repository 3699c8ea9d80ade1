"""Exercise 08's own check tests (tests/test_checks.py runs every exercise's solution and wrong submissions):
plain-data validation, the cost order, the tiny same-maths half failing the wrong train steps of
tests/submissions/ex08.py in every hidden draw, the hidden cases covering every option in every draw, and
memlab.fit kept out of the learner's calls."""

from __future__ import annotations

import random
import sys

import pytest

import memlab
from _nb import solution_namespace
from autograder.checks.common import decode, encode
from autograder.checks.ex08 import cases as ex08_cases, judge as ex08_judge, run as ex08_run
from autograder.checks.ex08.refs import cost, dominating
from memlab.kit.ex08 import MODELS, check_problem, make_step, plan_error
from submissions import ex08 as wrong

PROBLEM = ex08_cases.VISIBLE_PROBLEM


def _namespace(replace: dict[str, str] | None = None) -> dict:
    return solution_namespace("08_capstone", replace)


def _tiny_cases(hidden, seed=0):
    return [c for c in ex08_cases.train_step_cases(hidden, random.Random(seed)) if c["part"] == "tiny"]


def _judge_tiny(ns, case):
    got = decode(encode(ex08_run.train_step_run(case, ns["train_step"])))
    ex08_judge.train_step_judge(case, got)


def test_plan_validation_names_the_field():
    plan = {"micro_batch": 2, "checkpoint": 1, "optimizer": "fused"}
    assert plan_error(plan, PROBLEM) is None
    assert "micro_batch" in plan_error({**plan, "micro_batch": 0}, PROBLEM)
    assert "micro_batch" in plan_error({**plan, "micro_batch": PROBLEM["batch"] + 1}, PROBLEM)
    assert "checkpoint" in plan_error({**plan, "checkpoint": MODELS[PROBLEM["model"]]["full"].n_layer + 1}, PROBLEM)
    assert "checkpoint" in plan_error({**plan, "checkpoint": True}, PROBLEM)
    assert "optimizer" in plan_error({**plan, "optimizer": "sgd"}, PROBLEM)
    assert "keys" in plan_error({**plan, "lr": 1.0}, PROBLEM)
    assert "dict" in plan_error([2, 1, "fused"], PROBLEM)
    with pytest.raises(ValueError, match="model"):
        check_problem({**PROBLEM, "model": "gpt-7b"})
    with pytest.raises(ValueError, match="batch"):
        check_problem({**PROBLEM, "batch": 0})
    with pytest.raises(ValueError, match="micro_batch"):
        make_step(PROBLEM, {**plan, "micro_batch": 0}, lambda *a: None)


def test_cost_counts_micro_batches_rounding_up_and_domination_is_strict():
    p = {**PROBLEM, "batch": 7}
    assert cost(p, {"micro_batch": 3, "checkpoint": 2, "optimizer": "fused"}) == (2, 3)
    front = {0: (3, 3), 1: (1, 7)}
    assert dominating(p, (1, 3), front) == [(0, 3), (1, 1)]
    assert dominating(p, (0, 3), front) == []            # on the front: nothing cheaper
    assert dominating(p, (1, 1), front) == []
    assert dominating(p, (2, 1), front) == [(1, 1)]      # checkpointing more than needed


@pytest.mark.slow
@pytest.mark.parametrize("name", ["micro_batches_without_dividing_the_loss",
                                  "dividing_by_the_count_of_uneven_micro_batches", "frozen_embedding"])
def test_wrong_train_steps_fail_visible_and_every_hidden_draw(name):
    ns = _namespace(wrong.WRONG[name]["replace"])
    for hidden, seeds in ((False, [0]), (True, range(4))):
        for seed in seeds:
            with pytest.raises(AssertionError):
                for case in _tiny_cases(hidden, seed):
                    _judge_tiny(ns, case)


def test_hidden_train_step_cases_cover_every_option():
    for seed in range(20):
        cases = ex08_cases.train_step_cases(True, random.Random(seed))
        tiny = [c for c in cases if c["part"] == "tiny"]
        assert any(c["part"] == "full" for c in cases)
        plans = [(c["problem"], c["plan"]) for c in tiny]
        L = lambda p: MODELS[p["model"]]["full"].n_layer  # noqa: E731
        assert {pl["optimizer"] for _, pl in plans} == {"foreach", "fused"}
        assert any(pl["micro_batch"] == 1 for _, pl in plans)
        assert any(pl["micro_batch"] == p["batch"] for p, pl in plans)
        assert any(p["batch"] % pl["micro_batch"] for p, pl in plans)                          # uneven
        assert any(pl["micro_batch"] > 1 and p["batch"] % pl["micro_batch"] == 0 and pl["micro_batch"] < p["batch"]
                   or p["batch"] in (3, 5, 7) for p, pl in plans)                                # even (or prime)
        assert any(pl["checkpoint"] == 0 for _, pl in plans)
        assert any(pl["checkpoint"] == L(p) for p, pl in plans)
        assert any(0 < pl["checkpoint"] < L(p) for p, pl in plans)
        assert {MODELS[p["model"]]["full"].pos for p, _ in plans} == {"learned", "rope"}


def test_fit_tools_raise_inside_the_learner_call_and_come_back():
    # memlab.fit and memlab.fit_search are functions, defined in memlab.fitting.plan and memlab.fitting.search
    fit_module, search_module = sys.modules["memlab.fitting.plan"], sys.modules["memlab.fitting.search"]
    before = (memlab.fit, memlab.fit_search, fit_module.fit, search_module.fit_search)
    with ex08_run._no_fit_tool():
        for f in (memlab.fit, memlab.fit_search, fit_module.fit, search_module.fit_search):
            with pytest.raises(RuntimeError, match="off limits"):
                f("llama-2-7b")
    assert (memlab.fit, memlab.fit_search, fit_module.fit, search_module.fit_search) == before


# ----------------------------------------------------------------------------- results validated, headroom drawn
def test_empty_short_or_missing_results_fail_never_pass_vacuously():
    case = _tiny_cases(True, 3)[0]
    good = decode(encode(ex08_run.train_step_run(case, _namespace()["train_step"])))
    ex08_judge.train_step_judge(case, good)
    forged = [{"calls": [], "steps": [], "final": []},
              {**good, "calls": good["calls"][:1], "steps": good["steps"][:1]},
              {**good, "steps": []},
              {**good, "final": good["final"][:-1]},
              {**good, "final": [v[:1] for v in good["final"]]},
              {**good, "steps": [{**s, "proj": []} for s in good["steps"]]},
              {k: v for k, v in good.items() if k != "final"},
              {**good, "calls": [{**c, "blocks": "many"} for c in good["calls"]]}]
    for got in forged:
        with pytest.raises(AssertionError):
            ex08_judge.train_step_judge(case, got)
    plan_case = {"problem": PROBLEM}
    with pytest.raises(AssertionError):
        ex08_judge.fit_judge(plan_case, {"plan": {"micro_batch": 2, "checkpoint": 1, "optimizer": "fused"},
                                         "full": {"fits": True, "peak": 0, "steady": 0, "steps": 1, "state": [],
                                                  "wte": 2, "blocks": 8}, "tiny": {"calls": [], "steps": [],
                                                                                    "final": []}})


def test_hidden_plan_problems_draw_a_tight_and_a_loose_headroom():
    for seed in range(50):
        cases = ex08_cases.plan_cases(True, random.Random(seed))
        hs = sorted(c["problem"]["headroom"] for c in cases)
        assert len(cases) == 2 and {c["problem"]["batch"] for c in cases} == {p["batch"] for p in
                                                                              ex08_cases.HIDDEN_PROBLEMS}
        assert ex08_cases.LOOSE[0] <= hs[0] <= ex08_cases.LOOSE[1] and hs[1] >= min(t for t, _ in ex08_cases.TIGHT)


@pytest.mark.slow
def test_headroom_ranges_hold_against_the_grader_references():
    """TIGHT: the plans that fit with 5% (both cheapest orders) no longer fit, and some plan does. LOOSE: the plain
    recipe does not fit at full capacity minus the headroom, and one sequence per micro-batch and every block
    checkpointed are dominated."""
    from autograder.checks.ex08.refs import reference_front, reference_peak
    for i, p in enumerate(ex08_cases.HIDDEN_PROBLEMS):
        B, L = p["batch"], MODELS[p["model"]]["full"].n_layer
        at5 = reference_front({**p, "headroom": 0.05})
        cheapest_at5 = [min(at5.items(), key=lambda kv: (kv[1][0], kv[0])), min(at5.items())]  # n first, k first
        for h in ex08_cases.TIGHT[i]:
            q = {**p, "headroom": h}
            assert reference_front(q)
            for k, (n, m) in cheapest_at5:
                assert reference_peak(q, {"micro_batch": m, "checkpoint": k, "optimizer": "fused"}) > \
                    ex08_judge.usable(q), (q, k, m)
        for h in ex08_cases.LOOSE:
            q = {**p, "headroom": h}
            front = reference_front(q)
            assert reference_peak(q, {"micro_batch": B, "checkpoint": 0, "optimizer": "fused"}) > ex08_judge.usable(q)
            assert dominating(q, (0, B), front) and dominating(q, (L, 1), front), (q, front)
