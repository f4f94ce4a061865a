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

import ctypes
import os
import sys

import torch

__all__ = ["empty"]

_MADV_HUGEPAGE = 14  # <linux/mman.h>, the same on every Linux architecture
_HUGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
#: Below this a buffer gains little (one or two huge pages at most) and small
#: allocations come from the malloc heap, where faults are rarely taken afresh.
_MIN_BYTES = 4 << 20


def _load_madvise():
    if not sys.platform.startswith("linux") or os.environ.get("FASTPAR_HUGE_PAGES", "1") == "0":
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
