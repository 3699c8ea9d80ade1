"""Exercise 02's own check tests (tests/test_checks.py runs every exercise's solution and wrong submissions):
the checks' references agree with brute force and the hidden cases cover every branch in every draw."""

from __future__ import annotations

import random

import pytest

from autograder.checks import ex02
from autograder.checks.ex02 import refs as ex02_refs


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
        assert {c["cfg"]["pos"] for c in gpt} == {"learned", "rope"}
        assert {c["cfg"]["attn"] for c in gpt} == {"sdpa", "math"}
        assert any(c["cfg"]["dropout"] > 0 for c in gpt)


def test_hidden_cases_cover_the_new_branches():
    from autograder.checks.common import rng
    from memlab.checkpointing import plan_peak
    for _ in range(3):
        k_cases = ex02.TASKS["task2_1_checkpoint_every_k"].cases(True, rng(True))
        (bad,) = [c["validate"] for c in k_cases if "validate" in c]
        assert {type(k) for k in bad} == {int, float, bool, str} and 0 in bad
        assert any(type(k) is int and k < 0 for k in bad) and True in bad
        assert all(float(k) >= 1 for k in bad if type(k) in (float, str))      # would be valid as ints
        plan = ex02.TASKS["task2_3_plan_checkpoints"].cases(True, rng(True))
        forced = [c for c in plan if "free to recompute" in c["desc"]]
        assert len(forced) == 1
        m, c, budget = forced[0]["m"], forced[0]["c"], forced[0]["budget"]
        best = ex02_refs.brute_force_plan(m, c, budget)[0]
        cheapest = [k for k in ex02_refs.all_plans(len(m))
                    if plan_peak(m, k) <= budget and ex02_refs.plan_cost(c, k) == best]
        assert cheapest and all(any(kk and not cc for kk, cc in zip(k, c)) for k in cheapest)
        gpt = ex02.TASKS["task2_4_checkpointed_gpt"].cases(True, rng(True))
        assert all(c["T"] < c["cfg"]["block_size"] for c in gpt)
    visible = ex02.TASKS["task2_1_checkpoint_every_k"].cases(False, None)
    assert any("validate" in c for c in visible)


def test_reference_schemes_come_from_pytorchs_pass():
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from memlab.checkpointing import activation_peak
    from autograder.checks.ex02 import cases as ex02_cases
    case = dict(n=7, d=16, rows=32, container="list", x_grad=True, seed=5)
    for k in (1, 2, 3, 9):
        _, blocks, x, w = ex02_cases._stack(case)
        ref = ex02_refs.ref_every_k(blocks, k)
        assert [isinstance(m, CheckpointWrapper) for m in ref] == [i % k == 0 for i in range(7)]
        assert torch.allclose(ref(x), ex02_refs.plain_forward(blocks, x))
    # every block checkpointed keeps less than the plain stack, and one kept input per block at most
    _, blocks, x, w = ex02_cases._stack(case)
    plain = activation_peak(nn_seq := torch.nn.Sequential(*blocks), lambda: (nn_seq(x) * w).sum()).peak
    ref = ex02_refs.ref_every_k(blocks, 1)
    assert activation_peak(ref, lambda: (ref(x) * w).sum()).peak < plain
    gcase = ex02.TASKS["task2_4_checkpointed_gpt"].cases(False, None)[0]
    cfg, plain_gpt, batches = ex02_cases._gpt_setup(gcase)
    gpt = ex02_refs.ref_checkpointed_gpt(cfg, plain_gpt.state_dict())
    assert all(isinstance(b, CheckpointWrapper) for b in gpt.blocks)
    x, y = batches[0]
    assert torch.allclose(gpt(x, y), plain_gpt(x, y))


