"""Scatter and gather of nested structures (tensors, tuples, lists, dicts, namedtuples)
across devices, as ``torch.nn.parallel.scatter_gather`` does, on fastpar's Scatter and
Gather autograd functions (which also take ``"cpu"`` replica devices)."""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.nn.parallel.parallel_apply import get_a_var

from . import _dispatch, comm
from ._functions import Gather, Scatter

__all__ = ["gather", "scatter", "scatter_kwargs"]


def _is_namedtuple(obj) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_asdict") and hasattr(obj, "_fields")


def scatter(inputs, target_gpus, dim=0):
    r"""Slice tensors into approximately equal chunks along ``dim``, one per device;
    tuples, lists, dicts and namedtuples are walked, other objects are referenced once
    per device. A batch smaller than the device count gives fewer chunks.
    ``target_gpus`` (torch's name) may also hold ``"cpu"`` entries.

    Raises:
        ValueError: a tensor has no dimension ``dim`` (a 0-dim tensor, or a 1-D one with
            ``dim=1``), naming where it sits in ``inputs`` (``inputs[1]``,
            ``inputs['lengths']``). torch's raises a bare ``IndexError`` or
            ``RuntimeError`` that names neither the tensor nor ``dim``.
    """
    if torch.compiler.is_dynamo_compiling():  # (see _dispatch.eager_entry)
        return _scatter_eagerly(inputs, target_gpus, dim)
    return _scatter(inputs, target_gpus, dim, "inputs")


def _scatter(inputs, target_gpus, dim, name: str):
    """:func:`scatter`, naming the tensors that cannot be split ``name[...]``."""
    devs = comm._devices(target_gpus, "target_gpus", unique=False)  # repeats allowed, as torch's
    # ``dim`` as comm.scatter reads it (any integer type), once for the whole walk; None
    # when it is no int, which comm.scatter then names.
    split_dim = comm._as_int(dim)

    # ``where``: (parent's where, field name or index/key) chains, spelled out only in
    # an error, so that a long list of objects builds no strings.
    def scatter_map(obj, where):
        if isinstance(obj, torch.Tensor):
            _check_splittable(obj, split_dim, where)
            return Scatter.apply(devs, None, dim, obj)
        if _is_namedtuple(obj):
            fields = (scatter_map(o, (where, _Field(f))) for f, o in zip(obj._fields, obj))
            return [type(obj)(*args) for args in zip(*fields)]
        if isinstance(obj, tuple) and len(obj) > 0:
            return list(zip(*(scatter_map(o, (where, i)) for i, o in enumerate(obj))))
        if isinstance(obj, list) and len(obj) > 0:
            return [list(i) for i in zip(*(scatter_map(o, (where, i)) for i, o in enumerate(obj)))]
        if isinstance(obj, dict) and len(obj) > 0:
            # (Each item as torch walks it, a (key, value) tuple: the key is copied.)
            return [type(obj)(i) for i in zip(*(zip(scatter_map(k, where), scatter_map(v, (where, k)))
                                                 for k, v in obj.items()))]
        return [obj for _ in devs]

    try:
        return scatter_map(inputs, name)
    finally:
        scatter_map = None  # break the closure's reference cycle


class _Field:
    """A namedtuple's field name in :func:`_scatter`'s ``where`` (``.x``, not ``['x']``)."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


def _spelled(where) -> str:
    """``where`` of :func:`_scatter`'s walk as Python spells it: ``kwargs['x'][0].y``."""
    parts = []
    while isinstance(where, tuple):
        where, key = where
        parts.append(f".{key.name}" if isinstance(key, _Field) else f"[{key!r}]")
    return where + "".join(reversed(parts))


def _check_splittable(t: torch.Tensor, dim: int | None, where) -> None:
    """Raise unless ``t`` has a dimension ``dim`` to be split along. (``dim`` None, no
    int, is left to :func:`fastpar.comm.scatter`, which names it.)"""
    if dim is None or -t.dim() <= dim < t.dim():
        return
    raise ValueError(
        f"cannot scatter {_spelled(where)}: it is a {t.dim()}-dim tensor (shape {tuple(t.shape)}) with no "
        f"dimension {dim} to split along (every tensor in the inputs is split along dim {dim})"
    )


