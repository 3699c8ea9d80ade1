"""memlab.core.allocator: the caching-allocator model against answers derived by hand from PyTorch's rules
(c10/cuda/CUDACachingAllocator.cpp), against a GPU recording when there is one, and fit's use of it."""

import pytest
import torch

import memlab
from memlab.core.allocator import (CachingAllocator, events_from_tracker, least_capacity, replay, round_size,
                                   step_start)
from memlab.core.track import MemoryTracker

MiB = 2**20
TINY = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)


def one(n):
    r = replay([("alloc", 1, n)])
    return r["max_allocated"], r["max_reserved"]


@pytest.mark.parametrize("n, block, segment", [
    (1, 512, 2 * MiB),                         # kMinBlockSize; small pool, a kSmallBuffer segment
    (512, 512, 2 * MiB),
    (513, 1024, 2 * MiB),                      # rounded up to a multiple of 512
    (1 * MiB, 1 * MiB, 2 * MiB),               # kSmallSize is still small
    (1 * MiB + 1, 1 * MiB + 512, 20 * MiB),    # large pool, under kMinLargeAlloc: a kLargeBuffer segment
    (10 * MiB, 10 * MiB, 10 * MiB),            # kMinLargeAlloc: its own segment, rounded to kRoundLarge
    (10 * MiB + 1, 10 * MiB + 512, 12 * MiB),  # 10 MiB + 512 rounded up to 2 MiB
    (30 * MiB, 30 * MiB, 30 * MiB)])
def test_rounding_and_segment_of_one_request(n, block, segment):
    assert round_size(n) == block
    assert one(n) == (block, segment)


def test_small_blocks_share_a_2_mib_segment_until_it_is_full():
    full = [("alloc", i, 512) for i in range(4096)]            # 4096 x 512 B = 2 MiB exactly
    assert replay(full)["max_reserved"] == 2 * MiB and replay(full)["segments"] == 1
    assert replay(full + [("alloc", "x", 1)])["max_reserved"] == 4 * MiB


