"""Exercise 08's own check tests (tests/test_checks.py runs every exercise's solution and wrong submissions):
plan validation, the stated order, the hidden cases covering every rung in every draw, the wrong train steps
failing every hidden draw, results validated before judging, memlab.fit kept out of the learner's calls, and the
hidden problem family's guarantees proved with memlab.fit at the corners of its ranges."""

from __future__ import annotations

import random
import sys

import pytest

import memlab
from _nb import solution_namespace
from autograder.checks.common import decode, encode
from autograder.checks.ex08 import cases as ex08_cases, judge as ex08_judge, refs as ex08_refs, run as ex08_run
from memlab.kit.ex08 import MODELS, check_problem, fit_options, plan_error, usable
from submissions import ex08 as wrong

PROBLEM = ex08_cases.VISIBLE_PROBLEM
PLAN = {"method": "lora", "lora_r": 16, "precision": "bf16", "optimizer": "adamw", "checkpointing": True,
        "micro_batch": 2, "offload": False}


def _namespace(replace: dict[str, str] | None = None) -> dict:
    return solution_namespace("08_capstone", replace)


def _judge_tiny(ns, case):
    got = decode(encode(ex08_run.train_step_run(case, ns["train_step"])))
    ex08_judge.train_step_judge(case, got)


# ----------------------------------------------------------------------------- plans, problems, the order
def test_plan_validation_names_the_field():
    assert plan_error(PLAN, PROBLEM) is None
    for key, bad in (("method", "dora"), ("precision", "fp16"), ("optimizer", "sgd"), ("lora_r", 0),
                     ("checkpointing", "full"), ("micro_batch", 0), ("micro_batch", PROBLEM["batch"] + 1),
                     ("offload", 1)):
        assert key in plan_error({**PLAN, key: bad}, PROBLEM), (key, bad)
    assert "keys" in plan_error({**PLAN, "lr": 1.0}, PROBLEM)
    assert "dict" in plan_error([PLAN], PROBLEM)
    assert plan_error({**PLAN, "micro_batch": 3}, PROBLEM) is None                      # uneven: train_step's
    assert "divide" in plan_error({**PLAN, "micro_batch": 3}, PROBLEM, dividing=True)   # not memlab.fit's
    assert "optimizer" in plan_error({**PLAN, "optimizer": "adamw8bit"}, PROBLEM)       # LoRA keeps AdamW
    full = {**PLAN, "method": "full"}
    assert "offload" in plan_error({**full, "offload": True}, PROBLEM)                  # no host RAM
    assert plan_error({**full, "offload": True}, {**PROBLEM, "offload_ok": True}) is None
    assert "offload" in plan_error({**full, "offload": True, "optimizer": "adamw8bit"}, {**PROBLEM,
                                                                                         "offload_ok": True})
    with pytest.raises(ValueError, match="model"):
        check_problem({**PROBLEM, "model": "gpt-7b"})
    with pytest.raises(ValueError, match="batch"):
        check_problem({**PROBLEM, "batch": 0})
    with pytest.raises(ValueError, match="divide"):
        fit_options(PROBLEM, {**PLAN, "micro_batch": 3})
    assert fit_options(PROBLEM, {**full, "micro_batch": 4})["micro_batch"] is None


def test_the_grid_is_in_the_stated_order():
    p = {**PROBLEM, "batch": 8, "offload_ok": True}
    g = ex08_refs.grid(p)
    keys = [ex08_refs.order_key(p, q) for q in g]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert g[0]["method"] == "full" and g[0]["precision"] == "fp32" and not g[0]["checkpointing"]
    assert g[0]["micro_batch"] == 8 and g[-1]["method"] == "qlora" and g[-1]["micro_batch"] == 1
    assert all(q["micro_batch"] in (1, 2, 4, 8) for q in g)
    assert not any(q["offload"] for q in ex08_refs.grid(PROBLEM))                       # offload_ok False
    lora = [q for q in g if q["method"] == "lora"]
    assert lora and all(q["optimizer"] == "adamw" and not q["offload"] for q in lora)


# ----------------------------------------------------------------------------- hidden cases: every branch, every run
def test_hidden_train_step_cases_cover_every_rung():
    for seed in range(30):
        cases = ex08_cases.train_step_cases(True, random.Random(seed))
        plans = [(c["problem"], c["plan"]) for c in cases]
        assert {pl["method"] for _, pl in plans} == {"full", "lora", "qlora"}
        assert {pl["precision"] for _, pl in plans} == {"fp32", "bf16"}
        assert {pl["optimizer"] for _, pl in plans} == {"adamw", "adamw8bit"}
        assert {pl["checkpointing"] for _, pl in plans} == {True, False}
        assert any(pl["micro_batch"] == 1 for _, pl in plans)
        assert any(pl["micro_batch"] == p["batch"] for p, pl in plans)
        assert any(p["batch"] % pl["micro_batch"] and pl["precision"] == "fp32" for p, pl in plans)   # uneven
        assert any(1 < pl["micro_batch"] < p["batch"] and p["batch"] % pl["micro_batch"] == 0 for p, pl in plans)
        assert {p["model"] for p, _ in plans} == set(MODELS)
        assert any(pl["method"] == "lora" and pl["checkpointing"] for _, pl in plans)
        assert [c["part"] for c in cases].count("memory") == 1


