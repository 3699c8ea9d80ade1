"""Exercise 10's checks in-process: the references against independent computations (memlab's tracker replaying
the traces on real tensors, memlab.planning's own planner and bound, a search over every offset, the lesson's
separable block), the hidden draws covering every branch of each task in every run, the mistakes of
tests/submissions/ex10.py losing every hidden draw, and the guards (tests/test_checks.py runs the solution and
every submission once)."""

from __future__ import annotations

import functools
import itertools
import random

import pytest
import torch

import memlab.planning as P
from _nb import solution_namespace
from autograder.checks.common import check, decode, encode, hide
from autograder.checks.ex10 import TASKS
from autograder.checks.ex10 import cases as C
from autograder.checks.ex10 import refs as R
from memlab.kit import ex10 as kit
from submissions import ex10 as spec

ASSIGNMENT = "10_memory_planning"
L, PL, B = "task10_1_lifetimes", "task10_2_plan_offsets", "task10_3_separable_block"


def _random_lifetimes(r, n, span=8, sizes=(1, 2, 3, 4, 6), zeros=True):
    out = []
    for _ in range(n):
        b = r.randrange(span)
        out.append((0 if zeros and r.random() < 0.1 else r.choice(sizes), b, r.randint(b + 1, span)))
    return out


def _fails(task_id, names, cases) -> bool:
    """Whether some case fails (an AssertionError, or the submission's own code raising)."""
    task = TASKS[task_id]
    for case in cases:
        try:
            task.judge(case, decode(encode(task.run(case, **names))))
        except Exception:               # noqa: BLE001 - an AssertionError or a crash of the submission's code
            return True
    return False


# ----------------------------------------------------------------------------- task 10.1: references
def test_reference_lifetimes_and_bound_match_the_tracker_on_real_tensors():
    """Each hidden trace run on real tensors under memlab's tracker (kit.replay): the same storages, births and
    deaths, and the tracker's peak is the bound."""
    r = random.Random(0)
    for _ in range(15):
        events = C._trace(r, r.randint(24, 40))
        measured = kit.replay(events)
        assert R.storage_lifetimes(events) == measured.lifetimes
        assert R.live_peak(R.storage_lifetimes(events)) == measured.peak
    ex = kit.example_trace()
    assert R.storage_lifetimes(ex) == kit.replay(ex).lifetimes


def test_reference_bound_matches_memlab_and_counts_touching_tensors_apart():
    r = random.Random(1)
    for _ in range(300):
        lts = _random_lifetimes(r, r.randint(0, 12))
        assert R.live_peak(lts) == P.live_bytes_peak(lts)
    assert R.live_peak([(5, 0, 2), (7, 2, 4)]) == 7 and R.live_peak([]) == 0


def test_lifetime_draws_cover_every_branch_in_every_run():
    for seed in range(150):
        cases = TASKS[L].cases(True, random.Random(seed))
        traces = [c["events"] for c in cases if "events" in c]
        lists = [c["intervals"] for c in cases if "intervals" in c]
        assert traces and all(C.coverage(t) >= set(C.COVERAGE) for t in traces)
        for events in traces:
            lts = R.storage_lifetimes(events)
            assert lts[0][1] == 0 and lts[0][2] == len(events), "the first storage lives through the whole trace"
            kit.check_trace(events)
        assert [] in lists
        for lts in filter(None, lists):
            peak = R.live_peak(lts)
            assert C._closed_peak(lts) > peak and C._in_list_order(lts) != peak
            assert sum(s for s, _, _ in lts) > peak and any(s == 0 for s, _, _ in lts)


@pytest.mark.parametrize("name", [n for n, w in spec.WRONG.items() if L in w["replace"]])
def test_lifetime_mistakes_lose_every_hidden_run(name):
    ns = solution_namespace(ASSIGNMENT, spec.WRONG[name]["replace"])
    names = {n: ns[n] for n in TASKS[L].names}
    for seed in range(40):
        assert _fails(L, names, TASKS[L].cases(True, random.Random(seed))), f"{name} passed draw {seed}"


