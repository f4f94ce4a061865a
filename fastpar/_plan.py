"""Pointer plans: what one multi-tensor launch needs to know about a list of tensors.

A :class:`Plan` describes a list of same-device tensors laid end to end in one flat
buffer: each tensor's address, numel and element offset, grouped by dtype (a Triton
pointer type is a compile-time constant, so each dtype group is one launch). Each
:class:`Group` builds, on demand and once per block size, the Numba kernels' chunk map
(``chunk_map``: an entry per program) or the Triton kernels' ``block_begin`` (an entry
per tensor) and, on CUDA, one device copy of its tables.

Plans are built with ``map`` over C-level getters and vectorised numpy, never a Python
loop per tensor, and are cached on the identity of the tensor objects: a training loop
that flattens the same parameters every step builds nothing after the first step. Every
cache hit re-checks each tensor's data pointer, dtype, sizes and strides (in compiled
code, see ``_fastcheck``), so a tensor whose storage was replaced (``.data =``, ``set_``,
``resize_``) or whose shape changed in place (``t_()``, ``as_strided_()``) gets a fresh
plan, never a stale address or layout.
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import operator
import sys
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from . import _env
from ._fastcheck import metadata_snapshot, same_tensors
from ._validate import no_memory_error
from .kernels._launch import fork_safe_lock

_T = torch.Tensor
_get_device = operator.attrgetter("device")
_get_dtype = operator.attrgetter("dtype")
_get_layout = operator.attrgetter("layout")

#: Bytes of alignment that lets Triton emit 128-bit vector loads and stores.
VECTOR_BYTES = 16


def _first_index(values, pred) -> int:
    return next(i for i, v in enumerate(values) if pred(v))


def check_tensor_list(tensors, name: str) -> tuple:
    """Validate a non-empty list of dense, same-device tensors; return it as a tuple.

    Raises ``TypeError`` for a non-sequence, a non-tensor item or a sparse tensor, and
    ``ValueError`` for an empty list or tensors on different devices. Messages name the
    argument and the offending position.
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(
            f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}"
        )
    tup = tuple(tensors)
    if not tup:
        raise ValueError(f"{name} must contain at least one tensor, got an empty {type(tensors).__name__}")
    if not all(map(isinstance, tup, (torch.Tensor,) * len(tup))):
        i = _first_index(tup, lambda t: not isinstance(t, torch.Tensor))
        raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(tup[i]).__name__}")
    layouts = set(map(_get_layout, tup))
    if layouts != {torch.strided}:
        i = _first_index(tup, lambda t: t.layout != torch.strided)
        raise TypeError(
            f"{name}[{i}] has layout {tup[i].layout}; expected dense tensors (torch.strided). "
            "Sparse tensors are not supported: densify them explicitly if that is what you want."
        )
    if any(map(operator.attrgetter("is_nested"), tup)):
        i = _first_index(tup, lambda t: t.is_nested)
        raise TypeError(f"{name}[{i}] is a nested tensor; fastpar takes dense tensors (torch.strided)")
    devices = set(map(_get_device, tup))
    if len(devices) > 1:
        d0 = tup[0].device
        i = _first_index(tup, lambda t: t.device != d0)
        raise ValueError(
            f"{name} must all be on one device: {name}[0] is on {d0} but {name}[{i}] is on {tup[i].device}"
        )
    return tup


def _check_block(block) -> None:
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        # A zero block would map no program at all: a launch that writes nothing.
        raise ValueError(f"block (elements per program, e.g. a tuned chunk) must be a positive int, got {block!r}")


