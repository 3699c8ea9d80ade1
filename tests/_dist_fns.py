"""Functions the rank processes of tests/test_dist.py run (they must live in an importable file)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from memlab.sharding import CommCounter


def whoami(x):
    t = torch.full((3,), float(dist.get_rank() + 1))
    dist.all_reduce(t)                                   # 1 + 2 (+ 3 ...) on every rank
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "x": x, "sum": t.tolist(),
            "pid": os.getpid(), "env_rank": os.environ["RANK"], "local_rank": os.environ["LOCAL_RANK"]}


def raise_on(rank):
    if dist.get_rank() == rank:
        raise ValueError(f"rank {rank} fails on purpose")
    return "fine"


def hang_on(rank, child_pid_file=None):
    if dist.get_rank() == rank:
        if child_pid_file:                               # a grandchild that must die with the group
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
            with open(child_pid_file, "w") as f:
                f.write(str(child.pid))
        time.sleep(1000)
    return "done"


def unpicklable():
    return lambda: 1


def print_something():
    print("hello from rank", dist.get_rank(), flush=True)
    return None


def known_collectives(n_elems):
    """One call of each collective on fp32 tensors; returns what the counter saw."""
    n, r = dist.get_world_size(), dist.get_rank()
    t = torch.ones(n_elems)                              # 4 * n_elems bytes
    with CommCounter() as comm:
        dist.all_reduce(t)
        out = torch.empty(n * n_elems)
        dist.all_gather_into_tensor(out, t)
        dist.all_gather([torch.empty(n_elems) for _ in range(n)], t)
        small = torch.empty(n_elems)
        dist.reduce_scatter_tensor(small, torch.ones(n * n_elems))
        dist.broadcast(t, src=0)
        dist.reduce(t, dst=0)
        dist.all_reduce(t, async_op=True).wait()
        from torch.distributed import _functional_collectives as fc
        fc.wait_tensor(fc.all_reduce(t, "sum", dist.group.WORLD))
        fc.wait_tensor(fc.all_gather_tensor(t, 0, dist.group.WORLD))
        fc.wait_tensor(fc.reduce_scatter_tensor(torch.ones(n * n_elems), "sum", 0, dist.group.WORLD))
    return {"counts": comm.as_dict(), "log": comm.log, "rank": r}


def subgroup_all_reduce(n_elems):
    """An all-reduce on a group of this rank alone: the counter must use the subgroup's size (1: nothing sent),
    not the world's."""
    r = dist.get_rank()
    groups = [dist.new_group([i]) for i in range(dist.get_world_size())]    # every rank creates every group
    t = torch.ones(n_elems)
    with CommCounter() as comm:
        dist.all_reduce(t, group=groups[r])
    return comm.as_dict()


def tracked_alloc(n_elems):
    keep = torch.zeros(n_elems)                          # 4 * n_elems bytes, alive when fn returns
    t = torch.ones(8)
    dist.all_reduce(t)
    return keep.numel()


def deepspeed_model_states(stage, steps=2):
    """A tiny Llama (transformers, from a config) trained `steps` steps under DeepSpeed ZeRO `stage` with bf16 and
    torch's AdamW on this rank; what this rank holds after the last step, read from DeepSpeed's own objects:
    {"parameters": its 16-bit weights (the partitions at stage 3), "masters": its fp32 partition,
    "moments": AdamW's exp_avg and exp_avg_sq, "n_params": ...}. Every parameter is partitioned at stage 3
    (stage3_param_persistence_threshold 0: DeepSpeed keeps parameters below 1e5 elements whole by default)."""
    from transformers import LlamaForCausalLM
    from memlab.sharding import zero_train as zt
    from memlab.core.models import tiny_llama_config
    deepspeed = zt.quiet_deepspeed()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": 2**17, "allgather_bucket_size": 2**17,
                                    "stage3_prefetch_bucket_size": 2**17, "stage3_param_persistence_threshold": 0}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for step in range(steps):
        ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(step))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    opt = engine.optimizer
    nbytes = lambda ts: sum(t.untyped_storage().nbytes() for t in {t.untyped_storage()._cdata: t for t in ts}.values())  # noqa: E731
    if stage == 3:
        params = nbytes(p.ds_tensor for p in engine.module.parameters())
        masters = nbytes(opt.fp32_partitioned_groups_flat)
    else:
        params = nbytes(p for p in engine.module.parameters())
        masters = nbytes(opt.single_partition_of_fp32_groups)
    moments = nbytes(v for st in opt.optimizer.state.values() for k, v in st.items()
                     if k in ("exp_avg", "exp_avg_sq"))
    return {"parameters": params, "masters": masters, "moments": moments,
            "n_params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in engine.module.parameters())}
