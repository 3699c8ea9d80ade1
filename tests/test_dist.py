"""memlab.sharding (ranks on one machine), memlab.sharding.zero and the lesson 06 training script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import _dist_fns as fns
from memlab import sharding
from memlab.sharding import CommCounter, RankError, RankGroup, ring_bytes_sent
from memlab.core.estimate import zero_model_state_bytes
from memlab.core.models import GPTConfig
from memlab.core.track import MemoryTracker
from memlab.sharding.zero import HostLinkCounter, comm_volume, deepspeed_buffers, follow_storage_resizes
from memlab.sharding.zero_scale import zero_rank_step

ROOT = Path(__file__).resolve().parent.parent
DS_PRELOAD = ("torch._dynamo", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "torch.distributed.fsdp")


def _gone(pid: int, wait: float = 5.0) -> bool:
    """The process no longer exists (or is a zombie nobody will run again)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                state = next(line for line in f if line.startswith("State:"))
            if "Z" in state.split()[1]:
                return True
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def ranks():
    with RankGroup(2, timeout=60) as g:
        yield g


# ----------------------------------------------------------------------------- the runner
def test_results_come_back_in_rank_order(ranks):
    out = ranks.run(fns.whoami, "hi")
    assert [o["rank"] for o in out] == [0, 1]
    assert all(o["world"] == 2 and o["x"] == "hi" and o["sum"] == [3.0, 3.0, 3.0] for o in out)
    assert [o["env_rank"] for o in out] == ["0", "1"] and [o["local_rank"] for o in out] == ["0", "1"]
    assert len({o["pid"] for o in out} | {os.getpid()}) == 3, "each rank must be its own process"
    assert ranks.run(fns.whoami, 2)[1]["x"] == 2, "a group must be reusable"


def test_rank_output_goes_to_its_log(ranks):
    ranks.run(fns.print_something)
    assert "hello from rank 1" in ranks.log(1) and "hello from rank 1" not in ranks.log(0)


def test_run_tracked_brings_memory_and_comm_back(ranks):
    res = ranks.run_tracked(fns.tracked_alloc, 1000)
    assert [r.rank for r in res] == [0, 1] and res[0].value == 1000
    assert res[0].peak >= 4000 and res[0].peak_breakdown["temporaries"] >= 4000
    assert res[0].comm == {"all_reduce": {"calls": 1, "bytes": 32, "sent": 32}}


