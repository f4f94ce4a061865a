"""``fastpar.DataParallel``: a drop-in for ``torch.nn.DataParallel`` on fastpar's kernels."""
from __future__ import annotations

import warnings
from itertools import chain
from typing import TypeVar

import torch
from torch.nn.modules import Module

from . import comm, rnn
from .kernels._launch import fork_safe_lock
from .parallel_apply import parallel_apply
from .replicate import replicate
from .scatter_gather import gather, scatter_kwargs

__all__ = ["DataParallel", "data_parallel"]

T = TypeVar("T", bound=Module)


def _index(device: torch.device):
    return device.index if device.type == "cuda" else device


def _default_device_ids():
    return list(range(torch.cuda.device_count())) if torch.cuda.is_available() else None


def _names_cpu(d) -> bool:
    try:
        return isinstance(d, (str, torch.device)) and torch.device(d).type == "cpu"
    except RuntimeError:  # not a device string: left to the validation that names it
        return False


def _checked_ids(device_ids) -> list:
    """``device_ids`` as a list, each entry a device name or index (with or without
    CUDA here: a typo must not pass as "CUDA ids, ignored")."""
    if isinstance(device_ids, (str, bytes, int, torch.device)) or not hasattr(device_ids, "__iter__"):
        raise TypeError(
            "device_ids must be a list of devices (e.g. [0, 1], or ['cpu', 'cpu'] for host replicas), "
            f"got {type(device_ids).__name__} {device_ids!r}"
        )
    device_ids = list(device_ids)
    for i, d in enumerate(device_ids):
        if isinstance(d, int) and not isinstance(d, bool) and d < 0:
            raise ValueError(f"device_ids[{i}] must be a CUDA device index (>= 0) or a device, got {d}")
    if device_ids:
        comm._check_device_set([comm._device(d, f"device_ids[{i}]", available=False)
                                for i, d in enumerate(device_ids)], "device_ids")
    return device_ids


def _cuda_ids_without_cuda(device_ids) -> bool:
    """True if ``device_ids`` asks for no CPU replica and there is no CUDA: torch's
    wrapper then ignores the ids (no accelerator, no parallelism)."""
    return not torch.cuda.is_available() and not any(_names_cpu(d) for d in device_ids)


