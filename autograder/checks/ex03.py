"""Checks for exercise 03, "A loss scaler and an AMP step".

Each `check_task3_M(student, *, hidden)` raises AssertionError with a message
that says what was expected and the likely mistake. Visible checks use fixed
inputs; hidden checks draw new models, scales and overflow patterns every run.

References:
- task3_1: `torch.amp.GradScaler("cpu")` itself (it works on the CPU in the
  PyTorch versions this course supports), driven through the same seeded
  fp16-autocast run as the learner's scaler, with inf/NaN gradients injected.
- task3_2: a reference AMP loop with the documented pattern (PyTorch docs,
  "Automatic Mixed Precision examples": gradient clipping and accumulation).
- task3_3: memlab.MemoryTracker for the bytes of each category; autograd's
  saved-tensor hooks for the split of the activations by dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

import memlab

from .common import expect_int, mb, rng

CATEGORY_KEYS = ("parameters", "gradients", "optimizer", "activations")
_SCALER_METHODS = ("scale", "unscale_", "step", "update", "get_scale")


# ----------------------------------------------------------------------------- task3_1
@dataclass
class ScalerPlan:
    """One seeded run: an MLP trained with fp16 autocast and SGD + momentum."""
    seed: int
    dims: tuple = (32, 64, 2, 10)
    batch: int = 16
    steps: int = 16
    x_scale: float = 1.0
    init_scale: float = 2.0 ** 22
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 3
    inject: dict = field(default_factory=dict)      # step -> (value, param index, flat index)
    explicit: set = field(default_factory=set)      # steps that call unscale_ (and clip) before step

    def kwargs(self):
        return dict(init_scale=self.init_scale, growth_factor=self.growth_factor,
                    backoff_factor=self.backoff_factor, growth_interval=self.growth_interval)

    def __str__(self):
        inj = {i: ("inf" if math.isinf(v) else "nan") for i, (v, _, _) in sorted(self.inject.items())}
        return (f"DynamicLossScaler({', '.join(f'{k}={v:g}' for k, v in self.kwargs().items())}); "
                f"{self.steps} steps, inf/NaN injected at {inj}, explicit unscale_ at {sorted(self.explicit)}")


@dataclass
class StepRecord:
    used: float                  # get_scale() when scale(loss) was called
    ran: bool                    # optimizer.step() really ran
    after: float                 # get_scale() after update()
    explicit: list | None        # grads right after an explicit unscale_ (else None)
    grads: list                  # grads right after step()


def drive_scaler(scaler, plan: ScalerPlan):
    """Train with `scaler` the way torch.amp.GradScaler is used; record what it did."""
    torch.manual_seed(plan.seed)
    model = memlab.MLP(*plan.dims)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    calls = []
    hook = opt.register_step_pre_hook(lambda *args: calls.append(1))
    g = torch.Generator().manual_seed(plan.seed)
    records = []
    try:
        for i in range(plan.steps):
            x = torch.randn(plan.batch, plan.dims[0], generator=g) * plan.x_scale
            y = torch.randint(0, plan.dims[3], (plan.batch,), generator=g)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x, y)                                 # fp32 loss from an fp16 forward
            used = float(scaler.get_scale())
            scaler.scale(loss).backward()
            if i in plan.inject:
                value, pi, fi = plan.inject[i]
                with torch.no_grad():
                    params[pi].grad.view(-1)[fi % params[pi].numel()] = value
            explicit = None
            if i in plan.explicit:
                scaler.unscale_(opt)
                explicit = [p.grad.detach().clone() for p in params]
                torch.nn.utils.clip_grad_norm_(params, 1e3)        # a clip that never bites: unscale_ must suffice
            n = len(calls)
            scaler.step(opt)
            ran = len(calls) > n
            grads = [p.grad.detach().clone() for p in params]
            scaler.update()
            records.append(StepRecord(used, ran, float(scaler.get_scale()), explicit, grads))
            opt.zero_grad(set_to_none=True)
    finally:
        hook.remove()
    return records, [p.detach().clone() for p in params]


def _make_student_scaler(cls, plan):
    try:
        s = cls(**plan.kwargs())
    except TypeError as e:
        raise AssertionError(f"DynamicLossScaler must accept the keyword arguments init_scale, growth_factor, "
                             f"backoff_factor and growth_interval (like torch.amp.GradScaler); it raised: {e}")
    missing = [m for m in _SCALER_METHODS if not callable(getattr(s, m, None))]
    if missing:
        raise AssertionError(f"DynamicLossScaler is missing the method(s) {missing}; it needs "
                             f"{list(_SCALER_METHODS)} with GradScaler's signatures")
    return s


def _finite(ts):
    return all(bool(torch.isfinite(t).all()) for t in ts)


def _same(a, b, rtol=1e-5):
    return all(torch.allclose(x, y, rtol=rtol, atol=1e-7 * max(1.0, y.abs().max().item())) for x, y in zip(a, b))


def _ratio(stu, ref):
    """Median of stu/ref over the larger reference entries (tells 'divided twice' from 'not divided')."""
    s = torch.cat([t.flatten() for t in stu]).double()
    r = torch.cat([t.flatten() for t in ref]).double()
    keep = r.abs() > r.abs().max() * 1e-3
    return (s[keep] / r[keep]).median().item() if keep.any() else float("nan")


def compare_scaler_runs(ref, stu, plan: ScalerPlan):
    """Raise AssertionError at the first step where the learner's scaler behaves differently."""
    (ref_steps, ref_params), (stu_steps, stu_params) = ref, stu
    where = f"[{plan}]"
    for i, (r, s) in enumerate(zip(ref_steps, stu_steps)):
        at = f"step {i}"
        if s.used != r.used:
            if i == 0:
                raise AssertionError(f"{where} before the first update the scale should be init_scale = {r.used:g}, "
                                     f"get_scale() returned {s.used:g}")
            raise AssertionError(f"{where} {at}: the scale used should be {r.used:g} (GradScaler), yours is {s.used:g}")
        if s.ran != r.ran:
            if s.ran:
                raise AssertionError(
                    f"{where} {at}: the gradients contained inf/NaN (scale {r.used:g}), so optimizer.step() must be "
                    f"SKIPPED, but yours ran it. Check every .grad with torch.isfinite after unscaling and do not call "
                    f"optimizer.step() if any value is inf or NaN: one bad step corrupts the weights for good.")
            raise AssertionError(
                f"{where} {at}: the gradients were finite, so optimizer.step() should run, but yours skipped it. "
                f"Reset the found-inf flag at every iteration (GradScaler forgets it in update()), and check the "
                f"gradients of this step only.")
        if r.explicit is not None and _finite(r.explicit) and not _same(s.explicit, r.explicit):
            q = _ratio(s.explicit, r.explicit)
            raise AssertionError(
                f"{where} {at}: after unscale_(optimizer) the gradients should be divided by the scale {r.used:g}; "
                f"yours are {q:.3g} times the expected values. unscale_ multiplies every .grad of the optimizer's "
                f"parameters by 1/scale, in place.")
        if r.ran and not _same(s.grads, r.grads):
            q = _ratio(s.grads, r.grads)
            if r.explicit is not None and abs(q * r.used - 1) < 1e-3:
                raise AssertionError(
                    f"{where} {at}: unscale_() was called before step(), and your step() divided the gradients by "
                    f"the scale a second time (they are 1/{r.used:g} of what they should be). Record that this "
                    f"iteration is already unscaled and let step() unscale only if unscale_() has not run.")
            if abs(q / r.used - 1) < 1e-3:
                raise AssertionError(
                    f"{where} {at}: step() ran the optimizer on SCALED gradients ({r.used:g} times too large). "
                    f"step() must unscale first when unscale_() has not been called this iteration.")
            raise AssertionError(f"{where} {at}: after step() the gradients are {q:.3g} times GradScaler's; they "
                                 f"should be the gradients divided by the scale exactly once.")
        if s.after != r.after:
            grew = r.after > r.used
            if grew and s.after <= s.used:
                hint = (f"it should have grown to {r.after:g}: after growth_interval = {plan.growth_interval} "
                        f"consecutive steps without inf/NaN, multiply the scale by growth_factor "
                        f"({plan.growth_factor:g}) and restart the count.")
            elif not r.ran and s.after >= s.used:
                hint = (f"after a skipped step the scale must back off to {r.after:g} (times backoff_factor "
                        f"{plan.backoff_factor:g}) and the count of clean steps must restart at 0.")
            elif not grew and s.after > s.used:
                hint = ("it grew too early: count only consecutive clean steps, reset the count to 0 after an "
                        "overflow and after each growth, and grow when the count reaches growth_interval.")
            else:
                hint = ("compare your update() with GradScaler's: back off on inf/NaN, grow every "
                        "growth_interval clean steps.")
            raise AssertionError(f"{where} {at}: after update() the scale should be {r.after:g}, yours is "
                                 f"{s.after:g}: {hint}")
    if not _same(stu_params, ref_params, rtol=1e-4):
        raise AssertionError(f"{where} the parameters after {plan.steps} steps differ from a run with "
                             f"torch.amp.GradScaler although the scales and skipped steps match: does scale(loss) "
                             f"return loss * scale, and does step() pass the unscaled gradients to optimizer.step()?")


