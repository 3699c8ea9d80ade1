"""Exercise 03's judges: each compares what `run` returned with a reference computed here (refs.py, or
torch.amp.GradScaler driven by memlab.kit.ex03.drive_scaler) and raises AssertionError with a teaching message."""

from __future__ import annotations

import math

import torch

from memlab.kit.ex03 import drive_scaler

from ..common import expect_type, expected, mb
from .cases import CATEGORY_KEYS, NOISE_BYTES, input_bytes
from .refs import reference_amp, reference_report
from .run import step_returns


# ----------------------------------------------------------------------------- task3_1
def _plan_str(p):
    inj = {s: v for s, v, _, _ in p["inject"]}
    return (f"DynamicLossScaler(init_scale={p['init_scale']:g}, growth_factor={p['growth_factor']:g}, "
            f"backoff_factor={p['backoff_factor']:g}, growth_interval={p['growth_interval']}); {p['steps']} steps, "
            f"inf/NaN injected at {inj}, explicit unscale_ at {p['explicit']}")


def _finite(summ):
    return summ is not None and all(math.isfinite(v) for row in summ for v in row)


def _same(a, b, rtol=1e-5):
    """Summaries ([norm, projection] per tensor) equal within rtol of each tensor's norm."""
    if a is None or len(a) != len(b):
        return False
    for (na, pa), (nb, pb) in zip(a, b):
        tol = rtol * nb + 1e-12
        if not (abs(na - nb) <= tol and abs(pa - pb) <= tol * 4):
            return False
    return True


def _ratio(stu, ref):
    ns = math.sqrt(sum(n * n for n, _ in stu)) if stu else float("nan")
    nr = math.sqrt(sum(n * n for n, _ in ref))
    return ns / nr if nr else float("nan")


def _guard_judge(got):
    expect_type("the guard probe", got, dict)
    assert got.get("unscale_in_place") is True, (
        "unscale_(optimizer) must divide every .grad by the scale IN PLACE (p.grad.mul_(1 / S)), as GradScaler "
        "does: after it the same gradient tensors hold the true values (code holding a gradient, a hook or a "
        "gradient bucket, sees them), not new tensors assigned to p.grad")
    assert got.get("second_unscale") is True, (
        "calling unscale_(optimizer) twice before update() must raise RuntimeError (as GradScaler does): a second "
        f"call would divide the gradients by the scale again (yours: {got.get('second_unscale')})")
    assert got.get("unscale_after_step") is True, (
        "calling unscale_(optimizer) after step() in the same iteration must raise RuntimeError (as GradScaler "
        f"does): step() has already unscaled, or skipped, this iteration (yours: {got.get('unscale_after_step')})")


def _step_judge(case, got):
    """step(optimizer, closure) against torch.amp.GradScaler's own step on the same iteration."""
    ref = step_returns(lambda: torch.amp.GradScaler("cpu", **{k: case[k] for k in (
        "init_scale", "growth_factor", "backoff_factor", "growth_interval")}))
    for label, when in (("clean", "on a clean iteration"), ("skipped", "when a gradient holds inf")):
        calls, want_calls = got.get(f"{label}_closure_calls"), ref[f"{label}_closure_calls"]
        assert calls == want_calls, (
            f"step(optimizer, closure) {when} ran the closure {calls} time(s), GradScaler runs it {want_calls}: "
            + ("pass step's extra arguments on, optimizer.step(*args, **kwargs)" if label == "clean" else
               "a skipped step must not call optimizer.step at all"))
        ret, want = got.get(f"{label}_returns"), ref[f"{label}_returns"]
        assert ret == want, (
            f"step(optimizer, closure) {when} returned {ret!r}; GradScaler returns "
            + ("what optimizer.step returned (here the closure's loss, 37.25)" if label == "clean" else "None"))


