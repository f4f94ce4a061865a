"""DDP communication hooks and a coalesced parameter broadcast on ``torch.distributed``.

fastpar brings no transport of its own here: the hooks plug fastpar's fused kernels into
``DistributedDataParallel`` (gloo on CPU, NCCL on GPU) and let ``torch.distributed`` move
the bytes.

* :func:`allreduce_hook`: torch's ``allreduce_hook``, the division by the world size one
  fastpar pass over the bucket in place; results bitwise equal to torch's.
* :func:`compress_hook` (and :data:`bf16_compress_hook`, :data:`fp16_compress_hook`):
  one fused pass scales by ``1 / world_size`` and casts the bucket into a persistent
  low-precision buffer, the all-reduce runs on that buffer, and one fused pass casts the
  sum back into the bucket. torch's compress hooks take three passes (cast, divide, copy
  back) and a fresh allocation per bucket and step; torch's bf16 hook also refuses to
  run without CUDA + NCCL, while gloo reduces bfloat16 and fastpar's hook runs there.
* :func:`register`: checks a hook against the model and its process group (dtypes the
  backend cannot reduce, gradients fastpar cannot cast) and registers it, so that a bad
  combination fails at registration rather than inside a step.
* :func:`sync_params`: every parameter and buffer of a module broadcast from one rank in
  one coalesced broadcast (packed with fastpar), for replicas built by hand.

Example::

    >>> # xdoctest: +SKIP
    >>> import fastpar.ddp
    >>> model = DistributedDataParallel(net)
    >>> fastpar.ddp.register(model, fastpar.ddp.bf16_compress_hook)
"""
# No ``from __future__ import annotations`` here: DistributedDataParallel compares the
# hooks' annotations with ``dist.GradBucket`` and ``Future[Tensor]`` objects, and
# postponed (string) annotations would fail that check.
import contextvars
import warnings
import weakref
import zlib

import torch
import torch.distributed as dist
from torch.autograd.graph import increment_version
from torch.multiprocessing.reductions import StorageWeakRef

from . import _alloc, _dispatch, _tuning
from ._flatten import flatten_plain, unflatten_into_plain
from ._plan import Group, plan_for, transient_tensors
from ._validate import FLOAT_DTYPES, check_conversion
from .kernels._launch import fork_safe_lock

__all__ = [
    "allreduce_hook",
    "bf16_compress_hook",
    "compress_hook",
    "fp16_compress_hook",
    "register",
    "release_buffers",
    "sync_params",
]


# ---------------------------------------------------------------------------------------
# Which dtypes a backend can all-reduce.

#: dtypes gloo's all_reduce(SUM) accepts (checked on torch 2.13: int16, uint16 and the
#: float8 types raise "Invalid scalar type").
_GLOO_DTYPES = frozenset({
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
    torch.complex64, torch.complex128,
})
#: dtypes torch's NCCL process group maps to an NCCL type (bfloat16 needs NCCL >= 2.10,
#: checked separately; complex tensors are reduced as real views).
_NCCL_DTYPES = frozenset({
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool,
    torch.complex64, torch.complex128,
})


def _nccl_version():
    try:
        return tuple(torch.cuda.nccl.version())
    except Exception:  # CPU-only builds have no NCCL to ask
        return None


def _non_member(state) -> bool:
    """``state`` is what ``new_group()`` returns on a rank it leaves out
    (``GroupMember.NON_GROUP_MEMBER``, an int)."""
    return type(state) is int and state == dist.GroupMember.NON_GROUP_MEMBER


def _refuse_non_member(state, name: str) -> None:
    """``TypeError`` if ``state`` is :func:`_non_member`: refused as "got int", the
    message did not say that this rank is outside the group."""
    if _non_member(state):
        raise TypeError(
            f"{name} is GroupMember.NON_GROUP_MEMBER, what new_group() returns on a rank it leaves "
            f"out: global rank {dist.get_rank()} is not in that group, and a hook reduces over a group "
            "that holds its rank; pass a group this rank belongs to (or None for the default group)"
        )


def _group_of(state, name: str = "state"):
    """The process group a hook runs on: ``state`` itself, or WORLD when it is None."""
    if state is None:
        if not dist.is_initialized():
            raise RuntimeError(
                f"{name} is None, which means the default process group, but "
                "torch.distributed is not initialized; call dist.init_process_group() first"
            )
        return dist.group.WORLD
    if not isinstance(state, dist.ProcessGroup):
        _refuse_non_member(state, name)
        raise TypeError(
            f"{name} must be None (the default process group) or a torch.distributed "
            f"ProcessGroup, got {type(state).__name__}"
        )
    return state


def _backend_for(group, device: torch.device) -> str:
    """Name of the backend ``group`` uses for tensors on ``device`` (``gloo``, ``nccl``,
    ...), read from ``get_backend_config`` (``"gloo"`` or ``"cpu:gloo,cuda:nccl"``)."""
    config = str(dist.get_backend_config(group))
    if ":" not in config:
        return config
    by_device = dict(item.split(":", 1) for item in config.split(","))
    if device.type not in by_device:
        raise RuntimeError(
            f"the process group has no backend for {device.type} tensors "
            f"(its backends: {config}); gradients live on {device}"
        )
    return by_device[device.type]


