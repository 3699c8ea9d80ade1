"""What runs in the learner's process for exercise 01: each task's `run`, returning plain data (what the learner
returned is described, never trusted). Tasks 1.1-1.4 ask for the learner's own measurement: while the learner's
code runs, memlab's tracker may not run, and no Python function of memlab/core/track.py may be called (a subclass
of memlab.MemoryTracker, or a wrapper that delegates to one, calls them)."""

from __future__ import annotations

import contextlib
import sys

import torch

from memlab.core.track import MemoryTracker

from ..common import forbid_memlab_tracker, memlab_files, no_calls
from .inputs import DTYPES, _breakdown_setup, _fingerprint, _phase_setup, _saved_setup

# ----------------------------------------------------------------------------- memlab's tracker is not the learner's
TRACKER_FILE = memlab_files("core/track.py")
HARMLESS = {"format_bytes", "phase"}        # printing bytes, and phase marks (a no-op without a tracker)
OWN_MODE = ("this task asks you to build the measurement yourself: memlab.MemoryTracker (memlab/core/track.py) is "
            "the lesson's finished tracker, so neither it nor a subclass of it nor a class that calls into it counts. "
            "Write your own TorchDispatchMode (your LiveBytes) and use autograd's hooks")


def no_tracker_calls(task: str):
    """While the learner's code runs: no call into memlab's tracker (memlab/core/track.py), however it is reached."""
    return no_calls(task, lambda filename, name: filename.endswith(TRACKER_FILE) and name not in HARMLESS, OWN_MODE)


@contextlib.contextmanager
def own_measurement(task: str):
    """memlab.MemoryTracker refused on entry (a clear message at once) and no call into its module at all (what
    a subclass or a wrapper made before the refusal was installed would still reach)."""
    with no_tracker_calls(task), forbid_memlab_tracker(task):
        yield


def measured_by_learner(task: str, fn):
    """fn() under `own_measurement`; what it returned, or {"problem": why} when it reached memlab's tracker."""
    try:
        with own_measurement(task):
            return fn()
    except AssertionError as e:
        return {"problem": str(e)}

# ----------------------------------------------------------------------------- plain-data helpers
def _as_int(v):
    """What the learner returned, as plain data: an int stays an int; anything else is described."""
    return v if type(v) is int else {"not_int": type(v).__name__, "repr": repr(v)[:80]}


def _as_dict(d):
    if type(d) is not dict:
        return {"not_dict": type(d).__name__, "repr": repr(d)[:120]}
    return {"items": {str(k): _as_int(v) for k, v in d.items()}}


# ----------------------------------------------------------------------------- task1_1
def _live_run(case, LiveBytes):
    if isinstance(LiveBytes, type) and issubclass(LiveBytes, MemoryTracker):
        return {"problem": f"task1_1: LiveBytes is memlab.MemoryTracker or a subclass of it; {OWN_MODE}"}
    try:
        with no_tracker_calls("task1_1"):
            return _live_steps(case, LiveBytes)
    except AssertionError as e:                      # the learner's mode reached memlab's tracker
        return {"problem": str(e)}


def _live_steps(case, LiveBytes):
    outside = torch.ones(1000)                       # made before the mode: never counted
    to_sort = torch.rand(case["sort_n"])             # also made before the mode
    try:
        mode = LiveBytes()
    except Exception as e:  # noqa: BLE001 - report any construction failure as a teaching message
        return {"problem": f"LiveBytes() must construct with no arguments; it raised {type(e).__name__}: {e}"}
    if isinstance(mode, MemoryTracker):
        return {"problem": f"task1_1: LiveBytes() returned a memlab.MemoryTracker; {OWN_MODE}"}
    for attr in ("current", "peak"):
        if not hasattr(mode, attr):
            return {"problem": f"LiveBytes needs a `{attr}` attribute (bytes, an int)"}
    seen = []

    def note():
        if sys.version_info < (3, 11):
            # Python 3.10's profile hook (no_tracker_calls) copies this function's caller's locals into a dict at
            # each C call it makes, and a name deleted since stays in that copy, holding its tensor, until the next
            # one: refresh the copy so that `del v` frees v's storage before it is counted
            sys._getframe(1).f_locals
        seen.append([_as_int(mode.current), _as_int(mode.peak)])

    with mode:
        note()                                                   # entering the mode
        a = torch.zeros(case["n1"], dtype=DTYPES[case["dtype"]])  # a new storage
        note()
        v = a.view(-1, 1)[: case["n1"] // 2]                     # views share a's storage: nothing new
        note()
        a.add_(1)                                                # in place: nothing new
        note()
        b = outside * 2                                          # a new storage from an op on an outside tensor
        note()
        w = outside.view(10, 100)                                # views / in-place results / several views
        outside.mul_(1)                                          # of an outside tensor: its storage existed
        parts = outside.chunk(3)                                 # before the mode, so nothing new
        note()
        values, indices = torch.sort(to_sort)                    # one op, two new storages (float32, int64)
        note()
        del values, indices
        note()
        del w, parts
        del a
        note()                                                   # `del a` while a view of it is alive
        del v
        note()                                                   # its last view gone: the storage is freed
        if not hasattr(mode, "reset_peak"):
            return {"problem": "LiveBytes needs a reset_peak() method that sets peak to the current bytes"}
        mode.reset_peak()
        note()
        del outside                                              # freeing something never counted
        note()
        live = {}
        for i, op in enumerate(case["stream"]):                  # a stream of allocations and frees
            if op[0] == "free":
                del live[op[1]]
            else:
                live[i] = torch.empty(op[1], dtype=DTYPES[op[2]])
            note()
        c = torch.zeros(case["n_detach"])                       # a new storage, then a detached alias of it
        note()
        d = c.detach()                                           # shares c's storage, but is not a view of c
        del c
        note()                                                   # the storage is alive while d holds it
        del d
        note()                                                   # now it is freed
        e = torch.empty_strided((case["strided"][0],), (case["strided"][1],))   # storage larger than the tensor
        note()
        del e
        note()
        del b
    return seen


# ----------------------------------------------------------------------------- task1_2
def _phase_run(case, profile_phases):
    model, opt, x, y, _ = _phase_setup(case)
    steps = []
    for _ in range(2):                               # the first step (lazy optimizer state) and a steady one
        step = measured_by_learner("task1_2", lambda: profile_phases(model, opt, x, y))
        if isinstance(step, dict) and "problem" in step:
            return step
        steps.append(_as_dict(step))
    return {"steps": steps, "params": _fingerprint(model.parameters())}


# ----------------------------------------------------------------------------- task1_3
def _saved_run(case, saved_bytes_per_layer):
    model, x = _saved_setup(case)
    got = measured_by_learner("task1_3", lambda: saved_bytes_per_layer(model, x))
    if isinstance(got, dict) and "problem" in got:
        return got
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return {"got": _as_dict(got), "hooks_left": hooks}


# ----------------------------------------------------------------------------- task1_4
def _breakdown_run(case, category_breakdown):
    got = measured_by_learner("task1_4", lambda: category_breakdown(*_breakdown_setup(case)))
    return got if isinstance(got, dict) and "problem" in got else _as_dict(got)


# ----------------------------------------------------------------------------- task1_5
def _estimate_run(case, estimate_peak_bytes):
    got = estimate_peak_bytes(*case)
    if type(got) is float and got.is_integer():
        got = int(got)
    return _as_int(got)
