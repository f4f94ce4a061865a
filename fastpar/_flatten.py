"""Multi-tensor flatten / unflatten: many tensors <-> one contiguous buffer, one kernel
launch per call and device (one per dtype group when the tensors mix dtypes)."""
from __future__ import annotations

import itertools
import math

import torch
from torch.autograd.graph import increment_version
from torch.overrides import handle_torch_function, has_torch_function

from . import _alloc, _dispatch, _tuning
from ._fastcheck import increment_versions, same_one, snapshot_one
from ._plan import plan_for
from ._validate import (
    check_conversion,
    check_dtype,
    check_flat,
    check_no_overlap,
    check_not_inference,
    check_not_recorded,
    check_scale,
    check_writable,
)

__all__ = ["flatten", "unflatten", "unflatten_into"]


def _staged_groups(plan, *, fill: bool):
    """The plan's groups, with contiguous temporaries standing in for non-contiguous
    tensors (filled with their values when ``fill``). Returns (groups, [(dst, tmp)])."""
    if len(plan.noncontig) == 0:
        return plan.groups, []
    pending = []
    groups = []
    nc = set(plan.noncontig.tolist())
    for g in plan.groups:
        if not nc.intersection(g.index.tolist()):
            groups.append(g)
            continue
        tensors = list(g.tensors)
        for j, i in enumerate(g.index.tolist()):
            if i in nc:
                t = tensors[j]
                tmp = (t.resolve_conj().resolve_neg().contiguous() if fill
                       else torch.empty_like(t, memory_format=torch.contiguous_format))
                pending.append((t, tmp))
                tensors[j] = tmp
        groups.append(g.with_tensors(tuple(tensors)))
    return groups, pending


def _empty_list(tensors) -> bool:
    """``tensors`` is an empty list or tuple: nothing to unflatten (``flatten`` still
    refuses one, as torch does, having no dtype or device to give its result)."""
    return isinstance(tensors, (list, tuple)) and not tensors


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_mode_enabled = torch._C._is_torch_function_mode_enabled


def _overriding(plan, *others) -> tuple:
    """The arguments (of ``plan.tensors`` and ``others``) whose class overrides
    ``__torch_function__``, where torch would hand them the call; else ``()``.

    torch's ``_flatten_dense_tensors`` / ``_unflatten_dense_tensors`` are overridable,
    so a subclass gets its results as its own class (or does what its override says):
    without this, the kernels read its data and returned plain tensors. The subclassed
    members are found once per plan (a cached plan holds the same objects), so plain
    lists pay nothing per call. Their positions are kept, not the tensors: a second
    reference to each, which ``plan.internal_refs`` does not count, made the plan cache
    take a dropped subclassed tensor for a live one and keep its plan (and the tensor)."""
    subs = plan.__dict__.get("_subclassed")
    if subs is None:
        subs = plan.__dict__["_subclassed"] = tuple(
            i for i, t in enumerate(plan.tensors) if type(t) not in _PLAIN)
    args = tuple(plan.tensors[i] for i in subs) if subs else ()
    args += tuple(o for o in others if isinstance(o, torch.Tensor) and type(o) not in _PLAIN)
    # (False inside an override's own call, where torch functions are disabled.)
    return args if args and has_torch_function(args) else ()


def _relevant(tensors, *others) -> tuple:
    """The arguments torch would look at for an override: the list's items and others."""
    items = tuple(tensors) if isinstance(tensors, (list, tuple)) else (tensors,)
    return items + others


