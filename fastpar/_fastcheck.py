"""C-speed re-validation of a cached plan: "are these the same tensor objects, each
still at the same data address, with the same dtype, sizes and strides?".

Two checks run on every cache hit. The first (identity and data pointer) is a Numba loop
over the list's items, tens of microseconds for 10,000 tensors; the second (dtype,
device, sizes, strides, requires_grad) is dynamo's C++ ``TensorGuards``, about 150 ns a
tensor. The second is what catches in-place metadata changes that keep the data pointer
(``t_()``, a shrinking ``resize_()``, ``as_strided_()``, ``p.data = p.data[:n]``), which
would otherwise make a stale plan copy the wrong elements.

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
_OB_ITEM_OFFSET = 24  # PyListObject: ob_refcnt, ob_type, ob_size, then ob_item


def _python_check(tensors: list, ids: np.ndarray, ptrs: list, cached: tuple) -> bool:
    return all(map(operator.is_, tensors, cached)) and list(map(_T.data_ptr, tensors)) == ptrs


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

    @numba.njit(nogil=False, cache=False)
    def _same(list_addr, n, ids, ptrs, proto):
        # Runs with the GIL held: the list cannot change under us.
        header = numba.carray(address_as_pointer(list_addr, proto), (4,))
        if header[2] != n:  # ob_size
            return False
        items = numba.carray(address_as_pointer(header[3], proto), (n,))
        for i in range(n):
            if items[i] != ids[i]:
                return False
        # Only the very objects the plan validated (and still references) get here,
        # so each is a live tensor.
        for i in range(n):
            if data_ptr_of(items[i]) != ptrs[i]:
                return False
        return True

    def check(tensors: list, ids: np.ndarray, ptrs_arr: np.ndarray) -> bool:
        return _same(id(tensors), len(tensors), ids, ptrs_arr, proto)

    # Self-test against the Python answers before trusting the layout assumptions.
    probe = [torch.zeros(3), torch.ones(2), torch.empty(0)]
    ids = np.array([id(t) for t in probe], dtype=np.int64)
    ptrs = np.array([t.data_ptr() for t in probe], dtype=np.int64)
    try:
        ok = check(probe, ids, ptrs) and not check(probe[::-1], ids, ptrs)
        ptrs_bad = ptrs.copy()
        ptrs_bad[1] += 4
        ok = ok and not check(probe, ids, ptrs_bad)
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


def same_tensors(tensors, plan) -> bool:
    """True if ``tensors`` are ``plan.tensors`` (the same objects, in order) and each still
    has the data pointer, dtype, sizes and strides it had when the plan was built."""
    global _numba_check, _numba_check_ready
    if len(tensors) != len(plan.tensors) or plan.guard is None:
        return False
    if not _numba_check_ready:
        _numba_check = _make_numba_check()
        _numba_check_ready = True
    if _numba_check is not None:
        lst = tensors if type(tensors) is list else list(tensors)
        same = _numba_check(lst, plan.ids, plan.ptrs_arr)
    else:
        same = _python_check(tensors, plan.ids, plan.ptrs, plan.tensors)
    return same and plan.guard.check(*tensors)
