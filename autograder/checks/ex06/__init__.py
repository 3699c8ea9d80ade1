"""Checks for exercise 06: shard the optimizer (ZeRO-1 and ZeRO-2 by hand), and a per-rank memory estimator.

Tasks 6.1 and 6.2 run the learner's optimizer on N forked gloo ranks (`memlab.kit.ex06.run_ranks`), a few steps of
a small model (`memlab.kit.ex06.Net`) with different data on every rank. Each rank brings back plain data: its
final parameters, the bytes of optimizer state it holds (the tensors in the `state` of every optimizer reachable
from the learner's: its own and any inner one) and for which parameters, the parameters it still holds gradients
for, and the bytes of each collective issued inside `step()` (memlab's CommCounter). The judge reruns the same
model and data on ONE process with the unsharded torch.optim optimizer, averaging the N ranks' gradients, and
compares (`refs.reference_run`); task 6.1's `self.owner` is replayed against the text's rule (largest first, each
to a least-loaded rank; `cases.not_largest_first`), on a hidden case with a float64 layer among float32 ones, so
that bytes and element counts order the tensors differently (`cases.sharded_cases`). Task 6.3's reference is
the per-rank bytes term by term over the whole-tensor partition torch's ZeroRedundancyOptimizer computes
(`refs.zero_partition_loads`, its `_partition_parameters` on meta tensors; `refs.reference_rank_bytes`).

Learner side (staged into the sandbox): this file, inputs.py, run.py. Trusted side (only in the grader and the
learner's own kernel): cases.py, refs.py, judge.py, named here by their functions and imported when called.
"""

from __future__ import annotations

from ..common import Task, tasks
from .run import dp_run, mem_run

TASKS = tasks(
    Task("task6_1_sharded_optimizer", ("ShardedOptimizer",), "sharded_cases",
         dp_run("task6_1_sharded_optimizer", "ShardedOptimizer"), "dp_judge", spawns=True),
    Task("task6_2_reduce_scatter", ("ZeRO2Optimizer",), "dp_cases", dp_run("task6_2_reduce_scatter", "ZeRO2Optimizer"),
         "zero2_judge", spawns=True),
    Task("task6_3_rank_memory", ("rank_memory",), "mem_cases", mem_run, "mem_judge"),
)