def flatten(tensors, *, dtype=None, scale=None, out=None):
    r"""Pack ``tensors`` end to end into one 1-D buffer, in one kernel launch.

    Returns the same values as ``torch._utils._flatten_dense_tensors(tensors)``, cast to
    ``dtype`` and multiplied by ``scale`` in the same pass when those are given.

    Args:
        tensors (list or tuple of Tensor): dense tensors on one device, of any shapes
            (non-contiguous and 0-dim included). They must share one dtype unless
            ``dtype`` is given.
        dtype (torch.dtype, optional): dtype of the result. Default: the tensors' dtype.
        scale (float or 0-dim Tensor, optional): multiply every element by ``scale``
            (computed in float32, or float64 when either side is float64).
            Floating-point dtypes only. A tensor is read with ``.item()`` (for a CUDA
            tensor, that waits for it).
        out (Tensor, optional): a contiguous 1-D tensor of the total numel, ``dtype`` and
            device to write into; reusing one across calls avoids the allocation (on this
            CPU a fresh 100+ MB buffer costs more in page faults than the copy itself).
            It must not overlap any input.

    Returns:
        Tensor: ``out`` if given, else a new tensor. On the CPU a result of 1 MiB or
        more may be placed in the buffer of an earlier result that nothing refers to
        any more (no tensor, view, storage or numpy array over it), which saves the
        page faults of a new one; ``FASTPAR_RESULT_CACHE_MB`` bounds the memory kept.

    Raises:
        TypeError: ``tensors`` is not a list or tuple of dense tensors, they mix dtypes
            without ``dtype``, ``dtype``/``scale``/``out`` has the wrong type or dtype,
            ``out`` is not a dense (strided) tensor, or the kernels do not convert or
            scale these dtypes (elements of 1, 2, 4 or 8 bytes are copied as they are,
            so complex128 is refused, and so are quantized tensors, whose scale a copy
            would lose; casts and ``scale`` take the float and integer dtypes, not bool
            or complex).
        ValueError: ``tensors`` is empty, the tensors are on several devices, ``scale`` is
            beyond float64's range, or ``out`` has the wrong size or device, is not
            contiguous and 1-D, is a lazily conjugated or negated view, or overlaps an
            input.
        RuntimeError: ``out`` cannot be written here (an inference tensor outside
            inference mode, or a tensor requiring grad with grad mode on).

    Nothing is written when a call is refused.

    Example::

        >>> params = [p.detach() for p in model.parameters()]
        >>> flat = fastpar.flatten(params)  # one launch
        >>> buf = torch.empty(flat.numel(), dtype=torch.bfloat16)
        >>> fastpar.flatten(params, dtype=torch.bfloat16, scale=0.5, out=buf)  # cast and scale, same pass

    One launch per call on the ``triton`` and ``numba`` backends, whatever the number of
    tensors; when ``dtype`` is given and the inputs mix dtypes, one launch per input
    dtype (a Triton pointer type is fixed at compile time). Non-contiguous inputs are
    first made contiguous (one extra copy each). Like ``torch.nn.parallel.comm``, the
    result does not record autograd history.

    A tensor subclass that overrides ``__torch_function__`` (among ``tensors``, or as
    ``out`` or ``scale``) gets the call as ``fastpar.flatten``, as torch's
    ``_flatten_dense_tensors`` hands it over: with the default override the result is
    of its class, as torch's is. So does an active ``TorchFunctionMode``.
    """
    if torch.compiler.is_dynamo_compiling():
        # Traced, dynamo went on into the plan building, the compiled check and the
        # first use's calibration (dozens of graph breaks and graphs, and warnings) with
        # no graph to build from them: the whole call runs eagerly, one graph break.
        return _flatten_eagerly(tensors, dtype=dtype, scale=scale, out=out)
    if _mode_enabled():
        # An active TorchFunctionMode gets the call first, for plain tensors too, as from
        # torch's: without this it saw fastpar's internal tensor reads instead of one call.
        return handle_torch_function(flatten, _relevant(tensors, out, scale), tensors, dtype=dtype, scale=scale, out=out)
    plan = plan_for(tensors, "tensors")
    overriding = _overriding(plan, out, scale)
    if overriding:
        return handle_torch_function(flatten, overriding, tensors, dtype=dtype, scale=scale, out=out)
    return _flatten_planned(plan, dtype, scale, out)


