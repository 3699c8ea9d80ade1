"""Exercise 01, tasks 1.1 (live bytes) and 1.2 (phase peaks), and the plain-data helpers every task of
exercise 01 uses. The task list and tasks 1.3-1.5 are in ex01.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import memlab

from .common import expect_int, forbid_memlab_tracker, mb

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
