"""memlab's memory tracker: exact live bytes of tensor storages, by category.

A `MemoryTracker` is a `TorchDispatchMode`: every ATen op that runs inside
`with tracker:` passes through it, so it sees every tensor storage as it is
created, and a weak reference tells it the moment the storage is freed. It
therefore works the same on CPU, CUDA, MPS, meta and FakeTensor (the virtual
GPU), which is what lets a learner without a GPU see exact numbers.

Categories (the role a storage plays; a storage has exactly one):

    parameters   parameters and buffers of the watched model(s)
    gradients    `.grad` of those parameters
    optimizer    tensors held in `optimizer.state` (Adam's exp_avg, exp_avg_sq, step)
    activations  what a "forward" phase produced that is still alive when the phase
                 ends: the tensors autograd saved for backward, checkpoint's stashed
                 inputs, the logits and the loss (mark phases with memlab.phase)
    temporaries  everything else: intermediates that die young, gradients of
                 activations during backward, optimizer scratch, inputs

A storage starts as "temporaries" and is re-labelled the moment its role is
known (a grad hook fires, the optimizer's step ends, the forward phase ends). The
peak breakdown is corrected retroactively: a storage that was alive at the
peak is counted at the peak under its final role. Timeline samples are not
corrected (they show what was known at that instant).

What it counts: storages created inside the `with` block on the tracked
device, plus what `watch()` registers (the model's parameters, existing
gradients and optimizer state, extra tensors). Bytes are `storage.nbytes()`;
with `round_to=512` each storage is rounded up like the CUDA caching
allocator rounds a request (kMinBlockSize = 512 in PyTorch's c10 caching allocator).
It does not see the allocator's cached-but-free blocks, the CUDA context, or
cuBLAS workspaces: on CUDA, `cuda_stats` reports the allocator beside it.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .validate import int_at_least, number_type, one_of

__all__ = ["CATEGORIES", "MemoryTracker", "Sample", "phase", "watch", "active_trackers", "format_bytes"]

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")
_IDX = {c: i for i, c in enumerate(CATEGORIES)}
_P, _G, _O, _A, _T = range(5)

_ACTIVE: list["MemoryTracker"] = []  # stack of trackers inside their `with`
_LIFT_FRESH = torch.ops.aten.lift_fresh.default


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB' (binary units, as torch.cuda.memory_summary prints)."""
    if not isinstance(n, (int, float)):
        raise TypeError(f"n must be a number of bytes, got {type(n).__name__}")
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark a phase ("forward", "backward", "step", ...) on every active tracker.

    A no-op when no tracker is active, so training code can carry phase marks
    whether or not anyone is measuring it.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"phase name must be a non-empty string, got {name!r}")
    trackers = list(_ACTIVE)
    previous = [t._phase for t in trackers]
    for t in trackers:
        t._set_phase(name)
    try:
        yield
    finally:
        for t, p in zip(trackers, previous):
            t._set_phase(p)


def watch(model=None, optimizer=None, tensors: Iterable[torch.Tensor] = (), category: str = "temporaries"):
    """Register a model/optimizer/tensors with every active tracker (see
    `MemoryTracker.watch`). Code that builds its model inside a tracker (the
    virtual GPU) calls this so parameters are counted as parameters."""
    for t in list(_ACTIVE):
        t.watch(model, optimizer, tensors, category)


def active_trackers() -> list["MemoryTracker"]:
    """The trackers whose `with` block is running, outermost first."""
    return list(_ACTIVE)


@dataclass
class Sample:
    """One point of the timeline: after event number `seq`, in phase `phase`."""
    seq: int
    phase: str
    total: int
    by_category: dict[str, int]


@dataclass
class _Block:
    nbytes: int
    cat: int
    seq: int               # event number at which it was allocated (or registered)
    phase: str             # phase it was allocated in
    ref: weakref.ref | None = None


@dataclass
class _Peak:
    seq: int = -1
    total: int = 0
    counts: list[int] = field(default_factory=lambda: [0] * len(CATEGORIES))

    def as_dict(self) -> dict[str, int]:
        return dict(zip(CATEGORIES, self.counts))


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    # wrapper subclasses (FakeTensor is not one of them) may have no storage
    try:
        return [t.untyped_storage()]
    except (RuntimeError, NotImplementedError):
        return []