def flatten_plain(tensors, *, dtype=None, scale=None, out=None):
    """:func:`flatten` without the ``__torch_function__`` hand-over, for fastpar's own
    callers (``comm.gather``, the DDP hooks): a subclass gets the call of the public
    function it made, as from torch's, not this step of it."""
    return _flatten_planned(plan_for(tensors, "tensors"), dtype, scale, out)


def _flatten_planned(plan, dtype, scale, out):
    if dtype is None:
        if len(plan.groups) > 1:
            d0 = plan.dtypes[0]
            i = next(i for i, d in enumerate(plan.dtypes) if d != d0)
            raise TypeError(
                f"tensors must share one dtype unless dtype= is given: tensors[0] is {d0} "
                f"but tensors[{i}] is {plan.dtypes[i]}"
            )
        dtype = plan.dtypes[0]
    dtype = check_dtype(dtype, "dtype")
    scale = check_scale(scale)
    key = _key("flatten", dtype, scale)
    if out is not None:
        bound = _bound_for(plan, key, out)
        if bound is not None:  # out and the plan as the last call saw them: checked then
            return bound.write(out)
    for g in plan.groups:
        check_conversion(g.dtype, dtype, scale, "flatten")
    given = out is not None
    if out is None:
        out, _ = _alloc.RESULTS.empty(plan.numel, dtype, plan.device)  # a dead result's buffer, else new
    else:
        check_flat(out, "out", numel=plan.numel, dtype=dtype, device=plan.device, written=True)
        check_no_overlap(plan, out, "out", "tensors")
    _launch(plan, key, out, given)
    increment_version(out)
    return out


def _launch(plan, key, flat, given: bool) -> list:
    """Run ``key``'s op (``flatten`` or ``unflatten_into``, with ``key``'s scale) between a
    checked ``plan`` and a checked ``flat``: the bound launches where calls are bound
    (see :func:`_bind`), else each group through the backend's launcher. Returns the
    ``(tensor, temporary)`` pairs of the staged non-contiguous tensors (for
    ``unflatten_into`` to copy back)."""
    op, scale = key[0], key[2]
    backend, launch = _dispatch.kernel(op, plan.device)
    bound = _bind(plan, key, flat, given, backend)
    if bound is not None:
        bound.run()
        return []
    to_flat = op == "flatten"
    groups, pending = _staged_groups(plan, fill=to_flat)
    for g in groups:
        launch(g, flat, scale, **_group_params(op, backend, g, flat, plan.numel))
    return pending


def _group_params(op: str, backend: str, g, flat, numel: int) -> dict:
    """The tuned launch parameters of ``op`` for group ``g`` and ``flat``."""
    src, dst = (g.dtype, flat.dtype) if op == "flatten" else (flat.dtype, g.dtype)
    return _tuning.params(op, backend, src, dst, numel, flat.device)


# ---------------------------------------------------------------------------
# Bound calls. In a training loop the same tensors go to the same buffer call after
# call; a cached plan then keeps the call's Numba launches with every argument resolved
# (_Bound), and the next call with the same buffer object, unchanged, skips what cannot
# have changed: the buffer's checks (one compiled metadata comparison instead), the
# backend and tuning look-ups and the launch set-up. That Python cost 40-60 us a call
# right after a kernel had streamed its data through the caches (5-15 us in a quiet
# loop), as much as the copy of a 2.6 MB parameter list.

#: Bound calls a plan keeps. A caller passing a new scale every call would add one a
#: call; past this many the plan forgets them and starts again.
_MAX_BOUND = 4


def _key(op: str, dtype, scale) -> tuple:
    """The key of a bound call: ``op``, the flat buffer's dtype and the scale, whose sign
    is kept apart for a zero: -0.0 == 0.0 and both hash alike, yet they scale to zeros
    of opposite signs, so a call bound for one must not answer the other."""
    return (op, dtype, scale) if scale != 0.0 else (op, dtype, scale, math.copysign(1.0, scale))


