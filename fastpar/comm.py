"""Collective device ops with the signatures and semantics of ``torch.nn.parallel.comm``,
on fastpar's single-launch kernels.

The centrepiece is :func:`reduce_add_coalesced`: one kernel per destination (per dtype)
sums the copies of every tensor held by all devices, reading them where they are, and
writes each result element once.

Devices may be CUDA devices (``int``, ``str`` or :class:`torch.device`) or ``"cpu"``
entries. A list of CPU entries means replicas kept in host memory: the ops then run on
the Numba backend, so the whole module works (and is tested) without a GPU. A repeated
CUDA device is refused, where torch accepts one (its NCCL path declines and it copies
instead): fastpar's multi-GPU paths were not written or tested for repeats. Repeated CPU
entries are allowed. One call takes either CUDA devices or CPU entries, not both.

Which path a CUDA reduction takes is logged at DEBUG level on the ``fastpar.comm`` logger
and returned by :func:`reduce_path`:

* ``"host"``: CPU replicas, one Numba launch.
* ``"peer"``: every source GPU's memory is readable from the destination (peer access,
  enabled once per pair through torch's own peer-access cache): one Triton launch on the
  destination reads every copy directly.
* ``"staged"``: otherwise, or when the allocator forbids raw peer pointers
  (``cudaMallocAsync``, expandable segments): each other source is flattened on its own
  device (one launch), copied to the destination (one async copy), and the same fused
  K-way kernel then runs over local buffers. All those copies are on the destination at
  once: K - 1 times the list's size of extra memory there (torch's algorithm works in
  ``buffer_size`` buckets instead).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import operator
import warnings
import weakref
from collections.abc import Mapping

import numpy as np
import torch

from . import _alloc, _cuda, _dispatch, _tuning
from ._fastcheck import increment_versions
from ._flatten import byte_layout, byte_views, flatten_plain, pack_bytes, region, split_views
from ._plan import ReduceGroup, plan_for
from ._validate import (
    CAST_DTYPES,
    QUANTIZED_DTYPES,
    check_not_inference,
    check_not_quantized,
    check_not_recorded,
    check_writable,
)

__all__ = [
    "broadcast",
    "broadcast_coalesced",
    "gather",
    "reduce_add",
    "reduce_add_coalesced",
    "reduce_path",
    "scatter",
]

log = logging.getLogger("fastpar.comm")

_DEFAULT_BUFFER = 10485760


# ----------------------------------------------------------------------------- devices
_CPU = torch.device("cpu")


def _warn_minus_one(d, stacklevel: int) -> None:
    """torch's FutureWarning (its words and category) for ``-1`` naming the CPU, as an
    output device (``gather``'s destination, DataParallel's ``output_device``)."""
    if isinstance(d, int) and not isinstance(d, bool) and d == -1:
        warnings.warn(
            "Using -1 to represent CPU tensor is deprecated. Please use a "
            'device object or string instead, e.g., "cpu".',
            FutureWarning, stacklevel=_dispatch.user_stacklevel(stacklevel + 1),
        )


def _device(d, name: str, *, available: bool = True) -> torch.device:
    """``d`` as a torch.device; ``cpu:N`` is the one host memory (``cpu``). With
    ``available``, a CUDA device on a machine without CUDA is refused here, by name,
    rather than by torch's CUDA calls later."""
    if isinstance(d, bool):
        raise TypeError(f"{name} must be an int, str or torch.device, got bool {d!r}")
    if isinstance(d, torch.device):
        dev = d
    elif isinstance(d, int):
        dev = torch.device("cpu") if d == -1 else torch.device("cuda", d)
    elif isinstance(d, str):
        try:
            dev = torch.device(d)
        except RuntimeError as e:
            raise ValueError(f"{name}: {d!r} is not a device ({e})") from None
    else:
        raise TypeError(f"{name} must be an int, str or torch.device, got {type(d).__name__} {d!r}")
    if dev.type == "cpu":
        return _CPU
    if dev.type != "cuda":
        raise ValueError(f"{name} must be a CUDA device or 'cpu', got {dev}")
    if not torch.cuda.is_available():
        if available:
            raise RuntimeError(
                f"{name} is {d!r} (a CUDA device), but CUDA is not available here; "
                "host replicas take 'cpu' entries (e.g. ['cpu', 'cpu'])"
            )
        return torch.device("cuda", dev.index or 0)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _devices(devices, name: str, *, unique: bool = True) -> list[torch.device]:
    """``devices`` as torch.devices; with ``unique``, no CUDA device may repeat."""
    if isinstance(devices, (str, bytes, int, torch.device, torch.Tensor)) or not hasattr(devices, "__iter__"):
        raise TypeError(f"{name} must be a list, tuple or other iterable of devices, got {type(devices).__name__}")
    if not isinstance(devices, (list, tuple)):
        devices = list(devices)  # any iterable, as torch's take (a generator, a range)
    if not devices:
        raise ValueError(f"{name} must name at least one device, got an empty {type(devices).__name__}")
    devs = [_device(d, f"{name}[{i}]", available=False) for i, d in enumerate(devices)]
    _check_device_set(devs, name, unique=unique)
    if devs[0].type == "cuda":  # (after the set's own checks, which hold with or without CUDA)
        _device(devices[0], f"{name}[0]")
    return devs


def _check_device_set(devs, name: str, *, unique: bool = True) -> None:
    types = {d.type for d in devs}
    if len(types) > 1:
        raise ValueError(f"{name} mixes CPU and CUDA devices ({[str(d) for d in devs]}); use one kind per call")
    if not unique:  # a sum may take several inputs from one device, as torch's does
        return
    seen = {}
    for i, d in enumerate(devs):
        if d.type == "cuda":
            if d in seen:
                raise ValueError(f"{name} must not repeat a CUDA device: {d} is at positions {seen[d]} and {i}")
            seen[d] = i


def _destination(destination, devs, name: str = "destination") -> torch.device:
    """The destination device: one of ``devs`` (default: the current CUDA device for
    CUDA inputs, as torch, or the CPU for CPU replicas)."""
    if destination is None:
        dst = torch.device("cpu") if devs[0].type == "cpu" else torch.device("cuda", torch.cuda.current_device())
    else:  # (membership decides: inputs on a device mean that device is there)
        dst = _device(destination, name, available=False)
    if dst not in devs:
        raise ValueError(
            f"{name} must be one of the inputs' devices {sorted({str(d) for d in devs})}, got {dst}"
        )
    return dst


