"""``fastpar.scatter_gather`` against ``torch.nn.parallel.scatter_gather``'s contract
(torch's own refuses CPU devices, so the comparisons are with its documented behaviour)."""
from __future__ import annotations

import collections
import subprocess
import sys

import pytest
import torch
from conftest import assert_close, assert_one_break_per_op, compiled_run, rand

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


def test_scatter_names_a_tensor_without_the_dim_to_split():
    """torch's raises a bare RuntimeError ("chunk expects at least a 1-dimensional
    tensor") or IndexError for a 0-dim keyword (a temperature) or a 1-D one with dim=1
    (lengths beside seq-first inputs), naming neither the argument nor dim; comm.scatter's
    message blamed dim ("dim must be an int in [-1, 1), got 1")."""
    x = torch.randn(5, 4, 3)
    with pytest.raises(ValueError, match=r"cannot scatter kwargs\['lengths'\]: it is a 1-dim tensor "
                                         r"\(shape \(4,\)\) with no dimension 1 to split along"):
        scatter_kwargs((x,), {"lengths": torch.tensor([5, 5, 4, 3])}, CPU2, dim=1)
    with pytest.raises(ValueError, match=r"cannot scatter inputs\[1\]\[0\]\.y: it is a 0-dim tensor"):
        scatter_kwargs((x, [Pair(x, torch.tensor(0.5))]), {}, CPU2)
    with pytest.raises(ValueError, match=r"cannot scatter inputs: it is a 0-dim tensor \(shape \(\)\) with no "
                                         r"dimension -1"):
        scatter(torch.tensor(1.0), CPU2, dim=-1)
    # (A key is copied, as torch's scatter walks the (key, value) items.)
    parts = scatter({"a": x, 3: [x]}, CPU2, dim=-1)
    assert [list(p) for p in parts] == [["a", 3], ["a", 3]] and torch.equal(parts[1][3][0], x[..., 2:])


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
    # The counts and the replica that differs are named (torch's message names neither).
    with pytest.raises(ValueError, match=r"dicts of \[1, 1, 2\] keys; replica 0 \['a'\], replica 2 \['a', 'extra'\]"):
        gather([{"a": a}, {"a": b}, {"a": b, "extra": b}], "cpu")


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


def test_gather_names_a_mapping_that_is_not_a_dict():
    """replica 0 returning a UserDict or mappingproxy was blamed on itself ("replica 0
    returned a UserDict where replica 0 returned UserDict"); torch rebuilds it from its
    keys and fails on the strings."""
    import types
    from collections import UserDict

    a, b = torch.randn(2), torch.randn(3)
    for make in (UserDict, types.MappingProxyType):
        with pytest.raises(TypeError, match=rf"cannot gather {make({}).__class__.__name__} outputs: only dicts "
                                            r"\(and dict subclasses\) are gathered key by key"):
            gather([make({"x": a}), make({"x": b})], "cpu")


@pytest.mark.parametrize("dim", [1, -1])
def test_gather_names_an_output_without_the_dim_to_gather_along(dim, recwarn):
    """A scalar loss, or a per-sample vector, from replicas of a dim=1 DataParallel:
    comm.gather warned it would gather "along dimension 0", then raised "dim must be an
    int in [-1, 1), got 1" or Gather an IndexError (torch's: a bare IndexError)."""
    with pytest.raises(ValueError, match=r"replica 0 returned a 0-dim tensor \(shape \(\)\) with no dimension "
                                         rf"{dim} to gather along"):
        gather([torch.tensor(1.0), torch.tensor(2.0)], "cpu", dim)
    if dim == 1:
        with pytest.raises(ValueError, match=r"replica 1 returned a 1-dim tensor \(shape \(3,\)\) with no "
                                             r"dimension 1"):
            gather([torch.randn(2, 3), torch.randn(3)], "cpu", dim)
    assert not [w for w in recwarn if "scalars" in str(w.message)]
    out = gather([torch.randn(2, 3), torch.randn(2, 1)], "cpu", dim)
    assert out.shape == (2, 4)


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


