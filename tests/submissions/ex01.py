"""Plausible-wrong submissions for exercise 01 and the points each must lose."""

from . import edit, solution_cells

ASSIGNMENT = "01_memory_profiler"

_LIVE_BYTES_VIEWS = '''
class LiveBytes(TorchDispatchMode):
    """Counts every output tensor's numel * element_size: views and in-place results count again."""
    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0

    def reset_peak(self):
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.current += t.numel() * t.element_size()
                self.peak = max(self.peak, self.current)
        return out
'''

_LIVE = solution_cells(ASSIGNMENT)["task1_1_live_bytes"]

_PHASES_AT_END = '''
def profile_phases(model, optimizer, x, y):
    """Reads the bytes live at the END of each phase instead of the peak during it."""
    mode = LiveBytes()
    out = {}
    with mode:
        loss = F.cross_entropy(model(x), y)
        out["forward"] = mode.current
        loss.backward()
        out["backward"] = mode.current
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["step"] = mode.current
    return out
'''

_BREAKDOWN_BODY = '''
def category_breakdown(model, optimizer, x, y):
    skip = {p.untyped_storage()._cdata for p in model.parameters()}
    skip |= {x.untyped_storage()._cdata, y.untyped_storage()._cdata}
    saved = {}
    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in skip:
            saved[st._cdata] = st.nbytes()
        return t
    params = sum(p.nbytes for p in model.parameters())
    {MEASURE}
'''

# counts what the step holds after backward as "activations": the gradients land there too
_GRADS_AS_ACTIVATIONS = _BREAKDOWN_BODY.replace("{MEASURE}", '''mode = LiveBytes()
    with mode:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        activations = mode.current
    grads = sum(p.grad.nbytes for p in model.parameters())
    optimizer.step()
    state = sum(v.nbytes for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    optimizer.zero_grad(set_to_none=True)
    return {"parameters": params, "gradients": grads, "optimizer": state, "activations": activations}''')

# reads optimizer.state before the first step() has created it
_STATE_BEFORE_STEP = _BREAKDOWN_BODY.replace("{MEASURE}", '''state = sum(v.nbytes for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    grads = sum(p.grad.nbytes for p in model.parameters())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"parameters": params, "gradients": grads, "optimizer": state, "activations": sum(saved.values())}''')

# reads the gradients after zero_grad(set_to_none=True) has freed them
_GRADS_AFTER_ZERO = _BREAKDOWN_BODY.replace("{MEASURE}", '''with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    state = sum(v.nbytes for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    optimizer.zero_grad(set_to_none=True)
    grads = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    return {"parameters": params, "gradients": grads, "optimizer": state, "activations": sum(saved.values())}''')

_SAVED_WITH_PARAMS = '''
def saved_bytes_per_layer(model, x):
    """Counts every saved storage, parameters (Linear's weight) included."""
    leaves = {name: m for name, m in model.named_modules() if not list(m.children())}
    result = {name: 0 for name in leaves}
    seen, running = set(), [None]
    hooks = [m.register_forward_pre_hook(lambda mod, inp, name=name: running.__setitem__(0, name))
             for name, m in leaves.items()]
    def pack(t):
        st = t.untyped_storage()
        if st._cdata not in seen:
            seen.add(st._cdata)
            result[running[0]] += st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    for h in hooks:
        h.remove()
    return result
'''

_ESTIMATE_NO_STATE = '''
def estimate_peak_bytes(batch, d_in, width, depth, d_out, optimizer, first_step):
    """Forgets Adam's state and scratch: counts weights, grads, inputs and activations only."""
    dims = [d_in] + [width] * depth + [d_out]
    P = 4 * sum(a * b + b for a, b in zip(dims[:-1], dims[1:]))
    X = 4 * batch * d_in + 8 * batch
    A = 4 * depth * batch * width + 4 * batch * d_out
    return max(P + X + A + 8 * batch * width, 2 * P + X)
'''

