"""Triton building blocks shared by the GPU kernels.

Every kernel here runs two ways: compiled for CUDA tensors, and under the Triton
interpreter for CPU tensors (the test suite's way to run GPU code without a GPU; raw
host addresses in pointer tables are valid there because the interpreter leaves CPU
tensors where they are). :class:`Kernel` picks the way per launch.
"""
from __future__ import annotations

import types

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

# torch dtype -> Triton element type for loads and arithmetic.
TL_DTYPES = {
    torch.float32: tl.float32,
    torch.float64: tl.float64,
    torch.float16: tl.float16,
    torch.bfloat16: tl.bfloat16,
    torch.int64: tl.int64,
    torch.int32: tl.int32,
    torch.int16: tl.int16,
    torch.int8: tl.int8,
    torch.uint8: tl.uint8,
}
# Same-dtype copies move bits, one integer type per element size.
RAW_BY_SIZE = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


def _interpretable(fn, _memo=None):
    """``fn`` re-bound to a copy of its globals in which every ``@triton.jit`` helper is
    an interpreted one: the interpreter runs a kernel's Python in its module globals,
    where a compiled helper refuses to be called. (Under ``TRITON_INTERPRET=1`` every
    ``triton.jit`` is already interpreted and nothing needs re-binding.)"""
    memo = {} if _memo is None else _memo
    if fn in memo:
        return memo[fn]
    g = dict(fn.__globals__)
    new = types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    new.__annotations__ = fn.__annotations__
    memo[fn] = new
    for name in fn.__code__.co_names:
        value = g.get(name)
        if isinstance(value, JITFunction):
            g[name] = InterpretedFunction(_interpretable(value.fn, memo))
    return new


class Kernel:
    """A ``@triton.jit`` function launchable on CUDA tensors (compiled) and on CPU
    tensors (interpreted). ``kernel.on(device)[grid](...)``.

    Helpers a kernel calls by name are re-bound for the interpreter; the ``@jit``
    functions inside ``triton.language`` itself (``tl.zeros``, ``tl.cdiv``, ...) are not,
    so kernels use the builtins (``tl.full``, ...) instead.
    """

    def __init__(self, jit_fn) -> None:
        self.jit = jit_fn
        self._interpreted = None

    def on(self, device: torch.device):
        if isinstance(self.jit, InterpretedFunction):
            if device.type == "cuda":
                # The interpreter copies the pointer table to the host, where its
                # entries (device addresses) would be dereferenced: a crash, not a run.
                raise RuntimeError(
                    "TRITON_INTERPRET=1 is set, and the Triton interpreter runs fastpar's kernels on "
                    f"CPU tensors only; got tensors on {device}. Unset TRITON_INTERPRET for CUDA "
                    "tensors (or use FASTPAR_BACKEND=torch)"
                )
            return self.jit
        if device.type == "cuda":
            return self.jit
        if self._interpreted is None:
            self._interpreted = InterpretedFunction(_interpretable(self.jit.fn))
        return self._interpreted


def keep_for_stream(table: torch.Tensor) -> None:
    """Tell the CUDA caching allocator that ``table`` (a pointer table) is read on the
    current stream. A cached plan's table is made on whatever stream was current at its
    first launch and read by later launches on any stream (a user's side stream, DDP's
    callbacks); without this, freeing it (the plan evicted) while such a launch is still
    queued would let the allocator hand its memory to work on the first stream."""
    if table.is_cuda:
        table.record_stream(torch.cuda.current_stream(table.device))


