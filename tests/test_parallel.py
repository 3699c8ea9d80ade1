"""memlab.parallel: the formulas of lesson 09 checked against real ranks (tensor, sequence and pipeline
parallelism, ring attention, a 2-D mesh) and against the papers' closed forms, and every public function's input
checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from memlab.attention import LLAMA_SHAPES, naive_attention
from memlab.sharding import RankGroup
from memlab.parallel import (LINKS, PUBLISHED_LAYOUTS, Block, block_param_counts, bubble_fraction,
                             collective_seconds, in_flight_microbatches, korthikanti_layer_bytes, kv_head_split,
                             layer_activation_bytes, layout_bytes, link_bandwidth, merge_attention,
                             tp_comm_per_layer, tp_param_bytes, tp_plan)
from memlab.parallel import runs, schedules

ROOT = Path(__file__).resolve().parent.parent
PRELOAD = ("torch.distributed.tensor.parallel", "torch.distributed.pipelining", "memlab.parallel.runs",
           "memlab.parallel.schedules")
B, S, D, A = 2, 64, 128, 4                  # tp_run's defaults


@pytest.fixture(scope="module")
def ranks():
    with RankGroup(2, timeout=120, preload=PRELOAD) as g:
        yield g


# ----------------------------------------------------------------------------- measured on two ranks
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_block_matches_the_unsharded_block_and_the_formulas(ranks, sp):
    for r in ranks.run(runs.tp_run, sp):
        assert r["max_output_error"] < 1e-4 and r["max_grad_error"] < 1e-4, r
        assert r["param_bytes"] == tp_param_bytes(D, None, 2)
        assert r["activation_bytes"] == layer_activation_bytes(S, B, D, A, t=2, sequence_parallel=sp, e=4,
                                                               dropout=False, impl="pytorch")
        comm = tp_comm_per_layer(S, B, D, 2, sequence_parallel=sp, e=4)
        assert r["forward_comm"] == comm["forward"] and r["backward_comm"] == comm["backward"]
        assert r["ln_grad_placement"] == ("(Partial(sum),)" if sp else "a plain tensor")


def test_unsharded_block_keeps_what_the_formula_says():
    torch.manual_seed(0)
    from memlab.core.track import MemoryTracker, phase
    block, x = Block(D, A), torch.randn(B, S, D)
    with MemoryTracker(block) as tr:
        with phase("forward"):
            y = block(x)                          # kept alive: the output counts, as the next block's input
        kept = tr.breakdown()["activations"]
    assert y.shape == x.shape and kept == layer_activation_bytes(S, B, D, A, e=4, dropout=False, impl="pytorch")


@pytest.mark.parametrize("schedule, keep_outputs", [("gpipe", False), ("1f1b", False), ("1f1b", True)])
def test_pipeline_keeps_the_predicted_micro_batches(ranks, schedule, keep_outputs):
    m, mb = 4, 2
    out = ranks.run(runs.pp_run, schedule, m, mb, 32, 64, 4, 1, keep_outputs)
    one_output = mb * 32 * 64 * 4                 # one micro-batch's (mb, s, h) fp32 tensor
    for stage, r in enumerate(out):
        assert r["boundary_bytes"] == one_output
        want = in_flight_microbatches(schedule, 2, m, stage)
        # return_outputs=True: the last stage also keeps each micro-batch's output for step() to return
        extra = (m - 1) * one_output if (keep_outputs and stage == 1) else 0
        # at most one more boundary tensor: the gradient the first stage has received for its next backward
        assert max(r["kept"]) - want * r["per_micro_batch"] - extra in range(0, one_output + 1), r["kept"]
        assert r["comm"]["send"]["bytes"] == m * one_output and r["comm"]["recv"]["bytes"] == m * one_output
        assert 0 <= r["bubble"] < 1 and len(r["intervals"]) == 2 * m


@pytest.mark.parametrize("name, recompute", [("gpipe", True), ("interleaved-1f1b", False), ("zb-v", False)])
def test_torch_schedules_keep_what_their_order_implies(ranks, name, recompute):
    m, mb, s, d = 4, 2, 32, 64
    out = ranks.run(schedules.schedule_run, name, m, 4, mb, s, d, 4, recompute)
    orders = [r["order"] for r in out]
    played = schedules.timeline(orders, recompute=recompute)
    boundary = mb * s * d * 4                                     # one (mb, s, h) fp32 tensor
    for r, sim in zip(out, played["ranks"]):
        kinds = [k for k, _, _ in r["order"]]
        assert kinds.count("F") == m * len(r["stages"]) and 0 <= r["bubble"] < 1
        split = name.startswith("zb")           # zero bubble: every backward split into I and W, none whole
        assert ("I" in kinds and "W" in kinds) == split and ("B" in kinds) == (not split)
        if recompute:      # GPipe re-materialised: each micro-batch in flight keeps one boundary tensor
            assert r["peak_kept"] == m * boundary, r["actions"]
        else:              # the order's chunk-micro-batches in flight, plus tensors received for the next
            extra = r["peak_kept"] - sim["in_flight"] * r["chunk_bytes"]     # compute: <= 2 per chunk
            assert 0 <= extra <= 2 * len(r["stages"]) * boundary, (r["rank"], r["peak_kept"], sim["in_flight"])
    # played at the papers' unit costs: interleaving divides 1F1B's bubble (p-1)/m by v = 2
    if name == "interleaved-1f1b":
        assert all(x["idle_share"] == pytest.approx(bubble_fraction(2, m, chunks=2)) for x in played["ranks"])
    if name == "gpipe":
        assert all(x["idle_share"] == pytest.approx(bubble_fraction(2, m)) for x in played["ranks"])


def test_timeline_plays_the_papers_schedules():
    m = 4
    gpipe = [[("F", s, k) for k in range(m)] + [("B", s, k) for k in range(m)] for s in range(2)]
    one_f_one_b = [[("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ("F", 0, 3), ("B", 0, 2),
                    ("B", 0, 3)],
                   [x for k in range(m) for x in (("F", 1, k), ("B", 1, k))]]
    for order, flight in ((gpipe, [4, 4]), (one_f_one_b, [2, 1])):
        t = schedules.timeline(order)
        assert t["step"] == m * 3 + 3 and [r["in_flight"] for r in t["ranks"]] == flight
        assert all(r["idle_share"] == pytest.approx(bubble_fraction(2, m)) for r in t["ranks"])
    # GPipe re-materialised: each backward runs its forward again (cost 3), the bubble share stays (p-1)/(m+p-1)
    remat = schedules.timeline(gpipe, recompute=True)
    assert remat["step"] == m * 4 + 4 and remat["ranks"][0]["idle_share"] == pytest.approx(0.2)
    # measured durations replace the unit costs: the last stage's slow backward delays the first stage's
    slow = schedules.timeline(one_f_one_b, durations=[[1, 1, 2, 1, 2, 1, 2, 2], [1, 5] * m])
    assert slow["ranks"][1]["busy"] == 24 and slow["step"] > t["step"]


def test_ring_attention_equals_full_attention(ranks):
    for causal in (True, False):
        for r in ranks.run(runs.ring_attention_run, 1, 2, 64, 16, causal):
            assert r["max_error"] < 1e-5 and r["comm"]["send"]["calls"] == 1


# ----------------------------------------------------------------------------- formulas
def test_layer_formula_is_korthikanti_in_the_papers_setting():
    for s, b, h, a in ((2048, 4, 4096, 32), (4096, 1, 12288, 96)):
        for t in (1, 2, 8):
            for sp in (False, True):
                assert layer_activation_bytes(s, b, h, a, t=t, sequence_parallel=sp) == \
                    pytest.approx(korthikanti_layer_bytes(s, b, h, a, t, sp))
    terms = layer_activation_bytes(64, 2, 128, 4, t=2, sequence_parallel=True, impl="pytorch", terms=True)
    assert terms["qkv input (ln1 output)"] == 2 * 64 * 2 * 128           # PyTorch keeps the gathered input


def test_traffic_formula():
    ar, sp = tp_comm_per_layer(64, 2, 128, 4), tp_comm_per_layer(64, 2, 128, 4, sequence_parallel=True)
    assert ar["sent_per_step"] == sp["sent_per_step"] == 4 * 2 * 3 / 4 * 2 * 64 * 2 * 128
    assert ar["forward"]["all_reduce"]["calls"] == 2 and sp["backward"]["all_gather"]["calls"] == 2


def test_pipeline_formulas():
    assert bubble_fraction(2, 4) == pytest.approx(0.2) and bubble_fraction(1, 8) == 0
    # Narayanan et al.'s bubble time fraction is (p-1)/m of the ideal time; interleaving divides it by v
    assert bubble_fraction(4, 8, of="ideal") == pytest.approx(3 / 8)
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11) and bubble_fraction(4, 8, chunks=2) == pytest.approx(3 / 19)
    assert bubble_fraction(4, 8, chunks=2, of="ideal") == pytest.approx(3 / 16)
    assert [in_flight_microbatches("1f1b", 4, 8, s) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight_microbatches("1f1b", 4, 2, 0) == 2 and in_flight_microbatches("gpipe", 4, 8, 3) == 8


def test_merge_attention_is_attention_over_both_halves():
    q, k, v = (torch.randn(2, 3, 8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    full = naive_attention(q, k, v)
    out, lse = None, None
    for kc, vc in zip(k.chunk(2, dim=2), v.chunk(2, dim=2)):
        out, lse = merge_attention(out, lse, *naive_attention(q, kc, vc, return_lse=True))
    assert torch.allclose(out, full, atol=1e-6)
    assert torch.allclose(lse, naive_attention(q, k, v, return_lse=True)[1], atol=1e-6)


def test_layout_and_links():
    shape = LLAMA_SHAPES["Llama-2-70B"]
    one, two = (layout_bytes(shape, tp=8, pp=p, dp=64 // (8 * p), seq=4096) for p in (1, 2))
    assert one["first"]["parameters"] == 2 * one["first"]["stage_params"]
    # fp32 gradient accumulation (Megatron-LM, Llama 3): 4 bytes per parameter; bf16 gradients: 2
    assert one["first"]["gradients"] == 4 * one["first"]["stage_params"]
    bf16 = layout_bytes(shape, tp=8, pp=1, dp=8, seq=4096, grad_bytes=2)
    assert one["first"]["total"] - bf16["first"]["total"] == 2 * one["first"]["stage_params"]
    assert kv_head_split(8, 4) == {"per_rank": 2, "replicas": 1} and kv_head_split(8, 16) == {"per_rank": 1,
                                                                                               "replicas": 2}
    assert two["first"]["parameters"] < one["first"]["parameters"]
    assert two["first"]["activations"] == one["first"]["activations"]    # p micro-batches x L/p layers
    assert two["last"]["activations"] * 2 == two["first"]["activations"]
    recompute = layout_bytes(shape, tp=8, pp=2, dp=4, seq=4096, recompute=True)
    assert recompute["first"]["activations"] == 2 * 40 * 2 * 4096 * 8192 // 8
    assert link_bandwidth("NVLink (H100 SXM)") == 450e9 and link_bandwidth("InfiniBand NDR (400 Gb/s)") == 50e9
    assert collective_seconds(50e9, "InfiniBand NDR (400 Gb/s)") == 1.0 and set(LINKS)
    assert all(r["gpus"] == r["tp"] * r["cp"] * r["pp"] * r["dp"] for r in PUBLISHED_LAYOUTS)
    assert block_param_counts(128)["total"] == sum(p.numel() for p in Block(128, 4).parameters())
    assert set(tp_plan(True)) > set(tp_plan(False))


# ----------------------------------------------------------------------------- input checks
BAD = [
    (lambda: Block(128, 3), ValueError, "d"),
    (lambda: tp_plan(1), TypeError, "sequence_parallel"),
    (lambda: block_param_counts(0), ValueError, "d"),
    (lambda: tp_param_bytes(128, None, 3), ValueError, "t"),
    (lambda: tp_param_bytes(128, None, 2, 0), ValueError, "bytes_per_param"),
    (lambda: layer_activation_bytes(64, 2, 128, 4, t=3), ValueError, "t"),
    (lambda: layer_activation_bytes(64, 2, 128, 4, attn="sdpa"), ValueError, "attn"),
    (lambda: layer_activation_bytes(64, 2, 128, 4, mlp="relu"), ValueError, "mlp"),
    (lambda: layer_activation_bytes(64, 2, 128, 4, impl="deepspeed"), ValueError, "impl"),
    (lambda: layer_activation_bytes(0, 2, 128, 4), ValueError, "s"),
    (lambda: korthikanti_layer_bytes(64, 2, 128, 4, 0), ValueError, "t"),
    (lambda: tp_comm_per_layer(64, 2, 128, 2, sequence_parallel="yes"), TypeError, "sequence_parallel"),
    (lambda: bubble_fraction(0, 4), ValueError, "p"),
    (lambda: bubble_fraction(2, 4, 0), ValueError, "chunks"),
    (lambda: bubble_fraction(2, 4, of="total"), ValueError, "of"),
    (lambda: kv_head_split(8, 3), ValueError, "t"),
    (lambda: layout_bytes(LLAMA_SHAPES["Llama-2-70B"], tp=8, pp=2, dp=4, seq=4096, grad_bytes=3), ValueError,
     "grad_bytes"),
    (lambda: schedules.timeline([]), ValueError, "orders"),
    (lambda: schedules.timeline([[("X", 0, 0)]]), ValueError, "orders"),
    (lambda: schedules.timeline([[("B", 0, 0), ("F", 0, 0)]]), ValueError, "deadlock"),
    (lambda: schedules.timeline([[("F", 0, 0)]], durations=[[1, 2]]), ValueError, "durations"),
    (lambda: schedules.schedule_run("pipedream"), ValueError, "schedule"),
    (lambda: schedules.schedule_run("zb-v", recompute="yes"), TypeError, "recompute"),
    (lambda: in_flight_microbatches("zb", 2, 4, 0), ValueError, "schedule"),
    (lambda: in_flight_microbatches("1f1b", 2, 4, 2), ValueError, "stage"),
    (lambda: merge_attention(None, None, [1.0], torch.zeros(1)), TypeError, "out_b"),
    (lambda: merge_attention(torch.zeros(2, 3), torch.zeros(3), torch.zeros(2, 3), torch.zeros(2)), ValueError,
     "shapes"),
    (lambda: link_bandwidth("Ethernet"), ValueError, "name"),
    (lambda: collective_seconds(-1, "PCIe Gen5 x16"), ValueError, "sent_bytes"),
    (lambda: layout_bytes({"n_layer": 80}, tp=8, pp=2, dp=4, seq=4096), ValueError, "shape"),
    (lambda: layout_bytes(LLAMA_SHAPES["Llama-2-70B"], tp=8, pp=3, dp=4, seq=4096), ValueError, "pp"),
    (lambda: layout_bytes(LLAMA_SHAPES["Llama-2-70B"], tp=8, pp=2, dp=4, seq=4096, zero1=1), TypeError, "zero1"),
    (lambda: runs.tp_run("no"), TypeError, "sequence_parallel"),
    (lambda: runs.pp_run("zb"), ValueError, "schedule"),
    (lambda: runs.pp_run("1f1b", return_outputs=None), TypeError, "return_outputs"),
    (lambda: runs.ring_attention_run(seq=0), ValueError, "seq"),
    (lambda: runs.mesh_run((2, 0)), ValueError, "shape"),
    (lambda: runs.mesh_run((2, 2), ("dp",)), ValueError, "names"),
]


@pytest.mark.parametrize("call, error, name", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_input_checks_name_the_argument(call, error, name):
    with pytest.raises(error, match=name):
        call()


@pytest.mark.slow
def test_runs_script_under_torchrun():
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "memlab" / "parallel" / "runs.py"), "--mode", "sp"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert sorted(x["rank"] for x in lines) == [0, 1] and all(x["max_grad_error"] < 1e-4 for x in lines)
