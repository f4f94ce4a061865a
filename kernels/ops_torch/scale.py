"""Reference in-place scale in plain torch ops (one op per tensor; not counted as
launches). Same contract as the Triton and Numba launchers."""
from __future__ import annotations

import torch


@torch.no_grad()  # (the kernels write outside autograd: results carry no history)
def scale(group, factor: float, divide: bool) -> None:
    """Replace every tensor ``t`` of ``group`` by ``t * factor`` (``t / factor`` when
    ``divide``), computed in float32 (float64 for float64) and rounded once to its dtype."""
    for t in group.tensors:
        compute = torch.float64 if t.dtype == torch.float64 else torch.float32
        # A Python scalar does not promote a float32 tensor: the arithmetic is float32.
        x = t.to(compute)
        t.data.copy_(x / factor if divide else x * factor)  # (.data: the caller bumps its version once)