def _check_reducible(group, device: torch.device, dtype: torch.dtype, who: str, what: str) -> None:
    """Raise ``TypeError`` if ``group`` cannot all-reduce ``dtype`` tensors on ``device``.

    Only gloo and NCCL are known here; other backends (MPI, UCC, third-party) are trusted
    to report their own errors."""
    backend = _backend_for(group, device)
    if backend == "gloo":
        supported = _GLOO_DTYPES
    elif backend == "nccl":
        if device.type != "cuda":
            raise TypeError(
                f"{who}: the process group reduces {device.type} tensors with NCCL, which "
                f"only reduces CUDA tensors; {what} are on {device}. Move the model to "
                "CUDA or use a gloo process group"
            )
        supported = _NCCL_DTYPES
        if dtype == torch.bfloat16:
            version = _nccl_version()
            if version is None or version < (2, 10):
                raise TypeError(
                    f"{who}: NCCL reduces bfloat16 from version 2.10, this torch has NCCL "
                    f"{'.'.join(map(str, version)) if version else '(none)'}; {what} would "
                    "be reduced as bfloat16. Use fp16_compress_hook or upgrade NCCL"
                )
    else:
        return
    if dtype not in supported:
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in supported))
        raise TypeError(
            f"{who}: the {backend} backend cannot all-reduce {dtype} tensors, and {what} "
            f"would be reduced as {dtype}; {backend} reduces {names}"
        )


#: Per process group (held weakly: it goes with the group), the (device, bucket dtype and
#: layout, hook) already checked by a hook (a hook re-checks lazily so that a hook
#: registered without :func:`register` still fails on every rank, before any collective,
#: instead of hanging one of them). Keyed on the group object, not its ``id``: a new
#: group of another backend could take a destroyed one's id and skip its check.
_checked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _check_once(group, buf: torch.Tensor, wire: torch.dtype, who: str) -> None:
    # The layout is part of the key: a sparse bucket after a dense one of the same dtype
    # must still be checked (and refused by the casting hooks).
    key = (buf.device, buf.dtype, buf.layout, who)
    try:
        seen = _checked.get(group)
        if seen is None:
            seen = _checked.setdefault(group, set())
    except TypeError:  # a group object that cannot be referenced weakly: check every call
        seen = set()
    if key not in seen:
        if buf.layout != torch.strided and who != "allreduce_hook":
            raise TypeError(
                f"{who}: gradient buckets must be dense to be cast; got a {buf.layout} "
                "bucket (an nn.Embedding(sparse=True)?). Use allreduce_hook for sparse gradients"
            )
        if who != "allreduce_hook":
            check_conversion(buf.dtype, wire, 1.0, who)
        _check_reducible(group, buf.device, wire, who, f"{buf.dtype} gradient buckets")
        seen.add(key)


# ---------------------------------------------------------------------------------------
# Fused passes over one bucket.

# A compress hook's pass for one bucket runs on the autograd thread while the cast back
# of another runs on gloo's callback thread. What may not be entered from two threads at
# once is locked where it is launched, for every caller: Numba's parallel regions (its
# workqueue layer) under ``PARALLEL_LOCK`` (kernels/ops_numba/_common.py, taken by the
# bound passes), the Triton interpreter under ``_dispatch.INTERPRETER_LOCK``.


class _Bucket:
    """What the passes over one bucket buffer reuse across steps: the launch group (its
    address, numel and chunk maps, and on CUDA its pointer table in device memory), the
    low-precision buffers the compress hooks reduce in, and each pass resolved to a
    ready launch (see :func:`_launch`)."""

    __slots__ = ("alive", "device_type", "group", "low", "passes")

    def __init__(self, buf: torch.Tensor) -> None:
        self.alive = StorageWeakRef(buf.untyped_storage())
        g = plan_for([buf], "bucket", cache=False).groups[0]
        # The same group without the tensor itself: holding the bucket buffer would keep
        # DDP's first-iteration buckets alive after it rebuilds them; the Numba and
        # Triton launchers need only the address, which the cache key pins.
        self.group = Group(g.dtype, g.device, g.index, (), g.addrs, g.numels, g.offsets)
        self.low: dict = {}
        #: (op, flat address, flat dtype, scale, divide) -> _Pass.
        self.passes: dict = {}
        # Read per pass: from the tensor, or from a torch.device (whose ``type`` makes
        # a new string each read), it would cost more than the rest of the lookup.
        self.device_type = buf.device.type


class _BucketCache:
    """Per-bucket state keyed on (device, address, numel, dtype) of the bucket buffer.

    Live buckets have distinct addresses, so two buckets in flight never share a
    low-precision buffer, whichever DDP models the hooks serve. An entry whose bucket
    storage has been freed (DDP rebuilds its buckets after the first iteration) is dropped
    the next time a new bucket is seen.
    """

    def __init__(self) -> None:
        self._entries: dict = {}
        self._lock = fork_safe_lock()

    def get(self, buf: torch.Tensor) -> _Bucket:
        key = (buf.device, buf.data_ptr(), buf.numel(), buf.dtype)
        entry = self._entries.get(key)
        if entry is not None and not entry.alive.expired():
            return entry
        entry = _Bucket(buf)
        with self._lock:
            for k in [k for k, e in self._entries.items() if e.alive.expired()]:
                del self._entries[k]
            self._entries[key] = entry
        return entry

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


_buckets = _BucketCache()


def release_buffers() -> None:
    r"""Drop what the hooks keep per bucket: the low-precision buffers of the compress
    hooks (half the gradients' size, on the gradients' device) and each bucket's resolved
    passes.

    A bucket's entry is otherwise dropped when a hook next sees a new bucket after the
    bucket's memory was freed, so after the last DDP model is deleted its buffers stay
    until then. Call this to return that memory at once (e.g. after training, before
    evaluation on the same GPU). Safe while hooks run: a later call rebuilds its entry.
    """
    _buckets.clear()