# looks only at a single-tensor result: an op that returns several new tensors (sort, max with indices) is missed
_LIVE_BYTES_FIRST_OUTPUT = '''
class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live = {}

    def reset_peak(self):
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage()._cdata for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        if isinstance(out, torch.Tensor):
            st = out.untyped_storage()
            key = st._cdata
            if key not in self._live and key not in inputs:
                n = st.nbytes()
                def freed(_ref, key=key, n=n):
                    if self._live.pop(key, None) is not None:
                        self.current -= n
                self._live[key] = weakref.ref(st, freed)
                self.current += n
                self.peak = max(self.peak, self.current)
        return out
'''

# right bytes, but the pre-hooks stay on the model after the call
_SAVED_HOOKS_LEFT = '''
def saved_bytes_per_layer(model, x):
    leaves = {name: m for name, m in model.named_modules() if not list(m.children())}
    result = {name: 0 for name in leaves}
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    seen, running = set(), [None]
    for name, m in leaves.items():
        m.register_forward_pre_hook(lambda mod, inp, name=name: running.__setitem__(0, name))
    def pack(t):
        st = t.untyped_storage()
        if running[0] is not None and st._cdata not in params and st._cdata not in seen:
            seen.add(st._cdata)
            result[running[0]] += st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    return result
'''

# counts Adam's state in the forward/backward even at the first step, before step() has created it
_ESTIMATE_STATE_AT_FIRST_STEP = '''
def estimate_peak_bytes(batch, d_in, width, depth, d_out, optimizer, first_step):
    dims = [d_in] + [width] * depth + [d_out]
    shapes = list(zip(dims[:-1], dims[1:]))
    n_params = sum(a * b + b for a, b in shapes)
    P = 4 * n_params
    O = 8 * n_params + 4 * 2 * len(shapes) if optimizer == "adam" else 0
    X = 4 * batch * d_in + 8 * batch
    A = 4 * depth * batch * width + 4 * batch * d_out
    forward_backward = P + O + X + A + 2 * 4 * batch * width
    scratch = 2 * 4 * max(a * b for a, b in shapes) if optimizer == "adam" else 0
    return max(forward_backward, P + P + O + X + scratch)
'''

# Adam's state left out of forward + backward at the steady state too (counted only in the optimizer step): wrong
# when a large batch makes forward + backward the peak
_ESTIMATE_STATE_ONLY_IN_STEP = edit(_ESTIMATE_STATE_AT_FIRST_STEP,
                                    "forward_backward = P + O + X + A", "forward_backward = P + X + A")

# no Adam state at all at the first step, not even in the step that creates it: wrong when the step is the peak
_ESTIMATE_NO_STATE_AT_FIRST_STEP = edit(edit(
    _ESTIMATE_STATE_AT_FIRST_STEP, "forward_backward = P + O + X + A",
    "forward_backward = P + (0 if first_step else O) + X + A"),
    "return max(forward_backward, P + P + O + X + scratch)",
    "return max(forward_backward, P + P + (0 if first_step else O) + X + scratch)")

# no moment late in the backward pass when nearly every gradient already exists: wrong when a narrow batch on a
# wide, deep MLP makes that the peak
_ESTIMATE_NO_LATE_BACKWARD = edit(_ESTIMATE_STATE_AT_FIRST_STEP, "forward_backward = P + O + X + A",
                                  "forward_backward = P + (0 if first_step else O) + X + A")

# memlab's own tracker under the exercise's name: it has current, peak and reset_peak already
_LIVE_BYTES_IS_MEMLABS = '''
class LiveBytes(memlab.MemoryTracker):
    """memlab's tracker, counting CPU storages, as the exercise's LiveBytes."""
    def __init__(self):
        super().__init__(device="cpu", timeline=False)
'''

