"""Tensor lifetimes of a real step, as memlab's tracker sees them.

The tracker (memlab/core/track.py) is a TorchDispatchMode: it sees every tensor *storage* an op creates and a
weak reference tells it when the storage is freed. A view shares its base's storage and an in-place op writes
into its input's storage, so neither is a new allocation; a storage resized in place counts as a new
allocation of the new size with the old one freed (as a CUDA `resize_` copies into a new block). Its event log,
read by `memlab.core.allocator.events_from_tracker`, is the allocation stream

    [("alloc", id, nbytes), ("free", id), ...]

and `lifetimes_from_events` turns it into one `Lifetime(size, birth, death)` per allocation, in allocation
order: birth is the index of the "alloc" event, death the index of the matching "free" (the length of the
stream for a storage still alive at the end). Times are event indices, so the tensor is alive on [birth, death).

`record_step(fn, *args, model=..., optimizer=...)` runs one step under a tracker and returns the whole `Trace`:
the stream, the lifetimes, the tracker's peak and where each phase starts. The parameters and optimizer state
of the watched model are registered when the tracker starts, so they are born first and live to the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.allocator import events_from_tracker, step_start
from ..core.track import MemoryTracker
from ..core.validate import pos_int
from .planner import Lifetime, as_lifetimes

__all__ = ["Trace", "lifetimes_from_events", "record_step", "round_lifetimes", "sub_trace"]


def _check_events(events):
    if not isinstance(events, (list, tuple)):
        raise TypeError(f"events must be a list of ('alloc', id, nbytes) / ('free', id) tuples, "
                        f"got {type(events).__name__}")
    for i, e in enumerate(events):
        ok = isinstance(e, tuple) and ((len(e) == 3 and e[0] == "alloc") or (len(e) == 2 and e[0] == "free"))
        if not ok:
            raise ValueError(f"events[{i}] must be ('alloc', id, nbytes) or ('free', id), got {e!r}")
        if e[0] == "alloc" and (not isinstance(e[2], int) or isinstance(e[2], bool) or e[2] < 0):
            raise ValueError(f"events[{i}]: nbytes must be a non-negative int, got {e[2]!r}")


def lifetimes_from_events(events) -> list[Lifetime]:
    """One Lifetime(size, birth, death) per "alloc" event of an allocation stream, in the order of the allocs.
    birth and death are indices into `events`; a storage never freed dies at len(events). An id may be
    allocated again after its free (a new lifetime); allocating a live id or freeing one that is not live is
    a ValueError."""
    _check_events(events)
    out: list[Lifetime] = []
    live: dict = {}                                     # id -> index into out
    for t, e in enumerate(events):
        try:
            is_live = e[1] in live
        except TypeError:
            raise TypeError(f"events[{t}]: the id must be hashable, got {e[1]!r}") from None
        if e[0] == "alloc":
            if is_live:
                raise ValueError(f"events[{t}] allocates id {e[1]!r}, which is still alive (free it first)")
            live[e[1]] = len(out)
            out.append(Lifetime(e[2], t, len(events)))
        else:
            if not is_live:
                raise ValueError(f"events[{t}] frees id {e[1]!r}, which is not alive")
            k = live.pop(e[1])
            out[k] = out[k]._replace(death=t)
    return out


def round_lifetimes(lifetimes, multiple: int = 512) -> list[Lifetime]:
    """Every size rounded up to a multiple of `multiple` bytes (512: the CUDA caching allocator's kMinBlockSize,
    so that a plan is compared with the allocator like for like); empty tensors stay empty."""
    lts = as_lifetimes(lifetimes)
    pos_int("multiple", multiple)
    return [lt._replace(size=-(-lt.size // multiple) * multiple) for lt in lts]


def sub_trace(lifetimes, start: int, stop: int) -> list[Lifetime]:
    """The tensors alive at some time in [start, stop), each clipped to that window and shifted so that the
    window starts at time 0: a small piece of a long trace for the brute force."""
    lts = as_lifetimes(lifetimes)
    for nm, v in (("start", start), ("stop", stop)):
        pos_int(nm, v, zero_ok=True)
    if stop <= start:
        raise ValueError(f"stop must be > start, got start={start}, stop={stop}")
    return [Lifetime(lt.size, max(lt.birth, start) - start, min(lt.death, stop) - start)
            for lt in lts if lt.birth < stop and lt.death > start]


@dataclass
class Trace:
    """One recorded step: the allocation stream, its lifetimes (same order as the allocs), the tracker's peak of
    live bytes, `start` (the number of events that registered what existed before the step: the watched model's
    parameters, gradients and optimizer state) and the event index where each phase begins (memlab.phase marks;
    "idle" events just before a phase count as its start)."""
    events: list
    lifetimes: list[Lifetime]
    peak: int
    start: int = 0
    phase_starts: dict[str, int] = field(default_factory=dict)
    tracker: MemoryTracker | None = None

    @property
    def end(self) -> int:
        """The time at which the trace ends (len(events))."""
        return len(self.events)

    def whole_step(self) -> list[int]:
        """Indices of the tensors that existed before the step and are still alive at its end."""
        return [i for i, lt in enumerate(self.lifetimes) if lt.birth < self.start and lt.death == self.end]


def record_step(fn, *args, model=None, optimizer=None, device=None, **kwargs) -> Trace:
    """Run `fn(*args, **kwargs)` once under a MemoryTracker watching `model` and `optimizer` and return its
    Trace. Tensors made before the call (an input batch) are not in the trace; the model's parameters,
    gradients and optimizer state that exist already are, alive from time 0."""
    if not callable(fn):
        raise TypeError(f"fn must be callable (one step), got {type(fn).__name__}")
    tracker = MemoryTracker(model, optimizer, device=device, timeline=True)
    with tracker:
        start = len(events_from_tracker(tracker))           # what registering the model and optimizer added
        fn(*args, **kwargs)
    events = events_from_tracker(tracker)
    starts = {}
    for ph in tracker.phase_peaks:
        if ph != "idle":
            s = step_start(tracker, ph)
            if s is not None:
                starts[ph] = max(s, start)
    return Trace(events, lifetimes_from_events(events), tracker.peak, start, starts, tracker)