class DataParallel(torch.nn.DataParallel[T]):
    r"""Implements data parallelism at the module level, as ``torch.nn.DataParallel``.

    Splits the input across the devices along ``dim``, replicates the module on each
    device (parameters in one contiguous buffer per device, RNN weights in cuDNN's
    layout, both refilled in place across calls), runs the replicas in parallel and
    gathers the outputs on ``output_device``. In backward, the replicas' gradients
    reach ``module``'s in one fused reduce-add launch per dtype.

    On CUDA, the module's own RNN weights are packed in place once
    (:func:`fastpar.rnn.flatten_parameters`, which keeps the Parameter objects), so every
    replica, the first included, hands cuDNN a ready buffer (of RNNs sharing a
    Parameter, the first: a Parameter sits in one buffer). Host replicas leave the
    module's weights as they are (there is no cuDNN to feed, and repacking would break a
    graph built through them before), and so do CUDA RNNs whose layout is not cuDNN's
    (bf16, cuDNN disabled: where torch's ``flatten_parameters()`` leaves them too).

    Same constructor, checks, warnings and forward flow as torch's, with the forward in
    four overridable steps: :meth:`scatter`, :meth:`replicate`, :meth:`parallel_apply`,
    :meth:`gather`. ``state_dict`` keys are torch's (``module.``-prefixed).

    Args:
        module (Module): module to be parallelized; its parameters and buffers must be
            on ``device_ids[0]``.
        device_ids (list of int, str or torch.device): CUDA devices (default: all), or
            ``"cpu"`` entries (repeats allowed) to run replicas in host memory, one
            thread each. The CPU mode exists for testing the whole path without a GPU and
            for CPU-bound models; it does not make a single-socket model faster by itself.
        output_device (int, str or torch.device): where outputs are gathered
            (default: ``device_ids[0]``).
        dim (int): dimension the inputs are split along (default: 0).

    Attributes:
        module (Module): the module to be parallelized.

    Example::

        >>> net = fastpar.DataParallel(model, device_ids=[0, 1, 2])
        >>> output = net(input_var)  # input_var can be on any device, including CPU
        >>> host = fastpar.DataParallel(model, device_ids=["cpu", "cpu"])
    """

    def __init__(self, module, device_ids=None, output_device=None, dim=0):
        # A subclass of torch's, so that isinstance checks (checkpoint code unwrapping
        # ``.module``, torch's own) see a DataParallel; its __init__ is replaced, not
        # called (torch's would check CUDA devices and refuse "cpu" replicas).
        Module.__init__(self)
        torch._C._log_api_usage_once("fastpar.DataParallel")
        if device_ids is None:
            device_ids = _default_device_ids()
        else:
            device_ids = _checked_ids(device_ids)  # once: it may be a one-shot iterator
            if _cuda_ids_without_cuda(device_ids):
                warnings.warn(
                    f"fastpar.DataParallel: CUDA is not available, so device_ids={device_ids!r} are "
                    "ignored and the module runs as is (as torch.nn.DataParallel does); pass "
                    "device_ids=['cpu', 'cpu'] for replicas in host memory", UserWarning, stacklevel=2)
                device_ids = None
        if device_ids is None:
            # As torch: no accelerator, no parallelism; the wrapper calls the module.
            self.module = module
            self.device_ids = []
            return
        if not device_ids:
            raise RuntimeError("no available devices were found")
        devs = comm._devices(device_ids, "device_ids")
        if output_device is None:
            output_device = devs[0]
        comm._warn_minus_one(output_device, stacklevel=2)  # torch's warns in every forward's gather
        self.dim = dim
        self.module = module
        # As torch: CUDA devices as indices (CPU replicas as torch.device("cpu")).
        self.device_ids = [_index(d) for d in devs]
        self.output_device = _index(comm._device(output_device, "output_device"))
        self.src_device_obj = devs[0]
        if devs[0].type == "cuda":
            from torch.nn.parallel.data_parallel import _check_balance

            _check_balance([d.index for d in devs])
        if len(self.device_ids) == 1:
            self.module.to(self.src_device_obj)

    def forward(self, *inputs, **kwargs):
        with torch.autograd.profiler.record_function("fastpar.DataParallel.forward"):
            if not self.device_ids:
                return self.module(*inputs, **kwargs)
            for t in chain(self.module.parameters(), self.module.buffers()):
                if t.device != self.src_device_obj:
                    raise RuntimeError(
                        "module must have its parameters and buffers "
                        f"on device {self.src_device_obj} (device_ids[0]) but found one of "
                        f"them on device: {t.device}"
                    )
            inputs, module_kwargs = self.scatter(inputs, kwargs, self.device_ids)
            # For a module with no inputs, run it once per device with empty arguments.
            if not inputs and not module_kwargs:
                inputs = ((),)
                module_kwargs = ({},)
            if len(self.device_ids) == 1:
                return self.module(*inputs[0], **module_kwargs[0])
            _flatten_rnns(self.module)
            replicas = self.replicate(self.module, self.device_ids[: len(inputs)])
            outputs = self.parallel_apply(replicas, inputs, module_kwargs)
            return self.gather(outputs, self.output_device)

    def replicate(self, module, device_ids):
        return replicate(module, device_ids, not torch.is_grad_enabled())

    def scatter(self, inputs, kwargs, device_ids):
        return scatter_kwargs(inputs, kwargs, device_ids, dim=self.dim)

    def parallel_apply(self, replicas, inputs, kwargs):
        return parallel_apply(replicas, inputs, kwargs, self.device_ids[: len(replicas)])

    def gather(self, outputs, output_device):
        return gather(outputs, output_device, dim=self.dim)


#: Held while a forward packs the module's RNN weights: two first forwards at once
#: would rebind the same weights under each other's replicas.
_FLATTEN_LOCK = fork_safe_lock()


def _feeds_cudnn(m) -> bool:
    """Whether packing ``m``'s own weights hands cuDNN a buffer it takes as is: they are on
    CUDA and their layout is cuDNN's (``RNNLayout.source == "cudnn"``, where torch's
    ``flatten_parameters()`` places them). Not where that layout is the dense one: bf16
    (``torch.backends.cudnn.CUDNN_TENSOR_DTYPES`` lacks it), cuDNN disabled, ROCm. There
    torch's ``flatten_parameters()`` leaves the weights alone, and packing them would only
    rebind the live weights (breaking a graph built through them before, as on the CPU)
    for a buffer no kernel asks for. Nor an RNN that cannot be packed (a parametrized
    weight, mixed dtypes or devices)."""
    w = next(iter(m._flat_weights), None)
    if not isinstance(w, torch.Tensor) or w.device.type != "cuda":
        return False
    try:
        return rnn.RNNLayout.for_module(m).source == "cudnn"
    except (TypeError, ValueError):
        return False


