"""New buffers for fastpar's results, with large host buffers on transparent huge pages.

A new host buffer of hundreds of MB is not memory yet: the kernel maps it page by page
as it is first written, one fault per 4 KiB page. On the VMs fastpar is measured on a
fault costs 3-6 us, so writing a fresh 177 MB buffer spent 100-240 ms in faults against
11 ms for the copy itself. Asking for transparent huge pages (``madvise(MADV_HUGEPAGE)``
on the 2 MiB-aligned part of the buffer, before anything touches it) makes that one fault
per 2 MiB: the same fresh buffer is then filled in 18-21 ms.

This is a hint to the kernel, as torch's own ``THP_MEM_ALLOC_ENABLE=1`` is (which does it
for every allocation of the process): where transparent huge pages are off
(``/sys/kernel/mm/transparent_hugepage/enabled`` is ``never``), or not Linux, nothing
changes. It only applies to buffers fastpar allocates for its results, of at least
``_MIN_BYTES``; ``FASTPAR_HUGE_PAGES=0`` turns it off.
"""
from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
import threading
import weakref

import torch

from . import _env
from .kernels._launch import fork_safe_lock

__all__ = ["empty", "gc_paused", "ResultCache", "use_count"]

_MADV_HUGEPAGE = 14  # <linux/mman.h>, the same on every Linux architecture
_HUGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
#: Below this a buffer gains little (one or two huge pages at most) and small
#: allocations come from the malloc heap, where faults are rarely taken afresh.
_MIN_BYTES = 4 << 20
#: Host result buffers of at least this many bytes are kept for reuse by
#: :class:`ResultCache`. glibc serves allocations this large from memory it may hand
#: back to the kernel when they are freed (``mmap`` chunks, or the heap's top trimmed),
#: so a loop that allocates one while the previous one is still alive can take a fault
#: on every page of every new buffer: flattening the 10,000 tiny tensors (a 2.56 MB
#: result) took 0.7-1.6 ms in the benchmark's rounds, against 0.4-0.8 ms refilling a
#: kept buffer, and the glibc path was fault-free in other processes (it depends on the
#: heap's layout). A lookup costs about 2.5 us more than ``torch.empty``: 5% of a 1 MiB
#: copy, and nothing beside the faults it saves.
_REUSE_MIN_BYTES = 1 << 20


def _load_madvise():
    if not sys.platform.startswith("linux") or not _env.flag("FASTPAR_HUGE_PAGES", True):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask for huge pages behind the 2 MiB-aligned part of ``t``'s memory (a host tensor
    of at least ``_MIN_BYTES`` not yet written); True if the kernel took the hint."""
    nbytes = t.numel() * t.element_size()
    if _madvise is None or t.device.type != "cpu" or nbytes < _MIN_BYTES:
        return False
    addr = t.data_ptr()
    lo = -(-addr // _HUGE) * _HUGE
    hi = (addr + nbytes) // _HUGE * _HUGE
    # Whole pages inside the tensor only: the hint must not change memory it does not own.
    return hi > lo and _madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0


def empty(size, *, dtype: torch.dtype, device) -> torch.Tensor:
    """``torch.empty(size, dtype=dtype, device=device)``; large host buffers get
    :func:`advise_huge_pages` before they are written."""
    t = torch.empty(size, dtype=dtype, device=device)
    advise_huge_pages(t)
    return t


def use_count(t: torch.Tensor) -> int:
    """References to ``t``'s storage (each tensor or storage object holding it counts)."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