#: Bytes read + written from which a Numba pass over a bucket runs on every thread. A
#: bucket is one contiguous tensor that autograd has just written, hot in cache, where
#: two threads pay off far earlier than for the many cold tensors flatten's default
#: (4 MiB) and its tuning are measured on: on 2 cores, a 1 MiB float32 bucket cast to
#: bfloat16 takes 14 us on two threads against 23 us on one, and ``Tensor.to`` and
#: ``Tensor.mul_`` use both threads at that size too.
_BUCKET_PARALLEL_MIN_BYTES = 1 << 20


#: Bound passes kept per bucket (a hook needs at most three: scale, cast in, cast back).
_MAX_PASSES_PER_BUCKET = 8


class _Pass:
    """One pass over one bucket, resolved once: the backend and tuned launch parameters
    it was resolved for, and ``run(bucket_buf, flat)`` that launches it (None: an empty
    bucket, nothing to launch)."""

    __slots__ = ("backend", "run", "stamp", "tuned")

    def __init__(self, backend: str, tuned: dict, run) -> None:
        self.backend = backend
        self.tuned = tuned
        self.run = run
        #: _tuning.resolution_state() when backend and tuned were last found current.
        self.stamp = None


def _bind_numba(op: str, group: Group, flat: torch.Tensor, scale, divide: bool, tuned: dict):
    """The Numba launch of ``op`` with every argument resolved, as a callable taking no
    arguments (None: an empty bucket, nothing to launch).

    The launchers' Python costs several microseconds a call, a good part of a pass over
    a 1 MB bucket; bound once, a step pays only the kernel call."""
    if op == "scale":
        from .kernels.ops_numba import scale as numba_scale

        return numba_scale.bind(
            group, scale, divide, chunk=tuned.get("chunk", numba_scale.DEFAULT_CHUNK),
            parallel_min_bytes=_BUCKET_PARALLEL_MIN_BYTES,
        )
    from .kernels.ops_numba import flatten as numba_flatten

    return numba_flatten.bind_copy(
        group, flat, scale, op == "flatten", chunk=tuned.get("chunk", numba_flatten.DEFAULT_CHUNK),
        parallel_min_bytes=_BUCKET_PARALLEL_MIN_BYTES,
    )


def _launch(op: str, entry: _Bucket, bucket_buf: torch.Tensor, flat: torch.Tensor, scale,
            divide: bool = False) -> None:
    """One fastpar pass between ``bucket_buf`` (the group side) and ``flat``: ``flatten``
    writes ``flat`` from the bucket, ``unflatten_into`` writes the bucket from ``flat``,
    ``scale`` multiplies the bucket in place by ``scale`` (divides by it if ``divide``;
    ``flat`` is then the bucket itself).

    The launch is resolved once per bucket and pass and reused every step. What the
    backend and the tuned parameters depend on (:func:`fastpar._tuning.resolution_state`)
    is checked every call (a ``FASTPAR_BACKEND`` or :func:`fastpar.use_backend` change, a
    re-read or forced tuning table, takes effect at the next call), and the launch is
    resolved again when it changed: asking :func:`fastpar._dispatch.backend_for_type` and
    :func:`fastpar._tuning.params` every call cost 5-8 us of a 1 MB compress pass's
    35-45 us, right after the kernel's 1.5 MB had gone through the caches (1.5 us in a
    quiet loop). On Numba
    a tuned ``chunk`` is used but not ``parallel_min_bytes``: bucket passes run on every
    core from 1 MiB read and written (``_BUCKET_PARALLEL_MIN_BYTES``)."""
    key = (op, flat.data_ptr(), flat.dtype, scale, divide)
    p = entry.passes.get(key)
    stamp = _tuning.resolution_state()
    while p is None or p.stamp != stamp:
        backend = _dispatch.backend_for_type(entry.device_type)
        if op == "flatten":
            src_dtype, dst_dtype = bucket_buf.dtype, flat.dtype
        else:
            src_dtype, dst_dtype = flat.dtype, bucket_buf.dtype
        # The same dict object while the tuning table is unchanged (see _tuning.params).
        tuned = _tuning.params(op, backend, src_dtype, dst_dtype, bucket_buf.numel(), bucket_buf.device)
        if p is None or p.backend != backend or p.tuned is not tuned:
            if len(entry.passes) >= _MAX_PASSES_PER_BUCKET:
                # A backend handing back a new result tensor every step would otherwise
                # add a pass per step (gloo and NCCL return the hook's own buffer).
                entry.passes.clear()
            p = entry.passes[key] = _Pass(backend, tuned, _bind(op, backend, entry, flat, scale, divide, tuned))
        # Current if nothing moved while it was resolved; else (a table read on first use,
        # typically this very call's) ask again.
        now = _tuning.resolution_state()
        if now == stamp:
            p.stamp = stamp
        stamp = now
    if p.run is not None:
        p.run(bucket_buf, flat)
    if op != "flatten":
        increment_version(bucket_buf)
    elif flat is not entry.low.get(flat.dtype):
        # A low-precision buffer the hook keeps is its own, never seen by autograd: its
        # version bump would cost a microsecond a pass for no one.
        increment_version(flat)


