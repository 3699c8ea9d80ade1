"""Exercise 02's own check tests (tests/test_checks.py runs every exercise's solution and wrong submissions):
the checks' references agree with brute force and the hidden cases cover every branch in every draw."""

from __future__ import annotations

import random

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
