"""Exercise 09's checks in-process: the references against the libraries they stand for (the shard layout and
gradients of torch's ColwiseParallel / RowwiseParallel on real ranks, the schedule walk against torch's own
pipeline order and against a measured torch.distributed.pipelining run), branch coverage of the hidden cases,
the off-limits guard, the kit's demo, and every submission of tests/submissions/ex09.py judged cell by cell
(tests/test_checks.py does the same for every registered exercise)."""

from __future__ import annotations

import random
import traceback

import pytest
import torch

from autograder.checks.common import check, decode, encode
from autograder.checks.ex09 import TASKS, cases as ex09_cases, refs as ex09_refs, run as ex09_run
from memlab.sharding.comm import CommCounter
from memlab.kit import ex09 as kit09

ASSIGNMENT = "09_parallelism"


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


# ----------------------------------------------------------------------------- the layout is torch's
def _torch_tp(run):
    """fn(rank, world) for run_ranks: the unsharded MLP parallelized by torch (ColwiseParallel, RowwiseParallel)
    on all ranks; its local shards, output, local gradients and forward traffic."""
    def fn(rank, world):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        model = kit09.unsharded_mlp(run)
        parallelize_module(model, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        x, gy = kit09.mlp_data(run)
        comm = CommCounter()
        with comm:
            y = model(x)
        y = y.full_tensor() if hasattr(y, "full_tensor") else y
        (y * gy).sum().backward()
        names = ("w1", "b1", "w2", "b2")
        return {"local": {k: p.to_local().reshape(-1).tolist() for k, p in zip(names, model.parameters())},
                "grads": {k: p.grad.to_local().reshape(-1).tolist() for k, p in zip(names, model.parameters())},
                "y": y.detach().reshape(-1).tolist(), "comm": comm.as_dict()}
    return fn


@pytest.mark.parametrize("world", [2, 4])
def test_the_reference_layout_and_gradients_are_torchs_tensor_parallelism(world):
    """refs.torch_shard cuts the tensors as parallelize_module's ColwiseParallel / RowwiseParallel place them;
    torch's TP MLP gives every rank the unsharded output and, for its local shards, the matching slice of the
    unsharded gradient (the spec of task 9.2); its forward is one all-reduce of the (B, T, d) output."""
    run = {"seed": 5, "batch": 2, "seq": 3, "d": 7, "hidden": 28}
    got = kit09.run_ranks(world, _torch_tp(run))
    full = kit09.mlp_weights(run)
    want_y, want_grads = ex09_refs.tp_reference(run, 0)
    for r, g in enumerate(got):
        for k, dim in ex09_refs.TP_DIMS.items():
            assert torch.equal(torch.tensor(g["local"][k]), ex09_refs.torch_shard(full[k], dim, r, world).reshape(-1))
            torch.testing.assert_close(torch.tensor(g["grads"][k]),
                                       ex09_refs.torch_shard(want_grads[k], dim, r, world).reshape(-1),
                                       rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(torch.tensor(g["y"]), want_y.reshape(-1), rtol=1e-4, atol=1e-5)
        assert g["comm"] == {"all_reduce": {"calls": 1, "bytes": 2 * 3 * 7 * 4,
                                            "sent": round(2 * (world - 1) / world * 2 * 3 * 7 * 4)}}


def test_the_row_parallel_input_is_what_a_column_parallel_layer_leaves():
    # small integers: every product and sum is exact in fp32, so the full matmul and the shards' smaller ones agree
    # bit for bit whatever order the kernel adds in (with random floats a differently blocked matmul differs in the
    # last bits on some CPUs)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-4, 5, (3, 8), generator=g).float()
    w = torch.randint(-4, 5, (6, 8), generator=g).float()
    col_out = [torch.nn.functional.linear(x, ex09_refs.torch_shard(w, 0, r, 2)) for r in range(2)]
    full = torch.nn.functional.linear(x, w)
    for r in range(2):
        assert torch.equal(ex09_refs.row_input(full, r, 2), col_out[r])


# ----------------------------------------------------------------------------- the schedule walk
def _torch_order_in_flight(schedule, stages, microbatches):
    """Peak in-flight micro-batches per stage in torch's own schedule IR (`_get_pipeline_order`), built without
    a stage or a process group (only the stage and micro-batch counts are read)."""
    from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe, _ComputationType
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = object.__new__(cls)
    sched._num_stages, sched._n_microbatches = stages, microbatches
    peaks = []
    for rank, actions in sorted(cls._get_pipeline_order(sched).items()):
        live = peak = 0
        for a in actions:
            if a is None:
                continue
            if a.computation_type == _ComputationType.FORWARD:
                live += 1
            elif a.computation_type == _ComputationType.FULL_BACKWARD:
                live -= 1
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_schedule_walk_matches_torchs_pipeline_order(schedule):
    for stages in range(2, 7):
        for microbatches in range(stages, 3 * stages + 1):
            assert ex09_refs.in_flight(schedule, stages, microbatches) == \
                _torch_order_in_flight(schedule, stages, microbatches), (stages, microbatches)


def test_the_schedule_walk_with_fewer_microbatches_than_stages():
    """Where torch's Schedule1F1B refuses (m < p), Megatron-LM's warm-up of min(p - s - 1, m) leaves every
    micro-batch in flight on the stages that cannot finish their warm-up."""
    assert ex09_refs.in_flight("1f1b", 4, 2) == [2, 2, 2, 1]
    assert ex09_refs.in_flight("1f1b", 5, 1) == [1] * 5
    assert ex09_refs.in_flight("gpipe", 6, 3) == [3] * 6
    assert ex09_refs.reference_pipeline_bytes("1f1b", 4, 8, 4 * 1000) == [4000, 3000, 2000, 1000]


@pytest.mark.parametrize("schedule,microbatches,stages", [("gpipe", 1, 2), ("gpipe", 3, 2), ("1f1b", 2, 2),
                                                          ("1f1b", 5, 2), ("1f1b", 4, 4), ("gpipe", 2, 4)])
def test_the_schedule_walk_matches_a_measured_pipeline(schedule, microbatches, stages):
    """torch.distributed.pipelining on real gloo ranks: every stage's peak of saved activations is the walk's
    in-flight count times one micro-batch's saved bytes; memlab's tracker sees at least that much."""
    per_mb = kit09.saved_bytes_per_microbatch()
    assert per_mb == kit09.saved_bytes_per_microbatch(1) > 0
    measured = kit09.measure_pipeline(schedule, microbatches, stages)
    walk = ex09_refs.in_flight(schedule, stages, microbatches)
    assert [m["saved_peak"] for m in measured] == [n * per_mb for n in walk]
    assert all(m["tracker_peak"] >= m["saved_peak"] for m in measured)


def test_measure_pipeline_checks_its_arguments():
    with pytest.raises(ValueError, match="schedule"):
        kit09.measure_pipeline("interleaved", 4)
    with pytest.raises(ValueError, match="microbatches"):
        kit09.measure_pipeline("1f1b", 1)
    with pytest.raises(ValueError, match="stages"):
        kit09.measure_pipeline("gpipe", 2, stages=1)


# ----------------------------------------------------------------------------- hidden cases cover every branch
def test_shard_cases_cover_every_branch_in_every_draw():
    for seed in range(50):
        cs = ex09_cases.shard_cases(True, random.Random(seed))
        valid = [c for c in cs if c["error"] is None]
        assert {(c["kind"], c["world"]) for c in valid} == {("column", 2), ("column", 4), ("row", 2), ("row", 4)}
        assert {(c["kind"], c["bias"]) for c in valid} == {("column", True), ("column", False), ("row", True),
                                                          ("row", False)}
        for c in valid:
            split, other = (c["out"], c["in"]) if c["kind"] == "column" else (c["in"], c["out"])
            assert split % c["world"] == 0 and other % c["world"] != 0
        uneven = [c for c in cs if c["error"] == "uneven"]
        assert {c["kind"] for c in uneven} == {"column", "row"}
        for c in uneven:
            assert (c["out"] if c["kind"] == "column" else c["in"]) % c["world"] != 0
        bad = [c for c in cs if c["error"] == "rank"]
        assert sorted(c["bad_rank"] - (0 if c["bad_rank"] < 0 else c["world"]) for c in bad) == [-1, 0], \
            "every run tries rank -1 and rank world_size"
        assert {c["bad_rank"] < 0 for c in bad} == {True, False}


def test_tp_cases_run_both_degrees_in_one_start_of_the_ranks():
    for seed in range(20):
        (case,) = ex09_cases.tp_cases(True, random.Random(seed))
        assert case["world"] == 4 and sorted(r["tp"] for r in case["runs"]) == [2, 4]
        for r in case["runs"]:
            assert r["hidden"] == 4 * r["d"] and r["hidden"] % r["tp"] == 0
    (visible,) = ex09_cases.tp_cases(False, random.Random(0))
    assert [r["tp"] for r in visible["runs"]] == [2], "the visible case has two groups side by side"


def test_pipe_cases_cover_every_branch_in_every_draw():
    for seed in range(50):
        cs = ex09_cases.pipe_cases(True, random.Random(seed))
        valid = [c for c in cs if c["error"] is None]
        assert {(c["schedule"], c["microbatches"] < c["stages"]) for c in valid} == {
            ("gpipe", True), ("gpipe", False), ("1f1b", True), ("1f1b", False)}
        for c in valid:
            assert c["bytes_per_microbatch"] % c["stages"] == 0
        errors = {c["error"]: c for c in cs if c["error"]}
        assert set(errors) == {"bytes_per_microbatch", "schedule"}
        assert errors["bytes_per_microbatch"]["bytes_per_microbatch"] % errors["bytes_per_microbatch"]["stages"]
        assert errors["schedule"]["bytes_per_microbatch"] % errors["schedule"]["stages"] == 0
        assert errors["schedule"]["schedule"] not in ex09_cases.SCHEDULES


# ----------------------------------------------------------------------------- guards and the kit
def test_no_shortcuts_catches_dtensor_and_pipelining():
    from torch.distributed.tensor.placement_types import Shard
    with pytest.raises(AssertionError, match="off limits"):
        with ex09_run.no_shortcuts("task9_1_shard_linear", "shard"):
            Shard(0)._split_tensor(torch.ones(4), 2)
    from torch.distributed.pipelining.schedules import ScheduleGPipe
    with pytest.raises(AssertionError, match="off limits"):
        with ex09_run.no_shortcuts("task9_3_pipeline_memory", "pipe"):
            sched = object.__new__(ScheduleGPipe)
            sched._num_stages, sched._n_microbatches = 2, 2
            ScheduleGPipe._get_pipeline_order(sched)
    with ex09_run.no_shortcuts("task9_3_pipeline_memory", "pipe"):
        torch.ones(3).sum()                                     # plain torch is fine


def test_linear_weights_are_the_same_whatever_the_global_rng():
    case = {"seed": 3, "out": 6, "in": 5, "bias": True, "rows": 2}
    a = kit09.linear_weights(case)
    torch.manual_seed(123)
    torch.randn(10)
    b = kit09.linear_weights(case)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert kit09.linear_weights(dict(case, bias=False))[1] is None


def test_show_tp_does_not_need_task_9_1(capsys):
    def broken(weight, bias, rank, world_size):
        raise NotImplementedError

    def wrong_shape(weight, bias, rank, world_size):
        return weight, bias

    def never(*args):
        raise AssertionError("the forward must not run without shards")

    assert kit09.show_tp(never, broken, broken) is None
    assert kit09.show_tp(never, wrong_shape, wrong_shape) is None
    assert capsys.readouterr().out.count("grader's own shards") == 2


# ----------------------------------------------------------------------------- the submissions, cell by cell
def _namespace(replace=None):
    from _nb import solution_namespace
    return solution_namespace(ASSIGNMENT, replace)


def _verdict(task_id, hidden, ns):
    """None if the cell passes; else the AssertionError's message, or the exception the learner's code raised."""
    task = TASKS[task_id]
    try:
        check(task, hidden=hidden, **{n: ns[n] for n in task.names})
    except AssertionError as e:
        return str(e)
    except Exception as e:                                     # noqa: BLE001 - a crash must come from the learner
        frames = traceback.extract_tb(e.__traceback__)
        assert type(e).__module__.startswith("memlab.kit") or any("/" not in f.filename for f in frames), (
            f"the check itself raised {type(e).__name__}: {e}")
        return f"{type(e).__name__}: {e}"
    return None


def _cells():
    from submissions import ex09 as spec
    out = []
    for kind in ("WRONG", "RIGHT"):
        for name, w in getattr(spec, kind).items():
            touched = {t for t, task in TASKS.items() if t in w["replace"]}
            for cell in [f"{t}_{k}" for t in sorted(touched) for k in ("visible", "hidden")]:
                slow = [pytest.mark.slow] if cell.startswith("task9_2") else []      # 4 forked ranks a cell
                out.append(pytest.param(kind, name, cell, cell in w.get("must_lose", []), id=f"{name}-{cell}",
                                        marks=slow))
    return out


@pytest.mark.parametrize("kind,name,cell,lose", _cells())
def test_submission_loses_exactly_its_cells(kind, name, cell, lose):
    from submissions import ex09 as spec
    w = getattr(spec, kind)[name]
    task_id, visibility = cell.rsplit("_", 1)
    verdict = _verdict(task_id, visibility == "hidden", _namespace(w["replace"]))
    if not lose:
        assert verdict is None, f"{name} lost {cell}, which it must keep: {verdict}"
        assert kind == "RIGHT" or cell in w["must_keep"], f"{name}: {cell} is in neither must_lose nor must_keep"
        return
    assert verdict is not None, f"{name} passed {cell}, which it must lose"
    assert len(verdict) >= 40 and "Traceback (most recent call last)" not in verdict, verdict


@pytest.mark.parametrize("name", ["row_bias_every_rank", "column_splits_weight_columns", "no_uneven_check",
                                  "views_alias_the_weight", "checks_both_dimensions", "no_rank_check",
                                  "forgets_to_divide", "one_f_one_b_as_gpipe", "warmup_only_off_by_one",
                                  "one_too_many", "ignores_few_microbatches", "stages_reversed", "no_bytes_check"])
def test_in_process_mistakes_lose_every_hidden_draw(name):
    """Each 9.1 and 9.3 mistake fails every hidden draw, not only most (these run in-process: cheap)."""
    from submissions import ex09 as spec
    w = spec.WRONG[name]
    ns = _namespace(w["replace"])
    (task_id,) = [t for t in w["replace"]]
    task = TASKS[task_id]
    for seed in range(40):
        lost = False
        for case in task.cases(True, random.Random(seed)):
            try:
                task.judge(case, decode(encode(task.run(case, **{n: ns[n] for n in task.names}))))
            except AssertionError:
                lost = True
                break
        assert lost, f"{name} passed hidden draw {seed}"


def test_the_solution_notebook_passes_every_cell():
    ns = _namespace()
    for task_id in TASKS:
        for hidden in (False, True):
            assert _verdict(task_id, hidden, ns) is None, (task_id, hidden)
