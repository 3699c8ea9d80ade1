"""Plausible-wrong submissions for exercise 09 and the points each must lose, and correct alternatives that
must keep every point. Each is the solution with one mistake made in it. Task 9.2 is checked with the grader's
own shards, so a mistake in task 9.1 never costs task 9.2's points (the visible 9.2 cell's demo table, which
uses the 9.1 functions, says so and moves on).

Task 9.2's traffic spec counts the bytes a ring sends within the tensor-parallel group, not the number of
collectives: a reduce-scatter followed by an all-gather of the output sends exactly what one all-reduce sends,
so it keeps every point (RIGHT); an all-gather of the hidden activation (4d wide) sends twice as much or more
and loses them even though its output and gradients are right (WRONG)."""

from __future__ import annotations

from . import both, edit, solution_cells

ASSIGNMENT = "09_parallelism"
_CELLS = solution_cells(ASSIGNMENT)
S1, S2, S3 = "task9_1_shard_linear", "task9_2_tp_mlp", "task9_3_pipeline_memory"
SHARD, TP, PIPE = (_CELLS[k] for k in (S1, S2, S3))
ALL1, ALL2, ALL3 = both(S1), both(S2), both(S3)

ROW_BIAS = "    b = bias.detach().clone() if bias is not None and rank == 0 else None"
RANK_CHECK = """    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size) = [0, {world_size}), got {rank}")
"""
ONE_FB = "min(microbatches, stages - s)"

