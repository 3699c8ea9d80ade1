"""Plausible-wrong submissions for exercise 10 and the points each must lose, and correct alternatives that must
keep every point. Each is the solution with one mistake made in it."""

from __future__ import annotations

from . import both, edit, solution_cells

ASSIGNMENT = "10_memory_planning"
_CELLS = solution_cells(ASSIGNMENT)
L, PL, B = "task10_1_lifetimes", "task10_2_plan_offsets", "task10_3_separable_block"
LIFE, PLAN, BLOCK = _CELLS[L], _CELLS[PL], _CELLS[B]

_VIEW = '''        elif kind == "view":                         # one more tensor on a live storage: no new bytes
            storage_of[tensor] = event[2]
            tensors_on[event[2]] += 1
'''
_FREE_AT = "                lifetimes[index_of.pop(storage)][2] = t\n"
_SORT = "    for _, delta in sorted(changes):                 # at one time, frees (negative) come before births\n"
_BUSY = "if lifetimes[j][1] < death and birth < lifetimes[j][2])"

WRONG = {
    # ----------------------------------------------------------------------------- task 10.1: lifetimes
    # a view is taken for a new tensor with new bytes: one lifetime too many per view
    "view_counted_as_allocation": {"replace": {L: edit(LIFE, _VIEW, _VIEW + (
        "            lifetimes.append([lifetimes[index_of[event[2]]][0], t, len(events)])   # a new tensor: new bytes\n"))},
        "must_lose": both(L), "must_keep": both(PL) + both(B)},
    # an in-place op's result is taken for a new allocation of the same size (as an out-of-place op would make)
    "inplace_counted_as_allocation": {"replace": {L: edit(LIFE, "        # \"inplace\" writes into a storage that "
                                                                "exists: nothing is allocated or freed\n",
                                                          '''        elif kind == "inplace":                      # the op's result: new bytes
            lifetimes.append([lifetimes[index_of[storage_of[tensor]]][0], t, len(events)])
''')},
        "must_lose": both(L), "must_keep": both(PL) + both(B)},
    # views ignored: the storage dies with the tensor that allocated it, though a view still holds it
    "views_do_not_keep_storage": {"replace": {L: edit(edit(
        LIFE, _VIEW, '''        elif kind == "view":                         # a view is no allocation: nothing to do
            pass
'''), "            storage = storage_of.pop(tensor)\n", "            storage = storage_of.pop(tensor, None)\n"
             "            if storage is None:                      # a view's free: not an allocation's\n"
             "                continue\n")},
        "must_lose": both(L), "must_keep": both(PL) + both(B)},
    # death one event late: the free event's index + 1
    "death_one_late": {"replace": {L: edit(LIFE, _FREE_AT, "                lifetimes[index_of.pop(storage)][2] = t + 1\n")},
                       "must_lose": both(L), "must_keep": both(PL) + both(B)},
    # a storage never freed dies at the last event instead of len(events)
    "never_freed_dies_at_last_event": {"replace": {L: edit(LIFE, "lifetimes.append([nbytes, t, len(events)])",
                                                           "lifetimes.append([nbytes, t, len(events) - 1])")},
                                       "must_lose": both(L), "must_keep": both(PL) + both(B)},
    # lifetimes kept in a dict by storage id: a storage id used again overwrites the first lifetime
    "one_lifetime_per_storage_id": {"replace": {L: edit(edit(edit(edit(edit(
        LIFE, "    lifetimes = []                                   # [size, birth, death] per alloc, in order\n",
        "    lifetimes = {}                                   # storage id -> [size, birth, death]\n"),
        "            index_of[storage] = len(lifetimes)       # a storage id used again starts a new lifetime\n", ""),
        "            lifetimes.append([nbytes, t, len(events)])", "            lifetimes[storage] = [nbytes, t, len(events)]"),
        "lifetimes[index_of.pop(storage)][2] = t", "lifetimes[storage][2] = t"),
        "    return [tuple(lt) for lt in lifetimes]", "    return [tuple(lt) for lt in lifetimes.values()]")},
        "must_lose": both(L), "must_keep": both(PL) + both(B)},
    # an empty tensor "holds no memory", so it gets no lifetime
    "empty_tensors_left_out": {"replace": {L: edit(LIFE, "    return [tuple(lt) for lt in lifetimes]",
                                                   "    return [tuple(lt) for lt in lifetimes if lt[0] > 0]")},
                               "must_lose": both(L), "must_keep": both(PL) + both(B)},
    # sorted by time only: at equal times the births (listed first) come before the frees
    "bound_births_before_frees": {"replace": {L: edit(LIFE, _SORT, "    for _, delta in sorted(changes, key=lambda c: "
                                                                   "c[0]):\n")},
                                  "must_lose": both(L), "must_keep": both(PL) + both(B)},
    # the bound as the sum of all sizes
    "bound_sum_of_sizes": {"replace": {L: edit(LIFE, "    live = peak = 0\n",
                                               "    return sum(size for size, _, _ in lifetimes)\n    live = peak = 0\n")},
                           "must_lose": both(L), "must_keep": both(PL) + both(B)},
    # a sweep in list order, as if the lifetimes came sorted by birth
    "bound_assumes_sorted_input": {"replace": {L: edit(LIFE, "    live = peak = 0\n", '''    peak, alive = 0, []
    for size, birth, death in lifetimes:             # in the order given
        alive = [(s, d) for s, d in alive if d > birth] + [(size, death)]
        peak = max(peak, sum(s for s, _ in alive))
    return peak
    live = peak = 0
''')},
        "must_lose": both(L), "must_keep": both(PL) + both(B)},
    # right for every list but the empty one: max() of nothing raises
    "bound_crashes_on_no_tensors": {"replace": {L: edit(LIFE, "    live = peak = 0\n",
                                                        "    return max(sum(s for s, b, d in lifetimes if b <= t < d) "
                                                        "for _, t, _ in lifetimes)\n    live = peak = 0\n")},
                                    "must_lose": both(L), "must_keep": both(PL) + both(B)},

    # ----------------------------------------------------------------------------- task 10.2: the planner
    # every tensor clear of every tensor placed before it, alive or not: a bump allocator, no reuse at all
    "plan_ignores_lifetimes": {"replace": {PL: edit(PLAN, _BUSY, ")")},
                               "must_lose": both(PL), "must_keep": both(L) + both(B)},
    # first fit in order of birth: what an allocator does, without looking ahead
    "plan_in_order_of_birth": {"replace": {PL: edit(PLAN, "key=lambda i: (-lifetimes[i][0], lifetimes[i][1], i)",
                                                    "key=lambda i: (lifetimes[i][1], i)")},
                               "must_lose": both(PL), "must_keep": both(L) + both(B)},
    # closed intervals: a tensor that dies at t is taken to clash with one born at t
    "plan_closed_intervals": {"replace": {PL: edit(PLAN, _BUSY,
                                                   "if lifetimes[j][1] <= death and birth <= lifetimes[j][2])")},
                              "must_lose": both(PL), "must_keep": both(L) + both(B)},
    # checks only the tensors born while it is alive, not those born before it and still alive
    "plan_misses_earlier_tensors": {"replace": {PL: edit(PLAN, _BUSY, "if birth <= lifetimes[j][1] < death)")},
                                    "must_lose": both(PL), "must_keep": both(L) + both(B)},
    # alignment ignored: a tensor goes right above the block below it
    "plan_ignores_alignment": {"replace": {PL: edit(PLAN, "at = max(at, -(-end // alignment) * alignment)",
                                                    "at = max(at, end)")},
                               "must_lose": both(PL), "must_keep": both(L) + both(B)},
    # the arena reported as the sum of the sizes, whatever the offsets
    "plan_arena_sum_of_sizes": {"replace": {PL: edit(PLAN, "    arena = max((offsets[i] + lifetimes[i][0] for i in "
                                                           "placed), default=0)",
                                                     "    arena = sum(size for size, _, _ in lifetimes)")},
                                "must_lose": both(PL), "must_keep": both(L) + both(B)},
    # right for every trace but the empty one: max() of nothing raises
    "plan_crashes_on_no_tensors": {"replace": {PL: edit(PLAN, "placed), default=0)", "placed))")},
                                   "must_lose": both(PL), "must_keep": both(L) + both(B)},

    # ----------------------------------------------------------------------------- task 10.3: the block
    # a bias in each conv: wasted parameters (batch norm subtracts the mean)
    "block_conv_bias": {"replace": {B: edit(edit(BLOCK, "groups=c_in, bias=False)", "groups=c_in)"),
                                            "nn.Conv2d(c_in, c_out, 1, bias=False)", "nn.Conv2d(c_in, c_out, 1)")},
                        "must_lose": both(B), "must_keep": both(L) + both(PL)},
    # the 3x3 conv is not depthwise: groups forgotten, a standard convolution's weights
    "block_not_depthwise": {"replace": {B: edit(BLOCK, "padding=1, groups=c_in, bias=False)", "padding=1, bias=False)")},
                            "must_lose": both(B), "must_keep": both(L) + both(PL)},
    # the stride on the pointwise conv: the depthwise half runs at the input's side
    "block_stride_on_pointwise": {"replace": {B: edit(edit(BLOCK, "nn.Conv2d(c_in, c_in, 3, stride, padding=1",
                                                           "nn.Conv2d(c_in, c_in, 3, 1, padding=1"),
                                                      "nn.Conv2d(c_in, c_out, 1, bias=False)",
                                                      "nn.Conv2d(c_in, c_out, 1, stride, bias=False)")},
                                  "must_lose": both(B), "must_keep": both(L) + both(PL)},
    # batch norms without their weights and biases
    "block_norms_not_affine": {"replace": {B: edit(edit(BLOCK, "nn.BatchNorm2d(c_in)", "nn.BatchNorm2d(c_in, affine=False)"),
                                                   "nn.BatchNorm2d(c_out)", "nn.BatchNorm2d(c_out, affine=False)")},
                               "must_lose": both(B), "must_keep": both(L) + both(PL)},
    # the depthwise half recomputed in backward to save memory: its batch norm's statistics update twice
    "block_checkpoints_depthwise_half": {"replace": {B: edit(
        BLOCK, "        h = F.relu(self.bn1(self.depthwise(x)), inplace=True)",
        "        h = torch.utils.checkpoint.checkpoint(lambda x: F.relu(self.bn1(self.depthwise(x))), x,\n"
        "                                              use_reentrant=False)")},
        "must_lose": both(B), "must_keep": both(L) + both(PL)},
    # predicts two kept tensors, as for a standard convolution
    "predict_two_tensors": {"replace": {B: edit(BLOCK, "    kept = 2 * c_in * plane + 2 * c_out * plane",
                                                "    kept = 2 * c_out * plane")},
                            "must_lose": both(B), "must_keep": both(L) + both(PL)},
    # predicts the depthwise conv's output at the input's side
    "predict_depthwise_at_input_side": {"replace": {B: edit(BLOCK, "    kept = 2 * c_in * plane + 2 * c_out * plane",
                                                            "    kept = 2 * c_in * 4 * batch * side * side + "
                                                            "2 * c_out * plane")},
                                        "must_lose": both(B), "must_keep": both(L) + both(PL)},
    # side // stride: right for even sides only
    "predict_floor_side": {"replace": {B: edit(BLOCK, "    out = (side - 1) // stride + 1", "    out = side // stride")},
                           "must_lose": both(B), "must_keep": both(L) + both(PL)},
    # the input counted as kept by the block
    "predict_counts_the_input": {"replace": {B: edit(BLOCK, "    return params, kept",
                                                     "    return params, kept + 4 * batch * c_in * side * side")},
                                 "must_lose": both(B), "must_keep": both(L) + both(PL)},
    # the batch norms' running mean and variance counted as parameters
    "predict_running_stats_as_params": {"replace": {B: edit(BLOCK, "2 * (c_in + c_out))    # filters",
                                                            "4 * (c_in + c_out))    # filters")},
                                        "must_lose": both(B), "must_keep": both(L) + both(PL)},
}

