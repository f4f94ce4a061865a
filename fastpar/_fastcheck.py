"""C-speed re-validation of a cached plan: "are these the same tensor objects, each
still at the same data address, with the same dtype, sizes and strides?".

Every cache hit checks identity and data pointer, then dtype, sizes and strides: the
latter is what catches in-place metadata changes that keep the data pointer (``t_()``, a
shrinking ``resize_()``, ``as_strided_()``, ``p.data = p.data[:n]``), which would
otherwise make a stale plan copy the wrong elements. One Numba loop over the list's
items does it all, tens of microseconds for 10,000 tensors, reading each tensor's
``TensorImpl`` fields (ndim, inline sizes and strides, numel, dtype) at offsets found by
calibrating against probe tensors at first use and verified by mutating them; where that
calibration fails, or a tensor has more than 5 dimensions (sizes out of line), dynamo's
C++ ``TensorGuards`` does the metadata check instead (about 80 ns a tensor).

In Python every per-tensor getter costs 30-60 ns (``map(Tensor.data_ptr, ...)`` takes
0.6 ms for 10,000 tensors, ten times the copy itself), so a Numba function does the loop:
it reads the list's item pointers (``PyListObject.ob_item``) and calls torch's exported
C accessor ``_torchinductor_pyobject_tensor_data_ptr(PyObject*)`` (what inductor's
generated C++ uses) on each. Both rest on CPython / torch internals, so they are
self-tested at import and the pure-Python check is used when anything is off (another
Python layout, a free-threaded build, a torch without the symbol).
"""
from __future__ import annotations

import ctypes
import operator
import sys
import sysconfig

import numba
import numpy as np
import torch

_T = torch.Tensor
_get_cdata = operator.attrgetter("_cdata")
_OB_ITEM_OFFSET = 24  # PyListObject: ob_refcnt, ob_type, ob_size, then ob_item


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
    def _same(list_addr, n, ids, impls, ptrs, proto):
        # Runs with the GIL held: the list cannot change under us.
        header = numba.carray(address_as_pointer(list_addr, proto), (4,))
        if header[2] != n:  # ob_size
            return False
        items = numba.carray(address_as_pointer(header[3], proto), (n,))
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
    if layout is not None:
        _, k, m, d = layout

        @numba.njit(nogil=False, cache=False)
        def _snapshot(list_addr, n, proto):
            """Row per tensor: ndim, 5 sizes, 5 strides, numel, dtype (ndim > 5: -1)."""
            header = numba.carray(address_as_pointer(list_addr, proto), (4,))
            items = numba.carray(address_as_pointer(header[3], proto), (n,))
            out = np.zeros((n, 13), dtype=np.int64)
            for i in range(n):
                obj = numba.carray(address_as_pointer(items[i], proto), (impl_word + 1,))
                w = numba.carray(address_as_pointer(obj[impl_word], proto), (d + 1,))
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
            return out

        @numba.njit(nogil=False, cache=False)
        def _same_meta(list_addr, n, ids, impls, ptrs, meta, proto):
            if not _same(list_addr, n, ids, impls, ptrs, proto):
                return False
            header = numba.carray(address_as_pointer(list_addr, proto), (4,))
            items = numba.carray(address_as_pointer(header[3], proto), (n,))
            for i in range(n):
                obj = numba.carray(address_as_pointer(items[i], proto), (impl_word + 1,))
                w = numba.carray(address_as_pointer(obj[impl_word], proto), (d + 1,))
                nd = w[k]
                if nd != meta[i, 0] or w[m] != meta[i, 11] or (w[d] & 0xFFFF) != meta[i, 12]:
                    return False
                for j in range(nd):
                    if w[k + 1 + j] != meta[i, 1 + j] or w[k + 6 + j] != meta[i, 6 + j]:
                        return False
            return True

        def snapshot(tensors: list):
            return _snapshot(id(tensors), len(tensors), proto)

        def check_meta(tensors: list, ids, impls, ptrs_arr, meta) -> bool:
            return _same_meta(id(tensors), len(tensors), ids, impls, ptrs_arr, meta, proto)

        # Verify the calibration by mutating metadata in place and reading it back.
        try:
            a = torch.zeros(4, 6)
            b = torch.zeros(10, dtype=torch.float64)
            probe = [a, b]
            ok = True
            for mutate in (lambda: a.t_(), lambda: a.resize_(3), lambda: a.as_strided_((2, 2), (1, 3)),
                           lambda: setattr(b, "data", b.data.view(torch.int64)[:4])):
                before = snapshot(probe)
                mutate()
                after = snapshot(probe)
                for row, t in zip(after, probe):
                    nd, sizes, strides, numel = _meta_of(t)
                    ok &= (row[0] == nd and list(row[1 : 1 + nd]) == sizes
                           and list(row[6 : 6 + nd]) == strides and row[11] == numel)
                ok &= not np.array_equal(before, after)
            ids = np.array([id(t) for t in probe], dtype=np.int64)
            impls = np.array([t._cdata for t in probe], dtype=np.int64)
            ptrs = np.array([t.data_ptr() for t in probe], dtype=np.int64)
            meta = snapshot(probe)
            ok = ok and check_meta(probe, ids, impls, ptrs, meta)
            a.t_()
            ok = ok and not check_meta(probe, ids, impls, ptrs, meta)
        except Exception:
            ok = False
        if ok:
            check.snapshot = snapshot
            check.check_meta = check_meta

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


def same_tensors(tensors, plan) -> bool:
    """True if ``tensors`` are ``plan.tensors`` (the same objects, in order) and each still
    has the data pointer, dtype, sizes and strides it had when the plan was built."""
    if len(tensors) != len(plan.tensors) or (plan.meta is None and plan.guard is None):
        return False
    check = _checker()
    lst = tensors if type(tensors) is list else list(tensors)
    if plan.meta is not None:
        return check.check_meta(lst, plan.ids, plan.impls, plan.ptrs_arr, plan.meta)
    if check is not None:
        same = check(lst, plan.ids, plan.impls, plan.ptrs_arr)
    else:
        same = _python_check(tensors, plan.impls, plan.ptrs, plan.tensors)
    return same and plan.guard.check(*tensors)
