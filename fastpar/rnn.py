"""cuDNN-compatible RNN weight packing: every weight of an ``nn.RNNBase`` copied into one
buffer, where cuDNN expects it, in one kernel launch.

PyTorch's ``_cudnn_rnn`` takes the storage of the first flat weight *from storage offset
0* as cuDNN's weight buffer and checks that every weight sits exactly where cuDNN's
layout puts it (``try_get_weight_buf`` in ``aten/src/ATen/native/cudnn/RNN.cpp``);
otherwise it warns "RNN module weights are not part of single contiguous chunk of memory"
and repacks on every call. The layout is cuDNN's to define (PyTorch asks cuDNN for each
matrix's address), so on CUDA :class:`RNNLayout` reads it off a template module that
``flatten_parameters()`` placed; elsewhere it is the canonical dense layout.

Packing is fastpar's multi-tensor copy (``flatten``) with the layout's offsets instead of
cumulative ones. Gaps in the layout (cuDNN's slots for absent biases, padding) are extra
entries of the same launch that copy from a zero buffer, so one launch both copies and
zero-fills, and a fresh buffer never needs a separate memset.
"""
from __future__ import annotations

import functools
import math
import operator
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.autograd.graph import increment_version

from . import _alloc, _dispatch, _tuning
from . import _flatten
from ._fastcheck import snapshot_one
from ._flatten import _staged_groups
from ._plan import Group, plan_for
from ._validate import check_conversion, check_memory, check_not_inference, check_not_recorded
from .kernels._launch import fork_safe_lock

__all__ = ["RNNLayout", "flatten_parameters", "is_flat", "pack"]

#: Gates per mode: rows of ``weight_ih`` are ``gates * hidden_size``.
_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def _weight_names(num_layers: int, bidirectional: bool, bias: bool, proj_size: int) -> list:
    """``_flat_weights_names`` as ``nn.RNNBase.__init__`` builds them."""
    names = []
    for layer in range(num_layers):
        for suffix in ("", "_reverse")[: 2 if bidirectional else 1]:
            kinds = ["weight_ih", "weight_hh"] + (["bias_ih", "bias_hh"] if bias else [])
            kinds += ["weight_hr"] if proj_size > 0 else []
            names += [f"{k}_l{layer}{suffix}" for k in kinds]
    return names


def _weight_shapes(mode, input_size, hidden_size, num_layers, bidirectional, bias, proj_size) -> list:
    """Shapes of the weights in ``_flat_weights_names`` order (as ``nn.RNNBase`` creates them)."""
    gate = _GATES[mode] * hidden_size
    real_hidden = proj_size if proj_size > 0 else hidden_size
    ndir = 2 if bidirectional else 1
    shapes = []
    for layer in range(num_layers):
        layer_in = input_size if layer == 0 else real_hidden * ndir
        for _ in range(ndir):
            shapes += [(gate, layer_in), (gate, real_hidden)]
            shapes += [(gate,), (gate,)] if bias else []
            shapes += [(proj_size, hidden_size)] if proj_size > 0 else []
    return shapes


