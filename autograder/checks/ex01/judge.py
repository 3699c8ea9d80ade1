"""Exercise 01's judges: each compares what the learner's `run` returned with the references (refs.py)."""

from __future__ import annotations

import torch

from ..common import expect_int, expected, mb
from .cases import CATEGORY_KEYS, PHASES
from .inputs import DTYPES, _fingerprint, _phase_setup, _saved_setup
from .refs import measure_mlp_step, reference_breakdown, reference_phase_peaks, reference_saved_per_layer

# ----------------------------------------------------------------------------- plain-data helpers
def _int(name: str, v) -> int:
    if isinstance(v, dict) and "not_int" in v:
        raise AssertionError(f"{name} must be a Python int (a byte count), got {v['not_int']}: {v['repr']}. "
                             f"Hint: tensor.nbytes and storage.nbytes() are ints; .item() turns a tensor into one.")
    return expect_int(name, v)


def _dict(name: str, got, keys) -> dict:
    want = f" with exactly the keys {tuple(keys)}" if keys is not None else ""
    if "not_dict" in got:
        raise AssertionError(f"{name} must return a dict{want}, got {got['not_dict']}: {got['repr']}")
    if keys is not None and set(got["items"]) != set(keys):
        raise AssertionError(f"{name} must return a dict{want}, got the keys {sorted(got['items'])}")
    return got["items"]


def _problem(got):
    if isinstance(got, dict) and "problem" in got:
        raise AssertionError(got["problem"])


def _same_fingerprint(got, want) -> bool:
    if len(got) != len(want):
        return False
    return all(abs(g - w) <= 1e-5 * (4 * fw[1] + 1e-3)
               for fg, fw in zip(got, want) for g, w in zip(fg, fw))


# ----------------------------------------------------------------------------- task1_1
_LIVE_STEPS = ["entering the mode", "a = torch.zeros(n1, dtype)", "taking views of a", "an in-place a.add_(1)",
               "b = outside * 2",
               "outside.view(10, 100), outside.mul_(1) and outside.chunk(3) on a tensor made before the mode (they "
               "share its old storage: skip an output whose storage is one of the op's inputs' and not yet counted)",
               "values, indices = torch.sort(t): one op returning TWO new tensors (count every output, not only "
               "the first: tree_flatten(out))",
               "deleting values and indices", "`del a` while a view of it is still alive",
               "deleting the last view of a (its storage is freed)", "reset_peak()",
               "freeing a tensor made before the mode was entered"]


def _live_judge(case, got):
    _problem(got)
    size = lambda n, d: n * torch.empty(0, dtype=DTYPES[d]).element_size()  # noqa: E731
    s1, s2, s3 = size(case["n1"], case["dtype"]), 4000, size(case["sort_n"], "float32") + size(case["sort_n"], "int64")
    want = [(0, 0), (s1, s1), (s1, s1), (s1, s1), (s1 + s2, s1 + s2), (s1 + s2, s1 + s2),
            (s1 + s2 + s3, s1 + s2 + s3), (s1 + s2, s1 + s2 + s3), (s1 + s2, s1 + s2 + s3),
            (s2, s1 + s2 + s3), (s2, s2), (s2, s2)]
    steps = list(_LIVE_STEPS)
    live, cur, peak = {}, s2, s2
    for i, op in enumerate(case["stream"]):
        if op[0] == "free":
            cur -= live.pop(op[1])
        else:
            live[i] = size(op[1], op[2])
            cur += live[i]
        peak = max(peak, cur)
        want.append((cur, peak))
        steps.append(f"random step {i} ({op[0]} of {op[1]}{' ' + op[2] if op[0] == 'alloc' else ''})")
    s4 = 4 * case["n_detach"]
    n, stride = case["strided"]
    s5 = 4 * ((n - 1) * stride + 1)                       # the storage empty_strided allocates: it spans every stride
    for delta, what in ((s4, "c = torch.zeros(n)"),
                        (0, "d = c.detach(); del c: d shares c's storage without being a view of c, so the storage "
                            "is alive (watch the storage, weakref.ref(storage, ...), not the tensor object)"),
                        (-s4, "del d: the storage's last tensor is gone"),
                        (s5, f"e = torch.empty_strided(({n},), ({stride},)): its storage spans every stride, far "
                             f"more than {n} floats (count storage.nbytes(), not tensor.nbytes)"),
                        (-s5, "del e")):
        cur += delta
        peak = max(peak, cur)
        want.append((cur, peak))
        steps.append(what)
    desc = f"(n1={case['n1']}, dtype={case['dtype']}, sort of {case['sort_n']} floats)"
    if type(got) is not list or len(got) != len(want):
        raise AssertionError("LiveBytes: the check could not observe every step")
    for (c, p), (wc, wp), what in zip(got, want, steps):
        c, p = _int("LiveBytes.current", c), _int("LiveBytes.peak", p)
        assert c == wc, (
            f"after {what} {desc}: current should be {wc} bytes, got {c}. "
            + ("Too many bytes: do you count a view (which shares its storage) as a new allocation, or forget to "
               "subtract a freed storage (use weakref.finalize / weakref.ref(storage, callback))?"
               if c > wc else
               "Too few bytes: count storage.nbytes() of every new storage an op returns (all of its outputs); do "
               "not subtract storages you never counted (tensors made before the mode was entered)."))
        assert p == wp, f"after {what} {desc}: peak should be {wp} bytes, got {p}"


