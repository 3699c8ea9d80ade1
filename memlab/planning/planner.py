"""Static memory planning: give every tensor of a step an offset in one arena, so that no two tensors alive at
the same time overlap, and make the arena small.

A plan is a list of offsets, one per `Lifetime(size, birth, death)` (bytes; the tensor is alive on the
half-open event interval [birth, death)). Two tensors *conflict* when both are non-empty and their intervals
intersect; a valid plan puts conflicting tensors at disjoint byte ranges. The arena is max(offset + size).

  live_bytes_peak   the most bytes alive at one moment: no plan can use less (a lower bound)
  greedy_by_size    largest tensor first, each into the best-fitting gap among the tensors it conflicts with
                    (TFLite's ArenaPlanner + SimpleMemoryArena::Allocate; XLA's GlobalDecreasingSizeBestFitHeap)
  first_fit         in allocation order (lifetime order), each at the lowest offset that fits: what an allocator
                    that never moves a block and cannot see the future does
  optimal_offsets   the smallest arena, by branch and bound over placement orders (small traces only)
  plan_conflicts, check_plan, arena_size   validating a plan

With all sizes equal the problem is colouring an interval graph (a colour is a slot of the arena): first fit in
order of birth uses as many slots as the most tensors alive at once, which is optimal. With sizes it is dynamic
storage allocation, NP-hard in general (Garey and Johnson 1979, problem SR2): the live-bytes peak stays a lower
bound, but it is not always reachable, and the heuristics can miss the optimum.

Why the brute force is exact: take an optimal plan and place its tensors, in order of their optimal offsets, each
at the lowest offset that fits among those already placed. By induction every tensor lands at or below its
optimal offset (every already placed tensor that conflicts with it ends at or below that offset), so the arena
is no larger. So the minimum over placement orders of "lowest fit in that order" is the optimum.
"""

from __future__ import annotations

from typing import NamedTuple

from ..core.validate import is_int, pos_int

__all__ = ["Lifetime", "as_lifetimes", "live_bytes_peak", "live_bytes_curve", "conflicts", "greedy_by_size",
           "first_fit", "optimal_offsets", "arena_size", "plan_conflicts", "check_plan", "plan_text"]


class Lifetime(NamedTuple):
    """One tensor of a trace: `size` bytes, alive on the event interval [birth, death)."""
    size: int
    birth: int
    death: int


def as_lifetimes(lifetimes, name: str = "lifetimes") -> list[Lifetime]:
    """Check a list of (size, birth, death) triples of ints (size >= 0, 0 <= birth < death) and return them
    as Lifetimes (ValueError / TypeError naming the first bad entry)."""
    if not isinstance(lifetimes, (list, tuple)):
        raise TypeError(f"{name} must be a list of (size, birth, death) tuples, got {type(lifetimes).__name__}")
    out = []
    for i, lt in enumerate(lifetimes):
        if not isinstance(lt, (tuple, list)) or len(lt) != 3:
            raise TypeError(f"{name}[{i}] must be a (size, birth, death) tuple, got {lt!r}")
        size, birth, death = lt
        if not (is_int(size) and is_int(birth) and is_int(death)):
            raise TypeError(f"{name}[{i}] must hold three ints (size, birth, death), got {lt!r}")
        if size < 0 or birth < 0 or death <= birth:
            raise ValueError(f"{name}[{i}] must have size >= 0 and 0 <= birth < death, got {tuple(lt)!r}")
        out.append(Lifetime(size, birth, death))
    return out


def _overlap(a: Lifetime, b: Lifetime) -> bool:
    return a.size > 0 and b.size > 0 and a.birth < b.death and b.birth < a.death


def conflicts(lifetimes) -> list[list[int]]:
    """For each tensor, the indices of the tensors it conflicts with (non-empty, alive at a common moment): the
    edges of the interval graph."""
    lts = as_lifetimes(lifetimes)
    order = sorted(range(len(lts)), key=lambda i: lts[i].birth)
    out: list[list[int]] = [[] for _ in lts]
    active: list[int] = []
    for i in order:
        if lts[i].size == 0:
            continue
        active = [j for j in active if lts[j].death > lts[i].birth]
        for j in active:
            out[i].append(j)
            out[j].append(i)
        active.append(i)
    return out


