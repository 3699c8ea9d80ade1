"""What exercise 10's notebook (tensor lifetimes, an offset planner, a separable block) takes from the kit: a
tensor-level allocation trace of a small step, read line by line, and the replay that measures any such trace
with memlab's tracker.

A trace is what a recorder sees at the level of tensors, one event per thing that happens to one:

    ("alloc", t, s, nbytes)   an op made tensor t on a NEW storage s of nbytes bytes (0 for an empty tensor)
    ("view", t, s)            an op made tensor t as a view of storage s (a slice, a transpose, a reshape):
                              no new bytes, and one more tensor that keeps s alive
    ("inplace", t)            an in-place op (relu_, add_, mul_) wrote into tensor t's storage: no new bytes
    ("free", t)               tensor t was released (its last reference went)

A storage is alive from its "alloc" until the "free" of the last tensor on it (views included). Ids are what a
recorder has at hand, such as addresses: a tensor id is used again after that tensor is freed, a storage id after
that storage is freed.

- `EXAMPLE`: the trace of a small step, each event beside the line of Python that makes it; `example_trace()`
  gives the events alone.
- `replay(events)` runs a trace on real tensors under memlab's MemoryTracker and returns what the tracker
  measured: each storage's lifetime (size, birth, death), in the trace's time (the index of the event), and its
  peak of live bytes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.allocator import events_from_tracker
from ..core.track import MemoryTracker
from ..core.validate import is_int
from ..planning.lifetimes import lifetimes_from_events

__all__ = ["EXAMPLE", "example_trace", "check_trace", "replay", "Replayed"]

# The forward of a two-layer block on a (4, 8) fp32 batch, then its loss (a recorder's view; ids are made up).
EXAMPLE = [
    ("w = torch.randn(8, 16)            # weights, made first, alive to the end", ("alloc", 1, 100, 512)),
    ("h = x @ w                          # (4, 16) fp32", ("alloc", 2, 101, 256)),
    ("h.relu_()                          # in place: writes into h", ("inplace", 2)),
    ("a = h[:, :8]                       # a view of h's storage", ("view", 3, 101)),
    ("del h                              # a still holds storage 101", ("free", 2)),
    ("m = torch.empty(0)                 # an empty tensor: 0 bytes", ("alloc", 2, 102, 0)),
    ("b = a.t()                          # a view of the view", ("view", 4, 101)),
    ("del a", ("free", 3)),
    ("c = b.contiguous()                 # (8, 4) fp32: a copy", ("alloc", 3, 103, 128)),
    ("del b                              # the last tensor on 101: it is freed", ("free", 4)),
    ("c.mul_(2)                          # in place", ("inplace", 3)),
    ("d = c.sum(dim=1)                   # (8,) fp32; address 101 is free again", ("alloc", 4, 101, 32)),
    ("del c", ("free", 3)),
    ("del m", ("free", 2)),
    ("loss = d.mean()                    # a 4-byte scalar, kept", ("alloc", 5, 104, 4)),
    ("del d", ("free", 4)),
]


def example_trace() -> list[tuple]:
    """The events of EXAMPLE (a fresh list)."""
    return [e for _, e in EXAMPLE]


def check_trace(events) -> list[tuple]:
    """events, checked to be a valid trace (see the module docstring): ValueError naming the first bad event."""
    if not isinstance(events, (list, tuple)):
        raise TypeError(f"events must be a list of event tuples, got {type(events).__name__}")
    tensors: dict = {}                                   # live tensor id -> storage id
    storages: dict = {}                                  # live storage id -> number of live tensors on it
    for i, e in enumerate(events):
        ok = isinstance(e, tuple) and e and (
            (e[0] == "alloc" and len(e) == 4 and is_int(e[3]) and e[3] >= 0)
            or (e[0] == "view" and len(e) == 3) or (e[0] in ("inplace", "free") and len(e) == 2))
        if not ok:
            raise ValueError(f"events[{i}] must be ('alloc', t, s, nbytes >= 0), ('view', t, s), ('inplace', t) "
                             f"or ('free', t), got {e!r}")
        kind, t = e[0], e[1]
        if kind in ("alloc", "view"):
            s = e[2]
            if t in tensors:
                raise ValueError(f"events[{i}] makes tensor {t!r}, which is alive (free it first)")
            if (kind == "alloc") == (s in storages):
                raise ValueError(f"events[{i}] {'allocates' if kind == 'alloc' else 'views'} storage {s!r}, which "
                                 f"is {'alive' if kind == 'alloc' else 'not alive'}")
            tensors[t] = s
            storages[s] = storages.get(s, 0) + 1
        else:
            if t not in tensors:
                raise ValueError(f"events[{i}] names tensor {t!r}, which is not alive")
            if kind == "free":
                s = tensors.pop(t)
                storages[s] -= 1
                if not storages[s]:
                    del storages[s]
    return list(events)


class Replayed(NamedTuple):
    """What the tracker measured while a trace ran: one (size, birth, death) per storage, in the order of the
    "alloc" events, in the trace's time; and the tracker's peak of live bytes."""
    lifetimes: list[tuple[int, int, int]]
    peak: int


def replay(events) -> Replayed:
    """Run a trace on real CPU tensors under memlab's MemoryTracker: "alloc" makes torch.empty(nbytes) of uint8,
    "view" slices a live tensor on that storage, "inplace" adds 1 in place, "free" drops the tensor. The tracker
    records each storage as it is made and freed; its times are mapped back to the index of the event that caused
    them."""
    events = check_trace(events)
    live: dict = {}                                      # tensor id -> the tensor
    on: dict = {}                                        # storage id -> tensor ids on it
    when: list[int] = []                                 # for each tracker event, the trace event that caused it
    tracker = MemoryTracker(device="cpu", timeline=True)
    with tracker:
        for i, e in enumerate(events):
            kind, t = e[0], e[1]
            if kind == "alloc":
                live[t] = torch.empty(e[3], dtype=torch.uint8)
                on[e[2]] = [t]
            elif kind == "view":
                live[t] = live[on[e[2]][0]][:]               # basic slicing: the same storage
                on[e[2]].append(t)
            elif kind == "inplace":
                live[t].add_(1)
            else:
                for ts in on.values():
                    if t in ts:
                        ts.remove(t)
                del live[t]
            when += [i] * (len(events_from_tracker(tracker)) - len(when))
        stream = events_from_tracker(tracker)
        peak = tracker.peak
    when.append(len(events))                             # a storage alive at the end dies at len(events)
    lts = lifetimes_from_events(stream)
    return Replayed([(lt.size, when[lt.birth], when[lt.death]) for lt in lts], peak)