def _random_plan(r) -> ScalerPlan:
    steps = r.randint(14, 22)
    n_params = 6                                     # MLP(depth=2): three Linear layers, weight and bias each
    inject = {}
    for i in r.sample(range(4, steps), r.randint(2, 4)):
        inject[i] = (r.choice([float("inf"), float("-inf"), float("nan")]), r.randrange(n_params), r.randrange(10**6))
    explicit = set(r.sample(range(steps), r.randint(2, 5)))
    return ScalerPlan(seed=r.randrange(2**31), dims=(r.randint(16, 48), r.randint(32, 96), 2, r.randint(4, 16)),
                      batch=r.randint(8, 32), steps=steps, x_scale=r.choice([0.5, 1.0, 2.0]),
                      init_scale=2.0 ** r.randint(12, 24), growth_factor=r.choice([2.0, 4.0]),
                      backoff_factor=r.choice([0.5, 0.25]), growth_interval=r.randint(2, 5),
                      inject=inject, explicit=explicit)


VISIBLE_PLAN = ScalerPlan(seed=3, inject={7: (float("inf"), 0, 5)}, explicit={10, 12})


def check_task3_1(DynamicLossScaler, *, hidden: bool) -> None:
    """DynamicLossScaler behaves like torch.amp.GradScaler: same scales, same skipped steps, same parameters."""
    r = rng(hidden, 31)
    runs, tries = [], 0                              # (plan, GradScaler's run)
    while len(runs) < (3 if hidden else 1):
        plan = _random_plan(r) if hidden else VISIBLE_PLAN
        ref = drive_scaler(torch.amp.GradScaler("cpu", **plan.kwargs()), plan)
        runs.append((plan, ref))
        grew = any(s.after > s.used for _, (steps, _) in runs for s in steps)
        if hidden and len(runs) == 3 and not grew and tries < 10:   # make sure growth is exercised
            runs.pop(0)
        tries += 1
    for plan, ref in runs:
        stu = drive_scaler(_make_student_scaler(DynamicLossScaler, plan), plan)
        compare_scaler_runs(ref, stu, plan)
    plans = [plan for plan, _ in runs]
    if hidden:                                       # GradScaler refuses a second unscale_ in one iteration
        s = _make_student_scaler(DynamicLossScaler, plans[0])
        model = memlab.MLP(8, 8, 1, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        s.scale(model(torch.randn(4, 8), torch.randint(0, 2, (4,)))).backward()
        s.unscale_(opt)
        try:
            s.unscale_(opt)
        except RuntimeError:
            pass
        else:
            raise AssertionError("calling unscale_(optimizer) twice before update() must raise RuntimeError (as "
                                 "GradScaler does): a second call would divide the gradients by the scale again")


# ----------------------------------------------------------------------------- task3_2
def reference_amp_step(model, optimizer, scaler, micro_batches, *, dtype=torch.float16, max_norm=None) -> float:
    """The documented AMP pattern: scaled backward per micro-batch, unscale_ before clipping, one step/update."""
    k = len(micro_batches)
    total = 0.0
    for x, y in micro_batches:
        with torch.autocast(x.device.type, dtype=dtype):
            loss = model(x, y) / k
        scaler.scale(loss).backward()
        total += loss.item()
    if max_norm is not None:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total


@dataclass
class AmpCase:
    seed: int
    kind: str = "mlp"            # "mlp" or "gpt"
    dtype: torch.dtype = torch.float16
    micro: int = 2
    batch: int = 8
    steps: int = 4
    max_norm: float | None = None
    init_scale: float = 2.0 ** 16
    optimizer: str = "sgd"

    def __str__(self):
        return (f"{self.kind.upper()}, {str(self.dtype).replace('torch.', '')}, {self.micro} micro-batch(es) of "
                f"{self.batch}, max_norm={self.max_norm}, {self.optimizer}, init_scale={self.init_scale:g}")


def _amp_setup(case: AmpCase):
    torch.manual_seed(case.seed)
    g = torch.Generator().manual_seed(case.seed)
    if case.kind == "gpt":
        cfg = memlab.GPTConfig.tiny(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16)
        model = memlab.GPT(cfg)
        batches = [[(torch.randint(0, 64, (case.batch, 16), generator=g),
                     torch.randint(0, 64, (case.batch, 16), generator=g))
                    for _ in range(case.micro)] for _ in range(case.steps)]
    else:
        model = memlab.MLP(24, 48, 2, 6)
        batches = [[(torch.randn(case.batch, 24, generator=g), torch.randint(0, 6, (case.batch,), generator=g))
                    for _ in range(case.micro)] for _ in range(case.steps)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if case.optimizer == "sgd" else \
        torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=case.init_scale, growth_interval=2,
                                  enabled=case.dtype == torch.float16)
    return model, opt, scaler, batches


def _run_amp(fn, case: AmpCase, who: str):
    model, opt, scaler, batches = _amp_setup(case)
    start = [p.detach().clone() for p in model.parameters()]
    losses, scales = [], []
    for step, micro in enumerate(batches):
        try:
            out = fn(model, opt, scaler, micro, dtype=case.dtype, max_norm=case.max_norm)
        except Exception as e:  # noqa: BLE001 - turn the learner's crash into a teaching message
            if who == "reference":
                raise
            hint = ""
            if "FP16 gradients" in str(e):
                hint = (" GradScaler refuses fp16 gradients: did you cast the model (its parameters) to fp16? "
                        "Keep the parameters fp32 and let torch.autocast cast copies for the matmuls.")
            raise AssertionError(f"[{case}] amp_step raised {type(e).__name__}: {e}.{hint}") from e
        if who != "reference":
            dtypes = {p.dtype for p in model.parameters()}
            assert dtypes == {torch.float32}, (
                f"[{case}] after amp_step the parameters are {sorted(map(str, dtypes))}: mixed precision keeps the "
                f"parameters (and so the optimizer's updates) in fp32. Do not call model.half()/model.to(dtype): "
                f"run the forward under torch.autocast(x.device.type, dtype=dtype) instead.")
            left = [n for n, p in model.named_parameters() if p.grad is not None]
            assert not left, (f"[{case}] after amp_step the gradients of {left[:3]}... are still allocated: end the "
                              f"step with optimizer.zero_grad(set_to_none=True) so the next step starts from none "
                              f"(and 4 bytes/param are not held between steps).")
        if isinstance(out, torch.Tensor):
            raise AssertionError(f"[{case}] amp_step must return the loss as a Python float (loss.item()), not a "
                                 f"tensor: holding the tensor keeps the whole graph alive")
        if not isinstance(out, (int, float)):
            raise AssertionError(f"[{case}] amp_step must return a float (the mean loss), got {type(out).__name__}")
        losses.append(float(out))
        scales.append(scaler.get_scale())
    delta = [p.detach() - s for p, s in zip(model.parameters(), start)]
    return losses, scales, delta


def check_amp_step(amp_step, case: AmpCase):
    ref_losses, ref_scales, ref_delta = _run_amp(reference_amp_step, case, "reference")
    losses, scales, delta = _run_amp(amp_step, case, "learner")
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        if not math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-5):
            hint = ""
            if math.isclose(a, b * case.micro, rel_tol=1e-3):
                hint = (f" Yours is {case.micro} times too large: divide each micro-batch's loss by the number of "
                        f"micro-batches ({case.micro}) so that the accumulated gradient is the mean, and return "
                        f"that mean.")
            elif b and math.isclose(a / b, scales[i] if i < len(scales) else 0, rel_tol=1e-2):
                hint = " You returned the SCALED loss: return the loss before scaler.scale()."
            raise AssertionError(f"[{case}] step {i}: amp_step should return the mean loss over the micro-batches, "
                                 f"{b:.6f}; yours returned {a:.6f}.{hint}")
    if scales != ref_scales:
        raise AssertionError(f"[{case}] the scaler's scale after each of your steps was {scales}, but should be "
                             f"{ref_scales}: call scaler.step(optimizer) and scaler.update() exactly once per "
                             f"amp_step, after all micro-batches (never per micro-batch).")
    num = math.sqrt(sum(((d - rd) ** 2).sum().item() for d, rd in zip(delta, ref_delta)))
    den = math.sqrt(sum((rd ** 2).sum().item() for rd in ref_delta))
    if den == 0:
        raise RuntimeError(f"internal check error: the reference skipped every step of [{case}]")
    err = num / max(den, 1e-12)
    if err > 1e-2:
        ratio = math.sqrt(sum((d ** 2).sum().item() for d in delta)) / max(den, 1e-12)
        if case.max_norm is not None and ratio < 0.05:
            hint = (" Your updates are far too small: did you clip BEFORE unscaling? The gradients are multiplied "
                    "by the scale until scaler.unscale_(optimizer) divides them, so clipping them then clips to "
                    "max_norm / scale. Call scaler.unscale_(optimizer) first, then clip_grad_norm_, then scaler.step.")
        elif case.max_norm is None and abs(ratio - case.micro) < 0.2 * case.micro:
            hint = (f" Your updates are {case.micro}x too large: the accumulated gradient must be the mean over the "
                    f"micro-batches (divide each loss by {case.micro}).")
        elif case.max_norm is not None:
            hint = (" With max_norm set: scaler.unscale_(optimizer), then "
                    "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), then scaler.step(optimizer).")
        else:
            hint = (" Check the order: for each micro-batch autocast forward, loss / k, scaler.scale(loss).backward(); "
                    "then once: (unscale_ and clip), scaler.step, scaler.update, zero_grad(set_to_none=True).")
        raise AssertionError(f"[{case}] after {case.steps} steps your parameter updates differ from the reference "
                             f"AMP loop by {err:.1%} (relative).{hint}")


