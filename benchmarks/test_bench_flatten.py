"""flatten / unflatten_into vs torch on the three real workloads (issue #2 targets).

Each group has providers ``fastpar`` and ``torch`` (and ``copy_``: one ``Tensor.copy_``
of the same bytes into a touched buffer, the bandwidth ceiling), measured in one run.
"""
from __future__ import annotations

import pytest
import torch
from conftest import interleaved, measure

import fastpar
from fastpar._workloads import WORKLOADS, nbytes

WL = list(WORKLOADS)


def _cat(ts) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def _check(got: torch.Tensor, expected: torch.Tensor, provider: str) -> None:
    """Both providers' timed calls compute the same (exact) result: a ratio between a
    fast wrong call and a right one would mean nothing."""
    assert got.dtype == expected.dtype and torch.equal(got, expected), \
        f"{provider}: the benchmarked call computes the wrong values"


@pytest.fixture(scope="module", params=WL)
def workload(request):
    torch.manual_seed(0)
    tensors = WORKLOADS[request.param][0]()
    n = sum(t.numel() for t in tensors)
    return request.param, tensors, n


@pytest.mark.parametrize("provider", ["fastpar", "torch"])
def test_flatten_allocating(benchmark, workload, provider):
    name, ts, n = workload
    benchmark.group = f"flatten alloc: {name}"
    fn = (lambda: fastpar.flatten(ts)) if provider == "fastpar" else (lambda: torch._utils._flatten_dense_tensors(ts))
    measure(benchmark, fn, 2 * nbytes(ts))
    _check(fn(), _cat(ts), provider)


@pytest.mark.parametrize("provider", ["fastpar", "torch", "copy_"])
def test_flatten_out(benchmark, workload, provider):
    name, ts, n = workload
    benchmark.group = f"flatten out=: {name}"
    out = torch.zeros(n)
    if provider == "fastpar":
        fn = lambda: fastpar.flatten(ts, out=out)
    elif provider == "torch":
        views = [t.reshape(-1) for t in ts]
        fn = lambda: torch.cat(views, out=out)
    else:
        src = torch.randn(n)
        fn = lambda: out.copy_(src)
    measure(benchmark, fn, 2 * nbytes(ts))
    if provider != "copy_":  # the timed calls wrote out
        _check(out, _cat(ts), provider)


@pytest.mark.parametrize("variant", ["alloc", "out="])
def test_flatten_interleaved(benchmark, workload, variant):
    """The two groups above with the providers alternated round by round
    (``conftest.interleaved``): torch's time for the tiny tensors moved 2-3x between
    sequential runs on one VM (``cat`` of 10,000 tensors 2.3-6.8 ms)."""
    name, ts, n = workload
    benchmark.group = f"flatten {variant}: {name}, interleaved"
    moved = 2 * nbytes(ts)
    if variant == "alloc":
        steps = {"fastpar": lambda: fastpar.flatten(ts), "torch": lambda: torch._utils._flatten_dense_tensors(ts)}
        nb = dict.fromkeys(steps, moved)
    else:
        out, out_torch, out_copy, src = torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.randn(n)
        views = [t.reshape(-1) for t in ts]
        steps = {"fastpar": lambda: fastpar.flatten(ts, out=out),
                 "torch": lambda: torch.cat(views, out=out_torch),
                 "copy_": lambda: out_copy.copy_(src)}
        nb = dict.fromkeys(steps, moved)
    interleaved(benchmark, steps, rounds=10 if name != "tiny" else 40, nbytes=nb)
    expected = torch.cat([t.reshape(-1) for t in ts])
    got = fastpar.flatten(ts) if variant == "alloc" else out
    assert torch.equal(got, expected), "the benchmarked call computes the wrong values"


@pytest.mark.parametrize("provider", ["fastpar", "torch"])
def test_flatten_bf16_scale_out(benchmark, workload, provider):
    name, ts, n = workload
    benchmark.group = f"flatten bf16+scale out=: {name}"
    out = torch.zeros(n, dtype=torch.bfloat16)
    if provider == "fastpar":
        fn = lambda: fastpar.flatten(ts, dtype=torch.bfloat16, scale=0.125, out=out)
    else:
        # torch's best three-pass equivalent: cat into a reused fp32 buffer, scale, cast.
        views = [t.reshape(-1) for t in ts]
        buf = torch.zeros(n)

        def fn():
            torch.cat(views, out=buf)
            buf.mul_(0.125)
            out.copy_(buf)

    measure(benchmark, fn, nbytes(ts) + 2 * n)
    _check(out, (_cat(ts) * 0.125).bfloat16(), provider)


@pytest.mark.parametrize("views_ready", [False, True], ids=["views-made", "views-prebuilt"])
@pytest.mark.parametrize("provider", ["fastpar", "torch", "copy_"])
def test_unflatten_into(benchmark, workload, provider, views_ready):
    """torch's way: ``_foreach_copy_(tensors, _unflatten_dense_tensors(flat, tensors))``.
    ``views-prebuilt`` times the ``_foreach_copy_`` alone, as if the views of ``flat`` were
    kept across calls (a lower bound for torch)."""
    name, ts, n = workload
    benchmark.group = f"unflatten_into ({'torch views prebuilt' if views_ready else 'torch makes views'}): {name}"
    flat = torch.randn(n)
    dst = [torch.zeros_like(t) for t in ts]
    if provider == "fastpar":
        fn = lambda: fastpar.unflatten_into(flat, dst)
    elif provider == "torch":
        if views_ready:
            views = list(torch._utils._unflatten_dense_tensors(flat, dst))
            fn = lambda: torch._foreach_copy_(dst, views)
        else:
            fn = lambda: torch._foreach_copy_(dst, torch._utils._unflatten_dense_tensors(flat, dst))
    else:
        out = torch.zeros(n)
        fn = lambda: out.copy_(flat)
    measure(benchmark, fn, 2 * nbytes(ts))
    if provider != "copy_":  # the timed calls wrote dst
        _check(torch.cat([d.reshape(-1) for d in dst]), flat, provider)


def test_unflatten_into_interleaved(benchmark, workload):
    """The ``views-prebuilt`` group above with fastpar, torch's ``_foreach_copy_`` and
    ``copy_`` alternated round by round (``conftest.interleaved``): sequential groups
    landed in different bandwidth modes of the VM (a Transformer's took 0.79x in one run
    and 2.16x in the next)."""
    name, ts, n = workload
    benchmark.group = f"unflatten_into (torch views prebuilt): {name}, interleaved"
    flat = torch.randn(n)
    dst, dst_torch = [torch.zeros_like(t) for t in ts], [torch.zeros_like(t) for t in ts]
    views = list(torch._utils._unflatten_dense_tensors(flat, dst_torch))
    out_copy = torch.zeros(n)
    steps = {"fastpar": lambda: fastpar.unflatten_into(flat, dst),
             "torch": lambda: torch._foreach_copy_(dst_torch, views),
             "copy_": lambda: out_copy.copy_(flat)}
    interleaved(benchmark, steps, rounds=10 if name != "tiny" else 40, nbytes=dict.fromkeys(steps, 2 * nbytes(ts)))
    for got, who in ((dst, "fastpar"), (dst_torch, "torch")):  # the timed calls wrote them
        _check(torch.cat([d.reshape(-1) for d in got]), flat, who)