def _check_tensor(t, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(
            f"{name} has layout {t.layout}; fastpar.comm takes dense tensors (torch.strided). "
            "Densify it explicitly (reduce_add and reduce_add_coalesced also sum positions that "
            "are sparse COO on every device)."
        )


# --------------------------------------------------------------------------- broadcast
def broadcast(tensor, devices=None, *, out=None):
    r"""Broadcast a tensor to the given devices.

    Args:
        tensor (Tensor): tensor to broadcast (a CUDA tensor, or a CPU tensor for CPU
            replicas).
        devices (Iterable[torch.device, str or int], optional): devices to copy to;
            the first entry equal to ``tensor``'s device gets ``tensor`` itself, and a
            repeated ``"cpu"`` entry a copy of its own (a host replica's).
        out (Sequence[Tensor], optional, keyword-only): tensors to copy into instead.

    .. note:: Exactly one of :attr:`devices` and :attr:`out` must be given.

    Returns:
        a tuple with one tensor per device (or ``out``).
    """
    if torch.compiler.is_dynamo_compiling():  # (see _dispatch.eager_entry)
        return _broadcast_eagerly(tensor, devices, out=out)
    _check_tensor(tensor, "tensor")
    if (devices is None) == (out is None):
        raise RuntimeError(
            f"Exactly one of 'devices' and 'out' must be specified, but got devices={devices} and out={out}"
        )
    if devices is not None:
        devs = _devices(devices, "devices")
        result, own_used = [], False
        for d in devs:
            if d == tensor.device and not own_used:
                result.append(tensor)
                own_used = True
            else:  # contiguous, as torch's copies (``at::empty(sizes)``), whatever the input's strides
                result.append(tensor.to(d, copy=True, memory_format=torch.contiguous_format))
        return tuple(result)
    outs = _out_list(out, "out")
    for i, o in enumerate(outs):
        if o.shape != tensor.shape or o.dtype != tensor.dtype:
            raise ValueError(
                f"out[{i}] must match tensor (shape {tuple(tensor.shape)}, {tensor.dtype}), "
                f"got shape {tuple(o.shape)}, {o.dtype}"
            )
    _check_copy_targets(outs, "out", [tensor] * len(outs))
    for o in outs:
        o.copy_(tensor)
    return tuple(outs)


def _out_list(out, name: str) -> list:
    if not isinstance(out, (list, tuple)) or not out:
        got = f"an empty {type(out).__name__}" if isinstance(out, (list, tuple)) else type(out).__name__
        raise TypeError(f"{name} must be a non-empty list or tuple of tensors, got {got}")
    for i, o in enumerate(out):
        _check_tensor(o, f"{name}[{i}]")
    return list(out)


def _check_copy_targets(outs, name: str, srcs) -> None:
    """Every refusal of ``outs[i].copy_(srcs[i])``, checked for all outputs before the
    first is written (a refusal half-way left earlier outputs written)."""
    for i, (o, src) in enumerate(zip(outs, srcs)):
        if src.is_meta and not o.is_meta:
            raise ValueError(f"tensor is a meta tensor, with no data to copy into {name}[{i}] (on {o.device})")
        _check_copy_target(o, f"{name}[{i}]", src_requires_grad=src.requires_grad)
        _check_quantized_copy(o, src, f"{name}[{i}]", "tensor")
        if _partially_overlap(o, src):
            raise RuntimeError(f"{name}[{i}] partly overlaps the memory of its source; it must be a separate buffer")


def _check_quantized_copy(o: torch.Tensor, src: torch.Tensor, label: str, src_label: str) -> None:
    """Raise where ``o.copy_(src)`` refuses for quantization, before anything is written
    (ATen's copy_ raised after the earlier outputs or slices were written): a quantized
    source into a tensor that is not; quantized into quantized of another dtype or
    qscheme; into a quantized tensor, a source other than float32, or a pair not both
    contiguous (or both channels_last)."""
    if not (o.is_quantized or src.is_quantized):
        return
    if not o.is_quantized:
        raise RuntimeError(
            f"{src_label} is quantized ({src.dtype}) but {label} is not ({o.dtype}); copy_ does not "
            f"dequantize: pass {src_label}.dequantize()"
        )
    if src.is_quantized:
        if o.dtype != src.dtype or o.qscheme() != src.qscheme():
            raise RuntimeError(
                f"{label} ({o.dtype}, {o.qscheme()}) cannot take the quantized {src_label} "
                f"({src.dtype}, {src.qscheme()}): copy_ needs one dtype and qscheme"
            )
        return
    if src.dtype != torch.float32:
        raise RuntimeError(
            f"{label} is quantized ({o.dtype}); copy_ quantizes only float32 sources, got {src_label} of {src.dtype}"
        )
    cl = torch.channels_last
    if not (o.is_contiguous() and src.is_contiguous()
            or o.is_contiguous(memory_format=cl) and src.is_contiguous(memory_format=cl)):
        raise RuntimeError(
            f"{label} is quantized ({o.dtype}); copy_ quantizes {src_label} only where both are contiguous "
            f"(or both channels_last), got strides {o.stride()} and {src.stride()}"
        )


_MADE_BY = {  # torch's CreationMeta of a view that autograd refuses to write in place
    "MULTI_OUTPUT_NODE": "a function that returns several views (unbind, split, chunk)",
    "NO_GRAD_MODE": "torch.no_grad() from a tensor that requires grad",
    "INFERENCE_MODE": "torch.inference_mode()",
    "IN_CUSTOM_FUNCTION": "a custom autograd Function",
}


def _check_copy_target(o: torch.Tensor, label: str, *, src_requires_grad: bool) -> None:
    """Raise where torch's ``o.copy_(src)`` (autograd's ``check_inplace``) would: an
    inference tensor outside inference mode; and, when the copy would be recorded
    (grad mode on and ``o`` or the source requiring grad), a view autograd cannot
    rebase (made by ``unbind``, under ``no_grad``, ...) or a leaf, or a view of a leaf,
    that requires grad; or elements sharing memory."""
    check_not_inference(o, label)
    if torch.is_grad_enabled() and (o.requires_grad or src_requires_grad):
        view = o._is_view()
        if view:
            meta = torch._C._autograd._get_creation_meta(o).name
            if meta != "DEFAULT":
                how = _MADE_BY.get(meta, f"creation meta {meta}")
                raise RuntimeError(
                    f"{label} is a view made by {how}; autograd refuses to write it in place "
                    "(write it under torch.no_grad(), or pass a tensor of its own)"
                )
        base = o._base if view else o
        if base.is_leaf and o.requires_grad:
            what = "a view of a leaf tensor" if view else "a leaf tensor"
            raise RuntimeError(f"{label} is {what} that requires grad; it can only be written under torch.no_grad()")
    if torch._debug_has_internal_overlap(o) == 1:
        raise RuntimeError(f"{label} has elements that share memory (e.g. made by expand()); it cannot be written")


def _dense(t: torch.Tensor) -> bool:
    """Whether some order of ``t``'s dimensions is contiguous (c10's
    ``is_non_overlapping_and_dense``)."""
    need = 1
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n != 1):
        if st != need:
            return False
        need *= n
    return True


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


def _partially_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """ATen's ``get_overlap_status(a, b) == PARTIAL``, which its copies refuse: both
    dense, in one storage, their byte spans meeting without being the same elements.
    (Overlaps it cannot judge, non-dense tensors, it lets through, and so do we.)"""
    if a is b or a.numel() == 0 or b.numel() == 0 or a.device != b.device or a.is_meta:
        return False
    # One storage object (ATen's is_alias_of), not one address: two storages over the
    # same memory (from_dlpack, from_numpy twice) are separate to ATen's check.
    if not _same_storage(a, b) or not (_dense(a) and _dense(b)):
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1, b1 = a0 + a.numel() * a.element_size(), b0 + b.numel() * b.element_size()
    if (a0, a1) == (b0, b1):
        return a.stride() != b.stride()
    return a0 < b1 and b0 < a1


