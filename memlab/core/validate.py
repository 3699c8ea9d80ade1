"""Input checks shared by every public function of memlab: each raises a one-line ValueError or TypeError that
names the bad argument, says what is allowed and shows what it got.

    pos_int("batch", batch)                          # ValueError: batch must be a positive int, got 0
    pos_int("bucket", bucket, zero_ok=True)          # ... must be a non-negative int ...
    int_at_least("steps", steps, 2)                  # ... must be an int >= 2 ...
    pos_float("timeout", timeout)                    # ... must be a positive number ...
    number_in("headroom", headroom, 0, 1)            # ... must be a number in [0, 1) ...
    one_of("stage", stage, (0, 1, 2, 3))             # ... must be one of (0, 1, 2, 3) ...
    flag("fused", fused)                             # TypeError: fused must be a bool, got str

A bool is never a number here (True is an int to Python, not a batch size). Each check returns its value, so
`n = pos_int("n", n)` reads as one line. `what=` replaces the default description of what is allowed.
Importing this module imports nothing.
"""

from __future__ import annotations

import math

__all__ = ["is_int", "is_number", "pos_int", "int_at_least", "pos_float", "number_in", "number_type", "flag",
           "one_of"]


def is_int(v) -> bool:
    """True for an int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """True for an int or float that is not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def int_at_least(name: str, v, lo: int, what: str | None = None) -> int:
    """v must be an int >= lo (ValueError otherwise)."""
    if not is_int(v) or v < lo:
        raise ValueError(f"{name} must be {what or f'an int >= {lo}'}, got {v!r}")
    return v


def pos_int(name: str, v, *, zero_ok: bool = False, what: str | None = None) -> int:
    """v must be an int >= 1 (>= 0 with zero_ok) (ValueError otherwise)."""
    default = "a non-negative int" if zero_ok else "a positive int"
    return int_at_least(name, v, 0 if zero_ok else 1, what or default)


def pos_float(name: str, v, *, finite: bool = False, what: str | None = None) -> float:
    """v must be a number > 0 (and finite with finite=True) (ValueError otherwise)."""
    if not is_number(v) or not v > 0 or (finite and not math.isfinite(v)):
        default = "a positive finite number" if finite else "a positive number"
        raise ValueError(f"{name} must be {what or default}, got {v!r}")
    return v


def number_in(name: str, v, lo: float, hi: float, *, hi_open: bool = True, what: str | None = None) -> float:
    """v must be a number in [lo, hi) ([lo, hi] with hi_open=False) (ValueError otherwise)."""
    if not is_number(v) or not (lo <= v < hi if hi_open else lo <= v <= hi):
        raise ValueError(f"{name} must be {what or f'a number in [{lo}, {hi}' + (')' if hi_open else ']')}, "
                         f"got {v!r}")
    return v


def number_type(name: str, v, what: str = "a number") -> float:
    """v must be an int or float, not a bool (TypeError otherwise): the type half of a two-step check."""
    if not is_number(v):
        raise TypeError(f"{name} must be {what}, got {type(v).__name__}")
    return v


def flag(name: str, v) -> bool:
    """v must be True or False (TypeError otherwise: 1 and "yes" are not flags)."""
    if not isinstance(v, bool):
        raise TypeError(f"{name} must be a bool, got {type(v).__name__}")
    return v


def one_of(name: str, v, allowed, what: str | None = None):
    """v must be one of `allowed` (ValueError otherwise). A bool never matches 0 or 1."""
    if isinstance(v, bool) and not any(a is v for a in allowed):
        ok = False
    else:
        try:
            ok = v in allowed
        except TypeError:                      # an unhashable value tested against a set or dict
            ok = False
    if not ok:
        raise ValueError(f"{name} must be {what or f'one of {allowed}'}, got {v!r}")
    return v