WRONG = {
    # 9.1: the row-parallel bias returned on every rank: the all-reduce adds it t times
    "row_bias_every_rank": {"replace": {S1: edit(SHARD, ROW_BIAS,
                                                 "    b = bias.detach().clone() if bias is not None else None")},
                            "must_lose": ALL1, "must_keep": ALL2 + ALL3},
    # 9.1: "column-parallel" read as nn.Linear's columns: W1 split by its input features (dim 1)
    "column_splits_weight_columns": {"replace": {S1: edit(SHARD, "    w = weight.detach()[rows].clone()",
                                                          "    w = weight.detach()[:, rows].clone()")},
                                     "must_lose": ALL1, "must_keep": ALL2 + ALL3},
    # 9.1: no divisibility check: floor division silently drops the last rows / columns
    "no_uneven_check": {"replace": {S1: edit(edit(SHARD, "    if out_features % world_size:",
                                                  "    if False:"),
                                             "    if in_features % world_size:", "    if False:")},
                        "must_lose": ALL1, "must_keep": ALL2 + ALL3},
    # 9.1: views of the full weight: the shard keeps every byte of it alive
    "views_alias_the_weight": {"replace": {S1: edit(SHARD, ".clone()", "")},
                               "must_lose": ALL1, "must_keep": ALL2 + ALL3},
    # 9.1: both dimensions required to divide (only the split one must): raises on valid layers
    "checks_both_dimensions": {"replace": {S1: edit(SHARD, "    if out_features % world_size:",
                                                    "    if out_features % world_size or weight.shape[1] % world_size:")},
                               "must_lose": ALL1, "must_keep": ALL2 + ALL3},
    # 9.1: no rank check: rank -1 or world_size slices an empty (or the last) block without a word
    # only rank >= world_size is refused: rank -1 silently takes the last shard
    "rank_checked_above_only": {"replace": {S1: SHARD.replace("    if not 0 <= rank < world_size:",
                                                              "    if rank >= world_size:")},
                                "must_lose": [f"{S1}_hidden"], "must_keep": [f"{S1}_visible"] + ALL2},
    # the row-parallel bias split into equal shares on every rank: the sum is right, the placement is not
    "row_bias_divided_among_ranks": {"replace": {S1: edit(SHARD, ROW_BIAS,
                                                          "    b = None if bias is None else bias.detach() / world_size")},
                                     "must_lose": ALL1, "must_keep": ALL2},
    # zeros instead of None on the ranks other than 0
    "row_bias_zeros_elsewhere": {"replace": {S1: edit(SHARD, ROW_BIAS, "    b = None if bias is None else "
                                                      "(bias.detach().clone() if rank == 0 else torch.zeros_like(bias))")},
                                 "must_lose": ALL1, "must_keep": ALL3},
    "no_rank_check": {"replace": {S1: edit(SHARD, RANK_CHECK, "")},
                      "must_lose": [f"{S1}_hidden"], "must_keep": [f"{S1}_visible"] + ALL2 + ALL3},
    # 9.2: torch.distributed.nn.functional.all_reduce: right output, but its backward all-reduces the gradient
    # too, so every shard's gradient is t times too large
    "autograd_all_reduce_twice": {"replace": {S2: """from torch.distributed.nn.functional import all_reduce as autograd_all_reduce


def tp_mlp_forward(x, w1_shard, b1_shard, w2_shard, b2, group):
    h = F.gelu(F.linear(x, w1_shard, b1_shard))
    return autograd_all_reduce(F.linear(h, w2_shard), group=group) + b2"""},
        "must_lose": ALL2, "must_keep": ALL1 + ALL3},
    # 9.2: b2 added to the partial output on every rank, before the all-reduce: t x b2
    "bias_before_all_reduce": {"replace": {S2: edit(edit(TP, "partial = F.linear(h, w2_shard)",
                                                         "partial = F.linear(h, w2_shard, b2)"),
                                                    "return AllReduceSum.apply(partial, group) + b2",
                                                    "return AllReduceSum.apply(partial, group)")},
                               "must_lose": ALL2, "must_keep": ALL1 + ALL3},
    # 9.2: the all-reduce over the default (world) group: with two tensor-parallel groups side by side it adds
    # the other group's partial sums, computed on other data
    "forgets_the_group": {"replace": {S2: edit(TP, "dist.all_reduce(total, group=group)", "dist.all_reduce(total)")},
                          "must_lose": ALL2, "must_keep": ALL1 + ALL3},
    # 9.2: all-gathers the hidden activation (and W2's shards) and multiplies on every rank: right output and
    # gradients (each rank's own piece keeps autograd), twice the traffic or more
    "all_gather_hidden": {"replace": {S2: """def tp_mlp_forward(x, w1_shard, b1_shard, w2_shard, b2, group):
    t, me = dist.get_world_size(group), dist.get_rank(group)
    h = F.gelu(F.linear(x, w1_shard, b1_shard))
    hs = [torch.empty_like(h) for _ in range(t)]
    dist.all_gather(hs, h.detach().contiguous(), group=group)
    ws = [torch.empty_like(w2_shard) for _ in range(t)]
    dist.all_gather(ws, w2_shard.detach().contiguous(), group=group)
    hs[me], ws[me] = h, w2_shard                          # this rank's own pieces keep their autograd
    return F.linear(torch.cat(hs, -1), torch.cat(ws, -1)) + b2"""},
        "must_lose": ALL2, "must_keep": ALL1 + ALL3},
    # 9.2: data parallelism's habit in g's backward: all-reduce the gradient and divide by t. Every rank already
    # holds the whole dL/dy, so the gradients come out right, for one more all-reduce of (B, T, d) per step
    "backward_all_reduce_divided_by_t": {"replace": {S2: edit(edit(
        TP, "        total = partial.clone()", "        ctx.group = group\n        total = partial.clone()"),
        "        return grad, None                              # every rank's loss is the same: dL/dpartial = dL/dy",
        "        grad = grad.clone()\n        dist.all_reduce(grad, group=ctx.group)\n"
        "        return grad / dist.get_world_size(ctx.group), None")},
        "must_lose": ALL2, "must_keep": ALL1 + ALL3},
    # 9.3: every stage charged the whole model's activations per micro-batch (never divided by the stages)
    "forgets_to_divide": {"replace": {S3: edit(PIPE, "per_stage = bytes_per_microbatch // stages",
                                               "per_stage = bytes_per_microbatch")},
                          "must_lose": ALL3, "must_keep": ALL1 + ALL2},
    # 9.3: 1F1B counted as GPipe (every micro-batch in flight on every stage)
    "one_f_one_b_as_gpipe": {"replace": {S3: edit(PIPE, 'if schedule == "gpipe":',
                                                  'if schedule in ("gpipe", "1f1b"):')},
                             "must_lose": ALL3, "must_keep": ALL1 + ALL2},
    # 9.3: only the warm-up forwards counted (p - s - 1): the micro-batch whose forward precedes the first
    # backward is forgotten
    "warmup_only_off_by_one": {"replace": {S3: edit(PIPE, ONE_FB, "min(microbatches, stages - s - 1)")},
                               "must_lose": ALL3, "must_keep": ALL1 + ALL2},
    # 9.3: one micro-batch too many (p - s + 1)
    "one_too_many": {"replace": {S3: edit(PIPE, ONE_FB, "min(microbatches, stages - s + 1)")},
                     "must_lose": ALL3, "must_keep": ALL1 + ALL2},
    # 9.3: p - s even when there are fewer micro-batches than that
    "ignores_few_microbatches": {"replace": {S3: edit(PIPE, ONE_FB, "(stages - s)")},
                                 "must_lose": ALL3, "must_keep": ALL1 + ALL2},
    # 9.3: the stages reversed: the LAST stage taken to hold the most
    "stages_reversed": {"replace": {S3: edit(PIPE, ONE_FB, "min(microbatches, s + 1)")},
                        "must_lose": ALL3, "must_keep": ALL1 + ALL2},
    # 9.3: no check that the bytes split evenly: rounds down silently
    "no_bytes_check": {"replace": {S3: edit(PIPE, "    if bytes_per_microbatch % stages:", "    if False:")},
                       "must_lose": ALL3, "must_keep": ALL1 + ALL2},
}