def broadcast_coalesced(tensors, devices, buffer_size=_DEFAULT_BUFFER):
    r"""Broadcast a sequence of tensors to the given devices.

    The tensors are flattened once on the source (one kernel launch per dtype), copied
    once to each other device, and returned there as views of that copy, so each
    device's outputs share one contiguous storage. For CPU replicas one launch per dtype
    writes every copy directly. Sparse COO tensors are copied on their own, as torch's.

    Args:
        tensors (Iterable[Tensor]): tensors to broadcast; all must be on
            ``devices[0]``.
        devices (Iterable[torch.device, str or int]): devices to copy to.
        buffer_size (int): a positive int, accepted for compatibility with torch (torch
            copies in chunks of at most this many bytes); fastpar always makes one buffer.

    Returns:
        A list with one list of tensors per device; ``result[0]`` holds ``tensors``
        themselves. The copies do not require grad.
    """
    if torch.compiler.is_dynamo_compiling():  # (see replicate: views at byte offsets, no graph)
        return _broadcast_coalesced_eagerly(tensors, devices, buffer_size)
    devs = _devices(devices, "devices")
    _check_buffer_size(buffer_size)
    tensors = _sequence(tensors)  # any iterable, as torch's takes (a generator)
    if isinstance(tensors, (list, tuple)) and not tensors:
        return [[] for _ in devs]  # as torch's: an empty list per device
    if isinstance(tensors, (list, tuple)) and _has_sparse([tensors]):
        return _broadcast_with_sparse(tensors, devs, buffer_size)
    plan = plan_for(tensors, "tensors")
    if plan.device != devs[0]:
        raise ValueError(f"tensors must be on devices[0] ({devs[0]}), got tensors on {plan.device}")
    for g in plan.groups:
        if g.dtype in QUANTIZED_DTYPES:  # (the message is built only for a refusal)
            check_not_quantized(g.dtype, f"broadcast_coalesced: tensors[{int(g.index[0])}]")  # raises
    result = [list(plan.tensors)]
    if len(devs) == 1:
        return result
    layout, nbytes = byte_layout(plan)
    if plan.device.type == "cpu":
        # Host replicas (devices never mix kinds): one launch writes every copy, reading
        # each tensor once, with no staging buffer on the source.
        bufs = [_alloc.empty(nbytes, dtype=torch.uint8, device=d) for d in devs[1:]]
        pack_bytes(plan, bufs, layout)
    else:
        src = _alloc.empty(nbytes, dtype=torch.uint8, device=plan.device)
        pack_bytes(plan, src, layout)
        bufs = [src.to(d, copy=True, non_blocking=True) for d in devs[1:]]
    result.extend(byte_views(buf, plan, layout) for buf in bufs)
    return result


def _broadcast_with_sparse(tensors, devs, buffer_size) -> list:
    """As torch's: sparse COO tensors are copied on their own (indices and values, the
    coalesced flag kept), the dense ones coalesced as usual; the order is kept."""
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo]
    for i in sparse:
        if tensors[i].device != devs[0]:
            raise ValueError(f"tensors must be on devices[0] ({devs[0]}), got tensors[{i}] on {tensors[i].device}")
    sparse_set = set(sparse)
    dense = [i for i in range(len(tensors)) if i not in sparse_set]
    dense_copies = broadcast_coalesced([tensors[i] for i in dense], devs, buffer_size) if dense else None
    result = [list(tensors)]
    for j, d in enumerate(devs[1:], 1):
        copies = [None] * len(tensors)
        for i, c in zip(dense, dense_copies[j] if dense else ()):
            copies[i] = c
        for i in sparse:
            copies[i] = sparse_copy(tensors[i], d)
        result.append(copies)
    return result


