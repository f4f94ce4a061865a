"""``fastpar.scatter_gather`` against ``torch.nn.parallel.scatter_gather``'s contract
(torch's own refuses CPU devices, so the comparisons are with its documented behaviour)."""
from __future__ import annotations

import collections

import pytest
import torch

from fastpar.scatter_gather import gather, scatter, scatter_kwargs

CPU2 = ["cpu", "cpu"]


def test_scatter_takes_torch_argument_names():
    x = torch.randn(4, 3)
    chunks = scatter(x, target_gpus=CPU2, dim=0)
    assert [tuple(c.shape) for c in chunks] == [(2, 3), (2, 3)]
    inputs, kwargs = scatter_kwargs((x,), {"y": x}, target_gpus=CPU2)
    assert len(inputs) == len(kwargs) == 2 and torch.equal(kwargs[1]["y"], x[2:])


def test_scatter_kwargs_pads_the_side_that_is_absent():
    x = torch.randn(4, 3)
    inputs, kwargs = scatter_kwargs((x,), {}, CPU2)
    assert kwargs == ({}, {}) and torch.equal(inputs[1][0], x[2:])
    inputs, kwargs = scatter_kwargs((), {"y": x}, CPU2)
    assert inputs == ((), ()) and torch.equal(kwargs[0]["y"], x[:2])


def test_scatter_kwargs_rejects_different_chunk_counts():
    with pytest.raises(ValueError, match="inputs split into 2 chunks along dim 0 but kwargs into 1"):
        scatter_kwargs((torch.randn(4, 3),), {"y": torch.randn(1, 3)}, CPU2)


def test_gather_rejects_sequences_of_different_lengths():
    # torch zips strictly; a plain zip returned [None] here.
    with pytest.raises(ValueError, match="zip"):
        gather([[None, None], [None]], "cpu")
    a, b = torch.randn(2, 3), torch.randn(1, 3)
    with pytest.raises(ValueError, match="zip"):
        gather([(a, a), (b,)], "cpu")
    Pair = collections.namedtuple("Pair", "x y")
    out = gather([Pair(a, [a]), Pair(b, [b])], "cpu")
    assert type(out) is Pair and torch.equal(out.x, torch.cat([a, b])) and torch.equal(out.y[0], out.x)
