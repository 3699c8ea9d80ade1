"""Exercise 05's check helpers in-process: the hidden cases cover every branch of each task in every run, the
mistakes of tests/submissions/ex05.py lose every hidden draw (not only most), the tile bound follows the tile
the learner's function was called with, and hidden-case messages do not state the expected values
(tests/test_checks.py runs every exercise's solution and wrong submissions once)."""

from __future__ import annotations

import random

import pytest
import torch

from _nb import solution_namespace
from autograder.checks.common import decode, encode
from autograder.checks.ex05 import TASKS
from autograder.checks.ex05 import cases as ex05_cases
from submissions import ex05 as spec

ASSIGNMENT = "05_efficient_attention"


def _loses(task_id, names, seed):
    """Whether the hidden check of task_id fails with this draw (AssertionError or a crash of the code)."""
    task = TASKS[task_id]
    for case in task.cases(True, random.Random(seed)):
        try:
            task.judge(case, decode(encode(task.run(case, **names))))
        except Exception:                 # noqa: BLE001 - an AssertionError, or the submission's own crash
            return True
    return False


# ----------------------------------------------------------------------------- task 5.1
def test_softmax_hidden_cases_cover_every_branch_in_every_run():
    for seed in range(200):
        cases = ex05_cases.softmax_cases(True, random.Random(seed))
        xs = [ex05_cases.softmax_input(c) for c in cases]
        # every row far below float32 exp's underflow: a running max started at 0 sums zeros
        assert any(bool((x.max(dim=-1).values < -110).all()) for x in xs)
        # row maxima far apart: one max over all rows underflows the lower rows
        assert any(x.shape[0] > 1 and float(x.max(dim=-1).values.max() - x.max(dim=-1).values.min()) > 250
                   for x in xs)
        # a row whose first block is all -inf (and a finite entry later)
        assert any(bool(torch.isinf(x[:, :c["block"]]).all(dim=-1).any()) for x, c in zip(xs, cases))
        for x in xs:
            assert torch.isfinite(x).any(dim=-1).all(), "every row keeps a finite entry"
        assert any(c["rising"] for c in cases) and any(c["n"] % c["block"] for c in cases)
        assert any(c["block"] > c["n"] for c in cases) and any(c["block"] == c["n"] for c in cases)


def test_the_solution_has_no_nan_when_a_first_block_is_masked():
    online_softmax = solution_namespace(ASSIGNMENT)["online_softmax"]
    x = torch.tensor([[float("-inf"), float("-inf"), 1.0, -2.0], [-300.0, -301.0, float("-inf"), -299.0]])
    assert torch.allclose(online_softmax(x, 2), torch.softmax(x, dim=-1))


@pytest.mark.parametrize("name", ["softmax_max_from_zero", "softmax_one_max_for_all_rows",
                                  "softmax_nan_on_masked_first_block", "softmax_no_rescale",
                                  "softmax_drops_partial_block"])
def test_softmax_mistakes_lose_every_hidden_run(name):
    fn = solution_namespace(ASSIGNMENT, spec.WRONG[name]["replace"])["online_softmax"]
    for seed in range(30):
        assert _loses("task5_1_online_softmax", {"online_softmax": fn}, seed), f"{name} passed draw {seed}"


def _messages(task_id, fn, seed):
    """The AssertionError messages of the hidden cases this function fails, one per failed case."""
    task, out = TASKS[task_id], []
    for case in task.cases(True, random.Random(seed)):
        try:
            task.judge(case, decode(encode(task.run(case, online_softmax=fn))))
        except AssertionError as e:
            out.append((case, str(e)))
    return out


def test_the_partial_block_hint_appears_only_when_the_partial_block_is_at_fault():
    hint = "is the last, partial block included?"
    dropped = solution_namespace(ASSIGNMENT, spec.WRONG["softmax_drops_partial_block"]["replace"])["online_softmax"]
    no_rescale = solution_namespace(ASSIGNMENT, spec.WRONG["softmax_no_rescale"]["replace"])["online_softmax"]
    for seed in range(10):
        got = _messages("task5_1_online_softmax", dropped, seed)
        assert got and all(hint in m for c, m in got if c["n"] % c["block"] and c["n"] > c["block"]), got
        got = _messages("task5_1_online_softmax", no_rescale, seed)
        assert got and not any(hint in m for _, m in got), \
            "a learner who handles the partial block but forgets the rescale is told to look at the partial block"


# ----------------------------------------------------------------------------- task 5.2
def test_attention_hidden_cases_catch_one_sided_tiling_in_every_case():
    for seed in range(300):
        cases = ex05_cases.attn_cases(True, random.Random(seed))
        assert {c["causal"] for c in cases} == {True, False}
        assert {len(c["lead"]) for c in cases} >= {0, 2}
        assert any(c["tq"] != c["tk"] for c in cases) and len({c["tile"] for c in cases}) > 1
        for c in cases:
            assert c["tk"] > c["tile"] and c["tq"] > c["tile"], "more than one key tile and query tile"
            assert c["tq"] % c["tile"] and c["tk"] % c["tile"], "a last, partial tile"
            assert ex05_cases._strip(c) > ex05_cases.largest_allowed(c, c["tile"])


@pytest.mark.parametrize("name", ["tiled_query_chunks_only", "tiled_full_matrix", "mask_after_max",
                                  "tiled_drops_partial_tile"])
def test_tiled_mistakes_lose_every_hidden_run(name):
    fn = solution_namespace(ASSIGNMENT, spec.WRONG[name]["replace"])["tiled_attention"]
    for seed in range(8):
        assert _loses("task5_2_tiled_attention", {"tiled_attention": fn}, seed), f"{name} passed draw {seed}"


# ----------------------------------------------------------------------------- task 5.3
def test_flash_records_the_tile_its_forward_passes_and_restores_the_name():
    ns = solution_namespace(ASSIGNMENT, spec.RIGHT["flash_tile_32"]["replace"])
    original = ns["tiled_attention"]
    case = ex05_cases.flash_cases(False, random.Random(0))[0]
    got = TASKS["task5_3_flash_function"].run(case, FlashAttention=ns["FlashAttention"])
    assert got["tiles"] == [32]
    assert ns["tiled_attention"] is original
    TASKS["task5_3_flash_function"].judge(case, decode(encode(got)))       # tile 32 at T = 40 passes
    with pytest.raises(AssertionError, match="tile 16"):                   # the same tensors with tile 16 do not
        TASKS["task5_3_flash_function"].judge(case, dict(decode(encode(got)), tiles=[16]))


# ----------------------------------------------------------------------------- messages
def test_hidden_messages_do_not_state_the_expected_values():
    fn = solution_namespace(ASSIGNMENT, spec.WRONG["softmax_one_max_for_all_rows"]["replace"])["online_softmax"]
    task = TASKS["task5_1_online_softmax"]
    for case in task.cases(True, random.Random(5)):
        got = decode(encode(task.run(case, online_softmax=fn)))
        try:
            task.judge(case, got)
        except AssertionError as e:
            assert "expected" not in str(e), str(e)
