"""Fast tests of exercise 00's checks (autograder/checks/ex00.py), without nbgrader: the source notebook's
solutions pass every check, each plausible-wrong submission of tests/submissions/ex00.py fails the checks
of the cells it must lose, and the grader's references agree with independent counts."""

from __future__ import annotations

import random

import nbformat
import pytest
import torch

import memlab
from torch.utils.flop_counter import FlopCounterMode

from _nb import ROOT, grade_id, is_solution, solution_namespace
from autograder.checks import ex00
from autograder.checks.common import check
from submissions import ex00 as wrong

SOURCE = ROOT / "solutions" / "00_memory_hierarchy" / "00_memory_hierarchy.ipynb"
NAMES = {"task0_1_op_cost": "op_cost", "task0_2_roofline": "roofline", "task0_3_copy_bandwidth": "copy_bandwidth",
         "task0_4_new_storage_bytes": "new_storage_bytes"}


def _namespace(replace: dict[str, str] | None = None) -> dict:
    return solution_namespace(SOURCE, replace)


def _passes(task_id: str, ns: dict, hidden: bool) -> bool:
    try:
        check(ex00.TASKS[task_id], hidden=hidden, **{NAMES[task_id]: ns[NAMES[task_id]]})
    except (AssertionError, TypeError, ValueError, RuntimeError, KeyError):
        return False
    return True


def test_every_task_has_a_check():
    ids = {grade_id(c) for c in nbformat.read(SOURCE, as_version=4).cells if is_solution(c)}
    assert ids == set(NAMES) == set(ex00.TASKS)


@pytest.mark.parametrize("task_id", [t for t in NAMES if t != "task0_3_copy_bandwidth"])
def test_reference_solutions_pass(task_id):
    ns = _namespace()
    for hidden in (False, True):
        check(ex00.TASKS[task_id], hidden=hidden, **{NAMES[task_id]: ns[NAMES[task_id]]})


@pytest.mark.slow
def test_reference_bandwidth_passes():
    ns = _namespace()
    for hidden in (False, True):
        check(ex00.TASKS["task0_3_copy_bandwidth"], hidden=hidden, copy_bandwidth=ns["copy_bandwidth"])


def _cells(name):
    return [(g.rsplit("_", 1)[0], g.endswith("_hidden")) for g in wrong.WRONG[name]["must_lose"]]


FAST_WRONG = [n for n, w in wrong.WRONG.items() if not any("copy_bandwidth" in g for g in w["must_lose"])]
SLOW_WRONG = [n for n in wrong.WRONG if n not in FAST_WRONG]


def _loses(name):
    ns = _namespace(wrong.WRONG[name]["replace"])
    for task_id, hidden in _cells(name):
        assert not _passes(task_id, ns, hidden), f"{name} passed {task_id} (hidden={hidden})"


@pytest.mark.parametrize("name", FAST_WRONG)
def test_wrong_submission_loses(name):
    _loses(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_WRONG)
def test_wrong_benchmark_loses(name):
    _loses(name)


def test_matmul_flops_agree_with_torch_flop_counter():
    for case in ex00._cost_cases(True, random.Random(1)) + ex00._cost_cases(False, random.Random(0)):
        if case["op"] != "matmul":
            continue
        a, b = (torch.empty(s, device="meta") for s in case["shapes"])
        with FlopCounterMode(display=False) as counter:
            out = a @ b
        flops, nbytes = ex00._cost("matmul", case["shapes"], "float32")
        assert flops == counter.get_total_flops()
        assert nbytes == (a.numel() + b.numel() + out.numel()) * 4


def test_hidden_cases_cover_every_branch():
    r = random.Random(3)
    ops = {c["op"] for c in ex00._cost_cases(True, r)}
    assert ops == {"matmul", "add", "mul", "relu", "softmax", "layer_norm"}
    roof = ex00._roof_cases(True, r)
    peaks = {(c["gpu"], c["op"] == "matmul" and c["dtype"] in ex00.GPUS[c["gpu"]]["tensor_flops"]) for c in roof}
    assert ("T4", False) in peaks and ("T4", True) in peaks and any(p for _, p in peaks)
    bounds = set()
    for c in roof:
        g = ex00.GPUS[c["gpu"]]
        peak = ex00._peak(g, c["op"], c["dtype"])
        bounds.add(c["flops"] / c["nbytes"] < peak / g["bandwidth"])
        if c["op"] == "matmul" and c["dtype"] in g["tensor_flops"] and c["flops"] / c["nbytes"] < peak / g["bandwidth"]:
            # a tensor-core op between the ridges: the vector ridge would call it compute-bound
            assert c["flops"] / c["nbytes"] > g["vector_flops"] / g["bandwidth"]
    assert bounds == {True, False}
    assert {c["warmup"] for c in ex00._bw_cases(True, r)} == {1, 2, 3}


def test_storage_reference_on_many_random_chains():
    r = random.Random(7)
    for _ in range(40):
        case = ex00._scase(r, ex00._chain(r, [5, 7, 3]), [5, 7, 3])
        ex00._new_storage_reference(case)          # raises if the tracker and the storage count disagree
    values = {ex00._new_storage_reference(c) > 0 for c in ex00._storage_cases(True, r)}
    assert values == {True, False}


def test_tracker_is_refused_and_restored():
    enter = memlab.MemoryTracker.__enter__
    with pytest.raises(AssertionError, match="off limits"):
        check(ex00.TASKS["task0_4_new_storage_bytes"], hidden=False,
              new_storage_bytes=_namespace(wrong.WRONG["uses_the_tracker"]["replace"])["new_storage_bytes"])
    assert memlab.MemoryTracker.__enter__ is enter


def test_calls_into_memlab_hierarchy_are_detected(monkeypatch, tmp_path):
    fake = tmp_path / "memlab" / "hardware" / "hierarchy.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def roofline(*a):\n    return {}\n")
    ns: dict = {}
    exec(compile(fake.read_text(), str(fake), "exec"), ns)
    with pytest.raises(AssertionError, match="memlab.hierarchy"):
        ex00._roof_run(ex00._roof_cases(False, random.Random(0))[0], lambda *a: ns["roofline"](*a))


def test_gpu_figures_are_sane():
    for name, g in ex00.GPUS.items():
        assert g["source"] and g["bandwidth"] > 1e11 and g["vector_flops"] > 1e12
        assert all(v > g["vector_flops"] for v in g["tensor_flops"].values()), name
    assert "bfloat16" not in ex00.GPUS["T4"]["tensor_flops"]