def scatter_kwargs(inputs, kwargs, target_gpus, dim=0):
    r"""Scatter ``inputs`` and ``kwargs``. When only one of them is given (or holds
    anything), the other is padded with empty tuples/dicts, as torch does.

    When both split into different numbers of chunks only because one side's extra
    chunks hold no tensor (objects other than tensors are copied once per device, so a
    batch of 1 with a float keyword gives 1 and 2 chunks on 2 devices), those are dropped.

    Raises:
        ValueError: both hold tensors that split into different numbers of chunks (say a
            positional batch of 4 and a keyword tensor of 2 rows on 4 devices). torch's
            ``parallel_apply`` then fails an assertion; padding the shorter instead would
            run some replicas without their keyword arguments.
    """
    if torch.compiler.is_dynamo_compiling():  # (see _dispatch.eager_entry)
        return _scatter_kwargs_eagerly(inputs, kwargs, target_gpus, dim)
    scattered_inputs = _scatter(inputs, target_gpus, dim, "inputs") if inputs else []
    scattered_kwargs = _scatter(kwargs, target_gpus, dim, "kwargs") if kwargs else []
    if scattered_inputs and scattered_kwargs and len(scattered_inputs) != len(scattered_kwargs):
        # Objects other than tensors are copied once per device: chunks beyond the
        # tensors' count that hold no tensor (a small last batch with a float keyword)
        # are dropped; extra chunks holding tensors mean the batches differ.
        n = min(len(scattered_inputs), len(scattered_kwargs))
        longer = scattered_inputs if len(scattered_inputs) > n else scattered_kwargs
        if any(get_a_var(c) is not None for c in longer[n:]):
            raise ValueError(
                f"inputs split into {len(scattered_inputs)} chunks along dim {dim} but kwargs into "
                f"{len(scattered_kwargs)}; the tensor arguments must have the same size along that dim "
                "(or each at least as many entries as there are devices)"
            )
        del longer[n:]
    if len(scattered_inputs) < len(scattered_kwargs):
        scattered_inputs.extend(() for _ in range(len(scattered_kwargs) - len(scattered_inputs)))
    elif len(scattered_kwargs) < len(scattered_inputs):
        scattered_kwargs.extend({} for _ in range(len(scattered_inputs) - len(scattered_kwargs)))
    return tuple(scattered_inputs), tuple(scattered_kwargs)


