"""Checks for exercise 01, "Build a memory profiler" (the contract: autograder/checks/common.py).

Each task's `run` builds its inputs from the case's seed and sizes, calls the
learner's code in the learner's process (with memlab.MemoryTracker switched off
inside tasks 1.2-1.4) and returns what it saw as plain data; `judge` computes the
reference in the grader: byte bookkeeping for 1.1, memlab's tracker on a twin
model for 1.2 and 1.4, the per-op saving rules for 1.3, and memlab's tracker on a
real training step for 1.5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import memlab
from memlab.estimate import mlp_activation_bytes

from .common import Task, expect_int, forbid_memlab_tracker, mb, tasks

PHASES = ("forward", "backward", "step")
CATEGORY_KEYS = ("parameters", "gradients", "optimizer", "activations")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "float64": torch.float64, "int64": torch.int64,
          "int8": torch.int8}


# ----------------------------------------------------------------------------- plain-data helpers
def _as_int(v):
    """What the learner returned, as plain data: an int stays an int; anything else is described."""
    return v if type(v) is int else {"not_int": type(v).__name__, "repr": repr(v)[:80]}


def _int(name: str, v) -> int:
    if isinstance(v, dict) and "not_int" in v:
        raise AssertionError(f"{name} must be a Python int (a byte count), got {v['not_int']}: {v['repr']}. "
                             f"Hint: tensor.nbytes and storage.nbytes() are ints; .item() turns a tensor into one.")
    return expect_int(name, v)


def _as_dict(d):
    if type(d) is not dict:
        return {"not_dict": type(d).__name__, "repr": repr(d)[:120]}
    return {"items": {str(k): _as_int(v) for k, v in d.items()}}


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


def _fingerprint(tensors) -> list:
    """Per tensor: [sum, sum of |x|, sum of x * w] in float64, w a fixed random vector."""
    out = []
    for i, t in enumerate(tensors):
        t = t.detach().double().flatten()
        w = torch.randn(t.numel(), generator=torch.Generator().manual_seed(1000 + i), dtype=torch.float64)
        out.append([float(t.sum()), float(t.abs().sum()), float((t * w).sum())])
    return out


def _same_fingerprint(got, want) -> bool:
    if len(got) != len(want):
        return False
    return all(abs(g - w) <= 1e-5 * (4 * fw[1] + 1e-3)
               for fg, fw in zip(got, want) for g, w in zip(fg, fw))


# ----------------------------------------------------------------------------- task1_1
def _live_cases(hidden, r):
    if not hidden:
        return [{"n1": 1000, "dtype": "float32", "sort_n": 300, "stream": []}]
    stream, live = [], []
    first = ["float32", "float16", "int8"]
    r.shuffle(first)                                # every itemsize in every run
    for i in range(40):
        if live and i >= 3 and r.random() < 0.4:
            stream.append(["free", live.pop(r.randrange(len(live)))])
        else:
            stream.append(["alloc", r.randrange(1, 4000), first[i] if i < 3 else r.choice(first)])
            live.append(i)
    return [{"n1": r.randrange(100, 5000), "dtype": r.choice(["float16", "float64", "int64"]),
             "sort_n": r.randrange(1, 700), "stream": stream}]


def _live_run(case, LiveBytes):
    outside = torch.ones(1000)                       # made before the mode: never counted
    to_sort = torch.rand(case["sort_n"])             # also made before the mode
    try:
        mode = LiveBytes()
    except Exception as e:  # noqa: BLE001 - report any construction failure as a teaching message
        return {"problem": f"LiveBytes() must construct with no arguments; it raised {type(e).__name__}: {e}"}
    for attr in ("current", "peak"):
        if not hasattr(mode, attr):
            return {"problem": f"LiveBytes needs a `{attr}` attribute (bytes, an int)"}
    seen = []

    def note():
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
        del b
    return seen


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
class _Flat(torch.nn.Module):
    """A GPT whose model(x) returns logits flattened for cross_entropy."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, idx):
        return self.m(idx).flatten(0, 1)


def _make_opt(name, model):
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    if name == "momentum":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _phase_setup(case):
    """(model, optimizer, x, y, description) rebuilt from the case, the same on both sides."""
    torch.manual_seed(case["seed"])
    g = torch.Generator().manual_seed(case["seed"])
    if case["kind"] == "gpt":
        n_layer, n_embd, vocab, B, T = case["dims"]
        cfg = memlab.GPTConfig.tiny(n_layer=n_layer, n_embd=n_embd, n_head=2, vocab_size=vocab, block_size=64)
        model = _Flat(memlab.GPT(cfg))
        x = torch.randint(0, vocab, (B, T), generator=g)
        y = torch.randint(0, vocab, (B, T), generator=g).flatten()
        desc = f"GPT(n_layer={n_layer}, n_embd={n_embd}), batch {B}x{T}"
    else:
        dims, B = case["dims"], case["B"]
        model = memlab.MLP(*dims)
        x = torch.randn(B, dims[0], generator=g)
        y = torch.randint(0, dims[3], (B,), generator=g)
        desc = f"MLP{tuple(dims)}, batch {B}"
    return model, _make_opt(case["opt"], model), x, y, f"{desc}, {case['opt']}"


def _phase_cases(hidden, r):
    if not hidden:
        return [{"kind": "mlp", "dims": [64, 128, 2, 10], "B": 32, "opt": "adam", "seed": 12}]
    mlp = lambda opt: {"kind": "mlp", "dims": [r.randint(16, 200), r.randint(32, 300), r.randint(1, 4),  # noqa: E731
                                               r.randint(2, 20)], "B": r.randint(8, 300), "opt": opt,
                       "seed": r.randrange(2**31)}
    gpt = {"kind": "gpt", "dims": [r.randint(1, 2), 32 * r.randint(1, 3), r.choice([64, 128]), r.randint(2, 6),
                                   r.choice([16, 32])], "opt": r.choice(["adam", "momentum"]),
           "seed": r.randrange(2**31)}
    return [mlp("adam"), mlp("momentum"), gpt]     # Adam's lazy state, SGD's momentum, a transformer


def _phase_run(case, profile_phases):
    model, opt, x, y, _ = _phase_setup(case)
    steps = []
    for _ in range(2):                               # the first step (lazy optimizer state) and a steady one
        with forbid_memlab_tracker("task1_2"):
            steps.append(_as_dict(profile_phases(model, opt, x, y)))
    return {"steps": steps, "params": _fingerprint(model.parameters())}


def reference_phase_peaks(model, optimizer, x, y) -> dict[str, int]:
    """The peak of bytes allocated by the step in each phase (memlab's tracker,
    no model/optimizer watched: only storages the step creates count)."""
    tracker = memlab.MemoryTracker(device=x.device)
    with tracker:
        with memlab.phase("forward"):
            loss = F.cross_entropy(model(x), y)
        with memlab.phase("backward"):
            loss.backward()
        with memlab.phase("step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del loss
    return {p: tracker.phase_peaks[p]["total"] for p in PHASES}


def _phase_judge(case, got):
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