def test_comm_counter_is_exact_on_known_collectives(ranks):
    E, N = 250, 2
    S = 4 * E
    out = ranks.run(fns.known_collectives, E)
    for o in out:
        c = o["counts"]
        assert c["all_reduce"] == {"calls": 3, "bytes": 3 * S, "sent": 3 * S}          # 2 (N-1)/N S each
        assert c["all_gather"] == {"calls": 3, "bytes": 3 * N * S, "sent": 3 * S}      # (N-1)/N N S each
        assert c["reduce_scatter"] == {"calls": 2, "bytes": 2 * N * S, "sent": 2 * S}
        assert c["broadcast"] == {"calls": 1, "bytes": S, "sent": S // 2}
        assert c["reduce"] == {"calls": 1, "bytes": S, "sent": S // 2}
        assert set(c) == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"}
        assert o["log"][0] == ("all_reduce", S) and len(o["log"]) == 10


def test_comm_counter_uses_the_subgroups_size(ranks):
    for c in ranks.run(fns.subgroup_all_reduce, 250):
        assert c["all_reduce"] == {"calls": 1, "bytes": 1000, "sent": 0}, c   # a group of one sends nothing


def test_a_raising_rank_is_named_and_the_group_stopped():
    g = RankGroup(2, timeout=30)
    pids = g.pids
    with pytest.raises(RankError) as err:
        g.run(fns.raise_on, 1)
    assert err.value.rank == 1 and err.value.kind == "raised"
    assert "rank 1 raised ValueError: rank 1 fails on purpose" in str(err.value)
    assert "raise_on" in err.value.remote_traceback
    assert g.closed and all(_gone(p) for p in pids)
    with pytest.raises(RuntimeError, match="closed"):
        g.run(fns.whoami, 0)


def test_a_hanging_rank_times_out_and_leaves_no_orphans(tmp_path):
    g = RankGroup(2, timeout=30)
    pids, pid_file = g.pids, tmp_path / "child.pid"
    t0 = time.monotonic()
    with pytest.raises(RankError) as err:
        g.run(fns.hang_on, 1, str(pid_file), timeout=3)
    assert time.monotonic() - t0 < 15
    assert err.value.rank == 1 and err.value.kind == "timeout"
    assert "rank 1 did not finish within 3 s" in str(err.value) and "finished: [0]" in str(err.value)
    child = int(pid_file.read_text())
    assert all(_gone(p) for p in pids + [child]), "the ranks and what they started must be killed"


def test_an_unpicklable_result_is_reported():
    with RankGroup(2, timeout=30) as g:
        with pytest.raises(RankError, match="does not pickle"):
            g.run(fns.unpicklable)


def test_bad_input():
    with pytest.raises(ValueError, match="world_size"):
        RankGroup(0)
    with pytest.raises(ValueError, match="backend"):
        RankGroup(2, backend="mpi")
    with pytest.raises(ValueError, match="timeout"):
        RankGroup(2, timeout=-1)
    with pytest.raises(ValueError, match="threads"):
        RankGroup(2, threads=0)
    with pytest.raises(TypeError, match="env"):
        RankGroup(2, env={"A": 1})
    with pytest.raises(TypeError, match="preload"):
        RankGroup(2, preload="deepspeed")
    with pytest.raises(ValueError, match="top level"):
        sharding.run(lambda: 1)
    with pytest.raises(TypeError, match="fn must be a function"):
        sharding.run(3)
    with pytest.raises(ValueError, match="payload"):
        ring_bytes_sent("all_reduce", -1, 2)
    with pytest.raises(ValueError, match="world_size"):
        ring_bytes_sent("all_reduce", 10, 0)
    with pytest.raises(ValueError, match="key"):
        CommCounter().total("nope")


def test_bad_run_arguments(ranks):
    with pytest.raises(TypeError, match="pickle"):
        ranks.run(fns.whoami, (i for i in range(3)))
    with pytest.raises(ValueError, match="timeout"):
        ranks.run(fns.whoami, 1, timeout=0)
    with pytest.raises(ValueError, match="rank"):
        ranks.log(5)
    assert ranks.run(fns.whoami, 1)[0]["x"] == 1, "refused calls must leave the group usable"


# ----------------------------------------------------------------------------- memlab.sharding.zero helpers
def test_ring_bytes_and_comm_volume():
    assert ring_bytes_sent("send", 1000, 4) == 1000 and ring_bytes_sent("recv", 1000, 4) == 0   # point to point
    assert ring_bytes_sent("all_reduce", 1000, 4) == 1500
    assert ring_bytes_sent("all_gather", 1000, 4) == 750 and ring_bytes_sent("broadcast", 1000, 1) == 0
    dp, z3 = comm_volume(10, 0), comm_volume(10, 3)
    assert dp["total"] == 40 and comm_volume(10, 2)["total"] == 40 and z3["total"] == 60
    assert comm_volume(10, 3, world_size=4)["total"] == 45
    with pytest.raises(ValueError, match="stage"):
        comm_volume(10, 4)
    with pytest.raises(ValueError, match="n_params"):
        comm_volume(0, 1)


def test_host_link_counter_counts_only_crossing_copies():
    host, dev = torch.zeros(100), torch.ones(100, dtype=torch.bfloat16)
    other = torch.zeros(100)
    with HostLinkCounter([host]) as link:
        host.copy_(dev)                 # device -> host: 200 bytes read from the bf16 source
        dev.copy_(host)                 # host -> device: 400 bytes
        other.copy_(dev)                # device -> device
    assert (link.to_host, link.to_device) == (200, 400)
    with pytest.raises(TypeError, match="host_tensors"):
        HostLinkCounter([1])


def test_follow_storage_resizes_keeps_the_tracker_right():
    tr = MemoryTracker(device="cpu", timeline=False)
    with tr, follow_storage_resizes():
        t = torch.empty(1000)
        before = tr.current
        t.untyped_storage().resize_(0)       # what FSDP2 does to free an unsharded parameter
        freed = tr.current
        t.untyped_storage().resize_(4000)
        again = tr.current
    assert before - freed == 4000 and again == before


def test_deepspeed_buffers_walks_counts_once_and_names_roles():
    flat = torch.zeros(10, dtype=torch.bfloat16)

    class FakeZero:                         # the attributes a ZeRO optimizer keeps
        def __init__(self):
            self.bit16_groups_flat = [flat]
            self.bit16_groups = [[flat[:4], flat[4:]]]                     # views: counted with the flat buffer
            self.single_partition_of_fp32_groups = [torch.zeros(5)]
            self.averaged_gradients = {0: [torch.zeros(5, dtype=torch.bfloat16)]}
            self.round_robin_meta = [torch.zeros(1000, device="meta")]      # no memory
            self.optimizer = torch.optim.SGD([torch.zeros(3, requires_grad=True)])
    b = deepspeed_buffers(FakeZero())
    assert {k: (v["bytes"], v["role"]) for k, v in b.items()} == {
        "bit16_groups_flat": (20, "parameters"), "single_partition_of_fp32_groups": (20, "optimizer"),
        "averaged_gradients": (10, "gradients")}
    with pytest.raises(TypeError, match="zero_optimizer"):
        deepspeed_buffers(3)


# ----------------------------------------------------------------------------- full scale on fake tensors
def _states_bytes(stage, n):
    """Bytes zero_rank_step holds before its forward, on a tiny model, counted exactly."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    cfg = GPTConfig.tiny(tie_weights=False, n_layer=2)
    tr = MemoryTracker(device="cpu", timeline=False)
    with FakeTensorMode(), tr:
        out = zero_rank_step(cfg, stage, n, 2, 32, bucket=0)
    return tr.phase_peaks["states"]["total"], out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_rank_step_holds_the_formulas_model_states(stage):
    held, out = _states_bytes(stage, 4)
    psi, part = out["n_params"], out["partition"]
    assert part == -(-psi // 4)
    # before the backward, stages 0 and 1 have no gradients yet (2 Psi later); 2 and 3 hold the partition
    formula = {0: 16 * psi, 1: 4 * psi + 12 * part, 2: 2 * psi + 14 * part, 3: 16 * part}[stage]
    assert abs(formula - zero_model_state_bytes(psi, 4, stage)) < 64         # the same formula, rounded
    assert held + (2 * psi if stage < 2 else 0) == formula, f"stage {stage}: held {held}, formula {formula}"


def test_zero_rank_step_bad_input():
    cfg = GPTConfig.tiny()
    with pytest.raises(ValueError, match="stage"):
        zero_rank_step(cfg, 5, 2, 1, 8)
    with pytest.raises(ValueError, match="n_gpus"):
        zero_rank_step(cfg, 1, 0, 1, 8)
    with pytest.raises(TypeError, match="cfg"):
        zero_rank_step("7b", 1, 2, 1, 8)
    with pytest.raises(ValueError, match="seq"):
        zero_rank_step(cfg, 1, 2, 1, 10_000)


def test_ds_config_checks_its_input():
    from memlab.sharding.zero_train import ds_config
    cfg = ds_config(3, offload=False)
    assert cfg["zero_optimization"]["stage3_param_persistence_threshold"] == 0
    assert ds_config(2, offload=True)["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    with pytest.raises(ValueError, match="stage"):
        ds_config(4)
    with pytest.raises(ValueError, match="bucket"):
        ds_config(1, bucket=0)


# ----------------------------------------------------------------------------- real DeepSpeed and FSDP2
@pytest.mark.slow
def test_deepspeed_and_fsdp2_per_rank_bytes_and_comm():
    from memlab.sharding import zero_train as zt
    with RankGroup(2, timeout=300, preload=DS_PRELOAD) as g:
        runs = {s: g.run(zt.deepspeed_run, s) for s in (0, 2, 3)}
        fsdp = g.run(zt.fsdp2_run)
    psi = runs[0][0]["n_params"]
    for s, res in runs.items():
        for r in res:
            live = sum(r["end_of_backward"].values())        # everything, whatever its label
            formula = zero_model_state_bytes(psi, 2, s)
            bucket = 2 * 2**17 if s else 0                    # one reduce bucket of 2^17 bf16 elements
            extra = live - formula - bucket                   # partition padding, the batch, Adam's step counters
            assert 0 <= extra < 0.03 * formula + 4096, (s, r["rank"], live, formula)
    dp = sum(c["sent"] for c in runs[0][0]["comm"].values())
    z3 = sum(c["sent"] for c in runs[3][0]["comm"].values())
    assert 1.3 < z3 / dp < 1.6, f"ZeRO-3 should move about 1.5x data parallel, measured {z3 / dp:.2f}x"
    for r in fsdp:
        states = sum(r["before_step"][c] for c in ("parameters", "gradients", "optimizer"))
        assert abs(states - 16 * psi / 2) < 0.01 * 16 * psi / 2


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed"])
def test_training_script_runs_under_the_launchers(launcher):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    script = [str(ROOT / "memlab" / "sharding" / "zero_train.py"), "--framework", "deepspeed", "--stage", "2"]
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *script]
    else:
        exe = Path(sys.executable).parent / "deepspeed"
        if not exe.exists():
            pytest.skip("the deepspeed launcher is not installed next to this Python")
        cmd = [str(exe), "--num_gpus", "2", "--master_port", str(sharding.ranks._free_port()), *script]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert sorted(x["rank"] for x in lines) == [0, 1]
    assert all(x["stage"] == 2 and x["world_size"] == 2 and x["device"] == "cpu" for x in lines)


def test_a_deferred_group_starts_at_its_first_run():
    g = RankGroup(2, wait=False, timeout=30)
    try:
        assert not g._procs, "wait=False must not start the ranks yet"
        assert g.run(fns.whoami, 7)[1]["x"] == 7
    finally:
        g.close()
    assert g.closed and all(_gone(p) for p in [p.pid for p in g._procs])


@pytest.mark.parametrize("stage", [1, 3])
def test_per_gpu_peaks_extrapolation_matches_a_direct_run(stage):
    from memlab import VirtualGPU
    from memlab.sharding.zero_scale import per_gpu_peaks
    cfg = GPTConfig.tiny(tie_weights=False, n_layer=5, n_embd=64, n_head=2, block_size=64)
    est = per_gpu_peaks(cfg, 2, 64, n_gpus=(1, 3), stages=(stage,), bucket=4096)
    for n in (1, 3):
        direct = VirtualGPU(capacity_gb=64).run(zero_rank_step, cfg, stage, n, 2, 64, 4096)
        assert abs(est[stage][n]["peak"] - direct.peak) <= 5e-3 * direct.peak, (n, est[stage][n], direct.peak)
        assert est[stage][n]["phase"] == direct.peak_phase
    with pytest.raises(ValueError, match="n_gpus"):
        per_gpu_peaks(cfg, 2, 64, n_gpus=(0,))


def test_label_and_resize_following_restore_and_check():
    from memlab.sharding.zero import label
    with pytest.raises(TypeError, match="tensors"):
        with MemoryTracker(device="cpu"):
            label([3], "gradients")
    original = torch.UntypedStorage.resize_
    with follow_storage_resizes():
        assert torch.UntypedStorage.resize_ is not original
    assert torch.UntypedStorage.resize_ is original


@pytest.mark.slow
def test_hsdp_run_shards_inside_its_group_and_all_reduces_across_replicas():
    from memlab.sharding.zero_train import fsdp2_run, hsdp_run
    with pytest.raises(ValueError, match="replicate"):
        hsdp_run(0)
    with pytest.raises(TypeError, match="reshard_after_forward"):
        hsdp_run(2, reshard_after_forward=1)
    with pytest.raises(ValueError, match="reduce_dtype"):
        hsdp_run(2, reduce_dtype="float16")
    with RankGroup(4, timeout=300, preload=("torch.distributed.fsdp",)) as g:
        full = g.run(fsdp2_run)
        hsdp = g.run(hsdp_run, 2)
        with pytest.raises(RankError, match="replicate must divide"):
            g.run(hsdp_run, 3)
    psi = hsdp[0]["n_params"]
    for f, h in zip(full, hsdp):
        assert h["mesh"] == [2, 2] and h["rank"] in h["shard_group"] and h["rank"] in h["replicate_group"]
        assert h["shard_group"] == [2 * (h["rank"] // 2), 2 * (h["rank"] // 2) + 1]    # row-major (2, 2) mesh
        states = sum(h["before_step"][c] for c in ("parameters", "gradients", "optimizer"))
        assert abs(states - 16 * psi / 2) < 0.01 * 16 * psi / 2, "HSDP shards the states over 2 ranks, not 4"
        payload = {c: v["bytes"] for c, v in h["comm"].items()}
        assert abs(payload["all_gather"] - 2 * 2 * psi) < 0.01 * 4 * psi       # bf16, forward + backward
        assert abs(payload["reduce_scatter"] - 4 * psi) < 0.01 * 4 * psi       # the whole fp32 gradient
        assert abs(payload["all_reduce"] - 4 * psi / 2) < 0.01 * 2 * psi       # the fp32 gradient shard
        assert "all_reduce" not in f["comm"]
        assert abs(h["loss"] - f["loss"]) < 1e-3 * abs(f["loss"]), "HSDP must train the same maths as FSDP"


@pytest.mark.slow
def test_fit_holds_what_a_real_deepspeed_run_holds_per_rank():
    """memlab.fit's per-rank model states under ZeRO 1, 2 and 3 on 2 ranks against DeepSpeed itself on 2 gloo
    ranks (a tiny transformers Llama, bf16 with fp32 masters, torch AdamW): the 16-bit weights each rank keeps
    (all of them, or its partition at stage 3) and the optimizer's partition (fp32 masters + two moments). fit
    rounds every tensor up to 512 bytes, as the allocator does: the tolerance is that rounding."""
    import memlab
    from transformers import LlamaForCausalLM
    from memlab.core.models import tiny_llama_config
    with torch.device("meta"):
        slack = 512 * len(list(LlamaForCausalLM(tiny_llama_config()).parameters()))
    with RankGroup(2, timeout=300, preload=DS_PRELOAD) as g:
        real = {s: g.run(fns.deepspeed_model_states, s) for s in (1, 2, 3)}
    for s, ranks in real.items():
        r = memlab.fit(tiny_llama_config(), "A100-80GB", precision="mixed", zero=s, gpus=2, batch=2, seq=32)
        for got in ranks:
            assert got["n_params"] == r.n_params
            assert 0 <= r.model_states["parameters"] - got["parameters"] <= slack, (s, got, r.model_states)
            assert 0 <= r.model_states["optimizer"] - (got["masters"] + got["moments"]) <= 3 * slack, \
                (s, got, r.model_states)