def sparse_copy(t: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    """A new sparse COO tensor like ``t``, with no autograd history and its coalesced
    flag kept: on ``device``, its indices and values copied, as torch's
    ``broadcast_coalesced`` makes one; with ``device`` None, sharing ``t``'s indices and
    values (an alias)."""
    t = t.detach()
    indices, values = t._indices(), t._values()
    if device is not None:
        indices, values = indices.to(device, copy=True), values.to(device, copy=True)
    # (Unchecked, as torch's unflatten_sparse_tensors: the parts are a valid tensor's.)
    return torch.sparse_coo_tensor(indices, values, t.shape, is_coalesced=t.is_coalesced(), check_invariants=False)


def _check_buffer_size(buffer_size) -> None:
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size <= 0:
        n = _as_int(buffer_size)  # (a numpy integer: torch's take one, as an int64 argument)
        if n is None or n <= 0:
            raise ValueError(f"buffer_size must be a positive int, got {buffer_size!r}")


# ------------------------------------------------------------------------------ reduce
def reduce_path(devices, destination) -> str:
    """``"host"``, ``"peer"`` or ``"staged"``: how a reduction from ``devices`` onto
    ``destination`` runs (see the module docstring).

    Args:
        devices (Iterable[torch.device, str or int]): the inputs' devices (repeats
            allowed, as for :func:`reduce_add_coalesced`).
        destination (torch.device, str or int): the device the sums are written on.

    Raises:
        TypeError: ``devices`` is a single device or string rather than an iterable of
            them, or an entry is not an int, str or torch.device.
        ValueError: an entry is not a device, or ``devices`` mixes CPU and CUDA.
        RuntimeError: CUDA devices on a machine without CUDA.
    """
    devs = _devices(devices, "devices", unique=False)
    dst = _device(destination, "destination")
    if dst.type == "cpu":
        return "host"
    return "peer" if _cuda.enable_peer_access(dst, devs) else "staged"


def reduce_add(inputs, destination=None):
    r"""Sum tensors from multiple devices, in one kernel launch.

    Args:
        inputs (list or tuple of Tensor): tensors to add, one per device (same shape and
            dtype).
        destination (int, str or torch.device, optional): device for the result, one of
            the inputs' devices (default: the current CUDA device, or the CPU for CPU
            replicas).

    Returns:
        A tensor on ``destination`` holding the element-wise sum (16-bit floats are
        accumulated in float32 and rounded once; sparse COO inputs give a sparse sum, or a
        dense one when a dense input is among them). A dense sum records no autograd
        history, as on torch's NCCL path; a sparse sum is made with ``torch.add``, as
        torch's is, and records it. A single input is returned as it is, as in torch.
    """
    if torch.compiler.is_dynamo_compiling():  # (see _dispatch.eager_entry)
        return _reduce_add_eagerly(inputs, destination)
    if isinstance(inputs, (list, tuple)) and _has_sparse([inputs]):
        # As torch's (without NCCL): sparse COO inputs give a sparse sum, and with a
        # dense one among them, a dense sum.
        [result] = reduce_add_coalesced([[t] for t in inputs], destination)
        return result
    tensors = _checked_any_device(inputs, "inputs")
    devs = [t.device for t in tensors]
    _check_device_set(devs, "inputs' devices", unique=False)
    t0 = tensors[0]
    for i, t in enumerate(tensors[1:], 1):
        if t.shape != t0.shape or t.dtype != t0.dtype:
            raise ValueError(
                f"inputs[{i}] (on {t.device}) has shape {tuple(t.shape)} and dtype {t.dtype}, but inputs[0] "
                f"(on {t0.device}) has shape {tuple(t0.shape)} and dtype {t0.dtype}"
            )
    dst = _destination(destination, devs)
    if not t0.dtype.is_complex:
        _check_reducible(t0.dtype, "inputs")
    if len(tensors) == 1:
        return tensors[0]  # as torch: nothing to add
    perm = _dense_order(tensors)
    if perm is not None:
        # Inputs laid out alike but not contiguously (channels_last, transposed): the
        # result gets their layout, as torch's ``+`` gives it, and they are summed as
        # the contiguous permuted views they are (no staging copies).
        result = torch.empty_like(t0, device=dst)
        reduce_add_coalesced([_permuted(t, perm, f"inputs[{i}]") for i, t in enumerate(tensors)], dst,
                             out=[result.permute(perm)])
        return result
    [result] = reduce_add_coalesced([[t] for t in tensors], dst)
    return result


def _dense_order(tensors):
    """The dimension order (outermost first) in which every tensor of ``tensors`` is
    contiguous, when they share one that is not the plain order; else None."""
    t0 = tensors[0]
    if t0.dim() < 2 or t0.is_contiguous() or t0.layout != torch.strided:
        return None
    perm = sorted(range(t0.dim()), key=lambda d: (-t0.stride(d), d))
    if all(t.layout == torch.strided and t.stride() == t0.stride() and t.permute(perm).is_contiguous()
           for t in tensors):
        return perm
    return None


def _permuted(t: torch.Tensor, perm: list, name: str) -> list:
    """``[t.permute(perm)]``, kept on the cached plan of ``[t]`` (:func:`_kept`), as
    :func:`_real_views` keeps a complex list's real views: a loop reducing the same
    tensors passes the same view each call, and hits the plan cache with it, where a
    new view made a new plan on every call (K=2 transposed 64x64 float32: 3 plans and
    0.22 ms a call; now the new result's plan alone, 0.12 ms; contiguous inputs 0.04 ms).
    A plan hit means the same tensor with the same data pointer, sizes and strides, so
    the view made at the first call still describes it (a view of a detached alias:
    see :func:`_kept`)."""
    plan = plan_for([t], name)
    if not plan.reusable:  # (no later call finds it: nothing to keep views on)
        return [t.permute(perm)]
    return _kept(plan, ("_permuted", tuple(perm)), lambda ts: [ts[0].detach().permute(perm)])


def _check_reducible(dtype, name: str) -> None:
    if dtype not in CAST_DTYPES:
        raise TypeError(
            f"{name}: cannot reduce {dtype} tensors; the reduce kernels support "
            f"{', '.join(str(d).replace('torch.', '') for d in CAST_DTYPES)}"
        )


def reduce_add_coalesced(inputs, destination=None, buffer_size=_DEFAULT_BUFFER, *, out=None):
    r"""Sum tensors from multiple devices, position by position, in one kernel launch
    per dtype.

    Args:
        inputs (Iterable[Iterable[Tensor]]): one list of tensors per device; the lists
            have the same length and, at each position, the same shape and dtype.
        destination (int, str or torch.device, optional): device for the results, one
            of the inputs' devices (default: the current CUDA device, or the CPU).
        buffer_size (int): a positive int, accepted for compatibility with torch (torch
            reduces in chunks of at most this many bytes); fastpar reduces everything at
            once.
        out (Sequence[Tensor], optional, keyword-only): contiguous tensors on
            ``destination`` to write the sums into in place (e.g. the ``.grad`` tensors of
            the source module); they must not overlap the inputs.

    Returns:
        A tuple of tensors on ``destination`` (as torch's), in input order: ``out``'s if given, else
        pieces of one new buffer per dtype (separate tensors, not autograd views of that
        buffer). 16-bit floats are accumulated in float32 and rounded once; complex
        tensors are summed as their real views. Sparse COO tensors (without ``out``)
        follow torch: a position sparse on every device is summed with ``torch.add``
        into a sparse result (which, as torch's, records autograd history), a position
        sparse on some devices only is densified. The fused kernel's sums record no
        autograd history, as on torch's NCCL path.
    """
    if torch.compiler.is_dynamo_compiling():  # (see _dispatch.eager_entry)
        return _reduce_add_coalesced_eagerly(inputs, destination, buffer_size, out=out)
    _check_buffer_size(buffer_size)
    inputs = _sequence(inputs)  # any iterable of per-device lists
    if isinstance(inputs, (list, tuple)) and not all(isinstance(lst, (list, tuple)) for lst in inputs):
        inputs = [_sequence(lst) for lst in inputs]  # (a list's plan is cached on the list itself)
    if not isinstance(inputs, (list, tuple)) or not inputs:
        raise TypeError(f"inputs must be a non-empty list of per-device tensor lists, got {inputs!r:.80}")
    if (out is None or isinstance(out, (list, tuple)) and not out) \
            and all(isinstance(lst, (list, tuple)) and not lst for lst in inputs):
        return ()  # as torch's: nothing to sum (and an empty out holds every sum)
    try:
        plans = [plan_for(lst, f"inputs[{k}]") for k, lst in enumerate(inputs)]
    except TypeError:
        # Looked for only once the fast path has refused the lists (no per-call scan).
        sparse = _first_sparse(inputs)
        if sparse is not None:
            if out is None:
                return _reduce_with_sparse(inputs, destination, buffer_size)
            k, i = sparse
            raise TypeError(
                f"inputs[{k}][{i}] has layout torch.sparse_coo; sparse COO tensors are summed only with "
                "out=None (into new sparse or dense results, as torch's reduce_add_coalesced); densify "
                "them to reduce into out"
            ) from None
        raise
    devs = [p.device for p in plans]
    _check_device_set(devs, "inputs' devices", unique=False)
    _check_same_layout(plans)
    dst = _destination(destination, devs)
    complex_ = any(g.dtype.is_complex for g in plans[0].groups)
    for g in plans[0].groups:
        if not g.dtype.is_complex:
            _check_reducible(g.dtype, f"inputs[0][{int(g.index[0])}]")
    if out is not None:
        # Checked against the inputs as given: for complex ones, before their real views
        # could hide a complex/real mismatch (a float (..., 2) out for a complex input).
        out_plan = _check_out(out, plans[0], plans, dst)
    if complex_:
        return _reduce_complex(plans, destination, buffer_size, out, None if out is None else out_plan)
    # -- validated: from here on, launches (on CUDA, kernel() refuses a graph capture).
    backend, launch = _dispatch.kernel("reduce_add", dst)
    if dst.type == "cpu":
        path = "host"
    else:
        path = "peer" if _cuda.enable_peer_access(dst, devs) else "staged"
    log.debug("reduce_add_coalesced: %d sources -> %s, %s path", len(plans), dst, path)
    if out is None:
        dst_addr, dst_tensors, result, fresh = _result_buffers(plans[0], dst)
    else:
        dst_addr = [g.addrs for g in out_plan.groups]
        dst_tensors = [g.tensors for g in out_plan.groups]
        fresh = [False] * len(out_plan.groups)
    # A cached out= plan keeps the last pointer table made for it (ReduceGroup.device_table).
    table_caches = ([None] * len(plans[0].groups) if out is None
                    else [None if g.transient else g._tables for g in out_plan.groups])
    sources, keep_alive = _source_addresses(plans, dst, path)
    if path == "peer":
        # The kernel reads other devices' memory directly: order it after their streams.
        # (The staged path reads only memory on dst, where torch's copies ordered it.)
        _cuda.wait_for(dst, devs)
    for gi, g in enumerate(plans[0].groups):
        group = ReduceGroup(
            g.dtype, dst, np.stack([s[gi] for s in sources]), dst_addr[gi], g.numels,
            [kept[gi] for kept in keep_alive], dst_tensors[gi], g._blocks, fresh=fresh[gi],
            table_cache=table_caches[gi],
        )
        launch(group, **_tuning.params("reduce_add", backend, g.dtype, g.dtype, g.numel, dst))
    if path == "peer":
        _cuda.release_to(dst, devs)
    if out is not None:
        increment_versions(out_plan.tensors, out_plan.impls)
        return tuple(out)
    return tuple(result)


def _first_sparse(inputs):
    """``(k, i)`` of the first sparse COO tensor ``inputs[k][i]``, or None."""
    return next(((k, i) for k, lst in enumerate(inputs) if isinstance(lst, (list, tuple))
                 for i, t in enumerate(lst) if isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo), None)


def _has_sparse(inputs) -> bool:
    return _first_sparse(inputs) is not None


def _reduce_with_sparse(inputs, destination, buffer_size) -> list:
    """torch's rule for sparse COO gradients (an ``nn.Embedding(sparse=True)``): a
    position sparse on every device is summed as sparse tensors on the destination
    (``torch.add``, as torch's ``reduce_add`` does); a position sparse on some devices
    only is densified; the dense positions are reduced together by the fused kernel."""
    lists = [list(lst) if isinstance(lst, (list, tuple)) else lst for lst in inputs]
    for k, lst in enumerate(lists):
        if not isinstance(lst, list) or len(lst) != len(lists[0]):
            raise ValueError(
                f"inputs[{k}] must be a list of {len(lists[0])} tensors (one per position, as inputs[0]), "
                f"got {type(lst).__name__}{f' of {len(lst)}' if isinstance(lst, list) else ''}"
            )
    for k, lst in enumerate(lists):
        for i, t in enumerate(lst):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"inputs[{k}][{i}] must be a torch.Tensor, got {type(t).__name__}")
            if t.layout not in (torch.strided, torch.sparse_coo):
                _check_tensor(t, f"inputs[{k}][{i}]")  # raises, naming the layout
    devs = [lst[0].device for lst in lists] if lists[0] else []
    dst = _destination(destination, devs) if devs else None
    result, dense = [None] * len(lists[0]), []
    for i, col in enumerate(zip(*lists)):
        for k, t in enumerate(col):
            if t.shape != col[0].shape or t.dtype != col[0].dtype:
                raise ValueError(
                    f"position {i}: inputs[{k}][{i}] on {t.device} has shape {tuple(t.shape)} and dtype {t.dtype}, "
                    f"but inputs[0][{i}] on {col[0].device} has shape {tuple(col[0].shape)} and dtype {col[0].dtype}"
                )
        if all(t.layout == torch.sparse_coo for t in col):
            result[i] = functools.reduce(torch.add, [t.to(dst) for t in col])
        else:
            dense.append(i)
    if dense:
        sums = reduce_add_coalesced(
            [[lst[i].to_dense() if lst[i].layout == torch.sparse_coo else lst[i] for i in dense] for lst in lists],
            destination, buffer_size,
        )
        for i, total in zip(dense, sums):
            result[i] = total
    return tuple(result)


