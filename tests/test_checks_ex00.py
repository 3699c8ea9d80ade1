"""Exercise 00's own check tests (tests/test_checks.py runs every exercise's solution and wrong submissions):
the grader's references agree with independent counts, the hidden cases cover every branch, and the guards
against the tracker and memlab.hardware.hierarchy work."""

from __future__ import annotations

import random

import pytest
import torch

import memlab
from memlab.kit.ex00 import GPUS
from torch.utils.flop_counter import FlopCounterMode

from _nb import solution_namespace
from autograder.checks import ex00
from autograder.checks.ex00 import cases as ex00_cases, refs as ex00_refs, run as ex00_run
from autograder.checks.common import check
from submissions import ex00 as wrong


def _namespace(replace: dict[str, str] | None = None) -> dict:
    return solution_namespace("00_memory_hierarchy", replace)


def test_matmul_flops_agree_with_torch_flop_counter():
    for case in ex00_cases._cost_cases(True, random.Random(1)) + ex00_cases._cost_cases(False, random.Random(0)):
        if case["op"] != "matmul":
            continue
        a, b = (torch.empty(s, device="meta") for s in case["shapes"])
        with FlopCounterMode(display=False) as counter:
            out = a @ b
        flops, nbytes = ex00_refs._cost("matmul", case["shapes"], "float32")
        assert flops == counter.get_total_flops()
        assert nbytes == (a.numel() + b.numel() + out.numel()) * 4


def test_hidden_cases_cover_every_branch():
    r = random.Random(3)
    ops = {c["op"] for c in ex00_cases._cost_cases(True, r)}
    assert ops == {"matmul", "add", "mul", "relu", "softmax", "layer_norm"}
    roof = ex00_cases._roof_cases(True, r)
    peaks = {(c["gpu"], c["op"] == "matmul" and c["dtype"] in ex00_cases.gpu_spec(c)["tensor_flops"]) for c in roof}
    assert ("T4", False) in peaks and ("T4", True) in peaks and any(p for _, p in peaks)
    bounds = set()
    for c in roof:
        g = ex00_cases.gpu_spec(c)
        peak = ex00_refs._peak(g, c["op"], c["dtype"])
        bounds.add(c["flops"] / c["nbytes"] < peak / g["bandwidth"])
        if c["op"] == "matmul" and c["dtype"] in g["tensor_flops"] and c["flops"] / c["nbytes"] < peak / g["bandwidth"]:
            # a tensor-core op between the ridges: the vector ridge would call it compute-bound
            assert c["flops"] / c["nbytes"] > g["vector_flops"] / g["bandwidth"]
    assert bounds == {True, False}
    assert {c["warmup"] for c in ex00_cases._bw_cases(True, r)} == {1, 2, 3}


def test_storage_reference_on_many_random_chains():
    r = random.Random(7)
    for _ in range(40):
        case = ex00_cases._scase(r, ex00_cases._chain(r, [5, 7, 3]), [5, 7, 3])
        ex00_refs._new_storage_reference(case)          # raises if the tracker and the storage count disagree
    values = {ex00_refs._new_storage_reference(c) > 0 for c in ex00_cases._storage_cases(True, r)}
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
    with pytest.raises(AssertionError, match="memlab.hardware.hierarchy"):
        ex00_run._roof_run(ex00_cases._roof_cases(False, random.Random(0))[0], lambda *a: ns["roofline"](*a))


def test_gpu_figures_are_sane():
    for name, g in GPUS.items():
        assert g["source"] and g["bandwidth"] > 1e11 and g["vector_flops"] > 1e12
        assert all(v > g["vector_flops"] for v in g["tensor_flops"].values()), name
    assert "bfloat16" not in GPUS["T4"]["tensor_flops"]


def test_every_run_has_list_results():
    for seed in range(5):
        cases = ex00_cases._storage_cases(True, random.Random(seed))
        lists = [c for c in cases if isinstance(ex00_cases._storage_fn(c)(*ex00_cases._storage_inputs(c)), list)]
        assert {c["ops"][0] for c in lists} == {"pair_list", "clone_split_list"}
        assert {ex00_refs._new_storage_reference(c) > 0 for c in lists} == {True}
    visible = ex00_cases._storage_cases(False, random.Random(0))
    assert any(c["ops"] == ["pair_list"] for c in visible)


def test_copy_onto_shared_storage_is_recorded():
    src = torch.ones(1000, dtype=torch.uint8)
    rec = ex00_run._Recorder(0.0, 3, {})
    with rec:
        src.copy_(src)                  # no bytes move
        src[:].copy_(src)
        torch.empty_like(src).copy_(src)
    assert [e[2] for e in rec.events if e[0] == "copy"] == [True, True, False]


def test_every_run_covers_every_roofline_and_timing_branch():
    """Over many seeds (test_hidden_cases_cover_every_branch draws one): tensor-core matmuls below the tensor
    ridge but above the vector one, and above the tensor ridge; T4's bfloat16 and every float32 matmul on the
    vector peak; a 16-bit non-matmul on a GPU with tensor cores for its dtype; an odd and an even repeat count."""
    for seed in range(50):
        r = random.Random(seed)
        ops = {c["op"] for c in ex00_cases._cost_cases(True, r)}
        assert ops == {"matmul", "add", "mul", "relu", "softmax", "layer_norm"}
        kinds = set()
        made_up = set()
        for c in ex00_cases._roof_cases(True, r):
            g = ex00_cases.gpu_spec(c)
            if "spec" in c:
                assert c["gpu"] not in GPUS, "a made-up GPU is none of the presets"
                made_up.add(c["op"] == "matmul" and c["dtype"] in g["tensor_flops"])
            tensor = c["op"] == "matmul" and c["dtype"] in g["tensor_flops"]
            intensity, ridge = c["flops"] / c["nbytes"], ex00_refs._peak(g, c["op"], c["dtype"]) / g["bandwidth"]
            vec_ridge = g["vector_flops"] / g["bandwidth"]
            if tensor:
                kinds.add("tensor between" if vec_ridge < intensity < ridge else "tensor above" if intensity > ridge
                          else "tensor below")
            elif c["op"] == "matmul":
                kinds.add(f"vector matmul {c['dtype']}")
            elif c["dtype"] in g["tensor_flops"]:
                kinds.add("16-bit non-matmul with tensor cores")
        assert {"tensor between", "tensor above", "vector matmul bfloat16", "vector matmul float32",
                "16-bit non-matmul with tensor cores"} <= kinds, (seed, kinds)
        assert made_up == {True, False}, "a made-up GPU, with and without a tensor-core peak for the dtype"
        dtypes = {c["dtype"] for c in ex00_cases._cost_cases(True, random.Random(seed))}
        assert dtypes == set(ex00_cases.DTYPES), "every dtype in every run"
        repeats = {c["repeats"] % 2 for c in ex00_cases._bw_cases(True, r)}
        assert repeats == {0, 1}
