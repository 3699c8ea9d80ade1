"""Exercise 08's own check tests (tests/test_checks.py runs every exercise's solution and wrong submissions):
plan validation, the stated order, the hidden cases covering every rung in every draw, the wrong train steps
failing every hidden draw, forward counters that cannot be pumped from outside the step, results validated before
judging, memlab.fit's machinery kept out of the learner's calls, 8.2's tolerance under what each mistake weighs,
8.1's memory corroborated from outside, and the hidden problem family's guarantees proved with memlab.fit at the
corners of its ranges (and, for the kind whose headroom memlab.fit sets, at every size)."""

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
        memory = [c for c in cases if c["part"] == "memory"]
        assert len(memory) == 2 and [c.get("watched", False) for c in memory] == [False, True]
        watched = memory[1]
        assert watched["size"] == "tiny" and watched["problem"]["batch"] >= 768
        assert watched["plan"]["micro_batch"] * 2 == watched["problem"]["batch"]


def test_hidden_state_cases_cover_every_rung():
    for seed in range(30):
        cases = ex08_cases.state_cases(True, random.Random(seed))
        assert {c["problem"]["model"] for c in cases} == set(MODELS)
        plans = [pl for c in cases for pl in c["plans"]]
        assert {pl["method"] for pl in plans} == {"full", "lora", "qlora"}
        assert any(pl["method"] == "full" and pl["precision"] == "fp32" and pl["optimizer"] == "adamw"
                   for pl in plans)
        assert any(pl["optimizer"] == "adamw8bit" for pl in plans) and any(pl["offload"] for pl in plans)
        # the plans on which each mistake 8.2's tolerance is set to catch is decisive, in every run
        assert {pl["precision"] for pl in plans if pl["method"] == "lora"} == {"fp32", "bf16"}
        assert any(pl["method"] == "qlora" for pl in plans)
        assert any(pl["method"] == "full" and pl["optimizer"] == "adamw8bit" and not pl["offload"] for pl in plans)
        for c in cases:
            assert all(plan_error(pl, c["problem"], dividing=True) is None for pl in c["plans"])


def test_hidden_plan_cases_draw_one_problem_of_each_kind(monkeypatch):
    """Every kind in every draw. The "offload" kind's headroom comes from memlab.fit's runs (refs.trap_headroom,
    proved at every size by test_family_offload_every_size_teaches_the_verdict_and_the_order): a stub here."""
    monkeypatch.setattr(ex08_refs, "trap_headroom", lambda p, r: round(r.uniform(0.02, 0.15), 4))
    for seed in range(50):
        cases = ex08_cases.plan_cases(True, random.Random(seed))
        assert sorted(c["kind"] for c in cases) == sorted(ex08_cases.FAMILY)
        for c in cases:
            f, p = ex08_cases.FAMILY[c["kind"]], c["problem"]
            check_problem(p)
            assert (p["model"], p["gpu"]) == (f["model"], f["gpu"])
            assert (p["batch"], p["seq"]) in ex08_cases.sizes(c["kind"])
            assert f["headroom"] is None or f["headroom"][0] <= p["headroom"] <= f["headroom"][1]
            assert f["offload_ok"] is None or p["offload_ok"] is f["offload_ok"]
            assert p["lora_r"] in f["ranks"]


def _trap_numbers(problem, plan):
    """Made-up memlab.fit numbers (peak, needed, capacity) in GiB for the offload branch: without checkpointing
    needed falls with the micro-batch, each plan's needed is its peak + 0.45 GiB; checkpointing needs 14 GiB."""
    G = 2**30
    cap = 22 * G
    if plan["checkpointing"]:
        return int(13.5 * G), 14 * G, cap
    peak = int({4: 26, 2: 19, 1: 16.5}[plan["micro_batch"]] * G)
    return peak, peak + int(0.45 * G), cap