# correct alternatives: every point kept
RIGHT = {
    # the tensors on each storage as a set; the bound from the births and deaths sorted apart (two pointers)
    "lifetimes_with_sets": {"replace": {L: '''def tensor_lifetimes(events):
    out, where, on = [], {}, {}
    for t, e in enumerate(events):
        if e[0] == "alloc":
            where[e[2]] = len(out)
            on[e[2]] = {e[1]}
            out.append((e[3], t, len(events)))
        elif e[0] == "view":
            on[e[2]].add(e[1])
        elif e[0] == "free":
            s = next(s for s, ts in on.items() if e[1] in ts)
            on[s].discard(e[1])
            if not on[s]:
                size, birth, _ = out[where[s]]
                out[where.pop(s)] = (size, birth, t)
                del on[s]
    return out


def live_bytes_bound(lifetimes):
    births = sorted((b, s) for s, b, _ in lifetimes)
    deaths = sorted((d, s) for s, _, d in lifetimes)
    live = peak = j = 0
    for b, s in births:
        while j < len(deaths) and deaths[j][0] <= b:
            live -= deaths[j][1]
            j += 1
        live += s
        peak = max(peak, live)
    return peak'''}},
    # TFLite's gap rule: the smallest gap that holds the tensor
    "plan_best_fit": {"replace": {PL: edit(PLAN, '''        at = 0
        for start, end in busy:
            if at + size <= start:                   # the gap below this block holds it
                break
            at = max(at, -(-end // alignment) * alignment)     # the first aligned byte above the block
        offsets[i] = at''', '''        at, best, gap = 0, None, None
        for start, end in busy:
            if at + size <= start and (gap is None or start - at < gap):
                best, gap = at, start - at           # the smallest gap that holds it
            at = max(at, -(-end // alignment) * alignment)
        offsets[i] = at if best is None else best''')}},
    # equal sizes in the other order: the latest birth first
    "plan_other_tie_break": {"replace": {PL: edit(PLAN, "key=lambda i: (-lifetimes[i][0], lifetimes[i][1], i)",
                                                  "key=lambda i: (-lifetimes[i][0], -lifetimes[i][1], -i)")}},
    # the layers as modules in an nn.Sequential, ReLUs not in place (they keep the same tensors)
    "block_sequential": {"replace": {B: '''class SeparableBlock(nn.Module):
    def __init__(self, c_in, c_out, stride=1):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(c_in, c_in, kernel_size=3, stride=stride, padding=1, groups=c_in, bias=False),
            nn.BatchNorm2d(c_in), nn.ReLU(),
            nn.Conv2d(c_in, c_out, kernel_size=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU())

    def forward(self, x):
        return self.body(x)


def block_bytes(c_in, c_out, side, batch, stride):
    s = -(-side // stride)
    stats = 2 * 4 * (c_in + c_out)                   # the norms' saved mean and inverse std, counted
    return 4 * (9 * c_in + c_in * c_out + 2 * c_in + 2 * c_out), 4 * batch * s * s * 2 * (c_in + c_out) + stats'''}},
}
