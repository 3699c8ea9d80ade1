"""Exercise 04's own check tests (tests/test_checks.py runs every exercise's solution and wrong submissions):
the clinic's patients shown in the notebook are the grader's reference scripts, each patient as it came in
fails its check, the hidden cases of tasks 4.5 and 4.6 cover every branch in every draw, and the full-size
check of task 4.4 measures a second real step."""

from __future__ import annotations

import inspect
import random

import pytest

import memlab
from memlab import clinic
from _nb import grade_id, source_notebook
from autograder.checks import ex04
from autograder.checks.common import check
from autograder.checks.ex04.cases import leak_cases, max_batch_cases
from autograder.checks.ex04.inputs import LEAK_PLANS, leak_scenario
from autograder.checks.ex04.refs import reference_leak, reference_max_batch


def _check(task_id, ns, hidden):
    task = ex04.TASKS[task_id]
    return check(task, hidden=hidden, **{n: ns[n] for n in task.names})


def test_patients_are_the_graders_references():
    cells = {grade_id(c): c.source for c in source_notebook("04_oom_clinic").cells}
    for gid, fn in [("task4_1_big_batch", clinic.train_big_batch), ("task4_2_eval_no_grad", clinic.evaluate),
                    ("task4_3_accumulated_loss", clinic.train_accumulated),
                    ("task4_4_optimizer_step", clinic.train_1b3)]:
        assert inspect.getsource(fn).strip() in cells[f"{gid}_patient"], f"{gid}: the notebook shows another script"


@pytest.mark.slow
@pytest.mark.parametrize("task_id,original", [("task4_1_big_batch", clinic.train_big_batch),
                                              ("task4_2_eval_no_grad", clinic.evaluate),
                                              ("task4_3_accumulated_loss", clinic.train_accumulated),
                                              ("task4_4_optimizer_step", clinic.train_1b3)])
def test_originals_fail_their_checks(task_id, original):
    """Each patient as it came in runs out of memory at full size: handing it back unchanged earns nothing."""
    with pytest.raises(AssertionError, match="still runs out of memory"):
        _check(task_id, {ex04.TASKS[task_id].names[0]: original}, False)


def test_max_batch_cases_cover_every_branch():
    for seed in range(5):
        cases = max_batch_cases(True, random.Random(seed))
        answers = [reference_max_batch(c) for c in cases]
        limits = [c["limit"] for c in cases]
        assert 0 in answers and 1 in answers
        assert any(a == lim and lim & (lim - 1) for a, lim in zip(answers, limits)), "limit not a power of two"
        assert any(a == lim - 1 for a, lim in zip(answers, limits))
        assert any(a & (a - 1) == 0 and a > 2 for a in answers)
        assert any(a > 2 and (a + 1) & a == 0 for a in answers) and any(a > 2 and (a - 1) & (a - 2) == 0
                                                                        for a in answers)


def _levels(case):
    step, model, opt = leak_scenario(case)
    tracker = memlab.MemoryTracker(model, opt)
    out = []
    with tracker:
        for _ in range(case["n_steps"]):
            step()
            out.append(tracker.breakdown())
    return out


def test_leak_cases_cover_every_leak_and_trap():
    for seed in range(5):
        cases = leak_cases(True, random.Random(seed))
        assert {c["kind"] for c in cases} == set(LEAK_PLANS) >= {
            "outputs", "grads", "inputs", "eval", "hook", "none_adam", "none_sgd", "two_leaks", "grads_and_inputs",
            "late", "flat_then_growing", "leak_and_late_growth", "leak_and_noise"}
        assert min(c["n_steps"] for c in cases) == 3


@pytest.mark.parametrize("seed", range(3))
def test_leak_traps_catch_their_mistakes_in_every_draw(seed):
    """Each trap scenario separates the spec from one mistake, whatever the draw: two leaks whose larger one is
    later (and earlier) in CATEGORIES than the smaller, growth that starts in step 2 (a leak) or 3 (none), noise."""
    order = list(memlab.CATEGORIES)
    for case in leak_cases(True, random.Random(seed)):
        kind, want = case["kind"], reference_leak(case)
        lv = _levels(case)
        net = {c: lv[-1][c] - lv[0][c] for c in order}
        leaking = [c for c in order if all(b[c] > a[c] for a, b in zip(lv, lv[1:]))]
        if kind in ("two_leaks", "grads_and_inputs"):
            assert len(leaking) == 2 and want[0] == max(leaking, key=net.get)
            first_is_largest = want[0] == leaking[0]
            assert first_is_largest == (kind == "grads_and_inputs"), "the first-found detector must lose two_leaks"
        elif kind == "late":
            assert want is not None and lv[0][want[0]] == 0, "the leak starts in step 2"
        elif kind == "flat_then_growing":
            assert want is None and net["temporaries"] > 0 and lv[1]["temporaries"] == lv[0]["temporaries"]
        elif kind in ("leak_and_late_growth", "leak_and_noise"):
            assert want[0] == "activations" and net["temporaries"] > net["activations"], (
                "a first-vs-last detector must report the temporaries")
            assert "temporaries" not in leaking


def test_recorder_counts_a_checkpoint_recomputation_once():
    """Task 4.3 counts the sequences pushed through the model: a checkpoint's recomputation in backward is not one."""
    import torch
    from memlab.core.models import GPT, GPTConfig
    from autograder.checks.ex04.run import _Recorder
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=1, n_embd=16, n_head=2, vocab_size=32, block_size=8))
    x = torch.randint(0, 32, (3, 8))
    rec = _Recorder(clone=False)
    with rec:
        torch.utils.checkpoint.checkpoint(model, x, x, use_reentrant=False).backward()
    assert rec.rows == 3
