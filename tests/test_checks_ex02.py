"""Exercise 02's checks, called directly (no nbgrader): the reference solution
passes every check, and every plausible-wrong submission fails the checks of
its task with an AssertionError that teaches (not a crash), within seconds."""

from __future__ import annotations

import nbformat
import pytest
import torch

from _nb import ROOT, grade_id, is_solution, solved_code
from autograder.checks import ex02
from submissions import ex02 as wrong

NAMES = {"task2_1_checkpoint_every_k": ["CheckpointEveryK"],
         "task2_2_sqrt_segments": ["sqrt_segments", "SqrtCheckpointed"],
         "task2_3_plan_checkpoints": ["plan_checkpoints"],
         "task2_4_checkpointed_gpt": ["CheckpointedGPT"]}
CHECKS = {"task2_1_checkpoint_every_k": ex02.check_task2_1, "task2_2_sqrt_segments": ex02.check_task2_2,
          "task2_3_plan_checkpoints": ex02.check_task2_3, "task2_4_checkpointed_gpt": ex02.check_task2_4}

NB = nbformat.read(ROOT / "solutions" / wrong.ASSIGNMENT / f"{wrong.ASSIGNMENT}.ipynb", as_version=4)
REFERENCE = {grade_id(c): solved_code(c.source) for c in NB.cells if is_solution(c)}
# the locked code cells a learner's solution may rely on (imports, the cost model), minus the device report and
# the notebook's thread setting (a test must not change the process it runs in)
GIVEN = [c.source for c in NB.cells if c.cell_type == "code" and not is_solution(c)
         and not c.metadata.get("nbgrader", {}).get("grade")
         and grade_id(c) in ("setup", "task2_3_model")]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread is as fast, and far steadier when other jobs share the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _define(code: str, task: str) -> list:
    ns: dict = {}
    for src in GIVEN:
        src = src.replace("print(memlab.describe(device))", "").replace("torch.set_num_threads(1)", "")
        exec(compile(src, "<given>", "exec"), ns)
    exec(compile(code, f"<{task}>", "exec"), ns)
    return [ns[name] for name in NAMES[task]]


def test_solution_has_one_cell_per_task():
    assert set(REFERENCE) == set(NAMES)


@pytest.mark.parametrize("task", sorted(NAMES))
@pytest.mark.parametrize("hidden", [False, True])
def test_reference_passes(task, hidden):
    CHECKS[task](*_define(REFERENCE[task], task), hidden=hidden)


WRONG_CASES = [(name, task, code, spec["must_lose"]) for name, spec in wrong.WRONG.items()
               for task, code in spec["replace"].items()]


@pytest.mark.parametrize("name,task,code,must_lose", WRONG_CASES, ids=[c[0] for c in WRONG_CASES])
def test_wrong_submission_fails_its_checks(name, task, code, must_lose):
    fns = _define(code, task)
    for hidden in (False, True):
        if f"{task}_{'hidden' if hidden else 'visible'}" not in must_lose:
            CHECKS[task](*fns, hidden=hidden)          # must keep these points
            continue
        with pytest.raises(AssertionError) as info:
            CHECKS[task](*fns, hidden=hidden)
        assert len(str(info.value)) > 40, f"{name}: the failure message should teach, got {info.value!r}"


def test_reference_planner_matches_brute_force():
    import random
    r = random.Random(0)
    for _ in range(300):
        n = r.randint(0, 8)
        m = [r.randint(1, 40) for _ in range(n)]
        c = [r.randint(0, 9) for _ in range(n)]
        budget = r.randint(0, sum(m) + 3)
        want, _ = ex02.brute_force_plan(m, c, budget)
        if want is None:
            with pytest.raises(ValueError):
                ex02.reference_plan(m, c, budget)
        else:
            keep = ex02.reference_plan(m, c, budget)
            assert ex02.plan_peak(m, keep) <= budget and ex02.plan_cost(c, keep) == want


def test_segments_reference():
    assert ex02.reference_segments(10) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert ex02.reference_segments(1) == [(0, 1)]
    assert len(ex02.reference_segments(64)) == 8


# ----------------------------------------------------------------------------- the memlab helpers the checks use
def test_activation_peak_measures_a_block_and_restores_grads():
    from memlab.checkpointing import activation_peak, block_stack
    stack = block_stack(1, d=16)
    stack[0].fc1.weight.grad = torch.ones_like(stack[0].fc1.weight)
    x = torch.randn(8, 16)
    m = activation_peak(stack, lambda: stack(x * 1.0).sum())
    u = 8 * 16 * 4
    # a residual MLP block (hidden 4d) keeps its input, GELU's input and W2's input: 9u; plus the 4-byte loss
    assert m.stored == 9 * u + 4
    assert m.peak >= m.stored and m.peak_phase in ("forward", "backward")
    assert torch.equal(stack[0].fc1.weight.grad, torch.ones_like(stack[0].fc1.weight))
    assert stack[0].fc2.weight.grad is None
    with pytest.raises(TypeError):
        activation_peak(stack, lambda: stack(x))              # not a scalar loss


def test_forward_counter_sees_recomputation_and_restores_forward():
    from torch.utils.checkpoint import checkpoint
    from memlab.checkpointing import ForwardCounter, block_stack
    stack = block_stack(3, d=8)
    x = torch.randn(4, 8, requires_grad=True)
    with ForwardCounter(stack) as counter:
        h = x
        for i, b in enumerate(stack):
            h = checkpoint(b, h, use_reentrant=False) if i != 1 else b(h)
        h.sum().backward()
        assert counter.counts == [2, 1, 2]
    assert all("forward" not in b.__dict__ for b in stack)
    with ForwardCounter([stack]) as whole:                    # a Sequential counted as one module
        stack(x)
        assert whole.counts == [1]
    with pytest.raises(TypeError):
        ForwardCounter(42)


def test_chen_segment_peak():
    from memlab.estimate import chen_segment_peak
    assert chen_segment_peak(16, 16, 1, 9, checkpoint_last=False) == 16 * 9      # no checkpointing
    assert chen_segment_peak(16, 1, 1, 9) == 16 + 9                              # every layer: O(N)
    assert chen_segment_peak(16, 4, 1, 1) == 8                                   # sqrt(N) with a = u: 2 sqrt(N)
    for bad in ((0, 1, 1, 1), (4, 5, 1, 1), (4, 2, -1, 1)):
        with pytest.raises(ValueError):
            chen_segment_peak(*bad)
