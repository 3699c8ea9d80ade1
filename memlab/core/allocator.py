"""A small model of PyTorch's CUDA caching allocator: what `torch.cuda.max_memory_reserved()` would say.

memlab's tracker counts the bytes of live tensors (the allocator's *allocated* bytes, each request rounded up
to 512 B). A real card fails on the allocator's *reserved* bytes, the segments it holds from cudaMalloc, plus the
CUDA context. `replay(events)` runs an ordered stream of allocations and frees through the allocator's rules and
reports both peaks:

    replay([("alloc", 1, 400), ("alloc", 2, 6 * 2**20), ("free", 1)])
    -> {"max_allocated": 6291968, "max_reserved": 23068672, "segments": 2, ...}

The rules and constants are PyTorch's (c10/cuda/CUDACachingAllocator.cpp, DeviceCachingAllocator; names as
there):

  kMinBlockSize  512 B     round_size: every request is rounded up to a multiple of 512 B (at least 512 B)
  kSmallSize     1 MiB     get_pool: requests up to 1 MiB come from the small pool, larger from the large pool
  kSmallBuffer   2 MiB     get_allocation_size: a small-pool segment is 2 MiB
  kMinLargeAlloc 10 MiB    get_allocation_size: a large request under 10 MiB takes a 20 MiB segment ...
  kLargeBuffer   20 MiB    ... (kLargeBuffer); from 10 MiB up, the request rounded up to 2 MiB (kRoundLarge)
  kRoundLarge    2 MiB
  max_split_size  CUDAAllocatorConfig's default is SIZE_MAX (no limit); PYTORCH_CUDA_ALLOC_CONF's max_split_size_mb
                 sets it (then get_free_block never hands a block >= it to a smaller request, nor one
                 kLargeBuffer or more larger than the request)

  get_free_block   best fit: the smallest free block of the pool that is large enough (ties: lowest address;
                   the pool is a std::set ordered by stream, size, address)
  should_split     small pool: split off the rest if it is >= kMinBlockSize; large pool: if the request is
                   < max_split_size and the rest is > kSmallSize (a rest of 1 MiB or less stays in the block)
  free_block       a freed block merges with free neighbours of its segment (try_merge_blocks)
  malloc           no free block -> cudaMalloc a new segment; if that fails (here: reserved + segment >
                   capacity), release_cached_blocks frees every cached segment that is not split (wholly free)
                   and it tries once more; then out of memory. Segments are never released otherwise
                   (empty_cache() is not called during a step).

Not modelled: streams (one stream), expandable_segments, roundup_power2_divisions (default off), CUDA graphs'
private pools and garbage_collection_threshold. cuBLAS's workspace goes through this allocator on a real
card but is not a tensor, so it is not in a tracker's stream (lesson 01).
"""

from __future__ import annotations

import bisect
import itertools

from .validate import int_at_least, is_int, pos_int

__all__ = ["CachingAllocator", "replay", "least_capacity", "round_size", "allocation_size", "events_from_tracker",
           "step_start",
           "kMinBlockSize", "kSmallSize", "kSmallBuffer", "kMinLargeAlloc", "kLargeBuffer", "kRoundLarge"]

MiB = 2**20
kMinBlockSize = 512            # all sizes are rounded to at least 512 bytes
kSmallSize = 1 * MiB           # largest "small" allocation is 1 MiB
kSmallBuffer = 2 * MiB         # "small" allocations are packed in 2 MiB blocks
kMinLargeAlloc = 10 * MiB      # allocations between 1 and 10 MiB may use kLargeBuffer
kLargeBuffer = 20 * MiB        # "large" allocations may be packed in 20 MiB blocks
kRoundLarge = 2 * MiB          # round up large allocations to 2 MiB