def test_trap_windows_make_the_answer_first_and_the_plan_before_it_peak_below_the_usable_bytes(monkeypatch):
    """refs.trap_windows on made-up numbers: with usable bytes in a window, the answer is the plan without
    checkpointing of micro_batch m, the plan before it peaks at most at the usable bytes yet needs more, and
    checkpointing the whole batch fits; a drawn headroom lands inside a window."""
    monkeypatch.setattr(ex08_refs, "measured", _trap_numbers)
    G = 2**30
    p = {"model": "llama-2-7b", "gpu": "L4-24GB", "batch": 4, "seq": 512, "headroom": 0.0, "lora_r": 8,
         "offload_ok": True}
    windows = ex08_refs.trap_windows(p)
    assert [m for m, _, _ in windows] == [1]                      # the plan before micro_batch 2 peaks at 26 GiB
    (m, lo, hi), = windows
    assert (lo, hi) == (19 * G, 19 * G + int(0.45 * G))         # its peak .. its needed
    for seed in range(20):
        h = ex08_refs.trap_headroom(p, random.Random(seed))
        assert lo <= usable({**p, "headroom": h}) < hi and 0.01 <= h <= 0.2
    assert ex08_refs.trap_windows({**p, "batch": 1}) == []       # no micro-batches: nothing to teach


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
    assert "off limits" in got.get("raised", "") + got.get("forbidden", "")


def test_fit_machinery_kept_out_however_it_is_reached():
    """Not only the public names: the unpatched function kept anywhere (the measure's own guard, a reference taken
    before the check), memlab.fitting's inner functions, fit_search, and switching the profile hook off all fail
    state_bytes and plan_for; reading a model's config (load_config) and the measure handed to plan_for do not.
    Each call below stops at its first line of memlab/fitting, so nothing is measured."""
    import memlab.fitting.run as fit_run
    import memlab.fitting.search as fit_search
    kept = sys.modules["memlab.fitting.plan"].fit
    state_case = {"problem": PROBLEM, "plans": [PLAN]}
    good = {"parameters": 1, "gradients": 1, "optimizer": 1}

    def calls(f):
        def state_bytes(problem, plan):
            try:
                f(problem)
            except Exception:  # noqa: BLE001 - a bad call still counts: it entered memlab/fitting
                pass
            return dict(good)
        return state_bytes
    kept_search = fit_search.fit_search

    def guard_found(p):                                # the unpatched function the check holds, found by the gc
        import gc
        guard = next(o for o in gc.get_objects() if isinstance(o, ex08_run._FitGuard) and o.hits is not None)
        return guard._fit(p["model"], batch=-1)
    for attempt in (lambda p: kept(p["model"], p["gpu"], batch=-1),            # kept before the patch
                    guard_found,
                    lambda p: fit_run.measure(None, None),                      # the machinery inside
                    lambda p: kept_search(p["model"], batch=-1)):
        got = ex08_run.state_run(state_case, calls(attempt))
        assert "forbidden" in got[0] and "off limits" in got[0]["forbidden"], got
        with pytest.raises(AssertionError, match="off limits"):
            ex08_judge.state_judge(state_case, got)

    def switched_off(problem, plan):
        sys.setprofile(None)
        return dict(good)
    got = ex08_run.state_run(state_case, switched_off)
    assert "switched off" in got[0]["forbidden"], got
    assert sys.getprofile() is None

    def reads_config(problem, plan):
        from memlab.fitting.plan import load_config
        return {"parameters": load_config(problem["model"]).hidden_size, "gradients": 0, "optimizer": 0}
    assert ex08_run.state_run(state_case, reads_config) == [{"parameters": 4096, "gradients": 0, "optimizer": 0}]

    def via_measure_closure(problem, measure):
        return measure._guard._fit(problem["model"], problem["gpu"], batch=-1)
    assert "off limits" in ex08_run.plan_run({"problem": {**PROBLEM, "seq": 256}}, via_measure_closure)["forbidden"]

    def swaps_memlab(problem, measure):
        import memlab.kit.ex08 as k
        k.usable = lambda p: 0
        return measure(PLAN)
    import memlab.kit.ex08 as kit_module
    usable_before = kit_module.usable
    try:
        got = ex08_run.plan_run({"problem": {**PROBLEM, "seq": 384}}, swaps_memlab)
    finally:
        kit_module.usable = usable_before
    assert "replaced" in got.get("raised", "") + got.get("forbidden", ""), got


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
              {**good, "calls": [{**c, "embed": "many"} for c in good["calls"]]},
              {**good, "calls": [{**c, "embed": [[0, 1], [1, 2]]} for c in good["calls"]]},      # a row twice
              {**good, "calls": [{**c, "embed": [[0, 1], [-1, 3]]} for c in good["calls"]]},     # not the batch's
              {**good, "calls": [{**c, "embed": [[0, 1, 2, 3]]} for c in good["calls"]]},        # one whole batch
              {**good, "calls": [{**c, "recompute": c["recompute"][:-1]} for c in good["calls"]]},
              {**good, "calls": [{**c, "recompute": [[] for _ in c["recompute"]]} for c in good["calls"]]},
              {**good, "calls": [{**c, "recompute": [[4] for _ in c["recompute"]]} for c in good["calls"]]}]
    for got in forged:
        with pytest.raises(AssertionError):
            ex08_judge.train_step_judge(case, got)
    state_case = {"problem": PROBLEM, "plans": [PLAN]}
    for got in ([], [{}], [{"parameters": 1, "gradients": 1}], [{"parameters": 1.5, "gradients": 1, "optimizer": 1}],
                [{"raised": "ValueError: x"}]):
        with pytest.raises(AssertionError):
            ex08_judge.state_judge(state_case, got)
    for got in ({}, {"plan": None}, {"plan": "lora"}, {"invalid": "no"}, {"raised": "ValueError: no plan fits"},
                {"forbidden": "plan_for called memlab.fit"}):
        with pytest.raises(AssertionError):
            ex08_judge.plan_judge({"problem": PROBLEM}, got)


