"""Exercise 10's references, written plainly for the check (never the solution, never memlab.planning's planner):

- task 10.1: each storage's lifetime found by scanning forward from its "alloc" event and counting the tensors on
  it (`storage_lifetimes`), and the most bytes alive at one moment found by evaluating every moment a tensor is
  born (`live_peak`: the live bytes only rise at a birth);
- task 10.2: every pair of tensors that are alive together and share a byte (`overlapping_pairs`), and the
  smallest arena by exhaustive search (`optimum`: every placement order, each tensor at the lowest aligned offset
  that fits beside the tensors already placed that it is alive with; an optimal plan, placed in the order of its
  offsets this way, lands no higher, so the best order gives the optimum);
- task 10.3: the separable block written with torch.nn.functional on the check's own parameters
  (`RefSeparable`), trained one step by autograd, its kept bytes measured with memlab's tracker.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from memlab.checkpointing import activation_peak

from .inputs import block_batch, conv_filters, out_side


# ----------------------------------------------------------------------------- task 10.1
def storage_lifetimes(events) -> list[tuple[int, int, int]]:
    """(size, birth, death) of each "alloc" event's storage, in the order of the allocs."""
    out = []
    for birth, e in enumerate(events):
        if e[0] != "alloc":
            continue
        storage, on, death = e[2], {e[1]}, len(events)
        for t in range(birth + 1, len(events)):
            f = events[t]
            if f[0] == "view" and f[2] == storage:
                on.add(f[1])
            elif f[0] == "free" and f[1] in on:
                on.discard(f[1])
                if not on:
                    death = t
                    break
        out.append((e[3], birth, death))
    return out


def live_peak(intervals) -> int:
    """max over every birth time b of the sizes alive at b (born at or before b, dying after b); 0 if none."""
    return max((sum(s for s, b, d in intervals if b <= t < d) for _, t, _ in intervals), default=0)


# ----------------------------------------------------------------------------- task 10.2
def alive_together(a, b) -> bool:
    """Two (size, birth, death) tensors that both hold bytes and are alive at a common moment."""
    return a[0] > 0 and b[0] > 0 and a[1] < b[2] and b[1] < a[2]


def overlapping_pairs(lifetimes, offsets) -> list[tuple[int, int]]:
    """(i, j), i < j, of every pair alive together whose byte ranges [offset, offset + size) intersect."""
    return [(i, j) for i in range(len(lifetimes)) for j in range(i + 1, len(lifetimes))
            if alive_together(lifetimes[i], lifetimes[j])
            and offsets[i] < offsets[j] + lifetimes[j][0] and offsets[j] < offsets[i] + lifetimes[i][0]]


def arena_of(lifetimes, offsets) -> int:
    return max((o + lt[0] for lt, o in zip(lifetimes, offsets) if lt[0]), default=0)


def _lowest(size: int, busy: list[tuple[int, int]], alignment: int) -> int:
    at = 0
    for start, end in sorted(busy):
        if at + size <= start:
            return at
        at = max(at, -(-end // alignment) * alignment)
    return at


def optimum(lifetimes, alignment: int = 1) -> int:
    """The smallest arena of any valid plan with offsets that are multiples of `alignment`: every order of the
    non-empty tensors, each placed at its lowest aligned fit (identical tensors are tried in one order only)."""
    nonempty = [i for i, lt in enumerate(lifetimes) if lt[0]]
    best = [sum(-(-lifetimes[i][0] // alignment) * alignment for i in nonempty)]     # everything stacked
    placed: dict[int, int] = {}

    def search(left: list[int], top: int):
        if top >= best[0]:
            return
        if not left:
            best[0] = top
            return
        tried = set()
        for i in left:
            if tuple(lifetimes[i]) in tried:
                continue
            tried.add(tuple(lifetimes[i]))
            busy = [(o, o + lifetimes[j][0]) for j, o in placed.items() if alive_together(lifetimes[i], lifetimes[j])]
            placed[i] = _lowest(lifetimes[i][0], busy, alignment)
            search([j for j in left if j != i], max(top, placed[i] + lifetimes[i][0]))
            del placed[i]

    search(nonempty, 0)
    return best[0] if nonempty else 0


# ----------------------------------------------------------------------------- task 10.3
class RefSeparable(nn.Module):
    """Depthwise 3x3 (groups=c_in, the stride) -> batch norm -> ReLU -> pointwise 1x1 -> batch norm -> ReLU, in
    torch.nn.functional on parameters and running statistics of its own."""

    def __init__(self, stride: int, dw: torch.Tensor, pw: torch.Tensor):
        super().__init__()
        c_out, c_in = pw.shape[:2]
        kw = {"device": dw.device}
        self.stride = stride
        self.dw, self.pw = nn.Parameter(dw), nn.Parameter(pw)
        self.g1, self.b1 = nn.Parameter(torch.ones(c_in, **kw)), nn.Parameter(torch.zeros(c_in, **kw))
        self.g2, self.b2 = nn.Parameter(torch.ones(c_out, **kw)), nn.Parameter(torch.zeros(c_out, **kw))
        for name, c in (("1", c_in), ("2", c_out)):
            self.register_buffer("mean" + name, torch.zeros(c, **kw))
            self.register_buffer("var" + name, torch.ones(c, **kw))

    def forward(self, x):
        h = F.conv2d(x, self.dw, stride=self.stride, padding=1, groups=x.shape[1])
        h = F.relu(F.batch_norm(h, self.mean1, self.var1, self.g1, self.b1, training=True, momentum=0.1))
        h = F.conv2d(h, self.pw)
        return F.relu(F.batch_norm(h, self.mean2, self.var2, self.g2, self.b2, training=True, momentum=0.1))


def reference_block(case) -> dict:
    """What the reference block does on the case's batch: output shape, output, gradients of the input and of the
    two filters, running statistics after the step, parameter bytes, and the bytes its forward keeps for backward
    (memlab's tracker)."""
    from .inputs import fingerprint
    block = RefSeparable(case["stride"], *conv_filters(case))
    x, w = block_batch(case)
    out = block(x)
    (out * w).sum().backward()
    got = {"shape": list(out.shape), "out": fingerprint(out), "x_grad": fingerprint(x.grad),
           "dw_grad": fingerprint(block.dw.grad), "pw_grad": fingerprint(block.pw.grad),
           "stats": [[block.mean1.tolist(), block.var1.tolist()], [block.mean2.tolist(), block.var2.tolist()]],
           "param_bytes": sum(p.numel() * p.element_size() for p in block.parameters())}
    x.grad = None
    got["kept"] = activation_peak(block, lambda: (block(x) * w).sum()).stored      # a second step, measured
    got["side"] = out_side(case)
    return got


def reference_kept_meta(case) -> dict:
    """The reference block's parameter bytes and the bytes its forward keeps for backward, measured with memlab's
    tracker on the meta device (shapes and byte counts, no memory): for sizes too large to run here."""
    c_in, c_out = case["c_in"], case["c_out"]
    with torch.device("meta"):
        block = RefSeparable(case["stride"], torch.empty(c_in, 1, 3, 3), torch.empty(c_out, c_in, 1, 1))
        x = torch.empty(case["batch"], c_in, case["side"], case["side"], requires_grad=True)
        side = out_side(case)
        w = torch.empty(case["batch"], c_out, side, side)
    kept = activation_peak(block, lambda: (block(x) * w).sum()).stored
    return {"param_bytes": sum(p.numel() * p.element_size() for p in block.parameters()), "kept": kept,
            "side": side}
