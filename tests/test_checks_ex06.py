"""Exercise 06's check helpers in-process: the forked rank harness (values back, a rank's traceback, a hang
killed), the optimizer-state weighing, the off-limits calls, the task 6.3 reference against brute force and
against bytes memlab's tracker measures (tests/test_checks.py runs every exercise's solution and wrong
submissions)."""

from __future__ import annotations

import random
import time

import pytest
import torch

import memlab
from autograder.checks.ex06 import cases as ex06_cases, refs as ex06_refs, run as ex06_run
from memlab.kit import ex06 as kit06


# ----------------------------------------------------------------------------- the rank harness
def _sum_ranks(rank, world):
    import torch.distributed as dist
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    return {"rank": rank, "sum": x.item()}


def test_run_ranks_brings_back_every_rank_in_order():
    out = kit06.run_ranks(3, _sum_ranks)
    assert out == [{"rank": r, "sum": 6.0} for r in range(3)]


def _raise_on_one(rank, world):
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def test_a_rank_that_raises_is_named_with_its_traceback():
    with pytest.raises(kit06.RanksFailed, match=r"rank 1 of 2 raised ValueError: boom on purpose(.|\n)*Traceback"):
        kit06.run_ranks(2, _raise_on_one)


def _hang_on_zero(rank, world):
    import torch.distributed as dist
    if rank == 0:
        dist.broadcast(torch.zeros(1), src=1)        # rank 1 never joins this collective
    time.sleep(60)
    return rank


def _leave_early(rank, world):
    import torch.distributed as dist
    if rank == 0:
        dist.broadcast(torch.zeros(1), src=1)        # rank 1 returns without joining it
    return rank


def test_a_hung_rank_is_killed_after_the_time_limit():
    t0 = time.monotonic()
    with pytest.raises(kit06.RanksFailed, match="did not finish within 3 s"):
        kit06.run_ranks(2, _hang_on_zero, timeout=3, collective_timeout=60)
    assert time.monotonic() - t0 < 15


def test_a_collective_another_rank_skipped_is_explained():
    with pytest.raises(kit06.RanksFailed, match="same collectives in the same order"):
        kit06.run_ranks(2, _leave_early, timeout=30)


def test_run_ranks_rejects_a_bad_world():
    with pytest.raises(ValueError, match="world"):
        kit06.run_ranks(0, _sum_ranks)


# ----------------------------------------------------------------------------- what the judge measures
def test_state_bytes_count_an_inner_optimizer_and_name_its_parameters():
    a, b, c = (torch.nn.Parameter(torch.randn(n)) for n in (5, 7, 3))

    class Wrapper(torch.optim.Optimizer):
        def __init__(self):
            super().__init__([a, b, c], {})
            self.inner = [torch.optim.AdamW([b])]            # reachable through a list attribute

    w = Wrapper()
    b.grad = torch.ones(7)
    w.inner[0].step()
    nbytes, owners = kit06._state(w, [a, b, c])
    assert owners == [1]
    assert nbytes == 2 * 7 * 4 + 4                              # exp_avg + exp_avg_sq + the step scalar


def test_no_shortcuts_catches_zero_redundancy_optimizer_and_memlab_zero():
    with pytest.raises(AssertionError, match="off limits"):
        with ex06_run.no_shortcuts("task6_3_rank_memory"):
            memlab.core.estimate.zero_model_state_bytes(1000, 4, 2)
    with pytest.raises(AssertionError, match="off limits"):
        with ex06_run.no_shortcuts("task6_3_rank_memory"):
            from memlab.sharding import zero
            zero.comm_volume(1000, 2)
    with ex06_run.no_shortcuts("task6_3_rank_memory"):          # the rest of memlab is allowed
        memlab.core.estimate.model_state_bytes(1000)


def test_reference_run_dedupes_a_shared_weight_and_skips_frozen_and_unused():
    case = ex06_cases.dp_cases(True, random.Random(3))[1] | {"shared": True, "frozen": True, "unused": True}
    model = kit06.Net(case)
    assert len(model.listed_params()) == len(list(model.parameters())) + 1        # listed twice, one tensor
    params, state, grads = ex06_refs.reference_run(case)
    frozen = [i for i, p in enumerate(model.parameters()) if not p.requires_grad]
    unused = [i for i, p in enumerate(model.parameters()) if any(p is q for q in model.extra.parameters())]
    assert frozen and unused
    for i in frozen + unused:
        assert state[i] == 0 and grads[i] is None
        assert torch.equal(params[i], list(model.parameters())[i].detach())           # never changed


