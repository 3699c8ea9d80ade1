"""Functions the rank processes of tests/test_dist.py run (they must live in an importable file)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from memlab.dist import CommCounter


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
