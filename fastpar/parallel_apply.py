"""Run replicas side by side, one thread each, as ``torch.nn.parallel.parallel_apply``
does, for CUDA devices and for ``"cpu"`` replicas in host memory."""
from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Mapping

import torch
from torch._utils import ExceptionWrapper
from torch.nn.parallel.parallel_apply import get_a_var

from . import _dispatch, comm

__all__ = ["parallel_apply"]


def parallel_apply(modules, inputs, kwargs_tup=None, devices=None):
    r"""Apply each module to its inputs in parallel threads.

    Args:
        modules (sequence of Module): the replicas.
        inputs (sequence): one positional-argument tuple (or single argument) per module.
        kwargs_tup (sequence of dict, optional): keyword arguments per module.
        devices (sequence, optional): the device of each module (CUDA or ``"cpu"``; a
            None entry, or no sequence, means the device of its first tensor input, or
            with none the current CUDA device; without CUDA that is a ``ValueError``).
            torch's ``parallel_apply`` resolves every None entry to the current CUDA
            device up front, whatever device the inputs are on.

    Returns:
        list: each module's output, in order. An exception raised in any replica is
        re-raised here, naming the replica and its device, after every thread has
        finished (no thread is left behind); a replica thread's ``SystemExit`` or
        ``KeyboardInterrupt`` too (torch's then fails with a bare ``KeyError``).

    Each thread runs in the caller's grad mode, inference mode, autocast state and
    context variables (torch's ``parallel_apply`` carries grad mode and autocast only).
    """
    if torch.compiler.is_dynamo_compiling():
        # Traced, dynamo warned at the thread machinery (_thread.allocate_lock, get_ident,
        # copy_context) and built no graph: the threads run eagerly, one graph break.
        return _parallel_apply_eagerly(modules, inputs, kwargs_tup, devices)
    if len(modules) != len(inputs):
        raise ValueError(f"modules and inputs must have the same length, got {len(modules)} and {len(inputs)}")
    if kwargs_tup is None:
        kwargs_tup = ({},) * len(modules)
    elif isinstance(kwargs_tup, Mapping):
        # One module's keyword arguments passed for all: its keys would be taken as the
        # per-module entries (torch's fails with a bare KeyError: 0, or in the replicas).
        raise TypeError(
            f"kwargs_tup must be a sequence of dicts, one per module, got a {type(kwargs_tup).__name__} "
            f"(keys {list(kwargs_tup)[:4]!r}); pass ({{...}},) * {len(modules)} for the same keywords everywhere"
        )
    elif len(kwargs_tup) != len(modules):
        raise ValueError(f"kwargs_tup must have one entry per module ({len(modules)}), got {len(kwargs_tup)}")
    else:
        for i, k in enumerate(kwargs_tup):
            if not hasattr(k, "keys"):  # (what ``**k`` takes: anything with keys(), as in torch)
                raise TypeError(f"kwargs_tup[{i}] must be a dict of keyword arguments, got {type(k).__name__}")
    devices = [None] * len(modules) if devices is None else list(devices)
    if len(devices) != len(modules):
        raise ValueError(f"devices must have one entry per module ({len(modules)}), got {len(devices)}")
    # A None entry (as torch allows) is the device of that replica's first tensor input,
    # what torch's worker looks for (get_a_var). torch resolves every None entry first,
    # with _get_device_index(None, True), to the current CUDA device: with no tensor
    # input, so do we. Without CUDA there is no current device to take (and torch's
    # parallel_apply refuses to run at all).
    for i, (d, x) in enumerate(zip(devices, inputs)):
        if d is None:
            t = get_a_var(x)
            if t is None:
                if torch.cuda.is_available():
                    devices[i] = torch.device("cuda", torch.cuda.current_device())
                    continue
                raise ValueError(
                    f"devices[{i}] is None and inputs[{i}] holds no tensor: the device of replica {i} "
                    "cannot be resolved; pass it in devices"
                )
            # (Checked as an explicit entry is: a meta or other tensor's device has no
            # place to run a replica, and would fail in the worker thread.)
            devices[i] = comm._device(t.device, f"devices[{i}] (the device of inputs[{i}])")
        else:
            devices[i] = comm._device(d, f"devices[{i}]")
    streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in devices]
    lock = threading.Lock()
    results = {}
    # Grad mode, inference mode, autocast and context variables (fastpar.use_backend) are
    # thread-local: carry the caller's into each thread. (torch's parallel_apply does not
    # carry inference mode: a replica's buffers made under it are inference tensors, and
    # a train-mode BatchNorm's in-place update of them is then refused in the worker.)
    grad_enabled = torch.is_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    autocast = {t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in ("cuda", "cpu")}

    def _worker(i, module, input, kwargs, device, stream):
        enabled, dtype = autocast[device.type]
        try:
            # (Only entered when on: inference_mode(False) turns grad mode on.)
            mode = torch.inference_mode() if inference else contextlib.nullcontext()
            with mode, torch.autocast(device.type, enabled=enabled, dtype=dtype):
                # Inside the mode, which turns grad mode off: enable_grad() within
                # inference_mode() keeps grad mode on, as in the caller's thread.
                torch.set_grad_enabled(grad_enabled)
                if device.type == "cuda":
                    with torch.cuda.device(device), torch.cuda.stream(stream):
                        output = module(*_as_tuple(input), **kwargs)
                else:
                    output = module(*_as_tuple(input), **kwargs)
            with lock:
                results[i] = output
        except BaseException as e:
            # A SystemExit or KeyboardInterrupt raised by a replica propagates as it is in
            # the caller's own thread; in a replica's thread it would end only that thread,
            # quietly (SystemExit prints nothing), and the caller met a bare KeyError for
            # the missing result (as torch's does): wrapped and re-raised here instead.
            if not (threaded or isinstance(e, Exception)):
                raise
            with lock:
                results[i] = ExceptionWrapper(where=_where(i, device))

    threaded = len(modules) > 1
    if threaded:
        threads = [
            threading.Thread(target=contextvars.copy_context().run, args=(_worker, i, m, x, k, d, s),
                             name=f"fastpar-replica-{i}")
            for i, (m, x, k, d, s) in enumerate(zip(modules, inputs, kwargs_tup, devices, streams))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        _worker(0, modules[0], inputs[0], kwargs_tup[0], devices[0], streams[0])

    outputs = []
    for i in range(len(inputs)):
        output = results[i]
        if isinstance(output, ExceptionWrapper):
            output.reraise()
        outputs.append(output)
    return outputs


def _as_tuple(x):
    return x if isinstance(x, (list, tuple)) else (x,)


def _where(i: int, device: torch.device) -> str:
    """Where replica ``i`` failed, in torch's words: a CUDA device by its index ("in
    replica 1 on device 0"), a host replica "on device cpu"."""
    return f"in replica {i} on device {device.index if device.type == 'cuda' else device}"


_parallel_apply_eagerly = _dispatch.eager_entry(parallel_apply)  # (see the start of parallel_apply)