def test_gather_to_none_is_the_default_device_as_in_torch():
    # torch's gather takes target_device None as the current CUDA device; it raised
    # "target_device must be an int, str or torch.device" here. Host replicas' outputs
    # gather to the CPU, as comm.gather's destination=None does.
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(1, 3, requires_grad=True)
    out = gather([{"y": a * 1, "n": None}, {"y": b * 1, "n": None}], None)
    assert out["n"] is None and out["y"].device.type == "cpu"
    assert torch.equal(out["y"], torch.cat([a, b]))
    out["y"].sum().backward()
    assert torch.equal(a.grad, torch.ones(2, 3)) and torch.equal(b.grad, torch.ones(1, 3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gather_to_none_is_the_current_device():
    x = torch.randn(2, 3, device="cuda")
    out = gather([x, x], None)
    assert out.device == torch.device("cuda", torch.cuda.current_device())
    assert torch.equal(out, torch.cat([x, x]))


# ----------------------------------------------------------- Properties (hypothesis)
# Random nested structures (tuples, lists, dicts, OrderedDicts, namedtuples, empty
# containers, objects other than tensors) holding tensors of any dtype and layout that
# share a batch size along dim: scattered, each device's structure is the same one with
# each tensor's chunk of torch.chunk in it; gathered, the per-device outputs give torch.cat;
# mismatched outputs are refused naming the replica.

from conftest import LAYOUTS, assert_same_bits, backend_properties, build, seeded, storage_of  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastpar._validate import CAST_DTYPES  # noqa: E402

DTYPES = [*CAST_DTYPES, torch.bool, torch.complex64, torch.complex128]


class Leaf:
    """Where a tensor goes in a drawn structure: its shape without the batch dim, dtype
    and layout (made into a tensor by :func:`materialize`)."""

    def __init__(self, rest, dtype, layout):
        self.rest, self.dtype, self.layout = rest, dtype, layout

    def __repr__(self):
        return f"Leaf({self.rest}, {str(self.dtype).replace('torch.', '')}, {self.layout})"


LEAVES = st.builds(Leaf, st.lists(st.integers(0, 3), min_size=1, max_size=2).map(tuple), st.sampled_from(DTYPES),
                   st.sampled_from(LAYOUTS))
#: Objects other than tensors: gather passes None and equal strings through; numbers
#: (which it cannot gather) only where nothing is gathered.
GATHERABLE = st.one_of(st.none(), st.sampled_from(["tag", b"k", ""]))
OBJECTS = st.one_of(GATHERABLE, st.integers(-3, 3), st.floats(-1, 1), st.sampled_from([(), [], {}]))


def structures(leaves):
    """Nested tuples, lists, dicts, OrderedDicts and namedtuples of ``leaves``."""
    keys = st.sampled_from(["a", "b", "c", "d"])

    def extend(inner):
        return st.one_of(
            st.lists(inner, min_size=1, max_size=3),
            st.lists(inner, min_size=1, max_size=3).map(tuple),
            st.dictionaries(keys, inner, min_size=1, max_size=3),
            st.dictionaries(keys, inner, min_size=1, max_size=3).map(collections.OrderedDict),
            st.builds(Pair, inner, inner),
        )

    return st.recursive(leaves, extend, max_leaves=6)


def rebuild(obj, leaf):
    """``obj`` with every :class:`Leaf` replaced by ``leaf(it)`` (types kept)."""
    if isinstance(obj, Leaf):
        return leaf(obj)
    if isinstance(obj, Pair):
        return Pair(*(rebuild(o, leaf) for o in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(rebuild(o, leaf) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, rebuild(v, leaf)) for k, v in obj.items())
    return obj


def tensors_of(obj) -> list:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in tensors_of(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in tensors_of(o)]
    return []


def batched(leaf, gen, batch, dim, flush_bf16=False):
    """The tensor for ``leaf`` with ``batch`` rows inserted at ``dim``."""
    shape = list(leaf.rest)
    shape.insert(dim if dim >= 0 else len(shape) + 1 + dim, batch)
    return build((tuple(shape), leaf.dtype, leaf.layout), gen, specials=True, flush_bf16=flush_bf16)


def assert_matches(got, want, what, *, identical=True):
    """``got`` has ``want``'s structure and types, tensors of its dtypes and bits, and
    where ``want`` has anything else, the very objects (or, not ``identical``, equal
    ones: gather rebuilds empty containers)."""
    assert type(got) is type(want), f"{what}: {type(got).__name__} where {type(want).__name__} was expected"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{what}: {got.dtype} != {want.dtype}"
        assert_same_bits(got.resolve_neg(), want.resolve_neg(), what)
    elif isinstance(want, (tuple, list)) and len(want):
        assert len(got) == len(want), f"{what}: {len(got)} items, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_matches(g, w, f"{what}[{i}]", identical=identical)
    elif isinstance(want, dict) and len(want):
        assert list(got) == list(want), f"{what}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_matches(got[k], want[k], f"{what}[{k!r}]", identical=identical)
    elif identical:
        assert got is want, f"{what}: {got!r} is not the object {want!r}"
    else:
        assert got == want, f"{what}: {got!r} != {want!r}"


DIMS = st.sampled_from([0, 1, -1])


@given(data=st.data())
def test_scatter_properties(data):
    """Any structure, batch size (0 included) and dim, to 1-4 CPU devices: one structure
    per chunk torch.chunk gives (per device when there is no tensor), each the input's
    with its tensors' chunks (only one of them a view of the input) and its other
    objects themselves; gathered back along dim, the input."""
    obj = data.draw(structures(st.one_of(LEAVES, OBJECTS)), "structure")
    k = data.draw(st.integers(1, 4), "devices")
    dim, batch = data.draw(DIMS, "dim"), data.draw(st.integers(0, 9), "batch")
    gen = seeded(data)
    obj = rebuild(obj, lambda leaf: batched(leaf, gen, batch, dim))
    ts = tensors_of(obj)
    n = len(torch.empty(batch).chunk(k)) if ts else k
    parts = fastpar.scatter(obj, ["cpu"] * k, dim)
    assert isinstance(parts, (list, tuple)) and len(parts) == n, f"{len(parts)} parts, expected {n}"
    for i, part in enumerate(parts):
        assert_matches(part, rebuild_chunks(obj, i, k, dim), f"part {i}")
    for j, t in enumerate(ts):
        views = [c for c in (tensors_of(p)[j] for p in parts) if c.numel() and storage_of(c) == storage_of(t)]
        assert len(views) <= 1, f"tensor {j}: {len(views)} chunks share its storage (host replicas need copies)"
    if not any(isinstance(o, (int, float)) for o in leaves(obj)):  # (numbers cannot be gathered)
        assert_matches(fastpar.gather(parts, "cpu", dim), obj, "gathered back", identical=False)


def leaves(obj):
    if isinstance(obj, (tuple, list)) and len(obj):
        return [x for o in obj for x in leaves(o)]
    if isinstance(obj, dict) and len(obj):
        return [x for o in obj.values() for x in leaves(o)]
    return [obj]


def rebuild_chunks(obj, i, k, dim):
    """The structure device ``i`` gets: ``obj`` with each tensor's i-th torch.chunk."""
    if isinstance(obj, torch.Tensor):
        return obj.chunk(k, dim)[i]
    if isinstance(obj, Pair):
        return Pair(*(rebuild_chunks(o, i, k, dim) for o in obj))
    if isinstance(obj, (tuple, list)) and len(obj):
        return type(obj)(rebuild_chunks(o, i, k, dim) for o in obj)
    if isinstance(obj, dict) and len(obj):
        return type(obj)((key, rebuild_chunks(v, i, k, dim)) for key, v in obj.items())
    return obj


def gathered(outs, dim):
    """What gathering the replicas' ``outs`` gives: their structure, with torch.cat of
    the tensors at each place along ``dim``."""
    out = outs[0]
    if isinstance(out, torch.Tensor):
        return torch.cat([o.resolve_neg() for o in outs], dim)
    if isinstance(out, Pair):
        return Pair(*(gathered(list(col), dim) for col in zip(*outs)))
    if isinstance(out, (tuple, list)):
        return type(out)(gathered(list(col), dim) for col in zip(*outs))
    if isinstance(out, dict):
        return type(out)((key, gathered([o[key] for o in outs], dim)) for key in out)
    return out


def replica_outputs(data, skeleton, k, dim, gen, flush_bf16=False):
    """``k`` outputs shaped as ``skeleton``, each tensor with its own size along ``dim``
    (0 included) and layout."""
    def leaf(lf):
        layout = data.draw(st.sampled_from(LAYOUTS), "layout")
        return batched(Leaf(lf.rest, lf.dtype, layout), gen, data.draw(st.integers(0, 4), "size"), dim, flush_bf16)

    return [rebuild(skeleton, leaf) for _ in range(k)]


def check_gather(data, backend):
    """The outputs of 1-4 replicas, any structure of tensors (any dtype, layout and size
    along dim), None and strings: gathered onto the CPU, that structure with torch.cat of
    each place's tensors (their bits) and the other objects as they were."""
    skeleton = data.draw(structures(st.one_of(LEAVES, GATHERABLE)), "structure")
    k, dim = data.draw(st.integers(1, 4), "replicas"), data.draw(DIMS, "dim")
    gen = seeded(data)
    outs = replica_outputs(data, skeleton, k, dim, gen, flush_bf16=backend == "triton")
    assert_matches(fastpar.gather(outs, "cpu", dim), gathered(outs, dim), f"gather of {skeleton}", identical=False)


test_gather_properties, test_gather_properties_triton_interpreter = backend_properties(
    check_gather, triton_examples=6)


@given(data=st.data())
def test_scatter_kwargs_properties(data):
    """Any positional and keyword structures (either may be empty), tensors sharing a
    batch size: as many input and kwargs chunks as torch.chunk gives the batch (as many
    as devices with no tensor anywhere; none when both are empty), each side's chunk i
    its structure with chunk i of every tensor, an absent side padded with () or {}."""
    item = structures(st.one_of(LEAVES, OBJECTS))
    inputs = tuple(data.draw(st.lists(item, max_size=3), "inputs"))
    kwargs = data.draw(st.dictionaries(st.sampled_from(["x", "y", "z"]), item, max_size=3), "kwargs")
    k = data.draw(st.integers(1, 4), "devices")
    dim, batch = data.draw(DIMS, "dim"), data.draw(st.integers(0, 9), "batch")
    gen = seeded(data)
    inputs, kwargs = (rebuild(x, lambda leaf: batched(leaf, gen, batch, dim)) for x in (inputs, kwargs))
    if tensors_of(inputs) or tensors_of(kwargs):
        n = len(torch.empty(batch).chunk(k))
    else:
        n = k if inputs or kwargs else 0
    ins, kws = scatter_kwargs(inputs, kwargs, ["cpu"] * k, dim)
    assert type(ins) is tuple and type(kws) is tuple, (type(ins), type(kws))
    assert len(ins) == len(kws) == n, f"{len(ins)} input and {len(kws)} kwargs chunks, expected {n}"
    for i in range(n):
        if inputs:
            assert_matches(ins[i], rebuild_chunks(inputs, i, k, dim), f"inputs chunk {i}")
        else:
            assert ins[i] == (), ins[i]
        if kwargs:
            assert_matches(kws[i], rebuild_chunks(kwargs, i, k, dim), f"kwargs chunk {i}")
        else:
            assert type(kws[i]) is dict and kws[i] == {}, kws[i]


def nodes(obj, path=()):
    """``(path, node)`` for ``obj`` and everything inside it."""
    yield path, obj
    if isinstance(obj, (tuple, list)):
        for i, o in enumerate(obj):
            yield from nodes(o, (*path, i))
    elif isinstance(obj, dict):
        for key, o in obj.items():
            yield from nodes(o, (*path, key))


def replace_at(obj, path, fn):
    """``obj`` with the node at ``path`` replaced by ``fn(node)`` (containers rebuilt)."""
    if not path:
        return fn(obj)
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        return type(obj)((key, replace_at(v, rest, fn) if key == head else v) for key, v in obj.items())
    items = [replace_at(o, rest, fn) if i == head else o for i, o in enumerate(obj)]
    return Pair(*items) if isinstance(obj, Pair) else type(obj)(items)


@given(data=st.data())
def test_gather_refusals_name_the_replica(data):
    """The outputs of 2-4 replicas, one of which differs at one place: a shorter list or
    tuple, a dict with another key, something else where the others have a tensor, a
    different string, a tensor of another size outside dim: refused, naming that
    replica (or its tensor). And scatter_kwargs of tensors whose batch sizes split into
    different numbers of chunks: refused, saying so."""
    k, dim = data.draw(st.integers(2, 4), "replicas"), data.draw(DIMS, "dim")
    gen = seeded(data)
    if data.draw(st.integers(0, 5), "scatter_kwargs") == 0:
        leaf = data.draw(LEAVES, "leaf")
        b_in, b_kw = data.draw(st.integers(0, 9), "input batch"), data.draw(st.integers(0, 9), "kwargs batch")
        x, y = batched(leaf, gen, b_in, dim), batched(leaf, gen, b_kw, dim)
        c_in, c_kw = len(torch.empty(b_in).chunk(k)), len(torch.empty(b_kw).chunk(k))
        if c_in == c_kw:
            ins, kws = scatter_kwargs((x,), {"y": y}, ["cpu"] * k, dim)
            assert len(ins) == len(kws) == c_in
        else:
            with pytest.raises(ValueError, match=rf"inputs split into {c_in} chunks along dim {dim} but kwargs into {c_kw}"):
                scatter_kwargs((x,), {"y": y}, ["cpu"] * k, dim)
        return
    skeleton = [data.draw(structures(st.one_of(LEAVES, GATHERABLE)), "structure"), data.draw(LEAVES, "leaf")]
    outs = replica_outputs(data, skeleton, k, dim, gen)
    j = data.draw(st.integers(1, k - 1), "replica")
    where = list(nodes(outs[j]))
    kinds = {
        "length": [p for p, o in where if isinstance(o, (tuple, list)) and not isinstance(o, Pair) and o],
        "keys": [p for p, o in where if isinstance(o, dict) and o],
        "kind": [p for p, o in where if isinstance(o, torch.Tensor)],
        "string": [p for p, o in where if isinstance(o, (str, bytes))],
    }
    kind = data.draw(st.sampled_from(sorted(kw for kw, ps in kinds.items() if ps) + ["shape"]), "wrong")
    path = data.draw(st.sampled_from(kinds.get(kind) or kinds["kind"]), "where")
    if kind == "length":
        def fn(o):
            return type(o)(o[:-1])
        exc, match = ValueError, r"the replicas returned (list|tuple)s of different lengths \["
    elif kind == "keys":
        def fn(o):
            return type(o)((("zz" if i == 0 else key), v) for i, (key, v) in enumerate(o.items()))
        exc, match = ValueError, rf"the replicas returned dicts with different keys: replica 0 .*, replica {j} "
    elif kind == "kind":
        other = data.draw(st.sampled_from([None, 1.0, "t", [0.0], {"a": 1}]), "instead")

        def fn(o):
            return other
        exc, match = TypeError, rf"replica 0 returned a tensor where replica {j} returned {type(other).__name__}"
    elif kind == "string":
        def fn(o):
            return o + o[:0] + (b"!" if isinstance(o, bytes) else "!")
        exc, match = TypeError, r"the replicas returned different (str|bytes)s at one position"
    else:
        def fn(o):
            shape = list(o.shape)
            shape[0 if dim != 0 else 1] += 1
            return torch.zeros(shape, dtype=o.dtype)
        exc, match = ValueError, rf"tensors\[{j}\] \(on cpu\) has shape .* incompatible with tensors\[0\]"
    outs[j] = replace_at(outs[j], path, fn)
    with pytest.raises(exc, match=match):
        fastpar.gather(outs, "cpu", dim)


def test_eager_use_neither_imports_dynamo_nor_wraps_the_launchers():
    # The compile-opaque launchers are handed out only once dynamo is loaded: importing
    # it costs ~2 s at the first launch, and its wrapper ~1 us a launch.
    code = (
        "import sys, torch, fastpar\n"
        "from fastpar import _dispatch, comm\n"
        "fastpar.flatten([torch.ones(3), torch.ones(2, 2)])\n"
        "comm.reduce_add_coalesced([[torch.ones(3)], [torch.ones(3)]], 'cpu')\n"
        "m = fastpar.DataParallel(torch.nn.Linear(3, 3), device_ids=['cpu', 'cpu'])\n"
        "m(torch.ones(4, 3)).sum().backward()\n"
        "assert 'torch._dynamo' not in sys.modules, 'eager fastpar imported torch._dynamo'\n"
        "assert not _dispatch._OPAQUE, 'eager fastpar made compile-opaque wrappers'\n"
        "import torch._dynamo\n"
        "backend, launch = _dispatch.kernel('flatten', torch.device('cpu'))\n"
        "assert launch is _dispatch._compile_opaque(backend, 'flatten') and launch is not _dispatch._kernel(backend, 'flatten')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_gather_inside_torch_compile_runs_the_kernels_eagerly():
    # dynamo traced on into the kernel launchers (no graph it could build there) and, on
    # the lock-holding launch wrapper, crashed in its own bytecode rewriting
    # ("exception table entry start instruction has no offset"). The launchers are
    # opaque to it: a graph break, then the eager kernels.
    torch._dynamo.reset()

    def step(a):
        return gather([t * 2 for t in a.chunk(2)], "cpu")

    a = torch.randn(4, 3, requires_grad=True)
    out = torch.compile(step, backend="eager")(a)
    # (Against a float64 reference: step(a) eagerly runs the very gather under test.)
    assert_close(out, a.detach().double() * 2, dtype=torch.float32, what="compiled gather")
    out.sum().backward()
    assert torch.equal(a.grad, torch.full_like(a, 2.0))
    torch._dynamo.reset()


def test_scatter_and_gather_inside_torch_compile_cost_one_graph_break_each():
    # Traced, dynamo went on into the Scatter and Gather autograd functions and broke
    # its graph again inside them (UntypedStorage.data_ptr, ContextVar.set), as it did
    # in the comm ops before they ran eagerly. Each runs eagerly whole now, one graph
    # break at its call; values and gradients as eager.
    x = rand((6, 4), torch.float64).requires_grad_()
    y = rand((6, 4), torch.float64)

    def step(x, y):
        parts = scatter((x * 2,), ["cpu", "cpu"])
        (inputs, kws) = scatter_kwargs((x,), {"y": y}, ["cpu", "cpu"])
        outs = [p[0] ** 2 + i[0] * k["y"] for p, i, k in zip(parts, inputs, kws)]
        return gather(outs, "cpu")

    out, breaks, graphs, warned = compiled_run(step, x, y)
    assert_close(out, 4 * x.detach() ** 2 + x.detach() * y, what="compiled scatter/gather")
    (grad,) = torch.autograd.grad(out.sum(), x)
    assert_close(grad, 8 * x.detach() + y, what="x.grad through the compiled scatter/gather")
    assert_one_break_per_op(breaks, graphs, warned, ["scatter", "scatter_kwargs", "gather"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_expanded_cpu_tensors_scatter_to_gpus_and_cpu_gathers_backpropagate():
    """A CPU tensor bound for GPUs is pinned first; ``pin_memory()`` gives its copy the
    tensor's own strides and ``copy_`` refuses a destination whose elements share memory,
    so an expanded CPU tensor raised ("more than one element of the written-to tensor
    refers to a single memory location"). That is the gradient ``out.sum().backward()``
    hands Gather's backward when the outputs were gathered on the CPU, so such a step
    failed; torch's scatter copies such tensors. (Found by reading; two chunks on one GPU
    stand for two GPUs: the path is the same.)"""
    x = torch.randn(1, 3).expand(4, 3)
    parts = scatter(x, [0, 0])
    torch.cuda.synchronize()
    assert [p.device for p in parts] == [torch.device("cuda", 0)] * 2
    assert torch.equal(torch.cat([p.cpu() for p in parts]), x)
    a = torch.randn(2, 3, device="cuda", requires_grad=True)
    b = torch.randn(3, 3, device="cuda", requires_grad=True)
    out = gather([a, b], "cpu")
    assert out.device.type == "cpu"
    out.sum().backward()  # Gather's backward gets ones expanded to (5, 3) (strides 0)
    torch.cuda.synchronize()
    assert torch.equal(a.grad.cpu(), torch.ones(2, 3)) and torch.equal(b.grad.cpu(), torch.ones(3, 3))