class _Bound:
    """One resolved call of a plan: its launches, and what they were resolved for (the
    op whose Numba launcher they stand for, that launcher, the tuning state, the flat
    buffer), and ``keep``: what the launches address besides the plan's tensors and the
    buffer (``rnn.pack``'s packing group and layout), held as long as they are."""

    __slots__ = ("state", "op", "launcher", "flat_ptr", "flat_snap", "launches", "keep")

    def run(self) -> None:
        for launch in self.launches:
            launch()

    def write(self, out: torch.Tensor) -> torch.Tensor:
        """A bound call into the caller's ``out``, found unchanged: check again what no
        comparison of ``out`` covers (inference mode, and grad mode for an ``out``
        requiring grad), run, bump ``out``'s version. Returns ``out``."""
        check_not_inference(out, "out")
        check_not_recorded(out, "out")
        self.run()
        increment_version(out)
        return out


def _current(plan, key):
    """The plan's bound call for ``key`` if nothing it was resolved with changed since:
    the backend request, the tuning tables, torch's thread count (together
    :func:`fastpar._tuning.resolution_state`), and the Numba launcher (tests replace it)."""
    memo = plan.__dict__.get("_bound")
    bound = None if memo is None else memo.get(key)
    if (bound is None or bound.state != _tuning.resolution_state()
            or _dispatch._kernel("numba", bound.op) is not bound.launcher):
        return None
    return bound


def _bound_for(plan, key, flat):
    """The plan's bound call for ``key`` if ``flat`` (a caller's buffer) is the tensor
    object it was bound for, with the same data pointer, dtype, sizes, strides and
    storage (so every check made on it then still holds); else None.

    No reference to the buffer is kept, not even a weak one: ``torch.utils.swap_tensors``
    refuses a tensor that has one (as ``nn.Module`` conversions swap parameters). The
    comparison needs none: it reads only through ``flat`` (its id, then the TensorImpl
    it holds, so only a tensor is handed to it: another object could hold anything
    there), and a tensor that took a dead buffer's id, TensorImpl, storage, DataPtr and
    sizes is a buffer every check made then passes again."""
    bound = _current(plan, key)
    if (bound is None or bound.flat_snap is None or not isinstance(flat, torch.Tensor)
            or not same_one(flat, bound.flat_snap)):
        return None
    return bound


def own_launcher(op: str):
    """The Numba launcher of ``op`` if it is the module's own, which ``bind_copy`` and
    ``bind_broadcast`` stand for; else None. Tests (and the autotuner's checks) replace
    or wrap it, in the module or in _dispatch, and a replacement must run as given."""
    from .kernels.ops_numba import flatten as numba_flatten

    launcher = _dispatch._kernel("numba", op)
    if (launcher is not getattr(numba_flatten, op) or getattr(launcher, "__module__", None) != numba_flatten.__name__
            or getattr(launcher, "__qualname__", None) != op):
        return None
    return launcher


def resolved(bind) -> tuple:
    """``(state, launches)``: ``bind()`` (which returns the launches, each bound with the
    tuned parameters it looks up) and the :func:`fastpar._tuning.resolution_state` they
    were bound under; bound again if that moved meanwhile (a first read of the tuning
    tables, typically this very call's, bumps their generation)."""
    state = None
    while state != _tuning.resolution_state():
        state = _tuning.resolution_state()
        launches = bind()
    return state, launches


def remember(plan, key, bound) -> None:
    """Keep ``bound`` as the plan's bound call for ``key`` (at most ``_MAX_BOUND``)."""
    memo = plan.__dict__.setdefault("_bound", {})
    if key not in memo and len(memo) >= _MAX_BOUND:
        memo.clear()
    memo[key] = bound


