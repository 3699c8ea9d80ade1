"""Exercise 08's runs, in the learner's process: the learner's train_step on a tiny twin (what the optimizer saw
at every step, which rows of the batch each embedding call saw, which layers were replayed inside the backward),
state_bytes on plain arguments, and plan_for with a measuring function. memlab.fit's machinery is kept out of the
learner's own calls: the public names raise, and a profile hook records any call into memlab/fitting (but for
reading a model's config) that does not come from the `measure` handed to plan_for. Plain data out."""

from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch

import memlab
from memlab.kit.ex08 import build_tiny, decoder_layers, fit_options, one_thread, plan_error, tiny_batch

from .inputs import TINY_STEPS, norm, project

FIT_NAMES = ("fit", "fit_search", "fit_max")
OFF_LIMITS = ("memlab.fit and its machinery (memlab/fitting) are off limits inside exercise 08's functions: count "
              "the bytes yourself (task 8.2) and measure with the `measure` you are handed (task 8.3)")


# ----------------------------------------------------------------------------- learner-side helpers
@contextlib.contextmanager
def _no_fit_tool():
    """memlab.fit / memlab.fit_search answer this exercise: their public names raise while the learner's code runs
    (a clear message at once; `_fit_off_limits` is what enforces it)."""
    homes = [memlab, sys.modules.get("memlab.fitting"), sys.modules.get("memlab.fitting.plan"),
             sys.modules.get("memlab.fitting.search"), sys.modules.get("memlab.fitting.limits")]
    saved = [(m, n, getattr(m, n)) for m in homes if m is not None for n in FIT_NAMES if hasattr(m, n)]

    def refuse(*a, **k):
        raise RuntimeError(OFF_LIMITS)
    for m, n, _ in saved:
        setattr(m, n, refuse)
    try:
        yield
    finally:
        for m, n, v in saved:
            setattr(m, n, v)


def _safe(fn, *a):
    try:
        return fn(*a)
    except Exception as e:  # noqa: BLE001 - the judge teaches
        return {"raised": f"{type(e).__name__}: {str(e)[:500]}"}


# ----------------------------------------------------------------------------- memlab.fit's machinery, off limits
_FITTING = os.sep + os.path.join("memlab", "fitting") + os.sep
_CONFIG = os.path.join("memlab", "fitting", "config.py")        # load_config: reading a model's shapes is the task's


def _hook_setters() -> set:
    """The functions that replace or remove a profile or trace hook (a learner's call of one is tampering)."""
    out = {sys.setprofile, sys.settrace, threading.setprofile, threading.settrace}
    for name in ("setprofile_all_threads", "settrace_all_threads"):
        if hasattr(threading, name):
            out.add(getattr(threading, name))
    mon = getattr(sys, "monitoring", None)
    for name in ("use_tool_id", "free_tool_id", "set_events", "set_local_events", "register_callback"):
        if mon is not None and hasattr(mon, name):
            out.add(getattr(mon, name))
    return out


def _memlab_functions() -> dict:
    """(module, name) -> id of every function and class memlab's modules hold: what measure's run resolves (the
    public fit names, which _no_fit_tool replaces while the learner's code runs, left out)."""
    return {(m, k): id(v) for m, mod in list(sys.modules.items()) if mod is not None and (m == "memlab" or
            m.startswith("memlab.")) for k, v in list(vars(mod).items()) if callable(v) and k not in FIT_NAMES}


def _replaced(reference: dict) -> list[str]:
    now = _memlab_functions()
    return sorted(f"{m}.{k}" for (m, k), v in reference.items() if (m, k) in now and now[(m, k)] != v)


# memlab as the check found it, before any learner's cell ran (the harness and the notebook's setup cell import the
# check first; importing memlab loads all of memlab/fitting): what measure runs must still be this code
_AT_IMPORT = _memlab_functions()
_FIT_CODE = sys.modules["memlab.fitting.plan"].fit.__code__


