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

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

# torch dtype -> (kind, numpy storage dtype). The kind picks the load/store pair.
KINDS: dict[torch.dtype, tuple[str, type]] = {
    torch.float32: ("plain", np.float32),
    torch.float64: ("plain", np.float64),
    torch.float16: ("f16", np.uint16),
    torch.bfloat16: ("bf16", np.uint16),
    torch.int64: ("plain", np.int64),
    torch.int32: ("plain", np.int32),
    torch.int16: ("plain", np.int16),
    torch.int8: ("plain", np.int8),
    torch.uint8: ("plain", np.uint8),
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
def store_f16(a, i, v):
    a[i] = _f32_to_half_bits(np.float32(v))


@numba.njit(nogil=True, cache=True)
def store_bf16(a, i, v):
    a[i] = f32_to_bf16_bits(np.float32(v))


LOADS = {"plain": load_plain, "f16": load_f16, "bf16": load_bf16}
STORES = {"plain": store_plain, "f16": store_f16, "bf16": store_bf16}


def storage(dtype: torch.dtype, raw: bool):
    """(kind, numpy storage dtype) for ``dtype``; ``raw`` copies bits."""
    if raw:
        return "plain", RAW_BY_SIZE[dtype.itemsize]
    return KINDS[dtype]


def compute_scale(src: torch.dtype, dst: torch.dtype, scale: float):
    """The scale in the compute type: float64 if either side is float64, else float32."""
    return np.float64(scale) if torch.float64 in (src, dst) else np.float32(scale)