def _bind(plan, key, flat, given: bool, backend: str):
    """The bound call of ``key`` (an op, the flat buffer's dtype, the scale) between a
    checked ``plan`` and a checked ``flat``, made or reused; None where calls are not
    bound: another backend, non-contiguous tensors (staged through new temporaries every
    call), a plan that is not cached."""
    if backend != "numba" or len(plan.noncontig) or not plan.reusable:
        return None
    from .kernels.ops_numba import flatten as numba_flatten

    op = key[0]
    launcher = own_launcher(op)
    if launcher is None:
        return None
    ptr = flat.data_ptr()
    if not given:
        # An allocating call's result buffer: a loop that keeps its last result while
        # making the next (``flat = fastpar.flatten(ts)``) gets two buffers in turn from
        # the result cache, so each keeps its own binding. Under the op's key alone, each
        # call bound again for the other buffer: 0.2 ms of a 1.0 ms flatten of 10,000
        # tensors.
        key = (*key, "result", ptr)
    bound = _current(plan, key)
    if bound is None or bound.flat_ptr != ptr:
        bound = _Bound()
        bound.op, bound.launcher, bound.flat_ptr, bound.keep = op, launcher, ptr, None
        to_flat = op == "flatten"

        def bind():
            launches = []
            for g in plan.groups:
                launch = numba_flatten.bind_copy(g, flat, key[2], to_flat,
                                                 **_group_params(op, backend, g, flat, plan.numel))
                if launch is not None:
                    launches.append(launch)
            return tuple(launches)

        bound.state, bound.launches = resolved(bind)
    elif not given or (bound.flat_snap is not None and same_one(flat, bound.flat_snap)):
        return bound
    else:  # the same memory through another tensor object, or changed: bind this one
        old, bound = bound, _Bound()
        bound.state, bound.op, bound.launcher, bound.flat_ptr, bound.launches, bound.keep = (
            old.state, old.op, old.launcher, ptr, old.launches, old.keep)
    bound.flat_snap = snapshot_one(flat) if given else None
    remember(plan, key, bound)
    return bound


def unflatten(flat, tensors):
    r"""Views of ``flat`` shaped like ``tensors`` (no copy), as
    ``torch._utils._unflatten_dense_tensors`` returns.

    Args:
        flat (Tensor): a contiguous 1-D tensor holding exactly the tensors' total numel.
        tensors (list or tuple of Tensor): tensors whose shapes the views take.

    Returns:
        tuple of Tensor: views into ``flat`` (with ``flat``'s dtype and device).

    Raises:
        TypeError: ``tensors`` is not a list or tuple of dense tensors, or ``flat`` not a
            dense tensor.
        ValueError: ``flat`` is not 1-D and contiguous, holds another numel, or is a
            lazily conjugated or negated view.

    Example::

        >>> flat = fastpar.flatten(grads)
        >>> views = fastpar.unflatten(flat, grads)  # views[i] has grads[i]'s shape

    An empty ``tensors`` gives ``()``, as in torch (``flat`` must then be empty). A
    tensor subclass that overrides ``__torch_function__`` (``flat`` or among
    ``tensors``) gets the call as ``fastpar.unflatten``, as torch's
    ``_unflatten_dense_tensors`` hands it over (the default override returns views of
    its class); so does an active ``TorchFunctionMode``.
    """
    if torch.compiler.is_dynamo_compiling():  # (as in flatten)
        return _unflatten_eagerly(flat, tensors)
    if _mode_enabled():  # (as in flatten)
        return handle_torch_function(unflatten, _relevant(tensors, flat), flat, tensors)
    if _empty_list(tensors):
        check_flat(flat, "flat", numel=0, dtype=None, device=None)
        return ()
    plan = plan_for(tensors, "tensors")
    overriding = _overriding(plan, flat)
    if overriding:
        return handle_torch_function(unflatten, overriding, flat, tensors)
    check_flat(flat, "flat", numel=plan.numel, dtype=None, device=None)
    if torch.is_grad_enabled():
        # torch's own views (narrow, then view), one autograd view of flat each: the
        # outputs of split_with_sizes are views of a multi-output node, which autograd
        # forbids writing in place with grad mode on (views[0].copy_(w * 2), or
        # views[0].mul_(3) where flat requires grad raised), where torch's are written
        # and backpropagated through. With grad mode off both are no-grad views alike.
        with _alloc.gc_paused():  # (10,000 new tensors: see gc_paused)
            views = torch._C._nn.unflatten_dense_tensors(flat, plan.tensors)
        empty = plan.__dict__.get("_empty")
        if empty is None:  # (position, offset, shape) of the empty tensors, once per plan
            numels = plan.numels.tolist()
            starts = [0, *itertools.accumulate(numels)]
            empty = plan.__dict__["_empty"] = [(i, starts[i], s) for i, (n, s) in enumerate(zip(numels, plan.shapes))
                                               if n == 0]
        if empty:  # torch gives these new tensors; fastpar's are views of flat, as the others
            views = list(views)
            for i, start, shape in empty:
                views[i] = flat.narrow(0, start, 0).view(shape)
            views = tuple(views)
        return views
    memo = plan.__dict__.get("_split")
    if memo is None:  # sizes and the non-1-D positions, made once per plan
        memo = plan.__dict__["_split"] = (
            plan.numels.tolist(), [(i, s) for i, s in enumerate(plan.shapes) if len(s) != 1])
    return tuple(split_views(flat, *memo))