def _as_real(tensors) -> list:
    # resolve_conj: a lazily conjugated gradient (of w.conj() or w.mH) has no real view.
    return [torch.view_as_real(t.resolve_conj()) if t.is_complex() else t for t in tensors]


def _real_views(plan) -> list:
    """``_as_real(plan.tensors)``, kept on a cached plan: passing the same real views
    each call, a loop hits the plan cache with them too, where new views made new plans
    on every call (K=2 into ``out=``, 184 small complex tensors: 1.3 ms a call against
    60 us for real ones). Kept only where every item is a view or the tensor itself (a
    lazily conjugated or negated tensor is resolved into a new copy per call). A plan
    hit means the same tensor objects with the same data pointers, sizes, strides and
    dispatch keys, so views made at the first call still describe them."""
    if not plan.reusable:  # (no later call finds it: nothing to keep views on)
        return _as_real(plan.tensors)
    if "_real_views" not in plan.__dict__ and any(t.is_conj() or t.is_neg() for t in plan.tensors):
        return _as_real(plan.tensors)
    return _kept(plan, "_real_views", _real_list)


def _real_list(tensors) -> list:
    """``_as_real(tensors)`` made of detached aliases of them (:func:`_kept`): a list of
    new objects, so that its plan's cache key (length, first and last ids) is never the
    plan's own, as it was with a real tensor at either end taken as it is (the two plans
    evicted each other on every call: 184 mixed tensors with real ends, K=2 into out=:
    6 plans built a call, 2.2 ms against 80 us)."""
    return _as_real([t.detach() for t in tensors])


def _kept(plan, key, make) -> list:
    """``make(plan.tensors)``, made once and kept on the cached ``plan`` under ``key``.

    ``make`` builds its views from ``t.detach()`` aliases (the same storage and version
    counter, so writes through them bump the tensors' versions), never from the
    tensors themselves: a view of a tensor refers to its TensorImpl, and while that
    impl has an owner besides the tensor's Python object, torch keeps that object alive
    from the impl (one more reference). That reference came and went with other views
    of the tensor (the caller's, another plan's), so no count of it fixed at the first
    call was right later: where it was missed, the plan never looked orphaned to the
    plan cache and kept the caller's tensors alive; and ``torch.utils.swap_tensors``
    refused the tensors while the plan was cached. Aliases add no reference to the
    tensors, so ``plan.internal_refs`` needs nothing added."""
    hit = plan.__dict__.get(key)
    if hit is None:
        hit = plan.__dict__.setdefault(key, make(plan.tensors))
    return hit


def _reduce_complex(plans, destination, buffer_size, out, out_plan):
    """Complex positions are summed as their real views (pairs of floats), as torch's
    comm does with ``view_as_real``; the results are complex views of real pieces.
    ``out`` has been checked against the complex inputs (:func:`_check_out`)."""
    was_complex = [t.is_complex() for t in plans[0].tensors]
    result = reduce_add_coalesced([_real_views(p) for p in plans], destination, buffer_size,
                                  out=None if out is None else _real_views(out_plan))
    if out is not None:
        return tuple(out)
    # A piece that follows an odd number of reals in the shared buffer is copied: a
    # complex view needs a storage offset of whole complex elements.
    return tuple(torch.view_as_complex(r if r.storage_offset() % 2 == 0 else r.clone()) if c else r
                 for r, c in zip(result, was_complex))


def _result_buffers(plan, dst):
    """New result tensors for ``plan``'s positions on ``dst``: per dtype group, their
    addresses and the tensors, and all of them in plan order.

    Each dtype group's results are pieces of one buffer: on the CPU, one that an
    earlier call's results no longer use (:class:`fastpar._alloc.ResultCache`), else a
    new one on huge pages. Buffers of at most ``buffer_size`` (torch's buckets) left to
    glibc were tried: it recycled them without a fault on some calls and returned them to
    the kernel on others (heap trimming), so a K=2 Transformer reduction took 27 ms or
    200 ms from one call to the next; a new buffer on huge pages every call took 37-60 ms
    at K=4. The last item says, per group, whether the buffer is a new one.
    """
    result = [None] * len(plan.tensors)
    addrs, per_group, fresh = [], [], []
    for g, (local, sizes, not_1d) in zip(plan.groups, _result_layout(plan)):
        buf, reused = _RESULTS.empty(g.numel, g.dtype, dst)
        fresh.append(not reused)
        addrs.append(buf.data_ptr() + local)
        views = split_views(buf, sizes, not_1d, autograd_views=False)
        if len(plan.groups) == 1:  # one dtype: the group is the plan, in order
            result = views
        else:
            for i, v in zip(g.index.tolist(), views):
                result[i] = v
        per_group.append(views)
    return addrs, per_group, result, fresh


