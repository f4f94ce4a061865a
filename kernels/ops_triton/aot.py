"""Ahead-of-time compilation of fastpar's Triton kernels for a CUDA target, with no GPU
and no driver (``triton.compile`` + ``GPUTarget``). The tests and ``python -m fastpar
info`` use it to check the generated PTX."""
from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def _ty(dtype) -> str:
    return "*" + {"int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8",
                  "fp32": "fp32", "fp64": "fp64", "fp16": "fp16", "bf16": "bf16"}[str(dtype)]


def compile_kernel(jit_fn, signature: dict, constexprs: dict, cc: int, aligned_args=()):
    """Compile ``jit_fn`` for ``sm_{cc}``; pointer arguments named in ``aligned_args``
    are declared 16-byte aligned (as Triton's launcher specialises them at run time)."""
    names = list(signature)
    sig = dict(signature)
    for k in constexprs:
        sig[k] = "constexpr"
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned_args}
    src = ASTSource(fn=jit_fn, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32))


def compile_copy(cc: int, src=torch.float32, dst=torch.float32, scaled=False, to_flat=True,
                 aligned=True, block=None) -> str:
    """PTX of the multi-tensor copy kernel as the launcher configures it."""
    from . import flatten as F

    cx = F.copy_constexprs(src if to_flat else dst, dst if to_flat else src, scaled, to_flat,
                           aligned, block or F.DEFAULT_BLOCK)
    flat_ty = cx["STORE"] if to_flat else cx["SRC"]
    signature = {"table": "*i64", "n_tensors": "i32", "flat": _ty(flat_ty), "scale": "fp64"}
    return compile_kernel(F._copy_kernel, signature, cx, cc, aligned_args=("table", "flat")).asm["ptx"]


def compile_reduce(cc: int, dtype=torch.float32, n_sources: int = 4, aligned=True, block=None) -> str:
    """PTX of the K-way reduce-add kernel as the launcher configures it."""
    from . import reduce_add as R

    cx = R.reduce_constexprs(dtype, n_sources, aligned, block or R.DEFAULT_BLOCK)
    signature = {"table": "*i64", "n_tensors": "i32"}
    return compile_kernel(R._reduce_add_kernel, signature, cx, cc, aligned_args=("table",)).asm["ptx"]
