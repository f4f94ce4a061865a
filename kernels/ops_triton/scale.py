"""Triton in-place scale: every tensor of a group multiplied (or divided) by one scalar,
in one launch.

Programs read the same pointer table as the multi-tensor copy (``addrs | numels |
offsets | block_begin``, built once per group) and find their tensor the same way, each
scaling one ``BLOCK``-element piece of one tensor in place. Each element is read and
written by the same program, so reading and writing through one pointer is safe.
"""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .. import _launch
from ._common import (
    TL_DTYPES,
    Kernel,
    align_elems,
    find_tensor,
    keep_for_stream,
    storage_type,
    to_storage,
)

#: Elements per program (as the copy's).
DEFAULT_BLOCK = 2048
DEFAULT_NUM_WARPS = 4

#: dtypes the kernel scales.
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


@triton.jit
def _scale_kernel(
    table,  # *i64: addrs[N] | numels[N] | offsets[N] (unused) | block_begin[N]
    n_tensors,  # N, tensors in this group
    factor: tl.float64,  # multiplier, or divisor when DIVIDE; converted to COMPUTE
    DT: tl.constexpr,  # element type of the tensors
    STORE: tl.constexpr,  # pointer type DT is stored through (int16 bits for bf16)
    COMPUTE: tl.constexpr,  # type the arithmetic runs in (fp32, or fp64 for fp64)
    DIVIDE: tl.constexpr,  # True: x / factor, correctly rounded; False: x * factor
    ALIGN: tl.constexpr,  # >1: every address is 16-byte aligned and every numel a
    #                       multiple of ALIGN elements, so loads/stores may be 128-bit
    BLOCK: tl.constexpr,  # elements per program
):
    """Program ``p`` replaces elements ``[start, start + BLOCK)`` (clipped to the numel)
    of tensor ``t``, the last with ``block_begin[t] <= p``, ``start = (p - block_begin[t])
    * BLOCK``, by ``x * factor`` or ``x / factor`` computed in COMPUTE and rounded to DT
    like torch. Programs never overlap."""
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
    if ALIGN > 1:
        # The launcher checked these; telling the compiler lets it vectorise.
        addr = tl.multiple_of(addr, 16)
        n = tl.multiple_of(n, ALIGN)
    idx = start + tl.arange(0, BLOCK)
    if ALIGN > 1:
        idx = tl.max_contiguous(tl.multiple_of(idx, BLOCK), BLOCK)
    mask = idx < n
    src = addr.to(tl.pointer_type(DT))
    dst = addr.to(tl.pointer_type(STORE))
    if ALIGN > 1:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
    if DT == tl.bfloat16:
        # bfloat16 widened by hand (its bits are float32's upper half): exact for every
        # value, where the interpreter's own bf16 -> fp32 conversion mangles subnormals.
        bits = tl.load(dst + idx, mask=mask).to(tl.uint16, bitcast=True)
        x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(src + idx, mask=mask).to(COMPUTE)
    f = tl.full((), factor, COMPUTE)  # (not tl.cast: see flatten.py)
    if DIVIDE:
        if COMPUTE == tl.float32:
            # fp32 ``/`` compiles to an approximate division (div.full.f32); torch's
            # quotient is the correctly rounded one.
            y = tl.math.div_rn(x, f)
        else:
            y = x / f  # fp64 division is IEEE-rounded (div.rn.f64)
    else:
        y = x * f
    tl.store(dst + idx, to_storage(y, DT), mask=mask)


scale_kernel = Kernel(_scale_kernel)


def scale_constexprs(dtype: torch.dtype, divide: bool, aligned: bool, block: int) -> dict:
    """The compile-time arguments the launcher passes (shared with the AOT tests)."""
    DT = TL_DTYPES[dtype]
    return {
        "DT": DT, "STORE": storage_type(DT),
        "COMPUTE": tl.float64 if dtype == torch.float64 else tl.float32,
        "DIVIDE": bool(divide), "ALIGN": align_elems(dtype, dtype) if aligned else 1, "BLOCK": block,
    }


def scale(group, factor: float, divide: bool, *, block: int = DEFAULT_BLOCK,
          num_warps: int = DEFAULT_NUM_WARPS) -> None:
    """Replace every tensor of ``group`` by ``t * factor`` (or ``t / factor`` when
    ``divide``), computed in float32 (float64 for float64) and rounded once to the
    tensor's dtype. One launch.

    Args:
        group (Group): the tensors (float32, float64, float16 or bfloat16; one dtype).
        factor (float): the multiplier, or the divisor when ``divide``.
        divide (bool): divide (correctly rounded ``x / factor``) instead of multiplying.
        block (int): elements per program.
        num_warps (int): warps per program.
    """
    if group.dtype not in DTYPES:
        raise TypeError(
            f"group must hold {', '.join(map(str, DTYPES))} tensors to be scaled, got {group.dtype}"
        )
    n_blocks = group.block_begin(block)[1]
    if n_blocks == 0:
        return
    cx = scale_constexprs(group.dtype, divide, group.aligned(align_elems(group.dtype, group.dtype)), block)
    table = group.device_table(block, group.device)
    # Launch on the tensors' device (Triton launches on the current device).
    with torch.cuda.device(group.device) if group.device.type == "cuda" else contextlib.nullcontext():
        keep_for_stream(table)
        scale_kernel.on(group.device)[(n_blocks,)](
            table, len(group.numels), float(factor), num_warps=num_warps, **cx,
        )
    _launch.launches.record("triton", "scale")
