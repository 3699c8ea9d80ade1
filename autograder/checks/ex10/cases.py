"""Exercise 10's cases (trusted side): what each task's inputs are drawn from.

- task 10.1: traces of random programs (every hidden trace holds a storage alive for the whole trace, a freed one,
  views, a view that outlives the tensor that allocated the storage, in-place ops, an empty tensor, and tensor and
  storage ids used again), and lists of lifetimes in no particular order for the bound, in which a tensor dies
  at the very time another is born and counting both would overstate the peak;
- task 10.2: small traces chosen with the heuristics below so that placing the tensors largest first reaches the
  brute-force optimum in every order of equal sizes and with either gap rule, while first fit in order of birth
  does not (one family where a tensor must take the bytes of one that dies as it is born, one with an alignment
  and sizes that are not multiples of it); a random trace; a recorded training step; the empty trace;
- task 10.3: separable blocks at stride 1 and 2 (an odd side), more and fewer output channels than input, and
  a MobileNet-sized layer whose bytes are only predicted (the judge measures its reference on the meta device).
"""

from __future__ import annotations

import itertools

import torch

from .refs import optimum

SIZES = (4, 12, 32, 64, 96, 128, 256, 512, 1024, 4096)
HAND = [(3, 0, 1), (2, 0, 2), (2, 1, 3), (1, 1, 4), (1, 2, 4), (3, 3, 5), (2, 4, 5)]     # lesson 10's example
COVERAGE = ("view", "inplace", "empty", "freed", "outlives_base", "storage_again", "tensor_again")


# ----------------------------------------------------------------------------- task 10.1: traces
def _program(r, n: int) -> list[tuple]:
    """A random valid trace of about n events; its first event allocates a storage that is never freed."""
    tids, sids = list(range(1, 9)), [4096 * k for k in range(1, 7)]
    live: dict[int, int] = {}                              # tensor -> storage
    on: dict[int, set] = {}                                # storage -> its live tensors
    events: list[tuple] = []

    def alloc(size):
        t = r.choice([t for t in tids if t not in live])
        s = r.choice([s for s in sids if s not in on])
        events.append(("alloc", t, s, size))
        live[t], on[s] = s, {t}

    alloc(r.choice((256, 512, 1024, 2048)))                # the weights: alive for the whole trace
    whole = events[0][1]
    while len(events) < n:
        kinds = []
        if len(live) < len(tids) and len(on) < len(sids):
            kinds += ["alloc"] * 4
        if len(live) < len(tids):
            kinds += ["view"] * 3
        kinds += ["inplace"] * 2
        if len(live) > 1:
            kinds += ["free"] * 5
        kind = r.choice(kinds)
        if kind == "alloc":
            alloc(0 if r.random() < 0.12 else r.choice(SIZES))
        elif kind == "view":
            s = r.choice(sorted(on))
            t = r.choice([t for t in tids if t not in live])
            events.append(("view", t, s))
            live[t] = s
            on[s].add(t)
        elif kind == "inplace":
            events.append(("inplace", r.choice(sorted(live))))
        else:
            t = r.choice([t for t in sorted(live) if t != whole])
            events.append(("free", t))
            s = live.pop(t)
            on[s].discard(t)
            if not on[s]:
                del on[s]
    return events


def coverage(events) -> set[str]:
    """Which branches of the spec a trace exercises (see COVERAGE)."""
    got = set()
    made: dict = {}                                          # storage -> the tensor that allocated it
    live: dict = {}
    count: dict = {}
    seen_t, seen_s = set(), set()
    for e in events:
        if e[0] in ("alloc", "view"):
            if e[1] in seen_t:
                got.add("tensor_again")
            seen_t.add(e[1])
            live[e[1]] = e[2]
            count[e[2]] = count.get(e[2], 0) + 1
        if e[0] == "alloc":
            if e[2] in seen_s:
                got.add("storage_again")
            seen_s.add(e[2])
            made[e[2]] = e[1]
            if e[3] == 0:
                got.add("empty")
        elif e[0] == "view":
            got.add("view")
        elif e[0] == "inplace":
            got.add("inplace")
        else:
            s = live.pop(e[1])
            count[s] -= 1
            if count[s]:
                if made.get(s) == e[1]:
                    got.add("outlives_base")
            else:
                got.add("freed")
                del count[s]
    return got


