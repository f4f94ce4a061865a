"""``fastpar.replicate``: ``torch.nn.parallel.replicate`` on fastpar's kernels.

On every device but the first, a replica's parameters are views into one contiguous
buffer filled by one ``broadcast_coalesced`` (one flatten launch per dtype on the
source, one copy per device), except RNN weights: each RNN module of each replica gets
its own buffer in the cuDNN layout (:mod:`fastpar.rnn`), packed from the source weights
in one launch, so cuDNN takes it as is and never re-compacts. (A replica's weight is one
tensor in one buffer: an RNN that repeats one Parameter, or shares one with an RNN
listed before it, or whose weights mix dtypes, is not packed; its weights are copied
like any parameter.)

Replica buffers persist across calls, as DDP keeps its bucket buffers: once nothing
refers to a previous call's buffer any more (its replicas and their autograd graph are
gone), the next call refills it instead of allocating; a buffer still referenced is
never overwritten (a new one is allocated instead, and up to four are kept per device
and kind: what a step running the network several times before its backward holds).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
from torch.nn import Parameter
from torch.nn.parameter import UninitializedTensorMixin
from torch.nn.parallel.replicate import _replicatable_module

from . import _alloc, _dispatch, comm, rnn
from ._flatten import byte_layout, byte_views, pack_bytes
from ._functions import Broadcast
from ._plan import plan_for
from ._validate import QUANTIZED_DTYPES, check_not_quantized
from .kernels._launch import fork_safe_lock

__all__ = ["replicate"]


class _BufferPool:
    """Persistent per-device buffers, refilled only once nothing else refers to them.

    Up to ``per_key`` buffers are kept per key: a training step that runs the network
    twice before its backward (a discriminator on real and fake batches, two views,
    micro-batches summed) holds two sets of replicas at once, and each set finds its own
    buffer idle again at the next step. (With one buffer per key, the second forward
    replaced it every step: a fresh copy of the parameters per device, page faults
    included.) When all ``per_key`` are in use, the least recently handed out one is
    let go to keep the new one (freed once its replicas die).

    On CUDA, "nothing refers to it" says only that the host let go: the last call's
    replicas may still be read by kernels queued on the stream that was current when the
    buffer was handed out. Refilled on that same stream, the new writes queue behind
    them; handed out while another stream is current, that stream first waits for the
    old one (what ``record_stream`` arranges for the caching allocator's blocks). The
    buffer is also ``record_stream``-ed on each stream it is handed out on: once the slot
    lets it go (replaced while still referenced, or the pool dropped with its network),
    the caching allocator frees it into the pool of the stream it was allocated on, and
    must not hand it to work there while kernels of a later stream still read it."""

    def __init__(self, per_key: int = 4) -> None:
        #: key -> [[IdleBuffer, CUDA stream current when last handed out or None], ...],
        #: least recently handed out first
        self._slots: dict = {}
        self._lock = fork_safe_lock()
        self.per_key = per_key
        self.allocations = 0

    def get(self, key, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` on ``device``: one kept under ``key`` when
        nothing else refers to it (:class:`fastpar._alloc.IdleBuffer`), else a new one.

        Returned as a new tensor over it (``detach()``) made under the lock: it counts as a
        use at once, so two threads replicating the same module never get the same buffer."""
        with self._lock:
            entries = self._slots.setdefault(key, [])

            def fits(e) -> bool:
                return e[0].buf.numel() == nbytes and e[0].buf.device == device

            # Every view (a replica's parameter, a tensor saved for backward) holds a
            # reference to the storage: at the count it had when new, none is left.
            entry = next((e for e in entries if fits(e) and e[0].idle()), None)
            if entry is not None:
                entries.remove(entry)
            else:
                # Kept buffers of another size or device (the network changed), or resized
                # or shared (never idle again), can serve no later call: let them go.
                entries[:] = [e for e in entries if fits(e) and e[0].intact()]
                del entries[: max(0, len(entries) - self.per_key + 1)]
                # (stream None: a new block, the allocator orders its reuse)
                entry = [_alloc.IdleBuffer(_alloc.empty(nbytes, dtype=torch.uint8, device=device)), None]
                self.allocations += 1
            entries.append(entry)  # most recently handed out last
            buf = entry[0].buf
            if buf.is_cuda:
                current = torch.cuda.current_stream(buf.device)
                last = entry[1]
                if last is not None and last != current:
                    current.wait_stream(last)
                entry[1] = current
                buf.record_stream(current)  # (a no-op on the stream it was allocated on)
            return buf.detach()  # not a view: its ``_base`` would be the slot's own tensor


#: One pool per replicated network (dropped with it).
_POOLS: "weakref.WeakKeyDictionary[torch.nn.Module, _BufferPool]" = weakref.WeakKeyDictionary()


class _Placement:
    """Lays out the copies of one tensor list on every device (used by Broadcast)."""

    def __init__(self, devices, pool: _BufferPool, tag: str, rnn_groups=()):
        self.devices = devices
        self.pool = pool
        self.tag = tag
        #: [(rnn module, [positions of its _flat_weights in the tensor list])]
        self.rnn_groups = rnn_groups

    def place(self, tensors) -> list[list[torch.Tensor]]:
        """``result[0]`` is ``tensors`` itself; ``result[j]`` their copies on device j."""
        tensors = list(tensors)
        result = [tensors]
        if len(self.devices) == 1:
            return result
        rnn_positions = {i for _, pos in self.rnn_groups for i in pos}
        # Sparse COO tensors are copied on their own, as torch's broadcast_coalesced does.
        sparse = [i for i, t in enumerate(tensors) if t.layout == torch.sparse_coo and i not in rnn_positions]
        special = rnn_positions.union(sparse)
        rest = [i for i in range(len(tensors)) if i not in special]
        rest_copies = self._broadcast([tensors[i] for i in rest])
        rnn_copies = [self._pack_rnn(k, m, [tensors[i] for i in pos]) for k, (m, pos) in enumerate(self.rnn_groups)]
        for j, d in enumerate(self.devices[1:], 1):
            copies = [None] * len(tensors)
            for i, c in zip(rest, rest_copies[j - 1]):
                copies[i] = c
            for i in sparse:
                copies[i] = comm.sparse_copy(tensors[i], d)
            for (_, pos), per_replica in zip(self.rnn_groups, rnn_copies):
                for i, v in zip(pos, per_replica[j - 1]):
                    copies[i] = v
            result.append(copies)
        return result

    def _broadcast(self, tensors) -> list[list[torch.Tensor]]:
        """Flatten once on the source, one copy into each device's persistent buffer."""
        if not tensors:
            return [[] for _ in self.devices[1:]]
        plan = plan_for(tensors, "tensors")
        layout, nbytes = byte_layout(plan)
        src_dev = self.devices[0]
        if src_dev.type == "cpu":
            # Host replicas: flatten straight into each replica's buffer (no staging),
            # one launch writing every buffer, each source read once.
            bufs = [self.pool.get((self.tag, j), nbytes, d) for j, d in enumerate(self.devices[1:], 1)]
            pack_bytes(plan, bufs, layout)
        else:
            staging = self.pool.get((self.tag, 0), nbytes, src_dev)
            pack_bytes(plan, staging, layout)
            bufs = []
            for j, d in enumerate(self.devices[1:], 1):
                b = self.pool.get((self.tag, j), nbytes, d)
                b.copy_(staging, non_blocking=True)
                bufs.append(b)
        return [byte_views(b, plan, layout) for b in bufs]

    def _pack_rnn(self, k: int, module, weights) -> list[list[torch.Tensor]]:
        """For each replica ``j >= 1``, its weights of RNN ``module`` (the network's
        ``k``-th packed RNN): views of a buffer in the layout cuDNN wants on its device.
        Replicas on the weights' own device (host replicas) are packed together in one
        launch; each other device gets one launch packing on the source in its layout,
        then one copy.

        The buffers are kept under ``k``, not the module: a network whose RNN is replaced
        (a new module each time, the old ones kept) would otherwise add slots for good."""
        src = weights[0].device
        local, result = [], []
        for j, device in enumerate(self.devices[1:], 1):
            layout = rnn.RNNLayout.for_module(module, device=device)
            buf = self.pool.get((self.tag, "rnn", k, j), layout.numel * layout.dtype.itemsize, device)
            flat = buf.view(layout.dtype)
            if device == src:
                local.append(flat)
                local_layout = layout
            else:
                # Pack on the source in the destination's layout, then one copy.
                src_layout = rnn.RNNLayout(**{**_layout_fields(layout), "device": src})
                staging = self.pool.get((self.tag, "rnn", k, 0), buf.numel(), src)
                rnn.pack(weights, src_layout, out=staging.view(layout.dtype))
                buf.copy_(staging, non_blocking=True)
                # Idle again for the next device's pack (which queues behind this copy on
                # the source's stream): held here, the pool found it in use and allocated a
                # new staging buffer for every device after the first, every call.
                del staging
            result.append(layout.views(flat))
        if local:
            rnn._pack(weights, local_layout, local[0], True, local[1:], bind=False)
        return result


def _layout_fields(layout) -> dict:
    return {f: getattr(layout, f) for f in (
        "mode", "input_size", "hidden_size", "num_layers", "bidirectional", "bias", "proj_size",
        "dtype", "device", "names", "shapes", "offsets", "numel", "source")}


def _members(modules, kind: str) -> list:
    """``network.parameters()`` (``kind="_parameters"``) or ``network.buffers()``
    (``"_buffers"``) from the list of ``network.modules()``: the same tensors in the same
    order, each once, without another walk of the module tree."""
    seen, out = set(), []
    for m in modules:
        # Through the attribute where the instance dict lacks it (a torch.jit.trace'd
        # module serves ``_parameters`` from C++ through ``__getattr__``).
        members = m.__dict__[kind] if kind in m.__dict__ else getattr(m, kind)
        for t in members.values():
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def _plain_members(network) -> bool:
    """True if ``network``'s class lists its modules, parameters and buffers as
    ``torch.nn.Module`` does (so :func:`_members` gives what torch's replicate sees)."""
    cls, base = type(network), torch.nn.Module
    return all(getattr(cls, name) is getattr(base, name) for name in (
        "modules", "named_modules", "parameters", "named_parameters", "buffers", "named_buffers", "_named_members"))


def _member_name(network, t) -> str:
    """The qualified name of parameter or buffer ``t`` (for error messages)."""
    return next((n for n, x in (*network.named_parameters(), *network.named_buffers()) if x is t), "?")


def _rnn_groups(modules, tensors):
    """RNN modules whose weights are all among ``tensors``, with their positions: the
    ones a replica can hold packed. A replica's weight is one tensor, so it sits in one
    buffer: an RNN whose weights repeat one Parameter, or that shares one with an RNN
    listed before it, is left out (its weights are copied like any parameter)."""
    index = {id(t): i for i, t in enumerate(tensors)}
    groups, claimed = [], set()
    for m in modules:
        if isinstance(m, torch.nn.RNNBase):
            # From ``_parameters``, as torch's replicate reads them: ``getattr`` would
            # evaluate a parametrized weight (spectral_norm's power iteration updates its
            # buffers in place); such a weight is not a parameter of ``m`` anyway.
            weights = [m._parameters.get(n) for n in m._flat_weights_names]
            if weights and all(w is not None and id(w) in index for w in weights) \
                    and len({w.dtype for w in weights}) == 1:
                pos = [index[id(w)] for w in weights]
                if len(set(pos)) == len(pos) and claimed.isdisjoint(pos):
                    groups.append((m, pos))
                    claimed.update(pos)
    return groups


def _broadcast(tensors, placement: _Placement, detach: bool):
    if not tensors:
        return [[] for _ in placement.devices]
    if detach:
        return placement.place(tensors)
    copies = Broadcast.apply(placement, *tensors)
    n = len(tensors)
    return [list(copies[i : i + n]) for i in range(0, len(copies), n)]


def replicate(network, devices, detach=False):
    r"""Replicate ``network`` on ``devices``, as ``torch.nn.parallel.replicate`` does.

    Args:
        network (Module): the module to replicate; its parameters and buffers live on
            ``devices[0]``.
        devices (sequence of int, str or torch.device): CUDA devices, or ``"cpu"``
            entries for replicas in host memory (repeats allowed).
        detach (bool): if True, the copies are not connected to ``network``'s parameters
            by autograd (what ``DataParallel`` does under ``torch.no_grad()``).

    Returns:
        list of Module: one replica per device; the first shares ``network``'s storage.

    Gradients of the replicas' parameters flow back into ``network``'s through one fused
    reduce-add launch per dtype (Broadcast's backward).
    """
    if torch.compiler.is_dynamo_compiling():
        # Traced under aot_eager with dynamic shapes, the replicas' byte views failed in
        # torch's alias replay ("self.size(-1) must be divisible by 4 to view Byte as
        # Float"); replicas are modules, not a graph: the whole call runs eagerly.
        return _replicate_eagerly(network, devices, detach)
    modules = list(network.modules())  # one walk of the tree serves every step below
    if any(isinstance(m, torch.jit.ScriptModule) for m in modules) and not _replicatable_module(network):
        raise RuntimeError("Cannot replicate network where python modules are children of ScriptModule")
    if not devices:
        return []
    devs = comm._devices(devices, "devices")
    num_replicas = len(devs)
    if _plain_members(network):
        params = _members(modules, "_parameters")
        buffers = _members(modules, "_buffers")
    else:  # the class changes how its tensors are listed: ask it, as torch does
        params, buffers = list(network.parameters()), list(network.buffers())
    for kind, tensors in (("parameter", params), ("buffer", buffers)):
        for t in tensors:
            if isinstance(t, UninitializedTensorMixin):
                # A lazy module's before its first forward: no shape to copy (its numel
                # raised from deep inside the flatten), and a replica's copy could never
                # be materialized into the original. DDP refuses these too.
                raise RuntimeError(
                    f"replicate: network's {kind} {_member_name(network, t)!r} is uninitialized "
                    f"({type(t).__name__}, from a lazy module such as nn.LazyLinear); run one forward "
                    "pass of the module itself (on devices[0]) to initialize it before replicating it"
                )
            if t.device != devs[0]:
                name = _member_name(network, t)
                raise RuntimeError(
                    f"replicate: network's {kind} {name!r} is on {t.device}, but every parameter and "
                    f"buffer must be on devices[0] ({devs[0]})"
                )
            if t.dtype in QUANTIZED_DTYPES and num_replicas > 1:
                # Its copies would be its integers without its quantizer (scale, zero
                # point): tensors that report is_quantized False and cannot be used.
                check_not_quantized(t.dtype, f"replicate: network's {kind} {_member_name(network, t)!r}")
    pool = _POOLS.get(network)
    if pool is None:
        pool = _POOLS[network] = _BufferPool()

    # Keyed on id(): a Tensor's __hash__ is a Python call (id(self)), ~1,000 per call.
    param_indices = {id(p): i for i, p in enumerate(params)}
    rnn_groups = _rnn_groups(modules, params)
    param_copies = _broadcast(params, _Placement(devs, pool, "params", rnn_groups), detach)

    buffers_rg = [b for b in buffers if b.requires_grad and not detach]
    buffers_not_rg = [b for b in buffers if not (b.requires_grad and not detach)]
    idx_rg = {id(b): i for i, b in enumerate(buffers_rg)}
    idx_not_rg = {id(b): i for i, b in enumerate(buffers_not_rg)}
    copies_rg = _broadcast(buffers_rg, _Placement(devs, pool, "buffers_rg"), detach)
    # Under detach the buffers requiring grad join the others: a list of another size
    # than a differentiable call's, so it gets a slot of its own (in one slot, a training
    # loop with no_grad forwards between its steps reallocated it at every switch).
    tag = "buffers_detached" if detach and any(b.requires_grad for b in buffers) else "buffers"
    copies_not_rg = _broadcast(buffers_not_rg, _Placement(devs, pool, tag), True)

    module_copies = [[] for _ in devs]
    module_indices = {}
    for i, module in enumerate(modules):
        module_indices[module] = i
        plain = _plain_replication(module)
        for j in range(num_replicas):
            if plain:
                # Module._replicate_for_data_parallel, without a Module.__setattr__ per field.
                replica = module.__new__(type(module))
                d = module.__dict__.copy()
                d["_parameters"] = {}
                d["_buffers"] = d["_buffers"].copy()
                d["_modules"] = d["_modules"].copy()
                d["_is_replica"] = True
                d["_former_parameters"] = OrderedDict()
                object.__setattr__(replica, "__dict__", d)
            else:
                replica = module._replicate_for_data_parallel()
                replica._former_parameters = OrderedDict()
                # A class's own copy may come with the source's Parameters registered
                # (fx's GraphModule: __copy__ rebuilds its root's): every one is set again
                # below, where a copy that is not a Parameter would sit beside the stale
                # entry (parameters() gave the source's, forward the copy; torch's
                # setattr raises). Replicas hold no parameters of their own, as torch's.
                # (A ScriptModule's is a view of its C++ module's, which C++ made.)
                params = replica._parameters
                if type(params) is dict and params:
                    for key in module._parameters:
                        params.pop(key, None)
            module_copies[j].append(replica)

    hooks_free = _no_registration_hooks()
    for i, module in enumerate(modules):
        # What Module.__setattr__ ends up doing, done directly where the replica's class
        # does not customise it (thousands of calls per replicate otherwise dominate it).
        fast = hooks_free and _plain_setattr(module)
        for key, child in module._modules.items():
            for j in range(num_replicas):
                replica = module_copies[j][i]
                if child is None:
                    replica._modules[key] = None
                elif fast:
                    replica._modules[key] = module_copies[j][module_indices[child]]
                else:
                    setattr(replica, key, module_copies[j][module_indices[child]])
        for key, param in module._parameters.items():
            for j in range(num_replicas):
                replica = module_copies[j][i]
                if param is None:
                    replica._parameters[key] = None
                else:
                    copy = param_copies[j][param_indices[id(param)]]
                    if fast:
                        # What Module.__setattr__ makes of it: a Parameter (replica 0's
                        # under detach=True is the source's own, as torch's broadcast
                        # returns device 0's inputs) is registered, anything else is a
                        # plain attribute. A copy fastpar made (every other one) is a new
                        # plain Tensor, never a Parameter: Parameter's isinstance, a
                        # Python-level __instancecheck__, is asked only of the others.
                        made = (j > 0 or not detach) and type(copy) is torch.Tensor
                        if not made and isinstance(copy, Parameter):
                            replica._parameters[key] = copy
                        else:
                            replica.__dict__[key] = copy
                    else:
                        setattr(replica, key, copy)
                    replica._former_parameters[key] = copy
        for key, buf in module._buffers.items():
            for j in range(num_replicas):
                replica = module_copies[j][i]
                if buf is None:
                    replica._buffers[key] = None
                    continue
                copy = copies_rg[j][idx_rg[id(buf)]] if buf.requires_grad and not detach else copies_not_rg[j][idx_not_rg[id(buf)]]
                if fast:  # register_buffer with the original's persistence: unchanged
                    replica._buffers[key] = copy
                else:
                    setattr(replica, key, copy)
    for m, _ in rnn_groups:
        # Replicas 1.. have their weights packed where cuDNN wants them; replica 0's are
        # ``m``'s own (as aliases made by Broadcast), packed if ``m`` is (DataParallel
        # packs it once). A replica's ``_flat_weight_refs``, copied from ``m``, point at
        # ``m``'s weight objects, so ``RNNBase.forward`` would find the weights
        # "changed" and re-run ``flatten_parameters()``, which on CUDA copies every
        # weight into a fresh buffer, every step: point them at the replica's own.
        for j in range(num_replicas):
            replica = module_copies[j][module_indices[m]]
            if j > 0 or rnn.is_flat(replica):
                replica._flat_weight_refs = [None if w is None else weakref.ref(w) for w in replica._flat_weights]
    return [module_copies[j][0] for j in range(num_replicas)]


def _plain_replication(module) -> bool:
    cls = type(module)
    return cls._replicate_for_data_parallel is torch.nn.Module._replicate_for_data_parallel and _plain_setattr(module)


def _plain_setattr(module) -> bool:
    cls = type(module)
    return cls.__setattr__ is torch.nn.Module.__setattr__ and cls.register_buffer is torch.nn.Module.register_buffer


def _no_registration_hooks() -> bool:
    m = torch.nn.modules.module
    return not any(getattr(m, name, None) for name in (
        "_global_module_registration_hooks", "_global_parameter_registration_hooks",
        "_global_buffer_registration_hooks"))


_replicate_eagerly = _dispatch.eager_entry(replicate)  # (see the start of replicate)
