"""Checks for exercise 02, "Checkpointed models".

Each `check_task2_M(student, *, hidden)` raises AssertionError with a message
that says what was expected and the likely mistake. Visible checks use fixed
inputs; hidden checks draw new sizes, seeds and instances every run.

What is graded is behaviour, measured on modules this file owns:
  * gradients (and, for the GPT, trained parameters) against the unmodified model, tight tolerance;
  * how many times each block's forward ran in one forward + backward, counted
    inside forward() itself (a non-reentrant checkpoint stops its recomputation
    early, so forward hooks would miss it);
  * peak activation memory, measured with memlab's tracker
    (memlab.checkpointing.activation_peak), against the reference scheme;
  * the planner's cost against brute force over every plan, under the cost model
    stated in the notebook (`plan_peak`, `plan_cost` below).
"""

from __future__ import annotations

import itertools
import math
import signal
import threading
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memlab.checkpointing import activation_peak
from memlab.models import GPT, Block, GPTConfig

from .common import mb, rng, torch_seed

RTOL, ATOL = 1e-5, 1e-6          # gradients: checkpointing repeats the same arithmetic


# ----------------------------------------------------------------------------- modules the checks own
class CountingBlock(nn.Module):
    """x + fc2(gelu(fc1(x))) that counts how often its forward runs (recomputations included)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.fc2(F.gelu(self.fc1(x)))


class CountingGPTBlock(Block):
    """memlab's GPT Block, counting its forward calls. Installed by swapping a block's class,
    so parameter names and values do not change."""

    def forward(self, x, rope=None):
        self.calls += 1
        return super().forward(x, rope)


def _count_gpt_blocks(model: GPT) -> list[Block]:
    blocks = list(model.blocks)
    for b in blocks:
        b.__class__ = CountingGPTBlock
        b.calls = 0
    return blocks


def _stack(n, d, hidden, seed, container):
    torch.manual_seed(seed)
    blocks = [CountingBlock(d, hidden) for _ in range(n)]
    if container == "Sequential":
        return nn.Sequential(*blocks), blocks
    if container == "ModuleList":
        return nn.ModuleList(blocks), blocks
    return list(blocks), blocks


def _plain_forward(blocks, x):
    for b in blocks:
        x = b(x)
    return x


# ----------------------------------------------------------------------------- references (for bounds)
class _RefEveryK(nn.Module):
    def __init__(self, blocks, k):
        super().__init__()
        self.blocks, self.k = nn.ModuleList(blocks), k

    def forward(self, x):
        for i, b in enumerate(self.blocks):
            x = checkpoint(b, x, use_reentrant=False) if i % self.k == 0 else b(x)
        return x


def reference_segments(n: int) -> list[tuple[int, int]]:
    """ceil(sqrt(n)) contiguous segments, lengths differing by at most one (longer ones first)."""
    s = math.isqrt(n - 1) + 1
    q, r = divmod(n, s)
    out, start = [], 0
    for i in range(s):
        stop = start + q + (1 if i < r else 0)
        out.append((start, stop))
        start = stop
    return out


class _RefSegments(nn.Module):
    def __init__(self, blocks, segments):
        super().__init__()
        self.blocks, self.segments = nn.ModuleList(blocks), segments

    def _run(self, start, stop, x):
        for b in self.blocks[start:stop]:
            x = b(x)
        return x

    def forward(self, x):
        for start, stop in self.segments:
            x = checkpoint(self._run, start, stop, x, use_reentrant=False)
        return x


class _RefCheckpointedGPT(GPT):
    def forward(self, idx, targets=None):
        B, T = idx.shape
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        x = self.drop(x)
        rope = (self.rope_cos[:T], self.rope_sin[:T]) if self.cfg.pos == "rope" else None
        for block in self.blocks:
            x = checkpoint(block, x, rope, use_reentrant=False)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


# ----------------------------------------------------------------------------- shared stack checks
@contextmanager
def _learner_code(task, desc, what):
    """Turn an exception raised by the learner's code into a failed check that says what happened."""
    try:
        yield
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001 - any crash of the submission is a failed check with a message
        msg = f"{task} ({desc}): {what} raised {type(e).__name__}: {str(e)[:300]}"
        if "does not require grad" in str(e):
            msg += (". The output is cut from the autograd graph: with use_reentrant=True, a checkpoint whose "
                    "inputs do not require grad (here the input batch) returns an output that does not require "
                    "grad either. Use use_reentrant=False.")
        raise AssertionError(msg) from None


