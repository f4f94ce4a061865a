"""Every Triton kernel compiled ahead of time for sm_80 and sm_90 (no GPU needed), with
the PTX checked for what matters on hardware the interpreter cannot show."""
from __future__ import annotations

import re

import pytest
import torch
import triton
import triton.language as tl

from fastpar.kernels.ops_triton import aot
from fastpar.kernels.ops_triton._common import find_tensor

CCS = [80, 90]


@pytest.mark.parametrize("cc", CCS)
@pytest.mark.parametrize("to_flat", [True, False], ids=["flatten", "unflatten_into"])
def test_copy_fp32_aligned_uses_128bit_vectors(cc, to_flat):
    ptx = aot.compile_copy(cc, to_flat=to_flat)
    assert "ld.global.v4.b32" in ptx, "aligned fp32 copy must load 128-bit vectors"
    assert "st.global.v4.b32" in ptx, "aligned fp32 copy must store 128-bit vectors"


@pytest.mark.parametrize("cc", CCS)
def test_copy_unaligned_compiles_scalar(cc):
    ptx = aot.compile_copy(cc, aligned=False)
    assert ".entry" in ptx and "ld.global.v4" not in ptx


@pytest.mark.parametrize("cc", CCS)
@pytest.mark.parametrize(
    "src,dst,scaled",
    [
        (torch.float32, torch.bfloat16, True),
        (torch.float32, torch.float16, True),
        (torch.float16, torch.float32, False),
        (torch.bfloat16, torch.float64, True),
        (torch.float64, torch.bfloat16, False),
        (torch.int32, torch.float32, False),
    ],
    ids=str,
)
@pytest.mark.parametrize("to_flat", [True, False], ids=["flatten", "unflatten_into"])
def test_copy_conversions_compile_vectorised(cc, src, dst, scaled, to_flat):
    ptx = aot.compile_copy(cc, src=src, dst=dst, scaled=scaled, to_flat=to_flat)
    assert ".entry" in ptx
    # Both sides are 16-byte aligned: each moves whole 128-bit vectors (4 x 32 bits, or
    # 2 x 64 bits for float64; 16-bit values travel packed in 32-bit lanes).
    assert "ld.global.v4.b32" in ptx or "ld.global.v2.b64" in ptx, "expected 128-bit vector loads"
    assert "st.global.v4.b32" in ptx or "st.global.v2.b64" in ptx, "expected 128-bit vector stores"


