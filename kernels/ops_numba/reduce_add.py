"""Numba K-way reduce-add: ``dst[t] = src[0][t] + ... + src[K-1][t]`` for N tensors in
one launch, accumulating in float32 for 16-bit floats (float64 for float64, int64 for
integers), each destination element written once."""
from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from .. import _launch
from . import _common as C

#: Elements per parallel iteration; its float accumulator (64 KB) stays in L2.
DEFAULT_CHUNK = 16384
#: Below this many bytes moved, run on the calling thread (see flatten.py).
DEFAULT_PARALLEL_MIN_BYTES = 4 << 20

_ACCUMULATOR = {
    torch.float16: np.float32, torch.bfloat16: np.float32, torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int64: np.int64, torch.int32: np.int64, torch.int16: np.int64, torch.int8: np.int64,
    torch.uint8: np.int64,
}


#: Calls writing at least this many bytes write their results with streaming stores
#: (see ``_common.copy_bytes``) when the accumulator has the storage type.
DEFAULT_STREAM_MIN_BYTES = 16 << 20


@functools.cache
def _reduce_kernel_for(kind: str, parallel: bool, stream: bool):
    load = C.LOADS[kind]
    store = C.STORES[kind]

    @numba.njit(parallel=parallel, nogil=True)
    def _reduce_add_kernel(
        src_addrs,  # int64[K, N]: address of tensor t in source k
        dst_addrs,  # int64[N]: address of destination tensor t
        numels,  # int64[N]: elements per tensor
        block_tensor,  # int32[B]: tensor each block reduces
        block_start,  # int64[B]: first element of that tensor the block reduces
        scratch,  # [threads, chunk] accumulator rows, one per worker thread
        proto,  # empty array: its dtype is the storage type
    ):
        size = proto.itemsize
        n_src = src_addrs.shape[0]
        chunk = scratch.shape[1]
        for b in numba.prange(block_tensor.shape[0]):
            t = block_tensor[b]
            lo = block_start[b]
            m = min(chunk, numels[t] - lo)
            off = lo * size
            acc = scratch[numba.get_thread_id()]
            # Up to four sources per pass, read side by side in one loop: reading one
            # source's whole block after another made every block restart K memory
            # streams and ran 30% slower. The sums keep the order src[0] + src[1] + ...
            # (as one running sum would), so results do not depend on the grouping.
            # Unsigned indices let LLVM vectorise (no negative-index wrap-around).
            k = 0
            while k < n_src:
                g = min(4, n_src - k)
                s0 = numba.carray(C.address_as_pointer(src_addrs[k, t] + off, proto), (m,))
                s1 = numba.carray(C.address_as_pointer(src_addrs[k + min(1, g - 1), t] + off, proto), (m,))
                s2 = numba.carray(C.address_as_pointer(src_addrs[k + min(2, g - 1), t] + off, proto), (m,))
                s3 = numba.carray(C.address_as_pointer(src_addrs[k + min(3, g - 1), t] + off, proto), (m,))
                if k == 0:
                    if g == 4:
                        for i in range(np.uint64(m)):
                            acc[i] = load(s0, i) + load(s1, i) + load(s2, i) + load(s3, i)
                    elif g == 3:
                        for i in range(np.uint64(m)):
                            acc[i] = load(s0, i) + load(s1, i) + load(s2, i)
                    elif g == 2:
                        for i in range(np.uint64(m)):
                            acc[i] = load(s0, i) + load(s1, i)
                    else:
                        for i in range(np.uint64(m)):
                            acc[i] = load(s0, i)
                elif g == 4:
                    for i in range(np.uint64(m)):
                        acc[i] = acc[i] + load(s0, i) + load(s1, i) + load(s2, i) + load(s3, i)
                elif g == 3:
                    for i in range(np.uint64(m)):
                        acc[i] = acc[i] + load(s0, i) + load(s1, i) + load(s2, i)
                elif g == 2:
                    for i in range(np.uint64(m)):
                        acc[i] = acc[i] + load(s0, i) + load(s1, i)
                else:
                    for i in range(np.uint64(m)):
                        acc[i] += load(s0, i)
                k += g
            if stream:
                # The accumulator row has the storage type: stream it out, skipping the
                # read-for-ownership of each destination line (K + 1 passes over memory
                # instead of K + 2).
                C.copy_bytes(dst_addrs[t] + off, np.int64(acc.ctypes.data), m * size, True)
                C.store_fence()
            else:
                d = numba.carray(C.address_as_pointer(dst_addrs[t] + off, proto), (m,))
                for i in range(np.uint64(m)):
                    store(d, i, acc[i])

    return _reduce_add_kernel


def reduce_add(group, *, chunk: int = DEFAULT_CHUNK, parallel_min_bytes: int = DEFAULT_PARALLEL_MIN_BYTES,
               stream_min_bytes: int = DEFAULT_STREAM_MIN_BYTES) -> None:
    """Write ``sum_k src[k][t]`` into every destination ``t`` of ``group`` (a
    :class:`fastpar._plan.ReduceGroup`). One launch. Calls writing at least
    ``stream_min_bytes`` of float32/float64/int64 results into existing tensors (not
    ``group.fresh``) write them with streaming stores (where the CPU has them)."""
    block_tensor, block_start = group.blocks(chunk)
    if len(block_tensor) == 0:
        return
    kind, storage = C.KINDS[group.dtype]
    parallel = group.numel * group.dtype.itemsize * (group.n_sources + 1) >= parallel_min_bytes and C.parallel_ok()
    stream = (C.HAS_STREAM and not group.fresh and np.dtype(_ACCUMULATOR[group.dtype]) == np.dtype(storage)
              and group.numel * group.dtype.itemsize >= stream_min_bytes)
    threads = numba.get_num_threads() if parallel else 1
    scratch = np.empty((threads, chunk), _ACCUMULATOR[group.dtype])
    with C.launch_lock(parallel):
        _reduce_kernel_for(kind, parallel, stream)(
            group.src_addrs, group.dst_addrs, group.numels, block_tensor, block_start, scratch,
            np.empty(0, storage),
        )
    _launch.launches.record("numba", "reduce_add")