class IdleBuffer:
    """A buffer kept for reuse, and the test of whether anything else still refers to it.

    The storage's use count sees tensors, views and numpy arrays over it, but not a
    second reference to its Python storage object: torch keeps one such object per
    storage, so a user's ``t.untyped_storage()`` (or a ``TypedStorage`` over it) is the
    very object the count itself goes through. So the slot holds that object and also
    compares its Python reference count, its size (``resize_`` in place) and, for a host
    buffer, whether it was moved to shared memory (a result sent to another process: torch
    keeps only a weak reference on the sending side, the receiver maps the same memory).

    ``UntypedStorage.is_shared()`` is True for every CUDA storage (torch's
    ``THPStorage_isShared``: device memory needs no move to be shared), so it says nothing
    there and is not asked: a CUDA buffer sent to another process stays referenced by
    its sender for as long as the receiver uses it (torch's rule for CUDA tensors in
    multiprocessing), which the use count sees. Asked, it made every CUDA buffer look
    dead, and replicate's pool allocated afresh on every call.

    Python weak references to that storage object count too: without this slot holding
    it, the object would die with the last result and ``weakref.ref(r.untyped_storage())``
    would return None; held here, it stays alive, and a weak reference kept past the
    results would hand back the storage after a later call refilled it."""

    __slots__ = ("buf", "storage", "nbytes", "uses", "refs", "weak", "host")

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.storage = buf.untyped_storage()
        self.nbytes = self.storage.nbytes()
        self.uses = use_count(buf)
        self.refs = sys.getrefcount(self.storage)
        self.weak = weakref.getweakrefcount(self.storage)
        self.host = buf.device.type == "cpu"

    def intact(self) -> bool:
        """False once the storage was resized or (a host buffer) moved to shared memory:
        never idle again."""
        return self.storage.nbytes() == self.nbytes and not (self.host and self.storage.is_shared())

    def idle(self) -> bool:
        """True when nothing but this slot refers to the buffer, and it is intact."""
        return (use_count(self.buf) == self.uses and sys.getrefcount(self.storage) == self.refs
                and weakref.getweakrefcount(self.storage) == self.weak and self.intact())


class ResultCache:
    """Host result buffers handed out again once nothing refers to them, as DDP keeps
    its bucket buffers and torch's CUDA caching allocator keeps blocks.

    ``reduce_add_coalesced`` (and ``flatten`` without ``out=``) returns new tensors every
    call; in a training loop the previous call's results (last step's gradients) are
    gone by the next call, and
    refilling their buffer costs no page fault at all, where a new one costs faults
    (huge pages or not) and, on a VM that returns free memory to its host, host-side
    faults too. A buffer is reused only when its storage is referenced by this cache
    alone (no result, view, ``.grad`` or saved tensor left), so no live tensor ever
    sees its memory change. (The results of a call that compiled a Numba kernel stay
    alive until the garbage collector runs: Numba's compiler leaves that call's frames
    in a reference cycle. Their buffer is then simply not reused until then.)

    Only buffers of at least ``_REUSE_MIN_BYTES`` (1 MiB) are kept; smaller ones are
    allocated anew every call. At most ``per_key`` buffers are kept per (dtype, numel,
    inference mode) and ``max_bytes`` in all
    (least recently used keys dropped first: their memory is freed once their results
    die). ``FASTPAR_RESULT_CACHE_MB`` sets ``max_bytes`` (0 turns the cache off);
    :meth:`clear` drops every buffer.
    """

    def __init__(self, max_bytes: int | None = None, per_key: int = 2) -> None:
        if max_bytes is None:
            max_bytes = int(_env.number("FASTPAR_RESULT_CACHE_MB", 1024.0, float) * (1 << 20))
        self.max_bytes = max_bytes
        self.per_key = per_key
        self._slots: dict = {}  # (dtype, numel, inference mode) -> [IdleBuffer], oldest key first
        self._bytes = 0
        self._lock = fork_safe_lock()

    def empty(self, numel: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, bool]:
        """A 1-D host buffer of ``numel`` elements and whether it is a reused one (its
        pages already mapped); other devices get :func:`empty` (their allocators cache).

        The tensor returned is a new tensor over the buffer's storage: while the caller
        holds it (or anything made from it), the buffer counts as in use, so two threads
        never get the same one. It is ``detach()``-ed, not a ``view``: a view's ``_base``
        is the kept tensor itself, which the use count does not see held (the same
        tensor as the slot's), so a caller keeping ``result._base`` saw it refilled."""
        device = torch.device(device)
        nbytes = numel * dtype.itemsize
        if device.type != "cpu" or nbytes > self.max_bytes or nbytes < _REUSE_MIN_BYTES:
            return empty(numel, dtype=dtype, device=device), False
        # Buffers made in inference mode are inference tensors: handed out only there
        # (outside, a result could not be modified in place or saved for backward).
        key = (dtype, numel, torch.is_inference_mode_enabled())
        with self._lock:
            slots = self._slots.pop(key, [])
            self._slots[key] = slots  # most recently used last
            for slot in slots:
                if slot.idle():
                    return slot.buf.detach(), True
            # A slot whose buffer was resized or shared is never idle again: replace it.
            dead = [sl for sl in slots if not sl.intact()]
            for sl in dead:
                slots.remove(sl)
                self._bytes -= nbytes
            buf = empty(numel, dtype=dtype, device=device)
            if len(slots) < self.per_key:
                slots.append(IdleBuffer(buf))
                self._bytes += nbytes
                while self._bytes > self.max_bytes:
                    old_key = next(iter(self._slots))
                    self._bytes -= sum(sl.buf.numel() * sl.buf.element_size() for sl in self._slots.pop(old_key))
            return buf.detach(), False

    def clear(self) -> None:
        """Drop every kept buffer (their memory is freed once their results are gone)."""
        with self._lock:
            self._slots.clear()
            self._bytes = 0


