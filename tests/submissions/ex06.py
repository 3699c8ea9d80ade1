"""Plausible-wrong submissions for exercise 06 and the points each must lose, and correct alternatives that
must keep every point. Each is the solution with one mistake made in it; where two mistakes sit in different
tasks they share one submission (fewer rank groups to start). Task 6.2 subclasses the task 6.1 class, so a
mistake in 6.1's constructor or step() loses 6.2 too; a mistake in 6.1's reduce_gradients() (which 6.2
overrides) does not."""

from __future__ import annotations

from . import both, edit, solution_cells

ASSIGNMENT = "06_zero"
_CELLS = solution_cells(ASSIGNMENT)
S1, S2, S3 = "task6_1_sharded_optimizer", "task6_2_reduce_scatter", "task6_3_rank_memory"
ZERO1, ZERO2, MEM = (_CELLS[k] for k in (S1, S2, S3))
ALL1, ALL2, ALL3 = both(S1), both(S2), both(S3)

GREEDY = """        for p in sorted(trainable, key=lambda p: p.numel() * p.element_size(), reverse=True):
            r = load.index(min(load))                   # the least loaded rank (the lowest on a tie)
            self.owner[p] = r
            load[r] += p.numel() * p.element_size()
"""
BROADCAST = """        for p, r in self.owner.items():                 # the same order on every rank
            dist.broadcast(p, src=r)"""
DEDUPE = """        seen = set()                                    # a shared tensor listed twice is one parameter
        groups = [dict(g, params=[p for p in g["params"] if not (id(p) in seen or seen.add(id(p)))])
                  for g in groups]
"""
MEM_LOAD = """    psi, mine = sum(numels), max(load)"""

WRONG = {
    # every rank steps every parameter: right values, N copies of the optimizer state
    "no_sharding": {"replace": {S1: edit(ZERO1, 'if self.owner.get(p) == self.rank]', ']')},
                    "must_lose": ALL1, "must_keep": ALL2 + ALL3},   # ZeRO-2: non-owners have no grad to step
    # the largest tensors all on the first rank(s): contiguous chunks of the size-sorted list
    "unbalanced_split": {"replace": {S1: edit(ZERO1, GREEDY, """        ordered = sorted(trainable, key=lambda p: p.numel() * p.element_size(), reverse=True)
        chunk = -(-len(ordered) // self.world)
        self.owner = {p: i // chunk for i, p in enumerate(ordered)}
""")}, "must_lose": ALL1 + ALL2, "must_keep": ALL3},
    # owners dealt round-robin over the size-sorted tensors, not each to the least-loaded rank: training is right,
    # the assignment is not the one the text asks for
    "owners_round_robin": {"replace": {S1: edit(ZERO1, GREEDY, """        ordered = sorted(trainable, key=lambda p: p.numel() * p.element_size(), reverse=True)
        self.owner = {p: i % self.world for i, p in enumerate(ordered)}
""")}, "must_lose": ALL1, "must_keep": ALL2 + ALL3},
    # greedy in list order, not largest first
    "owners_greedy_in_list_order": {"replace": {S1: edit(
        ZERO1, "for p in sorted(trainable, key=lambda p: p.numel() * p.element_size(), reverse=True):",
        "for p in trainable:")}, "must_lose": ALL1, "must_keep": ALL2 + ALL3},
    # balanced by element count, not bytes: the same on single-dtype models (the visible case), not on the hidden
    # AdamW case's mix of float64 and float32 layers
    "owners_balanced_by_element_count": {"replace": {S1: edit(ZERO1, GREEDY, """        for p in sorted(trainable, key=lambda p: p.numel(), reverse=True):
            r = load.index(min(load))
            self.owner[p] = r
            load[r] += p.numel()
""")}, "must_lose": [f"{S1}_hidden"], "must_keep": [f"{S1}_visible"] + ALL2 + ALL3},
    # frozen parameters get owners too (and shift the balance of the others)
    "frozen_parameters_owned": {"replace": {S1: edit(
        ZERO1, 'trainable = [p for g in self.param_groups for p in g["params"] if p.requires_grad]',
        'trainable = [p for g in self.param_groups for p in g["params"]]')}, "must_lose": ALL1,
        "must_keep": ALL2 + ALL3},
    # params taken to be parameter-group dicts always: a flat list of tensors (the other form the text allows)
    # crashes the constructor; the visible case has groups, every hidden run a flat list
    "param_groups_only": {"replace": {S1: edit(ZERO1, """        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
""", "")}, "must_lose": [f"{S1}_hidden", f"{S2}_hidden"], "must_keep": [f"{S1}_visible", f"{S2}_visible"] + ALL3},
    # the updated shards never leave their owner
    "no_broadcast": {"replace": {S1: edit(ZERO1, BROADCAST, "        pass")}, "must_lose": ALL1 + ALL2, "must_keep": ALL3},
    # a shared weight listed twice gets two owners and is stepped (and all-reduced) twice
    "shared_stepped_twice": {"replace": {S1: edit(ZERO1, DEDUPE, "")}, "must_lose": ALL1 + ALL2,
                             "must_keep": ALL3},
    # 6.1: the gradient divided by N twice; 6.3: Psi / N, as if tensors split evenly
    "average_twice_and_psi_over_n": {
        "replace": {S1: edit(ZERO1, "p.grad /= self.world\n", "p.grad /= self.world\n                p.grad /= self.world\n"),
                    S3: edit(MEM, MEM_LOAD, "    psi, mine = sum(numels), sum(numels) // world_size")},
        "must_lose": ALL1 + ALL3, "must_keep": ALL2},
    # 6.1: summed, never divided; 6.3: K = 16 (the whole 2 + 2 + 12 taken as optimizer state)
    "sum_no_divide_and_k16": {
        "replace": {S1: edit(ZERO1, "                p.grad /= self.world\n", ""),
                    S3: edit(MEM, '"bf16_adam": (2, 2, 12)', '"bf16_adam": (2, 2, 16)')},
        "must_lose": ALL1 + ALL3, "must_keep": ALL2},
    # 6.1: a frozen or unused parameter (grad None) crashes the all-reduce; 6.3: K = 4 (only the master copy)
    "frozen_crash_and_k4": {
        "replace": {S1: edit(ZERO1, "            if p.grad is not None:\n                dist.all_reduce(p.grad)",
                             "            if True:\n                dist.all_reduce(p.grad)"),
                    S3: edit(MEM, '"bf16_adam": (2, 2, 12)', '"bf16_adam": (2, 2, 4)')},
        "must_lose": ALL1 + ALL3, "must_keep": ALL2},
    # 6.2: ZeRO-1's all-reduce kept (every rank receives every gradient and keeps it);
    # 6.3: stage 2 forgets that the gradients are sharded
    "zero2_allreduce_and_stage2_full_grads": {
        "replace": {S2: """class ZeRO2Optimizer(ShardedOptimizer):
    def reduce_gradients(self):
        super().reduce_gradients()""",
                    S3: edit(MEM, "(mine if stage >= 2 else psi)", "(mine if stage >= 3 else psi)")},
        "must_lose": ALL2 + ALL3, "must_keep": ALL1},
    # 6.2: reduced to the owner, but the other ranks keep their (partial-sum) gradients
    "zero2_keeps_grads": {"replace": {S2: edit(ZERO2, "                p.grad = None", "                pass")},
                          "must_lose": ALL2, "must_keep": ALL1 + ALL3},
    # a scheduler's lr changes (written into the outer optimizer's param_groups) never reach the inner optimizer
    "ignores_scheduler": {"replace": {S1: edit(ZERO1, """            for i, g in zip(self.group_of, self.inner.param_groups):
                # a scheduler changes the lr in self.param_groups: pass every setting on before stepping
                g.update({k: v for k, v in self.param_groups[i].items() if k != "params"})
""", "")}, "must_lose": ALL1 + ALL2, "must_keep": ALL3},
    # 6.3: rank 0's load (it takes the largest tensor) instead of the fullest rank's
    "rank0_load": {"replace": {S3: edit(MEM, MEM_LOAD, "    psi, mine = sum(numels), load[0]")},
                   "must_lose": ALL3, "must_keep": ALL1 + ALL2},
    # 6.3: greedy in list order instead of largest first
    "list_order_greedy": {"replace": {S3: edit(MEM, "for n in sorted(numels, reverse=True):", "for n in numels:")},
                          "must_lose": ALL3, "must_keep": ALL1 + ALL2},
    # the library's optimizer and memlab's formula instead of the learner's own: off limits, caught by the profiler
    "library_shortcuts": {
        "replace": {S1: "from torch.distributed.optim import ZeroRedundancyOptimizer as ShardedOptimizer",
                    S3: """def rank_memory(numels, stage, world_size, layout):
    total = int(memlab.core.estimate.zero_model_state_bytes(sum(numels), world_size, stage))
    return {"params": 0, "grads": 0, "optimizer": total, "total": total}"""},
        "must_lose": ALL1 + ALL2 + ALL3},
}