def _grads(params, x):
    out = [p.grad.clone() if p.grad is not None else None for p in params]
    return out, (x.grad.clone() if x.grad is not None else None)


def _run_step(module_or_fn, params, x, weights):
    for p in params:
        p.grad = None
    x.grad = None
    out = module_or_fn(x)
    (out * weights).sum().backward()
    g, gx = _grads(params, x)
    return out.detach(), g, gx


def _peak(module, run, x, weights):
    """Peak activation bytes of forward + backward of the loss sum(run(x) * weights)."""
    return activation_peak(module, lambda: (run(x) * weights).sum()).peak


def _check_stack_wrapper(task, wrapped, blocks, x, weights, expected_calls, bound, plain_peak, desc):
    """Outputs, gradients, forward counts and peak memory of a wrapper around `blocks`."""
    if not isinstance(wrapped, nn.Module):
        raise AssertionError(f"{task}: your wrapper must be an nn.Module (got {type(wrapped).__name__})")
    params = [p for b in blocks for p in b.parameters()]
    mine = {id(p) for p in wrapped.parameters()}
    missing = sum(id(p) not in mine for p in params)
    assert not missing, (
        f"{task} ({desc}): {missing} of the blocks' {len(params)} parameters are not parameters of your module. "
        f"Register the blocks as submodules (self.blocks = nn.ModuleList(blocks)) so that an optimizer and "
        f".to(device) see them; do not copy them.")
    ref_out, ref_g, ref_gx = _run_step(lambda t: _plain_forward(blocks, t), params, x, weights)
    for b in blocks:
        b.calls = 0
    with _learner_code(task, desc, "a forward + backward through your module"):
        out, got_g, got_gx = _run_step(wrapped, params, x, weights)
    calls = [b.calls for b in blocks]
    assert out.shape == ref_out.shape and torch.allclose(out, ref_out, rtol=RTOL, atol=ATOL), (
        f"{task} ({desc}): the output differs from running the blocks in order "
        f"(max |diff| {(out - ref_out).abs().max().item() if out.shape == ref_out.shape else 'shape ' + str(tuple(out.shape))}). "
        f"Checkpointing must not change the forward: run every block exactly once, in order, on the previous output.")
    if x.requires_grad:
        assert got_gx is not None and torch.allclose(got_gx, ref_gx, rtol=RTOL, atol=ATOL), (
            f"{task} ({desc}): the gradient of the INPUT differs from the plain model's "
            f"({'None' if got_gx is None else 'max |diff| %.2e' % (got_gx - ref_gx).abs().max().item()}). "
            f"Did you detach the checkpointed input (x.detach())? That cuts the graph: gradients stop at the "
            f"checkpoint.")
    bad = [i for i, (a, b) in enumerate(zip(got_g, ref_g))
           if a is None or not torch.allclose(a, b, rtol=RTOL, atol=ATOL)]
    if bad:
        none = [i for i in bad if got_g[i] is None]
        hint = ("Some parameters got NO gradient at all: with use_reentrant=True a checkpoint whose inputs do not "
                "require grad (here the input batch) gives the blocks inside it no gradients; use "
                "use_reentrant=False. A detached checkpoint input (x.detach()) also cuts the gradient to "
                "everything before it." if none else
                "Did you detach the checkpointed input, or run a block on something other than the previous "
                "block's output?")
        raise AssertionError(f"{task} ({desc}): {len(bad)} of {len(params)} parameter gradients differ from the "
                             f"unmodified model's. {hint}")
    if calls != expected_calls:
        more = [i for i, (c, e) in enumerate(zip(calls, expected_calls)) if c > e]
        less = [i for i, (c, e) in enumerate(zip(calls, expected_calls)) if c < e]
        why = []
        if less:
            why.append(f"blocks {less} ran fewer times than expected: a checkpointed block runs twice (forward, "
                       f"then the recomputation in backward); one that ran once was not checkpointed"
                       + (", and one that ran 0 times was not called at all: use the blocks you are given, do not "
                          "copy them." if any(calls[i] == 0 for i in less) else "."))
        if more:
            why.append(f"blocks {more} ran more times than expected: do you call a block twice in forward (for "
                       f"example once under torch.no_grad() and once normally), or checkpoint it twice?")
        raise AssertionError(f"{task} ({desc}): forward calls per block in one forward + backward were {calls}, "
                             f"expected {expected_calls}. " + " ".join(why))
    with _learner_code(task, desc, "measuring the peak memory of your module"):
        peak = _peak(wrapped, wrapped, x, weights)
    assert peak <= bound, (
        f"{task} ({desc}): peak activation memory {mb(peak)} is above the {mb(bound)} the checkpointing scheme "
        f"needs (no checkpointing: {mb(plain_peak)}). Checkpointed blocks must not keep their activations: do not "
        f"also run them outside the checkpoint, and do not hold on to intermediate outputs.")


