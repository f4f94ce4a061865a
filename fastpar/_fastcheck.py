"""C-speed re-validation of a cached plan: "are these the same tensor objects, each
still at the same data address, with the same dtype, sizes and strides?".

Every cache hit checks identity and data pointer, then dtype, sizes and strides: the
latter is what catches in-place metadata changes that keep the data pointer (``t_()``, a
shrinking ``resize_()``, ``as_strided_()``, ``p.data = p.data[:n]``), which would
otherwise make a stale plan copy the wrong elements. One Numba pass over the list's
items does it all (each item's class too: ``t.__class__ = Sub`` changes nothing else,
and decides whether a call goes to a ``__torch_function__`` override), about 7 ns a
tensor when their metadata is in cache (35 ns when it is not; lists of
``PARALLEL_CHECK_MIN_TENSORS`` or more are split across the thread pool where a
parallel region may start and no kernel holds it), reading each tensor's
``TensorImpl`` fields (ndim, inline sizes and strides, numel, dtype, storage, storage
offset and dispatch key set, whose conj/neg bits
``a.data = a.conj()`` flips in place) and its ``StorageImpl``'s data pointer and size at
offsets found by calibrating against probe tensors at first use and verified by mutating
them; where that calibration fails, or a tensor has more than 5 dimensions (sizes out
of line), dynamo's C++ ``TensorGuards`` does the metadata check instead (about 80 ns a
tensor).

The same calibration finds each tensor's version counter, so :func:`increment_versions`
bumps 10,000 counters in tens of microseconds (torch's ``increment_version`` takes about
50 ns a tensor: 0.5 ms, more than the copy it follows), split across the thread pool as
the check is for lists of ``PARALLEL_CHECK_MIN_TENSORS`` or more.

In Python every per-tensor getter costs 30-60 ns (``map(Tensor.data_ptr, ...)`` takes
0.6 ms for 10,000 tensors, ten times the copy itself), so a Numba function does the loop,
reading the list's item pointers (``PyListObject.ob_item``) and the fields above. Where
only the C++ guard checks metadata, the loop instead calls torch's exported C accessor
``_torchinductor_pyobject_tensor_data_ptr(PyObject*)`` (what inductor's generated C++
uses) on each tensor. All of it rests on CPython / torch internals, so it is self-tested
at first use (outside inference mode) and the pure-Python check is used when anything is
off (another Python layout, a free-threaded build, a torch without the symbol).
"""
from __future__ import annotations

import ctypes
import operator
import sys
import sysconfig
import warnings

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .kernels._launch import fork_safe_lock

_T = torch.Tensor
_get_cdata = operator.attrgetter("_cdata")
_OB_ITEM_OFFSET = 24  # PyListObject: ob_refcnt, ob_type, ob_size, then ob_item
#: Lists of at least this many tensors are re-checked on the thread pool. The serial
#: check takes 7-11 ns a tensor in cache; starting a parallel region costs several
#: microseconds, and on a loaded machine can wait for a descheduled worker, so only long
#: lists (80+ us of checking) take the pool.
PARALLEL_CHECK_MIN_TENSORS = 8192
#: Parts a parallel check splits the list into (Numba's static schedule hands each
#: thread a contiguous run of them).
_CHECK_PARTS = 64
#: Per parallel pass (the plan re-check, the version bump): False once it failed to run
#: (a threading layer that cannot load).
_pool_usable = {"check": True, "bump": True}
_POOL_FAILED = {
    "check": "the parallel plan re-check cannot run here ({e}); long tensor lists are re-checked on "
             "one thread from now on",
    "bump": "the parallel version-counter bump cannot run here ({e}); long tensor lists' versions are "
            "bumped on one thread from now on",
}


def _on_pool(kind: str, kernel, args):
    """``kernel(*args)``, a compiled parallel pass (``kind``: "check" or "bump"), on the
    thread pool; None if the pool is busy (a kernel holds ``PARALLEL_LOCK``: never wait
    for it here) or the pass cannot run at all (then, with a warning, ``kind`` runs on
    the calling thread from now on: the serial pass gives the same answer)."""
    from .kernels.ops_numba import _common as numba_common

    try:
        if not getattr(kernel, "signatures", True):
            # Compiled once (about a second) before taking the pool, so that other
            # threads' kernels do not wait for the compiler.
            kernel.compile(tuple(numba.typeof(a) for a in args))
        if not numba_common.PARALLEL_LOCK.acquire(blocking=False):
            return None
        try:
            return kernel(*args)
        finally:
            numba_common.PARALLEL_LOCK.release()
    except Exception as e:
        # A parallel region that cannot start, e.g. NUMBA_THREADING_LAYER naming a layer
        # that is not installed ("No threading layer could be loaded").
        _pool_usable[kind] = False
        warnings.warn("fastpar: " + _POOL_FAILED[kind].format(e=f"{type(e).__name__}: {e}"),
                      RuntimeWarning, stacklevel=2)
        return None


