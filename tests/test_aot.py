"""Every Triton kernel compiled ahead of time for sm_80 and sm_90 (no GPU needed), with
the PTX checked for what matters on hardware the interpreter cannot show."""
from __future__ import annotations

import re

import pytest
import torch

from fastpar.kernels.ops_triton import aot

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
