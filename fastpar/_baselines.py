"""torch's own algorithms, replayed on CPU tensors, as benchmark baselines.

``torch.nn.parallel.comm`` refuses CPU inputs, so its steps are reproduced here exactly:
``_take_tensors`` buckets of at most ``buffer_size`` bytes, ``_flatten_dense_tensors``
(a ``torch.cat`` into a fresh buffer) per bucket and device, root + pairwise adds,
``_unflatten_dense_tensors`` and a final reorder."""
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


def broadcast_coalesced(tensors, k: int, buffer_size: int = BUFFER):
    """``torch.nn.parallel.comm.broadcast_coalesced``'s steps on CPU tensors: per bucket,
    one flatten on the source and one copy per other device, unflattened into views."""
    per_device = [[] for _ in range(k - 1)]
    for chunk in _take_tensors(list(tensors), buffer_size):
        flat = _flatten_dense_tensors(chunk)
        for j in range(k - 1):
            per_device[j].extend(_unflatten_dense_tensors(flat.clone(), chunk))
    return [list(tensors)] + [_reorder_tensors_as(p, tensors) for p in per_device]


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