def round_size(nbytes: int) -> int:
    """The block size of a request: 1 B -> 512 B, 513 B -> 1024 B (kMinBlockSize)."""
    return kMinBlockSize if nbytes < kMinBlockSize else -(-nbytes // kMinBlockSize) * kMinBlockSize


def allocation_size(size: int) -> int:
    """The segment cudaMalloc'ed for a (rounded) block size that no cached block can hold."""
    if size <= kSmallSize:
        return kSmallBuffer                              # 2 MiB, shared by small blocks
    if size < kMinLargeAlloc:
        return kLargeBuffer                              # 20 MiB, split between 1-10 MiB requests
    return -(-size // kRoundLarge) * kRoundLarge         # the request rounded up to 2 MiB


class _Block:
    __slots__ = ("size", "addr", "small", "prev", "next", "allocated")

    def __init__(self, size, addr, small, prev=None, nxt=None):
        self.size, self.addr, self.small, self.prev, self.next, self.allocated = size, addr, small, prev, nxt, False


class CachingAllocator:
    """The allocator's state: two pools of cached free blocks (small, large), the live blocks by id, and the
    allocated / reserved byte counts with their peaks. `capacity` (bytes or None): what cudaMalloc can get
    in all; `max_split_size` (bytes or None = PyTorch's default, no limit)."""

    def __init__(self, capacity: int | None = None, max_split_size: int | None = None):
        if capacity is not None:
            pos_int("capacity", capacity, what="a positive int of bytes or None")
        if max_split_size is not None:
            int_at_least("max_split_size", max_split_size, kLargeBuffer, what="an int of bytes >= 20 MiB or None")
        self.capacity = capacity
        self.max_split = max_split_size if max_split_size is not None else float("inf")
        self._pools = {True: [], False: []}              # sorted lists of (size, addr, block)
        self._live: dict = {}
        self._addr = itertools.count(0, 1 << 40)         # segment base addresses, far apart, increasing
        self.allocated = self.reserved = self.max_allocated = self.max_reserved = 0
        self.segments = self.max_segments = self.releases = 0
        self.oom = None                                  # (id, bytes) of the request that found no memory

    # ------------------------------------------------------------------ pools
    def _insert(self, b):
        bisect.insort(self._pools[b.small], (b.size, b.addr, b))

    def _remove(self, b):
        pool = self._pools[b.small]
        del pool[bisect.bisect_left(pool, (b.size, b.addr))]   # (size, addr) sorts just before its entry

    def _free_block(self, size, small):                  # get_free_block
        pool = self._pools[small]
        i = bisect.bisect_left(pool, (size, -1))          # the first block of at least `size` bytes
        if i == len(pool):
            return None
        b = pool[i][2]
        if not small and ((size < self.max_split <= b.size) or
                          (size >= self.max_split and b.size >= size + kLargeBuffer)):
            return None
        del pool[i]
        return b

    def _new_segment(self, size, small):                 # alloc_block: cudaMalloc
        seg = allocation_size(size)
        if self.capacity is not None and self.reserved + seg > self.capacity:
            return None
        self.reserved += seg
        self.segments += 1
        self.max_reserved = max(self.max_reserved, self.reserved)
        self.max_segments = max(self.max_segments, self.segments)
        return _Block(seg, next(self._addr), small)

    def release_cached(self) -> int:
        """release_cached_blocks: cudaFree every cached segment that is wholly free; returns the bytes freed."""
        freed = 0
        for small, pool in self._pools.items():
            keep = []
            for e in pool:
                b = e[2]
                if b.prev is None and b.next is None:    # not split: a whole segment
                    freed += b.size
                    self.segments -= 1
                else:
                    keep.append(e)
            self._pools[small] = keep
        self.reserved -= freed
        self.releases += 1 if freed else 0
        return freed

    # ------------------------------------------------------------------ malloc / free
    def malloc(self, uid, nbytes: int) -> bool:
        """Allocate `nbytes` for id `uid`; False (and `oom` set) when even a retry after release_cached fails.
        A request of 0 bytes allocates nothing (PyTorch returns a null pointer for it)."""
        if uid in self._live:
            raise ValueError(f"uid {uid!r} is already allocated (free it first)")
        if nbytes == 0:
            self._live[uid] = None
            return True
        size = round_size(nbytes)
        small = size <= kSmallSize
        b = self._free_block(size, small)
        if b is None:
            b = self._new_segment(size, small)
            if b is None and self.release_cached():
                b = self._new_segment(size, small)
            if b is None:
                self.oom = (uid, nbytes)
                return False
        rest = b.size - size
        if rest >= kMinBlockSize if small else (size < self.max_split and rest > kSmallSize):   # should_split
            r = _Block(rest, b.addr + size, small, b, b.next)
            if b.next is not None:
                b.next.prev = r
            b.next, b.size = r, size
            self._insert(r)
        b.allocated = True
        self._live[uid] = b
        self.allocated += b.size
        self.max_allocated = max(self.max_allocated, self.allocated)
        return True

    def free(self, uid):
        """Free id `uid`'s block into its pool, merged with free neighbours (free_block, try_merge_blocks)."""
        if uid not in self._live:
            raise ValueError(f"uid {uid!r} is not allocated")
        b = self._live.pop(uid)
        if b is None:
            return
        b.allocated = False
        self.allocated -= b.size
        for n in (b.prev, b.next):
            if n is not None and not n.allocated:
                self._remove(n)
                if n is b.prev:
                    b.addr, b.prev = n.addr, n.prev
                    if n.prev is not None:
                        n.prev.next = b
                else:
                    b.next = n.next
                    if n.next is not None:
                        n.next.prev = b
                b.size += n.size
        self._insert(b)

    def stats(self) -> dict:
        return {"max_allocated": self.max_allocated, "max_reserved": self.max_reserved,
                "segments": self.max_segments, "allocated": self.allocated, "reserved": self.reserved,
                "releases": self.releases, "oom": self.oom}


def replay(events, capacity: int | None = None, max_split_size: int | None = None, repeat_from: int | None = None,
           repeats: int = 0) -> dict:
    """Run `events`, a list of ("alloc", id, nbytes) and ("free", id), through a fresh `CachingAllocator`.
    Returns {"max_allocated", "max_reserved", "segments" (the most held at once), "allocated", "reserved" (at the
    end), "releases" (how often cached segments were released to make room), "oom" (None, or (id, bytes) of the
    first request that did not fit `capacity`; the replay stops there)}.

    repeat_from, repeats: run events[repeat_from:] `repeats` more times after the whole list (a training loop's
    later steps: ids born in that part get fresh ids each time; a free of an id born before it is skipped, as that
    block is already gone), so that the peaks are the steady state's, not the first step's."""
    if not isinstance(events, (list, tuple)):
        raise TypeError(f"events must be a list of ('alloc', id, nbytes) / ('free', id) tuples, "
                        f"got {type(events).__name__}")
    pos_int("repeats", repeats, zero_ok=True)
    if repeats and (not is_int(repeat_from) or not 0 <= repeat_from <= len(events)):
        raise ValueError(f"repeat_from must be an index into events (0..{len(events)}) when repeats > 0, "
                         f"got {repeat_from!r}")
    a = CachingAllocator(capacity, max_split_size)
    born = {e[1] for e in events[repeat_from:] if e[0] == "alloc"} if repeats else set()
    for r in range(repeats + 1):
        for i, e in enumerate(events if r == 0 else events[repeat_from:]):
            if not isinstance(e, tuple) or e[0] not in ("alloc", "free"):
                raise ValueError(f"events[{i}] must be ('alloc', id, nbytes) or ('free', id), got {e!r}")
            uid = e[1] if r == 0 or e[1] not in born else (r, e[1])
            if e[0] == "alloc":
                if not is_int(e[2]) or e[2] < 0:
                    raise ValueError(f"events[{i}]: nbytes must be a non-negative int, got {e[2]!r}")
                if not a.malloc(uid, e[2]):
                    return a.stats()
            elif r == 0 or e[1] in born:
                a.free(uid)
    return a.stats()


def least_capacity(events, **replay_kw) -> int:
    """The least device memory (a multiple of kRoundLarge, 2 MiB, as every segment is) in which `replay(events,
    capacity=..., **replay_kw)` runs to the end: the allocator frees its cached segments and retries before it
    fails, so a card needs this much, less than the `max_reserved` it caches when it has room. Found by bisection
    between the allocated peak and that `max_reserved` (assumes that more memory never fails where less ran)."""
    free = replay(events, **replay_kw)
    lo = -(-free["max_allocated"] // kRoundLarge)        # in units of 2 MiB
    hi = -(-free["max_reserved"] // kRoundLarge)
    while lo < hi:
        mid = (lo + hi) // 2
        if replay(events, capacity=max(mid, 1) * kRoundLarge, **replay_kw)["oom"] is None:
            hi = mid
        else:
            lo = mid + 1
    return lo * kRoundLarge


def _stream(tracker):
    """(event, phase) pairs of a tracker's event log (see `events_from_tracker`)."""
    log = getattr(tracker, "_events", None)
    if log is None or not getattr(tracker, "keep_timeline", False):
        raise ValueError("tracker must be a memlab MemoryTracker made with timeline=True "
                         "(VirtualGPU.run(..., timeline=True))")
    size, cur = {}, {}
    for seq, phase, uid, delta in log:
        if seq == uid:                                   # birth
            size[uid], cur[uid] = delta, uid
            yield ("alloc", uid, delta), phase
        elif uid not in size:                            # freed after a resize to 0 bytes: already gone
            continue
        elif delta <= 0 and -delta == size[uid]:         # death
            yield ("free", cur.pop(uid)), phase
            del size[uid]
        else:                                            # resized: a new block, then the old one freed
            new = (uid, seq)
            size[uid] += delta
            yield ("alloc", new, size[uid]), phase
            yield ("free", cur[uid]), phase
            cur[uid] = new


def events_from_tracker(tracker) -> list[tuple]:
    """The ordered allocation stream a memlab `MemoryTracker` saw (it keeps it when made with timeline=True, as
    `VirtualGPU.run(..., timeline=True)` does): ("alloc", id, nbytes) and ("free", id). A storage resized in place
    is a new allocation of the new size and the old one freed, as a CUDA resize_ copies into a new block."""
    return [e for e, _ in _stream(tracker)]


def step_start(tracker, phase: str = "forward") -> int | None:
    """The index in `events_from_tracker(tracker)` where the first `phase` begins, moved back over the "idle"
    events just before it (a training loop makes its batch there): where a training step's events start, for
    `replay(..., repeat_from=)`. None when the tracker saw no such phase."""
    phases = [ph for _, ph in _stream(tracker)]
    if phase not in phases:
        return None
    i = phases.index(phase)
    while i and phases[i - 1] == "idle":
        i -= 1
    return i