class _FitGuard:
    """While the learner's function runs: a profile hook that records every call into memlab/fitting (its modules'
    code; memlab/fitting/config.py, which reads a model's config, excepted) made from outside memlab/fitting, and
    every call that replaces a profile or trace hook. `measure(problem)` gives the one way in: memlab.fit for a
    plan of the problem, run with the hook paused (it doubles memlab.fit's time) and refused if memlab's functions
    were replaced meanwhile (so no code of the learner's runs inside it). All work is in this thread: the grader
    refuses threads and processes while a check runs."""

    def __init__(self):
        self.hits: list[str] = []
        self.tamper: list[str] = []
        self.setters = _hook_setters()
        import memlab.fitting.plan as plan_module
        self._fit = plan_module.fit            # held only inside this guard: calling it elsewhere is a hit
        self._profile = self._make_profile()

    def _make_profile(self):
        hits, tamper, setters, guard = self.hits, self.tamper, self.setters, self

        def own(frame) -> bool:
            """The guard's own hook switch: its watch block, or a measure of this guard, in this very frame."""
            me = frame.f_locals.get("self")
            return (frame.f_code is _WATCHING_CODE and me is guard) or \
                (frame.f_code is _MEASURE_CODE and isinstance(me, _GuardedMeasure) and me._guard is guard)

        def profile(frame, event, arg):
            if event == "call":
                f = frame.f_code.co_filename
                if _FITTING in f and not f.endswith(_CONFIG) and frame.f_code.co_name != "<module>":
                    caller = frame.f_back
                    if caller is None or _FITTING not in caller.f_code.co_filename:
                        hits.append(f"{os.path.basename(f)}:{frame.f_code.co_name}")
            elif event == "c_call" and arg in setters and not own(frame):
                tamper.append(getattr(arg, "__qualname__", str(arg)))
        return profile

    def measure(self, problem):
        return _GuardedMeasure(self, dict(problem))

    @contextlib.contextmanager
    def watching(self):
        self.before = _memlab_functions()
        previous = sys.getprofile()
        sys.setprofile(self._profile)
        try:
            yield self
        finally:
            now = sys.getprofile()
            sys.setprofile(previous)
            if now is not self._profile:
                self.tamper.append("the profile hook was replaced")
            changed = _replaced(self.before)
            if changed:
                self.tamper.append(f"memlab's functions replaced ({', '.join(changed[:3])})")

    def verdict(self, who: str) -> str | None:
        """None, or why the learner's call broke the rule (a teaching message)."""
        if self.tamper:
            return (f"{who} switched off how the check watches it ({'; '.join(sorted(set(self.tamper))[:3])}): "
                    f"leave profile hooks and memlab's functions as they are")
        if self.hits:
            return f"{who} called {sorted(set(self.hits))[:3]}: {OFF_LIMITS}"
        return None


_WATCHING_CODE = _FitGuard.watching.__wrapped__.__code__


class _GuardedMeasure:
    """measure(plan) -> {"peak": bytes, "fits": bool}: memlab.fit's steady-state peak and verdict for a plan of the
    problem (the headroom included)."""

    def __init__(self, guard: _FitGuard, problem: dict):
        self._guard, self._problem = guard, problem

    def __call__(self, plan, *, _replaced=_replaced, _at_import=_AT_IMPORT, _fit_code=_FIT_CODE,
                 _setprofile=sys.setprofile, _getprofile=sys.getprofile):
        # the helpers bound when the check was imported: a learner's module-level swap does not reach them
        guard = self._guard
        options = fit_options(self._problem, plan)          # ValueError for an invalid plan, as memlab.fit's
        changed = sorted(set(_replaced(guard.before)) | set(_replaced(_at_import)))
        changed += [] if guard._fit.__code__ is _fit_code else ["memlab.fitting.plan.fit"]
        if changed:
            raise RuntimeError(f"measure refuses to run: memlab's functions were replaced ({', '.join(changed[:3])})")
        hook = _getprofile()
        _setprofile(None)
        try:
            r = guard._fit(self._problem["model"], self._problem["gpu"], **options)
        finally:
            _setprofile(hook)
        return {"peak": int(r.peak), "fits": bool(r.fits)}

    def __repr__(self) -> str:
        return "measure(plan) -> {'peak': bytes, 'fits': bool}"