def test_sqrt_cases_cover_every_branch_in_every_run():
    """Task 2.2, every run: n = 1, a square and both its neighbours among the segment counts; every container, an
    input without grad, a stack of a square number of blocks and one of a number that is not."""
    import math
    for seed in range(50):
        ns_case, *stacks = ex02.TASKS["task2_2_sqrt_segments"].cases(True, random.Random(seed))
        ns = ns_case["ns"]
        assert 1 in ns and any(math.isqrt(n) ** 2 == n and n > 1 and {n - 1, n + 1} <= set(ns) for n in ns)
        assert {c["container"] for c in stacks} == {"Sequential", "ModuleList", "list"}
        assert any(not c["x_grad"] for c in stacks)
        assert {math.isqrt(c["n"]) ** 2 == c["n"] for c in stacks} == {True, False}


# ----------------------------------------------------------------------------- the watched cases, from outside
MEASURED = ("task2_1_checkpoint_every_k", "task2_2_sqrt_segments", "task2_4_checkpointed_gpt")


def _watched(task_id, seed=0):
    (case,) = [c for c in ex02.TASKS[task_id].cases(True, random.Random(seed)) if c.get("watched")]
    return case


def test_every_hidden_draw_has_one_watched_case_per_measured_task():
    for seed in range(20):
        for tid in MEASURED:
            _watched(tid, seed)                 # exactly one
    assert not any(c.get("watched") for c in ex02.TASKS["task2_3_plan_checkpoints"].cases(True, random.Random(0)))


@pytest.mark.usefixtures("one_thread")                 # tests/conftest.py
def test_a_module_that_does_not_checkpoint_holds_150_mib_more_in_each_watched_case():
    """Measured with memlab's tracker in this process: the plain model's activation peak against the peak of the
    reference scheme each watched case is judged against (what an honest run's window holds besides its inputs)."""
    from memlab.checkpointing import activation_peak
    from autograder.checks.ex02.inputs import _gpt_setup, _stack
    gap = {}
    for tid in MEASURED:
        case = _watched(tid)
        if "cfg" in case:
            cfg, plain, batches = _gpt_setup(case)
            x, y = batches[0]
            scheme = ex02_refs.ref_checkpointed_gpt(cfg, plain.state_dict())
            peaks = [activation_peak(m, lambda m=m: m(x, y)).peak for m in (scheme, plain)]
        else:
            _, blocks, x, w = _stack(case)
            n = case["n"]
            scheme = ex02_refs.ref_every_k(blocks, case["k"]) if "k" in case else ex02_refs.RefSegments(
                blocks, ex02_refs.round_robin_segments(n, next(s for s in range(1, n + 1) if s * s >= n)))
            peaks = [activation_peak(scheme, lambda f=f: (f(x) * w).sum()).peak
                     for f in (scheme, lambda t: ex02_refs.plain_forward(blocks, t))]
        gap[tid] = peaks[1] - peaks[0]
    assert all(g >= 150 * 2**20 for g in gap.values()), gap


def test_corroborate_flags_a_window_the_tracker_did_not_see():
    """judge.corroborate with made-up runs, for each measured task: an honest watched case (window = the tracker's
    peak, what the run keeps besides and a little) is not flagged; a window of the plain model's size while the
    tracker reported the scheme's peak is; a case without a window (growth None), a small case and a case whose run
    raised are never flagged."""
    from autograder.checks.ex02.cases import outside_the_tracker
    from autograder.checks.ex02.judge import corroborate
    MiB = 2**20
    for tid in MEASURED:
        case = _watched(tid)
        small = ex02.TASKS[tid].cases(False, None)[-1]
        peak, extra = 39 * MiB, outside_the_tracker(case)
        assert corroborate([(tid, case, {"peak": peak}, peak + extra + 6 * MiB)]) == []
        assert corroborate([(tid, case, {"peak": peak}, 208 * MiB)]) != [], tid
        assert corroborate([(tid, case, {"peak": 0}, 150 * MiB)]) != [], tid
        assert corroborate([(tid, case, {"peak": peak}, None)]) == []
        assert corroborate([(tid, small, {"peak": 0}, 500 * MiB)]) == []
        assert corroborate([(tid, case, {"problem": "raised"}, 500 * MiB)]) == []