def _stack_case(r, hidden, visible_case):
    if hidden:
        n = r.randint(6, 14)
        d = r.choice([16, 24, 32])
        rows = r.choice([32, 48, 64])
        container = r.choice(["Sequential", "ModuleList", "list"])
        x_grad = r.random() < 0.5
    else:
        n, d, rows, container, x_grad = visible_case
    return n, d, rows, container, x_grad


def _per_block_bytes(d, hidden, rows, seed):
    """Bytes one CountingBlock keeps for backward when run normally, its input included (measured)."""
    stack, blocks = _stack(1, d, hidden, seed, "Sequential")
    x = torch.randn(rows, d)
    return activation_peak(stack, lambda: stack(x * 1.0).sum()).stored


def _bounds(ref, blocks, x, weights):
    """(the reference scheme's peak, the peak without checkpointing), same loss as the learner's."""
    return _peak(ref, ref, x, weights), _peak(ref, lambda t: _plain_forward(blocks, t), x, weights)


# ----------------------------------------------------------------------------- task2_1
def check_task2_1(CheckpointEveryK, *, hidden: bool) -> None:
    """CheckpointEveryK(blocks, k): block i runs under a non-reentrant checkpoint iff i % k == 0."""
    r = rng(hidden, 21)
    cases = [(8, 32, 64, "Sequential", True, 2), (8, 32, 64, "ModuleList", False, 3)]
    if hidden:
        cases = []
        for x_grad in (True, False, r.random() < 0.5):       # an input without grad every time
            n, d, rows, container, _ = _stack_case(r, True, None)
            cases.append((n, d, rows, container, x_grad, r.randint(1, max(1, n // 3))))
    for n, d, rows, container, x_grad, k in cases:
        seed = torch_seed(r)
        desc = f"{n} blocks in a {container}, k={k}, input requires_grad={x_grad}"
        stack, blocks = _stack(n, d, 4 * d, seed, container)
        try:
            wrapped = CheckpointEveryK(stack, k)
        except Exception as e:  # noqa: BLE001 - report construction failures as teaching messages
            raise AssertionError(f"task2_1 ({desc}): CheckpointEveryK(blocks, k) raised {type(e).__name__}: {e}. "
                                 f"It must accept an nn.Sequential, an nn.ModuleList or a list of modules.")
        x = torch.randn(rows, d, requires_grad=x_grad)
        weights = torch.randn(rows, d)                  # the loss: sum(output * weights)
        # the bound: the reference scheme's measured peak plus half a block of slack
        ref_peak, plain_peak = _bounds(_RefEveryK(blocks, k), blocks, x, weights)
        slack = _per_block_bytes(d, 4 * d, rows, seed) // 2
        expected = [2 if i % k == 0 else 1 for i in range(n)]
        _check_stack_wrapper("task2_1", wrapped, blocks, x, weights, expected, ref_peak + slack, plain_peak, desc)
    if hidden:                                              # k must be validated
        stack, _ = _stack(3, 8, 8, 0, "list")
        for bad in (0, -1):
            try:
                CheckpointEveryK(stack, bad)
            except ValueError:
                continue
            except Exception as e:  # noqa: BLE001
                raise AssertionError(f"task2_1: CheckpointEveryK(blocks, k={bad}) should raise ValueError, "
                                     f"raised {type(e).__name__}")
            raise AssertionError(f"task2_1: CheckpointEveryK(blocks, k={bad}) should raise ValueError: k must be "
                                 f"a positive int")


# ----------------------------------------------------------------------------- task2_2
def _check_segments(sqrt_segments, n):
    try:
        segs = sqrt_segments(n)
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"task2_2: sqrt_segments({n}) raised {type(e).__name__}: {e}")
    try:
        segs = [tuple(s) for s in segs]
        ok = all(len(s) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in s) for s in segs)
    except TypeError:
        ok = False
    assert ok, (f"task2_2: sqrt_segments({n}) must return a list of (start, stop) pairs of ints, "
                f"got {segs!r}")
    want = math.isqrt(n - 1) + 1
    assert segs and segs[0][0] == 0 and segs[-1][1] == n and all(
        a[1] == b[0] for a, b in zip(segs, segs[1:])) and all(s[1] > s[0] for s in segs), (
        f"task2_2: sqrt_segments({n}) = {segs}: the segments must be non-empty, contiguous and cover "
        f"0..{n} exactly (each stop is the next start; Python slice convention, stop excluded)")
    sizes = [s[1] - s[0] for s in segs]
    assert len(segs) == want, (
        f"task2_2: sqrt_segments({n}) returned {len(segs)} segments, expected ceil(sqrt({n})) = {want}")
    assert max(sizes) - min(sizes) <= 1, (
        f"task2_2: sqrt_segments({n}) has segment lengths {sizes}; they must differ by at most one "
        f"(spread the remainder n % segments over the first or last segments)")
    return segs


def check_task2_2(sqrt_segments, SqrtCheckpointed, *, hidden: bool) -> None:
    """sqrt_segments(n) -> ceil(sqrt(n)) balanced (start, stop) pairs; SqrtCheckpointed(blocks) checkpoints each."""
    r = rng(hidden, 22)
    ns = list(range(1, 30)) + [64, 100, 101] if not hidden else [r.randint(1, 400) for _ in range(40)]
    for n in ns:
        _check_segments(sqrt_segments, n)
    cases = [(16, 32, 64, "Sequential", True)]
    if hidden:
        cases = []
        for _ in range(2):
            n, d, rows, container, x_grad = _stack_case(r, True, None)
            cases.append((r.randint(9, 20), d, rows, container, x_grad))
    for n, d, rows, container, x_grad in cases:
        seed = torch_seed(r)
        desc = f"{n} blocks in a {container}, input requires_grad={x_grad}"
        stack, blocks = _stack(n, d, 4 * d, seed, container)
        try:
            wrapped = SqrtCheckpointed(stack)
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"task2_2 ({desc}): SqrtCheckpointed(blocks) raised {type(e).__name__}: {e}")
        x = torch.randn(rows, d, requires_grad=x_grad)
        weights = torch.randn(rows, d)
        ref_peak, plain_peak = _bounds(_RefSegments(blocks, reference_segments(n)), blocks, x, weights)
        a = _per_block_bytes(d, 4 * d, rows, seed)
        # another balanced order of the segment lengths may shift the peak by up to one block
        bound = ref_peak + a
        expected = [2] * n
        try:
            _check_stack_wrapper("task2_2", wrapped, blocks, x, weights, expected, bound, plain_peak, desc)
        except AssertionError as e:
            calls = [b.calls for b in blocks]
            last = reference_segments(n)[-1]
            if "forward calls per block" in str(e) and all(c == 1 for c in calls[last[0]:]):
                raise AssertionError(str(e) + " The last segment was not checkpointed: "
                                     "torch.utils.checkpoint.checkpoint_sequential leaves it out on purpose, but "
                                     "this task asks you to checkpoint every segment.") from None
            raise


# ----------------------------------------------------------------------------- task2_3
def plan_peak(act_bytes, keep) -> int:
    """Peak bytes of a plan under the exercise's cost model."""
    kept = peak = run = 0
    for m, k in zip(act_bytes, keep):
        if k:
            kept, run = kept + m, 0
        else:
            run += m
            peak = max(peak, kept + run)
    return max(peak, kept)


def plan_cost(recompute_cost, keep):
    return sum(c for c, k in zip(recompute_cost, keep) if not k)


def brute_force_plan(act_bytes, recompute_cost, budget):
    """(min cost, plan) over all 2**N plans, or (None, None) if none fits."""
    best = (None, None)
    for keep in itertools.product((False, True), repeat=len(act_bytes)):
        if plan_peak(act_bytes, keep) <= budget:
            c = plan_cost(recompute_cost, keep)
            if best[0] is None or c < best[0]:
                best = (c, list(keep))
    return best


def reference_plan(act_bytes, recompute_cost, budget) -> list[bool]:
    """Dynamic programme over (next layer, bytes kept so far) with Pareto pruning:
    at position s (layer s-1 kept, or s = 0) a state is (kept bytes K, cost); from it,
    keep layer j >= s after recomputing the run s..j-1, or keep nothing more."""
    m, c, n = list(act_bytes), list(recompute_cost), len(act_bytes)
    if len(c) != n:
        raise ValueError("act_bytes and recompute_cost must have the same length")
    fronts = [dict() for _ in range(n + 1)]     # position -> {kept bytes: (cost, back pointer)}
    fronts[0][0] = (0, None)
    best = None
    for s in range(n + 1):
        # Pareto-prune: keep a state only if no state with fewer kept bytes is at least as cheap
        items, pruned, low = sorted(fronts[s].items()), {}, math.inf
        for K, (cost, back) in items:
            if cost < low:
                pruned[K], low = (cost, back), cost
        fronts[s] = pruned
        for K, (cost, _) in pruned.items():
            run = rcost = 0
            for j in range(s, n):
                if K + run > budget:
                    break
                if K + m[j] <= budget:
                    cand = (cost + rcost, (s, K, j))
                    old = fronts[j + 1].get(K + m[j])
                    if old is None or cand[0] < old[0]:
                        fronts[j + 1][K + m[j]] = cand
                run, rcost = run + m[j], rcost + c[j]
            else:
                if K + run <= budget and (best is None or cost + rcost < best[0]):
                    best = (cost + rcost, (s, K))
    if best is None:
        raise ValueError(f"no plan fits the budget of {budget} bytes")
    keep = [False] * n
    s, K = best[1]
    while s > 0:                                   # walk the back pointers: layer s-1 was kept
        _, back = fronts[s][K]
        s_prev, K_prev, j = back
        keep[j] = True
        s, K = s_prev, K_prev
    return keep


def min_peak(act_bytes) -> int:
    """The smallest peak any plan reaches (brute force; small N only)."""
    return min(plan_peak(act_bytes, k) for k in itertools.product((False, True), repeat=len(act_bytes)))


@contextmanager
def _time_limit(seconds, what):
    """Fail with a teaching message if the block runs longer than `seconds` (Unix main thread only)."""
    usable = hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
    if not usable:
        yield
        return

    def on_alarm(signum, frame):
        raise AssertionError(what)

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _call_planner(plan_checkpoints, m, c, budget, desc):
    try:
        keep = plan_checkpoints(list(m), list(c), budget)
    except ValueError as e:
        raise AssertionError(f"task2_3 ({desc}): your planner raised ValueError ({e}), but a plan fits this "
                             f"budget") from None
    except AssertionError:
        raise
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"task2_3 ({desc}): plan_checkpoints raised {type(e).__name__}: {e}") from None
    try:
        keep = list(keep)
    except TypeError:
        raise AssertionError(f"task2_3 ({desc}): plan_checkpoints must return a list of bools, got "
                             f"{type(keep).__name__}") from None
    assert len(keep) == len(m) and all(isinstance(k, (bool,)) or k in (0, 1) for k in keep), (
        f"task2_3 ({desc}): plan_checkpoints must return one bool per layer ({len(m)}), got {keep!r}")
    return [bool(k) for k in keep]