def _trace(r, n):
    while True:
        events = _program(r, n)
        if coverage(events) >= set(COVERAGE):
            return events


def _closed_peak(intervals) -> int:
    """The peak if a tensor dying at t and one born at t were counted together (the mistake to catch)."""
    return max((sum(s for s, b, d in intervals if b <= t <= d) for _, t, _ in intervals), default=0)


def _in_list_order(intervals) -> int:
    """The peak of a sweep that takes the lifetimes in the order given, as if sorted by birth (the mistake to
    catch): at each one, the sizes of those listed before it that are still alive, and its own."""
    peak, alive = 0, []
    for size, birth, death in intervals:
        alive = [(s, d) for s, d in alive if d > birth] + [(size, death)]
        peak = max(peak, sum(s for s, _ in alive))
    return peak


def _intervals(r) -> list[tuple]:
    """Random lifetimes in an order that matters (a sweep in list order gets another peak), where the touching ones
    matter too: counting a tensor that dies at t together with one born at t overstates the peak."""
    from .refs import live_peak
    while True:
        span = r.randint(6, 12)
        out = []
        for _ in range(r.randint(10, 18)):
            b = r.randrange(span)
            out.append((0 if r.random() < 0.1 else r.choice(SIZES), b, r.randint(b + 1, span)))
        r.shuffle(out)
        peak = live_peak(out)
        if _closed_peak(out) > peak and sum(s for s, _, _ in out) > peak and any(s == 0 for s, _, _ in out) \
                and _in_list_order(out) != peak:
            return out


def _lifetimes_cases(hidden, r):
    from memlab.kit.ex10 import example_trace
    if not hidden:
        return [{"events": example_trace()},
                {"events": _trace(r, 24)},
                {"intervals": [(128, 5, 7), (64, 2, 5), (32, 0, 2), (16, 1, 6), (0, 3, 4), (256, 0, 1), (64, 4, 7)]},
                {"intervals": []}]
    return [{"events": _trace(r, r.randint(24, 40))} for _ in range(3)] + \
        [{"intervals": _intervals(r)} for _ in range(2)] + [{"intervals": []}]