def _pool_pays(n: int, kind: str) -> bool:
    """Whether a pass over ``n`` tensors should try the thread pool: only long lists
    (a region costs microseconds to start) and only where a region may start
    (``parallel_ok``: not in a forked child, torch not on one thread)."""
    if n < PARALLEL_CHECK_MIN_TENSORS or not _pool_usable[kind]:
        return False  # (before the import: short lists are re-checked every call)
    from .kernels.ops_numba import _common as numba_common

    return numba_common.parallel_ok()


def _python_check(tensors: list, impls: np.ndarray, ptrs: list, cached: tuple) -> bool:
    return (all(map(operator.is_, tensors, cached))
            and np.array_equal(np.fromiter(map(_get_cdata, tensors), np.int64, len(tensors)), impls)
            and list(map(_T.data_ptr, tensors)) == ptrs)


#: TensorImpl words read by the calibration (192 bytes; the object is larger, and the
#: fields sought lie in its first 21 words on torch 2.x).
_WORDS = 24


def _words(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(addr)).copy()


def _meta_of(t: torch.Tensor):
    """What the reader must find: ndim, sizes, strides, numel."""
    return t.dim(), list(t.shape), list(t.stride()), t.numel()


def _impl_word():
    """Word of a tensor's PyObject holding its TensorImpl pointer (``Tensor._cdata``),
    read within the object (``__basicsize__``); None unless unambiguous."""
    probes = [torch.empty(3), torch.nn.Parameter(torch.empty(2)), torch.empty(0, dtype=torch.int64)]
    pyw = [_words(id(t), type(t).__basicsize__ // 8) for t in probes]
    n = min(len(p) for p in pyw)
    cand = [w for w in range(2, n) if all(p[w] == t._cdata for p, t in zip(pyw, probes))]
    return cand[0] if len(cand) == 1 else None


def _calibrate():
    """Offsets (in int64 words) of: the TensorImpl pointer in a tensor's PyObject, and in
    the TensorImpl, ndim (followed by 5 inline sizes and 5 inline strides), numel and
    the word whose low 16 bits are the dtype. None unless every probe agrees."""
    probes = [torch.empty(3, 5, 7), torch.empty(11, 13).t(), torch.empty(17, dtype=torch.float64),
              torch.empty(2, 3, 4, 5, 6, dtype=torch.int32), torch.empty(()), torch.empty(9, 10)[:, ::3],
              torch.empty(19, 2, dtype=torch.bfloat16), torch.empty(23, dtype=torch.int64),
              torch.empty(4, 29, dtype=torch.float16), torch.empty(31, 3, dtype=torch.uint8)]
    impl_word = _impl_word()
    if impl_word is None:
        return None
    impls = [_words(t._cdata, _WORDS) for t in probes]
    metas = [_meta_of(t) for t in probes]

    def block_ok(k, w, meta):
        nd, sizes, strides, _ = meta
        return w[k] == nd and list(w[k + 1 : k + 1 + nd]) == sizes and list(w[k + 6 : k + 6 + nd]) == strides

    ks = [k for k in range(2, _WORDS - 12) if all(block_ok(k, w, m) for w, m in zip(impls, metas))]
    if len(ks) != 1:
        return None
    k = ks[0]
    ms = [m for m in range(k + 11, _WORDS) if all(w[m] == meta[3] for w, meta in zip(impls, metas))]
    if not ms:
        return None
    m = ms[0]
    ds = []
    for d in range(m + 1, min(m + 8, _WORDS)):
        low = [int(w[d]) & 0xFFFF for w in impls]
        by_dtype = {}
        for t, v in zip(probes, low):
            by_dtype.setdefault(t.dtype, set()).add(v)
        if all(len(v) == 1 for v in by_dtype.values()) and len({next(iter(v)) for v in by_dtype.values()}) == len(by_dtype):
            ds.append(d)
    if not ds:
        return None
    return impl_word, k, m, ds[0]


def _calibrate_storage():
    """Offsets (in int64 words) of: the ``StorageImpl`` pointer and the storage offset in
    a ``TensorImpl``, and the data pointer and the size in bytes in a ``StorageImpl``;
    None unless every probe agrees. A tensor's data pointer is its storage's data pointer plus its storage offset
    (times the item size, which the dtype check pins), so comparing these three words
    compares data pointers without calling into torch."""
    base = torch.empty(64)
    probes = [torch.empty(5), base[3:], base[17:40:2], torch.empty(7, dtype=torch.float64)[5:],
              torch.from_numpy(np.zeros(6)), torch.empty(0), torch.empty(4, 3, dtype=torch.int32)[1:]]
    impls = [_words(t._cdata, _WORDS) for t in probes]
    store = [(t.untyped_storage()._cdata, t.storage_offset(), t.untyped_storage().data_ptr()) for t in probes]
    s = [w for w in range(2, _WORDS) if all(i[w] == st[0] for i, st in zip(impls, store))]
    o = [w for w in range(2, _WORDS) if all(i[w] == st[1] for i, st in zip(impls, store))]
    # from_numpy's storage keeps its data and its deleter context apart, so only the
    # data word itself matches every probe.
    stor_words = [_words(st[0], 12) for st in store]
    sd = [w for w in range(2, 6) if all(sw[w] == st[2] for sw, st in zip(stor_words, store))]
    if len(s) != 1 or len(o) != 1 or len(sd) != 1:
        return None
    # The size follows the DataPtr (data, deleter context, device).
    nbytes = [t.untyped_storage().nbytes() for t in probes]
    nb = [w for w in range(sd[0] + 3, 12) if all(sw[w] == b for sw, b in zip(stor_words, nbytes))]
    if len(nb) != 1:
        return None
    return s[0], o[0], sd[0], nb[0]


def _calibrate_keyset(d: int):
    """Offset (in int64 words) of a ``TensorImpl``'s dispatch key set, past the dtype word
    ``d``: the same for plain float tensors of any shape and layout, different for a
    conjugate view and a negative view (the lazy ``conj()`` / ``neg`` bits, which
    ``a.data = a.conj()`` sets in place without touching anything else the check reads);
    None unless unambiguous and confirmed by setting a conjugate bit in place.

    Sixteen plain probes, made apart: a word that merely happens to hold one value in a
    few of them (one did in a CI run with four probes, making the search ambiguous)
    does not hold it in all."""
    plain = []
    for k in range(16):
        t = torch.empty(3 + k, 2 + k % 5)
        plain.append(t.t() if k % 3 == 0 else t[::2] if k % 3 == 1 else t)
        torch.empty(k + 1)  # interleave other allocations
    pairs = []
    for k in range(3):
        z = torch.zeros(3 + k, dtype=torch.complex64)
        pairs += [(z, z.conj()), (plain[k], torch._neg_view(plain[k]))]
    words = [_words(t._cdata, _WORDS) for t in plain]
    pw = [(_words(a._cdata, _WORDS), _words(b._cdata, _WORDS)) for a, b in pairs]
    cand = [j for j in range(d + 1, _WORDS)
            if len({int(w[j]) for w in words}) == 1 and all(wa[j] != wb[j] for wa, wb in pw)]
    z = torch.zeros(3, dtype=torch.complex64)
    before = _words(z._cdata, _WORDS)
    z.data = z.conj()
    after = _words(z._cdata, _WORDS)
    cand = [j for j in cand if after[j] != before[j]]
    return cand[0] if len(cand) == 1 and z.is_conj() else None


def _calibrate_version():
    """``(word, byte)``: the word of a ``TensorImpl`` holding its version counter
    (``VersionCounter*``, shared by ``detach()`` but not by ``.data``; null for
    inference tensors) and the byte offset of the 32-bit version in that counter; None
    unless unambiguous and confirmed by bumping probes."""
    bases = [torch.zeros(3) for _ in range(4)]
    keep = [(t, t.detach(), t.data) for t in bases]
    words = [tuple(_words(x._cdata, _WORDS) for x in trio) for trio in keep]

    # Shared by each tensor and its detach(), not by its .data, distinct across the
    # tensors, and pointer-like: uninitialised padding words can pass the first tests
    # by chance (they did, once in a CI run, with a single probe), never all of them.
    def is_counter(w):
        vals = [wa[w] for wa, _, _ in words]
        return (all(wa[w] == wb[w] != wc[w] for wa, wb, wc in words) and len(set(vals)) == len(vals)
                and all(x >= 65536 and x % 8 == 0 for x in vals))

    cand = [w for w in range(2, _WORDS) if is_counter(w)]
    if len(cand) != 1:
        return None
    v = cand[0]
    a, _, c = keep[0]
    u32 = lambda t: np.ctypeslib.as_array((ctypes.c_uint32 * 6).from_address(int(_words(t._cdata, _WORDS)[v]))).copy()
    seen = []
    for _ in range(3):
        seen.append((u32(a), a._version, u32(c), c._version))
        a.add_(1)
        c.add_(1)
    offs = [j for j in range(2, 6) if all(wa_[j] == va and wc_[j] == vc for wa_, va, wc_, vc in seen)]
    return (v, offs[0] * 4) if len(offs) == 1 else None


@intrinsic
def _atomic_add_u32(typingctx, addr, k):
    """``*(uint32_t*)addr += k`` (modulo 2**32) as ``std::atomic<uint32_t>::operator+=``
    does it: ``k`` of ``operator++`` in one locked instruction."""
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(32).as_pointer())
        builder.atomic_rmw("add", ptr, builder.trunc(args[1], ir.IntType(32)), "seq_cst")
        return context.get_dummy_value()

    return sig, codegen


def _make_bump():
    """A compiled ``bump(impls) -> int`` adding one to each tensor's version counter
    (what ``torch.autograd.graph.increment_version`` does, at a few ns a tensor instead
    of about 50), or None where calibration fails. Returns -1, or the index of the first
    tensor without a version counter (an inference tensor), having bumped nothing."""
    if sysconfig.get_config_var("Py_GIL_DISABLED") or sys.implementation.name != "cpython":
        return None
    try:
        found = _calibrate_version()
    except Exception:
        return None
    if found is None:
        return None
    v, byte = found
    from .kernels.ops_numba._common import address_as_pointer

    proto = np.empty(0, np.int64)

    @numba.njit(nogil=False, cache=False)
    def _bump_range(impls, proto, lo, hi):
        # impls[lo:hi]'s counters, one locked add per run of consecutive tensors sharing
        # one (views of one buffer, listed in order, share their base's): the same sum
        # as an increment per tensor, without many threads' increments of one counter
        # queueing for its cache line (10,000 split views of one buffer: parallel bump
        # 80 us against the serial 53 us on 2 threads, before runs were added at once).
        last = 0
        run = 0
        for i in range(lo, hi):
            c = numba.carray(address_as_pointer(impls[i], proto), (v + 1,))[v]
            if c != last:
                if run:
                    _atomic_add_u32(last + byte, run)
                last = c
                run = 0
            run += 1
        if run:
            _atomic_add_u32(last + byte, run)

    @numba.njit(nogil=False, cache=False)
    def _first_without_counter(impls, proto):
        # Run by both bumps before any increment, so that a refused list bumps nothing:
        # the first tensor without a version counter (an inference tensor), or -1.
        for i in range(impls.shape[0]):
            if numba.carray(address_as_pointer(impls[i], proto), (v + 1,))[v] == 0:
                return i
        return -1

    @numba.njit(nogil=False, cache=False)
    def _bump(impls, proto):
        refused = _first_without_counter(impls, proto)
        if refused < 0:
            _bump_range(impls, proto, 0, impls.shape[0])
        return refused

    @numba.njit(nogil=False, cache=False, parallel=True)
    def _bump_parallel(impls, proto):
        # The same, the increments split across the thread pool: each locked increment
        # waits for the ones before it (about 5.5 ns a tensor, in cache or not: 10,000
        # bumps took 54 us, more than the copy of 10,000 tiny tensors; 32 us on two
        # threads of a Zen 5 VM). Counters shared by tensors of the list are added to
        # atomically all the same, once per run of them in a part. The caller keeps the GIL.
        refused = _first_without_counter(impls, proto)
        if refused >= 0:
            return refused
        n = impls.shape[0]
        step = (n + _CHECK_PARTS - 1) // _CHECK_PARTS
        for p in numba.prange(_CHECK_PARTS):
            lo = min(n, p * step)
            _bump_range(impls, proto, lo, min(n, lo + step))
        return -1

    #: The two compiled bumps, looked up per call (tests wrap them to see which ran).
    kernels = {"serial": _bump, "parallel": _bump_parallel}

    def bump(impls: np.ndarray) -> int:
        if _pool_pays(impls.shape[0], "bump"):
            r = _on_pool("bump", kernels["parallel"], (impls, proto))
            if r is not None:
                return r
        return kernels["serial"](impls, proto)

    bump.kernels = kernels

    # Self-test: the bumped versions are the ones torch reports.
    try:
        probe = [torch.zeros(2), torch.zeros(3, requires_grad=True), torch.zeros(1)]
        probe.append(probe[0].detach())  # shares probe[0]'s counter: bumped twice
        before = [t._version for t in probe]
        ok = bump(np.array([t._cdata for t in probe], dtype=np.int64)) == -1
        ok = ok and [t._version for t in probe] == [before[0] + 2, before[1] + 1, before[2] + 1, before[3] + 2]
        with torch.inference_mode():
            inf = torch.zeros(1)
        ok = ok and bump(np.array([probe[2]._cdata, inf._cdata], dtype=np.int64)) == 1
        ok = ok and probe[2]._version == before[2] + 1
    except Exception:
        ok = False
    return bump if ok else None


_bump = None
_bump_ready = False
#: Held while the compiled check or bump is made (first use): threads calling fastpar
#: for the first time together make it once, and none sees it half made.
_INIT_LOCK = fork_safe_lock()


def increment_versions(tensors, impls: np.ndarray) -> None:
    """``torch.autograd.graph.increment_version(tensors)``, ``impls`` being the tensors'
    ``TensorImpl`` addresses (``Plan.impls``, verified by the plan check). A list with an
    inference tensor (no counter) and uncalibrated builds go through torch, which skips
    inference tensors."""
    global _bump, _bump_ready
    if not _bump_ready:
        with _INIT_LOCK:
            if not _bump_ready:
                with torch.inference_mode(False), torch.no_grad():  # normal probe tensors (see _checker)
                    _bump = _make_bump()
                _bump_ready = True
    if _bump is None or _bump(impls) != -1:
        torch.autograd.graph.increment_version(list(tensors))


def _make_numba_check():
    if sysconfig.get_config_var("Py_GIL_DISABLED") or sys.implementation.name != "cpython":
        return None
    guards = getattr(torch._C, "_dynamo", None)
    addr = getattr(getattr(guards, "guards", None), "_torchinductor_pyobject_tensor_data_ptr", None)
    if not isinstance(addr, int) or addr == 0:
        return None
    # void* f(PyObject*) called as int64 -> int64: the same registers on x86-64 and arm64.
    data_ptr_of = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_int64)(addr)

    from .kernels.ops_numba._common import address_as_pointer

    proto = np.empty(0, np.int64)

    impl_word = _impl_word()
    if impl_word is None:
        return None

    @numba.njit(nogil=False, cache=False)
    def _list_items(list_addr, n, proto):
        """The item pointers of the list at ``list_addr`` (``PyListObject``: ob_refcnt,
        ob_type, ob_size, ob_item), or none at all if it does not hold ``n`` items."""
        header = numba.carray(address_as_pointer(list_addr, proto), (4,))
        return numba.carray(address_as_pointer(header[3], proto), (n if header[2] == n else 0,))

    @numba.njit(nogil=False, cache=False)
    def _same(list_addr, n, ids, impls, ptrs, proto):
        # Runs with the GIL held: the list cannot change under us.
        items = _list_items(list_addr, n, proto)
        if items.shape[0] != n:
            return False
        for i in range(n):
            if items[i] != ids[i]:
                return False
        # The very objects the plan validated (and still references), each still with
        # the TensorImpl it had then (torch.utils.swap_tensors replaces it): so each is
        # the dense tensor validated, and asking its data pointer is safe.
        for i in range(n):
            obj = numba.carray(address_as_pointer(items[i], proto), (impl_word + 1,))
            if obj[impl_word] != impls[i]:
                return False
        for i in range(n):
            if data_ptr_of(items[i]) != ptrs[i]:
                return False
        return True

    def check(tensors: list, ids: np.ndarray, impls: np.ndarray, ptrs_arr: np.ndarray) -> bool:
        return _same(id(tensors), len(tensors), ids, impls, ptrs_arr, proto)

    layout = _calibrate()
    storage = _calibrate_storage()
    keyset = _calibrate_keyset(layout[3]) if layout is not None else None
    if layout is not None and storage is not None and keyset is not None:
        _, k, m, d = layout
        s_w, o_w, sd_w, nb_w = storage
        st_top = max(sd_w + 3, nb_w + 1)
        ks_w = keyset
        top = max(d, s_w, o_w, ks_w) + 1

        @numba.njit(nogil=False, cache=False)
        def _snapshot(list_addr, n, proto):
            """Row per tensor: ndim, 5 sizes, 5 strides, numel, dtype, StorageImpl,
            storage offset, the storage's ``DataPtr`` (data pointer and the two words
            after it, its deleter and context), and the dispatch key set (conj and neg
            bits), and the storage's size in bytes (ndim > 5: ndim -1), and the
            object's class (``ob_type``: ``t.__class__ = Sub`` changes nothing else)."""
            items = _list_items(list_addr, n, proto)
            out = np.zeros((n, 21), dtype=np.int64)
            for i in range(n):
                obj = numba.carray(address_as_pointer(items[i], proto), (impl_word + 1,))
                out[i, 20] = obj[1]
                w = numba.carray(address_as_pointer(obj[impl_word], proto), (top,))
                nd = w[k]
                if nd > 5:
                    out[i, 0] = -1
                    continue
                out[i, 0] = nd
                for j in range(nd):
                    out[i, 1 + j] = w[k + 1 + j]
                    out[i, 6 + j] = w[k + 6 + j]
                out[i, 11] = w[m]
                out[i, 12] = w[d] & 0xFFFF
                out[i, 13] = w[s_w]
                out[i, 14] = w[o_w]
                dp = numba.carray(address_as_pointer(w[s_w], proto), (st_top,))
                out[i, 15] = dp[sd_w]
                out[i, 16] = dp[sd_w + 1]
                out[i, 17] = dp[sd_w + 2]
                out[i, 18] = w[ks_w]
                out[i, 19] = dp[nb_w]
            return out

        @numba.njit(nogil=False, cache=False)
        def _rows_same(items, lo, hi, ids, impls, meta, proto):
            # Rows lo..hi, each tensor's lines read once: with 50,000 tensors (a K=4
            # reduce) their metadata is far out of cache and the loop is bound by memory
            # latency. (A range per call, not a row: a call per row, with its array
            # arguments, made the loop three times slower.)
            for i in range(lo, hi):
                # The very object the plan validated (and still references), still with
                # the TensorImpl it had then (torch.utils.swap_tensors replaces it) and
                # of the class it had then (``__class__`` assignment: whether the call
                # goes to a ``__torch_function__`` override is decided per plan).
                if items[i] != ids[i]:
                    return False
                obj = numba.carray(address_as_pointer(items[i], proto), (impl_word + 1,))
                if obj[impl_word] != impls[i] or obj[1] != meta[i, 20]:
                    return False
                w = numba.carray(address_as_pointer(impls[i], proto), (top,))
                nd = w[k]
                if nd != meta[i, 0] or w[m] != meta[i, 11] or (w[d] & 0xFFFF) != meta[i, 12]:
                    return False
                for j in range(nd):
                    if w[k + 1 + j] != meta[i, 1 + j] or w[k + 6 + j] != meta[i, 6 + j]:
                        return False
                if w[s_w] != meta[i, 13] or w[o_w] != meta[i, 14] or w[ks_w] != meta[i, 18]:
                    return False
                # The whole DataPtr, not only the address: a lazy clone (copy on write)
                # keeps the address and swaps the deleter context, and must not be
                # written through the old plan (torch's data_ptr() would un-share it).
                # And the storage's size: resize_(0) then regrowing it smaller can give back
                # the very same DataPtr (the allocator reuses the block), and a destination
                # reaching past the new end must then be refused (Plan.first_short).
                dp = numba.carray(address_as_pointer(w[s_w], proto), (st_top,))
                if dp[sd_w] != meta[i, 15] or dp[sd_w + 1] != meta[i, 16] or dp[sd_w + 2] != meta[i, 17]:
                    return False
                if dp[nb_w] != meta[i, 19]:
                    return False
            return True

        @numba.njit(nogil=False, cache=False)
        def _same_meta(list_addr, n, ids, impls, meta, proto):
            items = _list_items(list_addr, n, proto)
            return items.shape[0] == n and _rows_same(items, 0, n, ids, impls, meta, proto)

        @numba.njit(nogil=False, cache=False, parallel=True)
        def _same_meta_parallel(list_addr, n, ids, impls, meta, proto):
            # The same test split across the thread pool: the loop waits on memory, and
            # two cores keep twice the reads in flight (10,000 tensors: 105 -> 69 us,
            # 50,000 out of cache: 2.2 -> 1.0 ms on a 2-core Zen 3 VM). The caller keeps
            # the GIL (nogil=False), so the list cannot change; the workers only read
            # memory. Mismatching parts are counted (no early exit from a prange).
            items = _list_items(list_addr, n, proto)
            if items.shape[0] != n:
                return False
            step = (n + _CHECK_PARTS - 1) // _CHECK_PARTS
            bad = 0
            for p in numba.prange(_CHECK_PARTS):
                lo = min(n, p * step)
                hi = min(n, lo + step)
                if not _rows_same(items, lo, hi, ids, impls, meta, proto):
                    bad += 1
            return bad == 0

        def snapshot(tensors: list):
            return _snapshot(id(tensors), len(tensors), proto)

        #: The two compiled checks, looked up per call (tests wrap them to see which ran).
        kernels = {"serial": _same_meta, "parallel": _same_meta_parallel}

        def check_meta(tensors: list, ids, impls, meta) -> bool:
            n = len(tensors)
            # On the pool where it pays; otherwise, or when the pool is busy, on this thread.
            if _pool_pays(n, "check"):
                same = _on_pool("check", kernels["parallel"], (id(tensors), n, ids, impls, meta, proto))
                if same is not None:
                    return same
            return kernels["serial"](id(tensors), n, ids, impls, meta, proto)

        # Verify the calibration by mutating metadata in place and reading it back.
        try:
            a = torch.zeros(4, 6)
            b = torch.zeros(10, dtype=torch.float64)
            c = torch.zeros(3, dtype=torch.complex64)
            probe = [a, b, c]
            ok = True
            for mutate in (lambda: a.t_(), lambda: a.resize_(3), lambda: a.as_strided_((2, 2), (1, 3)),
                           lambda: setattr(b, "data", b.data.view(torch.int64)[:4]),
                           lambda: b.set_(torch.empty(3, dtype=torch.int64).untyped_storage()),
                           lambda: b.resize_(1 << 16), lambda: a.set_(a.untyped_storage(), 1, (2,), (1,)),
                           lambda: b.untyped_storage().resize_(b.untyped_storage().nbytes() + 8),
                           lambda: setattr(c, "data", c.conj())):
                before = snapshot(probe)
                mutate()
                after = snapshot(probe)
                for row, t in zip(after, probe):
                    nd, sizes, strides, numel = _meta_of(t)
                    ok &= (row[0] == nd and list(row[1 : 1 + nd]) == sizes
                           and list(row[6 : 6 + nd]) == strides and row[11] == numel
                           and row[13] == t.untyped_storage()._cdata and row[14] == t.storage_offset()
                           and row[15] == t.untyped_storage().data_ptr()
                           and row[19] == t.untyped_storage().nbytes() and row[20] == id(type(t)))
                ok &= not np.array_equal(before, after)
            ok &= c.is_conj()
            ids = np.array([id(t) for t in probe], dtype=np.int64)
            impls = np.array([t._cdata for t in probe], dtype=np.int64)
            meta = snapshot(probe)
            ok = ok and check_meta(probe, ids, impls, meta)
            a.unsqueeze_(0)
            ok = ok and not check_meta(probe, ids, impls, meta)
            meta = snapshot(probe)
            b.__class__ = _ClassProbe  # (the only change: ob_type)
            ok = ok and not check_meta(probe, ids, impls, meta)
        except Exception:
            ok = False
        def check_one(t, ids, impls, meta) -> bool:
            # One tensor (an op's flat buffer), always on this thread, and not through
            # ``kernels``: tests spy there on the plan checks alone.
            lst = [t]
            return _same_meta(id(lst), 1, ids, impls, meta, proto)

        if ok:
            check.snapshot = snapshot
            check.check_meta = check_meta
            check.check_one = check_one
            check.meta_kernels = kernels

    # Self-test against the Python answers before trusting the layout assumptions.
    probe = [torch.zeros(3), torch.ones(2), torch.empty(0)]
    ids = np.array([id(t) for t in probe], dtype=np.int64)
    impls = np.array([t._cdata for t in probe], dtype=np.int64)
    ptrs = np.array([t.data_ptr() for t in probe], dtype=np.int64)
    try:
        ok = check(probe, ids, impls, ptrs) and not check(probe[::-1], ids, impls, ptrs)
        ptrs_bad = ptrs.copy()
        ptrs_bad[1] += 4
        ok = ok and not check(probe, ids, impls, ptrs_bad)
    except Exception:
        ok = False
    return check if ok else None


