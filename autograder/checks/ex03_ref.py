"""Exercise 03: the drivers both sides use, and the trusted references (never the solution's code).

- `drive_scaler` trains with any scaler the way torch.amp.GradScaler is used and summarises what it
  did as plain data; the judge drives torch.amp.GradScaler("cpu") with it.
- `reference_amp`: an AMP loop written differently from the exercise's (autograd.grad per micro-batch,
  accumulated by hand, the clipping formula of clip_grad_norm_ written out) around a real GradScaler.
- `reference_report`: memlab.MemoryTracker measuring the step, extended to note the dtype of each
  storage when an op creates it; parameters, gradients and optimizer state grouped by their dtype.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

import memlab

from .ex03_cases import CATEGORY_KEYS, DTYPES, amp_setup, build_report_case, plan_inputs

_INJECT = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


def summary(tensors, seed: int) -> list[list[float]]:
    """[norm, projection on a fixed random direction] of each tensor, in float64."""
    out = []
    for i, t in enumerate(tensors):
        d = t.detach().double().flatten()
        v = torch.randn(d.numel(), generator=torch.Generator().manual_seed(seed * 1009 + i), dtype=torch.float64)
        out.append([d.norm().item(), (d @ v).item()])
    return out


def drive_scaler(scaler, plan) -> dict:
    """Train a plan's MLP with fp16 autocast, SGD + momentum and `scaler`; inf/NaN injected into chosen
    gradients, unscale_ (and a clip that never bites) at chosen steps. Plain data of what happened."""
    model, opt, batches = plan_inputs(plan)
    params = list(model.parameters())
    calls = []
    hook = opt.register_step_pre_hook(lambda *args: calls.append(1))
    inject = {s: (v, pi, fi) for s, v, pi, fi in plan["inject"]}
    steps = []
    try:
        for i, (x, y) in enumerate(batches):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x, y)                                 # fp32 loss from an fp16 forward
            used = float(scaler.get_scale())
            scaler.scale(loss).backward()
            if i in inject:
                value, pi, fi = inject[i]
                with torch.no_grad():
                    params[pi].grad.view(-1)[fi % params[pi].numel()] = _INJECT[value]
            explicit = None
            if i in plan["explicit"]:
                scaler.unscale_(opt)
                explicit = summary([p.grad for p in params], i)
                torch.nn.utils.clip_grad_norm_(params, 1e3)        # a clip that never bites: unscale_ must suffice
            n = len(calls)
            scaler.step(opt)
            ran = len(calls) > n
            grads = summary([p.grad for p in params], i)
            scaler.update()
            steps.append({"used": used, "ran": ran, "after": float(scaler.get_scale()), "explicit": explicit,
                          "grads": grads})
            opt.zero_grad(set_to_none=True)
    finally:
        hook.remove()
    return {"steps": steps, "params": summary(params, 99)}


def guard_probe(make) -> dict:
    """Does unscale_ raise RuntimeError when called twice in an iteration, and after step()?"""
    def raises(fn):
        try:
            fn()
        except RuntimeError:
            return True
        except Exception as e:  # noqa: BLE001
            return f"raised {type(e).__name__}, not RuntimeError"
        return "did not raise"

    torch.manual_seed(0)
    model = memlab.MLP(8, 8, 1, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    s = make()
    s.scale(model(x, y)).backward()
    s.unscale_(opt)
    second = raises(lambda: s.unscale_(opt))
    opt.zero_grad(set_to_none=True)
    s = make()
    s.scale(model(x, y)).backward()
    s.step(opt)
    after = raises(lambda: s.unscale_(opt))
    return {"second_unscale": second, "unscale_after_step": after}


def reference_amp(case) -> dict:
    """Losses, scales and the parameter change of `steps` AMP steps, computed without the exercise's loop."""
    model, opt, scaler, batches = amp_setup(case)
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    dtype = DTYPES[case["dtype"]]
    losses, scales, used = [], [], []
    for micro in batches:
        k = len(micro)
        acc = [torch.zeros_like(p) for p in params]
        mean = 0.0
        used.append(float(scaler.get_scale()))
        for x, y in micro:
            with torch.autocast("cpu", dtype=dtype):
                part = model(x, y) / k
            mean += part.item()
            acc = [a + g for a, g in zip(acc, torch.autograd.grad(scaler.scale(part), params))]
        for p, a in zip(params, acc):
            p.grad = a
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
        losses.append(mean)
        scales.append(float(scaler.get_scale()))
    delta = torch.cat([(p.detach() - s).double().flatten() for p, s in zip(params, start)])
    return {"losses": losses, "scales": scales, "used": used, "delta": delta}


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