def _expect_optimal(plan_checkpoints, m, c, budget, desc, want_cost=None):
    if want_cost is None:
        want_cost, _ = brute_force_plan(m, c, budget)
    keep = _call_planner(plan_checkpoints, m, c, budget, desc)
    peak, cost = plan_peak(m, keep), plan_cost(c, keep)
    assert peak <= budget, (
        f"task2_3 ({desc}): your plan {_show(keep)} peaks at {peak} bytes, over the budget of {budget}. Check every "
        f"moment of the cost model: the end of the forward (all kept outputs) and each recomputed run (the outputs "
        f"kept before it plus the whole run).")
    assert cost == want_cost, (
        f"task2_3 ({desc}): your plan {_show(keep)} fits (peak {peak}) but costs {cost}; the cheapest plan that "
        f"fits costs {want_cost}. A greedy choice (keep the expensive or small layers first) is not optimal in "
        f"general: search over where each recomputed run starts and ends, with the bytes kept so far as part of "
        f"the state (dynamic programming).")


def _expect_infeasible(plan_checkpoints, m, c, budget, desc):
    try:
        keep = plan_checkpoints(list(m), list(c), budget)
    except ValueError as e:
        assert "budget" in str(e).lower(), (
            f"task2_3 ({desc}): raise ValueError with a message that says the budget cannot be met (mention "
            f"the budget), got {str(e)!r}")
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"task2_3 ({desc}): for a budget no plan can meet, raise ValueError; your planner "
                             f"raised {type(e).__name__}: {e}") from None
    raise AssertionError(f"task2_3 ({desc}): no plan fits a budget of {budget} bytes (the smallest possible peak "
                         f"is {min_peak(m)}), yet your planner returned {keep!r} instead of raising ValueError. "
                         f"Never return a plan that breaks the budget.")