def test_hidden_state_cases_cover_every_rung():
    for seed in range(30):
        cases = ex08_cases.state_cases(True, random.Random(seed))
        assert {c["problem"]["model"] for c in cases} == set(MODELS)
        plans = [pl for c in cases for pl in c["plans"]]
        assert {pl["method"] for pl in plans} == {"full", "lora", "qlora"}
        assert any(pl["method"] == "full" and pl["precision"] == "fp32" and pl["optimizer"] == "adamw"
                   for pl in plans)
        assert any(pl["optimizer"] == "adamw8bit" for pl in plans) and any(pl["offload"] for pl in plans)
        for c in cases:
            assert all(plan_error(pl, c["problem"], dividing=True) is None for pl in c["plans"])


def test_hidden_plan_cases_draw_one_problem_of_each_kind():
    for seed in range(50):
        cases = ex08_cases.plan_cases(True, random.Random(seed))
        assert sorted(c["kind"] for c in cases) == sorted(ex08_cases.FAMILY)
        for c in cases:
            f, p = ex08_cases.FAMILY[c["kind"]], c["problem"]
            check_problem(p)
            assert (p["model"], p["gpu"]) == (f["model"], f["gpu"]) and p["batch"] in ex08_cases.BATCHES
            assert f["seq"][0] <= p["seq"] <= f["seq"][1] and f["headroom"][0] <= p["headroom"] <= f["headroom"][1]
            assert f["offload_ok"] is None or p["offload_ok"] is f["offload_ok"]
            assert p["lora_r"] in f["ranks"]


def test_fit_tools_raise_inside_the_learner_call_and_come_back():
    fit_module, search_module = sys.modules["memlab.fitting.plan"], sys.modules["memlab.fitting.search"]
    before = (memlab.fit, memlab.fit_search, fit_module.fit, search_module.fit_search)
    with ex08_run._no_fit_tool():
        for f in (memlab.fit, memlab.fit_search, fit_module.fit, search_module.fit_search):
            with pytest.raises(RuntimeError, match="off limits"):
                f("llama-2-7b")
    assert (memlab.fit, memlab.fit_search, fit_module.fit, search_module.fit_search) == before

    def sneaky(problem, measure):
        return memlab.fit(problem["model"], problem["gpu"])
    got = ex08_run.plan_run({"problem": PROBLEM}, sneaky)
    assert "off limits" in got["raised"]


# ----------------------------------------------------------------------------- results validated before judging
def test_empty_short_or_missing_results_fail_never_pass_vacuously():
    memory = ex08_cases.train_step_cases(False, random.Random(0))[2]
    for got in ({}, {"peak": 1.5}, {"peak": "0"}, {"raised": "RuntimeError: x"}):
        with pytest.raises(AssertionError):
            ex08_judge.train_step_judge(memory, got)
    case = ex08_cases.train_step_cases(False, random.Random(0))[1]
    good = decode(encode(ex08_run.train_step_run(case, _namespace()["train_step"])))
    ex08_judge.train_step_judge(case, good)
    forged = [{"calls": [], "steps": [], "final": []},
              {**good, "calls": good["calls"][:1], "steps": good["steps"][:1]},
              {**good, "steps": []},
              {**good, "final": good["final"][:-1]},
              {**good, "final": [v[:1] for v in good["final"]]},
              {**good, "steps": [{**s, "proj": []} for s in good["steps"]]},
              {k: v for k, v in good.items() if k != "final"},
              {**good, "calls": [{**c, "layers": "many"} for c in good["calls"]]}]
    for got in forged:
        with pytest.raises(AssertionError):
            ex08_judge.train_step_judge(case, got)
    state_case = {"problem": PROBLEM, "plans": [PLAN]}
    for got in ([], [{}], [{"parameters": 1, "gradients": 1}], [{"parameters": 1.5, "gradients": 1, "optimizer": 1}],
                [{"raised": "ValueError: x"}]):
        with pytest.raises(AssertionError):
            ex08_judge.state_judge(state_case, got)
    for got in ({}, {"plan": None}, {"plan": "lora"}, {"invalid": "no"}, {"raised": "ValueError: no plan fits"}):
        with pytest.raises(AssertionError):
            ex08_judge.plan_judge({"problem": PROBLEM}, got)


# ----------------------------------------------------------------------------- the wrong steps, every hidden draw
@pytest.mark.slow
@pytest.mark.parametrize("name", ["micro_batch_losses_not_weighted", "dividing_by_the_count_of_uneven_micro_batches",
                                  "optimizer_step_per_micro_batch", "one_late_backward",
                                  "zero_grad_before_each_micro_batch", "checkpointing_ignored"])
