"""``fastpar.scatter_gather`` against ``torch.nn.parallel.scatter_gather``'s contract
(torch's own refuses CPU devices, so the comparisons are with its documented behaviour)."""
from __future__ import annotations

import collections

import pytest
import torch
from conftest import assert_close, rand

import fastpar
from fastpar.scatter_gather import gather, scatter, scatter_kwargs

CPU2 = ["cpu", "cpu"]
Pair = collections.namedtuple("Pair", "x y")


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
    with pytest.raises(ValueError, match=r"the replicas returned lists of different lengths \[2, 1\]"):
        gather([[None, None], [None]], "cpu")
    a, b = torch.randn(2, 3), torch.randn(1, 3)
    with pytest.raises(ValueError, match=r"the replicas returned tuples of different lengths \[2, 1\]"):
        gather([(a, a), (b,)], "cpu")
    Pair = collections.namedtuple("Pair", "x y")
    out = gather([Pair(a, [a]), Pair(b, [b])], "cpu")
    assert type(out) is Pair and torch.equal(out.x, torch.cat([a, b])) and torch.equal(out.y[0], out.x)


@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("dim", [1, -1, -2])
def test_top_level_scatter_gather_along_dim_with_backward(k, dim):
    # torch's scatter/gather chunk and concatenate along dim (negative dims wrap, as
    # torch's comm does with maybe_wrap_dim); backward of each is the other along dim.
    # Sizes 7 and 5 give uneven chunks (4+3, 3+3+1, 3+2, 2+2+1).
    x = torch.randn(4, 7, 5, dtype=torch.float64, requires_grad=True)
    chunks = fastpar.scatter(x, ["cpu"] * k, dim)
    want = x.detach().chunk(k, dim)
    assert len(chunks) == len(want)
    for i, (c, w) in enumerate(zip(chunks, want)):
        assert_close(c, w, what=f"chunk {i} along dim {dim}")
    scales = [float(i + 2) for i in range(len(chunks))]  # each chunk scaled differently
    y = fastpar.gather([c * s for c, s in zip(chunks, scales)], "cpu", dim=dim)
    assert_close(y, torch.cat([w * s for w, s in zip(want, scales)], dim), what=f"gather along dim {dim}")
    g = torch.randn(y.shape, dtype=torch.float64)
    y.backward(g)
    sizes = [w.size(dim) for w in want]
    expected = torch.cat([p * s for p, s in zip(g.split(sizes, dim), scales)], dim)
    assert_close(x.grad, expected, what=f"x.grad through scatter/gather along dim {dim}")