def live_bytes_curve(lifetimes) -> list[tuple[int, int]]:
    """(time, live bytes from that time on) at every time the total changes, in time order."""
    lts = as_lifetimes(lifetimes)
    delta: dict[int, int] = {}
    for lt in lts:
        delta[lt.birth] = delta.get(lt.birth, 0) + lt.size
        delta[lt.death] = delta.get(lt.death, 0) - lt.size
    out, live = [], 0
    for t in sorted(delta):
        live += delta[t]
        out.append((t, live))
    return out


def live_bytes_peak(lifetimes) -> int:
    """The most bytes alive at one moment: a lower bound on the arena of every valid plan (0 for no tensors)."""
    return max((b for _, b in live_bytes_curve(lifetimes)), default=0)


def _first_gap(size: int, busy: list[tuple[int, int]]) -> int:
    """Lowest offset where `size` bytes fit between the busy (start, end) ranges."""
    at = 0
    for start, end in sorted(busy):
        if at + size <= start:
            return at
        at = max(at, end)
    return at


def _best_gap(size: int, busy: list[tuple[int, int]]) -> int:
    """The smallest gap between busy ranges that holds `size` bytes (lowest such on ties), else the top:
    SimpleMemoryArena::Allocate in TFLite."""
    at, best, best_gap = 0, None, None
    for start, end in sorted(busy):
        if at + size <= start and (best_gap is None or start - at < best_gap):
            best, best_gap = at, start - at
        at = max(at, end)
    return at if best is None else best


def _place(lts: list[Lifetime], order, fit) -> list[int]:
    edges = conflicts(lts)
    offsets: list[int | None] = [None] * len(lts)
    for i in order:
        if lts[i].size == 0:
            offsets[i] = 0
            continue
        busy = [(offsets[j], offsets[j] + lts[j].size) for j in edges[i] if offsets[j] is not None]
        offsets[i] = fit(lts[i].size, busy)
    return offsets


def greedy_by_size(lifetimes) -> list[int]:
    """Offsets by TFLite's arena planner (tensorflow/lite/arena_planner.cc, CreateTensorAllocationVector): tensors
    alive together with every other one (parameters, optimizer state) first, then the others by size, largest
    first (ties: earlier birth, then list order), each into the smallest gap that holds it among the tensors it
    conflicts with, else on top (SimpleMemoryArena::Allocate)."""
    lts = as_lifetimes(lifetimes)
    edges = conflicts(lts)
    busy = sum(1 for lt in lts if lt.size)
    whole = [lt.size > 0 and len(e) == busy - 1 for lt, e in zip(lts, edges)]     # alive with every other tensor
    order = sorted(range(len(lts)), key=lambda i: (not whole[i], -lts[i].size, lts[i].birth, i))
    return _place(lts, order, _best_gap)


def first_fit(lifetimes) -> list[int]:
    """Offsets in allocation order (by birth; ties: list order), each tensor at the lowest offset where it fits
    beside the tensors alive with it: an allocator that never moves a block and does not know the future."""
    lts = as_lifetimes(lifetimes)
    return _place(lts, sorted(range(len(lts)), key=lambda i: (lts[i].birth, i)), _first_gap)


def arena_size(lifetimes, offsets) -> int:
    """max(offset + size) over the non-empty tensors (0 if there are none)."""
    lts, offs = _check_plan_args(lifetimes, offsets)
    return max((o + lt.size for lt, o in zip(lts, offs) if lt.size), default=0)


def _check_plan_args(lifetimes, offsets):
    lts = as_lifetimes(lifetimes)
    if not isinstance(offsets, (list, tuple)):
        raise TypeError(f"offsets must be a list of ints, one per lifetime, got {type(offsets).__name__}")
    if len(offsets) != len(lts):
        raise ValueError(f"offsets must have one entry per lifetime ({len(lts)}), got {len(offsets)}")
    for i, o in enumerate(offsets):
        if not is_int(o) or o < 0:
            raise ValueError(f"offsets[{i}] must be a non-negative int, got {o!r}")
    return lts, list(offsets)


