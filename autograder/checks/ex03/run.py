"""Exercise 03: what runs in the learner's process. `run` builds each case's inputs, drives the learner's
DynamicLossScaler, amp_step or dtype_report on them and returns plain data; it decides nothing."""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

import memlab
from memlab.kit.ex03 import drive_scaler, summary

from .inputs import DTYPES, amp_setup, build_report_case


# ----------------------------------------------------------------------------- task3_1
_SCALER_METHODS = ("scale", "unscale_", "step", "update", "get_scale")


def _make_scaler(cls, plan):
    kwargs = {k: plan[k] for k in ("init_scale", "growth_factor", "backoff_factor", "growth_interval")}
    try:
        s = cls(**kwargs)
    except TypeError as e:
        raise AssertionError(f"DynamicLossScaler must accept the keyword arguments init_scale, growth_factor, "
                             f"backoff_factor and growth_interval (like torch.amp.GradScaler); it raised: {e}")
    missing = [m for m in _SCALER_METHODS if not callable(getattr(s, m, None))]
    if missing:
        raise AssertionError(f"DynamicLossScaler is missing the method(s) {missing}; it needs "
                             f"{list(_SCALER_METHODS)} with GradScaler's signatures")
    return s


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
    grads = [p.grad for p in model.parameters()]
    scaled = [g.clone() for g in grads]
    s.unscale_(opt)
    # in place: the same .grad tensors now hold the scaled values divided by the scale
    in_place = all(p.grad is g for p, g in zip(model.parameters(), grads)) and all(
        torch.allclose(g, b / s.get_scale(), rtol=1e-6, atol=0) for g, b in zip(grads, scaled))
    second = raises(lambda: s.unscale_(opt))
    opt.zero_grad(set_to_none=True)
    s = make()
    s.scale(model(x, y)).backward()
    s.step(opt)
    after = raises(lambda: s.unscale_(opt))
    return {"second_unscale": second, "unscale_after_step": after, "unscale_in_place": in_place,
            **step_returns(make)}


def _returned(v):
    """What step() returned, as plain data: None, a number, or the name of another type."""
    if v is None or isinstance(v, bool):
        return v
    if isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.numel() == 1):
        return float(v)
    return f"<{type(v).__name__}>"


def step_returns(make) -> dict:
    """step(optimizer, closure) on a clean iteration and on one whose gradients hold inf: what it returned and
    how often the closure ran (GradScaler passes step's extra arguments to optimizer.step and returns its result;
    a skipped step never calls optimizer.step)."""
    torch.manual_seed(1)
    model = memlab.MLP(8, 8, 1, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8), torch.randint(0, 2, (4,))
    out = {}
    for label in ("clean", "skipped"):
        calls = []

        def closure():
            calls.append(1)
            return torch.tensor(37.25)         # what SGD.step(closure) returns: the closure's loss
        s = make()
        s.scale(model(x, y)).backward()
        if label == "skipped":
            with torch.no_grad():
                next(model.parameters()).grad[0, 0] = float("inf")
        out[f"{label}_returns"] = _returned(s.step(opt, closure))
        out[f"{label}_closure_calls"] = len(calls)
        s.update()
        opt.zero_grad(set_to_none=True)
    return out


def scaler_run(case, DynamicLossScaler):
    if case["kind"] == "guard":
        return guard_probe(lambda: _make_scaler(DynamicLossScaler, case))
    return drive_scaler(_make_scaler(DynamicLossScaler, case), case)


# ----------------------------------------------------------------------------- task3_2
def _forward_probe(model):
    """Forward hooks on every nn.Linear noting the dtype its output really has and, for each device type, whether
    autocast was on while it ran: the dtype and device_type the learner's autocast used."""
    seen = set()

    def hook(mod, args, out):
        if isinstance(out, torch.Tensor):
            seen.add((str(out.dtype).replace("torch.", ""),
                      tuple(d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))))
    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return seen, handles


def _cpu(a):
    """A device argument that names CUDA, as the CPU; anything else as it is."""
    if isinstance(a, torch.device) and a.type == "cuda":
        return torch.device("cpu")
    if isinstance(a, str) and (a == "cuda" or a.startswith("cuda:")):
        return "cpu"
    return a