# ----------------------------------------------------------------------------- counters that cannot be pumped
def test_calls_under_no_grad_or_outside_the_backward_do_not_count():
    """The plain whole-batch step with extra calls of the embedding and every layer's norm made under no_grad (so
    no row is seen twice by a counted forward pass) on the case where the plan asks for the whole batch at once:
    the embedding's rows are right, but no layer is replayed inside the backward, so checkpointing is missing."""
    first = "    h = base.model.embed_tokens(x[:m])"
    ns = _namespace({"task8_1_train_step": wrong._PUMPED.replace(first, "    torch.set_grad_enabled(False)\n" + first)
                     + "    torch.set_grad_enabled(True)\n"})
    case = next(c for c in ex08_cases.train_step_cases(True, random.Random(0))
                if c["plan"]["method"] == "lora" and c["plan"]["micro_batch"] == c["problem"]["batch"])
    got = decode(encode(ex08_run.train_step_run(case, ns["train_step"])))
    assert all(sorted(r for call in c["embed"] for r in call) == list(range(case["problem"]["batch"]))
               for c in got["calls"]) and all(c["ignored"] > 0 for c in got["calls"])
    with pytest.raises(AssertionError, match="inside the backward"):
        ex08_judge.train_step_judge(case, got)


# ----------------------------------------------------------------------------- memory seen from outside
def test_a_memory_growth_the_learners_tracker_did_not_report_is_flagged():
    """Task 8.1's memory cases judged in the judging process with their windows' growth beside them: the watched
    case's honest growth (about its peak) is not flagged, a growth of more than twice the reported peak + 64 MiB
    is, a growth with no report (no cgroup: None) or a case that raised is not; the flag keeps the score."""
    from autograder.trusted import Graded, JudgeBudget, judge_in_process
    MiB = 2**20
    cases = ex08_cases.train_step_cases(True, random.Random(0))
    watched = next(c for c in cases if c.get("watched"))
    gid = "task8_1_train_step_hidden"
    plan = {gid: ("task8_1_train_step", [watched])}
    for value, growth, flagged in (({"peak": 80 * MiB}, 90 * MiB, False),         # honest: about its peak
                                   ({"peak": 2 * MiB}, 160 * MiB, True),          # the work kept from the tracker
                                   ({"peak": 80 * MiB}, 2 * 80 * MiB + 64 * MiB, False),
                                   ({"peak": 80 * MiB}, None, False),
                                   ({"raised": "ValueError: x"}, 160 * MiB, False)):
        graded = Graded(memory_growth={} if growth is None else {f"{gid}/0": growth})
        results = {f"{gid}/0": {"key": f"{gid}/0", "value": value}}     # no "end": judged at once, and failed
        judge_in_process("autograder.checks.ex08", plan, {gid: 3.0}, results, graded, JudgeBudget())
        assert bool(graded.flags) == flagged, (value, growth, graded.flags)
        assert graded.scores[gid] == (0.0, 3.0)
    runs = [("task8_1_train_step", c, {"peak": 10 * MiB, "end": 0}, 500 * MiB) for c in cases if c["part"] == "tiny"]
    assert ex08_judge.corroborate(runs) == []          # only memory cases are corroborated


