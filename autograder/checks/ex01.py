"""Checks for exercise 01, "Build a memory profiler" (the contract: autograder/checks/common.py).

Each task's `run` builds its inputs from the case's seed and sizes, calls the
learner's code in the learner's process (with memlab.MemoryTracker switched off
inside tasks 1.2-1.4) and returns what it saw as plain data; `judge` computes the
reference in the grader: byte bookkeeping for 1.1, memlab's tracker on a twin
model for 1.2 and 1.4, the per-op saving rules for 1.3, and memlab's tracker on a
real training step for 1.5. Tasks 1.1 and 1.2 and the plain-data helpers are in ex01_tracking.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import memlab
from memlab.core.estimate import mlp_activation_bytes

from .common import Task, forbid_memlab_tracker, mb, tasks
from .ex01_tracking import (_live_cases, _live_judge, _live_run, _phase_cases, _phase_judge, _phase_run,  # noqa: F401
                            reference_phase_peaks, CATEGORY_KEYS, _as_int, _int, _as_dict, _dict, _make_opt)


# ----------------------------------------------------------------------------- task1_3
def _saved_cases(hidden, r):
    if not hidden:
        return [{"act": a, "dims": [32, 64, 2, 10], "B": 16, "seed": 13} for a in ("relu", "gelu")]
    depths = [1, r.randint(2, 4), r.randint(2, 4)]   # a single hidden layer in every run
    r.shuffle(depths)
    return [{"act": a, "dims": [r.randint(8, 200), r.randint(8, 300), d, r.randint(2, 30)], "B": r.randint(1, 200),
             "seed": r.randrange(2**31)} for a, d in zip(("relu", "gelu", "tanh"), depths)]


def _saved_setup(case):
    torch.manual_seed(case["seed"])
    model = memlab.MLP(*case["dims"], act=case["act"])
    x = torch.randn(case["B"], case["dims"][0], generator=torch.Generator().manual_seed(case["seed"]))
    return model, x


def _saved_run(case, saved_bytes_per_layer):
    model, x = _saved_setup(case)
    with forbid_memlab_tracker("task1_3"):
        got = saved_bytes_per_layer(model, x)
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return {"got": _as_dict(got), "hooks_left": hooks}


def reference_saved_per_layer(mlp: memlab.MLP, batch: int, itemsize: int = 4) -> dict[str, int]:
    """Bytes each leaf module of memlab.MLP saves for backward, a storage
    attributed to the first module that saves it, parameters excluded.

    Linear saves its input (only if its weight needs a gradient); ReLU and tanh
    save their output; GELU saves its input. So layers.0 owns the input batch,
    ReLU/tanh own their outputs (the next Linear saves them again), and with
    GELU both GELU (its input) and the next Linear (GELU's output) own one."""
    out = {}
    mods = list(mlp.layers)
    for i, m in enumerate(mods):
        name = f"layers.{i}"
        if isinstance(m, torch.nn.Linear):
            if i == 0:
                out[name] = batch * m.in_features * itemsize
            else:
                prev = mods[i - 1]
                out[name] = batch * m.in_features * itemsize if isinstance(prev, torch.nn.GELU) else 0
        else:
            out[name] = batch * mlp.width * itemsize
    return out


def _saved_judge(case, got):
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
def _breakdown_cases(hidden, r):
    if not hidden:
        return [{"opt": "adam", "act": "relu", "dims": [64, 128, 2, 10], "B": 32, "seed": 14}]
    acts = ["relu", "tanh", "gelu"]
    r.shuffle(acts)                                  # each optimizer and each activation in every run
    return [{"opt": o, "act": a, "dims": [r.randint(8, 200), r.randint(16, 300), r.randint(1, 4), r.randint(2, 20)],
             "B": r.randint(4, 256), "seed": r.randrange(2**31)} for o, a in zip(("adam", "momentum", "sgd"), acts)]


def _breakdown_setup(case):
    torch.manual_seed(case["seed"])
    model = memlab.MLP(*case["dims"], act=case["act"])
    opt = _make_opt(case["opt"], model)
    g = torch.Generator().manual_seed(case["seed"])
    x = torch.randn(case["B"], case["dims"][0], generator=g)
    y = torch.randint(0, case["dims"][3], (case["B"],), generator=g)
    return model, opt, x, y


def _breakdown_run(case, category_breakdown):
    with forbid_memlab_tracker("task1_4"):
        return _as_dict(category_breakdown(*_breakdown_setup(case)))


def reference_breakdown(case) -> dict[str, int]:
    """memlab's tracker, watching the model and optimizer, read after backward and after the step."""
    model, opt, x, y = _breakdown_setup(case)
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    tracker = memlab.MemoryTracker(model, opt)
    with tracker:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads = tracker.breakdown()["gradients"]
        opt.step()
        state = tracker.breakdown()["optimizer"]
        opt.zero_grad(set_to_none=True)
    d_in, width, depth, d_out = case["dims"]
    return {"parameters": params, "gradients": grads, "optimizer": state,
            "activations": mlp_activation_bytes(case["B"], d_in, width, depth, d_out, act=case["act"])}


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
    want = reference_breakdown(case)
    mine = _dict("category_breakdown", got, CATEGORY_KEYS)
    desc = f"MLP{tuple(case['dims'])} act={case['act']}, batch {case['B']}, {case['opt']}"
    for k in CATEGORY_KEYS:
        v = _int(f"category_breakdown(...)['{k}']", mine[k])
        assert v == want[k], (f"{desc}: {k} should be {want[k]} bytes ({mb(want[k])}), got {v} ({mb(v)}): "
                              f"{_BREAKDOWN_HINTS[k]}")


# ----------------------------------------------------------------------------- task1_5
def _estimate_cases(hidden, r):
    if not hidden:
        return [[2048, 128, 256, 3, 10, "sgd", False], [16, 256, 512, 3, 10, "adam", False]]
    # the first Adam step: activations dominate and Adam's state (which does not exist yet) would add over 20%
    depth, width = r.randint(3, 4), r.randint(128, 256)
    batch = round(r.uniform(4, 5.5) * width * (depth - 1) / (depth + 2))
    return [  # activation-heavy SGD, SGD's first step, state-heavy steady Adam, activation-heavy first Adam step
        [r.randint(1024, 3072), r.randint(64, 256), r.randint(128, 384), r.randint(2, 4), r.randint(2, 20), "sgd",
         False],
        [r.randint(256, 1024), r.randint(64, 256), r.randint(128, 384), r.randint(2, 4), r.randint(2, 20), "sgd",
         True],
        [r.randint(4, 32), r.randint(128, 512), r.randint(256, 512), r.randint(2, 4), r.randint(2, 20), "adam", False],
        [batch, r.randint(32, 96), width, depth, r.randint(2, 20), "adam", True],
    ]


def _estimate_run(case, estimate_peak_bytes):
    got = estimate_peak_bytes(*case)
    if type(got) is float and got.is_integer():
        got = int(got)
    return _as_int(got)


def measure_mlp_peak(batch, d_in, width, depth, d_out, optimizer, first_step, seed=0) -> int:
    """Peak bytes of one memlab.train_step of memlab.MLP (ReLU, cross-entropy,
    torch.optim with foreach=False), counting the input batch made for it."""
    torch.manual_seed(seed)
    model = memlab.MLP(d_in, width, depth, d_out)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False) if optimizer == "adam" else \
        torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)

    def batch_():
        return torch.randn(batch, d_in), torch.randint(0, d_out, (batch,))

    if not first_step:
        memlab.train_step(model, opt, *batch_())
    tracker = memlab.MemoryTracker(model, opt)
    with tracker:
        x, y = batch_()
        memlab.train_step(model, opt, x, y)
        del x, y
    return tracker.peak