def exact_values(shape, dtype) -> torch.Tensor:
    """Values a cast through float32 (or a narrower integer) would change, and that the
    float64 compare in assert_close still tells apart (|int64| < 2**52)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape).bool()
    if dtype == torch.int64:
        return torch.randint(-(2**52), 2**52, shape)
    if dtype == torch.float64:
        return torch.randn(shape, dtype=torch.float64) * 1e3
    return rand(shape, dtype)


@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool], ids=str)
def test_top_level_scatter_gather_round_trip_dtypes(dtype, dim):
    x = exact_values((7, 6), dtype)
    nested = {"x": x, "pair": (x[:, :3], [x[:, 3:]])}
    parts = fastpar.scatter(nested, ["cpu"] * 3, dim)
    assert len(parts) == 3
    for name, got_of, ref in [("x", lambda p: p["x"], x), ("pair[0]", lambda p: p["pair"][0], x[:, :3]),
                              ("pair[1][0]", lambda p: p["pair"][1][0], x[:, 3:])]:
        for i, (p, w) in enumerate(zip(parts, ref.chunk(3, dim))):
            got = got_of(p)
            assert got.dtype == dtype, f"{name} chunk {i} is {got.dtype}"
            assert_close(got, w, tol=(0, 0), what=f"{name} chunk {i}")
    back = fastpar.gather(parts, "cpu", dim=dim)
    for name, got, ref in [("x", back["x"], x), ("pair[0]", back["pair"][0], x[:, :3]),
                           ("pair[1][0]", back["pair"][1][0], x[:, 3:])]:
        assert got.dtype == dtype, f"gathered {name} is {got.dtype}"
        assert_close(got, ref, tol=(0, 0), what=f"gathered {name}")


@pytest.mark.parametrize("dim", [0, 1])
def test_gather_complex128(dim):
    """16-byte elements: gathered by copies (the one-launch path moves up to 8 bytes)."""
    parts = [torch.randn(2, 3, dtype=torch.complex128) for _ in range(2)]
    assert torch.equal(fastpar.gather(parts, "cpu", dim=dim), torch.cat(parts, dim))


def test_scatter_to_host_replicas_gives_one_view_and_copies():
    """torch keeps only the chunk on the input's own device a view of the input; host
    replicas ("cpu" repeated) must not all share its version counter, or an in-place op
    in one replica breaks the backward of the others."""
    x = torch.randn(6, 4)
    parts = fastpar.scatter(x, ["cpu"] * 3)
    base = x.untyped_storage().data_ptr()
    shared = [p.untyped_storage().data_ptr() == base for p in parts]
    assert shared == [True, False, False]
    for p, w in zip(parts, x.chunk(3)):
        assert torch.equal(p, w)
    # The failure it prevents: each replica applies an in-place ReLU to its chunk.
    m = torch.nn.Sequential(torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 2)).double()
    dp = fastpar.DataParallel(m, device_ids=["cpu", "cpu"])
    for _ in range(5):
        xb = torch.randn(8, 4, dtype=torch.float64)
        dp(xb.clone()).sum().backward()
        got = [p.grad.clone() for p in m.parameters()]
        m.zero_grad()
        m(xb.clone()).sum().backward()
        for g, p in zip(got, m.parameters()):
            assert_close(g, p.grad, what="grad with an in-place ReLU in each replica")
        m.zero_grad()


def test_scatter_keeps_namedtuples():
    # torch.nn.parallel.scatter rebuilds a namedtuple per device (type(obj)(*args)).
    x = torch.randn(4, 3)
    parts = scatter(Pair(x, 1.5), CPU2)
    assert [type(p) for p in parts] == [Pair, Pair]
    assert torch.equal(parts[1].x, x[2:]) and parts[1].y == 1.5


def test_scatter_keeps_dict_and_list_types():
    x = torch.randn(4, 3)
    parts = scatter(collections.OrderedDict(b=x, a=[x, 2]), CPU2)
    assert [type(p) for p in parts] == [collections.OrderedDict] * 2
    assert list(parts[0]) == ["b", "a"]
    assert [type(p["a"]) for p in parts] == [list, list]
    assert torch.equal(parts[1]["a"][0], x[2:]) and parts[1]["a"][1] == 2


def test_scatter_copies_empty_containers_to_every_device():
    # An empty tuple/list/dict is an object like any other: each device gets it, and
    # it must not truncate the zip of its siblings to nothing.
    x = torch.randn(4, 3)
    parts = scatter((x, (), []), CPU2)
    assert len(parts) == 2
    for p, w in zip(parts, x.chunk(2)):
        assert torch.equal(p[0], w) and p[1] == () and p[2] == []


def test_scatter_kwargs_drops_extra_chunks_without_tensors():
    # A batch of 1 on 2 devices gives 1 positional chunk; the float keyword is copied to
    # both devices, but only one replica must run (not a second one without inputs).
    x = torch.randn(1, 3)
    inputs, kwargs = scatter_kwargs((x,), {"scale": 0.5}, CPU2)
    assert len(inputs) == len(kwargs) == 1
    assert torch.equal(inputs[0][0], x) and kwargs[0] == {"scale": 0.5}


def test_gather_rejects_dicts_with_different_key_counts():
    a, b = torch.randn(2, 3), torch.randn(1, 3)
    with pytest.raises(ValueError, match="All dicts must have the same number of keys"):
        gather([{"a": a}, {"a": b, "extra": b}], "cpu")


@pytest.mark.parametrize(
    "outs,exc,match",
    [
        ([1.0, 2.0], TypeError, r"cannot gather float outputs: replicas must return tensors, None, or dicts"),
        (["ab", "cd"], TypeError, r"the replicas returned different strs at one position \(\['ab', 'cd'\]\)"),
        ([{"a": 1}, {"b": 1}], ValueError,
         r"the replicas returned dicts with different keys: replica 0 \['a'\], replica 1 \['b'\]"),
        (["T", None], TypeError, r"replica 0 returned a tensor where replica 1 returned NoneType"),
        ([{"a": "T"}, ["T"]], TypeError, r"replica 0 returned a dict where replica 1 returned list"),
        ([["T"], {"a": "T"}], TypeError, r"replica 0 returned a list where replica 1 returned dict"),
        (["T0", "T1"], ValueError, r"tensors\[1\] \(on cpu\) has shape \(2,\), incompatible with tensors\[0\]"),
    ],
    ids=["numbers", "strings", "dict-keys", "tensor-none", "dict-list", "list-dict", "0-dim-and-1-d"],
)
def test_gather_names_what_cannot_be_gathered(outs, exc, match):
    """torch fails these with a bare TypeError/KeyError/IndexError, and gathers strings
    into the text of a map object."""
    def tensors(o):
        if o == "T":
            return torch.randn(2)
        if o == "T0":
            return torch.tensor(1.0)
        if o == "T1":
            return torch.randn(2)
        if isinstance(o, dict):
            return {k: tensors(v) for k, v in o.items()}
        if isinstance(o, list):
            return [tensors(v) for v in o]
        return o

    with pytest.raises(exc, match=match):
        gather([tensors(o) for o in outs], "cpu")


def test_gather_accepts_mixed_sequences_and_mappings_at_one_position_as_torch_does():
    import types
    from collections import UserList

    a, b = torch.randn(2), torch.randn(3)
    Pair = collections.namedtuple("Pair", "x y")
    out = gather([(a,), [b]], "cpu")
    assert type(out) is tuple and torch.equal(out[0], torch.cat([a, b]))
    out = gather([Pair(a, None), (b, None)], "cpu")
    assert type(out) is Pair and torch.equal(out.x, torch.cat([a, b])) and out.y is None
    out = gather([UserList([a]), [b]], "cpu")
    assert type(out) is UserList and torch.equal(out[0], torch.cat([a, b]))
    out = gather([{"x": a}, types.MappingProxyType({"x": b})], "cpu")
    assert type(out) is dict and torch.equal(out["x"], torch.cat([a, b]))


def test_gather_passes_a_string_every_replica_returned_alike():
    """torch gathers strings into the text of a map object; a tag next to the tensors
    that every replica returned alike comes back as it is."""
    a, b = torch.randn(2), torch.randn(3)
    out = gather([{"t": a, "name": "x"}, {"t": b, "name": "x"}], "cpu")
    assert out["name"] == "x" and torch.equal(out["t"], torch.cat([a, b]))
    assert gather([(a, b"k"), (b, b"k")], "cpu")[1] == b"k"


def test_gather_passes_none_through():
    a, b = torch.randn(2, 3), torch.randn(1, 3)
    assert gather([None, None], "cpu") is None
    out = gather([(a, None), (b, None)], "cpu")
    assert torch.equal(out[0], torch.cat([a, b])) and out[1] is None
