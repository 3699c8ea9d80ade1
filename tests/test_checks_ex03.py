"""Exercise 03's own check tests (tests/test_checks.py runs every exercise's solution and wrong submissions):
the hidden cases exercise every branch of the spec in every draw."""

from __future__ import annotations

import random

import pytest
import torch

from memlab.kit.ex03 import drive_scaler
from autograder.checks.ex03.cases import amp_cases, scaler_cases
from autograder.checks.ex03.refs import reference_amp


def _gradscaler(plan):
    return torch.amp.GradScaler("cpu", **{k: plan[k] for k in ("init_scale", "growth_factor", "backoff_factor",
                                                                 "growth_interval")})


@pytest.mark.slow
def test_hidden_scaler_plans_cover_every_branch():
    # in every draw: growth, backoff after an injected NaN that follows growth_interval - 1 clean steps,
    # growth twice in a row, a skipped first step, inf / -inf / NaN, explicit unscale_ on a clean and a skipped step
    for seed in range(4):
        grow, first = [p for p in scaler_cases(True, random.Random(seed)) if p["kind"] == "plan"]
        assert {v for p in (grow, first) for _, v, _, _ in p["inject"]} == {"inf", "-inf", "nan"}
        steps = drive_scaler(_gradscaler(grow), grow)["steps"]
        g = grow["growth_interval"]
        ran = [s["ran"] for s in steps]
        assert ran[:g - 1] == [True] * (g - 1) and not ran[g - 1], "the NaN after g - 1 clean steps must skip"
        assert sum(s["after"] > s["used"] for s in steps) >= 3
        assert any(s["explicit"] is not None and s["ran"] for s in steps)
        assert any(s["explicit"] is not None and not s["ran"] for s in steps)
        steps = drive_scaler(_gradscaler(first), first)["steps"]
        assert not steps[0]["ran"] and any(s["ran"] for s in steps)


@pytest.mark.slow
def test_hidden_amp_cases_overflow_and_clip():
    for seed in range(3):
        cases = amp_cases(True, random.Random(seed))
        assert {c["dtype"] for c in cases} == {"float16", "bfloat16"} and min(c["micro"] for c in cases) == 1
        assert any(c["max_norm"] is None for c in cases) and any(c["max_norm"] for c in cases)
        clip_overflow = [c for c in cases if c["init_scale"] >= 2 ** 20]
        ref = reference_amp(clip_overflow[0])
        assert ref["scales"][0] < ref["used"][0], "the first step must overflow and be skipped"
        assert ref["delta"].norm() > 0
