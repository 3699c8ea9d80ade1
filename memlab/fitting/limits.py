"""The question practitioners ask: how long a context, or how large a batch, fits? `fit_max` finds the largest
sequence length (or batch) for which `memlab.fit` says a plan fits, by a bracketing search over measured steps,
and reports the bytes at the limit and what one more token (or sequence) would need.

The search: the first probe is the length asked (or 512 tokens / 1 sequence); while no step is known not to fit
the next probe is extrapolated from the measured ones (the bytes a step needs grow linearly with the batch and
at most quadratically with the sequence), then the bracket [largest that fits, smallest that does not] is closed
by alternating secant and bisection steps, so it ends in a few probes whatever the curve. Every probe is a real
`fit` (its measured runs are kept, in this process and on disk, so asking again is fast), and the answer is the
pair of neighbours the search measured last: the limit fits and the next value up does not.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ..core.track import format_bytes
from ..core.validate import one_of, pos_int

__all__ = ["FitMax", "fit_max"]

MAX_BATCH = 1 << 16
MAX_SEQ = 1 << 21            # for a model whose config names no limit (T5's relative positions)


@dataclass
class FitMax:
    """What `fit_max` found."""
    what: str                     # "seq" or "batch"
    value: int                    # the largest that fits (0: not even 1)
    at: object                    # FitResult at value (None when value is 0)
    above: object                 # FitResult at value + 1 (None when value is the search's ceiling)
    ceiling: int                  # the largest value searched (the model's max positions for seq)
    probes: list = field(default_factory=list)     # (value, fits, needed bytes) in the order measured
    seconds: float = 0.0

    def __str__(self) -> str:
        unit = "tokens" if self.what == "seq" else "sequences"
        r = self.at or self.above
        head = f"{r.model} on {r.gpu}: " if r is not None else ""
        if self.value == 0:
            return (f"{head}not even {self.what} 1 fits: it needs {format_bytes(self.above.needed)} of "
                    f"{format_bytes(self.above.usable)} usable")
        lines = [f"{head}largest {self.what} that fits: {self.value:,} {unit}: needs "
                 f"{format_bytes(self.at.needed)} of {format_bytes(self.at.usable)} usable "
                 f"(allocated peak {format_bytes(self.at.peak)}, in '{self.at.peak_phase}')"]
        if self.above is not None:
            lines.append(f"  {self.what} {self.value + 1:,} would need {format_bytes(self.above.needed)}: "
                         f"{format_bytes(self.above.needed - self.above.usable)} over")
        else:
            lines.append(f"  {self.value:,} is the most searched (the model's max_position_embeddings for seq)")
        lines.append(f"  {len(self.probes)} steps measured in {self.seconds:.1f} s")
        return "\n".join(lines)


def fit_max(model, gpu="L4-24GB", *, what: str = "seq", ceiling: int | None = None, **options) -> FitMax:
    """The largest sequence length (what="seq") or batch (what="batch", whole batches: no gradient accumulation)
    for which `memlab.fit(model, gpu, **options)` says the plan fits, with the bytes at that limit and what the next
    value up needs. `options` are fit's (method, precision, optimizer, checkpointing, lora_r, ..., and the other
    of batch / seq); `ceiling` caps the search (default: the model's max_position_embeddings for seq, 65536 for
    batch). Returns a `FitMax`."""
    from .plan import fit
    from .config import check_config, read_config
    one_of("what", what, ("seq", "batch"), what="'seq' or 'batch'")
    if what in options:
        raise ValueError(f"fit_max(what={what!r}) searches {what} itself: do not pass {what}=")
    if what == "batch" and options.get("micro_batch") is not None:
        raise ValueError("fit_max(what='batch') searches whole batches: micro_batch must be None (with gradient "
                         "accumulation any batch fits that one micro-batch does)")
    raw = check_config(read_config(model))
    if ceiling is None:
        ceiling = (raw.get("max_position_embeddings") or raw.get("n_positions") or MAX_SEQ) if what == "seq" \
            else MAX_BATCH
    pos_int("ceiling", ceiling)
    t0 = time.perf_counter()
    seen: dict[int, object] = {}
    probes = []

    def probe(x: int):
        if x not in seen:
            r = fit(model, gpu, **{what: x}, **options)
            seen[x] = r
            probes.append((x, bool(r.fits), int(r.needed)))
        return seen[x]

    start = min(ceiling, 512 if what == "seq" else 1)
    good, bad = 0, ceiling + 1                       # fits at good (0: nothing yet); not at bad
    x, stalled = start, 0
    while bad - good > 1:
        r = probe(x)
        if r.fits:
            good = max(good, x)
        else:
            bad = min(bad, x)
        if bad - good <= 1:
            break
        guess = _predict(seen, x, r.usable)
        if guess is not None and bad > ceiling:        # nothing known not to fit: aim a little beyond the edge
            guess = int(guess * 1.05) + 1
        if guess is None or stalled >= 2:              # no prediction, or two in a row at an end: from now on,
            x = _grow_or_halve(good, bad, ceiling)     # halve (the need climbs in steps the peak does not show:
        else:                                          # the allocator's 2 MiB segments on a small model)
            x = min(max(guess, good + 1), min(bad - 1, ceiling))
            stalled = stalled + 1 if x in (good + 1, bad - 1) and bad - good > 3 else 0
    at = seen.get(good) if good else None
    above = probe(good + 1) if good < ceiling else None
    if good == 0:
        above = probe(1)
    return FitMax(what, good, at, above, ceiling, probes, time.perf_counter() - t0)


def _predict(seen: dict, near: int, usable: int) -> int | None:
    """The largest value whose predicted need stays within `usable`. The allocated peak is smooth in the value
    (linear in the batch, at most quadratic in the sequence): a quadratic through the three measured values nearest
    `near` (a line through two); the caching allocator's share and the context are those of the nearest measured
    step, which vary little. None when it cannot say."""
    pts = sorted(seen.items(), key=lambda kv: abs(kv[0] - near))[:3]
    if len(pts) < 2:
        return None
    r = pts[0][1]
    target = (usable - r.context) * r.peak / max(r.reserved, 1)        # the peak that would need `usable`
    xs = [float(x) for x, _ in pts]
    ys = [float(q.peak) for _, q in pts]
    if len(pts) == 3:
        (x0, x1, x2), (y0, y1, y2) = xs, ys
        d = (x0 - x1) * (x0 - x2) * (x1 - x2)
        a = (x2 * (y1 - y0) + x1 * (y0 - y2) + x0 * (y2 - y1)) / d
        b = (x2 * x2 * (y0 - y1) + x1 * x1 * (y2 - y0) + x0 * x0 * (y1 - y2)) / d
        c = y0 - a * x0 * x0 - b * x0
        if a > 0 and b * b - 4 * a * (c - target) >= 0:
            return int(math.floor((-b + math.sqrt(b * b - 4 * a * (c - target))) / (2 * a)))
    (x0, x1), (y0, y1) = xs[:2], ys[:2]
    if y1 == y0:
        return None
    return int(math.floor(x0 + (target - y0) * (x1 - x0) / (y1 - y0)))


def _grow_or_halve(good: int, bad: int, ceiling: int) -> int:
    """Without a useful prediction: double while nothing is known not to fit, else the middle of the bracket."""
    if bad > ceiling:
        return min(ceiling, max(good + 1, 2 * good))
    return (good + bad) // 2 if good else max(1, bad // 2)
