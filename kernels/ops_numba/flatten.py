"""Numba multi-tensor copy: flatten (tensors -> flat), unflatten_into (flat -> tensors)
and broadcast (tensors -> several flat buffers).

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
#: flatten and unflatten_into calls moving (reading + writing) at least this many bytes
#: write with streaming stores (the 32 MiB L3 of the machine it was measured on: a
#: smaller result may still be in cache when it is next read): plain copies, and casts
#: and scales among float32, float16 and bfloat16.
DEFAULT_STREAM_MIN_BYTES = 32 << 20
#: broadcast calls writing at least this many bytes (to all buffers together) write
#: with streaming stores.
DEFAULT_BROADCAST_STREAM_MIN_BYTES = 16 << 20


@functools.cache
def _copy_kernel_for(src_kind: str, dst_kind: str, scaled: bool, to_flat: bool, parallel: bool, stream: bool,
                     cast: tuple | None = None):
    """``stream``: a plain copy written with streaming stores (``C.copy_bytes``);
    ``cast``: (source, destination) ``C.CAST_KINDS`` of a cast or scale written with
    streaming stores (``C.cast_stream_for``); neither: the typed loop."""
    load = C.LOADS[src_kind]
    store = C.STORES[dst_kind]
    streamed_cast = cast is not None
    # (A stand-in without it: the branch that calls it is compiled either way.)
    cast_stream = C.cast_stream_for(*cast, scaled) if streamed_cast else C.cast_stream_for("f32", "f32", scaled)
    lanes = C.CAST_LANES

    @numba.njit(nogil=True, inline="always")
    def _typed_range(s, d, lo, hi, scale):
        # Unsigned indices: Numba skips negative-index wrap-around for them, which
        # lets LLVM vectorise the loop (6x faster than a signed index here).
        for i in range(np.uint64(lo), np.uint64(hi)):
            v = load(s, i)
            if scaled:
                v = v * scale
            store(d, i, v)

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
            if stream:
                # A large plain copy (same dtype, no scale; the bits move unchanged):
                # streaming stores skip reading each destination line first, a third
                # less memory traffic than a cached copy.
                C.copy_bytes(dst_addr, src_addr, m * src_size, True)
                C.store_fence()  # before this worker reports the block done
                continue
            s = numba.carray(C.address_as_pointer(src_addr, src_proto), (m,))
            d = numba.carray(C.address_as_pointer(dst_addr, dst_proto), (m,))
            # The typed loop covers [0, body) and [end, m): everything unless streamed.
            body = m
            end = m
            if streamed_cast:
                # A large cast or scale: the typed loop up to the first 32-byte boundary
                # of the destination, CAST_LANES elements at a time with streaming
                # stores from there, the typed loop for the rest. A destination not
                # aligned to its element size never reaches a boundary: all typed loop.
                head = min(m, ((-dst_addr) & 31) // dst_size)
                if ((dst_addr + head * dst_size) & 31) == 0:
                    body = head
                    end = head + (m - head) // lanes * lanes
                    for i in range(body, end, lanes):
                        cast_stream(dst_addr + i * dst_size, src_addr + i * src_size, np.float32(scale))
            _typed_range(s, d, 0, body, scale)
            _typed_range(s, d, end, m, scale)
            if streamed_cast:
                C.store_fence()  # before this worker reports the block done

    return _copy_kernel


def bind_copy(group, flat: torch.Tensor, scale, to_flat: bool, *, chunk: int = DEFAULT_CHUNK,
              parallel_min_bytes: int = DEFAULT_PARALLEL_MIN_BYTES,
              stream_min_bytes: int = DEFAULT_STREAM_MIN_BYTES):
    """The launch :func:`flatten` (``to_flat``) or :func:`unflatten_into` would make,
    with every argument resolved: a callable taking no arguments that runs it (and
    counts it), or None when ``group`` has nothing to copy.

    For callers that copy between the same buffers every step (the DDP hooks): calling
    the result skips the kernel choice, the chunk map and the argument set-up, several
    microseconds a launch. It holds addresses, not tensors: it must not outlive them."""
    src_dtype, dst_dtype = (group.dtype, flat.dtype) if to_flat else (flat.dtype, group.dtype)
    raw = src_dtype == dst_dtype and scale is None
    src_kind, src_np = C.storage(src_dtype, raw)
    dst_kind, dst_np = C.storage(dst_dtype, raw)
    moved = group.numel * (src_dtype.itemsize + dst_dtype.itemsize)  # bytes read + written
    parallel = moved >= parallel_min_bytes and C.parallel_ok()
    # Streamed only from stream_min_bytes moved: smaller results may still be in cache
    # when next read, and for small tensors the inline typed loop beats a memcpy call
    # each. Casts and scales stream among float32, float16 and bfloat16 (the kinds the
    # vector cast handles; others keep the typed loop at every size).
    big = C.HAS_STREAM and moved >= stream_min_bytes
    stream = raw and big
    cast = None
    if big and not raw and src_dtype in C.CAST_KINDS and dst_dtype in C.CAST_KINDS:
        cast = (C.CAST_KINDS[src_dtype], C.CAST_KINDS[dst_dtype])
    kernel = _copy_kernel_for(src_kind, dst_kind, scale is not None, to_flat, parallel, stream, cast)
    chunk = C.balanced_chunk(group.numels, chunk, parallel)
    block_tensor, block_start = group.blocks(chunk)
    if len(block_tensor) == 0:
        return None
    args = (
        group.addrs, group.numels, group.offsets, block_tensor, block_start, chunk,
        flat.data_ptr(),
        C.compute_scale(src_dtype, dst_dtype, 1.0 if scale is None else scale),
        np.empty(0, src_np), np.empty(0, dst_np),
    )
    record = _launch.launches.record
    op = "flatten" if to_flat else "unflatten_into"

    launch = C.bound_launch(kernel, parallel,
                            lambda: _copy_kernel_for(src_kind, dst_kind, scale is not None, to_flat, False, stream, cast))

    def run() -> None:
        launch(*args)
        record("numba", op)

    return run


def _launch_copy(group, flat: torch.Tensor, scale, to_flat: bool, chunk: int, parallel_min_bytes: int,
                 stream_min_bytes: int) -> None:
    run = bind_copy(group, flat, scale, to_flat, chunk=chunk, parallel_min_bytes=parallel_min_bytes,
                    stream_min_bytes=stream_min_bytes)
    if run is not None:
        run()


def flatten(group, out: torch.Tensor, scale: float | None, *, chunk: int = DEFAULT_CHUNK,
            parallel_min_bytes: int = DEFAULT_PARALLEL_MIN_BYTES,
            stream_min_bytes: int = DEFAULT_STREAM_MIN_BYTES) -> None:
    """Copy every tensor of ``group`` into ``out[offset : offset + numel]``, cast to
    ``out.dtype`` and multiplied by ``scale`` when given. One launch. A plain copy (same
    dtype, no scale), or a cast or scale among float32, float16 and bfloat16, reading and
    writing ``stream_min_bytes`` or more together writes with streaming stores."""
    _launch_copy(group, out, scale, True, chunk, parallel_min_bytes, stream_min_bytes)


def unflatten_into(group, flat: torch.Tensor, scale: float | None, *, chunk: int = DEFAULT_CHUNK,
                   parallel_min_bytes: int = DEFAULT_PARALLEL_MIN_BYTES,
                   stream_min_bytes: int = DEFAULT_STREAM_MIN_BYTES) -> None:
    """Copy ``flat[offset : offset + numel]`` into every tensor of ``group``, cast to
    the group's dtype and multiplied by ``scale`` when given. One launch. A plain copy
    or a cast or scale among float32, float16 and bfloat16, reading and writing
    ``stream_min_bytes`` or more together writes with streaming stores."""
    _launch_copy(group, flat, scale, False, chunk, parallel_min_bytes, stream_min_bytes)


@functools.cache
def _broadcast_kernel_for(parallel: bool):
    @numba.njit(parallel=parallel, nogil=True)
    def _broadcast_kernel(
        addrs,  # int64[N]: address of each tensor's first element
        numels,  # int64[N]: elements per tensor
        offsets,  # int64[N]: element offset of each tensor in every flat buffer
        block_tensor,  # int32[B]: tensor (position in this group) each block copies
        block_start,  # int64[B]: first element of the tensor this block copies
        chunk,  # elements per block
        flat_addrs,  # int64[D]: address of each destination flat buffer's first element
        itemsize,  # bytes per element (a raw copy: the bits move unchanged)
        stream,  # write pieces of STREAM_MIN_BYTES or more with streaming stores
    ):
        """Block ``b`` copies its piece of one tensor into all D buffers: the piece is
        read from memory once and from L2 for the other D - 1 copies, and large pieces
        are written with streaming stores (``_common.copy_bytes``), so D copies of S
        bytes move S + D * S bytes instead of the 3 * D * S of D separate ``copy_``s."""
        for b in numba.prange(block_tensor.shape[0]):
            t = block_tensor[b]
            lo = block_start[b]
            nbytes = min(chunk, numels[t] - lo) * itemsize
            src = addrs[t] + lo * itemsize
            dst_off = (offsets[t] + lo) * itemsize
            for k in range(flat_addrs.shape[0]):
                C.copy_bytes(flat_addrs[k] + dst_off, src, nbytes, stream)
            if stream:
                C.store_fence()  # before this worker reports the block done

    return _broadcast_kernel


def bind_broadcast(group, outs: list, *, chunk: int = DEFAULT_CHUNK,
                   parallel_min_bytes: int = DEFAULT_PARALLEL_MIN_BYTES,
                   stream_min_bytes: int = DEFAULT_BROADCAST_STREAM_MIN_BYTES):
    """The launch :func:`broadcast` would make, with every argument resolved and ``outs``
    checked: a callable taking no arguments that runs it (and counts it), or None when
    there is nothing to copy. As :func:`bind_copy`: for callers that pack the same
    tensors into the same buffers call after call (``rnn.pack`` with ``out=``), it holds
    addresses, not tensors, and must not outlive them."""
    if not outs:
        return None
    block_tensor, block_start = group.blocks(chunk)
    if len(block_tensor) == 0:
        return None
    itemsize = group.dtype.itemsize
    # The kernel copies raw bytes at raw addresses: a wrong buffer would be overrun, not
    # merely miscast, so this launcher checks what the others trust their callers for.
    need = int((group.offsets + group.numels).max())
    for k, o in enumerate(outs):
        if o.dtype != group.dtype or o.device.type != "cpu" or not o.is_contiguous() or o.numel() < need:
            raise ValueError(
                f"outs[{k}] must be a contiguous CPU tensor of dtype {group.dtype} with at least {need} "
                f"elements, got {o.dtype} on {o.device}, shape {tuple(o.shape)}, strides {o.stride()}"
            )
    parallel = group.numel * itemsize * (1 + len(outs)) >= parallel_min_bytes and C.parallel_ok()
    args = (
        group.addrs, group.numels, group.offsets, block_tensor, block_start, chunk,
        np.array([o.data_ptr() for o in outs], dtype=np.int64), itemsize,
        group.numel * itemsize * len(outs) >= stream_min_bytes,
    )
    launch = C.bound_launch(_broadcast_kernel_for(parallel), parallel, lambda: _broadcast_kernel_for(False))
    record = _launch.launches.record

    def run() -> None:
        launch(*args)
        record("numba", "broadcast")

    return run


def broadcast(group, outs: list, *, chunk: int = DEFAULT_CHUNK,
              parallel_min_bytes: int = DEFAULT_PARALLEL_MIN_BYTES,
              stream_min_bytes: int = DEFAULT_BROADCAST_STREAM_MIN_BYTES) -> None:
    """Copy every tensor of ``group`` into ``out[offset : offset + numel]`` of every
    ``out`` in ``outs`` (contiguous, of the group's dtype, none overlapping the group).
    One launch, whatever the number of tensors and buffers. When the call writes at
    least ``stream_min_bytes``, it writes with streaming stores (where the CPU has
    them): the buffers would not stay in cache anyway, and skipping the
    read-for-ownership of every destination line saves a third of the traffic."""
    run = bind_broadcast(group, outs, chunk=chunk, parallel_min_bytes=parallel_min_bytes,
                         stream_min_bytes=stream_min_bytes)
    if run is not None:
        run()
