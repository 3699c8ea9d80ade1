"""Exercise 07's checks in-process. Every hidden draw covers the branches a mistake could hide in: left-skewed
and symmetric absmax values (7.2), a wide LoRA layer (7.3: A's initial scale, float32 tolerances over long sums),
tiny 7.4 cases whose smallest counted terms exceed the tolerance. Correct LoRA layers in other evaluation orders
pass every draw. Task 7.4's references: the activations measured on the virtual GPU from 1- and
2-layer cuts equal a full-depth run, the virtual GPU and real CPU tensors measure the same bytes, the
accounting of the task text (the solution) is within the tolerance of every measurement, and every hidden
draw covers both checkpointing branches (tests/test_checks.py runs every exercise's solution and wrong
submissions)."""

from __future__ import annotations

import random

import pytest

from _nb import solution_namespace
from autograder.checks.common import decode, encode
from autograder.checks.ex07 import cases as ex07_cases, judge as ex07_judge, refs, run as ex07_run


SMALL = {"hidden": 96, "intermediate": 200, "layers": 5, "heads": 6, "kv_heads": 2, "vocab": 211}


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", [False, True])
def test_two_layer_cuts_extend_to_a_full_depth_run(ckpt):
    import memlab
    cut = refs.measure_virtual(SMALL, 3, 2, 37, ckpt)
    full: dict = {}
    memlab.VirtualGPU(capacity_gb=2**20).run(refs.activation_step, SMALL, 3, 2, 37, ckpt, full)
    assert cut["kept"] == full["kept"]
    assert cut["recomputed"] == full["recomputed"]
    assert (full["recomputed"] > 0) == ckpt


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", [False, True])
def test_virtual_gpu_and_cpu_tensors_agree(ckpt):
    cfg = dict(SMALL, layers=2)
    cpu, virt = refs.measure_tiny(cfg, 2, 3, 11, ckpt), refs.measure_virtual(cfg, 2, 3, 11, ckpt)
    for k in ("kept", "recomputed"):     # the virtual GPU rounds each storage up to 512 bytes: at most about
        assert 0 <= virt[k] - cpu[k] <= 512 * (20 * cfg["layers"] + 10), (k, cpu, virt)   # 20 per layer


@pytest.mark.slow
def test_solution_within_tolerance_of_every_measurement():
    right = solution_namespace("07_qlora")["qlora_memory"]
    cases = ex07_cases.qlora_cases(True, random.Random(7))
    assert {(c["virtual"], c["checkpointing"]) for c in cases if not c["virtual"]} == {(False, False), (False, True)}
    assert {c["cfg"]["hidden"] for c in cases if c["virtual"]} == {4096, 5120}
    for c in cases:
        m = refs.measured_activations(c["cfg"], c["r"], c["batch"], c["seq"], c["checkpointing"], c["virtual"])
        got = right(dict(c["cfg"]), r=c["r"], batch=c["batch"], seq=c["seq"], checkpointing=c["checkpointing"])
        # the virtual GPU rounds each storage up to 512 bytes: at most about 20 per layer (as above)
        assert abs(got["activations"] - m["activations"]) <= ex07_judge.act_tol(c), (c, got["activations"], m)


def test_every_hidden_draw_has_left_skewed_and_symmetric_absmax():
    for seed in range(30):
        dq = [c for c in ex07_cases.dq_cases_list(True, random.Random(seed)) if c["what"] == "dq"]
        assert {c.get("skew", "right") for c in dq} == {"right", "left", "symmetric"}
        for c in dq:
            if c["skew"] != "left":
                continue
            y = ex07_cases.absmax_input(c).double()
            y = y - y.mean()
            for blk in y.split(ex07_cases.DQ_BLOCK):     # in every block the largest magnitude is below the mean
                assert blk.abs().max() > blk.max(), (seed, c)


def test_every_hidden_draw_has_a_wide_lora_case():
    for seed in range(30):
        cases = ex07_cases.lora_cases(True, random.Random(seed))
        assert any(c["r"] * c["d_in"] >= 2048 for c in cases)
        assert {c["dropout"] > 0 for c in cases} == {True, False} and {c["bias"] for c in cases} == {True, False}


def test_tiny_qlora_terms_exceed_the_tolerance_in_every_draw():
    for seed in range(200):
        for c in ex07_cases.qlora_cases(True, random.Random(seed)):
            if c["virtual"]:
                continue
            cfg, BT = c["cfg"], c["batch"] * c["seq"]
            lse = 4 * cfg["heads"] * BT * (1 if c["checkpointing"] else cfg["layers"])
            rope = 4 * c["seq"] * (cfg["hidden"] // cfg["heads"])
            # the measurement is up to 16 bytes above the text's count: a missing term must still fall outside
            assert min(lse, rope) > ex07_judge.TINY_TOL + 16, (c, lse, rope)


_ORDERS = {
    "solution": "return out + self.dropout(x) @ self.lora_A.T @ self.lora_B.T * self.scaling",
    "merged": "return out + self.dropout(x) @ (self.scaling * self.lora_B @ self.lora_A).T",
    "scaled_first": "return out + (self.scaling * self.dropout(x)) @ self.lora_A.T @ self.lora_B.T",
    "einsum": "return out + self.scaling * torch.einsum('...r,or->...o', "
              "torch.einsum('...i,ri->...r', self.dropout(x), self.lora_A), self.lora_B)",
}


@pytest.mark.slow          # 12 hidden draws of wide layers per order: minutes on 2 cores
@pytest.mark.parametrize("order", sorted(_ORDERS))
def test_lora_in_any_evaluation_order_passes_every_draw(order):
    from submissions.ex07 import LORA, S3
    code = LORA.replace(_ORDERS["solution"], _ORDERS[order])
    LoRALinear = solution_namespace("07_qlora", {S3: code})["LoRALinear"]
    task = __import__("autograder.checks.ex07", fromlist=["TASKS"]).TASKS[S3]
    for seed in range(12):
        for case in task.cases(True, random.Random(1000 + seed)):
            task.judge(case, decode(encode(ex07_run.lora_run(case, LoRALinear=LoRALinear))))


def test_lora_A_scale_is_checked_against_the_bound():
    from submissions.ex07 import LORA, S3
    code = LORA.replace("nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))", "nn.init.normal_(self.lora_A)")
    LoRALinear = solution_namespace("07_qlora", {S3: code})["LoRALinear"]
    task = __import__("autograder.checks.ex07", fromlist=["TASKS"]).TASKS[S3]
    wide = [c for c in task.cases(True, random.Random(5)) if c["d_in"] >= 2048][0]
    with pytest.raises(AssertionError, match="too large"):
        task.judge(wide, decode(encode(ex07_run.lora_run(wide, LoRALinear=LoRALinear))))


def test_every_hidden_draw_has_grouped_query_attention_and_full_heads():
    """kv_heads < heads in every tiny case (k_proj and v_proj narrower than q_proj), kv_heads == heads at full size:
    a count that ignores kv_heads, or that divides by it where it should not, loses every run."""
    for seed in range(200):
        cases = ex07_cases.qlora_cases(True, random.Random(seed))
        for c in cases:
            cfg = c["cfg"]
            assert cfg["heads"] % cfg["kv_heads"] == 0
            assert (cfg["kv_heads"] < cfg["heads"]) != c["virtual"], c
