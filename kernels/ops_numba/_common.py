"""Numba building blocks shared by the CPU kernels: raw addresses as typed arrays, and
element loads/stores for every dtype fastpar accepts.

numpy (and so Numba) has no bfloat16, and Numba has no CPU float16 arithmetic, so both
are stored as ``uint16`` bits and converted by hand: float16 through LLVM's ``half``
type (one ``vcvtph2ps``/``vcvtps2ph`` on F16C CPUs), bfloat16 with round-to-nearest-even
bit arithmetic, exactly as c10 does. float64 -> 16-bit goes through float32 first, as
c10's ``Half(float)``/``BFloat16(float)`` constructors do, so results match torch bit
for bit.
"""
from __future__ import annotations

import contextlib
import functools
import platform
import threading

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .. import _launch

# torch dtype -> (kind, numpy storage dtype). The kind picks the load/store pair.
KINDS: dict[torch.dtype, tuple[str, type]] = {
    torch.float32: ("plain", np.float32),
    torch.float64: ("plain", np.float64),
    torch.float16: ("f16", np.uint16),
    torch.bfloat16: ("bf16", np.uint16),
    torch.int64: ("plain", np.int64),
    torch.int32: ("plain", np.int32),
    torch.int16: ("i16", np.int16),
    torch.int8: ("i8", np.int8),
    torch.uint8: ("u8", np.uint8),
}

# Same-dtype copies move bits: one unsigned type per element size (covers bool,
# complex and anything else of these sizes).
RAW_BY_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@intrinsic
def address_as_pointer(typingctx, addr, proto):
    """``proto``: any array whose dtype names the element type of the pointer."""
    ptrty = types.CPointer(proto.dtype)
    sig = ptrty(types.int64, proto)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptrty))

    return sig, codegen


@intrinsic
def _half_bits_to_f32(typingctx, bits):
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen


@intrinsic
def _f32_to_half_bits(typingctx, x):
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def _f32_as_u32(typingctx, x):
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def _u32_as_f32(typingctx, x):
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@numba.njit(nogil=True, cache=True)
def f32_to_bf16_bits(x):
    """float32 -> bfloat16 bits, round to nearest even; NaN -> 0x7FC0 (as c10)."""
    if x != x:
        return np.uint16(0x7FC0)
    b = _f32_as_u32(x)
    b = b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))
    return np.uint16(b >> np.uint32(16))


@numba.njit(nogil=True, cache=True)
def bf16_bits_to_f32(bits):
    return _u32_as_f32(np.uint32(bits) << np.uint32(16))


# Loads return the value in its compute type (float32 for 16-bit floats); stores take any
# numeric value and convert it to the storage type.
@numba.njit(nogil=True, cache=True)
def load_plain(a, i):
    return a[i]


@numba.njit(nogil=True, cache=True)
def load_f16(a, i):
    return _half_bits_to_f32(a[i])


@numba.njit(nogil=True, cache=True)
def load_bf16(a, i):
    return bf16_bits_to_f32(a[i])


@numba.njit(nogil=True, cache=True)
def store_plain(a, i, v):
    a[i] = v


@numba.njit(nogil=True, cache=True)
def store_u8(a, i, v):
    # Through int64, as c10's TypeCast does for uint8: -1.0 -> 255. A direct
    # float -> uint8 conversion (LLVM's fptoui) is undefined for negative values: the
    # vector code for one x86-64 CPU wrapped them, for another clamped them to 0.
    a[i] = np.int64(v)


def store_narrow_int(a, i, v):
    """Store ``v`` into an int8/int16 array as torch does on x86-64 (see its overload)."""


@overload(store_narrow_int, jit_options={"nogil": True})
def _store_narrow_int(a, i, v):
    if not isinstance(v, types.Float):
        def store_int(a, i, v):  # integers: the low bits, as every integer cast
            a[i] = v
        return store_int

    def store_float(a, i, v):
        # A float goes through int32 (c10's static_cast, compiled to cvttss2si), whose
        # out-of-range and NaN result is INT32_MIN: low bits 0. LLVM's direct conversion
        # to int8/int16 is undefined out of range, and its vector code saturated
        # (300.0 -> 127 where torch gives 44).
        if v >= -2147483648.0 and v < 2147483648.0:
            a[i] = np.int32(v)
        else:
            a[i] = 0
    return store_float


@numba.njit(nogil=True, cache=True)
def store_f16(a, i, v):
    a[i] = _f32_to_half_bits(np.float32(v))


