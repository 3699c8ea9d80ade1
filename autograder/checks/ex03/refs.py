"""Exercise 03: the trusted references (never the solution's code).

- task3_1: the judge drives torch.amp.GradScaler("cpu") with memlab.kit.ex03.drive_scaler, the driver the
  learner's scaler runs in.
- `reference_amp`: an AMP loop written differently from the exercise's (autograd.grad per micro-batch,
  accumulated by hand, the clipping formula of clip_grad_norm_ written out) around a real GradScaler.
- `reference_report`: memlab.MemoryTracker measuring the step, extended to note the dtype of each
  storage when an op creates it; parameters, gradients and optimizer state grouped by their dtype.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

import memlab
from memlab.kit.ex03 import summary

from .cases import CATEGORY_KEYS
from .inputs import DTYPES, amp_setup, build_report_case


def _reference_step(case, model, params, opt, scaler, micro, dtype):
    k = len(micro)
    acc = [torch.zeros_like(p) for p in params]
    mean = 0.0
    for x, y in micro:
        with torch.autocast("cpu", dtype=dtype):
            part = model(x, y) / k
        mean += part.item()
        acc = [a + g for a, g in zip(acc, torch.autograd.grad(scaler.scale(part), params))]
        del part
    for p, a in zip(params, acc):
        p.grad = a
    del acc
    if case["max_norm"] is not None:
        scaler.unscale_(opt)
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params)).item()
        coef = min(1.0, case["max_norm"] / (norm + 1e-6))      # clip_grad_norm_'s formula
        for p in params:
            p.grad.mul_(coef)
    scaler.step(opt)
    scaler.update()
    for p in params:
        p.grad = None
    return mean


def reference_amp(case) -> dict:
    """Losses, scales and the parameter change of `steps` AMP steps, computed without the exercise's loop, and the
    memory a step needs: the peak growth of each step (measured with memlab.MemoryTracker) and the bytes one
    micro-batch's forward leaves alive for backward."""
    model, opt, scaler, batches = amp_setup(case)
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    dtype = DTYPES[case["dtype"]]
    losses, scales, used, growth = [], [], [], []
    for micro in batches:
        used.append(float(scaler.get_scale()))
        tracker = memlab.MemoryTracker(model, opt)
        with tracker:
            before = tracker.current
            losses.append(_reference_step(case, model, params, opt, scaler, micro, dtype))
            growth.append(tracker.peak - before)
        scales.append(float(scaler.get_scale()))
    delta = torch.cat([(p.detach() - s).double().flatten() for p, s in zip(params, start)])
    x, y = batches[0][0]
    tracker = memlab.MemoryTracker(model, opt)
    with tracker:
        before = tracker.current
        with torch.autocast("cpu", dtype=dtype):
            loss = model(x, y)
        graph = tracker.current - before
        del loss
    return {"losses": losses, "scales": scales, "used": used, "delta": delta, "growth": growth, "graph": graph}


class _DtypeTracker(memlab.MemoryTracker):
    """memlab's tracker, also noting the dtype of the op output that created each storage."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dtype_of: dict[int, torch.dtype] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self._seq
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                blk = self._blocks.get(t.untyped_storage()._cdata)
                if blk is not None and blk.seq > before:
                    self.dtype_of[t.untyped_storage()._cdata] = t.dtype
        return out

    def activations_by_dtype(self, exclude: set) -> dict:
        cat = memlab.CATEGORIES.index("activations")
        out: dict[str, int] = {}
        for key, blk in self._blocks.items():
            if blk.cat == cat and key not in exclude:
                name = str(self.dtype_of[key]).replace("torch.", "")
                out[name] = out.get(name, 0) + blk.nbytes
        return out


def _by_dtype(tensors) -> dict:
    out: dict[str, int] = {}
    for t in tensors:
        name = str(t.dtype).replace("torch.", "")
        out[name] = out.get(name, 0) + t.untyped_storage().nbytes()
    return out


def reference_report(case):
    """(totals measured by memlab's tracker, split by dtype, parameter summary after the step)."""
    model, opt, x, y = build_report_case(case)
    dtype = DTYPES[case["dtype"]]
    tracker = _DtypeTracker(model, opt)
    # the batch existed before the step: a view of it taken in the forward (GPT's targets.view(-1)) is no activation
    tracker.watch(tensors=[x, y], category="temporaries")
    with tracker:
        with memlab.phase("forward"):
            with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = model(x, y)
        with memlab.phase("backward"):              # entering it labels the forward's survivors as activations
            loss_key = loss.untyped_storage()._cdata
            totals = {"parameters": tracker.breakdown()["parameters"],
                      "activations": tracker.breakdown()["activations"] - loss.untyped_storage().nbytes()}
            split = {"parameters": _by_dtype(model.parameters()),
                     "activations": tracker.activations_by_dtype({loss_key})}
            loss.backward()
        totals["gradients"] = tracker.breakdown()["gradients"]
        split["gradients"] = _by_dtype(p.grad for p in model.parameters() if p.grad is not None)
        with memlab.phase("step"):
            opt.step()
        totals["optimizer"] = tracker.breakdown()["optimizer"]
        split["optimizer"] = _by_dtype(v for st in opt.state.values() for v in st.values() if torch.is_tensor(v))
        opt.zero_grad(set_to_none=True)
        del loss
    for k in CATEGORY_KEYS:                         # the split must add up to what the tracker measured
        if sum(split[k].values()) != totals[k]:
            raise RuntimeError(f"internal check error: the dtype split and the tracker disagree on {k} for {case}")
    return totals, split, summary(list(model.parameters()), 7)