def scaler_judge(case, got):
    if case["kind"] == "guard":
        _guard_judge(got)
        return _step_judge(case, got)
    ref = drive_scaler(torch.amp.GradScaler("cpu", **{k: case[k] for k in (
        "init_scale", "growth_factor", "backoff_factor", "growth_interval")}), case)
    expect_type("the scaler run", got, dict)
    where = f"[{_plan_str(case)}]"
    steps = got.get("steps")
    assert isinstance(steps, list) and len(steps) == len(ref["steps"]), f"{where} the run did not finish its steps"
    for i, (r, s) in enumerate(zip(ref["steps"], steps)):
        at = f"step {i}"
        if s["used"] != r["used"]:
            if i == 0:
                raise AssertionError(f"{where} before the first update the scale should be init_scale = "
                                     f"{r['used']:g}, get_scale() returned {s['used']}")
            raise AssertionError(f"{where} {at}: the scale used should be {r['used']:g} (GradScaler), yours is "
                                 f"{s['used']}")
        if s["ran"] != r["ran"]:
            if s["ran"]:
                raise AssertionError(
                    f"{where} {at}: the gradients contained inf/NaN (scale {r['used']:g}), so optimizer.step() must "
                    f"be SKIPPED, but yours ran it. Check every .grad with torch.isfinite after unscaling (inf, -inf "
                    f"and NaN, in every parameter) and do not call optimizer.step() if any value is inf or NaN: one "
                    f"bad step corrupts the weights for good.")
            raise AssertionError(
                f"{where} {at}: the gradients were finite, so optimizer.step() should run, but yours skipped it. "
                f"Reset the found-inf flag at every iteration (GradScaler forgets it in update()), and check the "
                f"gradients of this step only.")
        if r["explicit"] is not None and _finite(r["explicit"]) and not _same(s["explicit"], r["explicit"]):
            q = _ratio(s["explicit"], r["explicit"])
            raise AssertionError(
                f"{where} {at}: after unscale_(optimizer) the gradients should be divided by the scale "
                f"{r['used']:g}; yours are {q:.3g} times the expected values. unscale_ multiplies every .grad of the "
                f"optimizer's parameters by 1/scale, in place.")
        if r["ran"] and not _same(s["grads"], r["grads"]):
            q = _ratio(s["grads"], r["grads"])
            if r["explicit"] is not None and abs(q * r["used"] - 1) < 1e-3:
                raise AssertionError(
                    f"{where} {at}: unscale_() was called before step(), and your step() divided the gradients by "
                    f"the scale a second time (they are 1/{r['used']:g} of what they should be). Record that this "
                    f"iteration is already unscaled and let step() unscale only if unscale_() has not run.")
            if abs(q / r["used"] - 1) < 1e-3:
                raise AssertionError(
                    f"{where} {at}: step() ran the optimizer on SCALED gradients ({r['used']:g} times too large). "
                    f"step() must unscale first when unscale_() has not been called this iteration.")
            raise AssertionError(f"{where} {at}: after step() the gradients are {q:.3g} times GradScaler's; they "
                                 f"should be the gradients divided by the scale exactly once.")
        if s["after"] != r["after"]:
            grew = r["after"] > r["used"]
            if grew and s["after"] <= s["used"]:
                hint = (f"it should have grown to {r['after']:g}: after growth_interval = {case['growth_interval']} "
                        f"consecutive steps without inf/NaN, multiply the scale by growth_factor "
                        f"({case['growth_factor']:g}) and restart the count.")
            elif not r["ran"]:
                hint = (f"after a skipped step the scale must back off to {r['after']:g} (times backoff_factor "
                        f"{case['backoff_factor']:g}) and the count of clean steps must restart at 0.")
            elif not grew and s["after"] > s["used"]:
                hint = ("it grew too early: count only consecutive clean steps, reset the count to 0 after an "
                        "overflow and after each growth, and grow when the count reaches growth_interval.")
            else:
                hint = ("compare your update() with GradScaler's: back off by backoff_factor on inf/NaN, grow by "
                        "growth_factor every growth_interval clean steps.")
            raise AssertionError(f"{where} {at}: after update() the scale should be {r['after']:g}, yours is "
                                 f"{s['after']}: {hint}")
    if not _same(got.get("params"), ref["params"], rtol=1e-4):
        raise AssertionError(f"{where} the parameters after {case['steps']} steps differ from a run with "
                             f"torch.amp.GradScaler although the scales and skipped steps match: does scale(loss) "
                             f"return loss * scale, and does step() pass the unscaled gradients to optimizer.step()?")