def _bind(op: str, backend: str, entry: _Bucket, flat: torch.Tensor, scale, divide: bool, tuned: dict):
    """``run(bucket_buf, flat)`` for one pass on ``backend``; None when there is nothing
    to launch. It holds no tensor (a pass is cached with its bucket entry, which must not
    keep the bucket alive): the Numba launch needs only addresses, which the cache key
    pins, and the other backends get the tensors per call."""
    if backend == "numba":
        bound = _bind_numba(op, entry.group, flat, scale, divide, tuned)
        return None if bound is None else lambda bucket_buf, flat: bound()
    launch = _dispatch._kernel(backend, op)
    if backend == "torch":
        # The reference backend computes on the tensors themselves: a group holding the
        # bucket, made per call.
        def group_of(bucket_buf):
            return plan_for([bucket_buf], "bucket", cache=False).groups[0]
    else:
        group = entry.group

        def group_of(bucket_buf):
            return group
    if op == "scale":
        return lambda bucket_buf, flat: launch(group_of(bucket_buf), scale, divide, **tuned)
    return lambda bucket_buf, flat: launch(group_of(bucket_buf), flat, scale, **tuned)


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# ---------------------------------------------------------------------------------------
# Hooks.


def _value(fut):
    return fut.value()[0]


# When ``backward()`` runs inside a compiled function, dynamo traces every Python frame
# autograd calls, DDP's comm hook among them. Traced, a hook's body went through the
# bound Numba launches (which bypass fastpar._dispatch.kernel and its disabled
# launchers), warned at the builtins and caches it met, and left half-built
# ``StorageWeakRef`` objects whose ``__del__`` raised. A hook returns a future the
# reducer waits on: there is no graph to build from it, so while dynamo traces, the hooks
# and sync_params call their bodies' eager entries (_dispatch.eager_entry): one graph
# break each, the body run eagerly whole.


def _buffer_of(bucket, who: str) -> torch.Tensor:
    """The bucket's buffer; ``TypeError`` for the ``(grad, param)`` tuple DDP's Python
    reducer hands hooks (told apart as torch's compress hooks tell it)."""
    if isinstance(bucket, tuple):
        raise TypeError(
            f"{who}: bucket must be a torch.distributed.GradBucket, got {type(bucket).__name__}. "
            "DDP built under torch._dynamo.config.optimize_ddp='python_reducer' calls comm hooks "
            "per parameter with a (grad, param) tuple, inside compiled autograd, which fastpar's "
            "hooks do not support: use torch's hooks there, or optimize_ddp=True/False"
        )
    return bucket.buffer()


