"""fastpar's environment variables, read with errors that name them."""
from __future__ import annotations

import math
import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def number(name: str, default, kind=int, *, minimum=0):
    """``name`` as a ``kind`` (int or float) of at least ``minimum``; ``default`` when it
    is unset or empty. NaN and infinities are refused (float() reads them)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise ValueError(f"environment variable {name} must be {what}, got {raw!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"environment variable {name} must be a finite number, got {raw!r}")
    if value < minimum:
        raise ValueError(f"environment variable {name} must be at least {minimum}, got {raw!r}")
    return value


def flag(name: str, default: bool) -> bool:
    """``name`` as a switch: 1/true/yes/on or 0/false/no/off (any case); ``default`` when
    it is unset or empty."""
    raw = os.environ.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"environment variable {name} must be one of {', '.join(_TRUE + _FALSE)}, got {raw!r}")


def text(name: str, default: str) -> str:
    """``name`` stripped; ``default`` when it is unset or empty."""
    return os.environ.get(name, "").strip() or default