# ----------------------------------------------------------------------------- task3_2
def _case_str(c):
    return (f"{c['kind'].upper()}, {c['dtype']}, {c['micro']} micro-batch(es) of {c['batch']}, "
            f"max_norm={c['max_norm']}, init_scale={c['init_scale']:g}")


def amp_judge(case, got):
    where = f"[{_case_str(case)}]"
    expect_type("amp_step's run", got, dict)
    if "raised" in got:
        hint = ""
        if "FP16 gradients" in got["raised"]:
            hint = (" GradScaler refuses fp16 gradients: did you cast the model (its parameters) to fp16? "
                    "Keep the parameters fp32 and let torch.autocast cast copies for the matmuls.")
        raise AssertionError(f"{where} amp_step raised {got['raised']}.{hint}")
    assert got["param_dtypes"] == ["float32"], (
        f"{where} after amp_step the parameters are {got['param_dtypes']}: mixed precision keeps the parameters (and "
        f"so the optimizer's updates) in fp32. Do not call model.half()/model.to(dtype): run the forward under "
        f"torch.autocast(x.device.type, dtype=dtype) instead.")
    assert not got["grads_left"], (
        f"{where} after amp_step the gradients of {got['grads_left'][:3]}... are still allocated: end the step with "
        f"optimizer.zero_grad(set_to_none=True) so the next step starts from none (and 4 bytes/param are not held "
        f"between steps).")
    bad = [v for v in got["losses"] if type(v) is not float]
    assert not bad, (f"{where} amp_step must return the mean loss as a Python float (loss.item()), got {bad[0]}: "
                     f"holding a tensor keeps the whole graph alive")
    want = case["dtype"]
    fwd = got.get("forward") or []
    ran = sorted({d for d, _ in fwd})
    if ran != [want]:
        off = [d for d in ran if d != want]
        on = sorted({dev for _, devs in fwd for dev in devs})
        if off and "cpu" not in on:
            also = f"; it was on for {on}" if on else ""
            hint = (f" Autocast was not active for the device the inputs are on (cpu){also}: do not hard-code "
                    f"device_type='cuda', write torch.autocast(x.device.type, dtype=dtype), so the same step runs on "
                    f"any device.")
        else:
            hint = (" Run the forward under torch.autocast(x.device.type, dtype=dtype) with the dtype amp_step is "
                    "given, not a fixed one: bf16 and fp16 round differently (bf16 has fp32's range, fp16 needs the "
                    "scaler).")
        raise AssertionError(f"{where} your forward's Linear layers produced {off or ran} outputs, but amp_step was "
                             f"called with dtype={want}.{hint}")
    _judge_on_cuda(case, where, got.get("on_cuda"))
    ref = reference_amp(case)
    if case.get("memory"):
        bound = max(ref["growth"]) + ref["graph"] // 2
        worst = max(got["peak_growth"])
        if worst > bound:
            raise AssertionError(
                f"{where} during your step memory grew by {mb(worst)} at its peak (memlab's tracker), more than one "
                f"micro-batch's graph ({mb(ref['graph'])}) above what a step that frees each graph needs: the graphs "
                f"of several micro-batches were alive together. Call scaler.scale(loss / k).backward() inside the "
                f"loop, for each micro-batch, and keep only loss.item(), never the loss tensors, so that each "
                f"micro-batch's activations are freed before the next forward.")
    for i, (a, b) in enumerate(zip(got["losses"], ref["losses"])):
        if not math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-5):
            hint = ""
            if math.isclose(a, b * case["micro"], rel_tol=1e-3):
                hint = (f" Yours is {case['micro']} times too large: divide each micro-batch's loss by the number of "
                        f"micro-batches ({case['micro']}) so that the accumulated gradient is the mean, and return "
                        f"that mean.")
            elif b and math.isclose(a / b, ref["used"][i], rel_tol=1e-2):
                hint = " You returned the SCALED loss: return the loss before scaler.scale()."
            raise AssertionError(f"{where} step {i}: amp_step should return the mean loss over the micro-batches, "
                                 f"{b:.6f}; yours returned {a:.6f}.{hint}")
    if got["scales"] != ref["scales"]:
        raise AssertionError(f"{where} the scaler's scale after each of your steps was {got['scales']}, but should be "
                             f"{ref['scales']}: call scaler.step(optimizer) and scaler.update() exactly once per "
                             f"amp_step, after all micro-batches (never per micro-batch).")
    d, rd = torch.tensor(got["delta"], dtype=torch.float64), ref["delta"]
    if d.shape != rd.shape:
        raise AssertionError(f"{where} the model's parameters changed shape during amp_step")
    den = rd.norm().item()
    if den == 0:
        raise RuntimeError(f"internal check error: the reference skipped every step of {where}")
    err = (d - rd).norm().item() / den
    if not err <= 1e-2:
        ratio = d.norm().item() / den
        if case["max_norm"] is not None and ratio < 0.05:
            hint = (" Your updates are far too small: did you clip BEFORE unscaling? The gradients are multiplied "
                    "by the scale until scaler.unscale_(optimizer) divides them, so clipping them then clips to "
                    "max_norm / scale. Call scaler.unscale_(optimizer) first, then clip_grad_norm_, then scaler.step.")
        elif case["max_norm"] is None and abs(ratio - case["micro"]) < 0.2 * case["micro"]:
            hint = (f" Your updates are {case['micro']}x too large: the accumulated gradient must be the mean over the "
                    f"micro-batches (divide each loss by {case['micro']}).")
        elif case["max_norm"] is not None:
            hint = (" With max_norm set: scaler.unscale_(optimizer), then "
                    "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm), then scaler.step(optimizer).")
        else:
            hint = (" Check the order: for each micro-batch autocast forward, loss / k, scaler.scale(loss).backward(); "
                    "then once: (unscale_ and clip), scaler.step, scaler.update, zero_grad(set_to_none=True). A step "
                    "with inf/NaN gradients must go through scaler.step, which skips it.")
        raise AssertionError(f"{where} after {case['steps']} steps your parameter updates differ from the reference "
                             f"AMP loop by {err:.1%} (relative).{hint}")


