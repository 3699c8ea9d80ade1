"""Exercise 04, tasks 4.5 and 4.6: the two instruments.

- task4_5_find_max_batch_size: `run` hands the learner's search a step on a virtual GPU and counts its
  probes; `judge` finds the answer without a binary search: a brute-force scan of the step's exact
  byte formula (a fixed buffer plus a per-sample buffer, each rounded up to 512 bytes as the virtual GPU
  rounds), or, for a real training step, the peaks at batch 16 and 32 extrapolated and then walked to the
  boundary, and confirms the boundary with the virtual GPU itself. GPU capacities are read from memlab's
  presets at judge time.
- task4_6_leak_detector: `run` builds a step that leaks in a known way (or not) and calls the learner's
  detector; `judge` rebuilds the same step and measures it with memlab.MemoryTracker.
"""

from __future__ import annotations

import math

import torch

import memlab

from .common import Task, mb

_ROUND = 512   # the virtual GPU rounds every storage up to 512 bytes, as the CUDA caching allocator does


def _round(n: int) -> int:
    return -(-n // _ROUND) * _ROUND


def _gpu(case) -> memlab.VirtualGPU:
    return memlab.VirtualGPU(case["gpu"]) if case.get("gpu") else memlab.VirtualGPU(capacity_gb=case["capacity_gb"])


def _staircase(fixed_bytes: int, per_sample: int):
    """A step whose memory is known exactly: a fixed buffer plus per_sample bytes per batch element."""
    def step(batch):
        state = torch.empty(fixed_bytes, dtype=torch.uint8)               # like model states
        acts = torch.empty(per_sample * batch, dtype=torch.uint8)         # like activations
        return state, acts
    return step


def _sequence_mlp_step(width):
    """One AdamW step of a 2-layer MLP over (batch, 1024, width) activations: cheap on fake tensors."""
    def step(batch):
        model = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                    torch.nn.Linear(4 * width, width))
        opt = torch.optim.AdamW(model.parameters(), foreach=True)
        memlab.watch(model, opt)
        x = torch.randn(batch, 1024, width)
        with memlab.phase("forward"):
            loss = model(x).pow(2).mean()
        with memlab.phase("backward"):
            loss.backward()
        with memlab.phase("step"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    return step


def _step(case):
    return _staircase(case["fixed"], case["per"]) if case["kind"] == "staircase" else _sequence_mlp_step(case["width"])


def _stair(r, gpu, target, limit):
    """A staircase whose answer is exactly `target`: room for target samples, not for target + 1."""
    cap = _gpu(gpu).capacity                                              # the preset as memlab defines it now
    per = _ROUND * r.randint(2, max(2, min(cap // ((target + 1) * _ROUND), 2**21)))
    slack = _ROUND * r.randrange(0, per // _ROUND - 1)                    # < per - 512
    fixed_r = (cap - per * target - slack) // _ROUND * _ROUND             # room in [per*target, per*(target+1))
    fixed = max(0, fixed_r - r.randrange(_ROUND))                         # rounds up to fixed_r
    return {**gpu, "kind": "staircase", "fixed": fixed, "per": per, "limit": limit}


def max_batch_cases(hidden, r):
    if not hidden:
        t4 = memlab.VirtualGPU("T4-16GB").capacity
        return [{"gpu": "T4-16GB", "kind": "staircase", "fixed": 6 * 2**30, "per": 300 * 2**20, "limit": 4096},
                {"gpu": "T4-16GB", "kind": "staircase", "fixed": t4 + 2**20, "per": 2**20, "limit": 4096},
                {"gpu": "T4-16GB", "kind": "mlp", "width": 1024, "limit": 4096}]
    gpus = [{"gpu": "T4-16GB"}, {"gpu": "L4-24GB"}, {"capacity_gb": r.choice([4, 8, 12])},
            {"capacity_gb": r.choice([6.5, 40])}, {"gpu": "A100-40GB"}, {"capacity_gb": 16}]
    r.shuffle(gpus)
    k = r.randint(2, 8)
    cases = [_stair(r, gpus[0], 1, r.choice([256, 1000])),                # only batch 1 fits
             _stair(r, gpus[1], 2 ** k, 4096),                            # a power of two
             _stair(r, gpus[2], 2 ** r.randint(2, 8) - 1, 5000),           # one below one
             _stair(r, gpus[3], 2 ** r.randint(2, 8) + 1, 1000),           # one above one
             _stair(r, gpus[4], r.randint(3, 999), 1000),                  # anywhere, limit not a power of two
             _stair(r, gpus[5], 999, 1000)]                                # limit - 1
    cap = memlab.VirtualGPU(capacity_gb=8).capacity
    cases.append({"capacity_gb": 8, "kind": "staircase", "fixed": cap + r.randrange(1, 10**6), "per": 1000,
                  "limit": 4096})                                          # nothing fits
    for limit in (1000, 4096):                                            # everything up to the limit fits
        cases.append({"capacity_gb": r.choice([8, 16]), "kind": "staircase", "fixed": r.randrange(0, 10**6),
                      "per": r.randrange(1, 10**4), "limit": limit})
    return cases


def max_batch_run(case, find_max_batch_size):
    gpu, step, calls = _gpu(case), _step(case), []

    def counted(batch, *args, **kwargs):
        calls.append(batch if type(batch) is int else repr(batch)[:40])
        return step(batch, *args, **kwargs)

    try:
        got = find_max_batch_size(counted, gpu, limit=case["limit"])
    except torch.OutOfMemoryError as e:
        return {"oom_escaped": str(e).splitlines()[0][:300], "calls": calls[:200]}
    return {"got": got if type(got) is int else f"a {type(got).__name__}: {str(got)[:40]}", "calls": calls[:200],
            "n_calls": len(calls)}


def reference_max_batch(case) -> int:
    """The largest batch in [1, limit] that fits, found without bisection, confirmed by the virtual GPU."""
    gpu, limit = _gpu(case), case["limit"]
    fits = lambda b: gpu.fits(_step(case), b)  # noqa: E731
    if case["kind"] == "staircase":           # brute force over the exact byte formula
        room = gpu.capacity - _round(case["fixed"])
        want = 0
        for b in range(1, limit + 1):
            if _round(case["per"] * b) > room:
                break
            want = b
    else:                                     # peaks are affine in the batch: extrapolate, then walk to the edge
        lo, hi = 16, 32                       # past the small batches, where the optimizer's scratch dominates
        p1, p2 = gpu.run(_step(case), lo, catch_oom=True).peak, gpu.run(_step(case), hi, catch_oom=True).peak
        slope = max((p2 - p1) // (hi - lo), 1)
        want = max(0, min(limit, lo + (gpu.capacity - p1) // slope))
        while want < limit and fits(want + 1):
            want += 1
        while want > 0 and not fits(want):
            want -= 1
    if (want > 0 and not fits(want)) or (want < limit and fits(want + 1)):
        raise RuntimeError(f"internal check error: the reference answer {want} disagrees with the virtual GPU")
    return want


def _desc(case, gpu):
    if case["kind"] == "staircase":
        return (f"a step needing {mb(case['fixed'])} + batch x {mb(case['per'])} on a {mb(gpu.capacity)} virtual "
                f"GPU, limit={case['limit']}")
    return (f"one AdamW step of a width-{case['width']} MLP over (batch, 1024, {case['width']}) inputs on the "
            f"{case['gpu']}, limit={case['limit']}")


def max_batch_judge(case, got):
    gpu, limit = _gpu(case), case["limit"]
    desc = _desc(case, gpu)
    if "oom_escaped" in got:
        raise AssertionError(f"find_max_batch_size let a torch.OutOfMemoryError escape ({desc}): probe with "
                             f"gpu.fits(step_fn, b) or catch the error — an OOM is an answer, not a crash. "
                             f"({got['oom_escaped']})")
    value = got["got"]
    if type(value) is not int:
        raise AssertionError(f"find_max_batch_size must return a Python int, got {value}")
    bad = [b for b in got["calls"] if type(b) is not int or not 1 <= b <= limit]
    assert not bad, f"probe batch sizes must be ints in [1, limit={limit}]; you tried {bad[:5]} ({desc})"
    want = reference_max_batch(case)
    if value != want:
        if value == want + 1:
            hint = (f"one too large: batch {value} does not fit (it raises out-of-memory). When bisecting, return "
                    f"the largest batch you have SEEN fit (lo), not the first one that failed (hi).")
        elif value == want - 1:
            hint = f"one too small: batch {want} fits. Check the end of your search: probe until hi - lo == 1."
        elif want == 0:
            hint = "even batch 1 does not fit here: return 0."
        elif want == limit:
            hint = (f"every batch up to limit={limit} fits: return limit (doubling may jump past a limit that is "
                    f"not a power of two: probe the limit itself).")
        else:
            hint = "search by doubling until a batch fails, then bisect between the last fit and the first failure."
        raise AssertionError(f"{desc}: the largest batch that fits is {want}, you returned {value}: {hint}")
    budget = 2 * math.ceil(math.log2(limit)) + 3
    assert got["n_calls"] <= budget, (
        f"{desc}: you found {value} but ran {got['n_calls']} probe steps; a binary search needs at most about "
        f"2*log2(limit) = {budget} (double until it fails, then bisect). Each probe is a full training step.")


# ----------------------------------------------------------------------------- task4_6
_WHAT = {"outputs": "the step keeps its outputs in a list", "grads": "the step keeps every step's gradients",
         "inputs": "the step keeps its input batches", "eval": "an evaluation with autograd on keeps its loss",
         "hook": "a forward hook keeps a block's output", "none_adam": "no leak (AdamW creates its state in step 1)",
         "none_sgd": "no leak (SGD creates its momentum in step 1)"}


def leak_scenario(case):
    """A fresh (step_fn, model, optimizer) whose training step leaks (or not) in a known way."""
    kind, batch, width, d_in, seed = case["kind"], case["batch"], case["width"], case["d_in"], case["seed"]
    torch.manual_seed(seed)
    d_out = 10
    model = memlab.MLP(d_in, width, 2, d_out)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9) if kind == "none_sgd" else \
        torch.optim.AdamW(model.parameters(), lr=1e-3)
    kept = []
    g = torch.Generator().manual_seed(seed)
    xv, yv = torch.randn(batch, d_in, generator=g), torch.randint(0, d_out, (batch,), generator=g)
    if kind == "hook":
        model.layers[1].register_forward_hook(lambda mod, inp, out: kept.append(out))   # (B, width) per step

    def step():
        x, y = torch.randn(batch, d_in, generator=g), torch.randint(0, d_out, (batch,), generator=g)
        with memlab.phase("forward"):
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out, y)
        with memlab.phase("backward"):
            loss.backward()
        if kind == "grads":
            kept.append([p.grad for p in model.parameters()])             # keeps every step's gradients
        with memlab.phase("step"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        if kind == "outputs":
            kept.append(out)                                              # keeps a (B, d_out) output per step
        elif kind == "inputs":
            kept.append(x)                                                # keeps each input batch
        elif kind == "eval":
            with memlab.phase("forward"):                                 # evaluation with autograd on
                kept.append(model(xv, yv))

    return step, model, opt


def leak_cases(hidden, r):
    if not hidden:
        return [{"kind": k, "batch": 16, "width": 64, "d_in": 32, "seed": s, "n_steps": 5}
                for k, s in (("outputs", 1), ("none_adam", 2))]
    kinds = ["outputs", "grads", "inputs", "eval", "hook", "none_adam", "none_sgd"]   # every leak, both traps
    r.shuffle(kinds)
    steps = [3] + [r.randint(3, 5) for _ in kinds[1:]]                   # the shortest run included
    return [{"kind": k, "batch": r.randint(2, 64), "width": r.randint(8, 128), "d_in": r.randint(4, 64),
             "seed": r.randrange(2**31), "n_steps": n} for k, n in zip(kinds, steps)]


def leak_run(case, detect_leak):
    got = detect_leak(*leak_scenario(case), n_steps=case["n_steps"])
    if got is None:
        return {"none": True}
    if type(got) is not tuple or len(got) != 2:
        return {"shape": f"{type(got).__name__}: {str(got)[:60]}"}
    cat, per = got
    return {"category": cat if type(cat) is str else f"a {type(cat).__name__}",
            "per_step": float(per) if type(per) in (int, float) else f"a {type(per).__name__}"}


def reference_leak(case):
    """(category, bytes per step) measured with memlab.MemoryTracker, or None: the growth of each category
    between consecutive steps after the first, required positive on every one."""
    step, model, opt = leak_scenario(case)
    tracker = memlab.MemoryTracker(model, opt)
    levels = []
    with tracker:
        for _ in range(case["n_steps"]):
            step()
            levels.append(tracker.breakdown())
    growing = {}
    for c in memlab.CATEGORIES:
        deltas = [b[c] - a[c] for a, b in zip(levels, levels[1:])]
        if deltas and min(deltas) > 0:
            growing[c] = sum(deltas) / len(deltas)
    if not growing:
        return None
    c = max(growing, key=growing.get)
    return c, growing[c]


def leak_judge(case, got):
    want = reference_leak(case)
    desc = f"{_WHAT[case['kind']]}, batch {case['batch']}, width {case['width']}, {case['n_steps']} steps"
    if want is None:
        assert got.get("none"), (
            f"{desc}: nothing grows from step to step, but you reported {got}. The optimizer state (or momentum) "
            f"appears once, inside the first step: compare only steps after the first, and require growth on every "
            f"one of them.")
        return
    if got.get("none") or "shape" in got:
        raise AssertionError(f"{desc}: {want[0]} grows by {want[1]:.0f} bytes every step; you returned "
                             f"{got.get('shape', 'None')} (expected a tuple (category, bytes_per_step))")
    assert got["category"] == want[0], (
        f"{desc}: the category that grows every step is {want[0]!r} (+{want[1]:.0f} B per step); you reported "
        f"{got['category']!r}. Read tracker.breakdown() after each step inside ONE tracker and compare consecutive "
        f"steps.")
    per = got["per_step"]
    if type(per) is not float or not math.isfinite(per):
        raise AssertionError(f"{desc}: bytes_per_step must be a number, got {per}")
    assert abs(per - want[1]) <= max(16, 0.01 * want[1]), (
        f"{desc}: {want[0]} grows by {want[1]:.0f} bytes per step; you reported {per:g}. Average the growth over the "
        f"steps after the first: (after last step - after first step) / (n_steps - 1).")


MAX_BATCH_TASK = Task("task4_5_find_max_batch_size", ("find_max_batch_size",), max_batch_cases, max_batch_run,
                      max_batch_judge)
LEAK_TASK = Task("task4_6_leak_detector", ("detect_leak",), leak_cases, leak_run, leak_judge)
