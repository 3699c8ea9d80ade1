"""Plausible-wrong submissions for exercise 02 and the points each must lose."""

from . import edit, solution_cells

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
    def run_blocks(self, x, rope):
        for block in self.blocks:
            {BLOCK}
        return x
'''

_GPT_NOTHING = _GPT_HEAD.replace("{BLOCK}", "x = block(x, rope)")
_GPT_DETACH = _GPT_HEAD.replace("{BLOCK}", "x = checkpoint(block, x.detach(), rope, use_reentrant=False)")
# the recomputation draws new dropout masks: only wrong when dropout > 0 (the hidden tests)
_GPT_NO_RNG = _GPT_HEAD.replace("{BLOCK}",
                                "x = checkpoint(block, x, rope, use_reentrant=False, preserve_rng_state=False)")
# use_reentrant=True: right while the blocks' input requires grad; with the token embedding frozen (a hidden case)
# the blocks get no gradient
_GPT_REENTRANT = _GPT_HEAD.replace("{BLOCK}", "x = checkpoint(block, x, rope, use_reentrant=True)")
# the right segments, but every block under its own checkpoint: each block still runs twice, one input per block
# is kept instead of one per segment
_SQRT_EACH_BLOCK_IN_ITS_SEGMENT = edit(solution_cells(ASSIGNMENT)["task2_2_sqrt_segments"],
                                       "            x = checkpoint(run, start, stop, x, use_reentrant=False)",
                                       "            for i in range(start, stop):\n"
                                       "                x = checkpoint(self.blocks[i], x, use_reentrant=False)")

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
    "gpt_reentrant_checkpoint": {"replace": {T4: _GPT_REENTRANT}, "must_lose": [f"{T4}_hidden"],
                                 "must_keep": [f"{T4}_visible"] + _both(T2)},
    "sqrt_each_block_checkpointed_alone": {"replace": {T2: _SQRT_EACH_BLOCK_IN_ITS_SEGMENT},
                                           "must_lose": [f"{T2}_visible", f"{T2}_hidden"], "must_keep": _both(T4)},
    "gpt_rng_not_preserved": {"replace": {T4: _GPT_NO_RNG}, "must_lose": [f"{T4}_hidden"],
                              "must_keep": [f"{T4}_visible"] + _both(T1)},
}


# ----------------------------------------------------------------------------- mistakes the old cases could miss
# keeps the blocks as a plain attribute: registered when given an nn.Sequential / nn.ModuleList, lost for a list
_EVERY_K_UNREGISTERED = _EVERY_K_HEAD.replace("self.blocks = nn.ModuleList(blocks)", "self.blocks = blocks").replace(
    "{CHECKPOINTED}", "x = checkpoint(block, x, use_reentrant=False)")

_SQRT_UNREGISTERED = _SQRT_CHECKPOINT_SEQUENTIAL.replace(
    "self.blocks = nn.ModuleList(blocks)", "self.blocks = blocks").replace(
    "        return torch.utils.checkpoint.checkpoint_sequential(self.blocks, len(self.segments), x, use_reentrant=False)",
    """        for start, stop in self.segments:
            x = checkpoint(self._run, start, stop, x, use_reentrant=False)
        return x

    def _run(self, start, stop, x):
        for block in self.blocks[start:stop]:
            x = block(x)
        return x""")

# the dynamic programme without its "keep nothing more" exit: every plan it finds keeps the last layer (correct:
# keeping the last layer instead of recomputing it never costs more and never raises the peak)
_PLANNER_KEEPS_LAST = """
def plan_checkpoints(act_bytes, recompute_cost, budget):
    m, c, n = list(act_bytes), list(recompute_cost), len(act_bytes)
    states = [dict() for _ in range(n + 1)]
    states[0][0] = (0, [])
    for s in range(n):
        for kept, (cost, keep) in sorted(states[s].items()):
            run = run_cost = 0
            for j in range(s, n):
                if kept + run > budget:
                    break
                if kept + m[j] <= budget:
                    new = (cost + run_cost, keep + [False] * (j - s) + [True])
                    old = states[j + 1].get(kept + m[j])
                    if old is None or new[0] < old[0]:
                        states[j + 1][kept + m[j]] = new
                run, run_cost = run + m[j], run_cost + c[j]
    if not states[n]:
        raise ValueError(f"no checkpoint plan fits the budget of {budget} bytes")
    return min(states[n].values(), key=lambda v: v[0])[1]
"""

WRONG.update({
    "every_k_blocks_not_registered": {"replace": {T1: _EVERY_K_UNREGISTERED}, "must_lose": [f"{T1}_hidden"],
                                      "must_keep": [f"{T1}_visible"] + _both(T3)},
    "sqrt_blocks_not_registered": {"replace": {T2: _SQRT_UNREGISTERED}, "must_lose": [f"{T2}_hidden"],
                                   "must_keep": [f"{T2}_visible"] + _both(T1)},
})


# ----------------------------------------------------------------------------- k validated too loosely, free layers, rope
_K_CHECK = "if isinstance(k, bool) or not isinstance(k, int) or k < 1:"
_EVERY_K_OK = _EVERY_K_HEAD.replace("{CHECKPOINTED}", "x = checkpoint(block, x, use_reentrant=False)")
# only the sign is checked: a float, a bool pass, a string raises TypeError
_EVERY_K_SIGN_ONLY = edit(_EVERY_K_OK, _K_CHECK, "if k < 1:")
# k converted with int(): 2.0, True and "2" become valid
_EVERY_K_INT_COERCED = edit(_EVERY_K_OK, _K_CHECK, "k = int(k)\n        if k < 1:")
# isinstance(k, int) without excluding bool: True passes as 1
_EVERY_K_BOOL_ACCEPTED = edit(_EVERY_K_OK, _K_CHECK, "if not isinstance(k, int) or k < 1:")

# the dynamic programme never keeps a layer that is free to recompute (why keep what costs nothing?): wrong when
# keeping it is what splits a recomputed run into two that fit
_PLANNER_NEVER_KEEPS_FREE = edit(solution_cells(ASSIGNMENT)[T3], "if kept + m[j] <= budget:      # keep layer j's output",
                                 "if kept + m[j] <= budget and c[j] > 0:")

# ignores the rope tables GPT.forward sliced to T and passes the full (block_size, head_dim) buffers
_GPT_ROPE_UNSLICED = _GPT_HEAD.replace(
    "{BLOCK}", "x = checkpoint(block, x, None if rope is None else (self.rope_cos, self.rope_sin), "
               "use_reentrant=False)")

WRONG.update({
    "every_k_sign_check_only": {"replace": {T1: _EVERY_K_SIGN_ONLY}, "must_lose": _both(T1),
                                "must_keep": _both(T3)},
    "every_k_int_coerced": {"replace": {T1: _EVERY_K_INT_COERCED}, "must_lose": _both(T1),
                            "must_keep": _both(T2)},
    "every_k_bool_accepted": {"replace": {T1: _EVERY_K_BOOL_ACCEPTED}, "must_lose": _both(T1),
                              "must_keep": _both(T4)},
    "planner_never_keeps_free_layers": {"replace": {T3: _PLANNER_NEVER_KEEPS_FREE}, "must_lose": [f"{T3}_hidden"],
                                        "must_keep": [f"{T3}_visible"] + _both(T1)},
    "gpt_rope_tables_unsliced": {"replace": {T4: _GPT_ROPE_UNSLICED}, "must_lose": [f"{T4}_hidden"],
                                 "must_keep": [f"{T4}_visible"] + _both(T2)},
})


# ----------------------------------------------------------------------------- correct alternatives: full marks
_EVERY_K_TRAINING_ONLY = _EVERY_K_HEAD.replace("if i % self.k == 0:", "if i % self.k == 0 and self.training:").replace(
    "{CHECKPOINTED}", "x = checkpoint(block, x, use_reentrant=False)")

_SQRT_SEQUENTIAL_SEGMENTS = """
def sqrt_segments(n):
    s = math.isqrt(n - 1) + 1
    q, r = divmod(n, s)
    sizes = [q] * (s - r) + [q + 1] * r          # the longer segments last
    out, start = [], 0
    for size in sizes:
        out.append((start, start + size))
        start += size
    return out


class SqrtCheckpointed(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x):
        for start, stop in sqrt_segments(len(self.blocks)):
            x = checkpoint(nn.Sequential(*self.blocks[start:stop]), x, use_reentrant=False)
        return x
"""

# exhaustive recursion over (layer, bytes kept, bytes of the current run), memoised
_PLANNER_MEMO = """
import functools

def plan_checkpoints(act_bytes, recompute_cost, budget):
    m, c, n = list(act_bytes), list(recompute_cost), len(act_bytes)

    @functools.lru_cache(maxsize=None)
    def best(i, kept, run):
        if i == n:
            return (0, ())
        options = []
        if kept + m[i] <= budget:
            sub = best(i + 1, kept + m[i], 0)
            if sub is not None:
                options.append((sub[0], (True,) + sub[1]))
        if kept + run + m[i] <= budget:
            sub = best(i + 1, kept, run + m[i])
            if sub is not None:
                options.append((sub[0] + c[i], (False,) + sub[1]))
        return min(options) if options else None

    found = best(0, 0, 0)
    if found is None:
        raise ValueError(f"no plan fits the budget of {budget} bytes")
    return list(found[1])
"""

_GPT_TRAINING_ONLY = _GPT_HEAD.replace("{BLOCK}", """if self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)""")
_GPT_PARTIAL = "import functools\n" + _GPT_HEAD.replace(
    "{BLOCK}", "x = checkpoint(functools.partial(block, rope=rope), x, use_reentrant=False)")

RIGHT = {
    "every_k_training_mode_only": {"replace": {T1: _EVERY_K_TRAINING_ONLY}, "must_lose": [], "must_keep": _both(T1)},
    "sqrt_sequential_segments_longer_last": {"replace": {T2: _SQRT_SEQUENTIAL_SEGMENTS}, "must_lose": [],
                                             "must_keep": _both(T2)},
    "planner_always_keeps_last": {"replace": {T3: _PLANNER_KEEPS_LAST}, "must_lose": [], "must_keep": _both(T3)},
    "planner_memoised_recursion": {"replace": {T3: _PLANNER_MEMO}, "must_lose": [], "must_keep": _both(T3)},
    "gpt_training_mode_only": {"replace": {T4: _GPT_TRAINING_ONLY}, "must_lose": [], "must_keep": _both(T4)},
    "gpt_partial_rope": {"replace": {T4: _GPT_PARTIAL}, "must_lose": [], "must_keep": _both(T4)},
}
