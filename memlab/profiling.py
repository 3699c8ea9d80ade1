"""PyTorch's profiler read as numbers: the memory timeline by category, and the phases of a training step.

`torch.profiler.profile(profile_memory=True, record_shapes=True, with_stack=True)` records every allocation
and free; `prof.export_memory_timeline(path, device)` writes them, per category, as a JSON `[times, sizes]`.
Two things make that file awkward to use, and this module does them once:

* `read_memory_timeline(path, prof)`: the file as live bytes by category name, on a time axis in ms since the
  profile started. Each row of `sizes` is `[0, bytes of category 0, bytes of category 1, ...]` in the order of
  `torch.profiler._memory_profiler._CATEGORY_TO_INDEX` (`MemoryProfileTimeline._coalesce_timeline` in
  `torch/profiler/_memory_profiler.py`); the names are read from there, not written here, and a file whose rows
  do not have that length is refused. Times are microseconds on the profiler's clock; the profile's start is
  `prof.profiler.kineto_results.trace_start_ns()`.
* `phase_spans(prof)`: when the forward, the backward and the optimizer step ran, from the profiler's own
  events: autograd's `autograd::engine::evaluate_function: ...` ranges are the backward, the optimizer's
  `Optimizer.step#...` and `Optimizer.zero_grad#...` ranges (torch/optim/optimizer.py) are the step, and the
  forward runs from the first recorded event to the backward (so it includes whatever ran before the model,
  such as making the batch).

Importing this module imports only torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

__all__ = ["MemoryTimeline", "read_memory_timeline", "phase_spans"]


def _check_profile(prof) -> None:
    if not isinstance(prof, torch.profiler.profile):
        raise TypeError(f"prof must be a torch.profiler.profile (after its `with` block), got {type(prof).__name__}")
    if prof.profiler is None or prof.profiler.kineto_results is None:
        raise ValueError("prof has no results: read it after its `with torch.profiler.profile(...)` block ends")


def _category_names() -> list[str]:
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX
    names = [""] * len(_CATEGORY_TO_INDEX)
    for cat, i in _CATEGORY_TO_INDEX.items():
        names[i] = "unknown" if cat is None else cat.name.lower()
    return names


@dataclass
class MemoryTimeline:
    """The profiler's memory timeline of one device: `times_ms[i]` (ms since the profile started) and the live
    bytes of each profiler category at that moment, `by_category[name][i]`."""
    times_ms: list[float]
    by_category: dict[str, list[int]]

    @property
    def totals(self) -> list[int]:
        """Live bytes of all categories together, one per sample."""
        return [sum(col) for col in zip(*self.by_category.values())]

    @property
    def peak(self) -> int:
        """The highest total (bytes); 0 for an empty timeline."""
        return max(self.totals, default=0)

    def at_peak(self) -> dict[str, int]:
        """Live bytes by category at the first sample where the total peaks (all zero for an empty timeline)."""
        totals = self.totals
        i = totals.index(max(totals)) if totals else None
        return {name: (col[i] if i is not None else 0) for name, col in self.by_category.items()}


def read_memory_timeline(path: str | os.PathLike, prof=None) -> MemoryTimeline:
    """Read the JSON that `prof.export_memory_timeline(path, device)` wrote (a `.json` path, not `.html` or
    `.gz`). With `prof` (the profile it came from), times count from the profile's start; without it, from
    the first sample."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if not str(path).endswith(".json") or not os.path.isfile(path):
        raise ValueError(f"path must be an existing .json file written by export_memory_timeline, got {path!r}")
    if prof is not None:
        _check_profile(prof)
    with open(path) as f:
        data = json.load(f)
    names = _category_names()
    if not (isinstance(data, list) and len(data) == 2 and len(data[0]) == len(data[1])
            and all(isinstance(row, list) and len(row) == len(names) + 1 for row in data[1])):
        raise ValueError(f"path {path!r} is not a memory timeline of this torch ({torch.__version__}): expected "
                         f"[times, sizes] with rows of {len(names) + 1} numbers")
    times, sizes = data
    if prof is not None:
        start_us = prof.profiler.kineto_results.trace_start_ns() / 1000
    else:
        start_us = times[0] if times else 0
    return MemoryTimeline([(t - start_us) / 1000 for t in times],
                          {name: [int(row[i + 1]) for row in sizes] for i, name in enumerate(names)})


def phase_spans(prof) -> dict[str, tuple[float, float]]:
    """{"forward" | "backward" | "step": (start_ms, end_ms)} since the profile started, for the phases found
    in the profile's events (a profile without a backward has no "backward", and so on)."""
    _check_profile(prof)
    spans: dict[str, list[float]] = {}
    first = None
    for e in prof.events():
        start, end = e.time_range.start / 1000, e.time_range.end / 1000            # us -> ms
        first = start if first is None else min(first, start)
        phase = ("backward" if e.name.startswith("autograd::engine::evaluate_function")
                 else "step" if e.name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")) else None)
        if phase:
            lo, hi = spans.get(phase, (start, end))
            spans[phase] = [min(lo, start), max(hi, end)]
    later = [spans[p][0] for p in ("backward", "step") if p in spans]
    if first is not None and later and min(later) > first:
        spans["forward"] = [first, min(later)]
    return {p: (spans[p][0], spans[p][1]) for p in ("forward", "backward", "step") if p in spans}