def _normalize_device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cpu":
        return torch.device("cpu")  # CPU tensors report "cpu", never "cpu:0"
    if device.type == "cuda" and device.index is None:
        # cuDNN layouts are per device: key them on a concrete index.
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(frozen=True)
class RNNLayout:
    r"""Where each weight of an RNN configuration lives in its packed buffer.

    For a configuration (mode, sizes, layers, direction, bias, projection, dtype,
    device), the element offset and shape of every weight in the module's
    ``_flat_weights_names`` order, and the buffer's numel. Elements no weight covers
    (gaps) are zero in a packed buffer.

    On CUDA, when cuDNN would take the weights, the layout is cuDNN's own: read off a
    template module of the same configuration after ``flatten_parameters()`` placed it
    with ``torch._cudnn_rnn_flatten_weight`` (``source == "cudnn"``). Elsewhere (CPU, a
    dtype ``flatten_parameters()`` does not place (bf16), cuDNN disabled, ROCm) it is
    the canonical dense layout: per layer and direction ``w_ih, w_hh, b_ih, b_hh,
    w_hr`` in PyTorch's order, no gaps (``source == "dense"``). Layouts are cached per
    configuration and device.

    Build one with :meth:`for_module` or :meth:`for_config`; the constructor takes
    explicit offsets (checked to lie in the buffer and not to overlap).
    """

    mode: str
    input_size: int
    hidden_size: int
    num_layers: int
    bidirectional: bool
    bias: bool
    proj_size: int
    dtype: torch.dtype
    device: torch.device
    #: Weight names, in ``_flat_weights_names`` order.
    names: tuple
    #: Shape of each weight.
    shapes: tuple
    #: Element offset of each weight in the buffer.
    offsets: tuple
    #: Elements in the buffer (weights and gaps).
    numel: int
    #: ``"cudnn"`` (queried from cuDNN) or ``"dense"`` (canonical).
    source: str = "dense"
    #: ``[k, 2]`` int64: the ``[start, end)`` ranges no weight covers.
    gaps: np.ndarray = field(init=False, repr=False, compare=False, hash=False)
    numels: np.ndarray = field(init=False, repr=False, compare=False, hash=False)
    offsets_np: np.ndarray = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        # Tuples whatever sequences were given: a layout is a dict key (the packing
        # cache) and its shapes are compared with torch.Size.
        object.__setattr__(self, "names", tuple(self.names))
        object.__setattr__(self, "shapes", tuple(tuple(int(d) for d in s) for s in self.shapes))
        object.__setattr__(self, "offsets", tuple(int(o) for o in self.offsets))
        # The fields that for_config checks, checked here too (the constructor is public):
        # a device given as a string is made a torch.device, as pack compares devices.
        if self.mode not in _GATES:
            raise ValueError(f"RNNLayout: mode must be one of {', '.join(_GATES)}; got {self.mode!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"RNNLayout: dtype must be a torch.dtype, got {type(self.dtype).__name__} "
                            f"{self.dtype!r}")
        object.__setattr__(self, "device", _normalize_device(self.device))
        n = len(self.names)
        if len(self.shapes) != n or len(self.offsets) != n:
            raise ValueError(
                f"RNNLayout needs one shape and one offset per weight: got {n} names, "
                f"{len(self.shapes)} shapes and {len(self.offsets)} offsets"
            )
        numels = np.fromiter((int(np.prod(s, dtype=np.int64)) for s in self.shapes), np.int64, n)
        offsets = np.asarray(self.offsets, dtype=np.int64).reshape(n)
        if n and (offsets.min() < 0 or (offsets + numels).max() > self.numel):
            i = int(np.argmax((offsets < 0) | (offsets + numels > self.numel)))
            raise ValueError(
                f"RNNLayout: {self.names[i]} at [{offsets[i]}, {offsets[i] + numels[i]}) lies "
                f"outside the buffer's {self.numel} elements"
            )
        order = np.argsort(offsets, kind="stable")
        starts, ends = offsets[order], offsets[order] + numels[order]
        clash = np.nonzero(starts[1:] < ends[:-1])[0]
        if len(clash):
            a, b = order[clash[0]], order[clash[0] + 1]
            raise ValueError(f"RNNLayout: {self.names[a]} and {self.names[b]} overlap")
        # Gaps: the complement of the weights' ranges in [0, numel).
        lo = np.concatenate([[0], ends])
        hi = np.concatenate([starts, [self.numel]])
        keep = hi > lo
        gaps = np.stack([lo[keep], hi[keep]], axis=1).astype(np.int64).reshape(-1, 2)
        for name, value in (("gaps", gaps), ("numels", numels), ("offsets_np", offsets)):
            value.flags.writeable = False
            object.__setattr__(self, name, value)

    @property
    def nbytes(self) -> int:
        """Bytes in the buffer."""
        return self.numel * self.dtype.itemsize

    @staticmethod
    def for_config(mode: str, input_size: int, hidden_size: int, num_layers: int = 1, *,
                   bidirectional: bool = False, bias: bool = True, proj_size: int = 0,
                   dtype: torch.dtype = torch.float32, device="cpu") -> "RNNLayout":
        r"""The layout of a configuration, as ``nn.RNNBase`` takes it.

        Args:
            mode (str): ``"LSTM"``, ``"GRU"``, ``"RNN_TANH"`` or ``"RNN_RELU"``.
            input_size, hidden_size, num_layers, bidirectional, bias, proj_size: as for
                ``nn.LSTM`` (``proj_size > 0`` only with ``"LSTM"``).
            dtype (torch.dtype): dtype of the buffer. Default: ``torch.float32``.
            device (torch.device or str): device of the buffer. Default: CPU.
        """
        if mode not in _GATES:
            raise ValueError(f"mode must be one of {', '.join(_GATES)}; got {mode!r}")
        # Any integer type (numpy's too: nn.RNNBase type-checks only input_size and
        # hidden_size, so a module built with num_layers=np.int64(2) runs in torch),
        # made a Python int: the layout is a cache key and its fields are compared.
        sizes = {}
        for name, v, least in (("input_size", input_size, 1), ("hidden_size", hidden_size, 1),
                               ("num_layers", num_layers, 1), ("proj_size", proj_size, 0)):
            if isinstance(v, bool) or not hasattr(type(v), "__index__"):
                raise TypeError(f"{name} must be an int >= {least}, got {type(v).__name__} {v!r}")
            sizes[name] = operator.index(v)
            if sizes[name] < least:
                raise ValueError(f"{name} must be an int >= {least}, got {sizes[name]}")
        input_size, hidden_size, num_layers, proj_size = sizes.values()
        # As nn.RNNBase (which refuses a non-bool bias, so every module's is one): bool()
        # of the string "False" or of a tensor would give a layout the caller did not ask for.
        if not isinstance(bias, (bool, np.bool_)):
            raise TypeError(f"bias must be a bool, got {type(bias).__name__} {bias!r}")
        if proj_size and (mode != "LSTM" or proj_size >= hidden_size):
            raise ValueError(
                f"proj_size must be 0, or in [1, hidden_size) for LSTM; got proj_size={proj_size} "
                f"with mode={mode!r}, hidden_size={hidden_size}"
            )
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        device = _normalize_device(device)
        cudnn_on = device.type == "cuda" and torch.backends.cudnn.enabled
        return _layout(mode, input_size, hidden_size, num_layers, bool(bidirectional), bool(bias),
                       proj_size, dtype, device, cudnn_on)

    @staticmethod
    def for_module(module, device=None, *, dtype=None) -> "RNNLayout":
        r"""The layout of ``module``'s configuration.

        Args:
            module (nn.RNNBase): an ``nn.RNN``, ``nn.LSTM`` or ``nn.GRU``.
            device (torch.device, optional): device of the buffer. Default: the device
                of the module's weights.
            dtype (torch.dtype, optional): dtype of the buffer. Default: the dtype of
                the module's weights.
        """
        _check_rnn(module)
        names = list(module._flat_weights_names)
        weights = _module_weights(module, names)
        if device is None or dtype is None:
            _check_one_device_dtype(weights, names)
        layout = RNNLayout.for_config(
            module.mode, module.input_size, module.hidden_size, module.num_layers,
            bidirectional=module.bidirectional, bias=module.bias, proj_size=module.proj_size,
            dtype=weights[0].dtype if dtype is None else dtype,
            device=weights[0].device if device is None else device,
        )
        if list(layout.names) != names:
            raise ValueError(
                f"module's _flat_weights_names {names} differ from nn.RNNBase's for its "
                f"configuration {list(layout.names)}"
            )
        return layout

    def views(self, buffer: torch.Tensor) -> tuple:
        """Tensors over ``buffer`` (a packed buffer of this layout) shaped like the
        weights, each with its own version counter (as the weights that torch's
        ``flatten_parameters`` re-points with ``set_`` keep theirs, and as each copy of
        ``broadcast_coalesced`` gets one): pieces of ``unsafe_split_with_sizes`` over the
        weights and the gaps between them, not autograd views sharing ``buffer``'s."""
        _check_out(buffer, self, "buffer")
        sizes, slot, pos = [], [0] * len(self.shapes), 0
        for i in sorted(range(len(self.shapes)), key=self.offsets.__getitem__):
            if self.offsets[i] > pos:
                sizes.append(self.offsets[i] - pos)  # alignment gap before this weight
            slot[i] = len(sizes)
            n = math.prod(self.shapes[i])
            sizes.append(n)
            pos = self.offsets[i] + n
        sizes.append(buffer.numel() - pos)  # the tail (may be empty)
        pieces = buffer.unsafe_split_with_sizes(sizes)
        return tuple(pieces[slot[i]].view(s) for i, s in enumerate(self.shapes))


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=128)
def _layout(mode, input_size, hidden_size, num_layers, bidirectional, bias, proj_size, dtype,
            device, cudnn_on) -> RNNLayout:
    names = tuple(_weight_names(num_layers, bidirectional, bias, proj_size))
    shapes = tuple(_weight_shapes(mode, input_size, hidden_size, num_layers, bidirectional, bias, proj_size))
    cfg = (mode, input_size, hidden_size, num_layers, bidirectional, bias, proj_size, dtype, device)
    if cudnn_on:
        found = _cudnn_offsets(*cfg)
        if found is not None:
            offsets, numel = found
            return RNNLayout(*cfg, names, shapes, offsets, numel, "cudnn")
    numels = [int(np.prod(s)) for s in shapes]
    offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum(numels)[:-1]]))
    return RNNLayout(*cfg, names, shapes, offsets, int(sum(numels)), "dense")