#: Result buffers of reduce_add_coalesced, refilled once their results are gone (shared
#: with flatten's results).
_RESULTS = _alloc.RESULTS


def _result_layout(plan):
    """Per group (computed once per plan): each result's byte offset in the group's
    buffer, the results' numels, and ``(j, shape)`` for those that are not 1-D."""
    hit = plan.__dict__.get("_result_layout")
    if hit is None:
        hit = []
        shapes = plan.shapes
        for g in plan.groups:
            local = g.local_offsets * g.dtype.itemsize
            not_1d = [(j, shapes[i]) for j, i in enumerate(g.index.tolist()) if len(shapes[i]) != 1]
            hit.append((local, g.numels.tolist(), not_1d))
        plan.__dict__["_result_layout"] = hit
    return hit


def _check_same_layout(plans) -> None:
    p0 = plans[0]
    checked = p0.__dict__.setdefault("_same_layout", weakref.WeakSet())
    for k, p in enumerate(plans[1:], 1):
        if p in checked:  # plans are immutable while cached: checked once per pair
            continue
        if len(p.tensors) != len(p0.tensors):
            raise ValueError(
                f"inputs[{k}] (on {p.device}) has {len(p.tensors)} tensors but inputs[0] (on {p0.device}) "
                f"has {len(p0.tensors)}; every device must hold the same list"
            )
        if p.dtypes != p0.dtypes or not np.array_equal(p.numels, p0.numels) or p.shapes != p0.shapes:
            i = next(i for i, (a, b) in enumerate(zip(p.tensors, p0.tensors)) if a.shape != b.shape or a.dtype != b.dtype)
            raise ValueError(
                f"position {i}: inputs[{k}][{i}] on {p.device} has shape {tuple(p.tensors[i].shape)} "
                f"({p.dtypes[i]}) but inputs[0][{i}] on {p0.device} has shape {tuple(p0.tensors[i].shape)} "
                f"({p0.dtypes[i]})"
            )
        checked.add(p)


def _check_out(out, p0, plans, dst):
    out_plan = plan_for(out, "out")
    if out_plan.device != dst:
        raise ValueError(f"out must be on the destination {dst}, got tensors on {out_plan.device}")
    if len(out_plan.tensors) != len(p0.tensors):
        raise ValueError(f"out must hold {len(p0.tensors)} tensors (one per input position), got {len(out_plan.tensors)}")
    matched = out_plan.__dict__.setdefault("_matches", weakref.WeakSet())
    if p0 not in matched and (out_plan.dtypes != p0.dtypes or out_plan.shapes != p0.shapes):
        i = next(i for i, (a, b) in enumerate(zip(out_plan.tensors, p0.tensors)) if a.shape != b.shape or a.dtype != b.dtype)
        raise ValueError(
            f"out[{i}] has shape {tuple(out_plan.tensors[i].shape)} and dtype {out_plan.dtypes[i]}, but the inputs at "
            f"position {i} have shape {tuple(p0.tensors[i].shape)} and dtype {p0.dtypes[i]}"
        )
    matched.add(p0)
    if len(out_plan.noncontig):
        i = int(out_plan.noncontig[0])
        o = out_plan.tensors[i]
        if o.is_conj() or o.is_neg():  # staged like non-contiguous tensors, so listed there
            raise ValueError(
                f"out[{i}] is a lazily {'conjugated' if o.is_conj() else 'negated'} view; pass a "
                "resolved tensor (resolve_conj() / resolve_neg()) to be written in place"
            )
        raise ValueError(f"out[{i}] must be contiguous (the kernel writes it in place), got strides {o.stride()}")
    check_writable(out_plan, "out")
    if torch.is_grad_enabled() and out_plan.first_requiring_grad >= 0:
        i = out_plan.first_requiring_grad
        check_not_recorded(out_plan.tensors[i], f"out[{i}]")
    hit = out_plan.self_overlap()
    if hit is not None:
        raise ValueError(
            f"out[{hit[0]}] and out[{hit[1]}] share memory; the sums are written at once, so which "
            "lands there would be undefined: pass separate tensors"
        )
    for k, p in enumerate(plans):
        hit = out_plan.overlap_with(p)
        if hit is not None:
            i, j = hit
            raise ValueError(f"out[{i}] overlaps the memory of inputs[{k}][{j}]; out must be separate buffers")
    return out_plan


def _source_addresses(plans, dst, path):
    """Per source, per dtype group: the int64 addresses the kernel reads, and the tensors
    that must stay alive until it has. Non-contiguous inputs, and on the staged path
    every other device's list, go through one flat buffer on ``dst``."""
    addrs, keep = [], []
    for p in plans:
        if (path == "staged" and p.device != dst) or len(p.noncontig):
            layout, nbytes = byte_layout(p)
            buf = torch.empty(nbytes, dtype=torch.uint8, device=p.device)
            pack_bytes(p, buf, layout)  # one launch per dtype on the source device
            if p.device != dst:
                buf = buf.to(dst, non_blocking=True)  # one async copy per source
            addrs.append([buf.data_ptr() + off + g.local_offsets * g.dtype.itemsize for g, off in zip(p.groups, layout)])
            keep.append([region(buf, g, off) for g, off in zip(p.groups, layout)])
        else:
            addrs.append([g.addrs for g in p.groups])
            keep.append([g.tensors for g in p.groups])  # the plan's own tuples: no copy
    return addrs, keep