def test_wrong_train_steps_fail_visible_and_every_hidden_draw(name):
    ns = _namespace(wrong.WRONG[name]["replace"])
    for hidden, seeds in ((False, [0]), (True, range(3))):
        for seed in seeds:
            with pytest.raises(AssertionError):
                for case in ex08_cases.train_step_cases(hidden, random.Random(seed)):
                    _judge_tiny(ns, case)


@pytest.mark.slow
def test_solution_train_step_passes_several_hidden_draws():
    ns = _namespace()
    for seed in range(3):
        for case in ex08_cases.train_step_cases(True, random.Random(100 + seed)):
            _judge_tiny(ns, case)


# ----------------------------------------------------------------------------- the family's guarantees
def _corner(kind, *, big: bool, offload_ok=None):
    """The problem of `kind` at a corner of its ranges: big=True the most memory (longest sequences, the largest
    batch and rank, the most headroom), big=False the least."""
    f = ex08_cases.FAMILY[kind]
    i = 1 if big else 0
    return {"model": f["model"], "gpu": f["gpu"], "batch": ex08_cases.BATCHES[i], "seq": f["seq"][i],
            "headroom": f["headroom"][i], "lora_r": f["ranks"][-1 if big else 0],
            "offload_ok": f["offload_ok"] if f["offload_ok"] is not None else offload_ok}


def _plan(method, precision="bf16", optimizer="adamw", checkpointing=True, micro_batch=1, offload=False, r=8):
    return {"method": method, "lora_r": r, "precision": precision, "optimizer": optimizer,
            "checkpointing": checkpointing, "micro_batch": micro_batch, "offload": offload}


@pytest.mark.slow
def test_family_qlora_only_qlora_with_checkpointing_fits():
    small = _corner("qlora", big=False, offload_ok=True)       # every other branch is out even here
    room = usable(small)
    for q in ex08_refs.grid(small):
        if q["method"] != "qlora":
            assert ex08_refs.weights_floor(small, q) > room, q
    for precision in ("fp32", "bf16"):                           # no checkpointing: not even 1 or 2 sequences
        for m in (1, 2):
            assert not ex08_refs.fits(small, _plan("qlora", precision, checkpointing=False, micro_batch=m)), \
                (precision, m)
    big = _corner("qlora", big=True)
    assert ex08_refs.fits(big, _plan("qlora", "fp32", r=big["lora_r"]))   # checkpointing, one sequence: fits


@pytest.mark.slow
def test_family_lora_fits_where_no_full_plan_does_with_states_over_four_fifths_of_usable():
    small = _corner("lora", big=False)
    for q in ex08_refs.grid(small):
        if q["method"] == "full" or q["precision"] == "fp32" and q["method"] == "lora":
            assert ex08_refs.weights_floor(small, q) > usable(small), q
    big = _corner("lora", big=True)
    assert ex08_refs.fits(big, _plan("lora", r=big["lora_r"]))
    # the answer's branch holds most of the card even where it holds least (the least headroom): a plan_for that
    # skips a branch whose states exceed 0.8 x usable skips it in every draw
    states = sum(ex08_refs.reference_states(small, _plan("lora", r=small["lora_r"])).values())
    assert states > 0.81 * usable(small), states / usable(small)


def test_the_qlora_and_lora_kinds_draw_different_ranks():
    """A plan_for that writes one LoRA rank instead of problem["lora_r"] gets one of the two kinds wrong."""
    assert not set(ex08_cases.FAMILY["qlora"]["ranks"]) & set(ex08_cases.FAMILY["lora"]["ranks"])


@pytest.mark.slow
def test_family_offload_fits_full_fine_tuning():
    small = _corner("offload", big=False)
    for q in ex08_refs.grid(small):
        if q["method"] == "full" and (q["precision"] == "fp32" or not q["offload"]):
            assert ex08_refs.weights_floor(small, q) > usable(small), q
    big = _corner("offload", big=True)
    assert ex08_refs.fits(big, _plan("full", offload=True))


@pytest.mark.slow
def test_solution_plans_and_states_pass_more_hidden_draws():
    """Fixed draws beside the fresh ones test_checks.py and the class run grade: two for 8.2, one for 8.3 (each of
    its draws walks a grid of 7B/8B plans with memlab.fit)."""
    from autograder.checks.ex08 import TASKS
    ns = _namespace()
    for tid, names, seeds in (("task8_2_state_bytes", {"state_bytes": ns["state_bytes"]}, (7, 8)),
                              ("task8_3_cheapest_plan", {"plan_for": ns["plan_for"]}, (7,))):
        task = TASKS[tid]
        for seed in seeds:
            for case in task.cases(True, random.Random(seed)):
                task.judge(case, decode(encode(task.run(case, **names))))
