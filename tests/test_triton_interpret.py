"""The Triton kernels under the global ``TRITON_INTERPRET=1`` switch (where every
``@triton.jit`` is interpreted from import on), in a fresh process, on CPU tensors."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import torch, fastpar
    from fastpar import comm
    from triton.runtime.interpreter import InterpretedFunction
    from fastpar.kernels.ops_triton import flatten as F, reduce_add as R
    assert isinstance(F._copy_kernel, InterpretedFunction), type(F._copy_kernel)
    torch.manual_seed(0)
    ts = [torch.randn(7), torch.randn(3, 5), torch.randn(()), torch.randn(4, 6).t(), torch.randn(1030)]
    ref = torch.cat([t.reshape(-1) for t in ts])
    with fastpar.count_launches() as n:
        out = fastpar.flatten(ts, dtype=torch.bfloat16, scale=0.5)
    assert n.by_op == {("triton", "flatten"): 1}, n.by_op
    assert torch.equal(out, (ref * 0.5).bfloat16()), "flatten"
    back = [torch.full_like(t, float("nan")) for t in ts]
    fastpar.unflatten_into(ref, back)
    assert all(torch.equal(a, b) for a, b in zip(back, ts)), "unflatten_into"
    lists = [[torch.randn_like(t) for t in ts] for _ in range(3)]  # distinct sources
    sums = comm.reduce_add_coalesced(lists, "cpu")
    want = [sum(lst[i].double() for lst in lists) for i in range(len(ts))]
    assert all(torch.allclose(s.double(), w, rtol=1e-6, atol=1e-6) for s, w in zip(sums, want)), "reduce_add_coalesced"
    from fastpar._plan import plan_for
    from fastpar.kernels.ops_triton import scale as S
    assert isinstance(S._scale_kernel, InterpretedFunction), type(S._scale_kernel)
    for dtype in (torch.float32, torch.bfloat16):
        xs = [torch.randn(n).to(dtype) for n in (1, 7, 3000)]
        for factor, divide in ((0.5, False), (3.0, True)):
            got = [x.clone() for x in xs]
            with fastpar.count_launches() as n:
                S.scale(plan_for(got, "t", cache=False).groups[0], factor, divide)
            assert n.by_op == {("triton", "scale"): 1}, n.by_op
            exp = [x / factor if divide else x * factor for x in xs]
            assert all(torch.equal(a, b) for a, b in zip(got, exp)), ("scale", dtype, divide)
    # CUDA tensors under the interpreter: a clear error, not a host dereference of
    # device addresses (the interpreter copies the pointer table to the host).
    for k in (F.copy_kernel, R.reduce_add_kernel, S.scale_kernel):
        try:
            k.on(torch.device("cuda", 0))
        except RuntimeError as e:
            assert "TRITON_INTERPRET=1 is set" in str(e) and "cuda:0" in str(e), str(e)
        else:
            raise AssertionError("an interpreted kernel accepted a CUDA device")
    print("ok")
    """
)


def test_kernels_under_global_triton_interpret():
    env = dict(os.environ, TRITON_INTERPRET="1", FASTPAR_BACKEND="triton")
    res = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr
