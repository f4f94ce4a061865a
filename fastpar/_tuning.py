"""Tuned launch parameters, read once from saved autotune results (see
``fastpar.autotune``); defaults for anything not tuned."""
from __future__ import annotations


def params(op: str, backend: str, src_dtype, dst_dtype, numel: int) -> dict:
    """Keyword arguments (``block``/``num_warps`` or ``chunk``) for one launch."""
    return {}
