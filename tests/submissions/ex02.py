"""Plausible-wrong submissions for exercise 02 and the points each must lose."""

ASSIGNMENT = "02_checkpointing"

_EVERY_K_HEAD = '''
class CheckpointEveryK(nn.Module):
    def __init__(self, blocks, k):
        super().__init__()
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"k must be a positive int, got {k!r}")
        self.blocks = nn.ModuleList(blocks)
        self.k = k

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i % self.k == 0:
                {CHECKPOINTED}
            else:
                x = block(x)
        return x
'''

# cuts the graph at every checkpoint: the blocks before it get no gradient
_EVERY_K_DETACH = _EVERY_K_HEAD.replace("{CHECKPOINTED}", "x = checkpoint(block, x.detach(), use_reentrant=False)")

# "checkpoints" by running the block under no_grad first, then normally: two forward calls, no memory saved
_EVERY_K_TWICE = _EVERY_K_HEAD.replace("{CHECKPOINTED}", '''with torch.no_grad():
                    block(x)                 # the "checkpoint" pass
                x = block(x)                 # ... and the real one, which stores everything''')

# the reentrant variant: when the input batch does not require grad, block 0's weights get no gradient
_EVERY_K_REENTRANT = _EVERY_K_HEAD.replace("{CHECKPOINTED}", "x = checkpoint(block, x, use_reentrant=True)")

# torch's checkpoint_sequential: right segments, but the last one is never checkpointed
_SQRT_CHECKPOINT_SEQUENTIAL = '''
def sqrt_segments(n):
    s = math.isqrt(n - 1) + 1
    q, r = divmod(n, s)
    out, start = [], 0
    for i in range(s):
        stop = start + q + (1 if i < r else 0)
        out.append((start, stop))
        start = stop
    return out


class SqrtCheckpointed(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.segments = sqrt_segments(len(self.blocks))

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint_sequential(self.blocks, len(self.segments), x, use_reentrant=False)
'''

# checkpoints every block instead of segments, and rounds sqrt(n) down: O(N) memory, wrong segment count
_SQRT_PER_BLOCK = '''
def sqrt_segments(n):
    k = max(1, math.isqrt(n))
    return [(i, min(i + k, n)) for i in range(0, n, k)]


class SqrtCheckpointed(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return x
'''

# greedy: recompute the layers with the lowest cost per byte until the plan fits (falls back to uniform spacing)
_PLANNER_GREEDY = '''
def plan_checkpoints(act_bytes, recompute_cost, budget):
    n = len(act_bytes)
    keep = [True] * n
    for i in sorted(range(n), key=lambda i: recompute_cost[i] / act_bytes[i]):
        if plan_peak(act_bytes, keep) <= budget:
            return keep
        keep[i] = False
    if plan_peak(act_bytes, keep) <= budget:
        return keep
    for k in range(1, n + 1):
        uniform = [(i + 1) % k == 0 for i in range(n)]
        if plan_peak(act_bytes, uniform) <= budget:
            return uniform
    raise ValueError(f"no plan fits the budget of {budget} bytes")
'''

# minimises the cost and never looks at the budget: keeps everything
_PLANNER_IGNORES_BUDGET = '''
def plan_checkpoints(act_bytes, recompute_cost, budget):
    return [True] * len(act_bytes)      # nothing to recompute: cost 0
'''

_GPT_HEAD = '''
class CheckpointedGPT(GPT):
    def forward(self, idx, targets=None):
        B, T = idx.shape
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        x = self.drop(x)
        rope = (self.rope_cos[:T], self.rope_sin[:T]) if self.cfg.pos == "rope" else None
        for block in self.blocks:
            {BLOCK}
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
'''

_GPT_NOTHING = _GPT_HEAD.replace("{BLOCK}", "x = block(x, rope)")
_GPT_DETACH = _GPT_HEAD.replace("{BLOCK}", "x = checkpoint(block, x.detach(), rope, use_reentrant=False)")
# the recomputation draws new dropout masks: only wrong when dropout > 0 (the hidden tests)
_GPT_NO_RNG = _GPT_HEAD.replace("{BLOCK}",
                                "x = checkpoint(block, x, rope, use_reentrant=False, preserve_rng_state=False)")

T1, T2, T3, T4 = ("task2_1_checkpoint_every_k", "task2_2_sqrt_segments", "task2_3_plan_checkpoints",
                  "task2_4_checkpointed_gpt")


def _both(task):
    return [f"{task}_visible", f"{task}_hidden"]


WRONG = {
    "every_k_detached_input": {"replace": {T1: _EVERY_K_DETACH}, "must_lose": _both(T1),
                               "must_keep": _both(T2) + _both(T3)},
    "every_k_forward_twice": {"replace": {T1: _EVERY_K_TWICE}, "must_lose": _both(T1),
                              "must_keep": _both(T2) + _both(T4)},
    "every_k_reentrant": {"replace": {T1: _EVERY_K_REENTRANT}, "must_lose": _both(T1),
                          "must_keep": _both(T3)},
    "sqrt_checkpoint_sequential": {"replace": {T2: _SQRT_CHECKPOINT_SEQUENTIAL}, "must_lose": _both(T2),
                                   "must_keep": _both(T1) + _both(T4)},
    "sqrt_per_block": {"replace": {T2: _SQRT_PER_BLOCK}, "must_lose": _both(T2),
                       "must_keep": _both(T3)},
    "planner_greedy": {"replace": {T3: _PLANNER_GREEDY}, "must_lose": _both(T3),
                       "must_keep": _both(T1) + _both(T2)},
    "planner_ignores_budget": {"replace": {T3: _PLANNER_IGNORES_BUDGET}, "must_lose": _both(T3),
                               "must_keep": _both(T4)},
    "gpt_nothing_checkpointed": {"replace": {T4: _GPT_NOTHING}, "must_lose": _both(T4),
                                 "must_keep": _both(T1) + _both(T3)},
    "gpt_detached_input": {"replace": {T4: _GPT_DETACH}, "must_lose": _both(T4),
                           "must_keep": _both(T2)},
    "gpt_rng_not_preserved": {"replace": {T4: _GPT_NO_RNG}, "must_lose": [f"{T4}_hidden"],
                              "must_keep": [f"{T4}_visible"] + _both(T1)},
}