def _cudnn_offsets(mode, input_size, hidden_size, num_layers, bidirectional, bias, proj_size, dtype, device):
    """``(offsets, numel)`` where cuDNN placed a template module's weights, or None
    when ``flatten_parameters()`` left them alone (a dtype outside
    ``torch.backends.cudnn.CUDNN_TENSOR_DTYPES``, such as bf16, which recent torch may
    still run on cuDNN: see the README's Limits; ROCm)."""
    # Built on the meta device (no memory, no RNG draws), then given uninitialised CUDA
    # storage: ``to_empty`` re-runs ``_init_flat_weights`` -> ``flatten_parameters()``,
    # which hands the weights to ``torch._cudnn_rnn_flatten_weight`` exactly as it would
    # the user's module.
    tmpl = torch.nn.RNNBase(mode, input_size, hidden_size, num_layers, bias=bias,
                            bidirectional=bidirectional, proj_size=proj_size, device="meta", dtype=dtype)
    with torch.cuda.device(device):
        tmpl.to_empty(device=device)
    weights = tmpl._flat_weights
    storage = weights[0].untyped_storage()
    base = storage.data_ptr()
    if any(w.untyped_storage().data_ptr() != base or not w.is_contiguous() for w in weights):
        return None
    numel = storage.nbytes() // dtype.itemsize
    return tuple(int(w.storage_offset()) for w in weights), int(numel)