# ----------------------------------------------------------------------------- task1_2
def _phase_judge(case, got):
    _problem(got)
    model, opt, x, y, desc = _phase_setup(case)
    for step, mine in enumerate(got["steps"]):
        want = reference_phase_peaks(model, opt, x, y)
        mine = _dict("profile_phases", mine, PHASES)
        for p in PHASES:
            v = _int(f"profile_phases(...)['{p}']", mine[p])
            assert abs(v - want[p]) <= 64 + 1e-3 * want[p], (
                f"{desc}, step {step + 1}: the {p} phase peaked at {want[p]} bytes "
                f"({mb(want[p])}) of memory allocated by the step, you reported {v} ({mb(v)}). "
                + ("Did you report the bytes live at the END of the phase instead of its peak? Reset the peak "
                   "when the phase starts and read it when the phase ends." if v < want[p] else
                   "Too high: do you count views/in-place results as new memory, or carry the previous "
                   "phase's peak over (reset the peak at each phase start)?")
                + (" Remember the optimizer creates its state inside the first step()." if p == "step" else ""))
    assert _same_fingerprint(got["params"], _fingerprint(model.parameters())), (
        f"{desc}: after two calls of profile_phases the model's parameters differ from two plain training steps: "
        f"run forward, loss.backward(), optimizer.step(), optimizer.zero_grad(set_to_none=True) once per call")


# ----------------------------------------------------------------------------- task1_3
def _saved_judge(case, got):
    _problem(got)
    model, _ = _saved_setup(case)
    want = reference_saved_per_layer(model, case["B"])
    d_in, width, depth, _ = case["dims"]
    desc = f"MLP(act={case['act']!r}, d_in={d_in}, width={width}, depth={depth}), batch {case['B']}"
    mine = _dict("saved_bytes_per_layer", got["got"], None)
    assert set(mine) == set(want), (
        f"{desc}: keys should be the names of the leaf modules (model.named_modules(), modules with no children): "
        f"{sorted(want)}; got {sorted(mine)}")
    mods = dict(model.named_modules())
    for k in want:
        v = _int(f"saved_bytes_per_layer(...)['{k}']", mine[k])
        hint = ""
        if v > want[k] and isinstance(mods[k], torch.nn.Linear):
            hint = (" Too many bytes for a Linear: parameters (the weight, or weight.t() which is a view of it) "
                    "are not activations, and a tensor already saved by an earlier layer belongs to that layer.")
        elif v < want[k] and k == "layers.0":
            hint = " The first Linear saves the input batch x itself: count it."
        elif v != want[k]:
            hint = (" Use torch.autograd.graph.saved_tensors_hooks to see what autograd saves, module forward "
                    "pre-hooks to know which module is running, and count each storage once.")
        assert v == want[k], f"{desc}: {k} ({type(mods[k]).__name__}) saves {want[k]} bytes, you reported {v}.{hint}"
    assert got["hooks_left"] == 0, (
        f"{desc}: after saved_bytes_per_layer returned, the model still has {got['hooks_left']} forward hook(s): "
        f"remove every hook you registered (handle.remove(), in a finally block), or they run in every later "
        f"forward of the learner's model.")


