"""reduce_add_coalesced with K replicas of real gradients (issue #3 targets): fastpar vs
torch's own algorithm run on CPU tensors (torch.nn.parallel.comm refuses CPU inputs, so
its steps are replayed here: ``_take_tensors`` buckets, ``_flatten_dense_tensors``,
root + pairwise adds, ``_unflatten_dense_tensors``, reorder)."""
from __future__ import annotations

import pytest
import torch
from conftest import measure

from fastpar import comm
from fastpar._baselines import reduce_add_coalesced as torch_reduce_add_coalesced
from fastpar._workloads import WORKLOADS, nbytes

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
