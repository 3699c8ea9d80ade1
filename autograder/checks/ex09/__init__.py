"""Checks for exercise 09: tensor parallelism by hand (column- and row-parallel shards, a Megatron MLP over
torch.distributed) and a pipeline-stage activation estimator.

Task 9.1 calls the learner's two shard functions on every rank's behalf and judges the shards by what they
compute: concatenated in rank order (column-parallel) or summed as an all-reduce would sum them (row-parallel),
they must give the unsharded nn.Linear's output; each must own its memory (no view of the full weight); uneven
splits and ranks outside [0, world_size) raise a ValueError naming the argument. Task 9.2 runs the learner's
forward on 4 forked gloo ranks (`memlab.kit.ex09.run_ranks`) with the grader's own shards, as tp-way tensor
parallel groups side by side (tp = 2 and 4), and brings back every rank's output, the gradients of its shards
for a loss computed from the replicated output, and the bytes each collective of the forward and of the backward
sent (memlab's CommCounter, ring accounting); the judge compares with the unsharded nn.Sequential(Linear, GELU,
Linear) on one process, its gradients cut by the Shard placements of torch's ColwiseParallel / RowwiseParallel,
and allows at most one all-reduce of the (B, T, d) output per forward (a reduce-scatter plus an all-gather of the
same output sends the same bytes and passes) and, as Megatron's f and g operators send, nothing in the backward
(f's all-reduce of x's gradient runs only when x needs a gradient, and the grader's x does not).
Task 9.3's reference walks each schedule's event order (refs.events).

Learner side (staged into the sandbox): this file, inputs.py, run.py. Trusted side (only in the grader and the
learner's own kernel): cases.py, refs.py, judge.py, named here by their functions and imported when called.
"""

from __future__ import annotations

from ..common import Task, tasks
from .run import pipe_run, shard_run, tp_run

TASKS = tasks(
    Task("task9_1_shard_linear", ("column_parallel_linear", "row_parallel_linear"), "shard_cases", shard_run,
         "shard_judge"),
    Task("task9_2_tp_mlp", ("tp_mlp_forward",), "tp_cases", tp_run, "tp_judge", spawns=True),
    Task("task9_3_pipeline_memory", ("pipeline_activation_bytes",), "pipe_cases", pipe_run, "pipe_judge"),
)
