"""torch's own algorithms, replayed on CPU tensors, as benchmark baselines.

``torch.nn.parallel.comm`` refuses CPU inputs, so its steps are reproduced here exactly.
``reduce_add_coalesced`` (Python in torch): ``_take_tensors`` buckets of at most
``buffer_size`` bytes, ``_flatten_dense_tensors`` (a ``torch.cat`` into a fresh buffer,
or a view of a bucket's only tensor) per bucket and device, root + pairwise adds,
``_unflatten_dense_tensors`` and a final reorder. ``broadcast_coalesced`` (C++ in torch,
``torch/csrc/cuda/comm.cpp``): buckets from ``torch::utils::take_tensors``, which are
*not* ``_take_tensors``'s (see :func:`_take_tensors_cpp`), one flatten and one copy per
other device each, unflattened views, reordered only when the buckets hold several
types."""
from __future__ import annotations

import contextlib
import importlib

from torch.autograd import Function
from torch._utils import _flatten_dense_tensors, _reorder_tensors_as, _take_tensors, _unflatten_dense_tensors

BUFFER = 10485760


def reduce_add_coalesced(inputs, buffer_size: int = BUFFER):
    """``torch.nn.parallel.comm.reduce_add_coalesced``'s steps on CPU tensors."""
    ref_order = list(inputs[0])
    output = []
    for chunks in zip(*[_take_tensors(list(t), buffer_size) for t in inputs]):
        flats = [_flatten_dense_tensors(chunk) for chunk in chunks]
        result = flats[0] + flats[1]
        for other in flats[2:]:
            result.add_(other)
        output.extend(t.data for t in _unflatten_dense_tensors(result, chunks[0]))
    return tuple(_reorder_tensors_as(output, ref_order))


def _type_of(t):
    """What ``torch::utils::type_id`` tells apart: backend (layout and device) and dtype."""
    return t.layout, t.device.type, t.dtype


def _take_tensors_cpp(tensors, size_limit: int):
    """``torch::utils::take_tensors(tensors, size_limit)`` (``fine_grained=false``,
    torch/csrc/utils/tensor_flatten.cpp), the bucketing of torch's C++
    ``broadcast_coalesced``: per type, a tensor joins its type's bucket first, and the
    bucket is spilled once it holds ``size_limit`` bytes or more (so it ends with the
    tensor that crossed the limit); the partial buckets follow (in torch's type-id order;
    here in first-seen order, which changes only the order of the copies). Python's
    ``torch._utils._take_tensors`` (``comm.reduce_add_coalesced``'s) spills *before* a
    tensor that would cross the limit, so a bucket there never exceeds it: for
    ``nn.LSTM(1024, 1024, 4, bidirectional=True)`` it leaves every weight matrix alone in
    its bucket (flattened as a view, no copy) where torch's broadcast copies 208 of the
    352 MiB through ``cat`` into buckets of [bias, bias, weight]."""
    groups: dict = {}
    for t in tensors:
        key = _type_of(t)
        group = groups.setdefault(key, [[], 0])
        group[0].append(t)
        group[1] += t.numel() * t.element_size()
        if group[1] >= size_limit:
            yield group[0]
            groups[key] = [[], 0]
    for bucket, _ in groups.values():
        if bucket:
            yield bucket


def broadcast_coalesced(tensors, k: int, buffer_size: int = BUFFER):
    """``torch.nn.parallel.comm.broadcast_coalesced``'s steps on CPU tensors: per bucket
    (:func:`_take_tensors_cpp`), one flatten on the source and one copy per other device,
    unflattened into views; the first device gets the tensors themselves."""
    per_device = [[] for _ in range(k - 1)]
    types = set()
    for chunk in _take_tensors_cpp(list(tensors), buffer_size):
        types.add(_type_of(chunk[0]))
        flat = _flatten_dense_tensors(chunk)
        for j in range(k - 1):
            per_device[j].extend(_unflatten_dense_tensors(flat.clone(), chunk))
    if len(types) > 1:  # (comm.cpp: "If we only saw a single tensor type ... skip reordering")
        per_device = [_reorder_tensors_as(p, tensors) for p in per_device]
    return [list(tensors)] + per_device


class _TorchBroadcast(Function):
    @staticmethod
    def forward(ctx, k, *inputs):
        ctx.n = len(inputs)
        return tuple(t for ts in broadcast_coalesced(inputs, k) for t in ts)

    @staticmethod
    def backward(ctx, *grads):
        per = [list(grads[i : i + ctx.n]) for i in range(0, len(grads), ctx.n)]
        return (None,) + reduce_add_coalesced(per)


def _reshape(tensors, devices, detach=False):
    if not tensors:
        return []
    if detach:
        return broadcast_coalesced(tensors, len(devices))
    copies = _TorchBroadcast.apply(len(devices), *tensors)
    n = len(tensors)
    return [list(copies[i : i + n]) for i in range(0, len(copies), n)]


@contextlib.contextmanager
def torch_replicate_algorithm():
    """torch.nn.parallel.replicate with its comm steps replayed on CPU tensors."""
    # (``torch.nn.parallel.replicate`` the attribute is the function; this is the module.)
    torch_replicate_mod = importlib.import_module("torch.nn.parallel.replicate")
    saved = torch_replicate_mod._broadcast_coalesced_reshape
    torch_replicate_mod._broadcast_coalesced_reshape = _reshape
    try:
        yield lambda net, k: torch_replicate_mod.replicate(net, list(range(k)))
    finally:
        torch_replicate_mod._broadcast_coalesced_reshape = saved