def _judge_on_cuda(case, where, cuda):
    """The step run again with the model and the micro-batches on a CUDA device (they report cuda:0; the grader's
    arithmetic stays on its CPU): autocast must follow them there, as it does on a real GPU."""
    expect_type("the step as if on CUDA", cuda, dict)
    intro = (f"{where} the grader also runs your step with a model and micro-batches that report a CUDA device "
             f"(x.device.type is 'cuda'; the arithmetic stays on this CPU), as on a GPU")
    if "raised" in cuda:
        raise AssertionError(f"{intro}, and there amp_step raised {cuda['raised']}. Take every device from the "
                             f"inputs (x.device), never a fixed one.")
    want, asked = case["dtype"], cuda.get("autocast") or []
    if cuda.get("forward") != [want]:
        if "cuda" not in asked:
            hint = (f" Your step asked autocast for the device type(s) {asked}, not for 'cuda': autocast only casts "
                    f"the ops of the device type it is given, so on a GPU your forward ran in fp32 and the step saved "
                    f"nothing. Write torch.autocast(x.device.type, dtype=dtype): the same step then runs on any "
                    f"device.") if asked else " Your step entered no autocast at all there."
        else:
            hint = (" Run the forward under torch.autocast(x.device.type, dtype=dtype), with the dtype amp_step is "
                    "given.")
        raise AssertionError(f"{intro}; there your forward's Linear layers produced {cuda.get('forward')} outputs, "
                             f"not {want}.{hint}")


# ----------------------------------------------------------------------------- task3_3
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
    return "{" + ", ".join(f"{k}: {v}" for k, v in sorted(d.items())) + "}"