# ------------------------------------------------------------------------ scatter/gather
def scatter(tensor, devices=None, chunk_sizes=None, dim=0, streams=None, *, out=None):
    r"""Scatter a tensor across devices along ``dim``.

    Args:
        tensor (Tensor): tensor to scatter.
        devices (Iterable[torch.device, str or int], optional): devices to scatter to.
        chunk_sizes (Iterable[int], optional): sizes of the chunks; they must sum to
            ``tensor.size(dim)``. Default: ``tensor.chunk(len(devices), dim)``.
        dim (int, optional): dimension to chunk along. Default: ``0``.
        streams (Iterable[torch.cuda.Stream], optional): streams to copy on.
        out (Sequence[Tensor], optional, keyword-only): tensors to copy into; their
            sizes along ``dim`` give the chunk sizes.

    .. note:: Exactly one of :attr:`devices` and :attr:`out` must be given; a chunk that
        is already on its target device is returned as a view, not a copy.

    Returns:
        a tuple of chunks, one per device (or ``out``).
    """
    if torch.compiler.is_dynamo_compiling():  # (see _dispatch.eager_entry)
        return _scatter_eagerly(tensor, devices, chunk_sizes, dim, streams, out=out)
    _check_tensor(tensor, "tensor")
    if (devices is None) == (out is None):
        raise RuntimeError(
            f"Exactly one of 'devices' and 'out' must be specified, but got devices={devices} and out={out}"
        )
    if tensor.dim() == 0:
        raise ValueError("tensor must have at least one dimension to scatter, got a 0-dim tensor")
    dim = _dim(dim, tensor.dim())
    size = tensor.size(dim)
    # As torch's: streams[i] (when there is one) orders the copy to the i-th device; a
    # shorter list leaves the rest on the current stream.
    streams = None if streams is None else _listed(streams, "streams", "CUDA streams (or None)")
    if out is not None:
        outs = _out_list(out, "out")
        if chunk_sizes is not None:
            raise RuntimeError("'chunk_sizes' must not be specified when 'out' is specified")
        sizes = [o.size(dim) if o.dim() == tensor.dim() else -1 for o in outs]
        for i, o in enumerate(outs):
            expected = list(tensor.shape)
            expected[dim] = sizes[i]
            if o.dim() != tensor.dim() or list(o.shape) != expected or o.dtype != tensor.dtype:
                raise ValueError(
                    f"out[{i}] must have tensor's shape {tuple(tensor.shape)} except along dim {dim} and dtype "
                    f"{tensor.dtype}, got shape {tuple(o.shape)}, {o.dtype}"
                )
        if sum(sizes) != size:
            raise ValueError(f"the sizes of out along dim {dim} must sum to {size}, got {sizes} (sum {sum(sizes)})")
        _check_streams(streams, [o.device for o in outs], "out")
        chunks = tensor.split(sizes, dim)
        _check_copy_targets(outs, "out", chunks)
        for i, (o, chunk) in enumerate(zip(outs, chunks)):
            # Asynchronous only into device memory: into host memory (pinned) it could
            # still be running when the caller reads ``out``.
            with _on_stream(streams, i):
                o.copy_(chunk, non_blocking=o.is_cuda)
        return tuple(outs)
    # A device may take several chunks, as in torch's (Gather's backward scatters to
    # its inputs' devices, which may repeat).
    devs = _devices(devices, "devices", unique=False)
    if chunk_sizes is None:
        chunks = tensor.chunk(len(devs), dim)  # fewer chunks than devices for a small dim, as torch
        devs = devs[: len(chunks)]
    else:
        sizes = _listed(chunk_sizes, "chunk_sizes", "ints")
        if len(sizes) != len(devs):
            raise ValueError(f"chunk_sizes must have one entry per device ({len(devs)}), got {len(sizes)}")
        ints = [_as_int(s) for s in sizes]
        if any(s is None or s < 0 for s in ints):
            raise ValueError(f"chunk_sizes must be non-negative ints, got {sizes}")
        sizes = ints
        if sum(sizes) != size:
            raise ValueError(
                f"chunk_sizes must sum to tensor.size({dim}) = {size}, got {sizes} (sum {sum(sizes)})"
            )
        chunks = tensor.split(sizes, dim)
    _check_streams(streams, devs, "devices")  # (a short dim leaves devices without a chunk)
    result = []
    for i, (chunk, d) in enumerate(zip(chunks, devs)):
        if chunk.device == d:
            result.append(chunk)  # already there: a view, not a copy
        else:
            # A device-to-host copy stays synchronous: with non_blocking, torch returns
            # pinned memory that the copy may still be writing.
            with _on_stream(streams, i):
                result.append(chunk.to(d, non_blocking=d.type == "cuda"))
    return tuple(result)


def _listed(obj, name: str, what: str) -> list:
    """``list(obj)``; an object that cannot be iterated (an int, one stream) is refused
    by name, where ``list`` raised "'int' object is not iterable", naming nothing."""
    try:
        it = iter(obj)
    except TypeError:
        raise TypeError(f"{name} must be an iterable of {what}, got {type(obj).__name__} {obj!r:.80}") from None
    return list(it)


def _check_streams(streams, devs, name: str) -> None:
    """As torch's scatter: a stream of another device than its target would order
    nothing there. Checked before any copy."""
    for i, (st, d) in enumerate(zip(streams or (), devs)):
        if st is not None and d.type == "cuda" and st.device != d:
            raise ValueError(f"streams[{i}] is a stream of {st.device}, but {name}[{i}] is {d}")


def _on_stream(streams, i: int):
    """``torch.cuda.stream(streams[i])``, or no change where there is none."""
    if streams is not None and i < len(streams) and streams[i] is not None:
        return torch.cuda.stream(streams[i])
    return contextlib.nullcontext()


def _shared_memory_format(ts) -> torch.memory_format:
    """torch's gather: ``tensors[0]``'s ``suggest_memory_format()``, kept if every tensor
    suggests it, else contiguous. A tensor suggests ``channels_last``
    (``channels_last_3d``) when its strides are ordered as that format's, contiguous or
    not (c10's ``is_channels_last_strides_2d``/``_3d``): channels_last tensors sliced
    along a spatial dimension gather into a channels_last result, as torch's do."""
    fmt = _suggest_memory_format(ts[0])
    if fmt is not torch.contiguous_format and any(_suggest_memory_format(t) is not fmt for t in ts[1:]):
        return torch.contiguous_format
    return fmt


def _suggest_memory_format(t: torch.Tensor) -> torch.memory_format:
    """``t.suggest_memory_format()`` (c10's, whose strides test this mirrors)."""
    order = {4: (1, 3, 2, 0), 5: (1, 4, 3, 2, 0)}.get(t.dim())
    if order is None or t.layout != torch.strided:
        return torch.contiguous_format
    sizes, strides = t.shape, t.stride()
    if strides[1] == 0:
        return torch.contiguous_format
    least = 0
    for d in order:
        if sizes[d] == 0 or strides[d] < least:
            return torch.contiguous_format
        # (N111 contiguous, or N11W sliced along W: ambiguous, taken as contiguous)
        if d == 0 and least == strides[1]:
            return torch.contiguous_format
        least = strides[d] * sizes[d]
    return torch.channels_last if t.dim() == 4 else torch.channels_last_3d


def _as_int(x):
    """``x`` as an int where torch's C++ int arguments take it (an int, a numpy integer,
    a one-element integer tensor: anything with ``__index__``), a bool excepted; else None."""
    if isinstance(x, bool) or (isinstance(x, torch.Tensor) and x.dtype == torch.bool):
        return None
    try:
        return operator.index(x)
    except TypeError:
        return None


def _dim(dim, ndim: int) -> int:
    d = _as_int(dim)
    if d is None or not -ndim <= d < ndim:
        raise ValueError(f"dim must be an int in [{-ndim}, {ndim}), got {dim!r}")
    return d % ndim