class _ClassProbe(torch.Tensor):
    """A class the calibration assigns to a probe tensor in place (``__class__ =``)."""


_numba_check = None
_numba_check_ready = False


def metadata_guard(tensors):
    """A C++ guard of each tensor's dtype, device, sizes and strides, or None where this
    torch has no dynamo guards (then cached plans are never trusted)."""
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    tensor_guards = getattr(guards, "TensorGuards", None)
    if tensor_guards is None:
        return None
    try:
        return tensor_guards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)
    except Exception:  # a tensor subclass dynamo cannot guard: never trust the cache
        return None


def _checker():
    global _numba_check, _numba_check_ready
    if not _numba_check_ready:
        with _INIT_LOCK:
            if not _numba_check_ready:
                # Probes must be normal tensors (inference tensors have no version counter
                # and refuse in-place metadata changes), whatever mode the first call runs in.
                with torch.inference_mode(False), torch.no_grad():
                    _numba_check = _make_numba_check()
                _numba_check_ready = True
    return _numba_check


def metadata_snapshot(tensors: tuple, numels: np.ndarray, dtypes: list):
    """``(meta, guard)`` for a new plan: a snapshot of each tensor's metadata for the
    compiled check, or else (no calibration, a tensor with more than 5 dimensions, or a
    snapshot that disagrees with what torch reports) a C++ guard."""
    check = _checker()
    snapshot = getattr(check, "snapshot", None)
    if snapshot is not None:
        meta = snapshot(list(tensors))
        codes = {}
        consistent = all(codes.setdefault(dt, c) == c for dt, c in zip(dtypes, meta[:, 12].tolist()))
        if (meta[:, 0] >= 0).all() and np.array_equal(meta[:, 11], numels) and consistent:
            return meta, None
    return None, metadata_guard(tensors)