def unflatten_into(flat, tensors, *, scale=None) -> None:
    r"""Copy the slices of ``flat`` back into ``tensors``, in one kernel launch.

    The inverse of :func:`flatten`: ``tensors[i]`` receives
    ``flat[offset_i : offset_i + tensors[i].numel()]``, cast to ``tensors[i].dtype`` and
    multiplied by ``scale`` when given.

    Args:
        flat (Tensor): a contiguous 1-D tensor on the tensors' device holding exactly
            their total numel; it must not overlap them.
        tensors (list or tuple of Tensor): destinations; they may mix dtypes (one launch per
            dtype) and be non-contiguous (written through a contiguous temporary).
        scale (float or 0-dim Tensor, optional): multiply on the way (floating-point
            dtypes only), as in :func:`flatten`.

    Raises:
        TypeError: as :func:`flatten`, for ``tensors``, ``flat`` and ``scale``.
        ValueError: ``flat`` has the wrong size or device, is not contiguous and 1-D, is
            a lazily conjugated or negated view, or overlaps a destination; two
            destinations share memory; a destination overlaps itself.
        RuntimeError: a destination is an inference tensor outside inference mode.

    Nothing is written when a call is refused.

    Example::

        >>> flat = fastpar.flatten(grads, dtype=torch.bfloat16)
        >>> # ... all-reduce flat ...
        >>> fastpar.unflatten_into(flat, grads, scale=1 / world_size)  # cast back, one launch

    Writes bypass autograd, as under ``torch.no_grad()``, but bump the tensors' version
    counters so autograd still detects the modification of a saved tensor. An empty
    ``tensors`` writes nothing (``flat`` must then be empty). A tensor subclass that
    overrides ``__torch_function__`` (``flat``, ``scale`` or among ``tensors``) gets the
    call as ``fastpar.unflatten_into``, as :func:`flatten` and :func:`unflatten` hand
    theirs over (the default override runs it on the tensors as they are); so does an
    active ``TorchFunctionMode``.
    """
    if torch.compiler.is_dynamo_compiling():  # (as in flatten)
        return _unflatten_into_eagerly(flat, tensors, scale=scale)
    if _mode_enabled():  # (as in flatten)
        return handle_torch_function(unflatten_into, _relevant(tensors, flat, scale), flat, tensors, scale=scale)
    if _empty_list(tensors):
        return _unflatten_into_nothing(flat, scale)
    plan = plan_for(tensors, "tensors")
    overriding = _overriding(plan, flat, scale)
    if overriding:
        return handle_torch_function(unflatten_into, overriding, flat, tensors, scale=scale)
    return _unflatten_into_planned(plan, flat, scale)


