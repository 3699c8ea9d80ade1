"""Checks for exercise 01, "Build a memory profiler".

Each `check_task1_M(student, *, hidden)` raises AssertionError with a message
that says what was expected and the likely mistake. Visible checks use fixed
inputs; hidden checks draw new shapes every run. References come from
memlab's tracker or from exact formulas checked against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import memlab
from memlab.estimate import mlp_activation_bytes

from .common import close, expect_int, forbid_memlab_tracker, mb, rng, torch_seed

PHASES = ("forward", "backward", "step")
CATEGORY_KEYS = ("parameters", "gradients", "optimizer", "activations")


# ----------------------------------------------------------------------------- task1_1
def _fresh_mode(LiveBytes):
    try:
        mode = LiveBytes()
    except Exception as e:  # noqa: BLE001 - report any construction failure as a teaching message
        raise AssertionError(f"LiveBytes() must construct with no arguments; it raised {type(e).__name__}: {e}")
    for attr in ("current", "peak"):
        if not hasattr(mode, attr):
            raise AssertionError(f"LiveBytes needs a `{attr}` attribute (bytes, an int)")
    return mode


def _expect_now(mode, want_current, want_peak, what):
    cur, pk = expect_int("LiveBytes.current", mode.current), expect_int("LiveBytes.peak", mode.peak)
    assert cur == want_current, (
        f"after {what}: current should be {want_current} bytes, got {cur}. "
        + ("Too many bytes: do you count a view (which shares its storage) as a new allocation, or forget to "
           "subtract a freed storage (use weakref.finalize / weakref.ref(storage, callback))?"
           if cur > want_current else
           "Too few bytes: count storage.nbytes() of every new storage an op returns; do not subtract storages "
           "you never counted (tensors made before the mode was entered)."))
    assert pk == want_peak, f"after {what}: peak should be {want_peak} bytes, got {pk}"


def check_task1_1(LiveBytes, *, hidden: bool) -> None:
    """LiveBytes: a TorchDispatchMode with .current, .peak and reset_peak()."""
    r = rng(hidden, 11)
    outside = torch.ones(1000)                       # made before the mode: never counted
    mode = _fresh_mode(LiveBytes)
    with mode:
        _expect_now(mode, 0, 0, "entering the mode")
        n1 = r.randrange(100, 5000) if hidden else 1000
        dt = r.choice([torch.float32, torch.float16, torch.float64, torch.int64]) if hidden else torch.float32
        a = torch.zeros(n1, dtype=dt)                # a new storage
        s1 = n1 * a.element_size()
        _expect_now(mode, s1, s1, f"a = torch.zeros({n1}, dtype={dt})")
        v = a.view(-1, 1)[: n1 // 2]                 # views share a's storage: nothing new
        _expect_now(mode, s1, s1, "taking views of a")
        a.add_(1)                                    # in place: nothing new
        _expect_now(mode, s1, s1, "an in-place a.add_(1)")
        b = outside * 2                              # a new storage from an op on an outside tensor
        s2 = 1000 * 4
        _expect_now(mode, s1 + s2, s1 + s2, "b = outside * 2")
        w = outside.view(10, 100)                    # views / in-place results of an outside tensor:
        outside.mul_(1)                              # its storage existed before the mode, so nothing new
        _expect_now(mode, s1 + s2, s1 + s2,
                    "outside.view(10, 100) and outside.mul_(1) on a tensor made before the mode (they share "
                    "its old storage: skip an output whose storage is one of the op's inputs' and not yet counted)")
        del w
        del a
        _expect_now(mode, s1 + s2, s1 + s2, "`del a` while a view of it is still alive")
        del v
        _expect_now(mode, s2, s1 + s2, "deleting the last view of a (its storage is freed)")
        if not hasattr(mode, "reset_peak"):
            raise AssertionError("LiveBytes needs a reset_peak() method that sets peak to the current bytes")
        mode.reset_peak()
        _expect_now(mode, s2, s2, "reset_peak()")
        del outside                                  # freeing something never counted changes nothing
        _expect_now(mode, s2, s2, "freeing a tensor made before the mode was entered")
        if hidden:                                   # a random stream of allocations and frees
            live, peak = {}, s2
            for i in range(40):
                if live and r.random() < 0.4:
                    k = r.choice(sorted(live))
                    del live[k]
                else:
                    n = r.randrange(1, 4000)
                    live[i] = torch.empty(n, dtype=r.choice([torch.float32, torch.float16, torch.int8]))
                cur = s2 + sum(t.untyped_storage().nbytes() for t in live.values())
                peak = max(peak, cur)
                _expect_now(mode, cur, peak, f"random step {i}")
        del b


# ----------------------------------------------------------------------------- task1_2
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


def _twin(make, seed):
    torch.manual_seed(seed)
    return make()


def check_task1_2(profile_phases, *, hidden: bool) -> None:
    """profile_phases(model, optimizer, x, y) -> {"forward", "backward", "step": peak bytes}."""
    r = rng(hidden, 12)
    cases = 3 if hidden else 1
    for case in range(cases):
        seed = torch_seed(r)
        if hidden and case == 2:
            cfg = memlab.GPTConfig.tiny(n_layer=r.randint(1, 2), n_embd=32 * r.randint(1, 3), n_head=2,
                                        vocab_size=r.choice([64, 128]), block_size=64)
            B, T = r.randint(2, 6), r.choice([16, 32])
            make = lambda: memlab.GPT(cfg)                              # noqa: E731
            g = torch.Generator().manual_seed(seed)
            x = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
            y = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
            desc = f"GPT(n_layer={cfg.n_layer}, n_embd={cfg.n_embd}), batch {B}x{T}"
        else:
            dims = (r.randint(16, 200), r.randint(32, 300), r.randint(1, 4), r.randint(2, 20)) if hidden \
                else (64, 128, 2, 10)
            B = r.randint(8, 300) if hidden else 32
            make = lambda: memlab.MLP(*dims)                            # noqa: E731
            g = torch.Generator().manual_seed(seed)
            x = torch.randn(B, dims[0], generator=g)
            y = torch.randint(0, dims[3], (B,), generator=g)
            desc = f"MLP{dims}, batch {B}"
        opt_name = r.choice(["adam", "sgd"]) if hidden else "adam"
        mk_opt = (lambda p: torch.optim.Adam(p, lr=1e-3)) if opt_name == "adam" else \
            (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
        if hidden and case == 2:
            # wrap the GPT so model(x) returns logits flattened for cross_entropy
            class Flat(torch.nn.Module):
                def __init__(self, m):
                    super().__init__()
                    self.m = m

                def forward(self, idx):
                    return self.m(idx).flatten(0, 1)
            make_flat = lambda: Flat(make())                            # noqa: E731
            y = y.flatten()
        else:
            make_flat = make
        m_ref, m_stu = _twin(make_flat, seed), _twin(make_flat, seed)
        o_ref, o_stu = mk_opt(m_ref.parameters()), mk_opt(m_stu.parameters())
        for step in range(2):                        # first step (lazy optimizer state) and a steady one
            want = reference_phase_peaks(m_ref, o_ref, x, y)
            with forbid_memlab_tracker("task1_2"):
                got = profile_phases(m_stu, o_stu, x, y)
            if not isinstance(got, dict) or set(got) != set(PHASES):
                raise AssertionError(f"profile_phases must return a dict with exactly the keys {PHASES}, got "
                                     f"{got if not isinstance(got, dict) else sorted(got)}")
            for p in PHASES:
                v = expect_int(f"profile_phases(...)['{p}']", got[p])
                ok = abs(v - want[p]) <= 64 + 1e-3 * want[p]
                assert ok, (
                    f"{desc}, {opt_name}, step {step + 1}: the {p} phase peaked at {want[p]} bytes "
                    f"({mb(want[p])}) of memory allocated by the step, you reported {v} ({mb(v)}). "
                    + ("Did you report the bytes live at the END of the phase instead of its peak? Reset the peak "
                       "when the phase starts and read it when the phase ends." if v < want[p] else
                       "Too high: do you count views/in-place results as new memory, or carry the previous "
                       "phase's peak over (reset the peak at each phase start)?")
                    + (" Remember the optimizer creates its state inside the first step()." if p == "step" else ""))
            for pr, ps in zip(m_ref.parameters(), m_stu.parameters()):
                assert torch.allclose(pr, ps, atol=1e-6), (
                    "after profile_phases the model's parameters differ from a plain training step: run "
                    "forward, loss.backward(), optimizer.step(), optimizer.zero_grad(set_to_none=True) once")


# ----------------------------------------------------------------------------- task1_3
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


def check_task1_3(saved_bytes_per_layer, *, hidden: bool) -> None:
    """saved_bytes_per_layer(model, x) -> {leaf module name: bytes saved for backward}."""
    r = rng(hidden, 13)
    acts = ["relu", "gelu", "tanh"] if hidden else ["relu", "gelu"]
    for act in acts:
        torch_seed(r)
        d_in, width, depth, d_out = (r.randint(8, 200), r.randint(8, 300), r.randint(1, 4), r.randint(2, 30)) \
            if hidden else (32, 64, 2, 10)
        B = r.randint(1, 200) if hidden else 16
        model = memlab.MLP(d_in, width, depth, d_out, act=act)
        x = torch.randn(B, d_in)
        want = reference_saved_per_layer(model, B)
        with forbid_memlab_tracker("task1_3"):
            got = saved_bytes_per_layer(model, x)
        if not isinstance(got, dict):
            raise AssertionError(f"saved_bytes_per_layer must return a dict, got {type(got).__name__}")
        assert set(got) == set(want), (
            f"keys should be the names of the leaf modules (model.named_modules(), modules with no children): "
            f"{sorted(want)}; got {sorted(got)}")
        for k in want:
            v = expect_int(f"saved_bytes_per_layer(...)['{k}']", got[k])
            mod = dict(model.named_modules())[k]
            hint = ""
            if v > want[k] and isinstance(mod, torch.nn.Linear):
                hint = (" Too many bytes for a Linear: parameters (the weight, or weight.t() which is a view of it) "
                        "are not activations, and a tensor already saved by an earlier layer belongs to that layer.")
            elif v < want[k] and k == "layers.0":
                hint = " The first Linear saves the input batch x itself: count it."
            elif v != want[k]:
                hint = (" Use torch.autograd.graph.saved_tensors_hooks to see what autograd saves, module forward "
                        "pre-hooks to know which module is running, and count each storage once.")
            assert v == want[k], (f"MLP(act={act!r}, d_in={d_in}, width={width}, depth={depth}), batch {B}: "
                                  f"{k} ({type(mod).__name__}) saves {want[k]} bytes, you reported {v}.{hint}")


# ----------------------------------------------------------------------------- task1_4
def reference_breakdown(dims, act, B, opt_name, seed) -> dict[str, int]:
    torch.manual_seed(seed)
    model = memlab.MLP(*dims, act=act)
    opt = _make_opt(opt_name, model)
    params = sum(p.untyped_storage().nbytes() for p in model.parameters())
    tracker = memlab.MemoryTracker(model, opt)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, dims[0], generator=g)
    y = torch.randint(0, dims[3], (B,), generator=g)
    with tracker:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        grads = tracker.breakdown()["gradients"]
        opt.step()
        state = tracker.breakdown()["optimizer"]
        opt.zero_grad(set_to_none=True)
    return {"parameters": params, "gradients": grads, "optimizer": state,
            "activations": mlp_activation_bytes(B, dims[0], dims[1], dims[2], dims[3], act=act)}


def _make_opt(name, model):
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    if name == "momentum":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.SGD(model.parameters(), lr=0.1)


def check_task1_4(category_breakdown, *, hidden: bool) -> None:
    """category_breakdown(model, optimizer, x, y) -> bytes of parameters,
    gradients (after backward), optimizer state (after the first step) and
    activations (saved for backward, inputs and parameters excluded)."""
    r = rng(hidden, 14)
    opts = ["adam", "momentum", r.choice(["adam", "sgd"])] if hidden else ["adam"]
    for opt_name in opts:
        seed = torch_seed(r)
        dims = (r.randint(8, 200), r.randint(16, 300), r.randint(1, 4), r.randint(2, 20)) if hidden else (64, 128, 2, 10)
        act = r.choice(["relu", "tanh", "gelu"]) if hidden else "relu"
        B = r.randint(4, 256) if hidden else 32
        want = reference_breakdown(dims, act, B, opt_name, seed)
        torch.manual_seed(seed)
        model = memlab.MLP(*dims, act=act)
        opt = _make_opt(opt_name, model)
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(B, dims[0], generator=g)
        y = torch.randint(0, dims[3], (B,), generator=g)
        with forbid_memlab_tracker("task1_4"):
            got = category_breakdown(model, opt, x, y)
        if not isinstance(got, dict) or set(got) != set(CATEGORY_KEYS):
            raise AssertionError(f"category_breakdown must return a dict with exactly the keys {CATEGORY_KEYS}, "
                                 f"got {got if not isinstance(got, dict) else sorted(got)}")
        hints = {
            "parameters": "sum the bytes of model.parameters() (numel * element_size).",
            "gradients": "read the .grad tensors right after loss.backward(), before the optimizer step and "
                         "before zero_grad(set_to_none=True) frees them.",
            "optimizer": "optimizer.state is empty until the first step() creates it lazily: measure it after "
                         "optimizer.step(), and count every tensor in it (Adam: exp_avg, exp_avg_sq, step).",
            "activations": "count what autograd saves for backward during the forward (saved_tensors_hooks), each "
                           "storage once, excluding parameters and the input batch; gradients are not activations.",
        }
        desc = f"MLP{dims} act={act}, batch {B}, {opt_name}"
        for k in CATEGORY_KEYS:
            v = expect_int(f"category_breakdown(...)['{k}']", got[k])
            assert v == want[k], f"{desc}: {k} should be {want[k]} bytes ({mb(want[k])}), got {v} ({mb(v)}): {hints[k]}"


# ----------------------------------------------------------------------------- task1_5
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


def check_task1_5(estimate_peak_bytes, *, hidden: bool) -> None:
    """estimate_peak_bytes(batch, d_in, width, depth, d_out, optimizer, first_step) within 5% of the measured peak."""
    r = rng(hidden, 15)
    if hidden:
        cases = [  # activation-heavy, state-heavy steady Adam, first Adam step
            (r.randint(1024, 3072), r.randint(64, 256), r.randint(128, 384), r.randint(2, 4), r.randint(2, 20), "sgd", False),
            (r.randint(4, 32), r.randint(128, 512), r.randint(256, 512), r.randint(2, 4), r.randint(2, 20), "adam", False),
            (r.randint(256, 1024), r.randint(64, 256), r.randint(256, 512), r.randint(2, 4), r.randint(2, 20), "adam", True),
        ]
    else:
        cases = [(2048, 128, 256, 3, 10, "sgd", False), (16, 256, 512, 3, 10, "adam", False)]
    for batch, d_in, width, depth, d_out, opt, first in cases:
        want = measure_mlp_peak(batch, d_in, width, depth, d_out, opt, first)
        got = estimate_peak_bytes(batch, d_in, width, depth, d_out, opt, first)
        if isinstance(got, float) and got.is_integer():
            got = int(got)
        got = expect_int("estimate_peak_bytes(...)", got)
        err = (got - want) / want
        desc = f"batch={batch}, d_in={d_in}, width={width}, depth={depth}, d_out={d_out}, {opt}, first_step={first}"
        assert abs(err) <= 0.05, (
            f"{desc}: measured peak {want} bytes ({mb(want)}), you estimated {got} ({mb(got)}), {100 * err:+.1f}%. "
            + ("Underestimate: is something missing? Adam keeps 8 bytes/param of state that exists during every "
               "step after the first; gradients exist at the end of backward; the backward of a Linear holds the "
               "incoming gradient and its outputs at once; the input batch is on the device too."
               if err < 0 else
               "Overestimate: at the first step Adam's state does not exist until step() creates it; activations "
               "are freed during backward while gradients are created, so they never all coexist."))