@numba.njit(nogil=True, cache=True)
def store_bf16(a, i, v):
    a[i] = f32_to_bf16_bits(np.float32(v))


LOADS = {"plain": load_plain, "u8": load_plain, "i8": load_plain, "i16": load_plain, "f16": load_f16,
         "bf16": load_bf16}
STORES = {"plain": store_plain, "u8": store_u8, "i8": store_narrow_int, "i16": store_narrow_int,
          "f16": store_f16, "bf16": store_bf16}


def storage(dtype: torch.dtype, raw: bool):
    """(kind, numpy storage dtype) for ``dtype``; ``raw`` copies bits."""
    if raw:
        return "plain", RAW_BY_SIZE[dtype.itemsize]
    return KINDS[dtype]


_F32_MAX = float(np.finfo(np.float32).max)


def compute_scale(src: torch.dtype, dst: torch.dtype, scale: float):
    """The scale in the compute type: float64 if either side is float64, else float32
    (a scale beyond float32's range becomes inf, as torch's, without numpy's warning)."""
    if torch.float64 in (src, dst):
        return np.float64(scale)
    if abs(scale) <= _F32_MAX or scale != scale:
        return np.float32(scale)
    with np.errstate(over="ignore"):  # (entered only here: it costs a microsecond)
        return np.float32(scale)


# ---------------------------------------------------------------------------------------
# Non-temporal (streaming) stores, for copies far larger than the caches: a normal store
# first reads the destination line into cache (read-for-ownership), so a copy moves three
# bytes per byte copied; a streaming store writes the line without reading it. Measured
# here on 177 MB copied to 3 destinations: 16-23 ms streaming vs 26-35 ms for three
# ``copy_`` calls. x86-64 only (``movntdq``/``vmovntdq``); elsewhere plain stores.

#: Streaming stores are used on this machine.
HAS_STREAM = platform.machine().lower() in ("x86_64", "amd64")
#: Copies shorter than this use plain stores: a partly written line would be flushed
#: from the write-combining buffer as a slow partial write, and small copies are
#: better left in cache for whoever reads them next.
STREAM_MIN_BYTES = 4096


def _store_nontemporal(builder, value, addr) -> None:
    """Store ``value`` (a vector) at the 32-byte-aligned integer address ``addr`` with a
    non-temporal (streaming) store: LLVM's ``!nontemporal`` metadata, which x86-64
    lowers to ``movnt*``."""
    st = builder.store(value, builder.inttoptr(addr, value.type.as_pointer()), align=32)
    st.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))