# memlab's tracker behind a wrapper of the exercise's shape, its __enter__ and __exit__ taken when the cell runs
# (before any check switches the tracker off), and the same tracker doing task 1.4's accounting
_LIVE_BYTES_WRAPS_MEMLABS = '''
_enter, _exit = memlab.MemoryTracker.__enter__, memlab.MemoryTracker.__exit__


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self._tracker = memlab.MemoryTracker(device="cpu", timeline=False)

    current = property(lambda self: self._tracker.current)
    peak = property(lambda self: self._tracker.peak)

    def reset_peak(self):
        self._tracker.reset_peak()

    def __enter__(self):
        _enter(self._tracker)
        return self

    def __exit__(self, *exc):
        return _exit(self._tracker, *exc)
'''
_BREAKDOWN_BY_MEMLABS_TRACKER = '''
def category_breakdown(model, optimizer, x, y):
    tracker = memlab.MemoryTracker(model, optimizer, timeline=False)
    _enter(tracker)
    try:
        with memlab.phase("forward"):
            loss = F.cross_entropy(model(x), y)
        with memlab.phase("backward"):          # the forward's survivors are labelled activations here
            activations = tracker.breakdown()["activations"] - loss.untyped_storage().nbytes()   # the scalar
            loss.backward()
        gradients = tracker.breakdown()["gradients"]
        optimizer.step()
        state = tracker.breakdown()["optimizer"]
        optimizer.zero_grad(set_to_none=True)
    finally:
        _exit(tracker, None, None, None)
    return {"parameters": sum(p.nbytes for p in model.parameters()), "gradients": gradients, "optimizer": state,
            "activations": activations}
'''