# ----------------------------------------------------------------------------- task 10.2: heuristics for the draws
def _up(x: int, a: int) -> int:
    return -(-x // a) * a


def _together(a, b, closed=False) -> bool:
    if not (a[0] and b[0]):
        return False
    return (a[1] <= b[2] and b[1] <= a[2]) if closed else (a[1] < b[2] and b[1] < a[2])


def _lowest(size, busy, a):
    at = 0
    for s, e in sorted(busy):
        if at + size <= s:
            return at
        at = max(at, _up(e, a))
    return at


def _best(size, busy, a):
    at, found, gap = 0, None, None
    for s, e in sorted(busy):
        if at + size <= s and (gap is None or s - at < gap):
            found, gap = at, s - at
        at = max(at, _up(e, a))
    return at if found is None else found


def _place(lts, order, fit, a, closed=False) -> list[int]:
    offs: list = [None] * len(lts)
    for i in order:
        if not lts[i][0]:
            offs[i] = 0
            continue
        busy = [(offs[j], offs[j] + lts[j][0]) for j in range(len(lts))
                if offs[j] is not None and j != i and _together(lts[i], lts[j], closed)]
        offs[i] = fit(lts[i][0], busy, a)
    return offs


def _arena(lts, offs) -> int:
    return max((o + lt[0] for lt, o in zip(lts, offs) if lt[0]), default=0)


def _orders(n: int, key, limit: int = 48):
    """Every order of range(n) sorted by key with the members of each group of equal keys in any order (None if
    there are more than `limit` such orders)."""
    groups: dict = {}
    for i in range(n):
        groups.setdefault(key(i), []).append(i)
    count = 1
    for g in groups.values():
        for m in range(2, len(g) + 1):
            count *= m
    if count > limit:
        return None
    return [[i for g in combo for i in g]
            for combo in itertools.product(*[itertools.permutations(groups[k]) for k in sorted(groups)])]


def _largest_first(lts, a, closed=False):
    """The arenas of every largest-first placement: each order of equal sizes, the tensors alive with every other
    one first or not (TFLite's rule), the lowest or the best-fitting gap."""
    nonempty = [i for i, lt in enumerate(lts) if lt[0]]
    whole = [i in nonempty and all(j == i or _together(lts[i], lts[j]) for j in nonempty) for i in range(len(lts))]
    out = set()
    for first in (False, True):
        orders = _orders(len(lts), (lambda i: (not whole[i], -lts[i][0])) if first else (lambda i: -lts[i][0]))
        if orders is None:
            return None
        out |= {_arena(lts, _place(lts, o, fit, a, closed)) for o in orders for fit in (_lowest, _best)}
    return out


def _birth_order(lts, a):
    """The arenas of placing the tensors in order of birth (each order of equal births), lowest or best gap."""
    orders = _orders(len(lts), lambda i: lts[i][1])
    return None if orders is None else {_arena(lts, _place(lts, o, fit, a)) for o in orders for fit in (_lowest, _best)}


def _crafted(r, family: str) -> dict:
    """A small trace on which every largest-first placement reaches the brute-force optimum and no placement in
    order of birth does. family: "whole" (a tensor alive from the first moment to the last), "touching" (the
    optimum needs a tensor to take the bytes of one that dies as it is born), "aligned" (an alignment that the
    sizes are not multiples of)."""
    a = r.choice((8, 64, 256)) if family == "aligned" else 1
    unit = 1 if family == "aligned" else r.choice((4, 16, 64))
    sizes = [a * k - d for k in (1, 2, 3, 4) for d in (0, a // 3)] if family == "aligned" else [1, 2, 3, 4, 5, 6]
    while True:
        span = r.randint(5, 8)
        lts = []
        for _ in range(r.randint(5, 7) - (family == "whole")):
            b = r.randrange(span)
            lts.append((r.choice(sizes), b, r.randint(b + 1, span)))
        if family == "whole":
            lts.append((r.choice(sizes), 0, max(d for _, _, d in lts)))
        r.shuffle(lts)
        greedy = _largest_first(lts, a)
        if greedy is None or len(greedy) != 1:
            continue
        births = _birth_order(lts, a)
        if births is None or min(births) <= max(greedy):
            continue
        if family == "touching":
            closed = _largest_first(lts, a, closed=True)
            if closed is None or min(closed) <= max(greedy):
                continue
        unaligned = _place(lts, sorted(range(len(lts)), key=lambda i: -lts[i][0]), _lowest, 1)
        if family == "aligned" and all(o % a == 0 for o in unaligned):     # ignoring the alignment must show
            continue
        if optimum(lts, a) != max(greedy):
            continue
        lts = [(s * unit, b, d) for s, b, d in lts]
        for _ in range(r.randint(1, 2)):                   # empty tensors: they take no bytes and clash with nothing
            b = r.randrange(span)
            lts.insert(r.randrange(len(lts) + 1), (0, b, r.randint(b + 1, span)))
        return {"kind": "small", "family": family, "lifetimes": lts, "alignment": a}


def _random_trace(r) -> dict:
    lts = []
    for _ in range(r.randint(30, 50)):
        b = r.randrange(30)
        lts.append((0 if r.random() < 0.1 else r.choice(SIZES), b, r.randint(b + 1, 32)))
    return {"kind": "random", "lifetimes": lts, "alignment": r.choice((1, 16, 64))}


def _sgd_step(model, x, y, lr=0.05):
    """One plain training step without torch.optim: forward, backward, p -= lr * grad, gradients dropped."""
    model(x, y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-lr)
            p.grad = None


def _recorded(r, visible: bool = False) -> dict:
    """The lifetimes of one training step of a small model, recorded with memlab's tracker."""
    import memlab
    from memlab.planning import record_step
    if visible:
        torch.manual_seed(0)
        model, batch, align = memlab.MLP(32, 128, 3, 10), 16, 64
        what = "a recorded training step of an MLP(32, 128, 3 layers), batch 16"
        x, y = torch.randn(batch, 32), torch.randint(0, 10, (batch,))
    else:
        torch.manual_seed(r.randrange(2**31))
        align = r.choice((1, 64, 512))
        if r.random() < 0.5:
            d, layers, batch = r.choice((16, 32, 48)), r.randint(2, 4), r.randint(4, 32)
            model, what = memlab.MLP(d, 4 * d, layers, 10), f"a recorded MLP training step, batch {batch}"
            x, y = torch.randn(batch, d), torch.randint(0, 10, (batch,))
        else:
            cfg = memlab.GPTConfig.tiny(n_layer=r.randint(1, 2), n_embd=32 * r.randint(1, 2), n_head=2,
                                        vocab_size=r.choice((48, 64)), block_size=32)
            batch = r.randint(2, 4)
            model, what = memlab.GPT(cfg), f"a recorded training step of a small GPT, batch {batch}"
            x = torch.randint(0, cfg.vocab_size, (batch, r.randint(8, 32)))
            y = x
    trace = record_step(_sgd_step, model, x, y, model=model)
    return {"kind": "large", "what": what, "lifetimes": [tuple(lt) for lt in trace.lifetimes], "alignment": align}


def _plan_cases(hidden, r):
    if not hidden:
        return [{"kind": "small", "family": "lesson", "lifetimes": list(HAND), "alignment": 1},
                _crafted(r, "aligned"), _recorded(r, visible=True), {"kind": "empty", "lifetimes": [], "alignment": 8}]
    return [_crafted(r, "whole"), _crafted(r, "touching"), _crafted(r, "aligned"), _random_trace(r), _recorded(r),
            {"kind": "empty", "lifetimes": [], "alignment": r.choice((1, 64))}]


# ----------------------------------------------------------------------------- task 10.3: blocks
def _block(r, c_in, c_out, stride, side, batch=None) -> dict:
    return {"c_in": c_in, "c_out": c_out, "stride": stride, "side": side, "batch": batch or r.randint(1, 3),
            "seed": r.randrange(2**31)}


def _block_cases(hidden, r):
    if not hidden:
        return [_block(r, 16, 32, 2, 15, 2), _block(r, 24, 24, 1, 10, 2),
                {"predict_only": True, "c_in": 256, "c_out": 512, "side": 28, "batch": 32, "stride": 2}]
    c = [8 * r.randint(1, 6) for _ in range(4)]
    small, large = min(c[:2]), max(c[:2]) + 8
    alpha = r.choice((0.25, 0.5, 0.75, 1.0))
    c_big = r.choice((128, 256, 512))
    return [_block(r, small, large, 2, 2 * r.randint(4, 9) + 1),          # stride 2, odd side, more channels out
            _block(r, large, small, 1, r.randint(6, 14)),                  # stride 1, fewer channels out
            _block(r, c[2], c[3], r.choice((1, 2)), r.randint(7, 16)),
            {"predict_only": True, "c_in": int(alpha * c_big), "c_out": int(alpha * 2 * c_big),
             "side": 2 * r.randint(3, 56) + 1, "batch": r.choice((8, 16, 32, 64)), "stride": 2}]