def unflatten_into_plain(flat, tensors, *, scale=None) -> None:
    """:func:`unflatten_into` without the ``__torch_function__`` hand-over, for fastpar's
    own callers (``ddp.sync_params``), as :func:`flatten_plain` is for :func:`flatten`."""
    if _empty_list(tensors):
        return _unflatten_into_nothing(flat, scale)
    return _unflatten_into_planned(plan_for(tensors, "tensors"), flat, scale)


def _unflatten_into_nothing(flat, scale) -> None:
    check_flat(flat, "flat", numel=0, dtype=None, device=None)
    check_scale(scale)


def _unflatten_into_planned(plan, flat, scale) -> None:
    if scale is None or type(scale) is float:  # (else checked and read first, below)
        bound = _bound_for(plan, _key("unflatten_into", getattr(flat, "dtype", None), scale), flat)
        if bound is not None:  # flat and the plan as the last call saw them: checked then
            check_writable(plan, "tensors")
            bound.run()
            increment_versions(plan.tensors, plan.impls)
            return
    check_flat(flat, "flat", numel=plan.numel, dtype=None, device=plan.device)
    scale = check_scale(scale)
    key = _key("unflatten_into", flat.dtype, scale)
    for g in plan.groups:
        check_conversion(flat.dtype, g.dtype, scale, "unflatten_into")
    check_no_overlap(plan, flat, "flat", "tensors")
    check_writable(plan, "tensors")
    hit = plan.self_overlap()
    if hit is not None:
        i, j = hit
        raise ValueError(
            f"tensors[{i}] and tensors[{j}] share memory (or, for a non-contiguous one, its storage); "
            "unflatten_into writes every tensor at once, so which slice of flat lands there would "
            "be undefined: pass separate tensors"
        )
    for i in plan.noncontig.tolist():
        if torch._debug_has_internal_overlap(plan.tensors[i]) == 1:
            raise ValueError(
                f"tensors[{i}] has internally overlapping memory (e.g. from expand(), strides "
                f"{plan.tensors[i].stride()}): writing into it is ambiguous"
            )
    pending = _launch(plan, key, flat, True)
    if pending:
        with torch.no_grad():  # writes bypass autograd, as for the contiguous tensors
            for dst, tmp in pending:
                # Through .data (an alias with a version counter of its own): the line
                # below bumps dst's version, once, as for every other tensor (dst.copy_
                # bumped it too).
                dst.data.copy_(tmp)
    increment_versions(plan.tensors, plan.impls)


# What the ops above run when called while dynamo traces (see _dispatch.eager_entry).
_flatten_eagerly = _dispatch.eager_entry(flatten)
_unflatten_eagerly = _dispatch.eager_entry(unflatten)
_unflatten_into_eagerly = _dispatch.eager_entry(unflatten_into)


# ---------------------------------------------------------------------------
# One byte buffer for a whole (possibly mixed-dtype) tensor list: each dtype group gets
# a 64-byte-aligned region, so every output of one device shares one storage. Used by
# comm.broadcast_coalesced, comm.reduce_add_coalesced and replicate.

_REGION_ALIGN = 64