# --- validation -------------------------------------------------------------------------


def _check_rnn(module, name: str = "module") -> None:
    if not isinstance(module, torch.nn.RNNBase):
        raise TypeError(
            f"{name} must be a torch.nn.RNNBase (nn.RNN, nn.LSTM or nn.GRU), got {type(module).__name__}"
        )


def _flatten_checks(module):
    """``(names, weights, layout)`` for :func:`flatten_parameters`, having checked that
    every weight can be packed and rebound; raises as documented there otherwise."""
    _check_rnn(module)
    names = list(module._flat_weights_names)
    weights = _module_weights(module, names)
    _check_one_device_dtype(weights, names)
    layout = RNNLayout.for_module(module)
    _check_shapes(weights, layout, lambda i: f"module.{names[i]}")
    if weights[0].is_meta:
        raise ValueError(f"module's weights are meta tensors (module.{names[0]} is on meta): there is no memory to pack")
    ptrs = {}
    for n, w in zip(names, weights):
        if w.numel() and w.data_ptr() in ptrs:
            # Rebinding one tensor to two slots would leave one of them wrong.
            raise ValueError(f"module.{n} aliases module.{ptrs[w.data_ptr()]}; tied RNN weights cannot be packed")
        ptrs[w.data_ptr()] = n
        if w.is_inference() and not torch.is_inference_mode_enabled():
            # set_ refuses in-place changes to inference tensors outside inference mode:
            # found here, before anything is rebound, not half-way through.
            raise RuntimeError(
                f"module.{n} is an inference tensor (made under torch.inference_mode()); it can be "
                "rebound into a packed buffer only inside torch.inference_mode()"
            )
    return names, weights, layout


def _module_weights(module, names) -> list:
    """The module's current weights by name (``getattr``, which ``_flat_weights`` mirrors)."""
    from torch.nn.utils import parametrize

    weights = []
    for n in names:
        if parametrize.is_parametrized(module, n):
            raise ValueError(
                f"module.{n} is parametrized; its value is recomputed on every access, so it "
                "cannot be rebound into a packed buffer (remove the parametrization first)"
            )
        w = getattr(module, n, None)
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"module.{n} must be a torch.Tensor, got {type(w).__name__}")
        if w.layout != torch.strided:
            raise TypeError(f"module.{n} must be a dense tensor, got layout {w.layout}")
        weights.append(w)
    if not weights:
        raise ValueError("module has no weights (_flat_weights_names is empty)")
    return weights