def gather(outputs, target_device, dim=0):
    r"""Gather per-device outputs onto ``target_device``, walking the same structures;
    0-dim tensors are gathered into a vector (with torch's warning).

    ``target_device`` None means what :func:`fastpar.comm.gather`'s ``destination=None``
    does: the current CUDA device, as torch's ``gather`` takes it, or the CPU for outputs
    of host replicas."""
    if torch.compiler.is_dynamo_compiling():  # (see _dispatch.eager_entry)
        return _gather_eagerly(outputs, target_device, dim)
    comm._warn_minus_one(target_device, stacklevel=2)
    dst = None if target_device is None else comm._device(target_device, "target_device")
    gather_dim = comm._as_int(dim)  # (as comm.gather reads it; None: no int, which it names)

    def gather_map(outs):
        out = outs[0]
        if isinstance(out, torch.Tensor):
            _same_kind(outs, lambda o: isinstance(o, torch.Tensor), "a tensor")
            _check_gatherable(outs, gather_dim)
            return Gather.apply(dst, dim, *outs)
        if out is None:
            return None
        if isinstance(out, dict):
            _same_kind(outs, lambda o: isinstance(o, Mapping), "a dict")
            if not all(len(out) == len(d) for d in outs):
                i = next(i for i, d in enumerate(outs) if len(d) != len(out))
                raise ValueError(
                    "All dicts must have the same number of keys: the replicas returned dicts "
                    f"of {[len(d) for d in outs]} keys; replica 0 {sorted(map(str, out))}, "
                    f"replica {i} {sorted(map(str, outs[i]))}"
                )
            for i, d in enumerate(outs):
                if d.keys() != out.keys():
                    raise ValueError(
                        f"the replicas returned dicts with different keys: replica 0 {sorted(map(str, out))}, "
                        f"replica {i} {sorted(map(str, d))}; they must match to be gathered"
                    )
            return type(out)((k, gather_map([d[k] for d in outs])) for k in out)
        # torch rebuilds anything else from its items: a Python number fails with a bare
        # TypeError, and a string comes back as the text of a map object. A string (a
        # name or tag next to the tensors) that every replica returned alike is passed
        # through; strings that differ cannot be gathered.
        if isinstance(out, (str, bytes)):
            if any(o != out for o in outs):
                raise TypeError(
                    f"the replicas returned different {type(out).__name__}s at one position "
                    f"({list(outs)!r}); only tensors are gathered, and other outputs must be equal"
                )
            return out
        if isinstance(out, Mapping):
            # A mapping that is not a dict (UserDict, mappingproxy): torch rebuilds it
            # from its keys, and the sequence check below would blame replica 0 itself.
            raise TypeError(
                f"cannot gather {type(out).__name__} outputs: only dicts (and dict subclasses) are gathered "
                "key by key, as in torch; return a dict"
            )
        if not hasattr(out, "__len__") or not hasattr(out, "__iter__"):
            raise TypeError(
                f"cannot gather {type(out).__name__} outputs: replicas must return tensors, None, or dicts, "
                "lists, tuples or namedtuples of them (return a tensor for a number)"
            )
        # Any sequence is rebuilt from its items, as in torch (a list beside a tuple,
        # a namedtuple beside a tuple), but not from a tensor, a mapping or a string.
        _same_kind(outs, lambda o: hasattr(o, "__len__") and not isinstance(o, (torch.Tensor, Mapping, str, bytes)),
                   f"a {type(out).__name__}")
        # Replicas returning sequences of different lengths is an error (as in torch),
        # not a silently truncated result.
        lengths = [len(o) for o in outs]
        if any(n != lengths[0] for n in lengths):
            raise ValueError(
                f"the replicas returned {type(out).__name__}s of different lengths {lengths} "
                "(one per replica); they must match to be gathered"
            )
        if _is_namedtuple(out):
            return type(out)._make(map(gather_map, zip(*outs, strict=True)))
        return type(out)(map(gather_map, zip(*outs, strict=True)))

    try:
        return gather_map(outputs)
    finally:
        gather_map = None


def _check_gatherable(outs, dim: int | None) -> None:
    """Raise unless every replica's tensor has a dimension ``dim`` (``dim`` other than 0:
    along 0, 0-dim outputs are made a vector, and comm.gather names a 0-dim one beside
    others). A scalar loss or a per-sample vector under ``dim=1`` otherwise met
    comm.gather's "dim must be an int in [-1, 1), got 1" after a warning that it would
    gather "along dimension 0" (torch's fails with a bare ``IndexError``)."""
    if dim is None or dim == 0:
        return  # (a dim that is not an int is named by comm.gather)
    for i, o in enumerate(outs):
        if not -o.dim() <= dim < o.dim():
            raise ValueError(
                f"replica {i} returned a {o.dim()}-dim tensor (shape {tuple(o.shape)}) with no dimension {dim} "
                f"to gather along (outputs are gathered along dim {dim}; only along dim 0 are 0-dim "
                "outputs made a vector)"
            )


def _same_kind(outs, ok, what: str) -> None:
    """Raise unless ``ok(output)`` holds for every replica's output at this position
    (replica 0's being ``what``)."""
    for i, o in enumerate(outs):
        if not ok(o):
            raise TypeError(
                f"replica 0 returned {what} where replica {i} returned {type(o).__name__}; "
                "the replicas' outputs must have the same structure to be gathered"
            )


# What the functions above run when called while dynamo traces (see _dispatch.eager_entry):
# traced, dynamo went on into the Scatter and Gather autograd functions and broke its
# graph again inside them (at UntypedStorage.data_ptr, ContextVar.set).
_scatter_eagerly = _dispatch.eager_entry(scatter)
_scatter_kwargs_eagerly = _dispatch.eager_entry(scatter_kwargs)
_gather_eagerly = _dispatch.eager_entry(gather)