# ----------------------------------------------------------------------------- task 6.3's reference
def _brute_loads(numels, world):
    """The greedy assignment as a plain loop over a list (the reference runs ZeroRedundancyOptimizer's own)."""
    loads = [0] * world
    for n in sorted(numels, reverse=True):
        loads[loads.index(min(loads))] += n
    return sorted(loads)


@pytest.mark.parametrize("seed", range(20))
def test_zero_partition_loads_match_a_plain_loop(seed):
    r = random.Random(seed)
    numels = [r.randint(1, 500) for _ in range(r.randint(1, 12))]
    world = r.randint(1, 6)
    loads = ex06_refs.zero_partition_loads(numels, world)
    assert sorted(loads) == _brute_loads(numels, world)
    assert sum(loads) == sum(numels)
    assert max(loads) <= sum(numels) / world + max(numels)


def test_rank_bytes_match_tensors_measured_by_the_tracker():
    """Allocate on one 'rank' what the accounting says it keeps (bf16 weights and grads, fp32 master, Adam's two
    fp32 moments) and let memlab's tracker weigh it."""
    numels, world = [900, 40, 700, 650, 33, 1200], 3
    loads = ex06_refs.zero_partition_loads(numels, world)
    mine = max(loads)
    for stage in range(4):
        want = ex06_refs.reference_rank_bytes(numels, stage, world, "bf16_adam")
        tracker = memlab.MemoryTracker()
        with tracker:
            n_w = mine if stage >= 3 else sum(numels)
            n_g = mine if stage >= 2 else sum(numels)
            n_o = mine if stage >= 1 else sum(numels)
            keep = [torch.empty(n_w, dtype=torch.bfloat16), torch.empty(n_g, dtype=torch.bfloat16),
                    *[torch.empty(n_o, dtype=torch.float32) for _ in range(3)]]
            measured = tracker.current
        assert measured == want["total"], (stage, measured, want)
        del keep


def test_task_6_3_hidden_cases_are_uneven_and_cover_every_stage_and_layout():
    for seed in range(50):
        cases = ex06_cases.mem_cases(True, random.Random(seed))
        assert sorted(c["stage"] for c in cases) == [0, 1, 2, 3]
        assert {"bf16_adam", "fp32_adam"} <= {c["layout"] for c in cases}
        for c in cases:
            if c["stage"]:
                loads = ex06_refs.zero_partition_loads(c["numels"], c["world"])
                assert max(loads) * c["world"] != sum(c["numels"])
                assert loads[0] < max(loads), "rank 0's load must not be the answer"
                assert max(ex06_cases.list_order_loads(c["numels"], c["world"])) != max(loads), \
                    "list order must give another fullest rank"


def test_the_hidden_optimizer_cases_cover_every_branch():
    for seed in range(10):
        cases = ex06_cases.dp_cases(True, random.Random(seed))
        assert {c["opt"] for c in cases} == {"adamw", "sgd"}
        assert len({c["world"] for c in cases}) == 2 and all(2 <= c["world"] <= 4 for c in cases)
        for key in ("groups", "frozen", "unused", "shared"):
            assert any(c[key] for c in cases), key
        assert any(c["kwargs"].get("weight_decay") for c in cases if c["opt"] == "adamw")


def test_zero_partition_is_torchs_and_not_sorted_by_list_order():
    """The reference partitions like ZeroRedundancyOptimizer: the largest tensor on rank 0, then the least
    loaded rank (the lowest on a tie)."""
    assert ex06_refs.zero_partition_loads([500, 400, 300, 300, 200], 2) == [800, 900]
    assert ex06_refs.zero_partition_loads([10, 50257, 4096, 64], 4) == [50257, 4096, 64, 10]
    assert ex06_refs.zero_partition_loads([7], 3) == [7, 0, 0]