@intrinsic
def _stream_32(typingctx, dst, src):
    """Copy 32 bytes from address ``src`` (any alignment) to address ``dst`` (32-byte
    aligned) with a non-temporal store."""
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        vec = ir.VectorType(ir.IntType(64), 4)
        v = builder.load(builder.inttoptr(args[1], vec.as_pointer()), align=1)
        _store_nontemporal(builder, v, args[0])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _store_fence(typingctx):
    """``sfence``: streaming stores are weakly ordered; this makes them visible before
    anything the thread does next (e.g. signalling the end of a parallel region)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        name = "llvm.x86.sse.sfence"
        fn = builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(ir.VoidType(), []), name)
        builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _memcpy(typingctx, dst, src, n):
    """``memcpy(dst, src, n)`` on raw addresses (LLVM's intrinsic: small copies inline,
    large ones glibc's tuned routine)."""
    sig = types.void(types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        cgutils.raw_memcpy(builder, builder.inttoptr(args[0], i8p), builder.inttoptr(args[1], i8p), args[2], 1)
        return context.get_dummy_value()

    return sig, codegen



#: Elements converted and stored per step of the streaming cast (:func:`cast_stream_for`):
#: 16 float32 lanes are two AVX2 registers, and 16 16-bit results one 32-byte store.
CAST_LANES = 16
#: How far ahead of its loads the streaming cast prefetches its source, in bytes. This
#: VM's hardware prefetchers left a 25 MB float32 -> bfloat16 cast 20-35% slower without
#: it (1024 to 8192 measured alike; 4096 kept).
PREFETCH_BYTES = 4096
#: torch dtype -> element kind of the streaming cast (computed in float32, as the
#: scalar loads and stores do for these dtypes).
CAST_KINDS: dict[torch.dtype, str] = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


@functools.cache
def cast_stream_for(src_kind: str, dst_kind: str, scaled: bool):
    """An intrinsic ``cast(dst, src, scale)`` on raw addresses: load ``CAST_LANES``
    elements of kind ``src_kind`` ("f32", "bf16" or "f16", see ``CAST_KINDS``) from
    ``src`` (any alignment of the element type), multiply them by the float32 ``scale``
    when ``scaled``, convert them to ``dst_kind`` and write them to ``dst`` (32-byte
    aligned) with non-temporal stores, prefetching the source ``PREFETCH_BYTES`` ahead.

    Bit for bit what ``LOADS``/``STORES`` compute one element at a time (a NaN's payload
    aside where a NaN meets a NaN scale: the product's payload depends on the operand
    order the compiler picked, in the typed loop too): bfloat16 rounds to nearest even
    with NaN -> 0x7FC0 (``f32_to_bf16_bits``), float16 through LLVM's ``half``
    (``vcvtps2ph``). Written as vector IR because Numba's loops do not emit
    streaming stores, and the scalar loop's stores read every destination line first.
    The caller must follow its streaming stores with :func:`store_fence`."""
    lanes = CAST_LANES

    @intrinsic
    def _cast_stream(typingctx, dst, src, scale):
        sig = types.void(types.int64, types.int64, types.float32)

        def codegen(context, builder, signature, args):
            f32, i32, i16, i64 = ir.FloatType(), ir.IntType(32), ir.IntType(16), ir.IntType(64)
            vf, vi32, vi16 = ir.VectorType(f32, lanes), ir.VectorType(i32, lanes), ir.VectorType(i16, lanes)
            vhalf = ir.VectorType(ir.HalfType(), lanes)

            def splat(ty, v):
                return ir.Constant(ty, [v] * lanes)

            dst_addr, src_addr, factor = args
            i8p = ir.IntType(8).as_pointer()
            prefetch_ty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            # (declare_intrinsic names it for this llvmlite: "p0i8" with typed pointers,
            # "p0" with opaque ones.)
            prefetch = builder.module.declare_intrinsic("llvm.prefetch", [i8p], prefetch_ty)
            ahead = builder.inttoptr(builder.add(src_addr, ir.Constant(i64, PREFETCH_BYTES)), i8p)
            # (read, keep in all cache levels, data): prefetches never fault, so one past
            # the source's end is harmless.
            builder.call(prefetch, [ahead, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            if src_kind == "f32":
                x = builder.load(builder.inttoptr(src_addr, vf.as_pointer()), align=4)
            else:
                h = builder.load(builder.inttoptr(src_addr, vi16.as_pointer()), align=2)
                if src_kind == "f16":
                    x = builder.fpext(builder.bitcast(h, vhalf), vf)
                else:  # bfloat16: the high half of a float32
                    x = builder.bitcast(builder.shl(builder.zext(h, vi32), splat(vi32, 16)), vf)
            if scaled:
                v = builder.insert_element(ir.Constant(vf, ir.Undefined), factor, ir.Constant(i32, 0))
                x = builder.fmul(x, builder.shuffle_vector(v, ir.Constant(vf, ir.Undefined), splat(vi32, 0)))
            if dst_kind == "f32":
                out = x
            elif dst_kind == "f16":
                out = builder.bitcast(builder.fptrunc(x, vhalf), vi16)
            else:  # bfloat16, as f32_to_bf16_bits: + 0x7FFF + lowest kept bit, NaN -> 0x7FC0
                b = builder.bitcast(x, vi32)
                lsb = builder.and_(builder.lshr(b, splat(vi32, 16)), splat(vi32, 1))
                rounded = builder.add(builder.add(b, splat(vi32, 0x7FFF)), lsb)
                bits = builder.trunc(builder.lshr(rounded, splat(vi32, 16)), vi16)
                out = builder.select(builder.fcmp_unordered("uno", x, x), splat(vi16, 0x7FC0), bits)
            _store_nontemporal(builder, out, dst_addr)
            return context.get_dummy_value()

        return sig, codegen

    return _cast_stream


if HAS_STREAM:

    @numba.njit(nogil=True)
    def copy_bytes(dst, src, n, stream):
        """Copy ``n`` bytes from address ``src`` to address ``dst`` (non-overlapping);
        with ``stream``, the 32-byte-aligned body of a copy of at least
        ``STREAM_MIN_BYTES`` is written with streaming stores, which the caller must
        follow with :func:`store_fence` before anything else reads the destination."""
        if not stream or n < STREAM_MIN_BYTES:
            _memcpy(dst, src, n)
            return
        head = (-dst) & 31
        end = head + ((n - head) & ~31)
        _memcpy(dst, src, head)
        i = head
        while i < end:
            _stream_32(dst + i, src + i)
            i += 32
        _memcpy(dst + end, src + end, n - end)

    @numba.njit(nogil=True)
    def store_fence():
        _store_fence()

else:

    @numba.njit(nogil=True)
    def copy_bytes(dst, src, n, stream):
        """Copy ``n`` bytes from address ``src`` to address ``dst`` (non-overlapping)."""
        _memcpy(dst, src, n)

    @numba.njit(nogil=True)
    def store_fence():
        pass


# ---------------------------------------------------------------------------------------
# Parallel regions and fork.

#: Held while a parallel kernel runs. Numba's ``workqueue`` threading layer (what it
#: uses where neither TBB nor GNU OpenMP is installed) aborts the process when two
#: threads enter parallel regions at once ("Concurrent access has been detected"), and
#: user threads, DDP's gloo callback thread and the autograd thread may all launch. The
#: kernels are memory-bound and each already uses every core: serialising them costs
#: little. Serial launches (small calls) need no lock. A plain ``Lock``, not reentrant:
#: the plan check's non-blocking acquire must find the pool busy also when this very
#: thread holds it (it is held only around a kernel call, never across code that forks).
PARALLEL_LOCK = _launch.fork_safe_lock(threading.Lock())


def launch_lock(parallel: bool):
    """``PARALLEL_LOCK`` for a parallel launch, else a no-op context."""
    return PARALLEL_LOCK if parallel else contextlib.nullcontext()


def bound_launch(kernel, parallel: bool, serial):
    """``launch(*args)`` for a launch bound once and run many times (the DDP hooks'
    cached passes): ``kernel`` itself when serial; when parallel, ``kernel`` under
    ``PARALLEL_LOCK``, or the kernel ``serial()`` returns where :func:`parallel_ok` has
    turned False since binding (the bound launch is run in a forked child)."""
    if not parallel:
        return kernel

    def launch(*args) -> None:
        if parallel_ok():
            with PARALLEL_LOCK:
                kernel(*args)
        else:
            serial()(*args)

    return launch


def balanced_chunk(numels: np.ndarray, chunk: int, parallel: bool) -> int:
    """The chunk a launch of ``chunk`` elements per block uses over tensors of
    ``numels``: ``chunk`` itself, except for a parallel launch over one tensor (a DDP
    bucket) in fewer than 8 blocks a thread, whose block count is rounded up to a
    multiple of the thread count and its blocks made equal (a multiple of 64 elements).
    ``prange`` hands each thread an equal run of blocks: 7 blocks on 2 threads leave one
    thread 4 and the call 10-14% longer, measured with the chunk of 1M elements tuned at
    4M on a 6.5M-element bucket. With 8 blocks a thread or more, one block more is at
    most an eighth of a thread's share; and many tensors are left as mapped."""
    if not parallel or len(numels) != 1 or isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) \
            or chunk < 1:
        return chunk  # (a bad chunk goes on to the chunk map's check, which names it)
    n, threads = int(numels[0]), numba.get_num_threads()
    blocks = -(-n // chunk)
    if blocks % threads == 0 or blocks >= 8 * threads:
        return chunk
    blocks = -(-blocks // threads) * threads
    even = -(-(-(-n // blocks)) // 64) * 64
    # (Rounding up to 64 can merge the last blocks of a tiny tensor: then as mapped.)
    return even if -(-n // even) % threads == 0 else chunk


def parallel_ok() -> bool:
    """False where a parallel region may not start or is not wanted: in a process forked
    after ``import fastpar`` or in a DataLoader worker (:func:`fastpar.kernels._launch.forked`),
    and wherever torch itself runs on one thread (``torch.set_num_threads(1)``, as
    DataLoader workers and ``OMP_NUM_THREADS=1`` set). With GNU OpenMP (Numba's ``omp``
    layer on Linux, sharing torch's ``libgomp``), a forked child that starts a parallel
    region after its parent did is killed with SIGTERM ("fork() called from a process
    already using GNU OpenMP") or hangs at the region's barrier. A child forked before
    fastpar was imported that still runs torch on several threads is not recognised."""
    return torch.get_num_threads() > 1 and not _launch.forked()
