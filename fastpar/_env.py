"""fastpar's environment variables, read with errors that name them."""
from __future__ import annotations

import math
import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _get(name: str) -> str:
    """``os.environ.get(name, "")``, without the ``KeyError`` that a miss raises and
    catches inside ``os.environ`` (``Mapping.get``): 1.5 us a call, a sizeable share of a
    DDP hook's pass over a 1 MB bucket, which reads ``FASTPAR_BACKEND`` every call. The
    standard ``os._Environ`` keeps its encoded names and values in the dict ``_data``,
    written through by every assignment (monkeypatch.setenv included); anything else
    standing in for ``os.environ`` is read through its own ``get``."""
    env = os.environ
    if type(env) is not _ENVIRON:
        return env.get(name, "")
    value = env._data.get(env.encodekey(name))
    return "" if value is None else env.decodevalue(value)


#: CPython's class of ``os.environ`` (None elsewhere: every read then goes through ``get``).
_ENVIRON = getattr(os, "_Environ", None)


def number(name: str, default, kind=int, *, minimum=0):
    """``name`` as a ``kind`` (int or float) of at least ``minimum``; ``default`` when it
    is unset or empty. NaN and infinities are refused (float() reads them)."""
    raw = _get(name).strip()
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
    raw = _get(name).strip().lower()
    if not raw:
        return default
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"environment variable {name} must be one of {', '.join(_TRUE + _FALSE)}, got {raw!r}")


def text(name: str, default: str) -> str:
    """``name`` stripped; ``default`` when it is unset or empty."""
    return _get(name).strip() or default
