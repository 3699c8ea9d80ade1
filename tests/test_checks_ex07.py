"""Exercise 07 task 7.4's references in-process: the activations measured on the virtual GPU from 1- and
2-layer cuts equal a full-depth run, the virtual GPU and real CPU tensors measure the same bytes, the
accounting of the task text (the solution) is within the tolerance of every measurement, and every hidden
draw covers both checkpointing branches (tests/test_checks.py runs every exercise's solution and wrong
submissions)."""

from __future__ import annotations

import random

import pytest

from _nb import solution_namespace
from autograder.checks.ex07 import cases as ex07_cases, refs

pytestmark = pytest.mark.slow

SMALL = {"hidden": 96, "intermediate": 200, "layers": 5, "heads": 6, "kv_heads": 2, "vocab": 211}


@pytest.mark.parametrize("ckpt", [False, True])
def test_two_layer_cuts_extend_to_a_full_depth_run(ckpt):
    import memlab
    cut = refs.measure_virtual(SMALL, 3, 2, 37, ckpt)
    full: dict = {}
    memlab.VirtualGPU(capacity_gb=2**20).run(refs.activation_step, SMALL, 3, 2, 37, ckpt, full)
    assert cut["kept"] == full["kept"]
    assert cut["recomputed"] == full["recomputed"]
    assert (full["recomputed"] > 0) == ckpt


@pytest.mark.parametrize("ckpt", [False, True])
def test_virtual_gpu_and_cpu_tensors_agree(ckpt):
    cfg = dict(SMALL, layers=2)
    cpu, virt = refs.measure_tiny(cfg, 2, 3, 11, ckpt), refs.measure_virtual(cfg, 2, 3, 11, ckpt)
    for k in ("kept", "recomputed"):     # the virtual GPU rounds each storage up to 512 bytes: at most about
        assert 0 <= virt[k] - cpu[k] <= 512 * (20 * cfg["layers"] + 10), (k, cpu, virt)   # 20 per layer


def test_solution_within_tolerance_of_every_measurement():
    right = solution_namespace("07_qlora")["qlora_memory"]
    cases = ex07_cases.qlora_cases(True, random.Random(7))
    assert {(c["virtual"], c["checkpointing"]) for c in cases if not c["virtual"]} == {(False, False), (False, True)}
    assert {c["cfg"]["hidden"] for c in cases if c["virtual"]} == {4096, 5120}
    for c in cases:
        m = refs.measured_activations(c["cfg"], c["r"], c["batch"], c["seq"], c["checkpointing"], c["virtual"])
        got = right(dict(c["cfg"]), r=c["r"], batch=c["batch"], seq=c["seq"], checkpointing=c["checkpointing"])
        # the virtual GPU rounds each storage up to 512 bytes: at most about 20 per layer (as above)
        tol = 512 * (20 * c["cfg"]["layers"] + 10) if c["virtual"] else 64
        assert abs(got["activations"] - m["activations"]) <= tol, (c, got["activations"], m)