def plan_conflicts(lifetimes, offsets) -> list[tuple[int, int]]:
    """Pairs (i, j), i < j, of tensors alive at a common moment whose byte ranges overlap: empty for a valid plan."""
    lts, offs = _check_plan_args(lifetimes, offsets)
    bad = []
    for i, others in enumerate(conflicts(lts)):
        for j in others:
            if i < j and offs[i] < offs[j] + lts[j].size and offs[j] < offs[i] + lts[i].size:
                bad.append((i, j))
    return sorted(bad)


def check_plan(lifetimes, offsets) -> int:
    """The arena of a valid plan; ValueError naming the first two tensors that overlap in time and in bytes."""
    bad = plan_conflicts(lifetimes, offsets)
    if bad:
        i, j = bad[0]
        lts = as_lifetimes(lifetimes)
        raise ValueError(f"offsets put tensors {i} {tuple(lts[i])} at {offsets[i]} and {j} {tuple(lts[j])} at "
                         f"{offsets[j]}: alive together and overlapping ({len(bad)} such pairs)")
    return arena_size(lifetimes, offsets)


def optimal_offsets(lifetimes, max_tensors: int = 10) -> list[int]:
    """Offsets of a smallest arena, found by trying placement orders (lowest fit in each; see the module
    docstring) with branch and bound: started from the better heuristic, cut when a partial plan is no better
    than the best, stopped when the live-bytes peak is reached. Independent groups of tensors (connected parts
    of the interval graph) are solved apart. ValueError if a group holds more than `max_tensors` tensors."""
    lts = as_lifetimes(lifetimes)
    pos_int("max_tensors", max_tensors)
    edges = conflicts(lts)
    offsets = [0] * len(lts)
    seen: set[int] = set()
    for s in range(len(lts)):
        if s in seen or lts[s].size == 0:
            continue
        group, stack = [], [s]                       # a connected part of the interval graph
        seen.add(s)
        while stack:
            i = stack.pop()
            group.append(i)
            for j in edges[i]:
                if j not in seen:
                    seen.add(j)
                    stack.append(j)
        if len(group) > max_tensors:
            raise ValueError(f"lifetimes has a group of {len(group)} tensors alive in overlapping spans; "
                             f"max_tensors={max_tensors} bounds the brute force (n! orders): pass a smaller trace")
        for i, o in zip(sorted(group), _optimal_group([lts[i] for i in sorted(group)])):
            offsets[i] = o
    return offsets


def _optimal_group(lts: list[Lifetime]) -> list[int]:
    n = len(lts)
    bound = live_bytes_peak(lts)
    best = min((greedy_by_size(lts), first_fit(lts)), key=lambda p: arena_size(lts, p))
    best_top = [arena_size(lts, best)]
    edges = conflicts(lts)
    placed: list[int | None] = [None] * n

    def search(top: int, left: list[int]):
        if best_top[0] == bound:
            return
        if not left:
            best[:] = list(placed)
            best_top[0] = top
            return
        tried = set()
        for i in left:
            if lts[i] in tried:                      # identical tensors: one order of them is enough
                continue
            tried.add(lts[i])
            busy = [(placed[j], placed[j] + lts[j].size) for j in edges[i] if placed[j] is not None]
            o = _first_gap(lts[i].size, busy)
            new_top = max(top, o + lts[i].size)
            if new_top >= best_top[0]:
                continue
            placed[i] = o
            search(new_top, [j for j in left if j != i])
            placed[i] = None

    search(0, list(range(n)))
    return best


def plan_text(lifetimes, offsets, unit: int = 1) -> str:
    """A plan drawn in text: one row per `unit` bytes of the arena (top row = highest address), one column per
    time step, the tensor's letter (A, B, ...; index mod 26) where it sits, "." where the arena is free."""
    lts, offs = _check_plan_args(lifetimes, offsets)
    pos_int("unit", unit)
    end = max((lt.death for lt in lts), default=0)
    rows = -(-arena_size(lts, offs) // unit)
    grid = [["."] * end for _ in range(rows)]
    for i, (lt, o) in enumerate(zip(lts, offs)):
        for r in range(o // unit, -(-(o + lt.size) // unit)):
            for t in range(lt.birth, lt.death):
                grid[r][t] = chr(65 + i % 26)
    return "\n".join(f"{r * unit:>6} " + "".join(row) for r, row in reversed(list(enumerate(grid))))
