"""matplotlib figures the lessons share: a stacked breakdown bar, a memory
timeline with phase bands, and a trade-off curve. Each returns the Axes."""

from __future__ import annotations

from typing import Mapping, Sequence

from .core.track import CATEGORIES, MemoryTracker, Sample
from .core.validate import int_at_least

__all__ = ["COLORS", "breakdown_bar", "timeline", "tradeoff"]

COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer": "#55A868",
          "activations": "#C44E52", "temporaries": "#8172B3"}
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _ax(ax):
    import matplotlib.pyplot as plt
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    return ax


def _unit(unit):
    if unit not in _UNITS:
        raise ValueError(f"unit must be one of {list(_UNITS)}, got {unit!r}")
    return _UNITS[unit]


def _bar_label(label: str, width: int = 14) -> str:
    import textwrap
    return "\n".join(textwrap.wrap(str(label), width)) or str(label)


def breakdown_bar(breakdowns: Mapping[str, Mapping[str, int]], unit: str = "MiB", ax=None, title=None,
                  capacity: int | None = None, wrap: int = 14):
    """One stacked bar per entry: {"label": {"parameters": bytes, ...}, ...}.

    A value may also be a `memlab.VirtualRun`: its peak breakdown, and if it ran out of memory, the
    allocation that failed drawn on top (hatched), so the bar reaches past the capacity line as the
    failed request did. `capacity` (bytes) draws a horizontal line: the GPU's memory. Labels are
    wrapped to `wrap` characters per line so that they do not overlap."""
    if not isinstance(breakdowns, Mapping) or not breakdowns:
        raise ValueError("breakdowns must be a non-empty mapping of label -> {category: bytes} or VirtualRun")
    int_at_least("wrap", wrap, 4, what="an int >= 4 (characters per label line)")
    div = _unit(unit)
    failed = {}
    parts = {}
    for k, v in breakdowns.items():
        if hasattr(v, "peak_breakdown") and hasattr(v, "fits"):          # a VirtualRun
            parts[k] = v.peak_breakdown
            failed[k] = 0 if v.fits else getattr(v, "request", 0)
        elif isinstance(v, Mapping):
            parts[k] = v
        else:
            raise TypeError(f"breakdowns[{k!r}] must be a mapping of category -> bytes or a VirtualRun, "
                            f"got {type(v).__name__}")
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(parts) + 2.5), 3.8))
    labels = list(parts)
    xs = range(len(labels))
    bottoms = [0.0] * len(labels)
    for c in CATEGORIES:
        vals = [parts[k].get(c, 0) / div for k in labels]
        if any(vals):
            ax.bar(xs, vals, bottom=bottoms, color=COLORS[c], label=c)
            bottoms = [b + v for b, v in zip(bottoms, vals)]
    if any(failed.values()):
        vals = [failed.get(k, 0) / div for k in labels]
        ax.bar(xs, vals, bottom=bottoms, color="white", edgecolor="#C44E52", hatch="//",
               label="failed allocation (OOM)")
    ax.set_xticks(list(xs), [_bar_label(k, wrap) for k in labels], fontsize=8)
    if capacity is not None:
        ax.axhline(capacity / div, color="k", ls="--", lw=1)
        ax.text(len(labels) - 0.5, capacity / div, " capacity", va="bottom", ha="right")
    ax.set_ylabel(unit)
    ax.set_title(title or "memory by category")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax


def timeline(tracker_or_samples: MemoryTracker | Sequence[Sample], unit: str = "MiB", ax=None, title=None,
             stacked: bool = True):
    """Live bytes after every allocation/free, stacked by category, with the
    phases (forward/backward/step) as shaded bands."""
    samples = tracker_or_samples.timeline if isinstance(tracker_or_samples, MemoryTracker) else list(tracker_or_samples)
    if not samples:
        raise ValueError("no samples: was the tracker created with timeline=True and used in a `with` block?")
    div = _unit(unit)
    ax = _ax(ax)
    xs = list(range(len(samples)))
    if stacked:
        ys = [[s.by_category[c] / div for s in samples] for c in CATEGORIES]
        ax.stackplot(xs, *ys, labels=CATEGORIES, colors=[COLORS[c] for c in CATEGORIES], step="post")
    else:
        ax.step(xs, [s.total / div for s in samples], where="post", color="k")
    band_colors = {"forward": "#e8f0fa", "backward": "#fbeaea", "step": "#eaf6ec"}
    start = 0
    for i in range(1, len(samples) + 1):
        if i == len(samples) or samples[i].phase != samples[start].phase:
            ph = samples[start].phase
            if ph != "idle":
                ax.axvspan(start, i, color=band_colors.get(ph, "#f2f2f2"), zorder=-1)
                ax.text((start + i) / 2, 1.0, ph, transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                        fontsize=8)
            start = i
    ax.set_xlabel("allocation / free event")
    ax.set_ylabel(unit)
    ax.set_title(title or "live memory over one step", pad=14)
    if stacked:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax


def tradeoff(xs: Sequence[float], series: Mapping[str, Sequence[float]], xlabel: str, ylabel: str, ax=None,
             title=None, logx: bool = False, logy: bool = False):
    """Lines for several named series over the same x (e.g. measured vs predicted)."""
    if not isinstance(series, Mapping) or not series:
        raise ValueError("series must be a non-empty mapping of name -> values")
    ax = _ax(ax)
    for name, ys in series.items():
        if len(ys) != len(xs):
            raise ValueError(f"series {name!r} has {len(ys)} values for {len(xs)} x values")
        ax.plot(xs, ys, marker="o", label=name, ls="--" if "predict" in name.lower() else "-")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_title(title or "")
    ax.legend(fontsize=8)
    return ax
