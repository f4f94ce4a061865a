"""reduce_add_coalesced with K replicas of real gradients (issue #3 targets): fastpar vs
torch's own algorithm run on CPU tensors (torch.nn.parallel.comm refuses CPU inputs, so
its steps are replayed here: ``_take_tensors`` buckets, ``_flatten_dense_tensors``,
root + pairwise adds, ``_unflatten_dense_tensors``, reorder)."""
from __future__ import annotations

import pytest
import torch
from conftest import interleaved, measure

from fastpar import comm
from fastpar._baselines import reduce_add_coalesced as torch_reduce_add_coalesced
from fastpar._workloads import WORKLOADS, nbytes

def _replicas(g, k: int) -> list:
    """``k`` copies of the gradients ``g``, replica ``j`` offset by ``j``: a sum of
    identical replicas could not tell every replica's values from ``k`` times the first
    one's."""
    return [[t.clone().add_(j) for t in g] for j in range(k)]


def _check_sums(got, lists, who: str) -> None:
    """Every position of ``got`` is the float64 sum of ``lists``' tensors there."""
    assert len(got) == len(lists[0]), f"{who}: {len(got)} results for {len(lists[0])} positions"
    for i, r in enumerate(got):
        exp = sum(lst[i].double() for lst in lists)
        assert r.shape == exp.shape and torch.allclose(r.double(), exp, rtol=1e-5, atol=1e-5), \
            f"{who}: position {i} is not the sum of the {len(lists)} replicas"


@pytest.fixture(scope="module", params=["transformer", "tiny"])
def grads(request):
    torch.manual_seed(0)
    return request.param, WORKLOADS[request.param][0]()


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("provider", ["fastpar", "torch"])
def test_reduce_add_coalesced(benchmark, grads, k, provider):
    name, g = grads
    benchmark.group = f"reduce_add_coalesced K={k}: {name}"
    lists = _replicas(g, k)
    fn = (lambda: comm.reduce_add_coalesced(lists, "cpu")) if provider == "fastpar" else (
        lambda: torch_reduce_add_coalesced(lists))
    measure(benchmark, fn, (k + 1) * nbytes(g), rounds=6 if name == "transformer" else 20)
    _check_sums(fn(), lists, provider)  # the timed call (either provider), in the inputs' order


@pytest.mark.parametrize("k", [2, 4, 8])
def test_reduce_add_coalesced_interleaved(benchmark, grads, k):
    """The first group with fastpar and torch's algorithm alternated round by round
    (``conftest.interleaved``): on a 2-core VM whose two cores sometimes give the memory
    bandwidth of one for seconds at a time, sequential groups of one provider then the
    other can land in different modes (a 177 MB copy_ took 4.4 ms or 7.6 ms, switching
    while a loop ran)."""
    name, g = grads
    benchmark.group = f"reduce_add_coalesced K={k}: {name}, interleaved"
    lists = _replicas(g, k)
    steps = {"fastpar": lambda: comm.reduce_add_coalesced(lists, "cpu"),
             "torch": lambda: torch_reduce_add_coalesced(lists)}
    # (Results are dropped every round, as a loop drops them: kept, fastpar's 177 MB
    # buffers could not be reused, and each round paid a new one's page faults.)
    interleaved(benchmark, steps, rounds=6 if name == "transformer" else 20,
                nbytes=dict.fromkeys(steps, (k + 1) * nbytes(g)))
    for provider, fn in steps.items():  # the timed calls sum every replica
        _check_sums(fn(), lists, provider)


@pytest.mark.parametrize("k", [2, 4, 8])
@pytest.mark.parametrize("provider", ["fastpar", "copy_"])
def test_reduce_add_coalesced_out(benchmark, grads, k, provider):
    """With ``out=`` buffers reused across calls: effective bandwidth (K+1) x bytes / time
    against one Tensor.copy_ (2 x bytes / time) into a touched buffer."""
    name, g = grads
    benchmark.group = f"reduce_add_coalesced out= K={k}: {name} (GB/s vs copy_)"
    if provider == "fastpar":
        lists = _replicas(g, k)
        out = [torch.zeros_like(t) for t in g]
        measure(benchmark, lambda: comm.reduce_add_coalesced(lists, "cpu", out=out), (k + 1) * nbytes(g))
        _check_sums(out, lists, "fastpar")  # the timed calls wrote out
    else:
        n = sum(t.numel() for t in g)
        src, dst = torch.randn(n), torch.zeros(n)
        measure(benchmark, lambda: dst.copy_(src), 2 * nbytes(g))


@pytest.mark.parametrize("k", [2, 4, 8])
def test_reduce_add_coalesced_out_interleaved(benchmark, grads, k):
    """The group above with fastpar and ``copy_`` alternated round by round
    (``conftest.interleaved``): the bandwidth share (``of_copy``) then compares the two
    under the same load (sequential rounds gave 71-128% on one VM within an hour)."""
    name, g = grads
    benchmark.group = f"reduce_add_coalesced out= K={k}: {name}, interleaved with copy_"
    lists = _replicas(g, k)
    out = [torch.zeros_like(t) for t in g]
    n = sum(t.numel() for t in g)
    src, dst = torch.randn(n), torch.zeros(n)
    steps = {"fastpar": lambda: comm.reduce_add_coalesced(lists, "cpu", out=out), "copy_": lambda: dst.copy_(src)}
    interleaved(benchmark, steps, rounds=10 if name == "transformer" else 30,
                nbytes={"fastpar": (k + 1) * nbytes(g), "copy_": 2 * nbytes(g)})
    _check_sums(out, lists, "fastpar")  # the timed calls wrote out