class _Accounting:
    """MemoryTracker's storage accounting: live blocks, counts by category, the peaks and the event log, and
    the out-of-memory error at capacity (state set up by MemoryTracker.__init__)."""

    # ------------------------------------------------------------------ bookkeeping
    def _bytes(self, st: torch.UntypedStorage) -> int:
        n = st.nbytes()
        r = self.round_to
        return n if r == 1 else -(-n // r) * r

    def _counts_device(self, t: torch.Tensor) -> bool:
        return t.device.type == self._device_type

    def _add(self, st: torch.UntypedStorage, cat: int) -> _Block | None:
        key = st._cdata
        blk = self._blocks.get(key)
        if blk is not None:
            n = self._bytes(st)
            if n != blk.nbytes:                       # resized in place (resize_, set_)
                self._grow(blk, n - blk.nbytes)
            return blk
        n = self._bytes(st)
        if self.capacity is not None and self._total + n > self.capacity:
            self._raise_oom(n)
        self._seq += 1
        blk = _Block(n, cat, self._seq, self._phase)
        blocks, finalize = self._blocks, self._free
        blk.ref = weakref.ref(st, lambda _r, key=key: finalize(key))
        blocks[key] = blk
        self._counts[cat] += n
        self._total += n
        if self.keep_timeline:
            self._cat_of[blk.seq] = cat
            self._events.append((self._seq, self._phase, blk.seq, n))
        self._after_event()
        return blk

    def _grow(self, blk: _Block, delta: int):
        if delta > 0 and self.capacity is not None and self._total + delta > self.capacity:
            self._raise_oom(delta)
        self._seq += 1
        blk.nbytes += delta
        self._counts[blk.cat] += delta
        self._total += delta
        if self.keep_timeline:
            self._events.append((self._seq, self._phase, blk.seq, delta))
        self._after_event()

    def _free(self, key: int):
        blk = self._blocks.pop(key, None)
        if blk is None:
            return
        self._seq += 1
        self._counts[blk.cat] -= blk.nbytes
        self._total -= blk.nbytes
        if self.keep_timeline:
            self._events.append((self._seq, self._phase, blk.seq, -blk.nbytes))
        self._after_event()

    def _after_event(self):
        total = self._total
        if total > self._peak.total:
            self._peak = _Peak(self._seq, total, list(self._counts))
        pp = self._phase_peaks.get(self._phase)
        if pp is None or total > pp.total:
            self._phase_peaks[self._phase] = _Peak(self._seq, total, list(self._counts))

    def _relabel(self, st: torch.UntypedStorage, cat: int):
        """Give a storage its role; fix the recorded peaks it was alive at."""
        blk = self._blocks.get(st._cdata)
        if blk is None:
            self._add(st, cat)           # registering a storage made before the tracker
            return
        if blk.cat == cat:
            return
        old = blk.cat
        self._counts[old] -= blk.nbytes
        self._counts[cat] += blk.nbytes
        blk.cat = cat
        if self.keep_timeline:
            self._cat_of[blk.seq] = cat
        # the block is alive now, so it was alive at every peak recorded after its birth
        for pk in (self._peak, *self._phase_peaks.values()):
            if pk.seq >= blk.seq:
                pk.counts[old] -= blk.nbytes
                pk.counts[cat] += blk.nbytes

    def _raise_oom(self, request: int):
        cap = self.capacity
        for o in self._watched_opts:            # label what the optimizer has created so far
            self._on_step(o)
        if self._phase == "forward":             # what the forward made so far is (mostly) saved for backward
            self._label_forward_survivors()
        live = self.breakdown()
        where = f" during phase '{self._phase}'" if self._phase != "idle" else ""
        dev = self.device_label or self._device_type
        lines = [
            f"CUDA out of memory{where}. Tried to allocate {format_bytes(request)}. "
            f"GPU 0 ({dev}) has a total capacity of {format_bytes(cap)} of which "
            f"{format_bytes(max(cap - self._total, 0))} is free. "
            f"{format_bytes(self._total)} is allocated by PyTorch.",
            "Live tensors at this moment, by category (memlab):",
        ]
        lines += [f"  {c:<12} {format_bytes(b):>12}" for c, b in live.items()]
        self.oom = {"request": request, "phase": self._phase, "live": live, "capacity": cap}
        raise torch.OutOfMemoryError("\n".join(lines))


class _Registration:
    """MemoryTracker's registration: the watched models (parameters, buffers, gradients by hook) and optimizers
    (state after each step), and extra tensors with a category."""

    # ------------------------------------------------------------------ input checks
    @staticmethod
    def _check_module(m):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module (or a list of them), got {type(m).__name__}")

    @staticmethod
    def _check_optimizer(o):
        if not isinstance(o, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (or a list of them), got {type(o).__name__}")

    # ------------------------------------------------------------------ registration
    def watch(self, model=None, optimizer=None, tensors: Iterable[torch.Tensor] = (),
              category: str = "temporaries") -> "MemoryTracker":
        """Register a model, an optimizer and/or extra tensors (e.g. an input batch
        created before the tracker). May be called before or inside `with`."""
        one_of("category", category, CATEGORIES)
        if model is not None:
            for m in (model if isinstance(model, (list, tuple)) else [model]):
                self._check_module(m)
                if m not in self._models:
                    self._models.append(m)
                if self._depth:
                    self._watch_model(m)
        if optimizer is not None:
            for o in (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]):
                self._check_optimizer(o)
                if o not in self._opts:
                    self._opts.append(o)
                if self._depth:
                    self._watch_optimizer(o)
        flat, _ = tree_flatten(list(tensors))
        for t in flat:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensors must contain only torch.Tensor, got {type(t).__name__}")
            if self._counts_device(t):
                for st in _storages(t):
                    self._relabel(st, _IDX[category])
        return self

    def _watch_model(self, m: torch.nn.Module):
        for p in m.parameters():
            if id(p) in self._watched_params:
                continue
            self._watched_params[id(p)] = p
            if self._counts_device(p):
                for st in _storages(p):
                    self._relabel(st, _P)
                if p.grad is not None:
                    for st in _storages(p.grad):
                        self._relabel(st, _G)
            if p.requires_grad:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        for b in m.buffers():
            if self._counts_device(b):
                for st in _storages(b):
                    self._relabel(st, _P)

    def _on_grad(self, p: torch.Tensor):
        if p.grad is not None and self._counts_device(p.grad):
            for st in _storages(p.grad):
                self._relabel(st, _G)

    def _watch_optimizer(self, o: torch.optim.Optimizer):
        self._watched_opts.append(o)
        self._on_step(o)
        self._handles.append(o.register_step_post_hook(lambda opt, args, kwargs: self._on_step(opt)))

    def _on_step(self, o: torch.optim.Optimizer):
        for state in o.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and self._counts_device(v):
                    for st in _storages(v):
                        self._relabel(st, _O)
        # grads may have been replaced during the step (rare); keep their label right
        for group in o.param_groups:
            for p in group["params"]:
                self._on_grad(p)


class _Results:
    """MemoryTracker's results: live bytes now, the peak and its breakdown and phase, each phase's peak, the
    timeline and the report."""

    # ------------------------------------------------------------------ results
    @property
    def current(self) -> int:
        """Live bytes now."""
        return self._total

    def breakdown(self) -> dict[str, int]:
        """Live bytes now, by category."""
        return dict(zip(CATEGORIES, self._counts))

    @property
    def peak(self) -> int:
        """Highest live total seen (bytes)."""
        return self._peak.total

    @property
    def peak_breakdown(self) -> dict[str, int]:
        """Live bytes by category at the moment of the peak (final roles)."""
        return self._peak.as_dict()

    @property
    def peak_phase(self) -> str:
        """The phase the peak happened in."""
        for ph, pk in self._phase_peaks.items():
            if pk.seq == self._peak.seq:
                return ph
        return "idle"

    @property
    def phase_peaks(self) -> dict[str, dict[str, int]]:
        """For each phase: its peak total and the breakdown at that moment."""
        return {ph: {"total": pk.total, **pk.as_dict()} for ph, pk in self._phase_peaks.items()
                if ph in self._phases_seen or ph == "idle"}

    @property
    def timeline(self) -> list[Sample]:
        """One sample per allocation/free event, in order, each storage under its
        final role. What was registered at entry (the model, existing state) is the
        first sample, not a ramp of events."""
        counts, out, start = [0] * len(CATEGORIES), [], self._timeline_from
        for i, (seq, ph, uid, delta) in enumerate(self._events):
            counts[self._cat_of[uid]] += delta
            if i >= start - 1 and (i >= start or start > 0):
                out.append(Sample(seq, ph if i >= start else "idle", sum(counts), dict(zip(CATEGORIES, counts))))
        return out

    def reset_peak(self):
        """Forget the peaks and the timeline (live blocks stay tracked)."""
        self._peak = _Peak(self._seq, self._total, list(self._counts))
        self._phase_peaks = {}
        self._timeline_from = len(self._events)

    def report(self) -> str:
        """A table: peak by category, and each phase's peak."""
        lines = [f"{'category':<12} {'at peak':>12}   {'now':>12}"]
        now = self.breakdown()
        for c in CATEGORIES:
            lines.append(f"{c:<12} {format_bytes(self.peak_breakdown[c]):>12}   {format_bytes(now[c]):>12}")
        lines.append(f"{'total':<12} {format_bytes(self.peak):>12}   {format_bytes(self.current):>12}")
        lines.append(f"peak reached in phase: {self.peak_phase}")
        for ph, d in self.phase_peaks.items():
            lines.append(f"  peak during {ph:<10} {format_bytes(d['total']):>12}")
        if self.cuda_stats.get("max_allocated") is not None:
            lines.append(f"CUDA allocator: max allocated {format_bytes(self.cuda_stats['max_allocated'])}, "
                         f"max reserved {format_bytes(self.cuda_stats['max_reserved'])}")
        return "\n".join(lines)


class MemoryTracker(_Accounting, _Registration, _Results, TorchDispatchMode):
    """Exact live tensor bytes by category, with phases, a peak and a timeline.

        tracker = MemoryTracker(model, optimizer)
        with tracker:
            with memlab.phase("forward"):
                loss = loss_fn(model(x), y)
            with memlab.phase("backward"):
                loss.backward()
            with memlab.phase("step"):
                optimizer.step()
        tracker.peak, tracker.peak_breakdown, tracker.phase_peaks, tracker.timeline

    Args:
        model: an nn.Module (or list of them) whose parameters/buffers are "parameters".
        optimizer: a torch.optim.Optimizer (or list) whose state is "optimizer".
        device: device type to count ("cpu", "cuda", "mps", "meta"); default: the
            model's parameter device, else "cpu". Tensors on other devices are ignored.
        capacity: bytes; exceeding it raises torch.OutOfMemoryError (the virtual GPU).
        round_to: round each storage up to a multiple of this many bytes (1 = exact).
        timeline: keep a sample per allocation/free event (cheap; turn off for huge runs).
    """

    def __init__(self, model=None, optimizer=None, *, device: str | torch.device | None = None,
                 capacity: int | None = None, round_to: int = 1, timeline: bool = True,
                 device_label: str | None = None):
        super().__init__()
        if capacity is not None:
            number_type("capacity", capacity, what="a number of bytes or None")
            if capacity <= 0:
                raise ValueError(f"capacity must be > 0 bytes, got {capacity}")
        int_at_least("round_to", round_to, 1)
        if device is not None and not isinstance(device, (str, torch.device)):
            raise TypeError(f"device must be a str, torch.device or None, got {type(device).__name__}")
        self.capacity = int(capacity) if capacity is not None else None
        self.round_to = round_to
        self.keep_timeline = bool(timeline)
        self.device_label = device_label
        self._device_type = torch.device(device).type if device is not None else None
        self._blocks: dict[int, _Block] = {}
        self._counts = [0] * len(CATEGORIES)
        self._total = 0
        self._seq = 0
        self._phase = "idle"
        self._phases_seen: list[str] = []
        self._peak = _Peak()
        self._phase_peaks: dict[str, _Peak] = {}
        # timeline as an event log: (seq, phase, block id, byte delta); categories are looked up
        # at read time, so a storage relabelled later shows under its final role everywhere
        self._events: list[tuple[int, str, int, int]] = []
        self._cat_of: dict[int, int] = {}
        self._timeline_from = 0
        self._handles: list = []
        self._watched_params: dict[int, torch.nn.Parameter] = {}
        self._watched_opts: list[torch.optim.Optimizer] = []
        self._depth = 0
        self.cuda_stats: dict[str, int] = {}
        self._cuda_phase_stats: list[tuple[str, int, int]] = []
        self._models = []
        for m in ([] if model is None else (model if isinstance(model, (list, tuple)) else [model])):
            self._check_module(m)
            self._models.append(m)
        self._opts = []
        for o in ([] if optimizer is None else (optimizer if isinstance(optimizer, (list, tuple)) else [optimizer])):
            self._check_optimizer(o)
            self._opts.append(o)
        if self._device_type is None:
            for m in self._models:
                for p in m.parameters():
                    self._device_type = p.device.type
                    break
                if self._device_type:
                    break
            self._device_type = self._device_type or "cpu"

    # ------------------------------------------------------------------ context
    def __enter__(self):
        if self._depth == 0:
            for m in self._models:
                self._watch_model(m)
            for o in self._opts:
                self._watch_optimizer(o)
            self._timeline_from = len(self._events)
            if self._device_type == "cuda" and torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.cuda_stats = {"allocated_at_enter": torch.cuda.memory_allocated(),
                                   "reserved_at_enter": torch.cuda.memory_reserved()}
            _ACTIVE.append(self)
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self._depth -= 1
        out = super().__exit__(*exc)
        if self._depth == 0:
            _ACTIVE.remove(self)
            for h in self._handles:
                h.remove()
            self._handles.clear()
            self._watched_params.clear()
            self._watched_opts.clear()
            if self._device_type == "cuda" and torch.cuda.is_available():
                torch.cuda.synchronize()
                self.cuda_stats.update(max_allocated=torch.cuda.max_memory_allocated(),
                                       max_reserved=torch.cuda.max_memory_reserved(),
                                       allocated_at_exit=torch.cuda.memory_allocated(),
                                       reserved_at_exit=torch.cuda.memory_reserved())
        return out

    def _label_forward_survivors(self):
        # whatever the forward produced and is still alive is kept for backward: activations.
        # (Hooking autograd's saved tensors instead would change when PyTorch frees them.)
        for blk in list(self._blocks.values()):
            if blk.cat == _T and blk.phase == "forward":
                st = blk.ref() if blk.ref is not None else None
                if st is not None:
                    self._relabel(st, _A)

    def _set_phase(self, name: str):
        if name == self._phase:
            return
        if self._phase == "forward":
            self._label_forward_survivors()
        if self._device_type == "cuda" and torch.cuda.is_available() and self._depth:
            self._cuda_phase_stats.append((name, torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
        self._phase = name
        if name not in self._phases_seen:
            self._phases_seen.append(name)
        pp = self._phase_peaks.get(name)        # a phase's peak includes the level it starts at
        if name != "idle" and (pp is None or self._total > pp.total):
            self._phase_peaks[name] = _Peak(self._seq, self._total, list(self._counts))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat, _ = tree_flatten(out)
        inputs = None
        for t in flat:
            if isinstance(t, torch.Tensor) and t.device.type == self._device_type:
                for st in _storages(t):
                    if st._cdata not in self._blocks and func is not _LIFT_FRESH:
                        # a view or in-place result of a tensor made before the tracker is not new memory
                        # (lift_fresh is different: it wraps a tensor torch.tensor() just built from data)
                        if inputs is None:
                            inputs = {s._cdata for a in tree_flatten((args, kwargs))[0]
                                      if isinstance(a, torch.Tensor) for s in _storages(a)}
                        if st._cdata in inputs:
                            continue
                    self._add(st, _T)
        return out