def _flatten_rnns(module) -> None:
    """On CUDA, pack the module's own RNN weights in the layout cuDNN wants (once; the
    Parameter objects are kept), so the replica on ``device_ids[0]``, which shares them,
    is as flat as the others. An RNN whose weights cannot be packed (tied, parametrized,
    of mixed dtypes or devices: what :func:`fastpar.rnn.flatten_parameters` refuses) is
    left as it is, as torch's ``RNNBase.flatten_parameters`` leaves it (its slower
    copying path). Of RNNs sharing a Parameter, only the first is packed: a Parameter
    sits in one buffer, so packing the next would move it out of the first's (which
    then repacked, and moved it back, on every forward), as :func:`fastpar.replicate`
    packs only the first in its replicas.

    Not on the CPU, where there is no cuDNN to feed: repacking rebinds the live weights
    (``set_``), which breaks a graph built through the module before, as torch's CPU
    modules are never repacked. Nor on CUDA where the layout is not cuDNN's (bf16, cuDNN
    disabled, ROCm: :func:`_feeds_cudnn`), for the same reason."""
    rnns, claimed = [], set()
    for m in module.modules():
        if isinstance(m, torch.nn.RNNBase) and _feeds_cudnn(m):
            # (From _parameters, as replicate reads them: getattr would run a
            # parametrization, e.g. spectral_norm's power iteration, in place.)
            weights = {id(w) for w in map(m._parameters.get, m._flat_weights_names) if w is not None}
            if claimed.isdisjoint(weights):
                rnns.append(m)
                claimed |= weights
    if not rnns or all(rnn.is_flat(m) for m in rnns):
        return
    with _FLATTEN_LOCK:
        for m in rnns:
            if rnn.is_flat(m):  # (packed by another thread's forward meanwhile)
                continue
            try:
                checked = rnn._flatten_checks(m)
            except (TypeError, ValueError, RuntimeError):
                continue
            rnn._flatten_checked(m, *checked)


def data_parallel(module, inputs, device_ids=None, output_device=None, dim=0, module_kwargs=None):
    r"""Evaluate ``module(input)`` in parallel across ``device_ids``: the functional form
    of :class:`DataParallel` (same arguments, as ``torch.nn.parallel.data_parallel``).

    Without CUDA, ``device_ids=None`` calls ``module`` as is (torch's raises
    "device type could not be determined"), and CUDA ids raise :class:`RuntimeError`."""
    if not isinstance(inputs, tuple):
        inputs = (inputs,) if inputs is not None else ()
    if device_ids is None:
        device_ids = _default_device_ids()
    else:
        device_ids = _checked_ids(device_ids)  # once: it may be a one-shot iterator
        if _cuda_ids_without_cuda(device_ids):
            # torch's data_parallel raises here too (it finds no device type).
            raise RuntimeError(
                f"device_ids={device_ids!r} name no CPU replica and CUDA is not available; "
                "pass device_ids=['cpu', 'cpu'] for replicas in host memory"
            )
    if device_ids is None:
        return module(*inputs, **(module_kwargs or {}))
    devs = comm._devices(device_ids, "device_ids")
    if output_device is None:
        output_device = devs[0]
    comm._warn_minus_one(output_device, stacklevel=2)
    output_device = comm._device(output_device, "output_device")
    src = devs[0]
    for t in chain(module.parameters(), module.buffers()):
        if t.device != src:
            raise RuntimeError(
                "module must have its parameters and buffers "
                f"on device {src} (device_ids[0]) but found one of "
                f"them on device: {t.device}"
            )
    inputs, module_kwargs = scatter_kwargs(inputs, module_kwargs, devs, dim)
    if not inputs and not module_kwargs:
        inputs = ((),)
        module_kwargs = ({},)
    if len(devs) == 1:
        return module(*inputs[0], **module_kwargs[0])
    _flatten_rnns(module)
    used = devs[: len(inputs)]
    replicas = replicate(module, used)
    outputs = parallel_apply(replicas, inputs, module_kwargs, used)
    return gather(outputs, output_device, dim)