@pytest.mark.parametrize("cc", CCS)
@pytest.mark.parametrize("src", [torch.float32, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("dst", [torch.int8, torch.int16, torch.uint8], ids=str)
def test_float_to_narrow_int_converts_as_torch_cuda(cc, src, dst):
    """torch's CUDA cast (``static_cast``, which nvcc compiles to ``cvt.rzi.s32.f32``)
    wraps out-of-range floats through int32 (uint8: through int64, c10's TypeCast.h).
    Triton's direct conversion to int8/int16 is ``cvt.rzi.s16``, which clamps first."""
    ptx = aot.compile_copy(cc, src=src, dst=dst, scaled=False, to_flat=True)
    wide = "s64" if dst == torch.uint8 else "s32"
    assert re.search(rf"cvt\.rzi\.{wide}\.f(16|32|64)", ptx), f"expected cvt.rzi.{wide} for {src} -> {dst}"
    assert not re.search(r"cvt\.rzi\.[su](8|16)\.f", ptx), "a direct (clamping) float -> 8/16-bit conversion"


@pytest.mark.parametrize("cc", CCS)
@pytest.mark.parametrize("k", [2, 4, 8])
def test_reduce_fp32_aligned_uses_128bit_vectors(cc, k):
    from fastpar.kernels.ops_triton import reduce_add as R

    ptx = aot.compile_reduce(cc, torch.float32, k)
    # Each of the K sources read with 128-bit loads only: BLOCK fp32 values spread over
    # 32 * num_warps threads, four per load, and no scalar 32-bit data load anywhere
    # (the table is read with 64-bit loads).
    per_source = R.DEFAULT_BLOCK // (32 * R.DEFAULT_NUM_WARPS * 4)
    assert ptx.count("ld.global.v4.b32") == k * per_source, "each of the K sources read with 128-bit loads"
    assert not re.search(r"ld\.global(\.\w+)*\.b32\b", ptx.replace("ld.global.v4.b32", "")), "a scalar data load"
    assert "st.global.v4.b32" in ptx
    # Table offsets computed in 64 bits although n_tensors arrives as i32.
    assert "mul.lo.s32" not in ptx


@pytest.mark.parametrize("cc", CCS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32], ids=str)
def test_reduce_other_dtypes_compile(cc, dtype):
    ptx = aot.compile_reduce(cc, dtype, 3)
    assert ".entry" in ptx and "ld.global.v" in ptx
    if dtype in (torch.float16, torch.bfloat16):
        assert "add.f32" in ptx or "add.rn.f32" in ptx, "16-bit sources accumulate in fp32"


def _compile_scale(cc, dtype, divide, aligned=True):
    """PTX of the in-place scale kernel as its launcher configures it."""
    from fastpar.kernels.ops_triton import scale as S

    cx = S.scale_constexprs(dtype, divide, aligned, S.DEFAULT_BLOCK)
    signature = {"table": "*i64", "n_tensors": "i32", "factor": "fp64"}
    return aot.compile_kernel(S._scale_kernel, signature, cx, cc, aligned_args=("table",)).asm["ptx"]


@pytest.mark.parametrize("cc", CCS)
def test_scale_fp32_aligned_uses_128bit_vectors(cc):
    ptx = _compile_scale(cc, torch.float32, divide=False)
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    assert "mul.f32" in ptx or "mul.rn.f32" in ptx


@pytest.mark.parametrize("cc", CCS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_scale_divides_correctly_rounded(cc, dtype):
    # torch's CPU div_ is the IEEE quotient; fp32 ``/`` in Triton is div.full.f32
    # (approximate), so the kernel must ask for div.rn.
    ptx = _compile_scale(cc, dtype, divide=True)
    assert "div.rn.f32" in ptx, "expected a correctly rounded fp32 division"
    assert "div.full.f32" not in ptx and "div.approx" not in ptx


@pytest.mark.parametrize("cc", CCS)
def test_scale_other_configs_compile(cc):
    assert "div.rn.f64" in _compile_scale(cc, torch.float64, divide=True)
    ptx = _compile_scale(cc, torch.float32, divide=False, aligned=False)
    assert ".entry" in ptx and "ld.global.v4" not in ptx



# --- 64-bit index arithmetic --------------------------------------------------------------
# Buffers of more than 2**31 elements (or 2**31 bytes) are the GPU's everyday case and the
# interpreter's never: a 32-bit index wraps silently on hardware. Checked twice:
# * in TTIR, every pointer offset (``tt.addptr``) is i64 and no i64 value (an address,
#   numel, offset or block start read from the table) is truncated to i32;
# * in PTX, no multiply forms a 32-bit result and no compare (the tail mask ``idx < n``)
#   is 32-bit. (``mul``/``mad.wide.[su]32``, 32-bit inputs into a 64-bit result, are the
#   table offsets ``k * n_tensors * 8`` and ``pid * 8``: fine.)
_NARROW_PTX = re.compile(r"\b(?:mul|mad)\.lo\.[su]32\b|\bsetp\.\w+\.[su]32\b")
_ADDPTR_32 = re.compile(r"tt\.addptr [^:\n]*: [^,\n]+, (?:tensor<[0-9x]*xi32>|i32)\b")
_TRUNC_64_32 = re.compile(r"arith\.trunci [^:\n]*: (?:tensor<[0-9x]*xi64>|i64) to (?:tensor<[0-9x]*xi32>|i32)\b")
# A product of 32-bit values, widened only afterwards (``(pid * BLOCK).to(tl.int64)``):
# PTX shows it as shl.b32 for a power of two, as it does lane arithmetic. No kernel
# multiplies in 32 bits (the bf16 rounding adds and shifts, never multiplies).
_MUL_32 = re.compile(r"arith\.muli [^\n]* : (?:tensor<[0-9x]*xi32>|i32)(?= loc\(|\s*$)", re.M)


# The one 32-bit compare allowed: of a 32-bit kernel argument itself with a constant.
# find_tensor's first loop test, ``n_tensors - 0 > 1`` in 64 bits, is narrowed by LLVM to
# the i32 argument it was sign-extended from (``setp.lt.s32 %p1, %r1, 2``): exact, and no
# index. Any compare of a computed 32-bit value still fails.
_PARAM_32 = re.compile(r"ld\.param\.[bsu]32\s+(%r\d+),")
_ARG_VS_CONST = re.compile(r"setp\.\w+\.[su]32\s+%p\d+,\s*(%r\d+),\s*-?\d+;")


def _narrow_ptx(ptx: str) -> list:
    args = set(_PARAM_32.findall(ptx))
    found = []
    for line in ptx.splitlines():
        hits = _NARROW_PTX.findall(line)
        m = _ARG_VS_CONST.search(line)
        if hits and not (m and m.group(1) in args):
            found += hits
    return found


def _check_64bit(kernel) -> None:
    ttir, ptx = kernel.asm["ttir"], kernel.asm["ptx"]
    assert "tt.addptr" in ttir and not _ADDPTR_32.findall(ttir), f"32-bit pointer offsets: {_ADDPTR_32.findall(ttir)}"
    assert not _TRUNC_64_32.findall(ttir), f"an i64 index truncated to i32: {_TRUNC_64_32.findall(ttir)}"
    assert not _MUL_32.findall(ttir), f"a 32-bit multiply: {_MUL_32.findall(ttir)}"
    assert not _narrow_ptx(ptx), f"32-bit index arithmetic: {sorted(set(_narrow_ptx(ptx)))}"
    assert re.search(r"setp\.lt\.s64", ptx), "the tail mask idx < numel must compare in 64 bits"


def _compile_copy_kernel(cc, src, dst, scaled, to_flat, aligned):
    """The copy kernel as ``aot.compile_copy`` builds it, whole (TTIR and PTX)."""
    from fastpar.kernels.ops_triton import flatten as F

    cx = F.copy_constexprs(src if to_flat else dst, dst if to_flat else src, scaled, to_flat, aligned,
                           F.DEFAULT_BLOCK)
    flat_ty = cx["STORE"] if to_flat else cx["SRC"]
    signature = {"table": "*i64", "n_tensors": "i32", "flat": aot._ty(flat_ty), "scale": "fp64"}
    return aot.compile_kernel(F._copy_kernel, signature, cx, cc, aligned_args=("table", "flat"))


@pytest.mark.parametrize("cc", CCS)
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("to_flat", [True, False], ids=["flatten", "unflatten_into"])
@pytest.mark.parametrize(
    "src,dst,scaled",
    [(torch.float32, torch.float32, False), (torch.float32, torch.bfloat16, True),
     (torch.int8, torch.int8, False), (torch.float64, torch.float16, False)],
    ids=str,
)
def test_copy_index_math_is_64bit(cc, aligned, to_flat, src, dst, scaled):
    _check_64bit(_compile_copy_kernel(cc, src, dst, scaled, to_flat, aligned))


@pytest.mark.parametrize("cc", CCS)
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_scale_index_math_is_64bit(cc, aligned, dtype):
    from fastpar.kernels.ops_triton import scale as S

    cx = S.scale_constexprs(dtype, True, aligned, S.DEFAULT_BLOCK)
    signature = {"table": "*i64", "n_tensors": "i32", "factor": "fp64"}
    _check_64bit(aot.compile_kernel(S._scale_kernel, signature, cx, cc, aligned_args=("table",)))


@pytest.mark.parametrize("cc", CCS)
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("dtype,k", [(torch.float32, 2), (torch.float16, 3), (torch.int8, 8)], ids=str)
def test_reduce_index_math_is_64bit(cc, aligned, dtype, k):
    from fastpar.kernels.ops_triton import reduce_add as R

    cx = R.reduce_constexprs(dtype, k, aligned, R.DEFAULT_BLOCK)
    signature = {"table": "*i64", "n_tensors": "i32"}
    _check_64bit(aot.compile_kernel(R._reduce_add_kernel, signature, cx, cc, aligned_args=("table",)))


@pytest.mark.parametrize("cc", CCS)
def test_no_kernel_flushes_subnormals(cc):
    """The Numba and torch backends keep float32 (and widened 16-bit) subnormals; a
    ``.ftz`` instruction (libdevice's flush-to-zero variants, picked under
    ``nvvm-reflect-ftz``) would zero them on the GPU only, where the interpreter cannot
    show it."""
    ptxs = []
    for src, dst, scaled in [(torch.float32, torch.float32, True), (torch.float32, torch.bfloat16, True),
                             (torch.float16, torch.float32, True), (torch.bfloat16, torch.float16, True),
                             (torch.float64, torch.float16, True), (torch.float32, torch.int8, False)]:
        for to_flat in (True, False):
            ptxs.append(_compile_copy_kernel(cc, src, dst, scaled, to_flat, True).asm["ptx"])
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        ptxs += [_compile_scale(cc, dtype, divide=True), _compile_scale(cc, dtype, divide=False),
                 aot.compile_reduce(cc, dtype, 3)]
    flushing = sorted({m for p in ptxs for m in re.findall(r"\b\w+(?:\.\w+)*\.ftz\b(?:\.\w+)*", p)})
    assert not flushing, f"flush-to-zero instructions: {flushing}"



@triton.jit
def _widened_after_32bit_product(table, n_tensors, flat, BLOCK: tl.constexpr):
    # pid * BLOCK formed in 32 bits and widened afterwards: it wraps past 2**31 elements
    # with every offset, compare and pointer add 64-bit. (PTX has no mul.lo.s32 for it:
    # a product by a power of two is emitted as shl.b32, which lane arithmetic also uses.)
    start = (tl.program_id(0) * BLOCK).to(tl.int64)
    idx = start + tl.arange(0, BLOCK)
    n = tl.load(table)
    x = tl.load(flat + idx, mask=idx < n)
    tl.store(flat + n + idx, x, mask=idx < n)


@triton.jit
def _index_compared_in_32bit(table, n_tensors, flat, BLOCK: tl.constexpr):
    # A 32-bit element index (program + lane) compared with a constant, widened only for
    # the pointers: no 32-bit multiply or pointer offset, only a compare the PTX check
    # (and not its allowance for an i32 argument against a constant) must find.
    idx = tl.program_id(0) + tl.arange(0, BLOCK)
    n = tl.load(table)
    m = (idx < 100000) & (idx.to(tl.int64) < n)
    x = tl.load(flat + idx.to(tl.int64), mask=m)
    tl.store(flat + n + idx.to(tl.int64), x, mask=m)


@pytest.mark.parametrize("cc", CCS)
@pytest.mark.parametrize(
    "kernel,match",
    [(_widened_after_32bit_product, "32-bit"), (_index_compared_in_32bit, "32-bit index arithmetic")],
    ids=["product-widened-after", "computed-index-compared"],
)
def test_64bit_check_catches_32bit_index_math(cc, kernel, match):
    """The checks above find a 32-bit index formed first and widened afterwards, and a
    32-bit compare of a computed index (which only the PTX check sees)."""
    signature = {"table": "*i64", "n_tensors": "i32", "flat": "*fp32"}
    compiled = aot.compile_kernel(kernel, signature, {"BLOCK": 1024}, cc, aligned_args=("table", "flat"))
    with pytest.raises(AssertionError, match=match):
        _check_64bit(compiled)


@pytest.mark.parametrize("cc", CCS)
def test_kernels_compile_for_one_tensor(cc):
    """Triton specialises an int argument equal to 1 as a constant: a one-tensor group
    (a DDP bucket, an RNN's single weight) launches every kernel with ``n_tensors`` a
    constexpr, which the interpreter never does."""
    from fastpar.kernels.ops_triton import flatten as F
    from fastpar.kernels.ops_triton import reduce_add as R
    from fastpar.kernels.ops_triton import scale as S

    for to_flat in (True, False):
        cx = F.copy_constexprs(torch.float32, torch.float32, False, to_flat, True, F.DEFAULT_BLOCK)
        signature = {"table": "*i64", "n_tensors": "i32", "flat": "*fp32", "scale": "fp64"}
        kernel = aot.compile_kernel(F._copy_kernel, signature, dict(cx, n_tensors=1), cc,
                                    aligned_args=("table", "flat"))
        _check_64bit(kernel)
        assert "ld.global.v4.b32" in kernel.asm["ptx"] and "st.global.v4.b32" in kernel.asm["ptx"]
    cx = S.scale_constexprs(torch.float32, False, True, S.DEFAULT_BLOCK)
    kernel = aot.compile_kernel(S._scale_kernel, {"table": "*i64", "n_tensors": "i32", "factor": "fp64"},
                                dict(cx, n_tensors=1), cc, aligned_args=("table",))
    _check_64bit(kernel)
    assert "ld.global.v4.b32" in kernel.asm["ptx"]
    cx = R.reduce_constexprs(torch.float32, 4, True, R.DEFAULT_BLOCK)
    kernel = aot.compile_kernel(R._reduce_add_kernel, {"table": "*i64", "n_tensors": "i32"},
                                dict(cx, n_tensors=1), cc, aligned_args=("table",))
    _check_64bit(kernel)
    assert "ld.global.v4.b32" in kernel.asm["ptx"]


@triton.jit
def _find_raw(begin, n_tensors, pids, out):
    # find_tensor given the kernel argument as it arrives (i32, i64, or the constant 1).
    i = tl.program_id(0)
    tl.store(out + i, find_tensor(begin, tl.load(pids + i), n_tensors))


@pytest.mark.parametrize("cc", CCS)
@pytest.mark.parametrize("n_tensors", ["i32", "i64", 1])
def test_find_tensor_compiles_for_any_n_tensors(cc, n_tensors):
    """The interpreter runs find_tensor whatever type ``n_tensors`` has; compiled, a
    loop-carried ``hi`` that changed type (i32 or constexpr in, i64 out) is an error."""
    signature = {"begin": "*i64", "n_tensors": "i32" if n_tensors == 1 else n_tensors, "pids": "*i64", "out": "*i64"}
    cx = {"n_tensors": 1} if n_tensors == 1 else {}
    assert ".entry" in aot.compile_kernel(_find_raw, signature, cx, cc).asm["ptx"]