_MEASURE_CODE = _GuardedMeasure.__call__.__code__


# ----------------------------------------------------------------------------- task8_1
def _in_backward() -> bool:
    """True while autograd's engine runs a backward pass in this thread (where a checkpoint replays a layer)."""
    return torch._C._current_graph_task_id() != -1


class _Watch:
    """What the embedding and each decoder layer's input norm are handed during one train_step: forward pre-hooks
    that record each call's rows, grad mode and whether autograd's backward is running. Only what cannot be pumped
    from outside the step counts: an embedding call counts as a forward pass when it runs with grad enabled outside
    the backward, each of its rows matched to the batch row it is (-1: not a row of the batch); a norm call counts
    as a recomputation when it runs inside the backward with grad enabled (a checkpoint replaying the layer).
    Every other call (under no_grad, a norm outside the backward, a malformed input) counts for nothing and is only
    tallied."""

    def __init__(self, model):
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        # each layer's first module (its input norm): transformers checkpoints a layer's class forward, and a
        # non-reentrant checkpoint stops replaying once it has what it needs, so only a pre-hook on the layer's
        # first module sees every replay
        norms = [layer.input_layernorm for layer in decoder_layers(model)]
        self.handles = [base.model.embed_tokens.register_forward_pre_hook(self._embed, with_kwargs=True)]
        self.handles += [n.register_forward_pre_hook(self._norm(i), with_kwargs=True) for i, n in enumerate(norms)]
        self.layers = len(norms)
        self.start(None)

    def start(self, x):
        self.x = x
        self.embed, self.recompute, self.ignored = [], [[] for _ in range(self.layers)], 0

    @staticmethod
    def _first(args, kwargs):
        t = args[0] if args else next(iter(kwargs.values()), None)
        return t if isinstance(t, torch.Tensor) else None

    def _embed(self, module, args, kwargs):
        ids, x = self._first(args, kwargs), self.x
        if x is None or ids is None or ids.dim() != 2 or not torch.is_grad_enabled() or _in_backward():
            self.ignored += 1
            return
        with torch.no_grad():
            if ids.shape[1] != x.shape[1] or ids.dtype != x.dtype:
                rows = [-1] * ids.shape[0]
            else:
                same = (ids.detach().to(x.device)[:, None, :] == x[None, :, :]).all(-1)     # (b, B)
                rows = [int(r.nonzero()[0, 0]) if bool(r.any()) else -1 for r in same]
        self.embed.append(rows)

    def _norm(self, i):
        def hook(module, args, kwargs):
            h = self._first(args, kwargs)
            if self.x is None or h is None or h.dim() < 2 or not (torch.is_grad_enabled() and _in_backward()):
                self.ignored += 1
                return
            self.recompute[i].append(int(h.shape[0]))
        return hook

    def seen(self) -> dict:
        return {"embed": self.embed, "recompute": self.recompute, "ignored": self.ignored}

    def remove(self):
        for h in self.handles:
            h.remove()