# correct alternatives: every point kept
RIGHT = {
    # 9.1 with torch.chunk (views, then copied) and the row bias on the LAST rank; 9.2 as a reduce-scatter plus an
    # all-gather of a padded flat buffer (the same ring bytes as one all-reduce); 9.3 by walking the schedules
    "chunk_reduce_scatter_walk": {"replace": {
        S1: '''def _check(weight, rank, world_size, dim):
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if weight.shape[dim] % world_size:
        raise ValueError(f"weight.shape[{dim}] = {weight.shape[dim]} is not a multiple of world_size")


def column_parallel_linear(weight, bias, rank, world_size):
    _check(weight, rank, world_size, 0)
    w = torch.chunk(weight.detach(), world_size, dim=0)[rank].clone()
    b = None if bias is None else torch.chunk(bias.detach(), world_size)[rank].clone()
    return w, b


def row_parallel_linear(weight, bias, rank, world_size):
    _check(weight, rank, world_size, 1)
    w = torch.chunk(weight.detach(), world_size, dim=1)[rank].clone(memory_format=torch.contiguous_format)
    return w, (bias.detach().clone() if bias is not None and rank == world_size - 1 else None)''',
        S2: '''class ReduceScatterGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group):
        t = dist.get_world_size(group)
        flat = partial.reshape(-1)
        n = -(-flat.numel() // t)                             # elements per rank, the buffer padded
        padded = torch.zeros(n * t)
        padded[:flat.numel()] = flat
        mine = torch.empty(n)
        dist.reduce_scatter_tensor(mine, padded, group=group)
        out = torch.empty(n * t)
        dist.all_gather_into_tensor(out, mine, group=group)
        return out[:flat.numel()].reshape(partial.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def tp_mlp_forward(x, w1_shard, b1_shard, w2_shard, b2, group):
    h = F.gelu(x @ w1_shard.T + b1_shard)
    return ReduceScatterGather.apply(h @ w2_shard.T, group) + b2''',
        S3: '''def pipeline_activation_bytes(schedule, stages, microbatches, bytes_per_microbatch):
    if schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"unknown schedule {schedule!r}")
    if bytes_per_microbatch % stages != 0:
        raise ValueError("bytes_per_microbatch must be a multiple of the number of stages")
    out = []
    for s in range(stages):
        if schedule == "gpipe":
            order = "F" * microbatches + "B" * microbatches
        else:
            warm = min(stages - s - 1, microbatches)
            order = "F" * warm + "FB" * (microbatches - warm) + "B" * warm
        live = peak = 0
        for op in order:
            live += 1 if op == "F" else -1
            peak = max(peak, live)
        out.append(peak * (bytes_per_microbatch // stages))
    return out'''}},
    # 9.1 with index_select (a fresh tensor); 9.2 with a straight-through sum (the forward's value is the
    # all-reduced sum, the backward the identity) instead of an autograd.Function; 9.3 as a closed form per stage
    "index_select_straight_through": {"replace": {
        S1: edit(edit(SHARD, "    w = weight.detach()[rows].clone()",
                      "    w = weight.detach().index_select(0, torch.arange(rank * n, (rank + 1) * n))"),
                 "    w = weight.detach()[:, rank * n:(rank + 1) * n].clone()",
                 "    w = weight.detach().index_select(1, torch.arange(rank * n, (rank + 1) * n))"),
        S2: '''def tp_mlp_forward(x, w1_shard, b1_shard, w2_shard, b2, group):
    partial = F.linear(F.gelu(F.linear(x, w1_shard, b1_shard)), w2_shard)
    total = partial.detach().clone()
    dist.all_reduce(total, group=group)
    return partial + (total - partial.detach()) + b2          # value: the sum; gradient: straight to partial''',
        S3: '''def pipeline_activation_bytes(schedule, stages, microbatches, bytes_per_microbatch):
    if schedule not in {"gpipe", "1f1b"}:
        raise ValueError(f"schedule: expected 'gpipe' or '1f1b', got {schedule!r}")
    per_stage, rest = divmod(bytes_per_microbatch, stages)
    if rest:
        raise ValueError(f"bytes_per_microbatch ({bytes_per_microbatch}) must split evenly over {stages} stages")
    return [per_stage * (microbatches if schedule == "gpipe" else min(microbatches, stages - s))
            for s in range(stages)]'''}},
}