def gather(tensors, dim=0, destination=None, *, out=None):
    r"""Gather tensors from multiple devices, concatenated along ``dim``.

    Args:
        tensors (Iterable[Tensor]): tensors to gather; sizes in every dimension other
            than ``dim`` must match.
        dim (int, optional): dimension to concatenate along. Default: ``0``.
        destination (torch.device, str, or int, optional): output device (``-1`` means
            CPU; default: the current CUDA device, or the CPU for CPU tensors).
        out (Tensor, optional, keyword-only): tensor to gather into.

    .. note:: 0-dim tensors gathered along dim 0 are unsqueezed into a vector, with a
        warning, as ``torch.nn.DataParallel`` does; along another dim they raise
        ``ValueError``.

    .. note:: As torch's, the result has ``tensors[0]``'s dtype (or ``out``'s) and other
        dtypes are converted by ``Tensor.copy_``.

    Returns:
        ``out`` if given, else a new tensor on ``destination``.
    """
    if torch.compiler.is_dynamo_compiling():  # (see _dispatch.eager_entry)
        return _gather_eagerly(tensors, dim, destination, out=out)
    ts = list(_checked_any_device(_sequence(tensors), "tensors"))
    given = ts  # (the caller's tensors: flatten takes 0-dim ones as they are, below)
    if all(t.dim() == 0 for t in ts):
        # Only along dim 0 (or -1, the same dimension of the vector made), as torch's
        # Gather: along another dim this warned that it "was asked to gather along
        # dimension 0" and then refused the dim.
        d = _as_int(dim)
        if d is None:
            _dim(dim, 1)  # raises, naming dim
        if d not in (0, -1):
            raise ValueError(
                f"tensors are all 0-dim, with no dimension {d} to gather along (0-dim tensors are "
                "gathered into a vector only along dim 0)"
            )
        warnings.warn(
            "Was asked to gather along dimension 0, but all input tensors were scalars; "
            "will instead unsqueeze and return a vector.",
            stacklevel=_dispatch.user_stacklevel(2),  # (the caller's line, as for -1 below)
        )
        ts = [t.view(1) for t in ts]
    ndim = ts[0].dim()
    dim = _dim(dim, max(ndim, 1))
    t0 = ts[0]
    for i, t in enumerate(ts):
        if t.dim() != ndim or any(a != b for j, (a, b) in enumerate(zip(t.shape, t0.shape)) if j != dim):
            raise ValueError(
                f"tensors[{i}] (on {t.device}) has shape {tuple(t.shape)}, incompatible with "
                f"tensors[0] (on {t0.device}) shape {tuple(t0.shape)} outside dim {dim}"
            )
    shape = list(t0.shape)
    shape[dim] = sum(t.size(dim) for t in ts)
    out_given = out
    if out is not None:
        if destination is not None:
            raise RuntimeError("'destination' must not be specified when 'out' is specified")
        _check_tensor(out, "out")
        if list(out.shape) != shape:
            raise ValueError(f"out must have shape {tuple(shape)}, got {tuple(out.shape)}")
        _check_copy_target(out, "out", src_requires_grad=any(t.requires_grad for t in ts))
        off = 0
        for i, t in enumerate(ts):  # as torch's, each input is copied into its slice
            if t.is_meta and not out.is_meta:
                raise ValueError(f"tensors[{i}] is a meta tensor, with no data to copy into out (on {out.device})")
            if _partially_overlap(out.narrow(dim, off, t.size(dim)), t):
                raise RuntimeError(f"out partly overlaps the memory of tensors[{i}]; it must be a separate buffer")
            off += t.size(dim)
        # Inputs already in out's storage (each its own slice: torch copies nothing) take
        # the per-input copies, which skip the same elements, not the one-launch path,
        # which refuses any overlap.
        in_place = any(_same_storage(out, t) for t in ts)
        dst = out.device
    else:
        devs = [t.device for t in ts]
        if destination is None:
            dst = torch.device("cpu") if devs[0].type == "cpu" else torch.device("cuda", torch.cuda.current_device())
        else:
            _warn_minus_one(destination, stacklevel=2)
            dst = _device(destination, "destination")
        in_place = False
        # (A new tensor of a quantized dtype would have no quantizer: no values to give.)
        if t0.dtype in QUANTIZED_DTYPES:
            check_not_quantized(t0.dtype, "gather: tensors[0]")  # raises
        fmt = _shared_memory_format(ts)
        if fmt is torch.contiguous_format:
            out = _alloc.empty(shape, dtype=t0.dtype, device=dst)
        else:  # as torch's gather: a layout every input shares is kept
            out = torch.empty(shape, dtype=t0.dtype, device=dst, memory_format=fmt)
    if out.is_quantized or any(t.is_quantized for t in ts):
        # copy_'s quantization refusals, checked before the first slice is written.
        off, label = 0, "the result" if out_given is None else "out"
        for i, t in enumerate(ts):
            _check_quantized_copy(out.narrow(dim, off, t.size(dim)), t, f"{label}'s slice {i}", f"tensors[{i}]")
            off += t.size(dim)
    # (Not when autograd would record the copies, as it records torch's: the one-launch
    # copy is invisible to it.)
    tracked = torch.is_grad_enabled() and (out.requires_grad or any(t.requires_grad for t in ts))
    if dim == 0 and out.is_contiguous() and all(t.device == dst and t.dtype == out.dtype for t in ts) \
            and out.numel() and out.element_size() in (1, 2, 4, 8) and not tracked and not in_place \
            and not out.is_conj() and not out.is_neg() and not out.is_quantized:
        # Rows of a contiguous result along dim 0 are the inputs laid end to end: one
        # flatten launch instead of one copy per input (flatten moves elements of up to
        # 8 bytes; complex128 takes the copies below). A lazily conjugated or negated
        # out (its bits are not its values; flatten refuses one) takes the copies too,
        # which write such a view as torch's do; so does a quantized out (flatten
        # refuses one), which copy_ writes with out's own quantizer.
        # 0-dim inputs as given (numel 1 each, laid end to end as their view(1)s): the
        # views, new every call, made a new plan every call (4 scalars: 104 us a call
        # against 44 us for 4 rows).
        flatten_plain(given, out=out.view(-1))
        return out
    off = 0
    for t in ts:
        if t.dtype != out.dtype and (t.is_neg() or out.is_neg()):
            # torch 2.13's copy_ from a lazily negated float16 tensor into float32 (and
            # back) drops the negation, and so does its copy_ into a negated out; the
            # source resolved and converted first, the copy is of one dtype and right.
            t = t.resolve_neg().to(out.dtype)
        # As torch's gather: asynchronous only into device memory (a pinned host ``out``
        # would be returned while the copies still write it).
        out.narrow(dim, off, t.size(dim)).copy_(t, non_blocking=out.is_cuda)
        off += t.size(dim)
    return out


def _sequence(obj):
    """``obj`` as a tuple if it is an iterable other than a list, tuple, tensor, string or
    mapping (a generator, say: torch's ``gather`` and ``reduce_add_coalesced`` iterate
    what they are given), else as it is (for the checks to name)."""
    if isinstance(obj, (list, tuple, torch.Tensor, str, bytes, Mapping)) or not hasattr(obj, "__iter__"):
        return obj
    return tuple(obj)


def _checked_any_device(tensors, name: str):
    """A non-empty list of dense tensors, on any devices."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{name} must contain at least one tensor, got an empty {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        _check_tensor(t, f"{name}[{i}]")
    return tensors


# What the ops above run when called while dynamo traces (see _dispatch.eager_entry).
_broadcast_eagerly = _dispatch.eager_entry(broadcast)
_broadcast_coalesced_eagerly = _dispatch.eager_entry(broadcast_coalesced)
_reduce_add_eagerly = _dispatch.eager_entry(reduce_add)
_reduce_add_coalesced_eagerly = _dispatch.eager_entry(reduce_add_coalesced)
_scatter_eagerly = _dispatch.eager_entry(scatter)
_gather_eagerly = _dispatch.eager_entry(gather)