class _CudaOnCpu(TorchFunctionMode):
    """Tensors made or moved to CUDA (device=x.device, .to(x.device), .cuda()) land on the CPU, where the
    arithmetic of the step as if on CUDA runs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*[_cpu(a) for a in args], **{k: _cpu(v) for k, v in (kwargs or {}).items()})


@contextlib.contextmanager
def _autocast_as_on_cuda(entered: list):
    """torch.autocast (torch.amp.autocast, torch.cuda.amp.autocast: one class) as it behaves when the tensors are on
    CUDA: autocast("cuda", dtype) casts them (here CPU autocast with CUDA's default dtype, fp16, when none is
    given), autocast("cpu", ...) leaves them alone. `entered` gets each device type asked for."""
    cls = torch.amp.autocast_mode.autocast
    original = cls.__init__

    def init(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        entered.append(str(device_type))
        if device_type == "cuda":
            device_type, dtype = "cpu", torch.float16 if dtype is None else dtype
        elif device_type == "cpu":
            enabled = False
        original(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    cls.__init__ = init
    try:
        yield
    finally:
        cls.__init__ = original


def amp_on_cuda(case, amp_step) -> dict:
    """One amp_step with the model and the micro-batches reporting the device cuda (the arithmetic on the CPU):
    the autocast device types the step asked for and the dtypes its Linear layers produced. Small micro-batches:
    only the devices and dtypes are read."""
    model, opt, scaler, batches = amp_setup(dict(case, steps=1, batch=min(case["batch"], 16)), on_cuda=True)
    entered: list[str] = []
    seen, handles = _forward_probe(model)
    try:
        with _autocast_as_on_cuda(entered), _CudaOnCpu():
            amp_step(model, opt, scaler, batches[0], dtype=DTYPES[case["dtype"]], max_norm=case["max_norm"])
    except Exception as e:  # noqa: BLE001 - the judge turns the learner's crash into a teaching message
        return {"raised": f"{type(e).__name__}: {str(e)[:400]}", "autocast": sorted(set(entered))}
    finally:
        for h in handles:
            h.remove()
    return {"autocast": sorted(set(entered)), "forward": sorted({d for d, _ in seen})}


def amp_run(case, amp_step):
    model, opt, scaler, batches = amp_setup(case)
    start = [p.detach().clone() for p in model.parameters()]
    losses, scales, dtypes, left, growth = [], [], set(), [], []
    seen, handles = _forward_probe(model)
    try:
        for micro in batches:
            tracker = memlab.MemoryTracker(model, opt)
            try:
                with tracker:
                    before = tracker.current
                    out = amp_step(model, opt, scaler, micro, dtype=DTYPES[case["dtype"]], max_norm=case["max_norm"])
                    growth.append(int(tracker.peak - before))
            except Exception as e:  # noqa: BLE001 - the judge turns the learner's crash into a teaching message
                return {"raised": f"{type(e).__name__}: {str(e)[:400]}"}
            losses.append(float(out) if type(out) in (float, int) else f"a {type(out).__name__}")
            scales.append(float(scaler.get_scale()))
            dtypes |= {str(p.dtype).replace("torch.", "") for p in model.parameters()}
            left += [n for n, p in model.named_parameters() if p.grad is not None and n not in left]
    finally:
        for h in handles:
            h.remove()
    delta = torch.cat([(p.detach() - s).double().flatten() for p, s in zip(model.parameters(), start)])
    return {"losses": losses, "scales": scales, "param_dtypes": sorted(dtypes), "grads_left": left,
            "delta": delta.tolist(), "peak_growth": growth,
            "forward": sorted([d, list(on)] for d, on in seen), "on_cuda": amp_on_cuda(case, amp_step)}


# ----------------------------------------------------------------------------- task3_3
def report_run(case, dtype_report):
    model, opt, x, y = build_report_case(case)
    got = dtype_report(model, opt, x, y, dtype=DTYPES[case["dtype"]])
    if type(got) is not dict:
        return {"shape": f"a {type(got).__name__}"}
    report = {}
    for k, row in got.items():
        key = k if type(k) is str else f"!{k!r}"
        if type(row) is not dict:
            report[key] = f"a {type(row).__name__}"
            continue
        report[key] = {(str(d).replace("torch.", "") if isinstance(d, torch.dtype) else f"!{d!r}"):
                       (n if type(n) is int else f"a {type(n).__name__}: {str(n)[:40]}") for d, n in row.items()}
    return {"report": report, "params": summary(list(model.parameters()), 7)}