def snapshot_one(t: torch.Tensor):
    """What :func:`same_one` compares ``t`` with later: its identity and a snapshot of
    its metadata (data pointer, dtype, sizes, strides, storage and its size, dispatch
    keys), or None where the compiled check is not available for it (no calibration,
    more than 5 dimensions)."""
    snapshot = getattr(_checker(), "snapshot", None)
    if snapshot is None:
        return None
    meta = snapshot([t])
    if meta[0, 0] < 0 or meta[0, 11] != t.numel():
        return None
    return np.array([id(t)], np.int64), np.array([t._cdata], np.int64), meta


def same_one(t: torch.Tensor, snap) -> bool:
    """True if ``t`` is the tensor object ``snap`` (from :func:`snapshot_one`) was taken
    of and none of its metadata changed since (about a microsecond)."""
    return _numba_check.check_one(t, *snap)


def same_tensors(tensors, plan) -> bool:
    """True if ``tensors`` are ``plan.tensors`` (the same objects, in order) and each still
    has the class, data pointer, dtype, sizes and strides it had when the plan was built."""
    if len(tensors) != len(plan.tensors) or (plan.meta is None and plan.guard is None):
        return False
    check = _checker()
    lst = tensors if type(tensors) is list else list(tensors)
    if plan.meta is not None:
        return check.check_meta(lst, plan.ids, plan.impls, plan.meta)
    if check is not None:
        same = check(lst, plan.ids, plan.impls, plan.ptrs_arr)
    else:
        same = _python_check(tensors, plan.impls, plan.ptrs, plan.tensors)
    return same and plan.guard.check(*tensors)