# ----------------------------------------------------------------------------- the wrong steps, every hidden draw
@pytest.mark.slow
@pytest.mark.parametrize("name", ["micro_batch_losses_not_weighted", "dividing_by_the_count_of_uneven_micro_batches",
                                  "optimizer_step_per_micro_batch", "one_late_backward",
                                  "zero_grad_before_each_micro_batch", "checkpointing_ignored",
                                  "counters_pumped_after_a_plain_step"])
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


# ----------------------------------------------------------------------------- 8.2: what each mistake weighs
@pytest.mark.slow
def test_state_tolerance_is_under_each_mistake_and_over_the_correct_counts():
    """For both models: the weight of NF4's constants is what double quantization predicts (an absmax byte per 64
    values, an fp32 per 256 blocks), the 8-bit state's block constants an fp32 per 256 values of each moment, and
    8.2's tolerance on those plans is half of that - under the mistake, over the reference solution's and the
    meta-model count's error (which leaves out the second-level constants and the code tables)."""
    ns, meta = _namespace(), _namespace(wrong.RIGHT["counted_on_a_meta_model"]["replace"])
    for model in MODELS:
        p = {**PROBLEM, "model": model, "lora_r": 32}
        _, linear = ex08_refs._tensor_sizes(model)
        qlora = {**PLAN, "method": "qlora", "lora_r": 32}
        eight = {**PLAN, "method": "full", "optimizer": "adamw8bit"}
        w_nf4 = ex08_refs.mistake_weights(p, qlora)["parameters"]
        assert 0.9 * linear / 64 < w_nf4 < 1.1 * linear / 64, (model, w_nf4, linear)
        n = sum(ex08_refs._tensor_sizes(model)[0])
        w_eight = ex08_refs.mistake_weights(p, eight)["optimizer"]
        assert 0.9 * n / 32 < w_eight < 1.1 * n / 32, (model, w_eight, n)
        for plan, c, w in ((qlora, "parameters", w_nf4), (eight, "optimizer", w_eight)):
            tol = ex08_judge.state_tolerance(p, plan, c)
            ref = ex08_refs.reference_states(p, plan)[c]
            assert tol < w and tol < ex08_judge.STATE_RTOL * ref, (model, c)
            for names in (ns, meta):
                assert abs(names["state_bytes"](p, plan)[c] - ref) < tol / 4, (model, c)


