"""Reference multi-tensor copy in plain torch ops (one op per tensor; not counted as
launches). Same contract as the Triton and Numba launchers."""
from __future__ import annotations

import torch


def flatten(group, out: torch.Tensor, scale: float | None) -> None:
    for t, off, n in zip(group.tensors, group.offsets.tolist(), group.numels.tolist()):
        piece = out[off : off + n].view(t.shape)
        if scale is None:
            piece.copy_(t)
        else:
            compute = torch.float64 if torch.float64 in (t.dtype, out.dtype) else torch.float32
            piece.copy_(t.to(compute) * scale)


def unflatten_into(group, flat: torch.Tensor, scale: float | None) -> None:
    for t, off, n in zip(group.tensors, group.offsets.tolist(), group.numels.tolist()):
        piece = flat[off : off + n].view(t.shape)
        if scale is None:
            t.copy_(piece)
        else:
            compute = torch.float64 if torch.float64 in (t.dtype, flat.dtype) else torch.float32
            t.copy_(piece.to(compute) * scale)