def _check_one_device_dtype(weights, names, what: str = "module.") -> None:
    w0 = weights[0]
    for n, w in zip(names, weights):
        if w.device != w0.device:
            raise ValueError(
                f"the weights must all be on one device: {what}{names[0]} is on {w0.device} but "
                f"{what}{n} is on {w.device}"
            )
        if w.dtype != w0.dtype:
            raise TypeError(
                f"the weights must all have one dtype: {what}{names[0]} is {w0.dtype} but "
                f"{what}{n} is {w.dtype}"
            )


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _check_shapes(weights, layout: RNNLayout, label) -> None:
    if len(weights) != len(layout.names):
        raise ValueError(
            f"weights must hold the layout's {len(layout.names)} weights "
            f"({', '.join(layout.names[:3])}, ...), got {len(weights)}"
        )
    if list(map(_shape, weights)) == list(layout.shapes):
        return
    for i, (w, s) in enumerate(zip(weights, layout.shapes)):
        if tuple(w.shape) != s:
            raise ValueError(
                f"{label(i)} has shape {tuple(w.shape)}, but the {layout.mode} configuration "
                f"(input_size={layout.input_size}, hidden_size={layout.hidden_size}, "
                f"proj_size={layout.proj_size}) expects {s}"
            )


def _check_out(t, layout: RNNLayout, name: str, *, written: bool = False) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{name} must be a dense tensor, got layout {t.layout}")
    if t.device != layout.device:
        raise ValueError(f"{name} must be on {layout.device} (the layout's device), got a tensor on {t.device}")
    if t.dtype != layout.dtype:
        raise TypeError(f"{name} must have dtype {layout.dtype} (the layout's dtype), got {t.dtype}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous 1-D tensor, got shape {tuple(t.shape)} with strides {t.stride()}"
        )
    if t.numel() != layout.numel:
        raise ValueError(
            f"{name} must have exactly {layout.numel} elements (the layout's buffer), got {t.numel()} "
            f"({'too small' if t.numel() < layout.numel else 'too large'})"
        )
    if t.storage_offset() != 0:
        # cuDNN takes the weight buffer from storage offset 0 of the first weight's storage.
        raise ValueError(
            f"{name} must start at storage offset 0 (cuDNN reads the buffer from there), "
            f"got storage offset {t.storage_offset()}"
        )
    check_memory(t, name)
    if written:  # (what flatten checks of its out)
        if t.is_conj() or t.is_neg():
            raise ValueError(
                f"{name} is a lazily {'conjugated' if t.is_conj() else 'negated'} view (its bits are not "
                f"its values); pass {name}.resolve_conj() / .resolve_neg(), or a plain tensor"
            )
        check_not_inference(t, name)
        check_not_recorded(t, name)


# --- packing ----------------------------------------------------------------------------

#: Per (device, dtype): a zero buffer the gap entries copy from. Only ever replaced by a
#: larger one; cached packing groups keep slices of older ones alive.
_ZEROS: dict = {}
#: CUDA zero buffers that a larger one replaced, kept for the life of the process. A pack
#: may read one from any stream, but the caching allocator would hand its memory out again
#: as soon as the last cached group holding it is dropped, to work on the stream it was
#: allocated on, while a pack on another stream may still be reading it (and would copy
#: that work's data into the gaps). They are small (the largest gap of a layout, at least
#: 1024 elements) and only replaced when a layout has a larger gap than any before.
_RETIRED_ZEROS: list = []
_ZEROS_LOCK = fork_safe_lock()
#: Plan group -> {layout: packing group}; entries go with the plan (weak keys).
_PACKING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _zero_source(device: torch.device, dtype: torch.dtype, n: int) -> torch.Tensor:
    with _ZEROS_LOCK:
        z = _ZEROS.get((device, dtype))
        if z is None or z.numel() < n:
            if z is not None and z.is_cuda:
                _RETIRED_ZEROS.append(z)
            z = torch.zeros(max(n, 1024), dtype=dtype, device=device)
            if z.is_cuda:
                # The fill is queued on the current stream; packs read this buffer from
                # whatever stream is current then. Once per buffer: wait for the fill.
                torch.cuda.current_stream(z.device).synchronize()
            _ZEROS[(device, dtype)] = z
        return z


def _packing_group(g: Group, layout: RNNLayout) -> Group:
    """``g`` (all the weights, in layout order) with the layout's offsets, plus one entry
    per gap that copies from a zero buffer: one launch writes the whole buffer."""
    tensors = list(g.tensors)
    addrs = [g.addrs]
    numels = [g.numels]
    offsets = [layout.offsets_np]
    if len(layout.gaps):
        lengths = layout.gaps[:, 1] - layout.gaps[:, 0]
        z = _zero_source(layout.device, g.dtype, int(lengths.max()))
        tensors += [z[:k] for k in lengths.tolist()]
        addrs.append(np.full(len(lengths), z.data_ptr(), dtype=np.int64))
        numels.append(lengths)
        offsets.append(layout.gaps[:, 0])
    n = len(tensors)
    return Group(g.dtype, g.device, np.arange(n), tuple(tensors), np.concatenate(addrs),
                 np.concatenate(numels), np.concatenate(offsets), transient=g.transient)


