"""Element offsets past 2**31 (and byte offsets past 2**32) through every multi-tensor
kernel, on the CPU: the Triton kernels under the interpreter (which keeps each value's
integer width, so a 32-bit index wraps there as on a GPU) and the Numba kernels.

A GPU holds buffers of more than 2**31 elements every day; copying one here would take
the interpreter millions of programs. So each test builds a launch group by hand over one
4 GiB *virtual* buffer (only the pages around the windows written are ever touched) and
seeds its chunk maps with a single block that starts past 2**31 elements of its tensor,
or lands past 2**31 elements into the flat buffer: one program, the offsets of a huge
launch. (The Numba kernels read ``blocks`` (each program's start); the Triton kernels
``block_begin`` (each tensor's first program), seeded as ``-start / BLOCK`` so that
program 0 starts at ``start``.) The AOT tests (tests/test_aot.py) check the same property in the compiled code.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastpar._plan import Group, ReduceGroup
from fastpar.kernels.ops_numba import flatten as NF
from fastpar.kernels.ops_numba import reduce_add as NR
from fastpar.kernels.ops_numba import scale as NS
from fastpar.kernels.ops_triton import flatten as TF
from fastpar.kernels.ops_triton import reduce_add as TR
from fastpar.kernels.ops_triton import scale as TS

BLOCK = 2048
HALF = 2**31 + 8192  # elements of the "tensor" region: past the int32 range
BACKENDS = ["triton", "numba"]


@pytest.fixture(scope="module")
def big():
    """One 4 GiB + 64 KiB int8 buffer, never written as a whole (lazily mapped)."""
    try:
        return torch.empty(2**32 + 2**16, dtype=torch.int8)
    except (RuntimeError, MemoryError) as e:  # a machine that refuses 4 GiB of address space
        pytest.skip(f"cannot reserve a 4 GiB buffer here: {e}")


def _group(t: torch.Tensor, offset: int, start: int) -> Group:
    """A one-tensor group whose only program copies elements [start, start + BLOCK) of
    ``t``, to or from ``flat[offset + start ...]``."""
    g = Group(t.dtype, t.device, np.arange(1), (t,), np.array([t.data_ptr()], np.int64),
              np.array([t.numel()], np.int64), np.array([offset], np.int64), transient=True)
    g._blocks.update(_maps(start))
    return g


def _maps(start: int) -> dict:
    """Both chunk maps of one program that starts at element ``start`` of tensor 0."""
    assert start % BLOCK == 0
    return {BLOCK: (np.array([0], np.int32), np.array([start], np.int64)),
            ("begin", BLOCK): (np.array([-(start // BLOCK)], np.int64), 1)}


def _kw(backend: str) -> dict:
    return {"block": BLOCK} if backend == "triton" else {"chunk": BLOCK}


def _pattern(n: int, seed: int) -> torch.Tensor:
    return torch.randint(-128, 128, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "offset,start",
    [(17, 2**31), (16, 2**31), (2**31 + 101, 0), (2**31 + 48, 4096)],
    ids=["start>2^31", "start>2^31-aligned", "offset>2^31", "offset>2^31-aligned"],
)
def test_copy_past_2_31_elements(big, backend, offset, start):
    src, flat = big[:HALF], big[HALF:]
    at = offset + start  # element of flat the block lands at
    assert at + BLOCK + 64 <= flat.numel() and at > 2**31
    mod = TF if backend == "triton" else NF
    want = _pattern(BLOCK, 1)

    # flatten: src[start:] -> flat[at:]
    src[start:start + BLOCK] = want
    flat[at - 64:at + BLOCK + 64] = -1
    mod.flatten(_group(src, offset, start), flat, None, **_kw(backend))
    assert torch.equal(flat[at:at + BLOCK], want), "flatten wrote elsewhere than offset + start"
    assert (flat[at - 64:at] == -1).all() and (flat[at + BLOCK:at + BLOCK + 64] == -1).all()

    # unflatten_into: flat[at:] -> src[start:]
    back = _pattern(BLOCK, 2)
    flat[at:at + BLOCK] = back
    lo = max(start - 64, 0)
    src[lo:start + BLOCK + 64] = -1
    mod.unflatten_into(_group(src, offset, start), flat, None, **_kw(backend))
    assert torch.equal(src[start:start + BLOCK], back), "unflatten_into wrote elsewhere than start"
    assert (src[lo:start] == -1).all() and (src[start + BLOCK:start + BLOCK + 64] == -1).all()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_past_2_31_elements(big, backend):
    t = big.view(torch.float16)  # 2**31 + 2**15 half floats: byte offsets past 2**32
    start = 2**31
    x = torch.linspace(-3, 3, BLOCK, dtype=torch.float16)
    t[start:start + BLOCK] = x
    t[start - 8:start] = 5.0
    t[start + BLOCK:start + BLOCK + 8] = 5.0
    mod = TS if backend == "triton" else NS
    mod.scale(_group(t, 0, start), 2.0, False, **_kw(backend))
    assert torch.equal(t[start:start + BLOCK], x * 2), "scale wrote elsewhere than start"
    assert (t[start - 8:start] == 5.0).all() and (t[start + BLOCK:start + BLOCK + 8] == 5.0).all()


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_reduce_add_past_2_31_elements(big, backend):
    src, dst = big[:HALF], big[HALF:2 * HALF]
    start = 2**31
    a = _pattern(BLOCK, 3)
    src[start:start + BLOCK] = a
    dst[start - 64:start + BLOCK + 64] = -1
    n = np.array([HALF], np.int64)
    # Two sources (the same memory, read twice) into one destination.
    g = ReduceGroup(torch.int8, src.device, np.array([[src.data_ptr()], [src.data_ptr()]], np.int64),
                    np.array([dst.data_ptr()], np.int64), n, [(src,), (src,)], (dst,),
                    _maps(start))
    if backend == "triton":
        TR.reduce_add(g, block=BLOCK)
    else:
        NR.reduce_add(g, chunk=BLOCK)
    assert torch.equal(dst[start:start + BLOCK], a + a), "reduce_add wrote elsewhere than start"
    assert (dst[start - 64:start] == -1).all() and (dst[start + BLOCK:start + BLOCK + 64] == -1).all()