def _show(keep):
    return "".join("K" if k else "." for k in keep)


LESSON_BYTES = [48, 48, 40, 32, 24, 16, 12, 8, 8, 6, 4, 4]
LESSON_COST = [2, 2, 3, 3, 4, 4, 6, 6, 8, 8, 10, 10]


def check_task2_3(plan_checkpoints, *, hidden: bool) -> None:
    """plan_checkpoints(act_bytes, recompute_cost, budget) -> optimal list of keep flags, or ValueError."""
    r = rng(hidden, 23)
    if not hidden:
        m, c = LESSON_BYTES, LESSON_COST
        for budget in (100, 140, 250):
            _expect_optimal(plan_checkpoints, m, c, budget, f"the lesson's 12-layer chain, budget {budget}")
        _expect_infeasible(plan_checkpoints, m, c, min_peak(m) - 1, "the lesson's chain, budget below every plan")
        _expect_optimal(plan_checkpoints, [5], [3], 5, "one layer, budget 5")
        return
    for case in range(60):
        n = r.randint(1, 10)
        m = [r.randint(1, 100) for _ in range(n)]
        c = [r.randint(0, 20) for _ in range(n)]
        lo, hi = min_peak(m), sum(m)
        desc = f"random chain {case}: act_bytes={m}, recompute_cost={c}"
        if case % 6 == 5:
            _expect_infeasible(plan_checkpoints, m, c, lo - r.randint(1, lo), desc + ", budget below every plan")
        else:
            budget = r.randint(lo, hi)
            _expect_optimal(plan_checkpoints, m, c, budget, desc + f", budget {budget}")
    # a longer chain with MiB-sized, uneven layers: optimal against the reference DP, within a time limit
    n = 40
    m = [r.randint(1, 64) * 2**20 for _ in range(n)]
    c = [r.randint(1, 50) for _ in range(n)]
    budget = r.randint(int(0.2 * sum(m)), int(0.4 * sum(m)))
    want = plan_cost(c, reference_plan(m, c, budget))
    with _time_limit(20, "task2_3: your planner took more than 20 s on a 40-layer chain; trying every subset "
                         "(2**40 plans) cannot finish: use dynamic programming over (next layer, bytes kept)."):
        _expect_optimal(plan_checkpoints, m, c, budget, f"a 40-layer chain, budget {budget} bytes", want)