def pack(weights, layout: RNNLayout, *, out=None) -> torch.Tensor:
    r"""Pack ``weights`` into a buffer of ``layout``, in one kernel launch.

    Every weight lands at its layout offset; gaps are zero-filled in the same launch.
    The buffer starts at storage offset 0, as cuDNN requires.

    Args:
        weights (list or tuple of Tensor): the weights in ``layout.names`` order (a module's
            ``_flat_weights``), with the layout's shapes, on the layout's device and of
            one dtype (converted to ``layout.dtype`` on the way when it differs).
            Non-contiguous weights are accepted (one extra copy each).
        layout (RNNLayout): where each weight goes.
        out (Tensor, optional): a contiguous 1-D tensor of exactly ``layout.numel``
            elements, of the layout's dtype and device, at storage offset 0, not
            overlapping any weight. Reusing one across calls avoids the allocation.

    Returns:
        Tensor: ``out`` if given, else a new buffer.

    One launch on the ``triton`` (CUDA, or the interpreter on CPU tensors) and ``numba``
    (CPU) backends. Like :func:`fastpar.flatten`, the result records no autograd history.
    """
    if torch.compiler.is_dynamo_compiling():  # (see _dispatch.eager_entry)
        return _pack_eagerly(weights, layout, out=out)
    return _pack(weights, layout, out, cache=True)


def _pack(weights, layout: RNNLayout, out, cache: bool, more_outs=(), bind: bool = True) -> torch.Tensor:
    """:func:`pack`; with ``more_outs`` (buffers like ``out``, given), the same packing is
    written into each of them too, in the same launch when no cast is needed (the
    ``broadcast`` op: each weight read once, large packs written with streaming
    stores), which is how replicate fills the buffers of several host replicas. Without
    ``bind``, a given ``out`` is not bound for the next call (replicate's: a new view of
    its pooled buffer every step, which a bound pack would never see again)."""
    if not isinstance(layout, RNNLayout):
        raise TypeError(f"layout must be an RNNLayout, got {type(layout).__name__}")
    plan = plan_for(weights, "weights", cache=cache)
    # Bound only for an out the caller passed (and no more_outs): binding the buffer
    # allocated below cost 25-40 us a call and replaced the caller's bound out= pack in
    # this layout, so a loop that also packed without out= missed it every call.
    bindable = bind and cache and out is not None and not more_outs
    if bindable:
        bound = _bound_pack(plan, layout, out)
        if bound is not None:  # the weights, layout and out as the last call checked them
            return bound.write(out)
    _check_shapes(plan.tensors, layout, lambda i: f"weights[{i}] ({layout.names[i]})")
    if plan.device != layout.device:
        raise ValueError(f"weights must be on {layout.device} (the layout's device), got {plan.device}")
    if len(plan.groups) > 1:  # one group per dtype
        _check_one_device_dtype(plan.tensors, [f"[{i}]" for i in range(len(plan.tensors))], "weights")
    check_conversion(plan.dtypes[0], layout.dtype, None, "pack")
    given = [] if out is None else [("out", out)]
    given += [(f"more_outs[{j}]", t) for j, t in enumerate(more_outs)]
    for name, t in given:
        _check_out(t, layout, name, written=True)
        i = plan.overlaps(t)
        if i >= 0:
            raise ValueError(f"{name} overlaps the memory of weights[{i}] ({layout.names[i]}); it must be a separate buffer")
    # A raw copy takes broadcast, which streams large packs past the cache. Resolved
    # before anything is allocated or staged: on CUDA this refuses a graph capture.
    op = "broadcast" if plan.dtypes[0] == layout.dtype else "flatten"
    backend, launch = _dispatch.kernel(op, layout.device)
    if out is None:
        out = _alloc.empty(layout.numel, dtype=layout.dtype, device=layout.device)
    outs = [out, *more_outs]
    groups, _ = _staged_groups(plan, fill=True)
    (g,) = groups
    if cache and g is plan.groups[0]:
        per_plan = _PACKING.setdefault(g, {})
        packed = per_plan.get(layout)
        if packed is None:
            new = _packing_group(g, layout)
            packed = per_plan.setdefault(layout, new)
            if packed is new:
                # It holds one more reference to each weight: counted, so that the plan
                # cache still drops the plan (and this group with it) once the caller's
                # weights are gone, instead of keeping them alive until evicted.
                plan.internal_refs += 1
    else:  # staged temporaries: a one-off group
        packed = _packing_group(g, layout)
    bound = None
    if bindable and g is plan.groups[0]:
        bound = _bind_pack(plan, layout, packed, op, backend, out)
    if bound is not None:
        bound.run()
    elif op == "broadcast":
        launch(packed, outs, **_tuning.params("flatten", backend, g.dtype, g.dtype, layout.numel * len(outs),
                                              packed.device))
    else:
        for o in outs:
            launch(packed, o, None, **_tuning.params("flatten", backend, g.dtype, o.dtype, layout.numel, packed.device))
    increment_version(outs)
    return out


