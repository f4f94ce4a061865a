"""fastpar.rnn.pack vs the torch way (issue #4 targets), same run, on two RNNs.

Groups per module: ``rnn pack alloc`` (a fresh buffer each call: fastpar's one launch
into ``torch.empty`` vs ``torch.zeros`` of the buffer then one ``copy_`` per weight into
its view) and ``rnn pack out=`` (a reused, touched buffer: fastpar vs one ``copy_`` per
weight, and ``copy_``: one ``Tensor.copy_`` of the same bytes, the bandwidth ceiling),
and the latter again with the three alternated round by round (``interleaved``).
GB/s counts bytes read plus written.

Targets (CPU): fastpar >= 1.0x torch allocating; into out= >= 80% of the ``copy_`` ceiling.
"""
from __future__ import annotations

import pytest
import torch
from conftest import interleaved, measure

from fastpar import rnn

MODULES = {
    "LSTM(1024,1024,4,bi,proj=256)": lambda: torch.nn.LSTM(1024, 1024, 4, bidirectional=True, proj_size=256),
    "GRU(512,512,2)": lambda: torch.nn.GRU(512, 512, 2),
}


@pytest.fixture(scope="module", params=list(MODULES))
def module(request):
    torch.manual_seed(0)
    m = MODULES[request.param]()
    weights = [w.detach() for w in m._flat_weights]
    return request.param, weights, rnn.RNNLayout.for_module(m)


def _rounds(layout) -> int:
    # Small buffers take well under a millisecond: more rounds so that a stall of a
    # descheduled worker thread on this shared 2-core machine does not move the median.
    return 50 if layout.nbytes < (64 << 20) else 10


def _torch_pack(weights, layout, buf):
    for w, v in zip(weights, layout.views(buf)):
        v.copy_(w)
    return buf


@pytest.mark.parametrize("provider", ["fastpar", "torch"])
def test_rnn_pack_allocating(benchmark, module, provider):
    name, weights, layout = module
    benchmark.group = f"rnn pack alloc: {name}"
    if provider == "fastpar":
        fn = lambda: rnn.pack(weights, layout)
    else:
        fn = lambda: _torch_pack(weights, layout, torch.zeros(layout.numel, dtype=layout.dtype))
    measure(benchmark, fn, 2 * layout.nbytes, rounds=_rounds(layout))
    benchmark.extra_info["launches"] = 1 if provider == "fastpar" else len(weights)


@pytest.mark.parametrize("provider", ["fastpar", "torch", "copy_"])
def test_rnn_pack_out(benchmark, module, provider):
    name, weights, layout = module
    benchmark.group = f"rnn pack out=: {name}"
    out = torch.zeros(layout.numel, dtype=layout.dtype)  # touched: no page faults in the loop
    if provider == "fastpar":
        fn = lambda: rnn.pack(weights, layout, out=out)
    elif provider == "torch":
        # The layout has no gaps on CPU, so a reused buffer needs no zeroing.
        assert len(layout.gaps) == 0
        fn = lambda: _torch_pack(weights, layout, out)
    else:
        src = torch.cat([w.reshape(-1) for w in weights])
        fn = lambda: out.copy_(src)
    measure(benchmark, fn, 2 * layout.nbytes, rounds=_rounds(layout))
    if provider == "fastpar":
        assert torch.equal(out, torch.cat([w.reshape(-1) for w in weights]))


def test_rnn_pack_out_interleaved(benchmark, module):
    """The ``rnn pack out=`` group with fastpar, torch and ``copy_`` alternated round by
    round (``conftest.interleaved``), so that all three meet the same load: the
    GRU's fastpar share of ``copy_`` moved 51-95% between sequential runs on one VM."""
    name, weights, layout = module
    benchmark.group = f"rnn pack out=: {name}, interleaved"
    out, out_torch, out_copy = (torch.zeros(layout.numel, dtype=layout.dtype) for _ in range(3))
    src = torch.cat([w.reshape(-1) for w in weights])
    steps = {
        "fastpar": lambda: rnn.pack(weights, layout, out=out),
        "torch": lambda: _torch_pack(weights, layout, out_torch),
        "copy_": lambda: out_copy.copy_(src),
    }
    interleaved(benchmark, steps, rounds=_rounds(layout), iterations=5 if layout.nbytes < (64 << 20) else 1,
                nbytes=dict.fromkeys(steps, 2 * layout.nbytes))
    assert torch.equal(out, src) and torch.equal(out_torch, src), "the benchmarked packs compute the wrong values"
