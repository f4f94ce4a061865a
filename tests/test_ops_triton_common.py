"""``kernels/ops_triton/_common.py``: ``find_tensor``, the search by which every Triton
kernel's program finds its tensor in ``block_begin`` (``fastpar._plan``), run under the
interpreter on CPU tensors against numpy's ``searchsorted``."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from fastpar._plan import block_begin, chunk_map
from fastpar.kernels.ops_triton._common import Kernel, find_tensor


@triton.jit
def _find_kernel(
    begin,  # *i64: block_begin[N]
    n_tensors,  # N
    pids,  # *i64: the program numbers to look up, one per program of this launch
    out,  # *i64: the tensor found for each
):
    i = tl.program_id(0)
    t = find_tensor(begin, tl.load(pids + i), tl.cast(n_tensors, tl.int64))
    tl.store(out + i, t)


_find = Kernel(_find_kernel)


def _numels(n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` numels, a third of them empty (runs of empties, at both ends too)."""
    numels = rng.integers(1, 5000, n)
    numels[rng.random(n) < 1 / 3] = 0
    return numels.astype(np.int64)


def _check(numels: np.ndarray, block: int, pids: np.ndarray | None = None) -> None:
    begin, total = block_begin(numels, block)
    if pids is None:
        pids = np.arange(total, dtype=np.int64)
    out = torch.full((len(pids),), -7, dtype=torch.int64)  # poison: unwritten shows as -7
    _find.on(torch.device("cpu"))[(len(pids),)](
        torch.from_numpy(begin), len(numels), torch.from_numpy(pids), out
    )
    want = np.searchsorted(begin, pids, side="right") - 1
    # The tensor chunk_map (the Numba kernels' per-program map) gives each program.
    np.testing.assert_array_equal(want, chunk_map(numels, block)[0][pids])
    bad = np.flatnonzero(out.numpy() != want)
    assert len(bad) == 0, (
        f"{len(bad)} of {len(pids)} programs found the wrong tensor (N={len(numels)}); "
        f"first: program {pids[bad[0]]} got {out[bad[0]].item()}, expected {want[bad[0]]}"
    )
    # No program lands on an empty tensor.
    assert (numels[out.numpy()] > 0).all()


@pytest.mark.parametrize("n", [1, 2, 3, 17, 255, 256, 257, 1000])
def test_find_tensor_every_program(n):
    rng = np.random.default_rng(n)
    numels = _numels(n, rng)
    numels[rng.integers(n)] = 3000  # at least one program
    # Small blocks: several programs per tensor.
    _check(numels, 1024)


def test_find_tensor_empty_ends_and_one_block_tensors():
    # Empties before the first and after the last non-empty tensor, and every other
    # tensor one program long: each program its own tensor.
    numels = np.array([0, 0, 5, 0, 1, 1, 0, 0, 7, 0, 0], dtype=np.int64)
    _check(numels, 8)


def test_find_tensor_past_two_steps():
    # 70,000 tensors (17 steps; more than 2**16, past any 16-bit slip). The programs
    # checked: each of a sample of tensors' first and last.
    rng = np.random.default_rng(1)
    numels = _numels(70_000, rng)
    numels[-1] = 1  # the last program is in the last tensor
    begin, total = block_begin(numels, 2048)
    nblk = (numels + 2047) // 2048
    picked = rng.choice(np.flatnonzero(nblk), 300, replace=False)
    pids = np.unique(np.concatenate([begin[picked], begin[picked] + nblk[picked] - 1, [0, total - 1]]))
    _check(numels, 2048, pids.astype(np.int64))


def test_block_begin_matches_chunk_map():
    rng = np.random.default_rng(2)
    for n in (1, 5, 300):
        numels = _numels(n, rng)
        for block in (1, 7, 2048):
            begin, total = block_begin(numels, block)
            tensor, start = chunk_map(numels, block)
            assert total == len(tensor)
            # Each program's start element, from block_begin as the kernels compute it.
            np.testing.assert_array_equal((np.arange(total) - begin[tensor]) * block, start)
    assert block_begin(np.zeros(0, np.int64), 4)[1] == 0
    with pytest.raises(ValueError, match="block"):
        block_begin(np.ones(3, np.int64), 0)
