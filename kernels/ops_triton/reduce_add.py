"""Triton K-way reduce-add: ``dst[t] = src[0][t] + ... + src[K-1][t]`` for N tensors in
one launch on the destination's device. On CUDA the sources may live on other GPUs: the
kernel reads peer memory directly through their (unified virtual) addresses, so K+1
passes over memory (K-1 copies, K-1 adds) become one read of each copy and one write."""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .. import _launch
from ._common import TL_DTYPES, Kernel, find_tensor, keep_for_stream, storage_type, to_storage

DEFAULT_BLOCK = 2048
DEFAULT_NUM_WARPS = 4


@triton.jit
def _reduce_add_kernel(
    table,  # *i64: src_addrs[K*N] (source-major) | dst_addrs[N] | numels[N] | block_begin[N]
    n_tensors,  # N
    K: tl.constexpr,  # sources (unrolled: typically 2-8 devices)
    DT: tl.constexpr,  # element type of sources and destination
    STORE: tl.constexpr,  # type DT is stored through (int16 bits for bf16)
    COMPUTE: tl.constexpr,  # accumulator type (fp32 for 16-bit floats)
    ALIGN: tl.constexpr,  # >1: addresses 16-byte aligned, numels multiples of ALIGN
    BLOCK: tl.constexpr,  # elements per program
):
    """Program ``p`` sums elements ``[start, start + BLOCK)`` of tensor ``t`` (the last
    with ``block_begin[t] <= p``; ``start = (p - block_begin[t]) * BLOCK``) over the K
    sources in registers (sources in order, so results are deterministic) and writes
    each destination element once."""
    pid = tl.program_id(0).to(tl.int64)
    # Passed as i32 below 2**31 (a constant when 1): table offsets in 64 bits.
    n_tensors = tl.cast(n_tensors, tl.int64)
    begin = table + (K + 2) * n_tensors
    t = find_tensor(begin, pid, n_tensors)
    start = (pid - tl.load(begin + t)) * BLOCK
    n = tl.load(table + (K + 1) * n_tensors + t)
    dst_addr = tl.load(table + K * n_tensors + t)
    if ALIGN > 1:
        n = tl.multiple_of(n, ALIGN)
        dst_addr = tl.multiple_of(dst_addr, 16)
    idx = start + tl.arange(0, BLOCK)
    if ALIGN > 1:
        idx = tl.max_contiguous(tl.multiple_of(idx, BLOCK), BLOCK)
    mask = idx < n
    # The sum starts from the first source, not from a zero: 0.0 + -0.0 is +0.0, so a
    # sum of -0.0s started at +0.0 comes out +0.0, unlike torch's and the Numba kernel's.
    # (A -0.0 start is no way out: Triton 3.6, torch 2.11's, folds tl.full(.., -0.0, ..)
    # to +0.0, since its scalar_constant takes any value == 0 as the null value.)
    for k in tl.static_range(K):
        a = tl.load(table + k * n_tensors + t)
        if ALIGN > 1:
            a = tl.multiple_of(a, 16)
        src = a.to(tl.pointer_type(DT))
        if ALIGN > 1:
            src = tl.multiple_of(src, 16)
        x = tl.load(src + idx, mask=mask).to(COMPUTE)
        if k == 0:
            acc = x
        else:
            acc += x
    dst = dst_addr.to(tl.pointer_type(STORE))
    if ALIGN > 1:
        dst = tl.multiple_of(dst, 16)
    tl.store(dst + idx, to_storage(acc, DT), mask=mask)


reduce_add_kernel = Kernel(_reduce_add_kernel)


def reduce_constexprs(dtype: torch.dtype, n_sources: int, aligned: bool, block: int) -> dict:
    """The compile-time arguments the launcher passes (shared with the AOT tests)."""
    DT = TL_DTYPES[dtype]
    if dtype.is_floating_point:
        compute = tl.float64 if dtype == torch.float64 else tl.float32
    else:
        compute = tl.int64
    return dict(K=n_sources, DT=DT, STORE=storage_type(DT), COMPUTE=compute,
                ALIGN=16 // dtype.itemsize if aligned else 1, BLOCK=block)


def reduce_add(group, *, block: int = DEFAULT_BLOCK, num_warps: int = DEFAULT_NUM_WARPS) -> None:
    """Write ``sum_k src[k][t]`` into every destination ``t`` of ``group`` (a
    :class:`fastpar._plan.ReduceGroup`). One launch on ``group.device``."""
    n_blocks = group.block_begin(block)[1]
    if n_blocks == 0:
        return
    cx = reduce_constexprs(group.dtype, group.n_sources, group.aligned(16 // group.dtype.itemsize), block)
    table = group.device_table(block, group.device)
    # Launch on the destination's device (Triton launches on the current device).
    with torch.cuda.device(group.device) if group.device.type == "cuda" else contextlib.nullcontext():
        keep_for_stream(table)
        reduce_add_kernel.on(group.device)[(n_blocks,)](table, len(group.numels), num_warps=num_warps, **cx)
    _launch.launches.record("triton", "reduce_add")