@pytest.mark.parametrize("name", ["rank0_load", "list_order_greedy", "average_twice_and_psi_over_n"])
def test_task_6_3_mistakes_lose_every_hidden_run(name):
    """Each 6.3 mistake fails every hidden draw, not only most (the judge runs in-process here)."""
    from _nb import solution_namespace
    from autograder.checks.common import decode, encode
    from autograder.checks.ex06 import TASKS
    from submissions import ex06 as spec
    task = TASKS["task6_3_rank_memory"]
    fn = solution_namespace("06_zero", spec.WRONG[name]["replace"])["rank_memory"]
    for seed in range(40):
        lost = False
        for case in task.cases(True, random.Random(seed)):
            try:
                task.judge(case, decode(encode(task.run(case, rank_memory=fn))))
            except AssertionError:
                lost = True
                break
        assert lost, f"{name} passed hidden draw {seed}"


def test_the_hidden_optimizer_cases_always_change_the_lr():
    for seed in range(20):
        cases = ex06_cases.dp_cases(True, random.Random(seed))
        assert any(c["gamma"] and c["gamma"] != 1 for c in cases)
    assert ex06_cases.dp_cases(False, random.Random(0))[0]["gamma"]


@pytest.mark.parametrize("seed", range(4))
def test_the_reference_run_follows_the_scheduler(seed):
    """The reference steps the scheduler: with it, the final parameters differ from a run without it."""
    case = ex06_cases.dp_cases(True, random.Random(seed))[0]
    with_sched = ex06_refs.reference_run(case)[0]
    without = ex06_refs.reference_run(dict(case, gamma=None))[0]
    assert any(not torch.allclose(a, b, rtol=1e-4, atol=1e-5) for a, b in zip(with_sched, without))


@pytest.mark.parametrize("seed", range(3))
def test_ignoring_the_scheduler_loses_every_hidden_run_and_the_solution_keeps_it(seed):
    """The AdamW case of every hidden run has a scheduler: an optimizer that never passes the outer groups' lr
    to its inner optimizer fails it; the solution passes the same draw."""
    from _nb import solution_namespace
    from autograder.checks.common import decode, encode
    from autograder.checks.ex06 import TASKS
    from submissions import ex06 as spec
    task = TASKS["task6_1_sharded_optimizer"]
    wrong = solution_namespace("06_zero", spec.WRONG["ignores_scheduler"]["replace"])["ShardedOptimizer"]
    right = solution_namespace("06_zero")["ShardedOptimizer"]
    torch.set_num_threads(1)
    case = task.cases(True, random.Random(seed))[0]
    assert case["gamma"]
    task.judge(case, decode(encode(task.run(case, ShardedOptimizer=right))))
    with pytest.raises(AssertionError, match="scheduler"):
        task.judge(case, decode(encode(task.run(case, ShardedOptimizer=wrong))))


def test_every_hidden_run_passes_parameter_groups_and_a_flat_list():
    """The text allows a list of tensors or a list of group dicts: every hidden run gives the optimizer both forms."""
    for seed in range(30):
        cases = ex06_cases.dp_cases(True, random.Random(seed))
        assert {c["groups"] for c in cases} == {True, False}
        for c in cases:
            listed = kit06.param_groups(c, kit06.Net(c))
            assert all(isinstance(g, dict) for g in listed) if c["groups"] else \
                all(isinstance(p, torch.Tensor) for p in listed)


def test_every_hidden_run_of_6_1_mixes_dtypes_so_elements_and_bytes_disagree():
    """The text balances owners by bytes: every hidden run's AdamW case has a float64 layer among float32 ones, and
    on it greedy by element count gives an owner map the bytes rule rejects (so does greedy in list order)."""
    for seed in range(40):
        adamw = ex06_cases.sharded_cases(True, random.Random(seed))[0]
        assert adamw["opt"] == "adamw" and adamw["float64_layers"], adamw
        dtypes = {p.dtype for p in kit06.Net(adamw).parameters()}
        assert dtypes == {torch.float32, torch.float64}, dtypes
        assert not ex06_cases._by_numel_is_by_bytes(adamw)
        assert not ex06_cases._list_order_is_largest_first(adamw)
    assert "float64_layers" not in ex06_cases.sharded_cases(False, random.Random(0))[0]