def check_task3_2(amp_step, *, hidden: bool) -> None:
    """amp_step(model, optimizer, scaler, micro_batches, *, dtype, max_norm) matches a reference AMP loop."""
    r = rng(hidden, 32)
    if not hidden:
        cases = [AmpCase(seed=1, micro=2, max_norm=None), AmpCase(seed=2, micro=2, max_norm=0.05)]
    else:
        cases = [
            AmpCase(seed=r.randrange(2**31), micro=r.randint(2, 4), batch=r.randint(4, 16), max_norm=None,
                    init_scale=2.0 ** r.randint(8, 16)),
            AmpCase(seed=r.randrange(2**31), micro=r.randint(1, 3), batch=r.randint(4, 16),
                    max_norm=r.choice([0.02, 0.05, 0.1]), init_scale=2.0 ** r.randint(17, 22), steps=6),
            AmpCase(seed=r.randrange(2**31), kind="gpt", dtype=torch.bfloat16, micro=r.randint(2, 3),
                    batch=r.randint(2, 4), max_norm=r.choice([None, 0.5]), steps=3),   # bf16: fp16 is slow on CPUs
            AmpCase(seed=r.randrange(2**31), dtype=torch.bfloat16, micro=r.randint(2, 3), batch=r.randint(4, 16),
                    max_norm=r.choice([None, 0.05])),
        ]
    for case in cases:
        check_amp_step(amp_step, case)


