"""Numba in-place scale: every tensor of a group multiplied (or divided) by one scalar,
in one launch.

A ``prange`` over the group's chunk map, each iteration scaling up to ``chunk``
elements of one tensor through a single pointer. ``flatten`` with the source as its own
destination computes the same values, but reads and writes through two pointers that
LLVM cannot prove disjoint, so its loop stays scalar and runs at half the speed of
``Tensor.mul_``; with one pointer there is nothing to disprove and the loop vectorises.
"""
from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from .. import _launch
from . import _common as C

#: Elements per parallel iteration (as flatten's; ``fastpar.autotune`` tunes the key
#: ``("scale", "numba", ...)`` if its search space lists one).
DEFAULT_CHUNK = 65536
#: Below this many bytes moved (read + written), run on the calling thread (see
#: flatten.py).
DEFAULT_PARALLEL_MIN_BYTES = 4 << 20

#: dtypes the kernel scales (values are loaded and rounded back like ``Tensor.mul_``).
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@functools.cache
def _scale_kernel_for(kind: str, divide: bool, parallel: bool):
    load = C.LOADS[kind]
    store = C.STORES[kind]

    # error_model="numpy": no per-division zero check (which would keep the loop from
    # vectorising); x / 0 gives inf/nan as torch's does.
    @numba.njit(parallel=parallel, nogil=True, error_model="numpy")
    def _scale_kernel(
        addrs,  # int64[N]: address of each tensor's first element
        numels,  # int64[N]: elements per tensor
        block_tensor,  # int32[B]: tensor (position in this group) each block scales
        block_start,  # int64[B]: first element of the tensor this block scales
        chunk,  # elements per block
        factor,  # multiplier or divisor, in the compute type (float32, or float64)
        proto,  # empty array: its dtype is the storage type
    ):
        size = proto.itemsize
        for b in numba.prange(block_tensor.shape[0]):
            t = block_tensor[b]
            lo = block_start[b]
            m = min(chunk, numels[t] - lo)
            # One view for reading and writing: no aliasing question for LLVM to answer.
            a = numba.carray(C.address_as_pointer(addrs[t] + lo * size, proto), (m,))
            # Unsigned indices: no negative-index wrap-around, so LLVM vectorises.
            for i in range(np.uint64(m)):
                if divide:
                    store(a, i, load(a, i) / factor)
                else:
                    store(a, i, load(a, i) * factor)

    return _scale_kernel


def bind(group, factor: float, divide: bool, *, chunk: int = DEFAULT_CHUNK,
         parallel_min_bytes: int = DEFAULT_PARALLEL_MIN_BYTES):
    """:func:`scale`'s launch with every argument resolved: a callable taking no
    arguments that runs it (and counts it), or None when ``group`` has nothing to scale.

    For callers that scale the same tensors every step (the DDP hooks): calling the
    result skips the dtype lookups, the chunk map and the argument set-up, a few
    microseconds per launch. The callable holds the tensors' addresses, not the tensors:
    it must not outlive them. Arguments as for :func:`scale`.
    """
    if group.dtype not in DTYPES:
        raise TypeError(
            f"group must hold {', '.join(map(str, DTYPES))} tensors to be scaled, got {group.dtype}"
        )
    if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk must be a positive int (elements per block), got {chunk!r}")
    kind, storage = C.KINDS[group.dtype]
    parallel = group.numel * 2 * group.dtype.itemsize >= parallel_min_bytes and C.parallel_ok()
    chunk = C.balanced_chunk(group.numels, chunk, parallel)
    block_tensor, block_start = group.blocks(chunk)
    if len(block_tensor) == 0:
        return None
    kernel = _scale_kernel_for(kind, bool(divide), parallel)
    args = (group.addrs, group.numels, block_tensor, block_start, chunk,
            C.compute_scale(group.dtype, group.dtype, factor), np.empty(0, storage))
    record = _launch.launches.record

    launch = C.bound_launch(kernel, parallel, lambda: _scale_kernel_for(kind, bool(divide), False))

    def run() -> None:
        launch(*args)
        record("numba", "scale")

    return run


def scale(group, factor: float, divide: bool, *, chunk: int = DEFAULT_CHUNK,
          parallel_min_bytes: int = DEFAULT_PARALLEL_MIN_BYTES) -> None:
    """Replace every tensor of ``group`` by ``t * factor`` (or ``t / factor`` when
    ``divide``), computed in float32 (float64 for float64 tensors) and rounded once to
    the tensor's dtype: what ``Tensor.mul_`` / ``Tensor.div_`` with a Python scalar
    compute on CPU, bit for bit (a NaN's payload aside: torch's own
    kernels give 0x7FC0 or 0xFFFF for a bfloat16 NaN, depending on the path). One launch.

    Args:
        group (Group): the tensors (float32, float64, float16 or bfloat16; one dtype).
        factor (float): the multiplier, or the divisor when ``divide``.
        divide (bool): divide (correctly rounded ``x / factor``) instead of multiplying;
            the two agree only where ``1 / factor`` is exact (a power of two).
        chunk (int): elements per parallel iteration.
        parallel_min_bytes (int): below this many bytes read + written, run on the
            calling thread.

    Raises:
        TypeError: ``group`` holds tensors of another dtype.
    """
    run = bind(group, factor, divide, chunk=chunk, parallel_min_bytes=parallel_min_bytes)
    if run is not None:
        run()