# ----------------------------------------------------------------------------- task2_4
def _gpt_case(r, hidden, case):
    if not hidden:
        return GPTConfig.tiny(n_layer=3, n_embd=64, n_head=4, vocab_size=64, block_size=32), 4, 32, 2
    # case 0 always has dropout (the recomputation must replay the masks), case 1 always rotary embeddings
    cfg = GPTConfig.tiny(n_layer=r.randint(2, 4), n_embd=32 * r.randint(1, 3), n_head=r.choice([2, 4]),
                         vocab_size=r.choice([48, 64, 96]), block_size=32,
                         dropout=r.choice([0.1, 0.2]) if case == 0 else r.choice([0.0, 0.1]),
                         pos="rope" if case == 1 else r.choice(["learned", "rope"]),
                         attn=r.choice(["sdpa", "math"]))
    return cfg, r.randint(2, 5), r.choice([16, 24, 32]), 3


def check_task2_4(CheckpointedGPT, *, hidden: bool) -> None:
    """CheckpointedGPT(cfg): memlab's GPT with every block checkpointed; trains to the same parameters."""
    r = rng(hidden, 24)
    for case in range(2 if hidden else 1):
        cfg, B, T, steps = _gpt_case(r, hidden, case)
        seed = torch_seed(r)
        desc = (f"n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, pos={cfg.pos!r}, attn={cfg.attn!r}, "
                f"dropout={cfg.dropout}, batch {B}x{T}")
        torch.manual_seed(seed)
        plain = GPT(cfg)
        try:
            mine = CheckpointedGPT(cfg)
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"task2_4 ({desc}): CheckpointedGPT(cfg) raised {type(e).__name__}: {e}")
        assert isinstance(mine, GPT), (f"task2_4: CheckpointedGPT must subclass memlab.models.GPT (got "
                                       f"{type(mine).__mro__}); override forward(), keep the parameters")
        try:
            mine.load_state_dict(plain.state_dict())
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"task2_4 ({desc}): CheckpointedGPT must have exactly GPT's parameters under "
                                 f"the same names, so a plain GPT's state_dict loads into it; load_state_dict "
                                 f"failed: {str(e)[:300]}. Override forward() instead of wrapping or renaming the "
                                 f"blocks.") from None
        ref = _RefCheckpointedGPT(cfg)
        ref.load_state_dict(plain.state_dict())
        g = torch.Generator().manual_seed(seed)
        batches = [(torch.randint(0, cfg.vocab_size, (B, T), generator=g),
                    torch.randint(0, cfg.vocab_size, (B, T), generator=g)) for _ in range(steps)]
        # logits without targets
        plain.eval()
        mine.eval()
        with torch.no_grad(), _learner_code("task2_4", desc, "model(idx)"):
            want, got = plain(batches[0][0]), mine(batches[0][0])
        assert isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(
            got, want, rtol=RTOL, atol=ATOL), (
            f"task2_4 ({desc}): model(idx) must return the same logits as GPT (shape {tuple(want.shape)}); "
            f"yours {'differ' if isinstance(got, torch.Tensor) and got.shape == want.shape else 'have the wrong shape/type'}. "
            f"Keep GPT.forward's steps (embeddings, position table or rope, dropout, blocks, ln_f, head, loss).")
        plain.train()
        mine.train()
        blocks = _count_gpt_blocks(mine)
        opt_p = torch.optim.SGD(plain.parameters(), lr=0.5)
        opt_m = torch.optim.SGD(mine.parameters(), lr=0.5)
        for step, (x, y) in enumerate(batches):
            losses = {}
            for model, opt in ((plain, opt_p), (mine, opt_m)):
                torch.manual_seed(seed + step)          # the same dropout masks for both
                opt.zero_grad(set_to_none=True)
                for b in blocks:
                    b.calls = 0
                with _learner_code("task2_4", desc, f"training step {step}"):
                    loss = model(x, y)
                    loss.backward()
                losses[model is mine] = loss.item()
            calls = [b.calls for b in blocks]
            assert abs(losses[True] - losses[False]) <= 1e-5 * max(1.0, abs(losses[False])), (
                f"task2_4 ({desc}): step {step}: your loss {losses[True]:.6f} differs from GPT's "
                f"{losses[False]:.6f}: the forward must compute exactly what GPT.forward computes.")
            for (name, p), q in zip(plain.named_parameters(), mine.parameters()):
                if q.grad is None or not torch.allclose(p.grad, q.grad, rtol=RTOL, atol=ATOL):
                    hint = (" With dropout, the recomputation must draw the same masks as the forward: keep "
                            "preserve_rng_state=True (the default)." if cfg.dropout else "")
                    hint += (" Did you detach the checkpointed input? Gradients then stop at that checkpoint and "
                             "never reach the embeddings and the blocks before it.")
                    raise AssertionError(
                        f"task2_4 ({desc}): at training step {step}, the gradient of {name!r} differs from the "
                        f"plain GPT's ("
                        + ("None" if q.grad is None else f"max |diff| {(p.grad - q.grad).abs().max().item():.2e}")
                        + f"), so your model would train differently.{hint}")
            assert calls == [2] * cfg.n_layer, (
                f"task2_4 ({desc}): each block's forward should run twice per training step (forward, then the "
                f"recomputation in backward), got {calls}. "
                + ("A block that ran once was not checkpointed." if min(calls) < 2 else
                   "A block that ran more often is called more than once in your forward."))
            opt_p.step()
            opt_m.step()
        for (name, p), q in zip(plain.named_parameters(), mine.parameters()):
            assert torch.allclose(p, q, rtol=RTOL, atol=ATOL), (
                f"task2_4 ({desc}): after {steps} SGD steps parameter {name!r} differs from the plain GPT's "
                f"(max |diff| {(p - q).abs().max().item():.2e}).")
        # memory: one stashed block input per block, one block recomputed at a time
        x, y = batches[0]
        for m in (mine, ref, plain):
            m.eval()                                    # no dropout masks in the memory comparison
        ref_peak = activation_peak(ref, lambda: ref(x, y)).peak
        plain_peak = activation_peak(plain, lambda: plain(x, y)).peak
        with _learner_code("task2_4", desc, "measuring the peak memory of your model"):
            peak = activation_peak(mine, lambda: mine(x, y)).peak
        slack = max((plain_peak - ref_peak) // (4 * cfg.n_layer), 1024)
        assert peak <= ref_peak + slack, (
            f"task2_4 ({desc}): peak activation memory {mb(peak)}, but checkpointing every block needs only "
            f"{mb(ref_peak)} (no checkpointing: {mb(plain_peak)}). Run each block only inside "
            f"checkpoint(block, x, rope, use_reentrant=False), and keep nothing else per block.")
        for b in blocks:
            b.__class__ = Block