def _estimate_judge(case, got):
    want = measure_mlp_peak(*case)
    got = _int("estimate_peak_bytes(...)", got)
    err = (got - want) / want
    batch, d_in, width, depth, d_out, opt, first = case
    desc = f"batch={batch}, d_in={d_in}, width={width}, depth={depth}, d_out={d_out}, {opt}, first_step={first}"
    assert abs(err) <= 0.05, (
        f"{desc}: measured peak {want} bytes ({mb(want)}), you estimated {got} ({mb(got)}), {100 * err:+.1f}%. "
        + ("Underestimate: is something missing? Adam keeps 8 bytes/param of state that exists during every "
           "step after the first; gradients exist at the end of backward; the backward of a Linear holds the "
           "incoming gradient and its outputs at once; the input batch is on the device too."
           if err < 0 else
           "Overestimate: at the first step Adam's state does not exist until step() creates it; activations "
           "are freed during backward while gradients are created, so they never all coexist."))


TASKS = tasks(
    Task("task1_1_live_bytes", ("LiveBytes",), _live_cases, _live_run, _live_judge),
    Task("task1_2_profile_phases", ("profile_phases",), _phase_cases, _phase_run, _phase_judge),
    Task("task1_3_saved_per_layer", ("saved_bytes_per_layer",), _saved_cases, _saved_run, _saved_judge),
    Task("task1_4_category_breakdown", ("category_breakdown",), _breakdown_cases, _breakdown_run, _breakdown_judge),
    Task("task1_5_estimate_peak", ("estimate_peak_bytes",), _estimate_cases, _estimate_run, _estimate_judge),
)