@triton.jit
def find_tensor(begin, pid, n_tensors):
    """The tensor program ``pid`` works on: the last ``t`` with ``begin[t] <= pid``.

    ``begin`` (``*i64``, ``n_tensors`` entries) holds each tensor's first program, tensors
    in order: non-decreasing from 0, an empty tensor sharing the next one's. The table
    thus has one entry per tensor instead of one per program: a per-call table of one
    per program cost ~190 us of host time on an H200 for a Transformer's 184 tensors.

    A binary search of scalar loads, ``ceil(log2(n_tensors))`` of them (8 for 184
    tensors, 14 for 10,000), every thread of the program reading the same entry: the
    entries stay in L1/L2 for the launch. (A search comparing many entries per step
    needs a reduction across warps: shared memory, barriers, and 32-bit lane compares.)
    ``pid``: integer scalar; ``n_tensors``: integer scalar or constexpr, at least 1
    (taken to int64 here: a kernel's i32 argument, or the constant Triton makes of a 1,
    would otherwise change ``hi``'s type in the loop, which compiles to an error while
    the interpreter runs it). Every value is 64-bit. Only ``begin[0] <= 0`` is assumed
    of the first entry (tests/test_big_offsets.py seeds a negative one)."""
    lo = tl.full((), 0, tl.int64)  # begin[lo] <= pid (begin[0] <= 0)
    hi = tl.cast(n_tensors, tl.int64)  # hi == n_tensors or begin[hi] > pid
    while hi - lo > 1:
        mid = (lo + hi) >> 1  # (both >= 0: a shift, not a signed division's fix-up)
        below = tl.load(begin + mid) <= pid
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    return lo


@triton.jit
def to_storage(x, DST: tl.constexpr):
    """Convert ``x`` for a store of dtype ``DST`` the way torch does.

    bfloat16 is produced by hand, round to nearest even with NaN -> 0x7FC0 as c10 does,
    and returned as int16 bits (store it through an int16 pointer): the hardware's
    ``cvt.rn.bf16.f32`` agrees except for NaN (it writes 0x7FFF), and the interpreter
    truncates. float64 -> 16-bit goes
    through float32, matching c10's ``Half(float)``/``BFloat16(float)`` double rounding.
    """
    if DST == tl.bfloat16:
        x32 = x.to(tl.float32)
        b = x32.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where(x32 != x32, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.int16, bitcast=True)
    elif DST == tl.float16:
        return x.to(tl.float32).to(tl.float16)
    elif DST == tl.uint8 and x.dtype.is_floating():
        # torch converts float -> uint8 through int64 ("consistent results across
        # CPU/GPU", c10/util/TypeCast.h): the direct conversion (cvt.rzi.u16.f32) clamps
        # -1.0 to 0 where torch gives 255.
        return x.to(tl.int64).to(DST)
    elif (DST == tl.int8 or DST == tl.int16) and x.dtype.is_floating():
        # torch's static_cast<int8_t>(float) compiles (nvcc) to cvt.rzi.s32.f32 and keeps
        # the low bits: out-of-range values wrap through int32, as on the CPU (300.0 ->
        # 44). Triton's direct conversion is cvt.rzi.s16.f32, which clamps to the int16
        # range first (1e5 -> -1 in int8 where torch gives -96).
        return x.to(tl.int32).to(DST)
    else:
        return x.to(DST)


def storage_type(dtype):
    """The Triton type a value of ``dtype`` is stored through (bf16 -> int16 bits)."""
    return tl.int16 if dtype == tl.bfloat16 else dtype


def copy_types(src: torch.dtype, dst: torch.dtype, scaled: bool):
    """(SRC, DST, COMPUTE) Triton types for a copy from ``src`` to ``dst``.

    Same dtype and no scale moves raw bits; otherwise values are converted, and scaled
    in float64 if either side is float64, else float32.
    """
    if src == dst and not scaled:
        raw = RAW_BY_SIZE[src.itemsize]
        return raw, raw, raw
    compute = tl.float64 if torch.float64 in (src, dst) else tl.float32
    return TL_DTYPES[src], TL_DTYPES[dst], compute


def align_elems(src: torch.dtype, dst: torch.dtype) -> int:
    """Elements per 16 bytes of the narrower side: numels and offsets must be multiples
    of it for whole 128-bit vectors on both sides."""
    return 16 // min(src.itemsize, dst.itemsize)
