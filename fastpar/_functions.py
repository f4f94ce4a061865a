"""Autograd functions of the data-parallel path, each with the opposite op as backward
(as in ``torch.nn.parallel._functions``): Broadcast (and BroadcastCoalesced) <->
ReduceAddCoalesced, Scatter <-> Gather."""
from __future__ import annotations

import torch
from torch.autograd import Function

from . import comm
from ._plan import transient_tensors


def _sparse_aliased(outputs, inputs) -> list:
    """``outputs`` with each sparse COO tensor that is one of ``inputs`` replaced by an
    alias (the same indices and values): autograd makes an input returned as an output
    into a view of it, and sparse tensors have no views (torch's own Broadcast fails
    there)."""
    sparse = {id(t) for t in inputs if t is not None and t.layout == torch.sparse_coo}
    if not sparse:
        return list(outputs)
    return [comm.sparse_copy(t, None) if id(t) in sparse else t for t in outputs]


def _marked(ctx, outputs) -> tuple:
    """The per-device copies ``outputs`` as one tuple, the copies of inputs that need no
    gradient marked non-differentiable (as torch's ``Broadcast`` marks them)."""
    non_differentiables = []
    for idx, needs in enumerate(ctx.needs_input_grad[1:]):
        if not needs:
            non_differentiables.extend(output[idx] for output in outputs)
    ctx.mark_non_differentiable(*non_differentiables)
    return tuple(t for tensors in outputs for t in tensors)


def _reduced(ctx, grad_outputs) -> tuple:
    """The backward of a broadcast: the sums of the copies' gradients, one per input,
    None for the inputs that need no gradient. Their copies are non-differentiable, and
    autograd hands zeros for them; summing those (a frozen backbone's parameters, every
    step) would be work thrown away, so only the inputs that need a gradient are
    reduced."""
    needed = [i for i, needs in enumerate(ctx.needs_input_grad[1:]) if needs]
    n = ctx.num_inputs
    if len(needed) == n:
        return ReduceAddCoalesced.apply(ctx.input_device, n, ctx.devices, *grad_outputs)
    sums = [None] * n
    if needed:
        grads = [grad_outputs[j + i] for j in range(0, len(grad_outputs), n) for i in needed]
        for i, s in zip(needed, ReduceAddCoalesced.apply(ctx.input_device, len(needed), ctx.devices, *grads)):
            sums[i] = s
    return tuple(sums)


class Broadcast(Function):
    """Copies of ``inputs`` on every device of ``placement`` (a
    :class:`fastpar.replicate._Placement`), which lays each device's copies out in its
    persistent buffers. Backward: the fused :class:`ReduceAddCoalesced` of the copies'
    gradients onto the inputs' device."""

    @staticmethod
    def forward(ctx, placement, *inputs):
        ctx.devices = placement.devices
        ctx.num_inputs = len(inputs)
        ctx.input_device = inputs[0].device if inputs else None
        if not inputs:
            return ()
        outputs = placement.place(inputs)
        outputs[0] = _sparse_aliased(outputs[0], inputs)
        return _marked(ctx, outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None,) + _reduced(ctx, grad_outputs)


class BroadcastCoalesced(Function):
    """Copies of ``inputs`` on every device of ``devices`` (``comm.broadcast_coalesced``:
    the first device's are ``inputs`` themselves). Backward: :class:`ReduceAddCoalesced`.
    The backward of :class:`ReduceAddCoalesced`, so that it too is differentiable (higher
    order gradients through ``replicate``), as torch's ``Broadcast`` is there."""

    @staticmethod
    def forward(ctx, devices, *inputs):
        ctx.devices = devices
        ctx.num_inputs = len(inputs)
        ctx.input_device = inputs[0].device if inputs else None
        if not inputs:
            return ()
        with transient_tensors():  # a step's gradients: don't keep their plans
            copies = comm.broadcast_coalesced(list(inputs), devices)
        copies[0] = _sparse_aliased(copies[0], inputs)
        return _marked(ctx, copies)

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None,) + _reduced(ctx, grad_outputs)


