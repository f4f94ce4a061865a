"""Reference multi-tensor copy in plain torch ops (one op per tensor; not counted as
launches). Same contract as the Triton and Numba launchers."""
from __future__ import annotations

import torch


def _pieces(group, flat: torch.Tensor):
    """Each tensor of ``group`` with its slice of ``flat``, shaped like it."""
    for t, off, n in zip(group.tensors, group.offsets.tolist(), group.numels.tolist()):
        yield t, flat[off : off + n].view(t.shape)


def _scaled(src: torch.Tensor, dst_dtype: torch.dtype, scale: float | None) -> torch.Tensor:
    if scale is None:
        return src
    compute = torch.float64 if torch.float64 in (src.dtype, dst_dtype) else torch.float32
    return src.to(compute) * scale


# The destinations are written through ``.data`` (a version counter of its own), as the
# other backends' kernels write without touching one: the caller bumps each destination
# once per call, as one in-place op would (``copy_`` into each would add one more, and one
# per tensor on the shared counter of ``out``).


@torch.no_grad()  # (the kernels write outside autograd: results carry no history)
def flatten(group, out: torch.Tensor, scale: float | None) -> None:
    for t, piece in _pieces(group, out.data):
        piece.copy_(_scaled(t, out.dtype, scale))


@torch.no_grad()  # (the kernels write outside autograd: results carry no history)
def unflatten_into(group, flat: torch.Tensor, scale: float | None) -> None:
    for t, piece in _pieces(group, flat):
        t.data.copy_(_scaled(piece, t.dtype, scale))


@torch.no_grad()  # (the kernels write outside autograd: results carry no history)
def broadcast(group, outs: list) -> None:
    for out in outs:
        flatten(group, out, None)