# correct alternatives: every point kept
RIGHT = {
    # the parameters all-gathered as one padded flat buffer per rank and dtype (the hidden 6.1 case mixes float64 and
    # float32 layers), and ZeRO-2 as a reduce-scatter of padded flat gradient buffers
    "all_gather_reduce_scatter": {"replace": {
        S1: edit(ZERO1, BROADCAST, """        for dtype in sorted({p.dtype for p in self.owner}, key=str):    # the same order on every rank
            mine = {r: [p for p, o in self.owner.items() if o == r and p.dtype == dtype] for r in range(self.world)}
            size = max(sum(p.numel() for p in ps) for ps in mine.values())
            flat = torch.zeros(size, dtype=dtype)
            if mine[self.rank]:
                cat = torch.cat([p.reshape(-1) for p in mine[self.rank]])
                flat[:cat.numel()] = cat
            out = [torch.empty(size, dtype=dtype) for _ in range(self.world)]
            dist.all_gather(out, flat)
            for r, ps in mine.items():
                offset = 0
                for p in ps:
                    p.copy_(out[r][offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
"""),
        S2: """class ZeRO2Optimizer(ShardedOptimizer):
    def reduce_gradients(self):
        mine = {r: [p for p, o in self.owner.items() if o == r and p.grad is not None] for r in range(self.world)}
        size = max(sum(p.numel() for p in ps) for ps in mine.values())
        if size == 0:
            return
        chunks = []
        for r in range(self.world):
            flat = torch.zeros(size)
            if mine[r]:
                cat = torch.cat([p.grad.reshape(-1) for p in mine[r]])
                flat[:cat.numel()] = cat
            chunks.append(flat)
        out = torch.empty(size)
        dist.reduce_scatter(out, chunks)
        out /= self.world
        offset = 0
        for p in mine[self.rank]:
            p.grad = out[offset:offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        for p, o in self.owner.items():
            if o != self.rank:
                p.grad = None"""}},
}
