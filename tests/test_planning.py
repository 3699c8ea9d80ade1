"""memlab.planning (lesson 10): lifetimes from the tracker, offset planners against an exhaustive search, Inductor's
wrapper read back, top-k packing, the attention variants against masked exact attention, MobileNet's counts."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

import memlab
from memlab.attention import naive_attention
from memlab.planning import (Lifetime, TopKSavedActivations, ToyAttentionModel, arena_size, as_lifetimes,
                             check_plan, conflicts, conv2d_cost, first_fit, greedy_by_size,
                             layout_report, lifetimes_from_events, linear_attention, live_bytes_curve,
                             live_bytes_peak, local_attention, lowrank_attention, mobilenet_v1, noise_scale,
                             optimal_offsets, pareto_front, param_count, plan_conflicts, profiled_allocations,
                             record_step, resident_bytes, round_lifetimes, steps_and_samples, sub_trace, topk_bytes,
                             topk_pack, topk_unpack, vgg16, wrapper_buffers)


# ----------------------------------------------------------------------------- references
def smallest_arena_by_offsets(lts, limit):
    """The smallest arena <= limit over *every* assignment of integer offsets (depth-first, no theory used), or
    None if no plan fits in `limit` bytes."""
    lts = [Lifetime(*lt) for lt in lts]
    order = sorted(range(len(lts)), key=lambda i: -lts[i].size)
    best = [None]

    def clash(i, o, placed):
        a = lts[i]
        return any(a.birth < lts[j].death and lts[j].birth < a.death and o < p + lts[j].size and p < o + a.size
                   for j, p in placed.items() if lts[j].size and a.size)

    def go(k, placed, top):
        if best[0] is not None and top >= best[0]:
            return
        if k == len(order):
            best[0] = top
            return
        i = order[k]
        for o in range(0, max(limit - lts[i].size, 0) + 1):
            if not clash(i, o, placed):
                placed[i] = o
                go(k + 1, placed, max(top, o + lts[i].size if lts[i].size else 0))
                del placed[i]

    go(0, {}, 0)
    return best[0]


def random_trace(rng, n, horizon=8, sizes=(1, 2, 3, 4, 6)):
    out = []
    for _ in range(n):
        b = rng.randrange(horizon)
        out.append((rng.choice(sizes) if rng.random() > 0.1 else 0, b, rng.randrange(b + 1, horizon + 1)))
    return out


# ----------------------------------------------------------------------------- planners
def test_planners_against_every_offset_assignment():
    rng = random.Random(10)
    for _ in range(40):
        lts = random_trace(rng, rng.randrange(1, 6), sizes=(1, 2, 3))
        lb = live_bytes_peak(lts)
        plans = {f.__name__: f(lts) for f in (greedy_by_size, first_fit, optimal_offsets)}
        arenas = {name: check_plan(lts, p) for name, p in plans.items()}        # raises on any overlap
        truth = smallest_arena_by_offsets(lts, arenas["first_fit"])
        assert arenas["optimal_offsets"] == truth, (lts, arenas, truth)
        assert lb <= truth <= min(arenas["greedy_by_size"], arenas["first_fit"])


def test_the_live_bytes_peak_is_not_always_reachable():
    # lesson 10's example: at most 5 bytes are alive at once, yet no plan fits in 5 (the exhaustive search says so)
    lts = [(3, 0, 1), (2, 0, 2), (2, 1, 3), (1, 1, 4), (1, 2, 4), (3, 3, 5), (2, 4, 5)]
    assert live_bytes_peak(lts) == 5
    assert smallest_arena_by_offsets(lts, 5) is None
    assert smallest_arena_by_offsets(lts, 6) == 6 == check_plan(lts, optimal_offsets(lts))
    assert arena_size(lts, first_fit(lts)) > 6                              # first fit misses the optimum


def test_unit_sizes_are_interval_colouring_and_first_fit_is_optimal():
    rng = random.Random(3)
    for _ in range(30):
        lts = random_trace(rng, rng.randrange(2, 12), horizon=10, sizes=(1,))
        most_alive = max(sum(1 for s, b, d in lts if s and b <= t < d) for t in range(10))
        assert check_plan(lts, first_fit(lts)) == most_alive == live_bytes_peak(lts)


def test_ties_zero_sizes_and_whole_trace_tensors():
    lts = [(4, 0, 9), (4, 1, 9), (2, 2, 4), (2, 2, 4), (0, 3, 5), (2, 4, 6), (0, 0, 9)]
    g = greedy_by_size(lts)
    assert g[:2] == [0, 4]                    # alive with every other tensor: placed first, at the bottom
    assert g == greedy_by_size(lts)           # deterministic on ties
    assert g[4] == 0 and g[6] == 0            # empty tensors take no space
    for plan in (g, first_fit(lts), optimal_offsets(lts)):
        assert check_plan(lts, plan) == 12 == live_bytes_peak(lts)
    assert conflicts([(0, 0, 5), (3, 1, 2)]) == [[], []]


def test_live_bytes_curve_half_open_intervals():
    assert live_bytes_curve([(2, 0, 2), (3, 2, 4)]) == [(0, 2), (2, 3), (4, 0)]
    assert live_bytes_peak([(2, 0, 2), (3, 2, 4)]) == 3                       # one dies as the other is born
    assert live_bytes_peak([]) == 0 and greedy_by_size([]) == [] and optimal_offsets([]) == []


def test_plan_checks_name_the_overlap():
    lts = [(4, 0, 3), (4, 2, 5), (4, 3, 6)]
    assert plan_conflicts(lts, [0, 2, 6]) == [(0, 1)]
    assert plan_conflicts(lts, [0, 2, 0]) == [(0, 1), (1, 2)]
    assert plan_conflicts(lts, [0, 4, 0]) == []                               # 0 and 2 never live together
    with pytest.raises(ValueError, match="tensors 0 .* and 1"):
        check_plan(lts, [0, 2, 0])
    with pytest.raises(ValueError, match="one entry per lifetime"):
        check_plan(lts, [0, 4])
    with pytest.raises(ValueError, match=r"offsets\[1\]"):
        arena_size(lts, [0, -1, 0])
    with pytest.raises(ValueError, match="max_tensors"):
        optimal_offsets([(1, 0, 9)] * 12)


@pytest.mark.parametrize("bad, err", [("x", TypeError), ([(1, 2)], TypeError), ([(1.0, 0, 1)], TypeError),
                                      ([(True, 0, 1)], TypeError), ([(-1, 0, 1)], ValueError),
                                      ([(1, 2, 2)], ValueError), ([(1, -1, 2)], ValueError)])
def test_lifetimes_are_validated(bad, err):
    with pytest.raises(err, match="lifetimes"):
        as_lifetimes(bad)


def test_round_and_sub_trace():
    assert round_lifetimes([(1, 0, 2), (0, 0, 1), (513, 1, 3)]) == [(512, 0, 2), (0, 0, 1), (1024, 1, 3)]
    assert sub_trace([(5, 0, 10), (3, 2, 4), (1, 8, 9)], 3, 9) == [(5, 0, 6), (3, 0, 1), (1, 5, 6)]
    with pytest.raises(ValueError, match="stop"):
        sub_trace([(1, 0, 2)], 3, 3)


# ----------------------------------------------------------------------------- lifetimes from a stream
def test_lifetimes_from_events():
    ev = [("alloc", "a", 8), ("alloc", "b", 0), ("free", "a"), ("alloc", "a", 4), ("free", "b")]
    assert lifetimes_from_events(ev) == [(8, 0, 2), (0, 1, 4), (4, 3, 5)]     # a again: a new lifetime
    with pytest.raises(ValueError, match="still alive"):
        lifetimes_from_events([("alloc", 1, 4), ("alloc", 1, 4)])
    with pytest.raises(ValueError, match="not alive"):
        lifetimes_from_events([("free", 1)])
    with pytest.raises(ValueError, match=r"events\[0\]"):
        lifetimes_from_events([("alloc", 1, -4)])
    with pytest.raises(TypeError, match="events"):
        lifetimes_from_events("alloc")


def test_recorded_step_views_in_place_and_empty_tensors():
    x = torch.randn(64, 32)                                   # made before the tracker: not in the trace

    def step():
        y = x * 2                                             # new: 8 KiB
        y.relu_()                                             # in place: same storage
        v = y.view(32, 64)[::2]                               # a view: same storage
        e = torch.empty(0)                                    # an empty storage: 0 bytes
        z = v.t().contiguous()                                # a copy of half of y: 4 KiB
        del y, v, e
        return z.sum()

    tr = record_step(step)
    assert [lt.size for lt in tr.lifetimes] == [8192, 0, 4096, 4]
    assert tr.peak == live_bytes_peak(tr.lifetimes) == 8192 + 4096          # y is gone before the sum
    assert check_plan(tr.lifetimes, greedy_by_size(tr.lifetimes)) >= tr.peak


def test_recorded_training_step_bound_is_the_tracker_peak():
    torch.manual_seed(0)
    model = memlab.MLP(d_in=16, width=32, depth=2, d_out=4)
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    memlab.train_step(model, opt, x, y)                       # the optimizer state exists before the trace
    tr = record_step(memlab.train_step, model, opt, x, y, model=model, optimizer=opt)
    n_state = sum(1 for p in model.parameters()) * 3          # parameters + exp_avg + exp_avg_sq
    whole = [lt for lt in tr.lifetimes if lt.death == tr.end]
    assert len(whole) >= n_state and tr.lifetimes[0].birth == 0
    assert set(tr.phase_starts) >= {"forward", "backward", "step"}
    assert live_bytes_peak(tr.lifetimes) == tr.peak
    for plan in (greedy_by_size, first_fit):
        assert check_plan(tr.lifetimes, plan(tr.lifetimes)) >= tr.peak


# ----------------------------------------------------------------------------- Inductor and the profiler
WRAPPER = '''
def call(self, args):
    arg0_1, = args
    buf0 = empty_strided_cpu((32, 256), (256, 1), torch.float32)
    buf1 = buf0; del buf0  # reuse
    buf2 = empty_strided_cpu((32, 512), (512, 1), torch.float32)
    del buf1
    buf3 = reinterpret_tensor(buf2, (512, 32), (1, 512), 0); del buf2  # reuse
    pool1 = empty_strided_cpu((1024, ), (1, ), torch.uint8)
    buf4 = alloc_from_pool(pool1, 0, torch.float32, (16, 16), (16, 1))
    del pool1
    return (buf3, buf4, )

runner = Runner(partitions=[])
'''


def test_wrapper_buffers_replays_allocations_reuses_and_frees():
    w = wrapper_buffers(WRAPPER)
    assert (w.allocations, w.reuses, w.pools) == (3, 2, [1024])
    assert w.allocated == 32768 + 65536 + 1024
    assert w.peak == 32768 + 65536                           # buf1 (buf0's storage) dies after buf2 is made
    with pytest.raises(ValueError, match="def call"):
        wrapper_buffers("x = 1")


def test_profiled_allocations_sees_a_kernel_and_layout_report():
    a = profiled_allocations(lambda: torch.ones(1000) + 1)
    assert a.total >= 8000 and a.count >= 2 and 4000 <= a.peak <= a.total
    img = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    r = layout_report(img)
    assert r["channels_last"] and not r["contiguous"] and r["memory order"] == [0, 2, 3, 1]
    with pytest.raises(ValueError, match="device"):
        profiled_allocations(lambda: None, device="mps")


# ----------------------------------------------------------------------------- top-k, batch, architectures
def test_topk_bytes_and_round_trip():
    n = 10_000
    assert 4 * n / topk_bytes(n, 0.1, 4, 4) == 5.0                         # int32 indices
    assert 4 * n / topk_bytes(n, 0.1, 4, 8) == pytest.approx(10 / 3)        # torch.topk's int64
    assert topk_bytes(10, 0.7, 1, 1) == 14                                  # ceil without float noise
    assert topk_bytes(n, 0.1, 4, bitmap=True) == 4000 + 1250                # values + one bit per value
    with pytest.raises(TypeError, match="bitmap"):
        topk_bytes(n, 0.1, bitmap=1)
    t = torch.randn(50, 40)
    p = topk_pack(t, 0.1)
    assert p.nbytes == topk_bytes(t.numel(), 0.1) and p.indices.dtype == torch.int32
    back = topk_unpack(p)
    kept = back != 0
    assert int(kept.sum()) == 200 and torch.equal(back[kept], t[kept])
    assert t.abs()[kept].min() >= t.abs()[~kept].max()
    with pytest.raises(ValueError, match="cannot address"):
        topk_pack(torch.randn(40_000), 0.1, torch.int16)
    with pytest.raises(ValueError, match="frac"):
        topk_pack(t, 0)


def test_topk_hooks_pack_activations_not_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    x = torch.randn(64, 64)
    with TopKSavedActivations(model, 1.0) as hooks:          # keep everything: the gradients must not change
        loss = model(x).square().sum()
    loss.backward()
    g_packed = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    assert all(torch.allclose(a, b) for a, b in zip(g_packed, (p.grad for p in model.parameters())))
    assert hooks.tally["parameter"] > 0 and hooks.tally["packed (bytes in)"] > 0


def test_pareto_steps_and_noise_scale():
    pts = [(1, 5), (2, 2), (3, 3), (2, 2), (5, 1)]
    assert pareto_front(pts) == [0, 1, 3, 4]
    assert steps_and_samples(100, 100) == (2.0, 2.0)
    with pytest.raises(ValueError, match="points"):
        pareto_front([(1, 2), (1,)])
    model = torch.nn.Linear(3, 2)
    x = torch.randn(1, 3).repeat(16, 1)                        # identical samples: no gradient noise
    assert noise_scale(model, x, torch.zeros(16, dtype=torch.long)) == pytest.approx(0, abs=1e-5)
    r = resident_bytes()
    assert r is None or r > 0


def test_mobilenet_and_vgg_counts_on_meta():
    with torch.device("meta"):
        m, v = mobilenet_v1(1.0), vgg16()
        half = mobilenet_v1(0.5)
    assert round(param_count(m) / 1e6, 1) == 4.2                 # Howard et al. 2017, Table 8
    assert param_count(v) == 138_357_544                          # VGG-16, configuration D
    assert 0.25 < param_count(half) / param_count(m) < 0.35       # about alpha^2
    with pytest.raises(ValueError, match="alpha"):
        mobilenet_v1(0)


@pytest.mark.parametrize("groups, kernel", [(1, 3), (16, 3), (1, 1)])
def test_conv2d_cost_flops_match_torch_flop_counter(groups, kernel):
    from torch.utils.flop_counter import FlopCounterMode
    conv = torch.nn.Conv2d(16, 16, kernel, padding=kernel // 2, groups=groups, bias=False)
    with FlopCounterMode(display=False) as fc:
        conv(torch.randn(2, 16, 9, 9))
    assert conv2d_cost(2, 16, 16, 9, kernel, groups=groups).flops == fc.get_total_flops()


# ----------------------------------------------------------------------------- attention variants
def test_attention_variants_against_exact_attention():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 16, 8) for _ in range(3))
    w = 4                                                      # block b sees blocks b-1..b+1: a banded mask
    blk = torch.arange(16) // w
    mask = (blk.view(-1, 1) - blk.view(1, -1)).abs() <= 1
    s = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~mask, float("-inf"))
    assert torch.allclose(local_attention(q, k, v, w), torch.softmax(s, -1) @ v, atol=1e-5)
    assert torch.allclose(local_attention(q, k, v, 16), naive_attention(q, k, v), atol=1e-5)
    qf, kf = F.elu(q) + 1, F.elu(k) + 1
    a = qf @ kf.transpose(-1, -2)                               # the T x T matrix linear attention avoids
    assert torch.allclose(linear_attention(q, k, v), (a / a.sum(-1, keepdim=True)) @ v, atol=1e-5)
    eye = torch.eye(16)
    assert torch.allclose(lowrank_attention(q, k, v, eye, eye), naive_attention(q, k, v), atol=1e-5)
    with pytest.raises(ValueError, match="window"):
        local_attention(q, k, v, 5)
    for kind in ("exact", "local", "linear", "lowrank"):
        out = ToyAttentionModel(kind, seq=16)(torch.randint(0, 16, (3, 16)))
        assert out.shape == (3, 16, 16)
