"""Choosing a batch size with memory, speed and convergence in view, and when memory is really allocated.

Batch size as a Pareto frontier: each batch size B is a point (peak memory, time to reach a given loss). The time
is (steps needed) x (seconds per step); McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training")
model the steps as S(B) = S_min (1 + B_noise / B) and the samples as E(B) = E_min (1 + B / B_noise),
with B_noise estimated by the gradient noise scale B_simple = tr(Sigma) / |G|^2. `noise_scale`
is lesson 04's per-sample estimator; `pareto_front` keeps the points no other point beats on every axis.

Lazy vs eager: `resident_bytes` reads how much of this process's memory the operating system has actually
backed with RAM (Linux /proc/self/statm): a large torch.empty on the CPU is address space until its pages are
first written.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from ..core.validate import is_number, pos_float

__all__ = ["noise_scale", "steps_and_samples", "pareto_front", "resident_bytes"]


def noise_scale(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn=None) -> float:
    """B_simple = tr(Sigma) / |G|^2 at the model's current parameters, from per-sample gradients (torch.func
    vmap over grad): tr(Sigma) is the per-coordinate variance of the N per-sample gradients, summed, and |G|^2 is
    |mean gradient|^2 - tr(Sigma) / N (unbiased). loss_fn(logits, targets) defaults to cross-entropy."""
    from torch.func import functional_call, grad, vmap
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    for nm, t in (("x", x), ("y", y)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{nm} must be a torch.Tensor, got {type(t).__name__}")
    if len(x) != len(y) or len(x) < 2:
        raise ValueError(f"x and y must hold the same number (>= 2) of samples, got {len(x)} and {len(y)}")
    loss_fn = torch.nn.functional.cross_entropy if loss_fn is None else loss_fn
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable(logits, targets), got {type(loss_fn).__name__}")
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}

    def loss_one(p, xi, yi):
        return loss_fn(functional_call(model, p, (xi[None],)), yi[None])

    g = vmap(grad(loss_one), in_dims=(None, 0, 0))(params, x, y)
    g = torch.cat([v.flatten(1) for v in g.values()], dim=1)            # (N, n_params)
    n = g.shape[0]
    tr_sigma = g.var(dim=0).sum()
    g2 = g.mean(dim=0).pow(2).sum() - tr_sigma / n
    return float(tr_sigma / g2)


def steps_and_samples(batch: float, b_noise: float) -> tuple[float, float]:
    """(S / S_min, E / E_min) = (1 + b_noise / batch, 1 + batch / b_noise) (McCandlish et al. 2018)."""
    pos_float("batch", batch, finite=True)
    pos_float("b_noise", b_noise, finite=True)
    return 1 + b_noise / batch, 1 + batch / b_noise


def pareto_front(points) -> list[int]:
    """Indices of the points that no other point dominates, every coordinate to be minimised (a point dominates
    another when it is no worse on every coordinate and better on one), in input order. Equal points all stay."""
    if not isinstance(points, (list, tuple)) or not points:
        raise TypeError(f"points must be a non-empty list of equal-length tuples of numbers, got {points!r}")
    dims = None
    for i, p in enumerate(points):
        if not isinstance(p, (list, tuple)) or not p or not all(is_number(v) for v in p):
            raise TypeError(f"points[{i}] must be a tuple of numbers, got {p!r}")
        if dims is not None and len(p) != dims:
            raise ValueError(f"points[{i}] has {len(p)} coordinates, points[0] has {dims}")
        dims = len(p)

    def dominates(a, b):
        return all(u <= v for u, v in zip(a, b)) and any(u < v for u, v in zip(a, b))

    return [i for i, p in enumerate(points) if not any(dominates(q, p) for q in points)]


def resident_bytes() -> int | None:
    """This process's resident set size in bytes (pages backed by RAM), from /proc/self/statm; None where that
    file does not exist (macOS, Windows)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