# Bound packs. A loop packing the same weights into the same out= buffer (a benchmark,
# a training step re-packing its RNN) checks, after its first call, only what can have
# changed: the weights (the plan's compiled check), out (one compiled metadata
# comparison: same object, data pointer, dtype, sizes, strides, storage, conj/neg bits;
# then inference and grad mode), and the backend and tuning state. The launch itself is
# kept resolved, as flatten(out=) keeps its own (fastpar._flatten._Bound): right after a
# pack that had streamed 25 MB through the caches, the Python of the full checks and the
# launch set-up took 0.2-0.3 ms of a 0.5-1 ms GRU(512, 512, 2) pack.


def _pack_key(layout: RNNLayout) -> tuple:
    # By identity: hashing a layout hashes every shape. The bound call keeps the layout,
    # so the id cannot pass to another one while the key is in use.
    return ("pack", id(layout))


def _bound_pack(plan, layout: RNNLayout, out):
    """The bound pack of ``plan``'s weights in ``layout`` into ``out`` if the last call
    bound it for that very ``out``, unchanged since (see :func:`_flatten._bound_for`)."""
    bound = _flatten._bound_for(plan, _pack_key(layout), out)
    return bound if bound is not None and bound.keep[1] is layout else None


def _bind_pack(plan, layout: RNNLayout, packed, op: str, backend: str, out):
    """Bind the pack just checked (``packed``: the plan's group placed in ``layout``) into
    ``out``, for the next call's :func:`_bound_pack`; None where packs are not bound: another
    backend, a replaced launcher, an uncached plan, a tensor the compiled check cannot
    snapshot."""
    if backend != "numba" or not plan.reusable:
        return None
    launcher = _flatten.own_launcher(op)
    snap = snapshot_one(out)
    if launcher is None or snap is None:
        return None
    from .kernels.ops_numba import flatten as numba_flatten

    def bind():
        if op == "broadcast":
            run = numba_flatten.bind_broadcast(packed, [out], **_tuning.params(
                "flatten", backend, packed.dtype, packed.dtype, layout.numel, packed.device))
        else:
            run = numba_flatten.bind_copy(packed, out, None, True, **_tuning.params(
                "flatten", backend, packed.dtype, out.dtype, layout.numel, packed.device))
        return () if run is None else (run,)

    bound = _flatten._Bound()
    bound.op, bound.launcher, bound.flat_ptr, bound.flat_snap = op, launcher, out.data_ptr(), snap
    bound.keep = (packed, layout)
    bound.state, bound.launches = _flatten.resolved(bind)
    _flatten.remember(plan, _pack_key(layout), bound)
    return bound


# --- modules ----------------------------------------------------------------------------


def _buffer_of(w: torch.Tensor, layout: RNNLayout) -> torch.Tensor:
    """The packed buffer ``w`` (a weight of a flat module) lives in, from offset 0."""
    return torch.empty(0, dtype=w.dtype, device=w.device).set_(w.untyped_storage(), 0, (layout.numel,))


def _weights_flat(weights, layout: RNNLayout) -> bool:
    w0 = weights[0]
    storage = w0.untyped_storage()
    base = storage.data_ptr()
    item = layout.dtype.itemsize
    if storage.nbytes() < layout.nbytes:
        return False
    for w, s, off in zip(weights, layout.shapes, layout.offsets):
        # A lazily negated or conjugated weight's memory does not hold its values (cuDNN
        # would read the bits): not flat, so flatten_parameters repacks its values.
        if (w.dtype != layout.dtype or w.device != layout.device or tuple(w.shape) != s
                or not w.is_contiguous() or w.is_neg() or w.is_conj()
                or w.untyped_storage().data_ptr() != base
                or w.data_ptr() != base + off * item):
            return False
    return True


