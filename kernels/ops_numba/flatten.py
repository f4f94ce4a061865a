"""Numba multi-tensor copy: flatten (tensors -> flat) and unflatten_into (flat -> tensors).

One launch per dtype group: a ``prange`` over the group's chunk map, each iteration
copying up to ``chunk`` elements of one tensor, cast and optionally scaled on the way.
"""
from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from .. import _launch
from . import _common as C

#: Elements per parallel iteration (tuned by ``fastpar.autotune``).
DEFAULT_CHUNK = 65536
#: Below this many bytes moved, run on the calling thread: waking the thread pool costs
#: more than it saves, and on a busy machine a parallel region can wait a whole
#: scheduler quantum (~4-8 ms) for a descheduled worker.
DEFAULT_PARALLEL_MIN_BYTES = 4 << 20


@functools.cache
def _copy_kernel_for(src_kind: str, dst_kind: str, scaled: bool, to_flat: bool, parallel: bool):
    load = C.LOADS[src_kind]
    store = C.STORES[dst_kind]

    @numba.njit(parallel=parallel, nogil=True)
    def _copy_kernel(
        addrs,  # int64[N]: address of each tensor's first element
        numels,  # int64[N]: elements per tensor
        offsets,  # int64[N]: element offset of each tensor in the flat buffer
        block_tensor,  # int32[B]: tensor (position in this group) each block copies
        block_start,  # int64[B]: first element of the tensor this block copies
        chunk,  # elements per block
        flat_addr,  # address of the flat buffer's first element
        scale,  # multiplier in the compute type (ignored unless scaled)
        src_proto,  # empty array: its dtype is the source storage type
        dst_proto,  # empty array: its dtype is the destination storage type
    ):
        src_size = src_proto.itemsize
        dst_size = dst_proto.itemsize
        for b in numba.prange(block_tensor.shape[0]):
            t = block_tensor[b]
            lo = block_start[b]
            m = min(chunk, numels[t] - lo)
            if to_flat:
                src_addr = addrs[t] + lo * src_size
                dst_addr = flat_addr + (offsets[t] + lo) * dst_size
            else:
                src_addr = flat_addr + (offsets[t] + lo) * src_size
                dst_addr = addrs[t] + lo * dst_size
            s = numba.carray(C.address_as_pointer(src_addr, src_proto), (m,))
            d = numba.carray(C.address_as_pointer(dst_addr, dst_proto), (m,))
            # Unsigned indices: Numba skips negative-index wrap-around for them, which
            # lets LLVM vectorise the loop (6x faster than a signed index here).
            for i in range(np.uint64(m)):
                v = load(s, i)
                if scaled:
                    v = v * scale
                store(d, i, v)

    return _copy_kernel


def _launch_copy(group, flat: torch.Tensor, flat_dtype, scale, to_flat: bool, chunk: int,
                 parallel_min_bytes: int) -> None:
    src_dtype, dst_dtype = (group.dtype, flat_dtype) if to_flat else (flat_dtype, group.dtype)
    raw = src_dtype == dst_dtype and scale is None
    src_kind, src_np = C.storage(src_dtype, raw)
    dst_kind, dst_np = C.storage(dst_dtype, raw)
    parallel = group.numel * (src_dtype.itemsize + dst_dtype.itemsize) >= parallel_min_bytes
    kernel = _copy_kernel_for(src_kind, dst_kind, scale is not None, to_flat, parallel)
    block_tensor, block_start = group.blocks(chunk)
    if len(block_tensor) == 0:
        return
    kernel(
        group.addrs, group.numels, group.offsets, block_tensor, block_start, chunk,
        flat.data_ptr(),
        C.compute_scale(src_dtype, dst_dtype, 1.0 if scale is None else scale),
        np.empty(0, src_np), np.empty(0, dst_np),
    )
    _launch.launches.record("numba", "flatten" if to_flat else "unflatten_into")


def flatten(group, out: torch.Tensor, scale: float | None, *, chunk: int = DEFAULT_CHUNK,
            parallel_min_bytes: int = DEFAULT_PARALLEL_MIN_BYTES) -> None:
    """Copy every tensor of ``group`` into ``out[offset : offset + numel]``, cast to
    ``out.dtype`` and multiplied by ``scale`` when given. One launch."""
    _launch_copy(group, out, out.dtype, scale, True, chunk, parallel_min_bytes)


def unflatten_into(group, flat: torch.Tensor, scale: float | None, *, chunk: int = DEFAULT_CHUNK,
                   parallel_min_bytes: int = DEFAULT_PARALLEL_MIN_BYTES) -> None:
    """Copy ``flat[offset : offset + numel]`` into every tensor of ``group``, cast to
    the group's dtype and multiplied by ``scale`` when given. One launch."""
    _launch_copy(group, flat, flat.dtype, scale, False, chunk, parallel_min_bytes)