def _tiny_run(problem, plan, train_step, seed, data_seed, steps=TINY_STEPS):
    """Run the learner's train_step `steps` times on the tiny twin; plain data of what the optimizer saw and of
    what the embedding and the layers were handed."""
    model, opt = build_tiny(problem, plan, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    index = {id(p): i for i, p in enumerate(params)}
    seen = []

    def pre_step(o, args, kwargs):
        grads = {index[id(p)]: None if p.grad is None else p.grad.detach().float().clone()   # copies: what the
                 for g in o.param_groups for p in g["params"] if id(p) in index}              # step sees
        seen.append({"missing": [i for i in range(len(params)) if grads.get(i) is None],
                     "unknown": sum(1 for g in o.param_groups for p in g["params"] if id(p) not in index),
                     "grads": [grads.get(i) for i in range(len(params))]})
    opt.register_step_pre_hook(pre_step)
    gen = torch.Generator().manual_seed(data_seed)
    watch = _Watch(model)
    calls = []
    try:
        for _ in range(steps):
            x, y = tiny_batch(problem, gen)
            before = len(seen)
            watch.start(x)
            train_step(model, opt, x.clone(), y.clone(), dict(plan))
            calls.append({"steps": len(seen) - before, **watch.seen()})
            watch.start(None)
    finally:
        watch.remove()
    return {"calls": calls,
            "steps": [{"missing": s["missing"], "unknown": s["unknown"],
                       "proj": project([g if g is not None else torch.zeros_like(p, dtype=torch.float32)
                                        for g, p in zip(s["grads"], params)], 1),
                       "norm": norm([g for g in s["grads"] if g is not None])} for s in seen],
            "final": [p.detach().double().flatten().tolist() for p in params]}


def _memory_run(problem, plan, train_step, seed, data_seed, size="small"):
    """The learner's step twice on a twin of `size`; the second step's peak (live bytes on the CPU, exact: memlab's
    tracker), when the optimizer's state is alive through forward and backward."""
    model, opt = build_tiny(problem, plan, seed, size)
    gen = torch.Generator().manual_seed(data_seed)
    train_step(model, opt, *tiny_batch(problem, gen, size), dict(plan))          # creates the optimizer state
    x, y = tiny_batch(problem, gen, size)
    with memlab.MemoryTracker(model, opt, device="cpu") as trk:
        train_step(model, opt, x, y, dict(plan))
        end = int(trk.current)                  # what stays alive into the next step's forward
    return {"peak": int(trk.peak), "end": end}


def train_step_run(case, train_step):
    with _no_fit_tool(), one_thread():
        if case["part"] == "tiny":
            return _safe(_tiny_run, case["problem"], case["plan"], train_step, case["seed"], case["data_seed"])
        return _safe(_memory_run, case["problem"], case["plan"], train_step, case["seed"], case["data_seed"],
                     case.get("size", "small"))


# ----------------------------------------------------------------------------- task8_2
def state_run(case, state_bytes):
    out = []
    guard = _FitGuard()
    with _no_fit_tool(), guard.watching():
        for plan in case["plans"]:
            got = _safe(state_bytes, dict(case["problem"]), dict(plan))
            if type(got) is dict and "raised" not in got:
                got = {k: (v if type(v) is int else repr(v)[:60]) for k, v in got.items() if type(k) is str}
            out.append(got if type(got) is dict else {"returned": type(got).__name__})
    why = guard.verdict("state_bytes")
    return [{"forbidden": why} for _ in out] if why else out


# ----------------------------------------------------------------------------- task8_3
_PLANS: dict = {}


def plan_run(case, plan_for):
    problem = case["problem"]
    key = (id(plan_for), tuple(sorted(problem.items())))
    if key not in _PLANS:
        guard = _FitGuard()
        measure = guard.measure(problem)
        with _no_fit_tool(), guard.watching():
            plan = _safe(plan_for, dict(problem), measure)
        why = guard.verdict("plan_for")
        if why:
            out = {"forbidden": why}
        elif type(plan) is not dict:
            out = {"invalid": f"plan_for must return a dict, got {type(plan).__name__}"}
        elif "raised" in plan:
            out = {"raised": plan["raised"]}
        elif plan_error(plan, problem, dividing=True):
            out = {"invalid": plan_error(plan, problem, dividing=True)}
        else:
            out = {"plan": plan}
        _PLANS[key] = out
    return _PLANS[key]