def allreduce_hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""Average the gradient bucket across the process group with one ``all_reduce``.

    A drop-in for ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks
    .allreduce_hook``: the bucket is divided by the world size in place, then all-reduced
    (sum) in place, and the future holds the bucket buffer itself (so with
    ``gradient_as_bucket_view=True`` DDP copies nothing back).

    The division is one fastpar pass over the bucket in place (``scale``: Numba on CPU,
    Triton on CUDA), with results bitwise equal to torch's ``allreduce_hook``:

    * for a power-of-two world size it multiplies by ``1 / world_size``, which is then
      exactly torch's quotient;
    * for other world sizes ``x * (1 / n)`` and ``x / n`` differ in the last bit for
      about a third of float32 values, so on CPU the pass divides, correctly rounded, as
      torch's ``Tensor.div_`` does there; on CUDA, where torch's ``div_`` multiplies by a
      float32 reciprocal instead, the hook calls ``Tensor.div_`` itself.

    On CPU the pass reads and writes through one pointer, so its loop vectorises, and it
    runs on every core from 1 MiB read and written (a float32 bucket of 512 KiB) up:
    faster than torch's ``Tensor.div_`` (the hook's own division) and about as fast as
    ``Tensor.mul_`` (measured on 2 cores,
    ``benchmarks/test_bench_ddp.py::test_allreduce_scale_pass``). 16- and 64-bit floats
    are scaled in float32 and float64, rounding once, as torch does (a bfloat16 NaN may
    come out with other payload bits than torch's, which itself varies them). Sparse
    buckets, other dtypes and non-contiguous buffers go to ``Tensor.div_``.

    Args:
        process_group (ProcessGroup or None): the group to average over (DDP passes
            the ``state`` given at registration); None means the default group
            (``dist.group.WORLD``), as torch's hooks accept.
        bucket (dist.GradBucket): the bucket DDP hands to the hook.

    Returns:
        torch.futures.Future[Tensor]: completes with the averaged bucket buffer.

    Example::

        >>> # xdoctest: +SKIP
        >>> fastpar.ddp.register(ddp_model, fastpar.ddp.allreduce_hook)
    """
    if torch.compiler.is_dynamo_compiling():  # (see _dispatch.eager_entry)
        return _allreduce_eagerly(process_group, bucket)
    return _allreduce(process_group, bucket)


def _allreduce(process_group, bucket):
    group = _group_of(process_group, "process_group")
    buf = _buffer_of(bucket, "allreduce_hook")
    _check_once(group, buf, buf.dtype, "allreduce_hook")
    n = group.size()
    if n > 1:
        # The scale pass reads and writes the bucket as one run of memory: a buffer that
        # is not one (a wrapper's bucket.set_buffer of a strided view) goes to div_ too.
        if buf.layout != torch.strided or buf.dtype not in FLOAT_DTYPES or not buf.is_contiguous():
            buf.div_(n)
        elif _power_of_two(n):
            _launch("scale", _buckets.get(buf), buf, buf, 1.0 / n)
        elif buf.device.type == "cpu":
            _launch("scale", _buckets.get(buf), buf, buf, float(n), divide=True)
        else:
            buf.div_(n)  # CUDA: torch multiplies by a float32 reciprocal (see above)
    return dist.all_reduce(buf, group=group, async_op=True).get_future().then(_value)


_allreduce_eagerly = _dispatch.eager_entry(_allreduce)
allreduce_hook._fastpar_wire = None  # reduced in the bucket's own dtype


#: dtype -> the hook compress_hook made for it (so each dtype has one hook object).
_compress_hooks: dict = {}


def compress_hook(dtype: torch.dtype = torch.bfloat16):
    r"""A DDP communication hook that all-reduces gradients in ``dtype``.

    The returned ``hook(process_group, bucket)`` takes one fused fastpar pass to scale the bucket
    by ``1 / world_size`` and cast it into a ``dtype`` buffer, all-reduces that buffer
    (sum), and takes one fused pass to cast the sum back into the bucket buffer, which the
    future then holds. The ``dtype`` buffer is kept per bucket (keyed on the bucket's
    address) and reused every step.

    Compared with torch's ``fp16_compress_hook`` / ``bf16_compress_hook`` (cast into a new
    tensor, divide it, copy it back: three passes and an allocation per bucket and step):

    * two passes, no allocation after the first step;
    * the scaling happens in float32 (float64 for float64 buckets) before the cast, so
      a share is rounded to ``dtype`` once, from a float32 product, rather than divided
      again after rounding (for a power-of-two world size: exactly the correctly rounded
      ``x / world_size``), and a float16 gradient above 65504 survives the cast when its
      share fits;
    * the bfloat16 hook runs on gloo as well as NCCL (torch's refuses to run without CUDA
      and NCCL, though gloo reduces bfloat16).

    The kept buffers cost ``dtype.itemsize / 4`` of the float32 gradient memory for as
    long as DDP keeps its buckets (torch's hooks allocate as much at every step). Under
    ``torch.compile`` (a backward run inside a compiled function) the hook runs eagerly,
    opaque to dynamo, as DDP's C++ reducer calls it; a model built under
    ``torch._dynamo.config.optimize_ddp="python_reducer"`` (compiled autograd), which
    calls hooks per parameter, is refused: use torch's hooks there.

    Args:
        dtype (torch.dtype): the dtype gradients travel and are summed in: ``torch.bfloat16``
            (default), ``torch.float16``, ``torch.float32`` (to compress a float64
            model), or ``torch.float64`` (accepted for symmetry: it widens rather than
            compresses). Default: ``torch.bfloat16``.

    Returns:
        Callable: ``hook(process_group, bucket) -> Future[Tensor]``, ``process_group`` a process group or
        None for the default group. The same object for the same ``dtype``.

    Raises:
        TypeError: ``dtype`` is not a floating-point dtype fastpar casts to.

    Example::

        >>> # xdoctest: +SKIP
        >>> fastpar.ddp.register(ddp_model, fastpar.ddp.compress_hook(torch.float16))
    """
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
        got = dtype if isinstance(dtype, torch.dtype) else f"{type(dtype).__name__} {dtype!r}"
        raise TypeError(
            f"dtype must be one of {', '.join(map(str, FLOAT_DTYPES))} (the floating-point "
            f"dtypes fastpar casts to), got {got}"
        )
    hook = _compress_hooks.get(dtype)
    if hook is None:
        hook = _compress_hooks.setdefault(dtype, _make_compress_hook(dtype))
    return hook


def _make_compress_hook(dtype: torch.dtype):
    short = str(dtype).replace("torch.", "")
    who = f"compress_hook({short})"

    def hook(process_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if torch.compiler.is_dynamo_compiling():  # (see _dispatch.eager_entry)
            return compress_eagerly(process_group, bucket)
        return compress(process_group, bucket)

    def compress(process_group, bucket):
        group = _group_of(process_group, "process_group")
        buf = _buffer_of(bucket, who)
        _check_once(group, buf, dtype, who)
        # The passes read and write the bucket as one run of memory: a buffer that is not
        # one (a wrapper's bucket.set_buffer of a strided view) goes through a contiguous
        # copy, written back into it after the cast back.
        work = buf if buf.is_contiguous() else buf.contiguous()
        entry = _buckets.get(work)
        low = entry.low.get(dtype)
        if low is None:
            low = entry.low[dtype] = torch.empty(work.numel(), dtype=dtype, device=work.device)
        _launch("flatten", entry, work, low, 1.0 / group.size())
        fut = dist.all_reduce(low, group=group, async_op=True).get_future()
        # The cast back may run on the backend's callback thread: it runs in this
        # thread's context, so both passes take the same backend. (A use_backend(...)
        # around backward() reaches this thread on the CPU only: autograd runs CUDA
        # backward on its device threads, which do not inherit context variables.)
        context = contextvars.copy_context()

        def decompress(fut):
            # Cast back in place: returning the bucket buffer itself spares DDP a copy
            # when gradients are bucket views, and frees nothing to allocate again.
            low_now = fut.value()[0]
            context.run(_launch, "unflatten_into", entry, work, low_now, None)
            if work is not buf:
                buf.copy_(work)
                if work.is_cuda:
                    # The contiguous copy (and the low buffer of its entry, dropped with
                    # it) was allocated on the hook's stream; a CUDA future's callback
                    # runs on another, so their memory must not be reused before the
                    # kernels queued here have read it (as torch's record_stream asks).
                    stream = torch.cuda.current_stream(work.device)
                    work.record_stream(stream)
                    low_now.record_stream(stream)
            return buf

        return fut.then(decompress)

    # DDP refuses hooks *named* bf16_compress_hook unless CUDA + NCCL are present (a check
    # meant for torch's own hook), so fastpar's hooks carry names of their own.
    hook.__name__ = hook.__qualname__ = f"fastpar_compress_hook_{short}"
    hook.__doc__ = (
        f"fastpar DDP communication hook: fused scale + cast to {short}, all_reduce in "
        f"{short}, fused cast back (see fastpar.ddp.compress_hook)."
    )
    hook._fastpar_wire = dtype
    compress_eagerly = _dispatch.eager_entry(compress)
    # pickle finds a function by module and name: a DDP model holding the hook pickles
    # (torch.save(ddp_model)) as with torch's hooks, which are module functions.
    globals()[hook.__name__] = hook
    return hook


# Every dtype's hook exists from import on, so that another process unpickles any of them.
for _dtype in FLOAT_DTYPES:
    compress_hook(_dtype)
del _dtype

#: ``compress_hook(torch.bfloat16)``: gradients all-reduced in bfloat16 (gloo or NCCL >= 2.10).
bf16_compress_hook = compress_hook(torch.bfloat16)
#: ``compress_hook(torch.float16)``: gradients all-reduced in float16.
fp16_compress_hook = compress_hook(torch.float16)


def _hook_name(hook) -> str:
    return "allreduce_hook" if hook is allreduce_hook else f"compress_hook({str(hook._fastpar_wire).replace('torch.', '')})"


def register(ddp_model, hook, state=None) -> None:
    r"""Check ``hook`` against ``ddp_model`` and register it as its communication hook.

    ``ddp_model.register_comm_hook(state, hook)`` accepts any callable and a combination
    the backend cannot run only fails inside the first backward. This checks first, on
    every rank alike and without communicating, then registers:

    * every gradient DDP reduces (parameters that require grad, minus
      ``parameters_to_ignore``) can be cast by the hook: floating point, dense (no
      ``nn.Embedding(sparse=True)``) for the compress hooks;
    * the process group's backend for the parameters' device can all-reduce the dtype
      that travels: gloo reduces float32/64, float16 and bfloat16; NCCL needs CUDA
      tensors and NCCL >= 2.10 for bfloat16. Other backends are not checked.

    Hooks registered with ``register_comm_hook`` directly make the same checks at their
    first call, before any collective, so a bad combination still raises on every rank
    rather than hanging one of them.

    Args:
        ddp_model (DistributedDataParallel): the model to register on.
        hook (Callable): :func:`allreduce_hook` or a hook from :func:`compress_hook`
            (:data:`bf16_compress_hook`, :data:`fp16_compress_hook`).
        state (ProcessGroup, optional): the group to reduce over. Default: the model's own
            process group (``ddp_model.process_group``), which torch's hooks would reach
            only if it is the default group (registered then as None, which keeps the
            model picklable and deep-copyable as with torch's hooks).

    Raises:
        TypeError: ``ddp_model`` is not a DistributedDataParallel, ``hook`` is not a
            fastpar hook, ``state`` is not a process group, ``ddp_model`` was built
            under ``torch._dynamo.config.optimize_ddp="python_reducer"``, or the
            combination of gradient dtypes, hook and backend is unsupported (the message
            names the parameter, its dtype and what would work).
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"ddp_model must be a torch.nn.parallel.DistributedDataParallel, got {type(ddp_model).__name__}"
        )
    if not callable(hook) or not hasattr(hook, "_fastpar_wire"):
        # Named with its module: torch's hooks share fastpar's names ("got allreduce_hook"
        # read as the very hook the message asked for).
        got = getattr(hook, "__qualname__", None)
        if got is None:
            got = type(hook).__name__
        elif getattr(hook, "__module__", None):
            got = f"{hook.__module__}.{got}"
        raise TypeError(
            "hook must be fastpar.ddp.allreduce_hook or a hook made by fastpar.ddp.compress_hook "
            f"(bf16_compress_hook, fp16_compress_hook), got {got}; "
            "register other hooks with ddp_model.register_comm_hook"
        )
    if state is None:
        # The model's group; None when that is the default group (the hooks read None as
        # it, as torch's do): DDP pickles and deep-copies itself only with the default
        # group, and a ProcessGroup held as the hook's state cannot be pickled.
        state = None if ddp_model.process_group is dist.group.WORLD else ddp_model.process_group
    elif not isinstance(state, dist.ProcessGroup):
        _refuse_non_member(state, "state")
        raise TypeError(
            f"state must be None (the model's own process group) or a torch.distributed "
            f"ProcessGroup, got {type(state).__name__}"
        )
    group = _group_of(state)
    who = _hook_name(hook)
    if getattr(ddp_model, "_use_python_reducer", False):
        raise TypeError(
            f"{who}: ddp_model was built under torch._dynamo.config.optimize_ddp='python_reducer', "
            "where DDP calls comm hooks per parameter inside compiled autograd, which fastpar's "
            "hooks do not support; use torch's hooks there, or build the model with "
            "optimize_ddp=True/False"
        )
    wire = hook._fastpar_wire
    ignored = set(getattr(ddp_model, "parameters_to_ignore", ()) or ())
    sparse = {
        id(m.weight)
        for m in ddp_model.module.modules()
        if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse
    }
    checked = set()
    for name, p in ddp_model.module.named_parameters():
        if not p.requires_grad or name in ignored:
            continue
        # DDP's buckets hold a complex gradient as its real view (view_as_real): the
        # hook sees that real dtype.
        dtype = p.dtype.to_real() if p.is_complex() else p.dtype
        if wire is not None:
            if id(p) in sparse:
                raise TypeError(
                    f"{who} cannot cast sparse gradients, and parameter {name!r} gets them "
                    "(an nn.Embedding/EmbeddingBag with sparse=True); use allreduce_hook"
                )
            if dtype not in FLOAT_DTYPES:
                raise TypeError(
                    f"{who} casts gradients with fastpar, which supports "
                    f"{', '.join(map(str, FLOAT_DTYPES))}; parameter {name!r} is {p.dtype}. "
                    "Use allreduce_hook for it"
                )
        key = (p.device, dtype)
        if key not in checked:
            _check_reducible(group, p.device, wire or dtype, who, f"gradients of parameter {name!r} ({p.dtype})")
            checked.add(key)
    ddp_model.register_comm_hook(state, hook)


# ---------------------------------------------------------------------------------------
# sync_params.


def _pack(tensors: list, out: torch.Tensor) -> None:
    """``fastpar.flatten(tensors, out=out)`` without the plan cache: the tensors here are
    views made for one call, and caching their plan would pin the module's memory."""
    with transient_tensors():
        flatten_plain(tensors, out=out)


def _unpack(flat: torch.Tensor, tensors: list) -> None:
    """``fastpar.unflatten_into(flat, tensors)`` without the plan cache."""
    with transient_tensors():
        unflatten_into_plain(flat, tensors)


def _sharing_memory(tensors: list) -> set:
    """Positions of the contiguous tensors whose bytes overlap a kept one's: in each
    storage, by offset (then list position), a tensor starting before the end of the
    last kept one is staged, else kept. Only offsets within a storage and list positions
    decide, so every rank of identical modules stages the same tensors."""
    by_storage: dict = {}
    for i, t in enumerate(tensors):
        if t.is_contiguous() and t.numel():
            lo = t.storage_offset() * t.element_size()
            key = (t.device, t.untyped_storage().data_ptr())
            by_storage.setdefault(key, []).append((lo, lo + t.numel() * t.element_size(), i))
    shared = set()
    for spans in by_storage.values():
        end = None
        for lo, hi, i in sorted(spans):
            if end is not None and lo < end:
                shared.add(i)
            else:
                end = hi
    return shared


def _expanded_index(t: torch.Tensor):
    """The index that cuts each dimension of ``t`` of stride 0 (and size > 1) to its
    first element, or None if ``t`` has none: an expanded tensor (a buffer registered as
    ``x.expand(...)``) holds each value at several positions, and that view of it holds
    all its memory once."""
    if all(st or n <= 1 for n, st in zip(t.shape, t.stride())):
        return None
    return tuple(slice(0, 1) if st == 0 and n > 1 else slice(None) for n, st in zip(t.shape, t.stride()))


def _mismatch_message(names: list, tensors: list, signature: list, most: int, group, me: int, device) -> str:
    """What :func:`sync_params` raises when the ranks' modules differ: the first tensor
    whose shape, dtype, device type or contiguity is not the same on every rank, as this
    rank holds it. Found with one more ``all_reduce`` (every rank is on this path), of
    each tensor's checksum padded to ``most``, the largest count in the group: the whole
    module's checksum said only that something differs, and a layout difference (a
    parameter transposed or made channels_last on one rank) read as a different
    architecture."""
    # crc + 1: 0 stands for "no tensor at this position" on a rank that holds fewer.
    own = [zlib.crc32(sig.encode()) + 1 for sig in signature] + [0] * (most - len(signature))
    check = torch.tensor(own + [-c for c in own], dtype=torch.int64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
    highs, lows = check[:most].tolist(), (-check[most:]).tolist()
    first = next((i for i in range(most) if highs[i] != lows[i]), None)
    if first is None:  # only a checksum collision gets here
        what = "their parameters and buffers differ"
    elif first < len(tensors):
        t = tensors[first]
        layout = "contiguous" if t.is_contiguous() else "non-contiguous"
        what = f"{names[first]} (#{first}): {t.dtype} {tuple(t.shape)} on {t.device.type}, {layout} here"
    else:
        what = f"no tensor #{first} here, another rank has one"
    return (
        f"sync_params: ranks hold different modules: on rank {me}, {what} ({len(tensors)} parameters "
        f"and buffers here, {most} on some rank); every rank must hold the same parameters and "
        "buffers, in the same order, with the same shapes, dtypes, device types and contiguity"
    )


def sync_params(module, src: int = 0, process_group=None) -> None:
    r"""Copy every parameter and buffer of ``module`` from rank ``src`` to all ranks of
    ``process_group``, in one coalesced broadcast.

    What ``DistributedDataParallel`` does at construction, for replicas built by hand:
    rank ``src`` packs all parameters and buffers into one flat buffer with a fastpar
    pass, ``dist.broadcast`` sends it, and every other rank unpacks it with one fastpar
    pass. Contiguous tensors travel as raw bytes, so every dtype (integer buffers such as
    ``num_batches_tracked``, bfloat16, bool, complex) shares that one buffer and arrives
    bit for bit; a non-contiguous tensor, or one sharing memory with another (a buffer
    registered as a view of another), travels in the same buffer through a contiguous
    copy written back after the broadcast (an expanded tensor, with a dimension of
    stride 0, through its distinct elements: it stays a view); and a module spread
    over several devices takes one broadcast per device.

    Before the broadcast one small ``all_reduce`` compares a checksum of the tensors'
    shapes, dtypes, device types and contiguity across ranks (DDP, too, refuses
    parameters whose strides differ), so modules that differ raise ``ValueError`` on
    every rank, naming the first tensor that differs, instead of hanging or scrambling
    the values.

    Must be called by every rank of the group; on a rank outside it (``new_group`` gave
    it ``GroupMember.NON_GROUP_MEMBER``) it warns and returns, as torch's collectives
    do. Writes bypass autograd, like
    ``torch.no_grad()``, and bump the tensors' version counters. Inside a
    function compiled with ``torch.compile`` the call is a graph break and runs eagerly.

    Args:
        module (nn.Module): the replica; ``module.parameters()`` and ``module.buffers()``
            are synchronized (each shared tensor once).
        src (int): global rank whose values everyone receives. Default: 0.
        process_group (ProcessGroup, optional): the group; default: the default group.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, ``src`` is not an int, or
            ``process_group`` is neither None nor a ``ProcessGroup``.
        ValueError: ``src`` is not a rank of the group, or ranks hold different modules.
        RuntimeError: ``process_group`` is None and ``torch.distributed`` is not
            initialized, ``module`` holds an uninitialized (lazy) parameter or buffer,
            or the group has no backend for a device the module's tensors
            are on (CPU buffers on an NCCL group), before any collective.
    """
    if torch.compiler.is_dynamo_compiling():
        # Called inside a compiled function, dynamo traced on through the packing, the
        # checksum and the collectives, warning at each builtin it met (zlib.crc32, ...),
        # with no graph to build from any of it: the whole call runs eagerly instead.
        return _sync_params_eagerly(module, src, process_group)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(src, bool) or not isinstance(src, int):
        raise TypeError(f"src must be an int (a global rank), got {type(src).__name__} {src!r}")
    if _non_member(process_group):
        # What new_group() hands the ranks it leaves out (an int, which _group_of would
        # refuse as "got int"): torch's collectives warn and do nothing there, and so
        # does this, so that every rank may run the same code for a subgroup.
        warnings.warn(
            f"sync_params: global rank {dist.get_rank()} does not belong to process_group "
            "(new_group() left it out); nothing is synced on this rank",
            stacklevel=_dispatch.user_stacklevel(2),  # (the caller's line under torch.compile too)
        )
        return
    group = _group_of(process_group, "process_group")
    ranks = dist.get_process_group_ranks(group)
    if src not in ranks:
        raise ValueError(f"src must be a global rank in the process group {ranks}, got {src}")
    me = dist.get_rank()

    # A lazy module before its first forward holds placeholders with no memory: torch's
    # detach() of one raised a ValueError naming neither this call nor the tensor. DDP
    # refuses them too (RuntimeError); refused here before any collective (on every rank
    # when none has run the forward; a rank that has would wait in the check below, as
    # it did before, until the group's timeout).
    # One walk of the module gives the tensors and the names an error gives them.
    named = [(f"parameter {n!r}", t) for n, t in module.named_parameters()]
    named += [(f"buffer {n!r}", t) for n, t in module.named_buffers()]
    for name, t in named:
        if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
            raise RuntimeError(
                f"sync_params: module has an uninitialized {name} (a lazy module before "
                "its first forward); run a forward pass on every rank first, then sync"
            )
    tensors = [t.detach() for _, t in named]
    # Wire groups: device -> tensors packed into one byte buffer (any dtype goes, even
    # one the backend cannot broadcast). Contiguous tensors go as byte views, so
    # unpacking writes the real tensors; a non-contiguous one goes through a contiguous
    # copy, written back after the broadcast (it once kept its dtype on the wire, and an
    # int16 or uint32 one then failed in gloo after other wires had been sent).
    wires: dict = {}
    staged = []
    signature = []
    shared = _sharing_memory(tensors)
    for i, t in enumerate(tensors):
        # A tensor sharing memory with an earlier one (a buffer registered as a view of
        # another) is staged too: unpacking writes no two wire pieces to one address.
        if t.is_contiguous() and i not in shared:
            w = t.reshape(-1).view(torch.uint8)
        else:
            # Only src's copy carries values; the others receive into it.
            tmp = t.contiguous() if me == src else torch.empty_like(t, memory_format=torch.contiguous_format)
            staged.append((t, tmp))
            w = tmp.reshape(-1).view(torch.uint8)
        wires.setdefault(t.device, []).append(w)
        signature.append(f"{t.dtype}{tuple(t.shape)}{t.device.type}{int(t.is_contiguous())}")

    # A device the group has no backend for (CPU buffers of a CUDA model on an NCCL
    # group) failed in its own broadcast, after the other devices' broadcasts had
    # written part of every receiving module: refused here, on every rank alike,
    # before any collective.
    for dev in wires:
        try:
            _backend_for(group, dev)
        except RuntimeError:
            raise RuntimeError(
                f"sync_params: the process group has no backend for {dev.type} tensors (its "
                f"backends: {dist.get_backend_config(group)}), and the module has parameters or "
                f"buffers on {dev}; move the module to one device type the group serves"
            ) from None
    device = tensors[0].device if tensors else torch.device("cpu")
    crc = zlib.crc32(";".join(signature).encode())
    check = torch.tensor([crc, len(tensors), -crc, -len(tensors)], dtype=torch.int64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX, group=group)
    hi, lo = check[:2].tolist(), (-check[2:]).tolist()
    if hi != lo:
        raise ValueError(_mismatch_message([n for n, _ in named], tensors, signature, hi[1], group, me, device))

    for dev, ws in wires.items():
        numel = sum(w.numel() for w in ws)
        if numel == 0:
            continue
        flat = _alloc.empty(numel, dtype=torch.uint8, device=dev)
        if me == src:
            _pack(ws, flat)
        dist.broadcast(flat, src=src, group=group)
        if me != src:
            _unpack(flat, ws)
    if me != src:
        for t, tmp in staged:
            # copy_ refuses a destination whose elements share memory: an expanded
            # tensor is written through the view that holds each value once (it travels
            # whole, as a non-contiguous tensor, so the wire does not depend on which
            # ranks hold it expanded).
            cut = _expanded_index(t)
            if cut is not None:
                t, tmp = t[cut], tmp[cut]
            t.copy_(tmp)


_sync_params_eagerly = _dispatch.eager_entry(sync_params)
