"""Measuring activation checkpointing: the activation bytes of one forward +
backward, a forward-call counter that sees recomputations, a stack of simple
residual blocks. (Chen et al.'s 2016 peak formula is memlab.core.estimate.chen_segment_peak.)

What is measured: `activation_peak` runs `loss = fn(*args)` and
`loss.backward()` under a `MemoryTracker` that watches the model, with every
parameter's `.grad` already allocated (zeros), so gradients accumulate in
place and the model state (parameters + gradients) stays constant during the
step. Everything else that is live is activation memory: tensors saved for
backward, checkpoint-stashed inputs, recomputed activations, and the
gradients of activations flowing backward. `peak` is the largest total of
those; `stored` is what is still live when the forward ends (what the forward
kept for the backward). Inputs created before the call are not counted.

No checkpointing scheme lives here: wrapping blocks in
`torch.utils.checkpoint.checkpoint` is the learner's job (lesson and exercise 02).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from .core.track import MemoryTracker, format_bytes, phase
from .core.validate import pos_int

__all__ = ["ActivationPeak", "activation_peak", "ForwardCounter", "ResidualMLPBlock", "block_stack"]


@dataclass
class ActivationPeak:
    """What `activation_peak` measured (bytes above the constant model state)."""
    peak: int             # largest activation bytes at any moment of forward + backward
    stored: int           # activation bytes live at the end of the forward
    peak_phase: str       # "forward" or "backward"
    tracker: MemoryTracker

    def __str__(self) -> str:
        return (f"activation peak {format_bytes(self.peak)} (in {self.peak_phase}), "
                f"stored after forward {format_bytes(self.stored)}")


def activation_peak(model: nn.Module, fn, *args, timeline: bool = False, **kwargs) -> ActivationPeak:
    """Run `loss = fn(*args, **kwargs)` then `loss.backward()` and measure the
    activation bytes (see the module docstring). `model` is the nn.Module whose
    parameters (and gradients) form the model state; its `.grad`s are restored
    to what they were before the call, so the measurement changes nothing.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not callable(fn):
        raise TypeError(f"fn must be callable and return a scalar loss, got {type(fn).__name__}")
    params = [p for p in model.parameters() if p.requires_grad]
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    tracker = MemoryTracker(model, timeline=timeline)
    try:
        with tracker:
            base = tracker.current                      # parameters + gradients (+ buffers)
            with phase("forward"):
                loss = fn(*args, **kwargs)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
                raise TypeError("fn must return a scalar loss tensor that requires grad")
            stored = tracker.current - base
            with phase("backward"):
                loss.backward()
            del loss
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
    peak = tracker.peak - base
    return ActivationPeak(peak, stored, tracker.peak_phase, tracker)


class ForwardCounter:
    """Counts calls to the `forward` of chosen modules, recomputations included.

    Forward hooks are not reliable for this: a non-reentrant checkpoint stops
    the recomputation as soon as the last tensor it needs has been recomputed
    (early stop, the default), so the checkpointed module's forward never
    returns and its forward hooks do not fire again. This counter instead
    wraps `forward` itself and counts on entry:

        counter = ForwardCounter(model.blocks)     # one module, or several
        ... forward + backward ...
        counter.counts  -> [2, 2, 2, 2]            # one per module, in order
        counter.remove()                           # restore the original forwards

    An nn.ModuleList or nn.Sequential stands for its children (one count per
    block); any other module is counted itself. To count a Sequential's own
    forward, pass it in a list: ForwardCounter([seq]).
    """

    def __init__(self, modules):
        if isinstance(modules, nn.Module) and not isinstance(modules, (nn.ModuleList, nn.Sequential)):
            modules = [modules]
        if not isinstance(modules, (nn.Module, list, tuple)):
            raise TypeError(f"modules must be an nn.Module or a list of them, got {type(modules).__name__}")
        mods = list(modules)
        if not mods or not all(isinstance(m, nn.Module) for m in mods):
            raise TypeError("modules must be an nn.Module or a non-empty list of nn.Modules")
        self.modules = mods
        self.counts = [0] * len(mods)
        self._shadowed = []                         # (module, the instance forward it had before, or None)
        for i, m in enumerate(mods):
            self._shadowed.append((m, m.__dict__.get("forward")))
            original = m.forward

            def counted(*a, _i=i, _f=original, **kw):
                self.counts[_i] += 1
                return _f(*a, **kw)

            m.forward = counted                     # an instance attribute shadows the class method

    def reset(self):
        self.counts = [0] * len(self.modules)

    @property
    def total(self) -> int:
        return sum(self.counts)

    def remove(self):
        """Give every module its forward back (idempotent)."""
        for m, before in self._shadowed:
            if before is None:
                m.__dict__.pop("forward", None)
            else:
                m.forward = before
        self._shadowed = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


class ResidualMLPBlock(nn.Module):
    """x + W2 gelu(W1 x): a transformer-like MLP block without attention.

    Saved for backward in fp32 (u = B * d * 4 bytes): W1's input x (u), GELU's
    input (hidden/d u) and W2's input (hidden/d u): 9 u for hidden = 4d. The
    block output is not saved by this block (the next block saves it).
    """

    def __init__(self, d: int, hidden: int | None = None):
        super().__init__()
        pos_int("d", d)
        hidden = 4 * d if hidden is None else hidden
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


def block_stack(n: int, d: int = 32, hidden: int | None = None) -> nn.Sequential:
    """nn.Sequential of `n` ResidualMLPBlocks of width `d`."""
    pos_int("n", n)
    return nn.Sequential(*(ResidualMLPBlock(d, hidden) for _ in range(n)))


def plan_peak(act_bytes, keep) -> int:
    """Peak activation bytes of a checkpoint plan under exercise 02's cost model: the bytes of the kept
    layers plus the bytes of the current run of recomputed layers (`keep[i]` True: layer i keeps its
    activations). Used by exercise 02's checks and benchmarks/bench_checkpointing.py."""
    kept = peak = run = 0
    for m, k in zip(act_bytes, keep):
        if k:
            kept, run = kept + m, 0
        else:
            run += m
            peak = max(peak, kept + run)
    return max(peak, kept)