WRONG = {
    # memlab.MemoryTracker subclassed as LiveBytes: the lesson's tracker, not the learner's
    "live_bytes_is_memlabs_tracker": {"replace": {"task1_1_live_bytes": _LIVE_BYTES_IS_MEMLABS},
                                      "must_lose": ["task1_1_live_bytes_visible", "task1_1_live_bytes_hidden",
                                                    "task1_2_profile_phases_visible", "task1_2_profile_phases_hidden"]},
    # memlab.MemoryTracker wrapped (its methods captured before the check could switch it off), for 1.1 and 1.4
    "memlabs_tracker_wrapped": {"replace": {"task1_1_live_bytes": _LIVE_BYTES_WRAPS_MEMLABS,
                                            "task1_4_category_breakdown": _BREAKDOWN_BY_MEMLABS_TRACKER},
                                "must_lose": ["task1_1_live_bytes_visible", "task1_1_live_bytes_hidden",
                                              "task1_2_profile_phases_visible", "task1_2_profile_phases_hidden",
                                              "task1_4_category_breakdown_visible",
                                              "task1_4_category_breakdown_hidden"],
                                "must_keep": ["task1_3_saved_per_layer_hidden"]},
    # watches the output tensor object, not its storage: a detached alias keeps the storage alive unseen
    "weakref_on_the_tensor_not_the_storage": {"replace": {"task1_1_live_bytes": edit(
        _LIVE, "self._live[key] = weakref.ref(st, freed)", "self._live[key] = weakref.ref(t, freed)")},
        "must_lose": ["task1_1_live_bytes_visible", "task1_1_live_bytes_hidden"],
        "must_keep": ["task1_3_saved_per_layer_hidden"]},
    # the tensor's element bytes, not its storage's: a strided output's storage is larger
    "tensor_nbytes_not_storage_nbytes": {"replace": {"task1_1_live_bytes": edit(_LIVE, "n = st.nbytes()", "n = t.nbytes")},
                                         "must_lose": ["task1_1_live_bytes_visible", "task1_1_live_bytes_hidden"],
                                         "must_keep": ["task1_4_category_breakdown_hidden"]},
    "views_counted": {"replace": {"task1_1_live_bytes": _LIVE_BYTES_VIEWS},
                      "must_lose": ["task1_1_live_bytes_visible", "task1_1_live_bytes_hidden"],
                      "must_keep": ["task1_3_saved_per_layer_hidden", "task1_5_estimate_peak_hidden"]},
    "phase_end_not_peak": {"replace": {"task1_2_profile_phases": _PHASES_AT_END},
                           "must_lose": ["task1_2_profile_phases_visible", "task1_2_profile_phases_hidden"],
                           "must_keep": ["task1_1_live_bytes_hidden", "task1_4_category_breakdown_hidden"]},
    "gradients_as_activations": {"replace": {"task1_4_category_breakdown": _GRADS_AS_ACTIVATIONS},
                                 "must_lose": ["task1_4_category_breakdown_visible",
                                               "task1_4_category_breakdown_hidden"],
                                 "must_keep": ["task1_2_profile_phases_hidden"]},
    "optimizer_state_before_first_step": {"replace": {"task1_4_category_breakdown": _STATE_BEFORE_STEP},
                                          "must_lose": ["task1_4_category_breakdown_visible",
                                                        "task1_4_category_breakdown_hidden"],
                                          "must_keep": ["task1_3_saved_per_layer_hidden"]},
    "gradients_after_zero_grad": {"replace": {"task1_4_category_breakdown": _GRADS_AFTER_ZERO},
                                  "must_lose": ["task1_4_category_breakdown_visible",
                                                "task1_4_category_breakdown_hidden"],
                                  "must_keep": ["task1_5_estimate_peak_hidden"]},
    "parameters_as_activations": {"replace": {"task1_3_saved_per_layer": _SAVED_WITH_PARAMS},
                                  "must_lose": ["task1_3_saved_per_layer_visible", "task1_3_saved_per_layer_hidden"],
                                  "must_keep": ["task1_4_category_breakdown_hidden"]},
    "estimate_without_optimizer_state": {"replace": {"task1_5_estimate_peak": _ESTIMATE_NO_STATE},
                                         "must_lose": ["task1_5_estimate_peak_visible", "task1_5_estimate_peak_hidden"],
                                         "must_keep": ["task1_1_live_bytes_hidden"]},
    "live_bytes_first_output_only": {"replace": {"task1_1_live_bytes": _LIVE_BYTES_FIRST_OUTPUT},
                                     "must_lose": ["task1_1_live_bytes_visible", "task1_1_live_bytes_hidden"],
                                     "must_keep": ["task1_2_profile_phases_visible"]},
    "saved_hooks_left_on_model": {"replace": {"task1_3_saved_per_layer": _SAVED_HOOKS_LEFT},
                                  "must_lose": ["task1_3_saved_per_layer_visible", "task1_3_saved_per_layer_hidden"],
                                  "must_keep": ["task1_4_category_breakdown_visible"]},
    "estimate_state_only_in_step": {"replace": {"task1_5_estimate_peak": _ESTIMATE_STATE_ONLY_IN_STEP},
                                    "must_lose": ["task1_5_estimate_peak_hidden"],
                                    "must_keep": ["task1_5_estimate_peak_visible"]},
    "estimate_no_state_at_first_step": {"replace": {"task1_5_estimate_peak": _ESTIMATE_NO_STATE_AT_FIRST_STEP},
                                        "must_lose": ["task1_5_estimate_peak_hidden"],
                                        "must_keep": ["task1_5_estimate_peak_visible"]},
    "estimate_no_late_backward": {"replace": {"task1_5_estimate_peak": _ESTIMATE_NO_LATE_BACKWARD},
                                  "must_lose": ["task1_5_estimate_peak_hidden"],
                                  "must_keep": ["task1_5_estimate_peak_visible"]},
    "estimate_state_at_first_step": {"replace": {"task1_5_estimate_peak": _ESTIMATE_STATE_AT_FIRST_STEP},
                                     "must_lose": ["task1_5_estimate_peak_hidden"],
                                     "must_keep": ["task1_5_estimate_peak_visible"]},
}
