"""Triton multi-tensor copy: flatten (tensors -> flat) and unflatten_into (flat -> tensors).

One launch per dtype group, whatever the number of tensors: addresses come from an int64
pointer table in device memory (no 4 KB kernel-argument limit, unlike apex's and
``_foreach``'s by-value structs), and every program copies one ``BLOCK``-element piece
of one tensor, which it finds by a search of each tensor's first program
(``block_begin``, one entry per tensor: see ``_common.find_tensor``).
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .. import _launch
from ._common import (
    Kernel,
    align_elems,
    copy_types,
    find_tensor,
    keep_for_stream,
    storage_type,
    to_storage,
)

#: Elements per program (tuned by ``fastpar.autotune``).
DEFAULT_BLOCK = 2048
DEFAULT_NUM_WARPS = 4


@triton.jit
def _copy_kernel(
    table,  # *i64: addrs[N] | numels[N] | offsets[N] | block_begin[N]
    n_tensors,  # N, tensors in this group
    flat,  # the flat buffer (source if not TO_FLAT, else destination); bf16 as int16 bits
    scale: tl.float64,  # multiplier (used when SCALED), converted to COMPUTE
    SRC: tl.constexpr,  # element type read
    DST: tl.constexpr,  # element type written
    STORE: tl.constexpr,  # pointer type DST is stored through (int16 bits for bf16)
    COMPUTE: tl.constexpr,  # type the scale is applied in
    SCALED: tl.constexpr,  # multiply by scale on the way
    TO_FLAT: tl.constexpr,  # True: tensors -> flat; False: flat -> tensors
    ALIGN: tl.constexpr,  # >1: every address is 16-byte aligned and every numel and offset
    #                       a multiple of ALIGN elements, so loads/stores may be 128-bit
    BLOCK: tl.constexpr,  # elements per program
):
    """Program ``p`` copies elements ``[start, start + BLOCK)`` (clipped to the numel) of
    tensor ``t``, the last with ``block_begin[t] <= p``, ``start = (p - block_begin[t]) *
    BLOCK``, to or from ``flat[offsets[t] + start ...]``, converting SRC -> DST like
    ``Tensor.to`` and multiplying by ``scale`` in COMPUTE when SCALED. Programs never
    overlap."""
    # The tensor's entries, read inline: Triton 3.6 (torch 2.11's) loses the alignment
    # hints below when these come back from a @jit helper, and then emits scalar accesses.
    # (The tensor's position may come from one: no hint rests on it.)
    pid = tl.program_id(0).to(tl.int64)
    # Passed as i32 below 2**31 (a constant when 1): table offsets in 64 bits.
    n_tensors = tl.cast(n_tensors, tl.int64)
    t = find_tensor(table + 3 * n_tensors, pid, n_tensors)
    start = (pid - tl.load(table + 3 * n_tensors + t)) * BLOCK
    addr = tl.load(table + t)
    n = tl.load(table + n_tensors + t)
    off = tl.load(table + 2 * n_tensors + t)
    if ALIGN > 1:
        # The launcher checked these; telling the compiler lets it vectorise.
        addr = tl.multiple_of(addr, 16)
        n = tl.multiple_of(n, ALIGN)
        off = tl.multiple_of(off, ALIGN)
    idx = start + tl.arange(0, BLOCK)
    if ALIGN > 1:
        idx = tl.max_contiguous(tl.multiple_of(idx, BLOCK), BLOCK)
    mask = idx < n
    if TO_FLAT:
        src = addr.to(tl.pointer_type(SRC))
        if ALIGN > 1:
            src = tl.multiple_of(src, 16)
        x = tl.load(src + idx, mask=mask)
        dst = flat + off + idx
    else:
        x = tl.load(flat + off + idx, mask=mask)
        dst = addr.to(tl.pointer_type(STORE))
        if ALIGN > 1:
            dst = tl.multiple_of(dst, 16)
        dst = dst + idx
    if SCALED:
        # (tl.full, not tl.cast: the interpreter hands a Python float to the kernel, and
        # tl.cast would make it float32 first; compiled, scale is a float64 argument.)
        x = x.to(COMPUTE) * tl.full((), scale, COMPUTE)
    tl.store(dst, to_storage(x, DST), mask=mask)


copy_kernel = Kernel(_copy_kernel)


def copy_constexprs(group_dtype, flat_dtype, scaled: bool, to_flat: bool, aligned: bool, block: int):
    """The compile-time arguments the launcher passes (shared with the AOT tests)."""
    src_dtype, dst_dtype = (group_dtype, flat_dtype) if to_flat else (flat_dtype, group_dtype)
    SRC, DST, COMPUTE = copy_types(src_dtype, dst_dtype, scaled)
    return dict(
        SRC=SRC, DST=DST, STORE=storage_type(DST), COMPUTE=COMPUTE, SCALED=scaled, TO_FLAT=to_flat,
        ALIGN=align_elems(src_dtype, dst_dtype) if aligned else 1, BLOCK=block,
    )


_INT_BY_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def flat_view(flat: torch.Tensor, flat_type, is_destination: bool) -> torch.Tensor:
    """The flat buffer as the kernel addresses it: as integers for raw copies, and as
    int16 bits when bf16 is written (by hand, see ``to_storage``)."""
    raw = flat_type in (tl.int8, tl.int16, tl.int32, tl.int64)
    if raw and flat.dtype not in _INT_BY_SIZE.values():
        return flat.view(_INT_BY_SIZE[flat.element_size()])  # any dtype (complex, bool) as bits
    if is_destination and flat.dtype == torch.bfloat16:
        return flat.view(torch.int16)
    return flat


def _launch_copy(group, flat, scale, to_flat: bool, block: int, num_warps: int) -> None:
    scaled = scale is not None
    aligned = flat.data_ptr() % 16 == 0 and group.aligned(
        align_elems(group.dtype, flat.dtype)
    )
    cx = copy_constexprs(group.dtype, flat.dtype, scaled, to_flat, aligned, block)
    n_blocks = group.block_begin(block)[1]
    if n_blocks == 0:
        return
    table = group.device_table(block, flat.device)
    kernel_flat = flat_view(flat, cx["STORE"] if to_flat else cx["SRC"], to_flat)
    # Launch on the flat buffer's device (Triton launches on the current device).
    with torch.cuda.device(flat.device) if flat.device.type == "cuda" else contextlib.nullcontext():
        keep_for_stream(table)
        copy_kernel.on(flat.device)[(n_blocks,)](
            table, len(group.numels), kernel_flat, 1.0 if scale is None else float(scale),
            num_warps=num_warps, **cx,
        )
    _launch.launches.record("triton", "flatten" if to_flat else "unflatten_into")


def flatten(group, out: torch.Tensor, scale: float | None, *, block: int = DEFAULT_BLOCK,
            num_warps: int = DEFAULT_NUM_WARPS) -> None:
    """Copy every tensor of ``group`` into ``out[offset : offset + numel]``, cast to
    ``out.dtype`` and multiplied by ``scale`` when given. One launch."""
    _launch_copy(group, out, scale, True, block, num_warps)


def unflatten_into(group, flat: torch.Tensor, scale: float | None, *, block: int = DEFAULT_BLOCK,
                   num_warps: int = DEFAULT_NUM_WARPS) -> None:
    """Copy ``flat[offset : offset + numel]`` into every tensor of ``group``, cast to
    the group's dtype and multiplied by ``scale`` when given. One launch."""
    _launch_copy(group, flat, scale, False, block, num_warps)


def broadcast(group, outs: list, *, block: int = DEFAULT_BLOCK, num_warps: int = DEFAULT_NUM_WARPS) -> None:
    """Copy every tensor of ``group`` into ``out[offset : offset + numel]`` of every
    ``out`` in ``outs``: one flatten launch per buffer. (On CUDA, fastpar's broadcast
    packs once on the source and copies the buffer to each device, so this serves only
    buffers on the tensors' own device, e.g. host replicas under the interpreter.)"""
    for out in outs:
        _launch_copy(group, out, None, True, block, num_warps)