_gc_lock = fork_safe_lock(threading.Lock())  # (made anew in a forked child)
_gc_depth = 0
_gc_was_enabled = False
#: Open blocks per thread (``threading.get_ident()`` -> count): after a fork, only the
#: forking thread's can ever end.
_gc_open: dict = {}


@contextlib.contextmanager
def gc_paused():
    """Hold off Python's cyclic garbage collector while a block makes many tensor
    objects at once (the 10,000 views of a coalesced result).

    Every tensor is a GC-tracked object, and each 700 new ones start a young-generation
    collection (every tenth of those an older one too), whose traversal of tensors costs
    about as much as making them: splitting a buffer into 10,000 views took 5.2-5.6 ms
    with the collector on and 2.6 ms with it held off here, the collection it owes then
    included. Nothing is freed later than it would be otherwise: the block makes
    objects and frees none, and the collector runs again at the next allocation after
    it. Nested and concurrent blocks (replica threads) share one pause: the collector
    is turned back on when the last one ends, and only if it was on when the first
    began (a caller that turned it off keeps it off). A process forked meanwhile keeps
    only the forking thread's blocks (see :func:`_gc_after_fork`)."""
    global _gc_depth, _gc_was_enabled
    me = threading.get_ident()
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_depth += 1
        _gc_open[me] = _gc_open.get(me, 0) + 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_open[me] > 1:
                _gc_open[me] -= 1
            else:
                del _gc_open[me]
            if _gc_depth == 0 and _gc_was_enabled:
                gc.enable()


def _gc_after_fork() -> None:
    """In a forked child: the blocks other threads had open will never end there (those
    threads do not exist in it), so they no longer count, and the collector is turned
    back on if they alone held it off. Without this a child forked while another thread
    was inside a block (a DataLoader worker) ran with the collector off for good, every
    later block finding it "paused" already. (The lock, which one of those threads may
    have held, is made anew by :func:`fastpar.kernels._launch.fork_safe_lock`'s hook.)"""
    global _gc_depth, _gc_open
    own = _gc_open.get(threading.get_ident(), 0)
    _gc_open = {threading.get_ident(): own} if own else {}
    if _gc_depth and not own and _gc_was_enabled:
        gc.enable()
    _gc_depth = own


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_gc_after_fork)


#: The host result buffers of ``flatten`` (without ``out=``) and ``reduce_add_coalesced``:
#: one cache, so that ``FASTPAR_RESULT_CACHE_MB`` bounds them together.
RESULTS = ResultCache()