def byte_layout(plan) -> tuple[list[int], int]:
    """Byte offset of each dtype group's region, and the buffer's total bytes."""
    offsets, total = [], 0
    for g in plan.groups:
        total = -(-total // _REGION_ALIGN) * _REGION_ALIGN
        offsets.append(total)
        total += g.numel * g.dtype.itemsize
    return offsets, total


def region(buf: torch.Tensor, group, byte_offset: int) -> torch.Tensor:
    """The 1-D ``group.dtype`` view of ``group``'s region of ``buf`` (a uint8 buffer)."""
    return buf[byte_offset : byte_offset + group.numel * group.dtype.itemsize].view(group.dtype)


def pack_bytes(plan, bufs, layout) -> None:
    """Flatten every group of ``plan`` into its region of each buffer in ``bufs`` (uint8
    buffers on the tensors' device, or one such buffer) with the ``broadcast`` op: one
    launch per group, each source read once, large copies streamed past the cache."""
    bufs = [bufs] if isinstance(bufs, torch.Tensor) else list(bufs)
    for buf in bufs:
        if buf.device != plan.device:
            raise ValueError(f"the byte buffer must be on the tensors' device {plan.device}, got {buf.device}")
    backend, launch = _dispatch.kernel("broadcast", plan.device)
    groups, _ = _staged_groups(plan, fill=True)
    for g, off in zip(groups, layout):
        if g.dtype.itemsize > 8:  # complex128: the same bytes, as pairs of 8-byte words
            g = g.as_words()
        # Same chunking knobs as flatten (the same kernel shape).
        kwargs = _tuning.params("flatten", backend, g.dtype, g.dtype, g.numel * len(bufs), plan.device)
        launch(g.local(), [region(b, g, off) for b in bufs], **kwargs)
    increment_version(bufs)


def split_views(flat: torch.Tensor, sizes: list, not_1d, *, autograd_views: bool = True) -> list:
    """Views of the 1-D ``flat`` with the given ``sizes``, laid end to end; ``not_1d``
    lists ``(position, shape)`` for the views that are not 1-D.

    ``split_with_sizes`` makes all the views in one call (2-3x faster than
    ``_unflatten_dense_tensors``); only the listed positions get a ``view``. Without
    ``autograd_views``, ``unsafe_split_with_sizes`` makes them (another 1.4-1.6x faster
    for 10,000 pieces): the pieces share ``flat``'s storage but autograd does not record
    them as views of it (a 1-D piece has no ``_base``; a piece given a shape in
    ``not_1d`` is a view of its own 1-D piece only; a version counter each). For results whose buffer
    never leaves fastpar, nothing can tell the difference, and in-place writes to one
    result then leave the others' versions alone, as for separately allocated tensors.
    """
    with _alloc.gc_paused():
        pieces = list(flat.split_with_sizes(sizes) if autograd_views else flat.unsafe_split_with_sizes(sizes))
        for j, shape in not_1d:
            pieces[j] = pieces[j].view(shape)
    return pieces


def byte_views(buf: torch.Tensor, plan, layout) -> list:
    """Tensors over ``buf`` shaped like ``plan``'s tensors, in the plan's order.

    Each has its own version counter, as each copy of torch's ``broadcast_coalesced``
    does (its NOTE "Version Counter in comm.*_coalesced"): they are made by
    ``unsafe_split_with_sizes``, not as autograd views of ``buf``. As views they shared
    ``buf``'s counter, so an in-place update of one replica's buffer (a step counter)
    made autograd reject a backward through another replica's weight."""
    memo = plan.__dict__.get("_group_views")
    if memo is None:  # per group: sizes and the non-1-D positions (made once per plan)
        shapes = plan.shapes
        memo = plan.__dict__["_group_views"] = [
            (g.numels.tolist(), [(j, shapes[i]) for j, i in enumerate(g.index.tolist()) if len(shapes[i]) != 1])
            for g in plan.groups
        ]
    if len(plan.groups) == 1:
        return split_views(region(buf, plan.groups[0], layout[0]), *memo[0], autograd_views=False)
    result = [None] * len(plan.tensors)
    for g, off, (sizes, not_1d) in zip(plan.groups, layout, memo):
        for i, v in zip(g.index.tolist(), split_views(region(buf, g, off), sizes, not_1d, autograd_views=False)):
            result[i] = v
    return result