# ----------------------------------------------------------------------------- task 10.2: references
def _grid_optimum(lts, a):
    """The smallest arena over EVERY assignment of aligned offsets up to the stacked arena (tiny traces only)."""
    top = sum(-(-s // a) * a for s, _, _ in lts)
    choices = range(0, top + 1, a)
    best = top
    for offs in itertools.product(choices, repeat=len(lts)):
        if not R.overlapping_pairs(lts, list(offs)):
            best = min(best, R.arena_of(lts, list(offs)))
    return best


def test_reference_optimum_is_exact_and_between_the_bound_and_every_heuristic():
    r = random.Random(2)
    for _ in range(150):
        lts = _random_lifetimes(r, r.randint(1, 7))
        best = R.optimum(lts)
        assert best == P.arena_size(lts, P.optimal_offsets(lts))           # memlab's branch and bound
        assert R.live_peak(lts) <= best <= min(P.arena_size(lts, P.greedy_by_size(lts)),
                                               P.arena_size(lts, P.first_fit(lts)))
    for _ in range(25):                                                     # every offset tried, aligned too
        a = r.choice((1, 2, 4))
        lts = _random_lifetimes(r, r.randint(1, 4), span=5, sizes=(1, 2, 3, 5), zeros=False)
        assert R.optimum(lts, a) == _grid_optimum(lts, a)
    assert R.optimum(C.HAND) == 6 and R.optimum([]) == 0


def test_reference_overlaps_match_memlab_plan_conflicts():
    r = random.Random(3)
    for _ in range(200):
        lts = _random_lifetimes(r, r.randint(0, 10))
        offsets = [r.randrange(8) for _ in lts]
        assert R.overlapping_pairs(lts, offsets) == P.plan_conflicts(lts, offsets)


@functools.lru_cache(maxsize=None)
def _small_draws(n: int = 8) -> list[list[dict]]:
    """The small traces of n hidden draws of task 10.2 (one of each family per draw), drawn once for the tests."""
    out = []
    for seed in range(n):
        r = random.Random(seed)
        out.append([C._crafted(r, f) for f in ("whole", "touching", "aligned")])
    return out


def test_small_plan_draws_hold_what_the_task_text_promises():
    """Every family of small traces: largest first reaches the exhaustive optimum, order of birth does not;
    touching tensors must share bytes; the aligned sizes are not multiples of the alignment; empty tensors and a
    tensor alive from first to last are there."""
    for draw in _small_draws():
        for family, case in zip(("whole", "touching", "aligned"), draw):
            assert case["family"] == family
            lts, a = [tuple(lt) for lt in case["lifetimes"]], case["alignment"]
            best = R.optimum(lts, a)
            full = [lt for lt in lts if lt[0]]                 # empty tensors take no bytes and clash with nothing
            assert C._largest_first(full, a) == {best} and min(C._birth_order(full, a)) > best
            assert any(s == 0 for s, _, _ in lts) and R.optimum(full, a) == best
            if family == "touching":
                assert min(C._largest_first(full, a, closed=True)) > best
                assert any(x[2] == y[1] for x in lts for y in lts if x[0] and y[0])
            if family == "aligned":
                assert a > 1 and any(s % a for s, _, _ in lts)
            if family == "whole":
                start, end = min(b for s, b, _ in lts if s), max(d for s, _, d in lts if s)
                assert any(s and b == start and d == end for s, b, d in lts)
            if a == 1:
                assert best == P.arena_size(lts, P.optimal_offsets(lts))


def test_plan_draws_have_every_kind_in_every_run():
    for seed in range(3):
        got = TASKS[PL].cases(True, random.Random(seed))
        assert [c["kind"] for c in got] == ["small", "small", "small", "random", "large", "empty"]
        large = got[4]["lifetimes"]
        assert len(large) > 20 and R.live_peak(large) < sum(s for s, _, _ in large)


@pytest.mark.parametrize("name", ["plan_ignores_lifetimes", "plan_in_order_of_birth", "plan_closed_intervals",
                                  "plan_misses_earlier_tensors", "plan_ignores_alignment"])
def test_planner_mistakes_lose_every_draw_of_small_traces(name):
    """The small traces alone (the recorded step and the empty trace left out) catch each mistake, every draw."""
    ns = solution_namespace(ASSIGNMENT, spec.WRONG[name]["replace"])
    for seed, small in enumerate(_small_draws()):
        assert _fails(PL, {"plan_offsets": ns["plan_offsets"]}, small), f"{name} passed draw {seed}"


def test_planner_runs_off_limits_and_reports_too_slow():
    def uses_memlab(lifetimes, alignment):
        return P.greedy_by_size(lifetimes), 0
    with pytest.raises(AssertionError, match="off limits"):
        check(TASKS[PL], plan_offsets=uses_memlab)
    msg = ""
    try:
        TASKS[PL].judge({"kind": "small", "lifetimes": [(1, 0, 1)], "alignment": 1}, {"too_slow": 20})
    except AssertionError as e:
        msg = str(e)
    assert "20 s" in msg


# ----------------------------------------------------------------------------- task 10.3: references
def test_reference_block_is_the_lessons_block_and_meta_measures_like_the_cpu():
    case = {"c_in": 8, "c_out": 16, "stride": 2, "side": 11, "batch": 2, "seed": 5}
    ref = R.reference_block(case)
    from autograder.checks.ex10.inputs import block_batch, conv_filters, fingerprint
    lesson = P.SeparableBlock(8, 16, 2)                                     # nn modules, memlab's own
    dw, pw = conv_filters(case)
    with torch.no_grad():
        lesson[0][0].weight.copy_(dw)
        lesson[1][0].weight.copy_(pw)
    x, w = block_batch(case)
    out = lesson(x)
    (out * w).sum().backward()
    assert all(abs(g - e) <= 1e-4 * (abs(e) + 1) for g, e in zip(fingerprint(out), ref["out"]))
    assert all(abs(g - e) <= 1e-4 * (abs(e) + 1) for g, e in zip(fingerprint(x.grad), ref["x_grad"]))
    assert ref["param_bytes"] == sum(p.nbytes for p in lesson.parameters()) == 4 * (9 * 8 + 8 * 16 + 2 * 24)
    assert R.reference_kept_meta(case)["kept"] == ref["kept"]
    side = 6                                                                # ceil(11 / 2)
    assert ref["kept"] == 4 * 2 * side * side * 2 * (8 + 16) + 8 * (8 + 16) + 4   # four tensors, statistics, loss


def test_block_draws_cover_every_branch_in_every_run():
    for seed in range(300):
        got = TASKS[B].cases(True, random.Random(seed))
        run = [c for c in got if not c.get("predict_only")]
        assert {c["stride"] for c in run} >= {1, 2}
        assert any(c["stride"] == 2 and c["side"] % 2 for c in run)
        assert any(c["c_in"] < c["c_out"] for c in run) and any(c["c_in"] > c["c_out"] for c in run)
        assert all(c["batch"] * ((c["side"] - 1) // c["stride"] + 1) ** 2 > 1 for c in run)   # batch norm needs 2
        big = [c for c in got if c.get("predict_only")]
        assert len(big) == 1 and big[0]["side"] % 2 and big[0]["stride"] == 2


def test_block_bytes_may_not_run_torch_and_the_block_may_not_be_the_lessons():
    ns = solution_namespace(ASSIGNMENT)

    def measures(c_in, c_out, side, batch, stride):
        with torch.device("meta"):
            block = ns["SeparableBlock"](c_in, c_out, stride)
        return sum(p.nbytes for p in block.parameters()), 0
    with pytest.raises(AssertionError, match="PREDICT"):
        check(TASKS[B], SeparableBlock=ns["SeparableBlock"], block_bytes=measures)
    with pytest.raises(AssertionError, match="off limits"):
        check(TASKS[B], SeparableBlock=P.SeparableBlock, block_bytes=ns["block_bytes"])


# ----------------------------------------------------------------------------- hidden feedback
def test_hidden_messages_hide_the_expected_values():
    ns = solution_namespace(ASSIGNMENT, spec.WRONG["death_one_late"]["replace"])
    task = TASKS[L]
    case = task.cases(True, random.Random(0))[0]
    want = R.storage_lifetimes([tuple(e) for e in case["events"]])
    with pytest.raises(AssertionError) as e:
        task.judge(case, decode(encode(task.run(case, **{n: ns[n] for n in task.names}))))
    shown = hide(str(e.value))
    assert "[hidden]" in shown and "One too late" in shown
    bad = next(w for w, g in zip(want, ns["tensor_lifetimes"]([tuple(x) for x in case["events"]])) if w != g)
    assert f"expected {bad[2]}" not in shown


# ----------------------------------------------------------------------------- the kit
def test_kit_refuses_invalid_traces_naming_the_event():
    for bad, match in (([("alloc", 1, 10, -4)], r"events\[0\]"), ([("view", 1, 10)], r"events\[0\] views storage"),
                       ([("alloc", 1, 10, 4), ("alloc", 1, 11, 4)], r"events\[1\] makes tensor 1"),
                       ([("alloc", 1, 10, 4), ("alloc", 2, 10, 4)], r"events\[1\] allocates storage 10"),
                       ([("free", 3)], r"events\[0\] names tensor 3"), ([("copy", 1)], r"events\[0\] must be")):
        with pytest.raises(ValueError, match=match):
            kit.replay(bad)
    with pytest.raises(TypeError, match="events must be a list"):
        kit.replay("alloc")
    assert kit.replay([]) == kit.Replayed([], 0)