def chunk_map(numels: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """For ``block`` elements per program: the tensor (int32 position) each program
    works on and the element it starts at (int64), tensors in order. (The Numba
    kernels' map: one entry per program. The Triton kernels take ``block_begin``.)"""
    begin, total = block_begin(numels, block)
    nblk = np.diff(begin, append=total)
    tensor = np.repeat(np.arange(len(nblk), dtype=np.int32), nblk)
    start = (np.arange(total, dtype=np.int64) - np.repeat(begin, nblk)) * block
    return tensor, start


def block_begin(numels: np.ndarray, block: int) -> tuple[np.ndarray, int]:
    """For ``block`` elements per program, tensors in order: each tensor's first program
    (int64, non-decreasing; an empty tensor shares the next one's) and the number of
    programs. The Triton kernels' tables hold this, one entry per tensor, and each
    program finds its tensor by searching it (``find_tensor``): a table of one entry per
    program (``chunk_map``) is what a list made anew each call paid for on the host,
    about 350 KB for a Transformer's 184 tensors at 2048 elements per program."""
    _check_block(block)
    nblk = (numels + block - 1) // block
    ends = np.cumsum(nblk)
    return ends - nblk, (int(ends[-1]) if len(ends) else 0)


class _Numel:
    """``numel``: the sum of ``numels``, taken once (they never change, and a launch
    asks several times: summing 10,000 numels costs ~8 us each time). And the per-block
    maps of ``numels``, made once per block size (``_blocks``)."""

    @property
    def numel(self) -> int:
        hit = self.__dict__.get("_numel")
        if hit is None:
            hit = self.__dict__["_numel"] = int(self.numels.sum())
        return hit

    def blocks(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """The chunk map for ``block`` elements per program (``chunk_map``): for each
        program, which tensor it works on (int32 position in this group) and where in
        it it starts."""
        hit = self._blocks.get(block)
        if hit is None:
            hit = self._blocks[block] = chunk_map(self.numels, block)
        return hit

    def block_begin(self, block: int) -> tuple[np.ndarray, int]:
        """``(first program of each tensor, programs)`` for ``block`` elements per
        program (``block_begin``)."""
        key = ("begin", block)
        hit = self._blocks.get(key)
        if hit is None:
            hit = self._blocks[key] = block_begin(self.numels, block)
        return hit


def _upload(host: torch.Tensor, device: torch.device, keep: bool) -> tuple:
    """``(table, event)``: the int64 ``host`` table on ``device``. On CUDA it goes through
    pinned memory, asynchronously on the current stream (see ``Group.device_table``), and
    ``event`` (recorded only if the table is ``keep``-t for later launches) marks that
    copy; else None."""
    if device.type != "cuda":
        return host.to(device), None
    table = host.pin_memory().to(device, non_blocking=True)
    event = None
    if keep:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
    return table, event


def _wait_for_copy(entry: list, slot: int, device: torch.device) -> None:
    """Before a kept table is read again: make the current stream wait for the copy
    whose event is ``entry[slot]`` (on the device; the host does not wait), or, once
    that copy has run, drop the event (no later launch needs to wait)."""
    event = entry[slot]
    if event is not None:
        if event.query():
            entry[slot] = None
        else:
            torch.cuda.current_stream(device).wait_event(event)


@dataclass(eq=False)
class Group(_Numel):
    """The tensors of one dtype within a plan: everything one launch needs."""

    dtype: torch.dtype
    device: torch.device
    #: Positions of these tensors in the plan's list.
    index: np.ndarray
    #: The tensors themselves (the torch backend and staging use them).
    tensors: tuple
    #: Address of each tensor's first element (int64; 2-D ``[K, N]`` for K-source ops).
    addrs: np.ndarray
    #: Elements in each tensor (int64).
    numels: np.ndarray
    #: Element offset of each tensor in the flat buffer (int64).
    offsets: np.ndarray
    _blocks: dict = field(default_factory=dict, repr=False)
    #: ``(block, device) -> [table, event]``: the event (CUDA, cached plans) is that of
    #: the table's copy, None once it has completed. One entry, so that threads missing
    #: the same key at once never pair one's table with the other's event. When this
    #: group is an ``out=`` of ``reduce_add_coalesced``, also ``("reduce", block,
    #: device) -> [src_addrs, dst_addrs, numels, table, event]`` (``ReduceGroup.device_table``).
    _tables: dict = field(default_factory=dict, repr=False)
    #: Made for one call (an uncached plan, staged temporaries): see ``device_table``.
    transient: bool = False

    @property
    def local_offsets(self) -> np.ndarray:
        """Element offsets within a buffer of this group alone (``offsets`` count every
        tensor of the plan, other dtypes included)."""
        hit = self._blocks.get("local")
        if hit is None:
            hit = np.zeros_like(self.numels)
            np.cumsum(self.numels[:-1], out=hit[1:])
            self._blocks["local"] = hit
        return hit

    def local(self) -> "Group":
        """This group over a buffer of its own (offsets from 0), sharing its caches' inputs."""
        if len(self.offsets) == 0 or (self.offsets == self.local_offsets).all():
            return self
        hit = self._blocks.get("local_group")
        if hit is None:
            hit = self._blocks["local_group"] = Group(
                self.dtype, self.device, self.index, self.tensors, self.addrs, self.numels, self.local_offsets,
                transient=self.transient,
            )
        return hit

    def as_words(self) -> "Group":
        """This group's bytes as 8-byte words (``int64``, twice the elements): how a raw
        copy moves 16-byte elements (complex128), which no Triton type holds. The
        tensors must be contiguous (a staged group's are; their strides may still be
        anything where a size is 0 or 1, hence ``as_strided``)."""
        hit = self._blocks.get("words")
        if hit is None:
            words = tuple(t.as_strided((t.numel(),), (1,)).view(torch.int64) for t in self.tensors)
            hit = self._blocks["words"] = Group(
                torch.int64, self.device, self.index, words, self.addrs, self.numels * 2, self.offsets * 2,
                transient=self.transient,
            )
        return hit

    def aligned(self, elem_align: int) -> bool:
        """True when every address is 16-byte aligned and every numel and offset is a
        multiple of ``elem_align`` elements, so whole vectors never straddle tensors."""
        key = ("aligned", elem_align)
        hit = self._blocks.get(key)
        if hit is None:
            hit = bool(
                (self.addrs % VECTOR_BYTES == 0).all()
                and (self.numels % elem_align == 0).all()
                and (self.offsets % elem_align == 0).all()
            )
            self._blocks[key] = hit
        return hit

    def device_table(self, block: int, device: torch.device) -> torch.Tensor:
        """One int64 tensor on ``device`` holding ``addrs | numels | offsets |
        block_begin`` (4N entries, whatever the number of programs), copied to the
        device once per plan and block.

        On CUDA the table goes through pinned memory asynchronously, on the current
        stream (where the launch that asked for it runs), as ``ReduceGroup.device_table``'s
        does: a blocking copy from pageable memory would make the host wait for
        everything queued on the stream (a whole backward), once per list the cache has
        not seen, which is every call for lists made anew each step (``.grad`` after
        ``zero_grad(set_to_none=True)``). torch's caching host allocator keeps the pinned
        block until the copy has run. A cached plan's later launches may run on other
        streams: until the copy's event has completed, each makes its stream wait for it
        (on the device; the host does not wait)."""
        key = (block, device)
        hit = self._tables.get(key)
        if hit is None:
            host = torch.from_numpy(np.concatenate(
                [self.addrs.reshape(-1), self.numels, self.offsets, self.block_begin(block)[0]]
            ))
            # (A transient table serves this call alone: no event.)
            table, event = _upload(host, device, keep=not self.transient)
            self._tables[key] = [table, event]
            return table
        _wait_for_copy(hit, 1, device)
        return hit[0]

    def with_tensors(self, tensors: tuple) -> "Group":
        """A copy over other tensors of the same shapes and dtype (fresh tables), e.g.
        the contiguous temporaries that stand in for non-contiguous ones."""
        addrs = np.fromiter(map(_T.data_ptr, tensors), np.int64, len(tensors))
        return Group(self.dtype, self.device, self.index, tensors, addrs, self.numels, self.offsets, transient=True)


@dataclass(eq=False)
class Plan(_Numel):
    """A list of same-device tensors laid end to end in one flat buffer."""

    tensors: tuple
    device: torch.device
    dtypes: list
    numels: np.ndarray
    offsets: np.ndarray
    ptrs: list
    #: Positions of non-contiguous tensors (they are staged through contiguous copies).
    noncontig: np.ndarray
    groups: list
    #: Byte range [lo, hi) spanned by each tensor's elements (for overlap checks).
    spans: np.ndarray
    #: ``id`` of each tensor and its data pointer, as int64 arrays (for the fast check).
    ids: np.ndarray
    ptrs_arr: np.ndarray
    #: Each tensor's TensorImpl address (``Tensor._cdata``), int64.
    impls: np.ndarray
    #: References to ``tensors[0]`` held by the plan itself.
    internal_refs: int = 1
    #: Metadata snapshot for the compiled re-check, or else a C++ guard (``_fastcheck``).
    meta: object = None
    guard: object = None

    @property
    def reusable(self) -> bool:
        """Whether a later call can find this plan again: it has a re-check snapshot
        (``meta`` or ``guard``). Not a plan made for one call (``plan_for(...,
        cache=False)``, transient tensors), nor one whose tensors no check can snapshot."""
        return self.meta is not None or self.guard is not None

    @property
    def shapes(self) -> tuple:
        """Each tensor's shape (made once per plan: a torch.Size costs ~1 us)."""
        hit = self.__dict__.get("_shapes")
        if hit is None:
            hit = self.__dict__["_shapes"] = tuple(t.shape for t in self.tensors)
        return hit

    def _sorted_spans(self):
        hit = self.__dict__.get("_sorted")
        if hit is None:
            order = np.argsort(self.spans[:, 0], kind="stable")
            lo = self.spans[order, 0]
            hi_max = np.maximum.accumulate(self.spans[order, 1])
            hit = self.__dict__["_sorted"] = (lo, hi_max, order)
        return hit

    def overlap_with(self, other: "Plan") -> tuple[int, int] | None:
        """``(i, j)`` such that ``self.tensors[i]`` overlaps ``other.tensors[j]`` in memory,
        or None. Vectorised (sort + search, no loop over pairs), and remembered per pair of
        plans (plans are immutable while cached)."""
        memo = self.__dict__.setdefault("_overlap_memo", weakref.WeakKeyDictionary())
        if other in memo:
            return memo[other]
        result = None
        if self.device == other.device and len(self.spans) and len(other.spans):
            lo, hi_max, order = other._sorted_spans()
            mine = self.spans[self.spans[:, 1] > self.spans[:, 0]]  # empty tensors overlap nothing
            keep = np.nonzero(self.spans[:, 1] > self.spans[:, 0])[0]
            # For each of my intervals: the largest end among other's intervals starting
            # before my end. They overlap iff that end lies past my start.
            idx = np.searchsorted(lo, mine[:, 1], side="left") - 1
            hit = (idx >= 0) & (hi_max[np.maximum(idx, 0)] > mine[:, 0])
            if hit.any():
                i = int(keep[np.argmax(hit)])
                j = other.overlaps(self.tensors[i])
                result = (i, j)
        memo[other] = result
        return result

    @property
    def has_inference(self) -> bool:
        """Whether any tensor is an inference tensor (fixed per TensorImpl)."""
        hit = self.__dict__.get("_has_inference")
        if hit is None:
            hit = self.__dict__["_has_inference"] = any(t.is_inference() for t in self.tensors)
        return hit

    @property
    def first_requiring_grad(self) -> int:
        """Position of the first tensor requiring grad, or -1: found when first asked
        (a Python loop over the tensors) and then kept, since a training loop's reused
        ``out`` buffers keep their flag. A ``requires_grad_()`` on a tensor after that
        is not seen."""
        hit = self.__dict__.get("_requires_grad")
        if hit is None:
            hit = self.__dict__["_requires_grad"] = next(
                (i for i, t in enumerate(self.tensors) if t.requires_grad), -1)
        return hit

    def first_short(self) -> int:
        """Position of the first tensor reaching past the end of its storage (one shrunk
        with ``untyped_storage().resize_()``), or -1: a kernel writing it would write
        past the allocation. Computed once per plan where the compiled check guards it
        (it compares each storage's size too), else on every call."""
        hit = self.__dict__.get("_short")
        if hit is not None:
            return hit
        result = -1
        n = len(self.tensors)
        if self.device.type != "meta" and n:
            extent = self.numels.copy()  # elements spanned: the numel, if contiguous
            for i in self.noncontig.tolist():
                t = self.tensors[i]
                if t.numel():
                    extent[i] = 1 + sum((k - 1) * st for k, st in zip(t.shape, t.stride()))
            offset = np.fromiter(map(_T.storage_offset, self.tensors), np.int64, n)
            have = np.fromiter(map(torch.UntypedStorage.nbytes, map(_T.untyped_storage, self.tensors)), np.int64, n)
            itemsize = np.fromiter((d.itemsize for d in self.dtypes), np.int64, n)
            bad = np.nonzero((self.numels > 0) & ((offset + extent) * itemsize > have))[0]
            result = int(bad[0]) if len(bad) else -1
        if self.meta is not None:
            self.__dict__["_short"] = result
        return result

    def self_overlap(self) -> tuple[int, int] | None:
        """``(i, j)``, ``i != j``, such that tensors ``i`` and ``j`` may share memory, or
        None (computed once per plan). Exact between contiguous tensors; a non-contiguous
        one counts as its whole storage against contiguous ones; non-contiguous tensors
        whose spans meet are compared element by element (disjoint columns of one matrix
        pass), up to ``_EXACT_MAX`` elements in all, beyond which meeting spans count."""
        if "_self_overlap" in self.__dict__:
            return self.__dict__["_self_overlap"]
        result = None
        live = np.nonzero(self.spans[:, 1] > self.spans[:, 0])[0]  # empty tensors overlap nothing
        nc = np.zeros(len(self.tensors), bool)
        nc[self.noncontig] = True
        cont = live[~nc[live]]
        if len(cont) > 1:
            order = cont[np.argsort(self.spans[cont, 0], kind="stable")]
            lo, hi = self.spans[order, 0], self.spans[order, 1]
            bad = np.nonzero(lo[1:] < np.maximum.accumulate(hi)[:-1])[0]
            if len(bad):
                j = int(order[bad[0] + 1])
                i = next(int(k) for k in order[: bad[0] + 1] if self.spans[k, 1] > self.spans[j, 0])
                result = (min(i, j), max(i, j))
        if result is None:
            for j in live[nc[live]]:
                hit = cont[(self.spans[cont, 0] < self.spans[j, 1]) & (self.spans[cont, 1] > self.spans[j, 0])]
                if len(hit):
                    result = (min(int(hit[0]), int(j)), max(int(hit[0]), int(j)))
                    break
        if result is None:
            result = _strided_self_overlap(self.tensors, live[nc[live]], self.spans)
        self.__dict__["_self_overlap"] = result
        return result

    def overlaps(self, t: torch.Tensor) -> int:
        """Position of the first tensor whose memory overlaps ``t``'s, or -1.

        The answer for the last byte range asked is remembered (the plan's spans never
        change): a training loop asks about the same ``out`` buffer every step, and the
        vectorised test over 10,000 spans costs about 15 us."""
        if t.device != self.device or t.numel() == 0 or t.device.type == "meta":
            return -1
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        last = self.__dict__.get("_last_overlap")
        if last is not None and last[0] == lo and last[1] == hi:
            return last[2]
        hit = np.nonzero((self.spans[:, 0] < hi) & (self.spans[:, 1] > lo))[0]
        result = int(hit[0]) if len(hit) else -1
        self.__dict__["_last_overlap"] = (lo, hi, result)
        return result


#: Elements (of non-contiguous tensors whose spans meet) that ``self_overlap`` compares
#: one by one; beyond it, meeting spans count as shared memory.
_EXACT_MAX = 1 << 22


def _element_starts(t: torch.Tensor) -> np.ndarray:
    """Address of every element of ``t``."""
    off = np.zeros(1, np.int64)
    for n, st in zip(t.shape, t.stride()):
        off = (off[:, None] + np.arange(n, dtype=np.int64)[None, :] * st).reshape(-1)
    return t.data_ptr() + off * t.element_size()


def _strided_self_overlap(tensors, idx: np.ndarray, spans: np.ndarray):
    """``(i, j)`` among non-contiguous ``tensors[idx]`` sharing an element's bytes, or None."""
    if len(idx) < 2:
        return None
    order = idx[np.argsort(spans[idx, 0], kind="stable")]
    if not (spans[order[1:], 0] < np.maximum.accumulate(spans[order, 1])[:-1]).any():
        return None  # no two spans meet
    if sum(tensors[i].numel() for i in order) > _EXACT_MAX:
        a, b = sorted(int(i) for i in order[:2])
        return (a, b)
    starts = np.concatenate([_element_starts(tensors[i]) for i in order])
    ends = starts + np.concatenate([np.full(tensors[i].numel(), tensors[i].element_size(), np.int64) for i in order])
    owner = np.concatenate([np.full(tensors[i].numel(), i, np.int64) for i in order])
    o = np.argsort(starts, kind="stable")
    starts, ends, owner = starts[o], ends[o], owner[o]
    # Each element against the one reaching furthest before it (an element of its own
    # tensor only where that tensor overlaps itself, which is refused on its own).
    furthest = np.maximum.accumulate(ends)
    arg = np.maximum.accumulate(np.where(ends == furthest, np.arange(len(ends)), 0))
    bad = np.nonzero((starts[1:] < furthest[:-1]) & (owner[1:] != owner[arg[:-1]]))[0]
    if not len(bad):
        return None
    a, b = int(owner[bad[0] + 1]), int(owner[arg[bad[0]]])
    return (min(a, b), max(a, b))


def _build(tup: tuple, cache: bool = True, name: str = "tensors") -> Plan:
    n = len(tup)
    device = tup[0].device
    dtypes = list(map(_get_dtype, tup))
    numels = np.fromiter(map(_T.numel, tup), np.int64, n)
    ptrs = list(map(_T.data_ptr, tup))
    addrs = np.array(ptrs, dtype=np.int64)
    if device.type != "meta":
        null = np.nonzero((addrs == 0) & (numels > 0))[0]
        if len(null):
            i = int(null[0])
            # A kernel would read or write through address 0 (a segfault on CPU).
            raise no_memory_error(tup[i], f"{name}[{i}]")
    # A conjugate or negative bit (t.conj(), torch._neg_view) is a lazy view: its bits
    # are not its values, so such tensors are staged like non-contiguous ones, through a
    # resolved copy.
    contig = np.fromiter((t.is_contiguous() and not t.is_conj() and not t.is_neg() for t in tup), bool, n)
    offsets = np.zeros(n, dtype=np.int64)
    np.cumsum(numels[:-1], out=offsets[1:])
    itemsize = np.fromiter((d.itemsize for d in dtypes), np.int64, n) if len(set(dtypes)) > 1 \
        else np.full(n, dtypes[0].itemsize, dtype=np.int64)
    # Span of memory each tensor may touch; for non-contiguous tensors, their storage
    # from their first element to the storage's end (conservative).
    spans = np.stack([addrs, addrs + numels * itemsize], axis=1)
    noncontig = np.nonzero(~contig)[0]
    for i in noncontig:
        t = tup[i]
        st = t.untyped_storage()
        spans[i] = (st.data_ptr(), st.data_ptr() + st.nbytes())
    if device.type == "meta":  # no memory (every data pointer is 0): nothing overlaps
        spans[:, 1] = spans[:, 0]
    groups = []
    codes = {}
    for d in dtypes:
        codes.setdefault(d, len(codes))
    if len(codes) == 1:
        members = [(dtypes[0], np.arange(n))]
    else:
        code_arr = np.fromiter((codes[d] for d in dtypes), np.int64, n)
        members = [(d, np.nonzero(code_arr == c)[0]) for d, c in codes.items()]
    for d, idx in members:
        groups.append(Group(d, device, idx, tuple(tup[i] for i in idx) if len(members) > 1 else tup,
                            addrs[idx], numels[idx], offsets[idx], transient=not cache))
    ids = np.fromiter(map(id, tup), np.int64, n)
    impls = np.fromiter(map(operator.attrgetter("_cdata"), tup), np.int64, n)
    meta, guard = metadata_snapshot(tup, numels, dtypes) if cache else (None, None)
    return Plan(tup, device, dtypes, numels, offsets, ptrs, noncontig, groups, spans, ids, addrs, impls,
                1 if len(groups) == 1 else 2, meta, guard)


class _PlanCache:
    """A small LRU of plans keyed on the identity of the tensor objects.

    It holds strong references to the tensors of at most ``size`` plans (set with
    ``FASTPAR_PLAN_CACHE``, default 32: a K=8 ``reduce_add_coalesced(out=)`` alone needs
    9 plans, and an LRU smaller than a loop's working set misses every time, rebuilding
    10,000-tensor plans at ~30 ms each); :func:`clear_plan_cache` drops them. Callers
    whose tensors are transient (a replica's gradients) pass ``cache=False``.

    The key is ``(length, id of the first tensor, id of the last)``. Lists that share it
    but differ in between (a list and a copy of it with some middle items replaced by
    other live tensors) each keep their plan, up to ``SLOTS`` per key, tried most recent
    first: with one plan per key, two such lists used in turn evicted each other and
    every call rebuilt its plan. A plan is kept beside a newer one only while every one
    of its tensors is referenced from outside the cache (one that nothing else refers to
    can never be passed again, and the plan would keep it alive), and only if it holds
    other tensor objects (the same objects with new metadata make it stale for good).
    That is checked whenever a plan is built (a miss): a middle tensor the caller drops
    stays alive until the next miss or :func:`clear_plan_cache`, as the ends of every
    cached plan do. References from other cached plans count as outside ones, so two
    keys' plans sharing a tensor keep each other's copy alive (up to ``SLOTS`` plans'
    worth per key, where one plan per key held one).
    """

    #: Plans kept per key (the most recently used first).
    SLOTS = 4

    def __init__(self) -> None:
        self.size = _env.number("FASTPAR_PLAN_CACHE", 32)
        # key -> tuple of plans, most recently used first; replaced whole, never
        # mutated, so a thread trying a tuple read under the lock sees a fixed set.
        self._plans: collections.OrderedDict = collections.OrderedDict()
        self._lock = fork_safe_lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        """The number of plans held."""
        with self._lock:
            return sum(map(len, self._plans.values()))

    def get(self, tensors, name: str, cache: bool) -> Plan:
        if not cache or self.size <= 0:
            return _build(check_tensor_list(tensors, name), cache=False, name=name)
        # Fast path: the very tensor objects of a cached plan (so already validated:
        # their layout and device cannot change without their data pointer changing
        # too), each still of the same class and at the same address.
        if isinstance(tensors, (list, tuple)) and tensors:
            key = (len(tensors), id(tensors[0]), id(tensors[-1]))
            with self._lock:
                slot = self._plans.get(key)
            if slot is not None:
                for plan in slot:
                    # Where a key holds several plans, three ids in between tell most
                    # of them apart before the full check (up to 0.2 ms for 10,000).
                    if len(slot) > 1 and not _middle_ids_match(tensors, plan.ids):
                        continue
                    if same_tensors(tensors, plan):
                        with self._lock:
                            now = self._plans.get(key)
                            if now is not None and plan in now:  # another thread may have evicted it
                                if now[0] is not plan:
                                    self._plans[key] = (plan, *(p for p in now if p is not plan))
                                self._plans.move_to_end(key)
                            self.hits += 1
                        return plan
        tup = check_tensor_list(tensors, name)
        key = (len(tup), id(tup[0]), id(tup[-1]))
        plan = _build(tup, name=name)
        with self._lock:
            self.misses += 1
            self._evict_orphans()
            # (_evict_orphans has just checked the key's older plans whole; its newest
            # one becomes an older one now.)
            kept = tuple(p for i, p in enumerate(self._plans.get(key, ()))
                         if not np.array_equal(p.ids, plan.ids) and (i or not _orphaned(p, ends_only=False)))
            self._plans[key] = (plan, *kept[: self.SLOTS - 1])
            self._plans.move_to_end(key)
            total = sum(map(len, self._plans.values()))
            while total > self.size:
                oldest, slot = next(iter(self._plans.items()))
                if len(slot) > 1:  # the least recently used plan of the oldest key
                    self._plans[oldest] = slot[:-1]
                else:
                    del self._plans[oldest]
                total -= 1
        return plan

    def _evict_orphans(self) -> None:
        # Drop plans whose first or last tensor nothing but the cache refers to any more
        # (a previous step's gradients, say): a list holding that very object can never
        # be passed again, and the plan would keep the rest alive. Both ends, as both are
        # in the key: lists often start with a persistent tensor and end with new ones.
        # A key's older plans (kept beside a newer one with the same ends) are checked
        # whole: their middle tensors are in no key, so one the caller dropped after
        # the newer plan came would otherwise stay alive until the key's next new plan.
        for k, slot in list(self._plans.items()):
            live = tuple(p for i, p in enumerate(slot) if not _orphaned(p, ends_only=not i))
            if not live:
                del self._plans[k]
            elif len(live) < len(slot):
                self._plans[k] = live

    def clear(self) -> None:
        with self._lock:
            self._plans.clear()


def _middle_ids_match(tensors, ids: np.ndarray) -> bool:
    """Whether the tensors at a quarter, half and three quarters of ``tensors`` are the
    objects whose ``id`` ``ids`` holds there (same length assumed: it is in the key)."""
    n = len(tensors)
    return all(id(tensors[i]) == ids[i] for i in (n >> 2, n >> 1, (3 * n) >> 2))


def _multiplicity(plan: Plan):
    """None where ``plan``'s tensors are distinct objects; else, per position, how many
    times that object is in the list. The plan (its tuple, a multi-dtype plan's group
    tuples, ``rnn``'s packing group) holds ``plan.internal_refs`` references per
    occurrence, so a tensor listed twice holds twice as many: counted as one, such a
    tensor never looked orphaned, and a plan of a list like ``[a, m, m, z]`` or
    ``[m, x, m]`` kept ``m`` alive after its caller had dropped it. Found once per plan
    (a sort of the ids: ~25 us for 10,000)."""
    hit = plan.__dict__.get("_multiplicity", False)
    if hit is False:
        s = np.sort(plan.ids)
        hit = None
        if len(s) > 1 and (s[1:] == s[:-1]).any():
            _, inverse, counts = np.unique(plan.ids, return_inverse=True, return_counts=True)
            hit = counts[inverse]
        plan.__dict__["_multiplicity"] = hit
    return hit


def _orphaned(plan: Plan, ends_only: bool) -> bool:
    """Whether some tensor of ``plan`` (its first or last one, with ``ends_only``) is
    referenced by nothing but the plan, whose own references to each tensor
    ``plan.internal_refs`` counts per occurrence in the list (``getrefcount`` adds one
    for its argument). The ends are read at every miss for every cached plan; all the
    tensors at every miss for each key's older plans, and for a key's newest plan when
    the key gets a new one."""
    refs = plan.internal_refs
    mult = _multiplicity(plan)
    if ends_only:
        ts = plan.tensors
        return (sys.getrefcount(ts[0]) - 1 <= refs * (1 if mult is None else int(mult[0]))
                or sys.getrefcount(ts[-1]) - 1 <= refs * (1 if mult is None else int(mult[-1])))
    if mult is None:
        return min(map(sys.getrefcount, plan.tensors)) - 1 <= refs
    have = np.fromiter(map(sys.getrefcount, plan.tensors), np.int64, len(plan.tensors)) - 1
    return bool((have <= refs * mult).any())


_CACHE = _PlanCache()


#: False inside :func:`transient_tensors`.
_cache_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar("fastpar_cache_plans", default=True)


@contextlib.contextmanager
def transient_tensors():
    """Within this block, plans are not cached. The autograd functions of the
    data-parallel path use it: their tensors (a replica's gradients and outputs) are new
    every step, so caching their plans would only keep them alive."""
    token = _cache_enabled.set(False)
    try:
        yield
    finally:
        _cache_enabled.reset(token)


def plan_for(tensors, name: str, *, cache: bool = True) -> Plan:
    """Validate ``tensors`` (see :func:`check_tensor_list`) and return their plan."""
    return _CACHE.get(tensors, name, cache and _cache_enabled.get())


def clear_plan_cache() -> None:
    """Drop every cached plan (and the references it holds to tensors)."""
    _CACHE.clear()


@dataclass(eq=False)
class ReduceGroup(_Numel):
    """One dtype group of a K-source reduction: ``dst[t] = sum_k src[k][t]``."""

    dtype: torch.dtype
    #: Device the kernel runs on (the destination's).
    device: torch.device
    #: int64 ``[K, N]``: address of tensor ``t`` in source ``k``.
    src_addrs: np.ndarray
    #: int64 ``[N]``: address of each destination tensor.
    dst_addrs: np.ndarray
    #: int64 ``[N]``: elements per tensor.
    numels: np.ndarray
    #: The memory behind the addresses, which must stay alive until the kernel has run:
    #: per source (and for the destination) either the N tensors themselves (a sequence)
    #: or one 1-D buffer holding them end to end. The torch backend computes on them.
    sources: list
    destinations: object
    #: Chunk-map cache shared with a plan group of the same numels.
    _blocks: dict = field(default_factory=dict, repr=False)
    #: The destinations are in a new buffer (not ``out=``, not a reused result buffer).
    #: The Numba kernel then keeps plain stores: streaming ones measured 7% slower there
    #: (Transformer, K=4), where the allocator hands back memory that is freshly mapped
    #: or still in cache.
    fresh: bool = False
    #: With ``out=`` of a cached plan: that plan group's ``_tables``, where the last
    #: table built for these destinations is kept (see ``device_table``); else None.
    table_cache: dict | None = None

    @property
    def n_sources(self) -> int:
        return self.src_addrs.shape[0]

    def aligned(self, elem_align: int) -> bool:
        return bool(
            (self.src_addrs % VECTOR_BYTES == 0).all()
            and (self.dst_addrs % VECTOR_BYTES == 0).all()
            and (self.numels % elem_align == 0).all()
        )

    def device_table(self, block: int, device: torch.device) -> torch.Tensor:
        """``src_addrs (source-major) | dst_addrs | numels | block_begin`` ((K + 3)N
        entries) as one int64 tensor on ``device``.

        On CUDA the table goes through pinned memory: an asynchronous copy from pageable
        memory may make the host wait for the stream first (CUDA's "API synchronization
        behavior"), and by now that stream waits on every source device's work (a
        replica's whole backward, say). torch's caching host allocator keeps the pinned
        block until the copy has run.

        It is built per call (sources are often transient), except with ``table_cache``
        (``out=`` of a cached plan): the last table built for those destinations is
        reused while the sources are at the same addresses, as in a loop reducing the
        same tensors into the same ``out``. The table holds nothing but those addresses,
        the numels and ``block_begin`` (made from the numels), so equal addresses mean an
        equal table, whatever tensors now live there. On an H200 a per-call table of an
        entry per program (pinned block, copy, host-to-device copy; 350 KB) took 170-190
        us of the host's time per call, for a kernel of 204 us (Transformer, K=4): the
        call was host-bound. It now has an entry per tensor (10 KB there). Later
        launches on other streams wait for the first one's copy, as
        ``Group.device_table``'s do."""
        cache = self.table_cache
        key = ("reduce", block, device)
        if cache is not None:
            hit = cache.get(key)
            if (hit is not None and np.array_equal(hit[0], self.src_addrs)
                    and np.array_equal(hit[1], self.dst_addrs) and np.array_equal(hit[2], self.numels)):
                _wait_for_copy(hit, 4, device)
                return hit[3]
        host = torch.from_numpy(np.concatenate(
            [self.src_addrs.reshape(-1), self.dst_addrs, self.numels, self.block_begin(block)[0]]
        ))
        table, event = _upload(host, device, keep=cache is not None)
        if cache is not None:
            # One list per entry, replaced whole: a thread reading the old entry keeps a
            # consistent (addresses, table, event) set.
            cache[key] = [self.src_addrs.copy(), self.dst_addrs.copy(), self.numels.copy(), table, event]
        return table