# ----------------------------------------------------------------------------- task3_3
def reference_dtype_report(model, optimizer, x, y, *, dtype=None) -> dict:
    """{category: {dtype: bytes}} with autograd's saved-tensor hooks (the activations' dtypes)."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    skip = params | {x.untyped_storage()._cdata, y.untyped_storage()._cdata}
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in skip:
            saved[st._cdata] = (t.dtype, st.nbytes())
        return t

    def add(d, t):
        d[t.dtype] = d.get(t.dtype, 0) + t.untyped_storage().nbytes()

    out = {k: {} for k in CATEGORY_KEYS}
    for p in model.parameters():
        add(out["parameters"], p)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast(x.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = model(x, y)
    for dt, n in saved.values():
        out["activations"][dt] = out["activations"].get(dt, 0) + n
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            add(out["gradients"], p.grad)
    optimizer.step()
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v):
                add(out["optimizer"], v)
    optimizer.zero_grad(set_to_none=True)
    return out


def tracker_totals(model, optimizer, x, y, *, dtype=None) -> dict:
    """The bytes of each category of one step, measured by memlab.MemoryTracker."""
    tracker = memlab.MemoryTracker(model, optimizer)
    # register the batch up front: it existed before the step, so a view of it taken in the forward
    # (GPT's targets.view(-1)) must not count as an activation made by the forward
    tracker.watch(tensors=[x, y], category="temporaries")
    with tracker:
        with memlab.phase("forward"):
            with torch.autocast(x.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = model(x, y)
        # forward survivors = what autograd saved + the loss itself (not saved by anyone)
        acts = tracker.breakdown()["activations"] - loss.untyped_storage().nbytes()
        params = tracker.breakdown()["parameters"]
        with memlab.phase("backward"):
            loss.backward()
        grads = tracker.breakdown()["gradients"]
        with memlab.phase("step"):
            optimizer.step()
        state = tracker.breakdown()["optimizer"]
        optimizer.zero_grad(set_to_none=True)
        del loss
    return {"parameters": params, "gradients": grads, "optimizer": state, "activations": acts}


@dataclass
class ReportCase:
    seed: int
    kind: str = "mlp"
    dims: tuple = (64, 128, 2, 10)
    batch: int = 32
    dtype: torch.dtype | None = torch.float16
    model_dtype: torch.dtype = torch.float32
    optimizer: str = "adam"

    def __str__(self):
        what = f"MLP{self.dims}" if self.kind == "mlp" else "tiny GPT"
        ac = f"autocast {str(self.dtype).replace('torch.', '')}" if self.dtype else "no autocast"
        return f"{what} in {str(self.model_dtype).replace('torch.', '')}, {ac}, batch {self.batch}, {self.optimizer}"

    def build(self):
        torch.manual_seed(self.seed)
        g = torch.Generator().manual_seed(self.seed)
        if self.kind == "gpt":
            cfg = memlab.GPTConfig.tiny(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16)
            model = memlab.GPT(cfg)
            x = torch.randint(0, 64, (self.batch, 16), generator=g)
            y = torch.randint(0, 64, (self.batch, 16), generator=g)
        else:
            model = memlab.MLP(*self.dims)
            x = torch.randn(self.batch, self.dims[0], generator=g).to(self.model_dtype)
            y = torch.randint(0, self.dims[3], (self.batch,), generator=g)
        model = model.to(self.model_dtype)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3) if self.optimizer == "adam" else \
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, opt, x, y


_REPORT_HINTS = {
    "parameters": "every parameter once (model.parameters()), storage bytes, by its dtype.",
    "gradients": "read every .grad after loss.backward(), before optimizer.step()/zero_grad. Under autocast the "
                 "gradients have the dtype of the parameters (fp32), not the 16-bit compute type.",
    "optimizer": "every tensor in optimizer.state, read AFTER optimizer.step() (the state is created lazily inside "
                 "the first step). Adam's `step` counter is a 4-byte fp32 tensor per parameter.",
    "activations": "what autograd saves for backward during the forward (torch.autograd.graph.saved_tensors_hooks): "
                   "count each STORAGE once (t.untyped_storage().nbytes(); a tensor saved twice or a view such as "
                   "q/k/v of one qkv output shares a storage), excluding parameters (a Linear saves its weight in "
                   "fp32 runs) and the batch x, y. Under autocast the 16-bit copies of x and of the weights are new "
                   "storages: they count.",
}


def _fmt(d):
    items = sorted(d.items(), key=lambda kv: str(kv[0]))
    return "{" + ", ".join(f"{str(k).replace('torch.', '')}: {v}" for k, v in items) + "}"


def check_report(dtype_report, case: ReportCase):
    m, o, x, y = case.build()
    want_total = tracker_totals(m, o, x, y, dtype=case.dtype)
    m, o, x, y = case.build()
    want = reference_dtype_report(m, o, x, y, dtype=case.dtype)
    for k in CATEGORY_KEYS:                                 # the split by dtype must add up to the tracker
        if sum(want[k].values()) != want_total[k]:
            raise RuntimeError(f"internal check error: hooks and tracker disagree on {k} for {case}")
    m_ref = [p.detach().clone() for p in m.parameters()]
    m, o, x, y = case.build()
    got = dtype_report(m, o, x, y, dtype=case.dtype)
    if not isinstance(got, dict) or set(got) != set(CATEGORY_KEYS):
        raise AssertionError(f"dtype_report must return a dict with exactly the keys {CATEGORY_KEYS}, got "
                             f"{got if not isinstance(got, dict) else sorted(got)}")
    for k in CATEGORY_KEYS:
        row = got[k]
        if not isinstance(row, dict) or not all(isinstance(d, torch.dtype) for d in row):
            raise AssertionError(f"dtype_report(...)['{k}'] must be a dict {{torch.dtype: bytes}}, got {row!r}")
        row = {d: expect_int(f"dtype_report(...)['{k}'][{d}]", n) for d, n in row.items() if n}
        total = sum(row.values())
        if total != want_total[k]:
            raise AssertionError(f"[{case}] {k}: memlab's tracker measures {want_total[k]} bytes "
                                 f"({mb(want_total[k])}), your report sums to {total} ({mb(total)}), by dtype "
                                 f"{_fmt(row)} (expected {_fmt(want[k])}). Count {_REPORT_HINTS[k]}")
        if row != want[k]:
            raise AssertionError(f"[{case}] {k}: the total is right but the split by dtype is not: expected "
                                 f"{_fmt(want[k])}, got {_fmt(row)}. Use each tensor's own .dtype. {_REPORT_HINTS[k]}")
    for a, b in zip(m.parameters(), m_ref):
        if not torch.allclose(a.detach().float(), b.float(), rtol=1e-3, atol=1e-5):
            raise AssertionError(f"[{case}] after dtype_report the parameters differ from one plain training step: "
                                 f"run exactly one forward, backward, optimizer.step() and zero_grad.")


def check_task3_3(dtype_report, *, hidden: bool) -> None:
    """dtype_report(model, optimizer, x, y, *, dtype) -> {category: {torch.dtype: bytes}} matching the tracker."""
    r = rng(hidden, 33)
    if not hidden:
        cases = [ReportCase(seed=0, dtype=None), ReportCase(seed=0, dtype=torch.float16)]
    else:
        def dims():
            return (r.randint(8, 96), r.randint(16, 128), r.randint(1, 3), r.randint(2, 16))
        cases = [
            ReportCase(seed=r.randrange(2**31), dims=dims(), batch=r.randint(4, 64),
                       dtype=r.choice([torch.float16, torch.bfloat16]), optimizer=r.choice(["adam", "sgd"])),
            ReportCase(seed=r.randrange(2**31), dims=dims(), batch=r.randint(4, 64), dtype=None,
                       model_dtype=torch.bfloat16, optimizer="adam"),
            ReportCase(seed=r.randrange(2**31), kind="gpt", batch=r.randint(1, 4),
                       dtype=r.choice([None, torch.bfloat16, torch.float16]), optimizer=r.choice(["adam", "sgd"])),
        ]
    for case in cases:
        check_report(dtype_report, case)
