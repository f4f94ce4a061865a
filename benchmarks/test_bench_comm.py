"""reduce_add_coalesced with K replicas of real gradients (issue #3 targets): fastpar vs
torch's own algorithm run on CPU tensors (torch.nn.parallel.comm refuses CPU inputs, so
its steps are replayed here: ``_take_tensors`` buckets, ``_flatten_dense_tensors``,
root + pairwise adds, ``_unflatten_dense_tensors``, reorder)."""
from __future__ import annotations

import pytest
import torch
from conftest import measure
from torch._utils import _flatten_dense_tensors, _reorder_tensors_as, _take_tensors, _unflatten_dense_tensors

from fastpar import comm
from fastpar._workloads import WORKLOADS, nbytes

BUFFER = 10485760


def torch_reduce_add_coalesced(inputs, buffer_size=BUFFER):
    """torch.nn.parallel.comm.reduce_add_coalesced's steps, on CPU tensors."""
    ref_order = list(inputs[0])
    output = []
    itrs = [_take_tensors(tensors, buffer_size) for tensors in inputs]
    for chunks in zip(*itrs):
        flats = [_flatten_dense_tensors(chunk) for chunk in chunks]
        result = flats[0] + flats[1]
        for other in flats[2:]:
            result.add_(other)
        output.extend(t.data for t in _unflatten_dense_tensors(result, chunks[0]))
    return tuple(_reorder_tensors_as(output, ref_order))


@pytest.fixture(scope="module", params=["transformer", "tiny"])
def grads(request):
    torch.manual_seed(0)
    return request.param, WORKLOADS[request.param][0]()


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("provider", ["fastpar", "torch"])
def test_reduce_add_coalesced(benchmark, grads, k, provider):
    name, g = grads
    benchmark.group = f"reduce_add_coalesced K={k}: {name}"
    lists = [[t.clone() for t in g] for _ in range(k)]
    fn = (lambda: comm.reduce_add_coalesced(lists, "cpu")) if provider == "fastpar" else (
        lambda: torch_reduce_add_coalesced(lists))
    measure(benchmark, fn, (k + 1) * nbytes(g), rounds=6 if name == "transformer" else 20)


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("provider", ["fastpar", "copy_"])
def test_reduce_add_coalesced_out(benchmark, grads, k, provider):
    """With ``out=`` buffers reused across calls: effective bandwidth (K+1) x bytes / time
    against one Tensor.copy_ (2 x bytes / time) into a touched buffer."""
    name, g = grads
    benchmark.group = f"reduce_add_coalesced out= K={k}: {name} (GB/s vs copy_)"
    if provider == "fastpar":
        lists = [[t.clone() for t in g] for _ in range(k)]
        out = [torch.zeros_like(t) for t in g]
        measure(benchmark, lambda: comm.reduce_add_coalesced(lists, "cpu", out=out), (k + 1) * nbytes(g))
    else:
        n = sum(t.numel() for t in g)
        src, dst = torch.randn(n), torch.zeros(n)
        measure(benchmark, lambda: dst.copy_(src), 2 * nbytes(g))