def is_flat(module) -> bool:
    r"""Whether ``module``'s weights sit in one buffer the way cuDNN takes them.

    The test ``try_get_weight_buf`` applies: the first weight's storage, read from
    offset 0, holds at least the layout's numel, and every weight's data pointer is
    where :meth:`RNNLayout.for_module` puts it; plus every weight has its layout shape
    and is contiguous (cuDNN reads them as dense matrices), with no lazy negation or
    conjugation bit (its memory would not hold its values). Shape or dtype mismatches
    and weights on different devices make it False.

    Raises:
        TypeError: ``module`` is not an ``nn.RNNBase``.
    """
    _check_rnn(module)
    from torch.nn.utils import parametrize

    names = list(module._flat_weights_names)
    if any(parametrize.is_parametrized(module, n) for n in names):
        return False  # (before ``getattr``, which would run the parametrization)
    weights = [getattr(module, n, None) for n in names]
    if not weights or not all(isinstance(w, torch.Tensor) and w.layout == torch.strided for w in weights):
        return False
    w0 = weights[0]
    if any(w.device != w0.device or w.dtype != w0.dtype for w in weights):
        return False
    try:
        layout = RNNLayout.for_module(module)
    except (TypeError, ValueError):
        return False
    return _weights_flat(weights, layout)


def flatten_parameters(module) -> torch.Tensor:
    r"""Pack ``module``'s weights into one cuDNN-layout buffer (one kernel launch) and
    rebind each weight to its view of it.

    Like ``nn.RNNBase.flatten_parameters()``, but on every device and dtype: each weight
    is re-pointed with ``set_`` (under ``no_grad``), so the ``Parameter`` objects stay
    the same and optimizers, hooks and ``state_dict()`` keep working; ``_flat_weights``
    is refreshed. Afterwards :func:`is_flat` is True and, on CUDA, cuDNN uses the buffer
    without repacking. A module that is already flat is left as it is.

    Args:
        module (nn.RNNBase): an ``nn.RNN``, ``nn.LSTM`` or ``nn.GRU`` (any mode, layer
            count and direction, ``bias=False``, ``proj_size > 0``).

    Returns:
        Tensor: the packed buffer (1-D, ``RNNLayout.for_module(module).numel``
        elements, storage offset 0).

    Raises:
        TypeError: ``module`` is not an ``nn.RNNBase``; a weight is not a dense tensor;
            the weights mix dtypes.
        ValueError: the weights are on different devices, alias each other, are
            parametrized, or do not have the shapes the module's configuration implies.
        RuntimeError: a weight is an inference tensor and inference mode is off.

    Every check runs before anything is written or rebound: a rejected call leaves the
    module as it was.

    The rebinding is an in-place change of each weight: a graph built through the
    weights before the call can no longer be backpropagated (autograd raises "modified
    by an inplace operation"), so flatten before the forward. ``copy.deepcopy`` of a
    flat module copies each weight on its own; flatten the copy again.
    """
    if torch.compiler.is_dynamo_compiling():  # (see _dispatch.eager_entry)
        return _flatten_parameters_eagerly(module)
    return _flatten_checked(module, *_flatten_checks(module))


def _flatten_checked(module, names, weights, layout) -> torch.Tensor:
    """:func:`flatten_parameters` once :func:`_flatten_checks` has passed (its result)."""
    if _weights_flat(weights, layout):
        buf = _buffer_of(weights[0], layout)
    else:
        # Not cached: the weights move into the new buffer right away, so a cached plan
        # would be stale at once and would keep the buffer alive.
        buf = _pack(weights, layout, None, cache=False)
        storage = buf.untyped_storage()
        with torch.no_grad():
            for w, s, off in zip(weights, layout.shapes, layout.offsets):
                w.set_(storage, off, s, _contiguous_strides(s))
                # The buffer holds the weight's values (a lazy negation or conjugation
                # resolved by the pack); ``set_`` keeps the bits, which would apply it again.
                if w.is_neg():
                    torch._C._set_neg(w, False)
                if w.is_conj():
                    torch._C._set_conj(w, False)
    # ``__setattr__`` keeps ``_flat_weights`` in sync with assignments; refresh it from
    # the attributes in case it was built before one (as ``_init_flat_weights`` does).
    module._flat_weights = list(weights)
    module._flat_weight_refs = [weakref.ref(w) for w in weights]
    return buf


# What the functions above run when called while dynamo traces (see _dispatch.eager_entry).
_pack_eagerly = _dispatch.eager_entry(pack)
_flatten_parameters_eagerly = _dispatch.eager_entry(flatten_parameters)