def report_judge(case, got):
    expect_type("dtype_report's run", got, dict)
    rep = got.get("report")
    if rep is None or set(rep) != set(CATEGORY_KEYS):
        raise AssertionError(f"dtype_report must return a dict with exactly the keys {CATEGORY_KEYS}, got "
                             f"{got.get('shape') or sorted(rep)}")
    want_total, want, params = reference_report(case)
    where = f"[{case['kind']} {case['dims'] if case['kind'] == 'mlp' else ''} in {case['model_dtype']}, " \
            f"autocast {case['dtype']}, batch {case['batch']}, {case['optimizer']}]"
    for k in CATEGORY_KEYS:
        row = rep[k]
        if type(row) is not dict or any(d.startswith("!") for d in row):
            raise AssertionError(f"dtype_report(...)['{k}'] must be a dict {{torch.dtype: bytes}}, got {row}")
        bad = {d: n for d, n in row.items() if type(n) is not int}
        if bad:
            raise AssertionError(f"dtype_report(...)['{k}'] values must be Python ints (byte counts), got {bad}. "
                                 f"Hint: storage.nbytes() is an int; .item() turns a tensor into one.")
        zero = sorted(d for d, n in row.items() if n == 0)
        if zero:
            raise AssertionError(f"dtype_report(...)['{k}'] lists {zero} with 0 bytes: leave out the dtypes with no "
                                 f"bytes, so that the report names only the dtypes that are really there")
        total = sum(row.values())
        if total != want_total[k]:
            raise AssertionError(f"{where} {k}: memlab's tracker measures {want_total[k]} bytes "
                                 f"({mb(want_total[k])}), your report sums to {total} ({mb(total)}), by dtype "
                                 f"{_fmt(row)} (expected {expected(_fmt(want[k]))}). Count {_REPORT_HINTS[k]}")
        if row != want[k]:
            raise AssertionError(f"{where} {k}: the total is right but the split by dtype is not: expected "
                                 f"{_fmt(want[k])}, got {_fmt(row)}. Use each tensor's own .dtype. {_REPORT_HINTS[k]}")
    if not _same(got["params"], params, rtol=1e-3):
        raise AssertionError(f"{where} after dtype_report the parameters differ from one plain training step: "
                             f"run exactly one forward, backward, optimizer.step() and zero_grad.")


# ----------------------------------------------------------------------------- task 3.2's watched case, from outside
def corroborate(runs) -> list[str]:
    """Task 3.2's watched case seen from outside: memlab's tracker in the learner's process measured the step's peak
    growth; while the case ran (its memory window, sandbox.py) the sandbox's memory may hold that, the micro-batches
    `run` built and some noise (allocator, code pages), not much more. A window more than twice the tracker's count
    and the inputs, plus NOISE_BYTES, held memory the tracker never saw (a dispatch mode switched off, work done
    outside torch): flag it for the instructor. `runs`: (task id, case, value, the case's memory growth in bytes or
    None) for every case; only watched cases are large enough for the comparison to mean something (a first case
    also pages in code, tens of MiB)."""
    MiB = 2**20
    flags = []
    for tid, case, value, growth in runs:
        if tid != "task3_2_amp_step" or not case.get("watched") or growth is None or not isinstance(value, dict):
            continue
        steps = value.get("peak_growth")
        if not isinstance(steps, list) or not steps or any(type(v) is not int for v in steps):
            continue
        seen, inputs = max(steps), input_bytes(case)
        if growth > 2 * (seen + inputs) + NOISE_BYTES:
            flags.append(f"task3_2_amp_step: while its large step ran, the sandbox's memory grew by "
                         f"{growth / MiB:.0f} MiB, more than twice what memlab's tracker saw the step allocate "
                         f"({seen / MiB:.0f} MiB at its peak) and the micro-batches ({inputs / MiB:.0f} MiB) plus "
                         f"{NOISE_BYTES // MiB} MiB: memory the tracker did not see (a dispatch mode switched off, "
                         f"work done outside torch)")
    return flags