def test_large_blocks_split_only_when_more_than_1_mib_is_left():
    # 6 MiB requests: 20 MiB segments, split while the rest is > 1 MiB: 3 per segment (2 MiB left)
    r = replay([("alloc", i, 6 * MiB) for i in range(4)])
    assert (r["max_allocated"], r["max_reserved"], r["segments"]) == (24 * MiB, 40 * MiB, 2)
    # 8 MiB leaves a 12 MiB block; 11.5 MiB takes it whole (0.5 MiB is not split off): allocated counts 12 MiB
    r = replay([("alloc", 1, 8 * MiB), ("alloc", 2, 11 * MiB + MiB // 2)])
    assert (r["max_allocated"], r["max_reserved"]) == (20 * MiB, 20 * MiB)


def test_freed_blocks_are_reused_and_merge_with_free_neighbours():
    r = replay([("alloc", 1, 6 * MiB), ("free", 1), ("alloc", 2, 6 * MiB)])
    assert r["max_reserved"] == 20 * MiB
    # two neighbours freed merge with the segment's rest into one 20 MiB block, which an 18 MiB request fits
    r = replay([("alloc", 1, 6 * MiB), ("alloc", 2, 6 * MiB), ("free", 1), ("free", 2), ("alloc", 3, 18 * MiB)])
    assert (r["max_reserved"], r["segments"]) == (20 * MiB, 1)


def test_fragmentation_reserved_above_allocated():
    # lesson 04's experiment: 8 x 5 MiB (4 per 20 MiB segment: the last takes the 5 MiB rest whole), every other
    # freed: 5 MiB holes between live blocks, none of them 8 MiB, so an 8 MiB request takes a new segment
    ev = [("alloc", i, 5 * MiB) for i in range(8)] + [("free", i) for i in range(0, 8, 2)] + [("alloc", "b", 8 * MiB)]
    r = replay(ev)
    assert (r["allocated"], r["reserved"], r["segments"]) == (28 * MiB, 60 * MiB, 3)


def test_lesson_01_segments_experiment():
    # 1000 x 400 B (one 2 MiB small segment), 8 x 6 MiB (3 segments of 20 MiB), every other freed, 20 MiB more
    ev = [("alloc", ("s", i), 400) for i in range(1000)] + [("alloc", i, 6 * MiB) for i in range(8)]
    ev += [("free", i) for i in range(0, 8, 2)] + [("alloc", "big", 20 * MiB)]
    assert replay(ev)["max_reserved"] == 2 * MiB + 3 * 20 * MiB + 20 * MiB


def test_cached_segments_are_released_only_when_an_allocation_fails():
    ev = [("alloc", 1, 12 * MiB), ("free", 1), ("alloc", 2, 14 * MiB)]
    assert replay(ev)["max_reserved"] == 26 * MiB                      # room to spare: the 12 MiB stays cached
    r = replay(ev, capacity=22 * MiB)                                  # cudaMalloc fails: free the cache, retry
    assert (r["max_reserved"], r["reserved"], r["releases"], r["oom"]) == (14 * MiB, 14 * MiB, 1, None)
    r = replay([("alloc", 1, 12 * MiB), ("alloc", 2, 14 * MiB)], capacity=22 * MiB)
    assert r["oom"] == (2, 14 * MiB)
    assert least_capacity(ev) == 14 * MiB
    # a split segment is not released: its free part stays reserved
    r = replay([("alloc", 1, 6 * MiB), ("alloc", 2, 6 * MiB), ("free", 1), ("alloc", 3, 16 * MiB)], capacity=36 * MiB)
    assert r["oom"] is None and r["reserved"] == 36 * MiB


def test_max_split_size_keeps_large_cached_blocks_whole():
    ev = [("alloc", 1, 40 * MiB), ("free", 1), ("alloc", 2, 12 * MiB)]
    assert replay(ev)["max_reserved"] == 40 * MiB                       # default: the 40 MiB block is split
    assert replay(ev, max_split_size=32 * MiB)["max_reserved"] == 52 * MiB


def test_steady_state_repeats_the_step():
    # step: a 6 MiB and a 12 MiB buffer; a 4 MiB tensor born in the step lives on into the next one
    ev = [("alloc", "w", 1 * MiB), ("alloc", "a", 6 * MiB), ("alloc", "b", 12 * MiB), ("free", "a"), ("free", "b")]
    once, twice = replay(ev), replay(ev, repeat_from=1, repeats=1)
    assert once["allocated"] == twice["allocated"] == 1 * MiB                 # nothing leaks across steps
    assert twice["max_reserved"] == once["max_reserved"]
    with pytest.raises(ValueError, match="repeat_from"):
        replay(ev, repeats=1)


def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="events"):
        replay("alloc")
    with pytest.raises(ValueError, match="events"):
        replay([("malloc", 1, 8)])
    with pytest.raises(ValueError, match="nbytes"):
        replay([("alloc", 1, -8)])
    with pytest.raises(ValueError, match="capacity"):
        CachingAllocator(capacity=0)
    with pytest.raises(ValueError, match="max_split_size"):
        CachingAllocator(max_split_size=MiB)
    with pytest.raises(ValueError, match="not allocated"):
        replay([("free", 1)])
    with pytest.raises(ValueError, match="timeline"):
        events_from_tracker(MemoryTracker(device="cpu", timeline=False))


def test_tracker_stream_replays_to_the_trackers_peak():
    trk = MemoryTracker(device="cpu", round_to=512)
    with trk:
        with memlab.phase("load"):
            a = torch.empty(300, dtype=torch.uint8)
            b = torch.empty(3 * MiB, dtype=torch.uint8)
        with memlab.phase("forward"):
            c = torch.empty(100, dtype=torch.uint8)
            c.resize_(5000)                                    # a new block of 5120 B, the old one freed
        del a, b, c
    ev = events_from_tracker(trk)
    assert [e[0] for e in ev] == ["alloc", "alloc", "alloc", "alloc", "free", "free", "free", "free"]
    # the tracker grows c in place; the allocator holds the old 512 B block while it copies into the new one
    assert replay(ev)["max_allocated"] == trk.peak + 512
    assert step_start(trk) == 2 and step_start(trk, "backward") is None


# ----------------------------------------------------------------------------- against a real GPU's recording
def test_replay_matches_a_recorded_gpu():
    rec = memlab.hardware.recorded.load()
    if rec is None or "rounding" not in rec.experiments:
        pytest.skip("no GPU recording with the 'rounding' experiment (benchmarks/record_gpu.py writes one)")
    for row in rec.experiment("rounding")["rows"]:
        assert one(row["request_bytes"]) == (row["allocated_bytes"], row["reserved_bytes"]), row
    if "segments" in rec.experiments:
        steps = {s["what"]: s for s in rec.experiment("segments")["steps"]}
        ev = [("alloc", ("s", i), 400) for i in range(1000)] + [("alloc", i, 6 * MiB) for i in range(8)]
        ev += [("free", i) for i in range(0, 8, 2)] + [("alloc", "big", 20 * MiB)]
        got = steps["+ one 20 MiB tensor (new segment needed)"]["reserved_bytes"] - steps["start"]["reserved_bytes"]
        assert replay(ev)["reserved"] == got


# ----------------------------------------------------------------------------- fit
def test_fit_reports_reserved_and_context_and_decides_on_them():
    r = memlab.fit(TINY, 1, seq=64)                    # 2 layers: the whole model runs, the replay is exact
    assert r.reserved >= r.peak and r.reserved_cached >= r.reserved and r.context > 0
    assert r.fits == (r.reserved + r.context <= r.usable)
    assert "reserved" in str(r) and "CUDA context" in str(r)
    # a card with room for the allocated peak but not the reserved bytes does not fit
    assert r.reserved > r.peak
    cap = (r.reserved - 1) / 2**30
    tight = memlab.fit(TINY, cap, seq=64, headroom=0.0, context=0)
    assert tight.peak <= tight.capacity and not tight.fits and tight.headroom_bytes < 0
    roomy = memlab.fit(TINY, (r.reserved + 2 * MiB) / 2**30, seq=64, headroom=0.0, context=0)
    assert roomy.fits and roomy.reserved == r.reserved
    with pytest.raises(ValueError, match="context"):
        memlab.fit(TINY, 1, seq=64, context=-1)


@pytest.mark.parametrize("kw", [dict(), dict(method="lora"), dict(mode="inference", batch=2),
                                dict(zero=2, gpus=4, precision="mixed")])
def test_reserved_is_never_below_the_allocated_peak(kw):
    r = memlab.fit(dict(TINY, num_hidden_layers=5), 1, seq=64, **kw)
    assert r.peak <= r.reserved <= r.reserved_cached, (r.peak, r.reserved, r.reserved_cached)