class ReduceAddCoalesced(Function):
    """Position-wise sum of per-device gradient lists onto ``destination``, one kernel
    launch per dtype. Backward: :class:`BroadcastCoalesced` of the summed gradients."""

    @staticmethod
    def forward(ctx, destination, num_inputs, devices, *grads):
        ctx.devices = devices
        per_device = [list(grads[i : i + num_inputs]) for i in range(0, len(grads), num_inputs)]
        with transient_tensors():  # a step's gradients: don't keep their plans
            # (One device: the sums are the gradients themselves.)
            return tuple(_sparse_aliased(comm.reduce_add_coalesced(per_device, destination), grads))

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None, None, None) + BroadcastCoalesced.apply(ctx.devices, *grad_outputs)


class Scatter(Function):
    """Chunks of ``input`` along ``dim``, one per device. CPU inputs bound for GPUs are
    copied from pinned memory on a per-device background stream the compute stream then
    waits on. Backward: :class:`Gather`."""

    @staticmethod
    def forward(ctx, target_devices, chunk_sizes, dim, input):
        ctx.dim = dim
        ctx.input_device = input.device
        streams = None
        if input.device.type == "cpu" and any(d.type == "cuda" for d in target_devices):
            if torch._debug_has_internal_overlap(input) == 1 and not input.is_pinned():
                # pin_memory() gives the copy the input's own strides and copy_ refuses a
                # destination whose elements share memory: an expanded input (the
                # gradient of out.sum() reaching Gather's backward from a CPU output,
                # a mask made with expand()) raised there. Pinned as a dense copy.
                input = input.contiguous()
            input = input.pin_memory()
            streams = [_background_stream(d) for d in target_devices]
        outputs = comm.scatter(input, target_devices, chunk_sizes, dim, streams)
        if input.device.type == "cpu" and input.numel():
            outputs = _one_view(outputs, input)
        if streams is not None:
            for d, out, s in zip(target_devices, outputs, streams):
                with torch.cuda.device(d):
                    main = torch.cuda.current_stream()
                    main.wait_stream(s)
                    out.record_stream(main)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        return (None, None, None, Gather.apply(ctx.input_device, ctx.dim, *grad_outputs))


class Gather(Function):
    """Concatenation of per-device ``inputs`` along ``dim`` on ``target_device`` (0-dim
    inputs become a vector, with torch's warning). Backward: :class:`Scatter`."""

    @staticmethod
    def forward(ctx, target_device, dim, *inputs):
        ctx.dim = dim
        ctx.target_device = target_device
        ctx.input_devices = [t.device for t in inputs]
        ctx.unsqueezed_scalar = dim == 0 and all(t.dim() == 0 for t in inputs)
        if ctx.unsqueezed_scalar:
            import warnings

            warnings.warn(
                "Was asked to gather along dimension 0, but all input tensors were scalars; "
                "will instead unsqueeze and return a vector.",
                stacklevel=2,
            )
            inputs = tuple(t.view(1) for t in inputs)
        with transient_tensors():  # a step's outputs: don't keep their plans
            out = comm.gather(list(inputs), dim, target_device)
        # (After comm.gather, whose checks name what mismatches: a 0-dim input among
        # others has no size along dim.)
        ctx.input_sizes = [t.size(dim) for t in inputs]
        return out

    @staticmethod
    def backward(ctx, grad_output):
        grads = Scatter.apply(ctx.input_devices, ctx.input_sizes, ctx.dim, grad_output)
        if ctx.unsqueezed_scalar:
            grads = tuple(g[0] for g in grads)
        return (None, None) + tuple(grads)


def _one_view(chunks, input):
    """``chunks`` with every view of ``input`` but the first replaced by a copy.

    ``comm.scatter`` leaves a chunk already on its device a view of ``input``, as torch's
    does. torch's device ids are distinct, so at most one chunk is a view; host replicas
    (``"cpu"`` repeated) would all get views, sharing ``input``'s version counter, and an
    in-place op in one replica (``ReLU(inplace=True)``, ``x += pos``) would invalidate
    what the others saved for backward."""
    base = input.untyped_storage().data_ptr()
    out, seen = list(chunks), False
    for i, c in enumerate(out):
        if c.numel() and c.device == input.device and c.untyped_storage().data_ptr() == base:
            if seen:
                out[i] = c.clone()
            seen = True
    return tuple(out)


_streams: dict = {}


def _background_stream(device: torch.device):
    """One background copy stream per CUDA device (created once, like torch's)."""
    if device.type != "cuda":
        return None
    s = _streams.get(device.index)
    if s is None:
        s = _streams[device.index] = torch.cuda.Stream(device)
    return s
