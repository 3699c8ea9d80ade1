"""The contract every exercise check follows, and helpers shared by the checks.

A task is checked in three parts (see `Task`):

- `cases(hidden, rng)` draws the inputs as plain data (ints, floats, strings,
  lists, dicts). Visible cases use a fixed seed; hidden cases draw fresh
  randomness every run and must cover every branch of the task's spec in every
  run (each option, edge sizes, first step and steady state).
- `run(case, **learner_names)` builds the inputs from the case, calls the
  learner's code and returns what it observed as plain data. In class grading it
  runs in the learner's sandboxed process (autograder/harness.py), so it decides
  nothing.
- `judge(case, got)` runs in the trusted grader: it computes its own reference
  (a naive or library implementation, never the solution), checks exact types,
  and raises AssertionError with a teaching message when `got` is wrong.

In the notebook, `check(task, hidden=False, **names)` does all three in the
learner's kernel for instant feedback; `memlab-grade` does the same with `run` in
a sandbox and `judge` outside it, so both give the same verdicts.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

import memlab

MAX_VALUE_CHARS = 4_000_000      # a probe's JSON result larger than this is refused


class TrustedPart:
    """A function of an exercise's trusted side (`cases.py`, `judge.py`), named by its module and attribute and
    imported on first call. The learner's sandbox holds no trusted file (trusted.stage_course_code copies only the
    learner side), so there the call fails with ModuleNotFoundError, while the grader and a learner's own kernel
    (the notebook's test cells) import it from the course."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args, **kwargs):
        import importlib
        return getattr(importlib.import_module(self.module), self.name)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


@dataclass(frozen=True)
class Task:
    """One graded task. `cases` and `judge` belong to the trusted side: give them as the name of a function in the
    exercise's `cases.py` / `judge.py` (imported only when called, so the learner side imports none of them) or as a
    callable. `run` is the learner side (run.py). `spawns`: the check's own run starts processes (ranks), which
    the grader then allows while it runs; any other case in which a thread or a process is started fails."""
    id: str                                            # "task3_1_loss_scaler": the TODO comment and grade_id prefix
    names: tuple[str, ...]                             # what the learner's notebook defines for this task
    cases: Callable[[bool, random.Random], list]       # (hidden, rng) -> [case, ...], each plain data   (trusted)
    run: Callable[..., Any]                            # (case, **learner_names) -> plain data   (learner's process)
    judge: Callable[[Any, Any], None]                  # (case, got) -> None, or raise AssertionError (trusted)
    spawns: bool = False

    def __post_init__(self):
        package = getattr(self.run, "__module__", "").rpartition(".")[0]
        for role in ("cases", "judge"):
            v = getattr(self, role)
            if isinstance(v, str):
                object.__setattr__(self, role, TrustedPart(f"{package}.{role}", v))


def tasks(*ts: Task) -> dict[str, Task]:
    out = {}
    for t in ts:
        if t.id in out:
            raise ValueError(f"two tasks share the id {t.id!r}")
        out[t.id] = t
    return out


def _plain(x, path="result"):
    """x, checked to be plain data of exact built-in types (no subclasses, no tensors)."""
    t = type(x)
    if x is None or t in (bool, int, str):
        return x
    if t is float:
        return x
    if t in (list, tuple):
        return [_plain(v, f"{path}[{i}]") for i, v in enumerate(x)]
    if t is dict:
        for k in x:
            if type(k) is not str:
                raise TypeError(f"{path} has a key {k!r} of type {type(k).__name__}; keys must be str")
        return {k: _plain(v, f"{path}[{k!r}]") for k, v in x.items()}
    raise TypeError(f"{path} is a {t.__module__}.{t.__qualname__}, not plain data (int, float, str, bool, None, "
                    f"list, dict); convert tensors with .tolist() or .item()")


def encode(x) -> str:
    """Plain data as JSON text, refusing anything else (what crosses the sandbox)."""
    text = json.dumps(_plain(x), allow_nan=True)
    if len(text) > MAX_VALUE_CHARS:
        raise ValueError(f"the result is {len(text)} characters of JSON, more than the {MAX_VALUE_CHARS} allowed")
    return text


def decode(text: str):
    return json.loads(text)


def check(task: Task, *, hidden: bool = False, r: random.Random | None = None, **names) -> int:
    """Run a task's cases in this process: the notebook's instant feedback. Returns the number of cases.
    r: where the cases are drawn from (default: `rng(hidden)`, a fresh seed for hidden cases)."""
    cases = task.cases(hidden, r or rng(hidden))
    for case in cases:
        try:
            task.judge(case, decode(encode(task.run(case, **names))))
        except AssertionError as e:
            raise AssertionError(hide(str(e)) if hidden else reveal(str(e))) from None
    return len(cases)


# ----------------------------------------------------------------------------- expected values in messages
# A judge marks each expected value it states with expected(...); who sees it is decided where the message is
# shown: a visible check reveals it, a hidden check's message gets [hidden] in its place (the trusted grader does
# the same), so hidden feedback never carries the reference's answer, whatever the wording around it.
_MARK = re.compile("\u27e6(.*?)\u27e7", re.S)


def expected(value) -> str:
    """`value` marked as the expected one in a judge's message (str(value) between markers)."""
    return f"\u27e6{value}\u27e7"


def reveal(message: str) -> str:
    """A message as a visible check shows it: the expected values, without their markers."""
    return _MARK.sub(lambda m: m[1], message)


def hide(message: str) -> str:
    """A message as a hidden check shows it: each marked expected value replaced by [hidden]."""
    return _MARK.sub("[hidden]", message)


# ----------------------------------------------------------------------------- judging helpers
def expect_type(name: str, value, kind: type):
    """value must be exactly of type kind (bool is not an int here)."""
    if type(value) is not kind:
        raise AssertionError(f"{name} must be a {kind.__name__}, got {type(value).__name__}: {str(value)[:80]}")
    return value


def allclose(name: str, got, want, rtol: float = 1e-5, atol: float = 1e-6, hint: str = "") -> None:
    """Nested lists of floats compared elementwise in float64, with a message naming the worst entry and what the
    learner's result holds there - never the expected value (hidden cases must not leak the reference) - followed
    by `hint` when the values differ."""
    g = torch.tensor(got, dtype=torch.float64) if not isinstance(got, torch.Tensor) else got.double()
    w = torch.tensor(want, dtype=torch.float64) if not isinstance(want, torch.Tensor) else want.double()
    if g.shape != w.shape:
        raise AssertionError(f"{name} has shape {tuple(g.shape)}, expected {tuple(w.shape)}")
    bad = ~torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        nan = int(torch.isnan(g).sum())
        raise AssertionError(f"{name} differs from the reference at flat index {i} (got {g.flatten()[i].item():.6g}; "
                             f"{int(bad.sum())} of {bad.numel()} entries off"
                             + (f", {nan} of them NaN" if nan else "") + ")" + hint)


def rng(hidden: bool, fixed_seed: int = 0) -> random.Random:
    """Visible checks use a fixed seed (reproducible feedback); hidden checks
    draw a fresh seed every run, so numbers copied from one run do not pass."""
    return random.Random(int.from_bytes(os.urandom(8), "little") if hidden else fixed_seed)


def torch_seed(r: random.Random) -> int:
    seed = r.randrange(2**31)
    torch.manual_seed(seed)
    return seed


@contextlib.contextmanager
def forbid_memlab_tracker(task: str):
    """Inside this block, entering memlab.MemoryTracker raises: the task asks
    you to build the measurement yourself."""
    original = memlab.MemoryTracker.__enter__

    def refuse(self):
        raise AssertionError(f"{task} asks you to measure with your own code: memlab.MemoryTracker is not "
                             f"allowed inside it (use the LiveBytes mode you wrote in task1_1).")

    memlab.MemoryTracker.__enter__ = refuse
    try:
        yield
    finally:
        memlab.MemoryTracker.__enter__ = original


def memlab_files(*names: str) -> tuple[str, ...]:
    """Path endings of memlab modules, for `no_calls_into`."""
    return tuple(os.sep + os.path.join("memlab", *n.split("/")) for n in names)


@contextlib.contextmanager
def no_calls(task: str, forbidden, message: str):
    """While the learner's code runs, record every Python call for which forbidden(filename, function name) is
    true; afterwards raise AssertionError(f"{task} called [...]: {message}") if there was one."""
    hits: list[str] = []
    previous = sys.getprofile()
    replacing = (sys.setprofile, sys.settrace)
    watching = [True]

    def profile(frame, event, arg):
        if event == "call" and forbidden(frame.f_code.co_filename, frame.f_code.co_name):
            hits.append(f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}")
        elif event == "c_call" and watching[0] and arg in replacing:   # switching this hook off hides what follows
            hits.append("sys:setprofile")

    sys.setprofile(profile)
    try:
        yield
    finally:
        watching[0] = False
        if sys.getprofile() is not profile:
            hits.append("sys:setprofile")
        sys.setprofile(previous)
    if hits:     # named functions first: `file:__enter__` says more than `file:<lambda>` or `file:<setcomp>`
        shown = sorted(set(hits), key=lambda h: (h.rsplit(":", 1)[-1].startswith("<"), h))[:3]
        raise AssertionError(f"{task} called {shown}: {message}")


def no_calls_into(task: str, files: tuple[str, ...], what: str):
    """`no_calls` for path endings `files`: for tasks whose answer a lesson's helper in memlab already computes."""
    return no_calls(task, lambda filename, name: filename.endswith(files),
                    f"{what}: the lesson's helpers are off limits in this task; write the computation yourself")


def expect_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AssertionError(f"{name} must be a Python int (a byte count), got {type(value).__name__}: {value!r}. "
                             f"Hint: tensor.nbytes and storage.nbytes() are ints; .item() turns a tensor into one.")
    return value



def mb(n: float) -> str:
    return memlab.format_bytes(n)