# ----------------------------------------------------------------------------- the family's guarantees
def _corner(kind, *, big: bool, offload_ok=None):
    """The problem of `kind` at a corner of its ranges: big=True the most memory (longest sequences, the largest
    batch and rank, the most headroom), big=False the least."""
    f = ex08_cases.FAMILY[kind]
    i = 1 if big else 0
    return {"model": f["model"], "gpu": f["gpu"], "batch": f.get("batches", ex08_cases.BATCHES)[-i], "seq": f["seq"][i],
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
def test_family_offload_every_size_teaches_the_verdict_and_the_order():
    """At every size of the "offload" kind memlab.fit's runs leave a headroom window (refs.trap_windows), and with a
    headroom drawn in it: every branch before full bf16 with ZeRO-Offload is out by its weights alone, the answer is
    a plan without checkpointing and with micro-batches, the reference solution finds it, and both plausible plans
    that get the order's finer points wrong lose - one that compares the peak with the usable bytes, one that tries
    fewer micro-batches before no checkpointing. So each loses 8.3's hidden points in every run."""
    ns = _namespace()
    peak = _namespace(wrong.WRONG["peak_instead_of_the_verdict"]["replace"])["plan_for"]
    swapped = _namespace(wrong.WRONG["micro_batches_before_checkpointing"]["replace"])["plan_for"]
    for i, (batch, seq) in enumerate(ex08_cases.sizes("offload")):
        f = ex08_cases.FAMILY["offload"]
        p = {"model": f["model"], "gpu": f["gpu"], "batch": batch, "seq": seq, "headroom": 0.0, "lora_r": 8,
             "offload_ok": True}
        assert ex08_refs.trap_windows(p), (batch, seq)
        p["headroom"] = ex08_refs.trap_headroom(p, random.Random(i))
        room = usable(p)
        for q in ex08_refs.grid(p):
            if q["method"] == "full" and (q["precision"] == "fp32" or not q["offload"]):
                assert ex08_refs.weights_floor(p, q) > room, q
        answer = ex08_refs.reference_plan(p)
        assert answer["method"] == "full" and answer["offload"] and not answer["checkpointing"], (p, answer)
        assert answer["micro_batch"] < batch, (p, answer)
        case = {"problem": p, "kind": "offload"}
        ex08_judge.plan_judge(case, decode(encode(ex08_run.plan_run(case, ns["plan_for"]))))
        for wrong_plan in (peak, swapped):
            with pytest.raises(AssertionError):
                ex08_judge.plan_judge(case, decode(encode(ex08_run.plan_run(case, wrong_plan))))


def test_the_verdict_is_memlab_fits_own():
    """refs.fits computes memlab.fit's verdict from its cached numbers (needed <= usable) instead of running it for
    every headroom: the same answer as FitResult.fits, on either side of the line."""
    from memlab.core.gpus import usable_bytes
    p = {**PROBLEM, "batch": 1, "seq": 32}
    plan = {**PLAN, "micro_batch": 1}
    peak, needed, cap = ex08_refs.measured(p, plan)
    for h in (1 - needed / cap + 1e-6, 1 - needed / cap - 1e-6, 0.05):
        h = round(min(max(h, 0.0), 0.99), 7)
        q = {**p, "headroom": h}
        assert ex08_refs.fits(q, plan) == memlab.fit(q["model"], q["gpu"], **fit_options(q, plan)).fits == \
            (needed <= usable_bytes(cap, h))


@pytest.mark.slow
def test_solution_states_pass_more_hidden_draws():
    """Fixed draws beside the fresh ones test_checks.py and the class run grade: two for 8.2 (8.3's kinds are proved
    above, at the corners of their ranges and, for the offload kind, at every size)."""
    from autograder.checks.ex08 import TASKS
    ns = _namespace()
    for tid, names, seeds in (("task8_2_state_bytes", {"state_bytes": ns["state_bytes"]}, (7, 8)),):
        task = TASKS[tid]
        for seed in seeds:
            for case in task.cases(True, random.Random(seed)):
                task.judge(case, decode(encode(task.run(case, **names))))