# ----------------------------------------------------------------------------- task1_4
_BREAKDOWN_HINTS = {
    "parameters": "sum the bytes of model.parameters() (numel * element_size).",
    "gradients": "read the .grad tensors right after loss.backward(), before the optimizer step and "
                 "before zero_grad(set_to_none=True) frees them.",
    "optimizer": "optimizer.state is empty until the first step() creates it lazily: measure it after "
                 "optimizer.step(), and count every tensor in it (Adam: exp_avg, exp_avg_sq, step).",
    "activations": "count what autograd saves for backward during the forward (saved_tensors_hooks), each "
                   "storage once, excluding parameters and the input batch; gradients are not activations.",
}


def _breakdown_judge(case, got):
    _problem(got)
    want = reference_breakdown(case)
    mine = _dict("category_breakdown", got, CATEGORY_KEYS)
    desc = f"MLP{tuple(case['dims'])} act={case['act']}, batch {case['B']}, {case['opt']}"
    for k in CATEGORY_KEYS:
        v = _int(f"category_breakdown(...)['{k}']", mine[k])
        assert v == want[k], (f"{desc}: {k} should be {want[k]} bytes ({mb(want[k])}), got {v} ({mb(v)}): "
                              f"{_BREAKDOWN_HINTS[k]}")


# ----------------------------------------------------------------------------- task1_5
_PEAK_MOMENTS = {
    "forward": "at the end of the forward pass: the parameters, the optimizer's state if it exists yet, the input "
               "batch and every activation kept for backward, no gradient yet",
    "backward": "in the backward pass: the activations not yet freed, the gradients made so far, and each Linear's "
                "backward holding the incoming gradient and its outputs at once (early in the backward when the "
                "batch is large; late, when nearly every gradient exists, when the batch is narrow and the layers "
                "wide)",
    "step": "in the optimizer step: the parameters, every gradient, the optimizer's state (Adam creates it inside its "
            "first step) and Adam's temporaries (denom, the size of the parameter being updated)",
}


def _estimate_judge(case, got):
    want, moment = measure_mlp_step(*case)
    got = _int("estimate_peak_bytes(...)", got)
    err = (got - want) / want
    batch, d_in, width, depth, d_out, opt, first = case
    step = "the optimizer's first step" if first else "a step after the first"
    desc = f"MLP(d_in={d_in}, width={width}, depth={depth}, d_out={d_out}), batch {batch}, {opt}, {step}"
    # the measured peak is the reference's answer: marked, so a hidden check shows [hidden] in its place; what
    # teaches is where the peak falls and which way the estimate is off, in words
    assert abs(err) <= 0.05, (
        f"{desc}: you estimated {got} bytes ({mb(got)}), {'below' if err < 0 else 'above'} the measured peak of "
        f"{expected(want)} bytes ({expected(mb(want))}) by more than the tolerance (five per cent). This step's peak "
        f"falls {_PEAK_MOMENTS[moment]}. "
        + ("Underestimate: is something missing? Adam keeps two fp32 moments per parameter (exp_avg, exp_avg_sq), "
           "state that exists during every step after the first; gradients exist at the end of backward; the "
           "backward of a Linear holds the incoming gradient and its outputs at once; the input batch is on the "
           "device too."
           if err < 0 else
           "Overestimate: at the first step Adam's state does not exist until step() creates it; activations "
           "are freed during backward while gradients are created, so they never all coexist."))
