"""fastpar.comm against float64 torch references, with CPU device lists (numba, the
Triton interpreter and the torch reference), plus CUDA tests that a multi-GPU machine
runs unchanged."""
from __future__ import annotations

import itertools
import math
import logging
import warnings

import pytest
import torch
from conftest import ALL_DTYPES, HAS_CUDA, TOL, assert_close, assert_one_break_per_op, compiled_run, compiling_flag_on, assert_unchanged, poison_, poisoned, rand, snapshot

import fastpar
from fastpar import comm

MIXED_SHAPES = [((5, 3), torch.float32), ((7,), torch.float64), ((), torch.float32), ((0,), torch.float32),
                ((9,), torch.bfloat16), ((3, 3), torch.float16), ((4,), torch.int64), ((1030,), torch.float32)]


def replicas(k, shapes=MIXED_SHAPES):
    """K independent per-device lists (fresh random values each)."""
    return [[rand(s, d) for s, d in shapes] for _ in range(k)]


def ref_sum(lists):
    return [sum(lst[i].to(torch.float64) for lst in lists) for i in range(len(lists[0]))]


def reduce_tol(dtype, k, magnitude: float = 6.0):
    """Sum of K values accumulated in float32 (float64 for float64) and rounded once to
    the result dtype: that rounding (``TOL``) plus up to K - 1 accumulation roundings,
    each at most 2**-24 (2**-53) of a partial sum of at most K * ``magnitude`` (the
    inputs here are standard normal: |x| < 6)."""
    rtol, atol = TOL[dtype]
    if not dtype.is_floating_point:
        return rtol, atol  # integers: exact
    eps = 2**-53 if dtype == torch.float64 else 2**-24
    return rtol, atol + (k - 1) * k * magnitude * eps


# ------------------------------------------------------------------------ reduce_add
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_reduce_add_coalesced_matches_float64(backend, k):
    lists = replicas(k)
    result = comm.reduce_add_coalesced(lists, "cpu")
    assert len(result) == len(MIXED_SHAPES)
    for i, (r, e) in enumerate(zip(result, ref_sum(lists))):
        assert r.dtype == lists[0][i].dtype and r.shape == lists[0][i].shape
        assert_close(r, e, what=f"position {i}", tol=reduce_tol(r.dtype, k))


@pytest.mark.parametrize("k", [4, 5, 6, 7, 9])
def test_reduce_add_coalesced_source_groupings(backend, k):
    # The Numba kernel reads up to four sources per pass: K = 5, 6, 7 and 9 end on a
    # partial group of 1, 2, 3 and 1 sources.
    lists = replicas(k, [((65_537,), torch.float32), ((33,), torch.float16), ((5, 7), torch.float64)])
    for i, (r, e) in enumerate(zip(comm.reduce_add_coalesced(lists, "cpu"), ref_sum(lists))):
        assert_close(r, e, what=f"position {i}", tol=reduce_tol(r.dtype, k))


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64], ids=str)
def test_reduce_add_coalesced_integers_wrap_as_torch(backend, dtype):
    # Integer sums wrap around as torch's in-place adds do in the tensor's dtype.
    info = torch.iinfo(dtype)
    gen = torch.Generator().manual_seed(5)
    lists = [[torch.randint(info.min, info.max, (n,), dtype=dtype, generator=gen) for n in (1, 7, 300)] for _ in range(6)]
    expected = [lists[0][i].clone() for i in range(3)]
    for lst in lists[1:]:
        for e, t in zip(expected, lst):
            e.add_(t)
    for i, (r, e) in enumerate(zip(comm.reduce_add_coalesced(lists, "cpu"), expected)):
        assert r.dtype == dtype and torch.equal(r, e), f"position {i}: {r[:5].tolist()} != {e[:5].tolist()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_reduce_add_keeps_negative_zero(backend, dtype):
    """-0.0 + -0.0 is -0.0, as torch's adds give: an accumulator started at +0.0 (the
    Triton kernel's, once) turned every all-negative-zero sum into +0.0."""
    a = torch.tensor([-0.0, 1.0, -0.0, 0.0, -0.0], dtype=dtype)
    b = torch.tensor([-0.0, -1.0, 0.0, -0.0, -0.0], dtype=dtype)
    (got,) = comm.reduce_add_coalesced([[a], [b]], "cpu")
    exp = a + b
    assert torch.equal(torch.signbit(got), torch.signbit(exp)) and torch.equal(got, exp), (got, exp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str)
def test_reduce_add_keeps_subnormals(backend, dtype, request):
    """Sums of subnormals are subnormal, exactly (multiples of the smallest one), as
    torch's adds give: a kernel that flushes them to zero (flush-to-zero, fastmath)
    passed every other reduce test (float32's atol 1e-6 and float64's 1e-12 are far above
    them, and the property tests draw none)."""
    if backend == "triton" and dtype == torch.bfloat16:
        request.applymarker(pytest.mark.xfail(strict=True, reason="the Triton interpreter's bfloat16 -> float32 "
                                              "conversion loses subnormals (as test_rnn records); a GPU's is exact"))
    from conftest import assert_same_bits

    tiny = torch.finfo(dtype).tiny
    mantissa = {torch.float32: 23, torch.float64: 52, torch.float16: 10, torch.bfloat16: 7}[dtype]
    smallest = torch.tensor(tiny * 2.0**-mantissa, dtype=torch.float64)
    assert smallest.to(dtype) > 0 and smallest.to(dtype) / 2 == 0
    n = torch.tensor([[1, 3, -5, 0, 100, -1, 7, 2], [2, -3, -6, 1, 27, 0, -7, 9], [4, 0, -1, -1, 0, -1, 0, 1]],
                     dtype=torch.float64)
    a, b, c = ((row * smallest).to(dtype) for row in n)
    assert ((a != 0) & (a.abs() < tiny)).any(), "the inputs must hold subnormals"
    exp = a + b + c  # exact: subnormal adds do not round
    assert ((exp != 0) & (exp.abs() < tiny)).sum() >= 5
    (got,) = comm.reduce_add_coalesced([[a], [b], [c]], "cpu")
    assert_same_bits(got, exp, f"{dtype} subnormal sums")
    out = poisoned(8, dtype=dtype)
    comm.reduce_add_coalesced([[a], [b], [c]], "cpu", out=[out])
    assert_same_bits(out, exp, f"{dtype} subnormal sums into out")
    assert_same_bits(comm.reduce_add([a, b], "cpu"), a + b, f"{dtype} subnormal reduce_add")


def _laid_out_alike(layout: str, k: int = 3) -> list:
    """K random tensors sharing a non-contiguous dense layout."""
    if layout == "channels_last":
        return [torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last) for _ in range(k)]
    return [torch.randn(6, 7).t() for _ in range(k)]


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
def test_reduce_add_keeps_a_shared_layout(backend, layout):
    """As torch's ``+``: inputs laid out alike give a result laid out so."""
    ts = _laid_out_alike(layout)
    got = comm.reduce_add(ts, "cpu")
    exp = ts[0] + ts[1] + ts[2]
    assert got.stride() == exp.stride(), (got.stride(), exp.stride())
    assert_close(got, ts[0].double() + ts[1].double() + ts[2].double(), dtype=torch.float32)


@pytest.mark.parametrize("layout", ["channels_last", "transposed"])
def test_reduce_add_of_a_shared_layout_in_a_loop_reuses_the_inputs_plans(backend, layout):
    # The inputs' permuted (contiguous) views are kept on their plans: made anew every
    # call, each made a new plan every call; only the new result's (out=) is new now.
    # And the kept views do not keep the caller's tensors alive.
    import gc
    import weakref

    from fastpar import _plan

    ts = _laid_out_alike(layout)
    comm.reduce_add(ts, "cpu")
    misses = _plan._CACHE.misses
    for step in range(3):
        for t in ts:
            t.copy_(torch.randn_like(t))  # new values, same tensors
        got = comm.reduce_add(ts, "cpu")
        assert got.stride() == (ts[0] + ts[1]).stride()
        assert_close(got, ts[0].double() + ts[1].double() + ts[2].double(), dtype=torch.float32,
                     what=f"step {step}")
    assert _plan._CACHE.misses == misses + 3, "the same inputs again: only the result's plan is new"
    gone = weakref.ref(ts[0])
    del ts, t, got
    for _ in range(8):  # each miss drops the plans nothing else refers to (in turn)
        comm.reduce_add_coalesced([[torch.randn(2)], [torch.randn(2)]], "cpu", out=[torch.empty(2)])
    gc.collect()
    assert gone() is None, "the kept views keep the caller's tensors alive"


def test_reduce_add_coalesced_results_are_independent_tensors(backend):
    # Results share buffers, but as separately allocated tensors would behave: an in-place
    # write to one neither changes nor bumps the version of another (they are not
    # autograd views of a hidden buffer), and each still has its own shape.
    lists = replicas(2)
    result = comm.reduce_add_coalesced(lists, "cpu")
    before = [r.clone() for r in result]
    versions = [r._version for r in result]
    result[0].add_(1)
    assert result[0]._version == versions[0] + 1
    for i in range(1, len(result)):
        assert result[i]._version == versions[i], f"result[{i}]'s version moved"
        assert torch.equal(result[i], before[i]), f"result[{i}] changed"
        assert result[i].shape == lists[0][i].shape


@pytest.mark.parametrize("dtype,small", [(torch.float16, 0.0004), (torch.bfloat16, 0.003)], ids=str)
def test_reduce_add_fp16_bf16_accumulate_in_fp32(backend, dtype, small):
    # 1 + seven values each under half a unit in the last place of 1.0: sequential 16-bit
    # adds round every partial sum back to 1.0; a float32 accumulator rounds once.
    lists = [[torch.full((100,), 1.0, dtype=dtype)]] + [[torch.full((100,), small, dtype=dtype)] for _ in range(7)]
    [r] = comm.reduce_add_coalesced(lists, "cpu")
    exact = sum(lst[0].double() for lst in lists).to(dtype)
    sequential = lists[0][0].clone()
    for lst in lists[1:]:
        sequential += lst[0]
    assert not torch.equal(exact, sequential), "the test values must tell the two apart"
    assert torch.equal(r, exact), f"{dtype}: expected one rounding of the fp32 sum"


def test_reduce_add_coalesced_into_out(backend):
    lists = replicas(3)
    out = [poison_(torch.empty(s, dtype=d)) for s, d in MIXED_SHAPES]
    res = comm.reduce_add_coalesced(lists, "cpu", out=out)
    assert all(a is b for a, b in zip(res, out))
    for i, (o, e) in enumerate(zip(out, ref_sum(lists))):
        assert_close(o, e, what=f"out[{i}]", tol=reduce_tol(o.dtype, 3))


@pytest.mark.parametrize("cdtype", [torch.complex64, torch.complex128], ids=str)
def test_reduce_add_coalesced_complex_as_real_views(backend, cdtype):
    # torch's comm sums complex tensors through view_as_real; so does fastpar.
    real = {torch.complex64: torch.float32, torch.complex128: torch.float64}[cdtype]
    lists = [[torch.randn(7, 3, dtype=cdtype), torch.randn(5, dtype=real), torch.randn((), dtype=cdtype)]
             for _ in range(3)]
    expected = [sum(lst[i].to(torch.complex128 if lst[i].is_complex() else torch.float64) for lst in lists)
                for i in range(3)]
    res = comm.reduce_add_coalesced(lists, "cpu")
    for i, (r, e) in enumerate(zip(res, expected)):
        assert r.dtype == lists[0][i].dtype and r.shape == lists[0][i].shape
        if r.is_complex():
            r, e = torch.view_as_real(r), torch.view_as_real(e)
        assert_close(r, e, what=f"result[{i}]", tol=reduce_tol(real, 3))
    out = [poison_(torch.empty_like(t)) for t in lists[0]]
    assert comm.reduce_add_coalesced(lists, "cpu", out=out) == tuple(out)  # a tuple, as torch's
    assert type(res) is tuple
    for i, (o, r) in enumerate(zip(out, res)):
        assert torch.equal(o, r), f"out[{i}] differs from the allocating call's result"
    assert torch.equal(comm.reduce_add([lst[0] for lst in lists], "cpu"), res[0])
    # Lazily conjugated tensors (the gradient of w.conj()) have no real view until resolved.
    conj = [[lst[0].conj(), lst[1]] for lst in lists]
    assert conj[0][0].is_conj()
    got = comm.reduce_add_coalesced(conj, "cpu")
    assert_close(torch.view_as_real(got[0]), torch.view_as_real(sum(lst[0].resolve_conj().to(torch.complex128)
                                                                    for lst in conj)),
                 what="conjugated sum", tol=reduce_tol(real, 3))
    # A real (..., 2) out is not a complex (...) result: rejected, not written.
    bad = [poisoned(7, 3, 2, dtype=real), poison_(torch.empty_like(lists[0][1])), poison_(torch.empty_like(lists[0][2]))]
    before = snapshot(bad)
    with pytest.raises(ValueError, match=r"out\[0\] has shape \(7, 3, 2\)"):
        comm.reduce_add_coalesced(lists, "cpu", out=bad)
    assert_unchanged(bad, before, what="rejected complex out")
    conj_out = [poison_(torch.empty_like(t)) for t in lists[0]]
    conj_out[0] = conj_out[0].conj()
    before = snapshot(conj_out)
    with pytest.raises(ValueError, match=r"out\[0\] is a lazily conjugated view"):
        comm.reduce_add_coalesced(lists, "cpu", out=conj_out)
    assert_unchanged(conj_out, before, what="rejected conjugated out")


def test_result_buffers_made_in_inference_mode_stay_there():
    """Reused result buffers are keyed on inference mode: a buffer first made under
    ``torch.inference_mode()`` (an inference tensor) was handed back to ordinary calls,
    whose results then refused in-place updates and backward."""
    import gc

    a, b = torch.ones(1 << 21), torch.ones(1 << 21)  # 8 MB: large enough to be kept
    with torch.inference_mode():
        (r,) = comm.reduce_add_coalesced([[a], [b]], "cpu")
        assert r.is_inference()
    del r
    gc.collect()
    (r,) = comm.reduce_add_coalesced([[a], [b]], "cpu")
    assert not r.is_inference()
    r.add_(1)
    w = torch.ones(1 << 21, requires_grad=True)
    (r * w).sum().backward()
    assert torch.equal(w.grad, torch.full_like(w, 3.0))


def test_reduce_into_inference_out_only_in_inference_mode():
    lists = [[torch.randn(3), torch.randn(2)] for _ in range(2)]
    with torch.inference_mode():
        out = [poisoned(3), poisoned(2)]
    before = snapshot(out)
    with pytest.raises(RuntimeError, match=r"out\[0\] is an inference tensor"):
        comm.reduce_add_coalesced(lists, "cpu", out=out)
    assert_unchanged(out, before, what="rejected inference out")
    with torch.inference_mode():
        comm.reduce_add_coalesced(lists, "cpu", out=out)
    for i, o in enumerate(out):
        assert_close(o, lists[0][i].double() + lists[1][i].double(), what=f"out[{i}]", tol=reduce_tol(torch.float32, 2))


def test_reduce_add_coalesced_sparse_follows_torch(backend):
    # A position sparse on every device stays sparse (summed with torch.add); sparse on
    # some devices only is densified; dense positions go through the kernel.
    def sparse(rows):
        return torch.sparse_coo_tensor(torch.tensor([rows]), torch.randn(len(rows), 3, dtype=torch.float64), (6, 3),
                                       check_invariants=True)

    lists = [[sparse([0, 2]), torch.randn(5, dtype=torch.float64), sparse([1])],
             [sparse([2, 5]), torch.randn(5, dtype=torch.float64), sparse([4]).to_dense()]]
    res = comm.reduce_add_coalesced(lists, "cpu")
    assert res[0].layout == torch.sparse_coo and res[1].layout == res[2].layout == torch.strided
    dense = lambda t: t.to_dense() if t.layout == torch.sparse_coo else t  # noqa: E731
    for i, r in enumerate(res):
        assert_close(dense(r), dense(lists[0][i]) + dense(lists[1][i]), what=f"result[{i}]", tol=TOL[torch.float64])
    total = comm.reduce_add([lists[0][0], lists[1][0]], "cpu")
    assert total.layout == torch.sparse_coo
    assert_close(total.to_dense(), dense(lists[0][0]) + dense(lists[1][0]), what="reduce_add", tol=TOL[torch.float64])
    mixed = comm.reduce_add([lists[0][2], lists[1][2]], "cpu")  # sparse + dense: dense, as torch's
    assert mixed.layout == torch.strided
    assert_close(mixed, dense(lists[0][2]) + lists[1][2], what="reduce_add mixed", tol=TOL[torch.float64])
    with pytest.raises(ValueError, match=r"position 0: inputs\[1\]\[0\] on cpu has shape \(7, 3\)"):
        comm.reduce_add_coalesced([lists[0], [torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, 3), (7, 3),
                                                                       check_invariants=True),
                                              *lists[1][1:]]], "cpu")

def test_reduce_sums_autograd_history_as_documented(backend):
    # README "fastpar.comm": dense sums record no history (torch's NCCL path); sums of
    # positions sparse on every device are torch.add's, as torch's are on every path,
    # and record it; one input is returned as it is.
    def sparse():
        return torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.randn(2), (4,), check_invariants=True,
                                       requires_grad=True)

    a, b = torch.randn(4, requires_grad=True), torch.randn(4, requires_grad=True)
    sa, sb = sparse(), sparse()
    assert comm.reduce_add([a, b], "cpu").grad_fn is None
    dense_sum, sparse_sum, densified = comm.reduce_add_coalesced([[a, sa, sa], [b, sb, b]], "cpu")
    assert dense_sum.grad_fn is None and densified.grad_fn is None and densified.layout == torch.strided
    assert sparse_sum.layout == torch.sparse_coo and sparse_sum.grad_fn is not None
    total = comm.reduce_add([sa, sb], "cpu")
    assert total.layout == torch.sparse_coo and total.grad_fn is not None
    assert comm.reduce_add([a], "cpu") is a


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_reduce_add_into_out_large_streamed(dtype):
    # Over 16 MiB of float32/float64 results into existing tensors: the Numba kernel
    # writes them with streaming stores. Destinations at odd offsets test the unaligned
    # head and tail of every piece; the poisoned margins, that nothing else is written.
    sizes = [4_500_001, 3, 65_537] if dtype == torch.float32 else [2_250_001, 5, 65_537]
    inputs = [[rand((n,), dtype) for n in sizes] for _ in range(3)]
    backing = [poison_(torch.empty(n + 2, dtype=dtype)) for n in sizes]
    out = [b[1 : 1 + n] for b, n in zip(backing, sizes)]
    comm.reduce_add_coalesced(inputs, "cpu", out=out)
    for i, o in enumerate(out):
        ref = sum(src[i].double() for src in inputs)
        assert_close(o, ref, dtype=dtype, what=f"out[{i}]")
    for b, n in zip(backing, sizes):
        assert b[0].isnan() and b[n + 1].isnan(), "wrote outside out"


def _new_values_(lists) -> None:
    """Fresh random values in every tensor of ``lists``, in place (the same tensors)."""
    for lst in lists:
        for t in lst:
            t.copy_(torch.randn_like(t))


def test_complex_reduce_in_a_loop_reuses_its_plans_and_lets_them_go(backend):
    # _real_views: the same complex tensors reduced again (new values) take no new plans
    # (their real views are kept on the cached plans); lazily conjugated ones are
    # resolved anew each call; and the kept views do not keep the tensors alive.
    import gc
    import weakref

    from fastpar import _plan

    def sums(lists):  # float64 sums, complex ones as their real views
        out = [sum(lst[i].resolve_conj().to(torch.complex128 if lst[i].is_complex() else torch.float64)
                   for lst in lists) for i in range(len(lists[0]))]
        return [torch.view_as_real(e) if e.is_complex() else e for e in out]

    def check(lists, out, what):
        for o in out:
            poison_(o)
        assert comm.reduce_add_coalesced(lists, "cpu", out=out) == tuple(out)
        for i, (o, e) in enumerate(zip(out, sums(lists))):
            got = torch.view_as_real(o) if o.is_complex() else o
            assert_close(got, e, what=f"{what}: out[{i}]", tol=reduce_tol(torch.float32, 2))

    lists = [[torch.randn(7, 3, dtype=torch.complex64), torch.randn(5), torch.randn((), dtype=torch.complex64)]
             for _ in range(2)]
    out = [torch.empty_like(t) for t in lists[0]]
    comm.reduce_add_coalesced(lists, "cpu", out=out)
    misses = _plan._CACHE.misses
    for step in range(3):
        _new_values_(lists)
        check(lists, out, f"step {step}")
    assert _plan._CACHE.misses == misses, "the same tensors again: no new plans"
    conj = [[lst[0].conj(), lst[1]] for lst in lists]
    cout = [torch.empty_like(t) for t in conj[0]]
    for step in range(2):
        lists[0][0].copy_(torch.randn_like(lists[0][0]))  # seen through its conjugate view
        check(conj, cout, f"conjugated, step {step}")
    gone = weakref.ref(lists[0][0])
    del lists, out, conj, cout
    for _ in range(4):  # each miss drops the plans nothing else refers to (in turn)
        comm.reduce_add_coalesced([[torch.randn(2)], [torch.randn(2)]], "cpu", out=[torch.empty(2)])
    gc.collect()
    assert gone() is None, "the kept real views keep the caller's tensors alive"


def test_complex_reduce_with_real_ends_in_a_loop_reuses_its_plans(backend):
    # A list that starts and ends with real tensors: its kept real views are a list of
    # the same length with the same first and last objects, so the plan cache's key
    # (length, first id, last id) was the original list's, and each plan evicted the
    # other on every call (184 tensors, K=2 into out=: 6 plans built a call).
    import gc
    import weakref

    from fastpar import _plan

    def mixed(views):
        ends = torch.randn(40)  # views=True: the real ends are views (gradients as bucket views)
        first, last = (ends[:5], ends[9:10].view(())) if views else (torch.randn(5), torch.randn(()))
        return [first, torch.randn(7, 3, dtype=torch.complex64), torch.randn(2, 2),
                torch.randn(3, dtype=torch.complex64), last]

    for views in (False, True):
        lists = [mixed(views) for _ in range(2)]
        out = [torch.empty_like(t) for t in mixed(False)]
        for given in (out, None):
            comm.reduce_add_coalesced(lists, "cpu", out=given)
            misses = _plan._CACHE.misses
            for step in range(3):
                _new_values_(lists)
                # A plan built for other tensors: the cache drops the plans it finds
                # orphaned, which must not be these (a view's reference to the tensor
                # it is made from, counted where there is none, made them look so).
                fastpar.flatten([torch.randn(3), torch.randn(2)])
                got = comm.reduce_add_coalesced(lists, "cpu", out=given)
                for i, g in enumerate(got):
                    e = lists[0][i].to(torch.complex128 if g.is_complex() else torch.float64) + lists[1][i]
                    g, e = (torch.view_as_real(g), torch.view_as_real(e)) if g.is_complex() else (g, e)
                    assert_close(g, e, what=f"views={views}, out={given is not None}, step {step}: [{i}]",
                                 tol=reduce_tol(torch.float32, 2))
            assert _plan._CACHE.misses == misses + 3, \
                f"views={views}, out={given is not None}: the same tensors again: no new plans"
    gone = [weakref.ref(lists[0][0]), weakref.ref(out[-1])]
    del lists, out, got, g, e, given
    for _ in range(6):  # each miss drops the plans nothing else refers to (in turn)
        comm.reduce_add_coalesced([[torch.randn(2)], [torch.randn(2)]], "cpu", out=[torch.empty(2)])
    gc.collect()
    assert all(r() is None for r in gone), "the kept real views keep the caller's tensors alive"


def test_kept_views_let_go_of_tensors_other_views_shared_and_leave_them_swappable(backend):
    # A view of a tensor makes torch keep that tensor's Python object alive from its
    # TensorImpl (one more reference, while the impl has another owner): measured at the
    # first call, that reference was missed where the impl had another owner then (a
    # view the caller held, or a kept view of another plan), or where one end of the
    # list is a view (its kept view refers to the view's base) and the other is not (one
    # count served both ends). The plan then never looked orphaned and stayed cached,
    # the caller's tensors with it (the LRU never fills while orphans are dropped); and
    # torch.utils.swap_tensors refused the tensors ("use_count ... got 3").
    import gc
    import weakref

    from fastpar import _plan

    def unrelated(n):
        for _ in range(n):
            fastpar.flatten([torch.randn(3), torch.randn(2)])

    # A view of an end held by the caller at the first call.
    lists = [[torch.randn(3, dtype=torch.complex64), torch.randn(4, dtype=torch.complex64)] for _ in range(2)]
    side = lists[0][0][:1]
    comm.reduce_add_coalesced(lists, "cpu")
    ts = [torch.empty_strided((7, 6), (1, 7)).normal_() for _ in range(2)]  # transposed, not views
    side_t = ts[0][:1]
    comm.reduce_add(ts, "cpu")
    gone = [weakref.ref(lists[0][0]), weakref.ref(lists[1][-1]), weakref.ref(ts[0])]
    del lists, side, ts, side_t
    unrelated(8)
    gc.collect()
    assert all(r() is None for r in gone), [r() is None for r in gone]

    # One end a persistent view (a gradient as a bucket view), the other new every step.
    bucket = torch.randn(20)
    firsts = [bucket[:5], bucket[5:10]]
    alive = []
    for step in range(4):
        lists = [[firsts[k], torch.randn(4, dtype=torch.complex64)] for k in range(2)]
        comm.reduce_add_coalesced(lists, "cpu")
        alive.append(weakref.ref(lists[0][-1]))
        del lists
    unrelated(8)
    gc.collect()
    assert [r() is None for r in alive] == [True] * 4

    # Still reused while held, and swappable.
    lists = [[torch.randn(3, dtype=torch.complex64), torch.randn(4)] for _ in range(2)]
    comm.reduce_add_coalesced(lists, "cpu")
    misses = _plan._CACHE.misses
    for _ in range(3):
        unrelated(1)
        comm.reduce_add_coalesced(lists, "cpu")
    assert _plan._CACHE.misses == misses + 3, "the same tensors again: no new plans"
    new = torch.randn(3, dtype=torch.complex64)
    torch.utils.swap_tensors(lists[0][0], new)
    assert torch.equal(comm.reduce_add_coalesced(lists, "cpu")[0], lists[0][0] + lists[1][0])


def test_kept_views_follow_tensors_changed_in_place(backend):
    # The views kept on a plan (_real_views, _permuted) were made at the first call: a
    # tensor given new storage or a new shape in place must not be summed through them.
    def sums(lists):
        return [sum(lst[i].to(torch.complex128) for lst in lists) for i in range(len(lists[0]))]

    changes = {
        ".data": lambda t: setattr(t, "data", torch.randn_like(t)),
        "set_": lambda t: t.set_(torch.randn_like(t)),
        "storage resized": lambda t: (t.untyped_storage().resize_(0),
                                      t.untyped_storage().resize_(t.numel() * t.element_size()),
                                      t.copy_(torch.randn_like(t))),
    }
    for what, change in changes.items():
        lists = [[torch.randn(4, 3, dtype=torch.complex64), torch.randn(5, dtype=torch.complex64)] for _ in range(2)]
        out = [torch.empty_like(t) for t in lists[0]]
        comm.reduce_add_coalesced(lists, "cpu", out=out)
        change(lists[0][0])
        change(out[1])
        for given in (out, None):
            got = comm.reduce_add_coalesced(lists, "cpu", out=given)
            for i, (g, e) in enumerate(zip(got, sums(lists))):
                assert_close(torch.view_as_real(g), torch.view_as_real(e), what=f"{what}, out={given is not None}: [{i}]",
                             tol=reduce_tol(torch.float32, 2))
    ts = _laid_out_alike("transposed")
    comm.reduce_add(ts, "cpu")
    for t in ts:
        t.t_()  # now contiguous: another layout, the same tensors
    ts[1].data = torch.randn(7, 6).t()  # and another storage and layout
    got = comm.reduce_add(ts, "cpu")
    assert_close(got, ts[0].double() + ts[1].double() + ts[2].double(), dtype=torch.float32, what="t_()")


def test_reduce_add_coalesced_noncontiguous_inputs(backend):
    base = [rand((6, 4), torch.float32) for _ in range(3)]
    lists = [[b.t(), b[:, 1]] for b in base]
    res = comm.reduce_add_coalesced(lists, "cpu")
    for r, e in zip(res, ref_sum(lists)):
        assert_close(r, e, tol=reduce_tol(torch.float32, 3))


@pytest.mark.slow
@pytest.mark.parametrize("be", ["numba", "triton"])
def test_reduce_add_thousand_tensors_one_launch(be):
    n = 1000 if be == "triton" else 10_000
    gen = torch.Generator().manual_seed(3)
    sizes = torch.randint(0, 40, (n,), generator=gen).tolist()
    lists = [[rand((s,), torch.float32, gen=gen) for s in sizes] for _ in range(4)]
    with fastpar.use_backend(be), fastpar.count_launches() as launches:
        res = comm.reduce_add_coalesced(lists, "cpu")
    assert launches.total == 1
    assert_close(torch.cat(res), torch.cat(ref_sum(lists)), tol=reduce_tol(torch.float32, 4))


@pytest.mark.parametrize("be", ["numba", "triton"])
@pytest.mark.parametrize("n", [1, 10, 300])
def test_reduce_launch_count_one_per_destination(be, n):
    lists = [[torch.randn(5) for _ in range(n)] for _ in range(3)]
    with fastpar.use_backend(be), fastpar.count_launches() as launches:
        comm.reduce_add_coalesced(lists, "cpu")
    assert launches.total == 1, launches.by_op


def _reduce_table_entry(out):
    """The pointer table kept for ``out`` (a cached plan's only dtype group)."""
    from fastpar import _plan

    (group,) = _plan.plan_for(out, "out").groups
    (entry,) = [v for k, v in group._tables.items() if k[0] == "reduce"]
    return entry


def test_reduce_into_out_reuses_its_table_while_the_sources_stay_put():
    # ReduceGroup.device_table: a loop reducing the same tensors into the same out=
    # makes its pointer table once; sources elsewhere get a new one; every sum is right.
    shapes = [((5, 3), torch.float32), ((17,), torch.float32), ((0,), torch.float32)]
    lists = replicas(3, shapes)
    out = [torch.empty_like(t) for t in lists[0]]

    def check(srcs, what):
        for o in out:
            poison_(o)
        comm.reduce_add_coalesced(srcs, "cpu", out=out)
        for i, (o, e) in enumerate(zip(out, ref_sum(srcs))):
            assert_close(o, e, what=f"{what}: out[{i}]", tol=reduce_tol(torch.float32, 3))

    with fastpar.use_backend("triton"):
        comm.reduce_add_coalesced(lists, "cpu", out=out)
        table = _reduce_table_entry(out)[3]
        for step in range(2):
            for lst in lists:
                for t in lst:
                    t.normal_()  # new values at the same addresses
            check(lists, f"step {step}")
            assert _reduce_table_entry(out)[3] is table, "same sources, same out: the table is reused"
        moved = [[t.clone() for t in lst] for lst in replicas(3, shapes)]
        check(moved, "other sources")
        assert _reduce_table_entry(out)[3] is not table
        lists[1][0].set_(torch.randn(5, 3))  # one source tensor now elsewhere (same object)
        check(lists, "a source moved by set_")


def _reduce_tables(out):
    """``{(dtype, block): table}`` kept for ``out``, over every dtype group of its plan."""
    from fastpar import _plan

    return {(g.dtype, k[1]): v[3] for g in _plan.plan_for(out, "out").groups
            for k, v in g._tables.items() if k[0] == "reduce"}


def _check_reduce_into(srcs, out, what, k=3):
    for o in out:
        poison_(o)
    comm.reduce_add_coalesced(srcs, "cpu", out=out)
    for i, (o, e) in enumerate(zip(out, ref_sum(srcs))):
        assert_close(o, e, what=f"{what}: out[{i}]", tol=reduce_tol(o.dtype, k))


def test_reduce_group_kept_table_is_the_table_it_would_make():
    # ReduceGroup.device_table with a table_cache returns, call after call, a table equal
    # to the one made anew: for another block (its block_begin), other source or
    # destination addresses, another number of sources.
    import numpy as np

    from fastpar._plan import ReduceGroup

    cpu = torch.device("cpu")
    numels = np.array([15, 1030, 0, 17], dtype=np.int64)
    cache = {}

    def group(src, dst, kept):
        return ReduceGroup(torch.float32, cpu, np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64),
                           numels, [], None, {}, table_cache=kept)

    src = [[64 * (i + 1) + 4096 * k for i in range(4)] for k in range(3)]
    dst = [64 * (i + 1) + 4096 * 9 for i in range(4)]
    calls = [(src, dst, 2048), (src, dst, 64), (src, dst, 2048), (src[:2], dst, 2048),
             ([src[0], src[2], src[1]], dst, 64), (src, [a + 64 for a in dst], 64), (src, dst, 64)]
    for n, (s, d, block) in enumerate(calls):
        kept = group(s, d, cache).device_table(block, cpu)
        fresh = group(s, d, None).device_table(block, cpu)
        assert torch.equal(kept, fresh), f"call {n}: block {block}, {len(s)} sources"


def test_reduce_into_out_keeps_a_table_per_launch_block():
    # The table's block_begin depends on the launch block (a tuned or forced parameter):
    # a call with another block must not read the table made for the first one.
    from fastpar import _tuning

    shapes = [((5, 3), torch.float32), ((1030,), torch.float32), ((17,), torch.float32)]
    lists = replicas(3, shapes)
    out = [torch.empty_like(t) for t in lists[0]]

    def small():
        return _tuning.forced({("reduce_add", "triton"): {"block": 64}})

    with fastpar.use_backend("triton"):
        _check_reduce_into(lists, out, "default block")
        with small():
            _check_reduce_into(lists, out, "block 64")
        tables = _reduce_tables(out)
        assert {b for _, b in tables} == {2048, 64}, tables.keys()
        for step in range(2):
            for lst in lists:
                for t in lst:
                    t.normal_()
            _check_reduce_into(lists, out, f"step {step}, default block")
            with small():
                _check_reduce_into(lists, out, f"step {step}, block 64")
            now = _reduce_tables(out)
            assert all(now[key] is tables[key] for key in tables), "each block's table is reused"


def test_reduce_into_out_keeps_a_table_per_dtype_group():
    # Each dtype group of out= keeps its own table (its plan group's), reused on its own.
    shapes = [((5, 3), torch.float32), ((7,), torch.float64), ((9,), torch.bfloat16), ((4,), torch.int64),
              ((1030,), torch.float32), ((0,), torch.float64)]
    lists = replicas(3, shapes)
    out = [torch.empty_like(t) for t in lists[0]]
    with fastpar.use_backend("triton"):
        _check_reduce_into(lists, out, "first call")
        tables = _reduce_tables(out)
        assert {d for d, _ in tables} == {torch.float32, torch.float64, torch.bfloat16, torch.int64}
        for lst in lists:
            for t in lst:
                t.copy_(rand(t.shape, t.dtype))
        # New list objects over the same tensors: the addresses, not the lists, decide.
        _check_reduce_into([list(lst) for lst in lists], out, "second call")
        now = _reduce_tables(out)
        assert now.keys() == tables.keys() and all(now[key] is tables[key] for key in tables)
        # One dtype's source moves: only that group's table is made anew.
        lists[2][1].set_(rand((7,), torch.float64))
        _check_reduce_into(lists, out, "a float64 source moved")
        now = _reduce_tables(out)
        assert now[(torch.float64, 2048)] is not tables[(torch.float64, 2048)]
        assert all(now[key] is tables[key] for key in tables if key[0] != torch.float64)


def test_reduce_into_out_shares_its_plan_tables_with_flatten():
    # A cached plan group's _tables holds flatten's (block, device) -> [table, event]
    # entries and the reduce's ("reduce", block, device) -> [..., table, event] ones:
    # neither may take the other's for its own.
    lists = replicas(2, [((5, 3), torch.float32), ((17,), torch.float32)])
    out = [torch.empty_like(t) for t in lists[0]]
    with fastpar.use_backend("triton"):
        for step in range(2):
            for o in out:
                o.normal_()
            flat = fastpar.flatten(out)
            assert torch.equal(flat, torch.cat([o.reshape(-1) for o in out])), f"step {step}: flatten"
            _check_reduce_into(lists, out, f"step {step}: reduce", k=2)


def test_reduce_into_out_with_staged_sources():
    # A non-contiguous source is read from a staging copy made per call: the table
    # holds the copy's address, whatever the source's own, and a copy at another
    # address makes a new one.
    base = [torch.randn(5, 6) for _ in range(3)]
    lists = [[b.t(), torch.randn(17)] for b in base]  # (6, 5) views, non-contiguous
    out = [torch.empty(6, 5), torch.empty(17)]
    held = []
    with fastpar.use_backend("triton"):
        for step in range(4):
            for b in base:
                b.normal_()
            _check_reduce_into(lists, out, f"step {step}")
            (table,) = _reduce_tables(out).values()
            assert table[0].item() != lists[0][0].data_ptr(), "the staging copy's address is in the table"
            held.append(torch.empty(6 * 5 * 4, dtype=torch.uint8))  # may take the freed copy's place


def test_reduce_add_single(backend):
    ts = [rand((4, 5), torch.float32) for _ in range(3)]
    r = comm.reduce_add(ts, "cpu")
    assert_close(r, sum(t.double() for t in ts), tol=reduce_tol(torch.float32, 3))
    assert comm.reduce_add(ts).device.type == "cpu"
    assert comm.reduce_add(ts[:1]) is ts[0], "one input: returned as is, as torch"


@pytest.mark.parametrize("call, match", [
    (lambda t: comm.scatter(t, ["cpu", "cpu"], chunk_sizes=4), r"chunk_sizes must be an iterable of ints, got int 4"),
    (lambda t: comm.scatter(t, ["cpu", "cpu"], chunk_sizes=torch.tensor(4)), r"chunk_sizes must be an iterable of ints, got Tensor"),
    (lambda t: comm.scatter(t, ["cpu"], streams=0), r"streams must be an iterable of CUDA streams \(or None\), got int 0"),
    (lambda t: comm.scatter(t, out=[]), r"out must be a non-empty list or tuple of tensors, got an empty list"),
    (lambda t: comm.broadcast(t, out=()), r"out must be a non-empty list or tuple of tensors, got an empty tuple"),
], ids=["chunk_sizes-int", "chunk_sizes-0dim", "streams-int", "scatter-out-empty", "broadcast-out-empty"])
def test_scatter_and_broadcast_refusals_say_what_they_got(call, match):
    """A chunk_sizes or streams that is not iterable was refused by ``list()``'s "'int'
    object is not iterable", naming neither the argument nor what it takes; an empty
    out was "got list", as if a list were wrong."""
    with pytest.raises(TypeError, match=match):
        call(torch.randn(4, 3))


def test_scatter_more_streams_than_chunks():
    # A short batch leaves devices without a chunk; the extra streams are ignored.
    x = torch.randn(1, 3)
    chunks = comm.scatter(x, ["cpu", "cpu"], None, 0, [None, None])
    assert len(chunks) == 1 and torch.equal(chunks[0], x)


def test_scatter_stream_of_another_device_is_refused_before_copying():
    # A stand-in stream object (no CUDA here): only its device is read before the check.
    class FakeStream:
        device = torch.device("cuda", 1)

    devices = ["cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match=r"streams\[0\] is a stream of cuda:1, but devices\[0\] is cuda:0"):
        if HAS_CUDA:
            comm.scatter(torch.randn(4, 3), devices, None, 0, [FakeStream(), None])
        else:  # (scatter itself refuses CUDA devices first here)
            comm._check_streams([FakeStream(), None], [torch.device(d) for d in devices], "devices")


def test_host_path_logged(caplog):
    with caplog.at_level(logging.DEBUG, logger="fastpar.comm"):
        comm.reduce_add_coalesced([[torch.ones(2)], [torch.ones(2)]], "cpu")
    assert "host path" in caplog.text
    assert comm.reduce_path(["cpu", "cpu"], "cpu") == "host"


def test_reduce_path_checks_devices_as_the_ops_do():
    # reduce_path read a string as its characters ("devices: 'c' is not a device") and
    # named a bad entry "devices" rather than its position.
    with pytest.raises(TypeError, match="devices must be a list, tuple or other iterable of devices, got str"):
        comm.reduce_path("cpu", "cpu")
    with pytest.raises(ValueError, match=r"devices\[1\]: 'gpu' is not a device"):
        comm.reduce_path(["cpu", "gpu"], "cpu")
    assert comm.reduce_path((d for d in ["cpu", "cpu"]), "cpu") == "host"


# ------------------------------------------------------------------------- broadcast
def test_broadcast_coalesced_shares_one_storage_per_device(backend):
    ts = [rand(s, d) for s, d in MIXED_SHAPES] + [rand((6, 4), torch.float32).t()]
    outs = comm.broadcast_coalesced(ts, ["cpu", "cpu", "cpu"])
    assert len(outs) == 3
    assert all(a is b for a, b in zip(outs[0], ts)), "outputs[0] are the inputs themselves"
    for d in (1, 2):
        assert all(torch.equal(a, b) for a, b in zip(outs[d], ts))
        assert all(not o.requires_grad for o in outs[d])
        storages = {o.untyped_storage().data_ptr() for o in outs[d] if o.numel()}  # (empty views own no memory)
        assert len(storages) == 1, "one contiguous storage per destination"
    assert outs[1][0].untyped_storage().data_ptr() != outs[2][0].untyped_storage().data_ptr()



def test_broadcast_coalesced_copies_have_their_own_version_counters(backend):
    # As torch's (its NOTE "Version Counter in comm.*_coalesced"): an in-place update of
    # one copy must not make autograd reject a tensor saved from another copy.
    ts = [rand(s, d) for s, d in MIXED_SHAPES]
    outs = comm.broadcast_coalesced(ts, ["cpu", "cpu"])
    before = [o._version for o in outs[1]]
    outs[1][0].add_(1)
    assert outs[1][0]._version == before[0] + 1
    assert [o._version for o in outs[1][1:]] == before[1:], "one copy's in-place update bumped the others"

def test_broadcast_coalesced_then_reduce_returns_k_times(backend):
    ts = [rand(s, d) for s, d in MIXED_SHAPES]
    outs = comm.broadcast_coalesced(ts, ["cpu"] * 4)
    for r, t in zip(comm.reduce_add_coalesced(outs, "cpu"), ts):
        assert_close(r, t.double() * 4, tol=reduce_tol(t.dtype, 4))


def test_broadcast_coalesced_one_flatten_launch():
    ts = [torch.randn(3) for _ in range(500)]
    with fastpar.use_backend("numba"), fastpar.count_launches() as n:
        comm.broadcast_coalesced(ts, ["cpu"] * 4)
    assert n.total == 1


def _sparse(rows, n=6, dtype=torch.float64, coalesce=False):
    t = torch.sparse_coo_tensor(torch.tensor([rows]), torch.randn(len(rows), 3, dtype=dtype), (n, 3),
                                check_invariants=True)
    return t.coalesce() if coalesce else t


def test_broadcast_coalesced_copies_sparse_tensors_as_torch():
    """As torch's: sparse COO tensors are copied on their own (indices and values, the
    coalesced flag kept), the dense ones coalesced in one launch, the order kept."""
    ts = [torch.randn(5), _sparse([0, 2, 2]), rand((3, 2), torch.float32), _sparse([4, 1], coalesce=True)]
    with fastpar.use_backend("numba"), fastpar.count_launches() as n:
        res = comm.broadcast_coalesced(ts, ["cpu"] * 3)
    assert n.total == 1  # the dense tensors, one launch
    assert all(r is t for r, t in zip(res[0], ts))
    for copies in res[1:]:
        for c, t in zip(copies, ts):
            assert c.layout == t.layout and c.dtype == t.dtype and not c.requires_grad
            if t.layout == torch.sparse_coo:
                assert c.is_coalesced() == t.is_coalesced()
                assert torch.equal(c._indices(), t._indices()) and torch.equal(c._values(), t._values())
                assert c._values().data_ptr() != t._values().data_ptr(), "a sparse copy shares the source's values"
            else:
                assert torch.equal(c, t) and c.data_ptr() != t.data_ptr()
    total = comm.reduce_add_coalesced(res, "cpu")  # back: K times, sparse stays sparse
    assert total[1].layout == torch.sparse_coo
    assert_close(total[1].to_dense(), 3 * ts[1].to_dense(), tol=reduce_tol(torch.float64, 3))
    assert comm.broadcast_coalesced([ts[1]], ["cpu", "cpu"])[1][0].layout == torch.sparse_coo  # sparse only
    with pytest.raises(ValueError, match=r"tensors must be on devices\[0\] \(cpu\), got tensors\[1\] on meta"):
        comm.broadcast_coalesced([ts[0], ts[1].to("meta")], ["cpu", "cpu"])


def test_broadcast():
    t = torch.randn(3, 2)
    res = comm.broadcast(t, ["cpu", "cpu"])
    assert res[0] is t and res[1] is not t and torch.equal(res[1], t)
    # Copies are contiguous whatever the input's strides, as torch's (at::empty(sizes));
    # the input's own device gets the input itself.
    tt = torch.randn(2, 3).t()
    res = comm.broadcast(tt, ["cpu", "cpu"])
    assert res[0] is tt and res[1].is_contiguous() and torch.equal(res[1], tt)
    out = [poison_(torch.empty(3, 2)), poison_(torch.empty(3, 2))]
    res = comm.broadcast(t, out=out)
    assert all(r is o for r, o in zip(res, out)) and all(torch.equal(o, t) for o in out)


@pytest.mark.parametrize("shape,dtype,got", [
    ((2, 3), torch.float32, r"got shape \(2, 3\), torch.float32"),  # same numel, other shape
    ((3, 2, 1), torch.float32, r"got shape \(3, 2, 1\), torch.float32"),
    ((3, 2), torch.float64, r"got shape \(3, 2\), torch.float64"),  # copy_ would cast
], ids=["shape", "ndim", "dtype"])
def test_broadcast_out_rejections_write_nothing(shape, dtype, got):
    # The bad tensor is last: every out is checked before any is written.
    t = torch.randn(3, 2)
    out = [poisoned(3, 2), poisoned(3, 2), poisoned(*shape, dtype=dtype)]
    watched = [*out, t]
    before = snapshot(watched)
    with pytest.raises(ValueError, match=r"out\[2\] must match tensor \(shape \(3, 2\), torch.float32\), " + got):
        comm.broadcast(t, out=out)
    assert_unchanged(watched, before, what="rejected broadcast out")


@pytest.mark.parametrize("tensors,devices,match", [
    (lambda: [torch.randn(3), torch.randn(2, 2, dtype=torch.float64)], [0, 1],
     r"tensors must be on devices\[0\] \(cuda:0\), got tensors on cpu" if HAS_CUDA else
     r"devices\[0\] is 0 \(a CUDA device\), but CUDA is not available here; host replicas take 'cpu' entries"),
    (lambda: [torch.randn(3), torch.randn(2, 2, dtype=torch.float64)], ["cuda:1", "cuda:0"],
     r"tensors must be on devices\[0\] \(cuda:1\), got tensors on cpu" if HAS_CUDA else
     r"devices\[0\] is 'cuda:1' \(a CUDA device\), but CUDA is not available"),
    (lambda: [torch.empty(3, device="meta")], ["cpu", "cpu"], r"tensors must be on devices\[0\] \(cpu\), got tensors on meta"),
], ids=["cpu-to-cuda", "cpu-to-cuda1", "meta-to-cpu"])
def test_broadcast_coalesced_rejects_tensors_not_on_devices0(tensors, devices, match):
    ts = tensors()
    before = snapshot(ts)
    with fastpar.count_launches() as n:
        # (Without CUDA, CUDA devices are refused first, as a RuntimeError naming them.)
        with pytest.raises(ValueError if HAS_CUDA or devices[0] == "cpu" else RuntimeError, match=match):
            comm.broadcast_coalesced(ts, devices)
    assert n.total == 0, f"a rejected broadcast_coalesced launched {n.by_op}"
    if ts[0].device.type != "meta":
        assert_unchanged(ts, before, what="rejected broadcast_coalesced inputs")


@pytest.mark.slow
def test_broadcast_coalesced_ten_thousand_tensors_and_a_large_one():
    # 10,000 small tensors of mixed sizes (0, 1, odd) and dtypes, and one of more than
    # 65536 elements (the Numba kernel's block: several blocks of one tensor, the last
    # partial) in the middle of the list; three CPU replicas.
    gen = torch.Generator().manual_seed(11)
    dtypes = [torch.float32, torch.float64, torch.float16, torch.int64, torch.bool, torch.int8]
    sizes = [0, 1, 3, 5, 7, 9, 17, 33]
    picks = torch.randint(0, len(sizes) * len(dtypes), (10_000,), generator=gen).tolist()

    def values(n, dtype):
        if dtype == torch.bool:
            return torch.randint(0, 2, (n,), generator=gen).bool()
        if dtype.is_floating_point:
            return torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
        return torch.randint(-100, 100, (n,), generator=gen).to(dtype)

    ts = [values(sizes[p % len(sizes)], dtypes[p // len(sizes)]) for p in picks]
    ts.insert(4321, torch.randn(2 * 65536 + 7, generator=gen, dtype=torch.float32))
    ts[17] = ts[17].view(1, -1) if ts[17].numel() else ts[17]  # one that is not 1-D
    before = snapshot(ts)
    copies = comm.broadcast_coalesced(ts, ["cpu", "cpu", "cpu"])
    assert len(copies) == 3 and all(len(c) == len(ts) for c in copies)
    assert all(c is t for c, t in zip(copies[0], ts)), "copies[0] must be the inputs themselves, as torch's"
    assert_unchanged(ts, before, what="broadcast_coalesced inputs")
    for d in (1, 2):
        for i, (c, t) in enumerate(zip(copies[d], ts)):
            assert c.dtype == t.dtype and c.shape == t.shape, f"copies[{d}][{i}]: {c.dtype} {tuple(c.shape)}"
            if not torch.equal(c, t):
                assert_close(c, t, tol=(0, 0), what=f"copies[{d}][{i}] ({t.numel()} elements)")
                raise AssertionError(f"copies[{d}][{i}] differs from its source")
            if t.numel():
                lo, hi = c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()
                src_lo, src_hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
                assert hi <= src_lo or src_hi <= lo, f"copies[{d}][{i}] shares memory with its source"
    big = [copies[d][4321] for d in (1, 2)]
    assert big[0].data_ptr() != big[1].data_ptr(), "two replicas share one copy"
    big[0].add_(1)  # a copy is independent of the source and of the other copy
    assert torch.equal(ts[4321], before[4321]) and torch.equal(big[1], before[4321])


# ------------------------------------------------------------------- scatter / gather
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_gather_round_trip(dim):
    x = rand((10, 9, 2), torch.float32)
    chunks = comm.scatter(x, ["cpu"] * 3, dim=dim)
    want = x.chunk(3, dim)  # 2 chunks along the last dim (size 2), as torch gives
    assert len(chunks) == len(want) and all(torch.equal(c, t) for c, t in zip(chunks, want))
    assert torch.equal(comm.gather(chunks, dim, "cpu"), x)


def test_scatter_chunk_sizes_and_views():
    x = torch.randn(10, 3)
    chunks = comm.scatter(x, ["cpu"] * 3, chunk_sizes=[2, 0, 8])
    assert [c.shape[0] for c in chunks] == [2, 0, 8]
    assert all(torch.equal(c, t) for c, t in zip(chunks, x.split([2, 0, 8])))
    assert chunks[0].data_ptr() == x.data_ptr(), "a chunk already on its device is a view"


@pytest.mark.parametrize("dim,sizes", [(0, [3, 0, 1, 5]), (1, [5, 0, 1, 3, 2]), (-1, [1, 7, 0, 3])])
def test_scatter_into_out_odd_sizes(dim, sizes):
    # The out tensors' sizes along dim are the chunk sizes (a 0-size chunk among them);
    # the last out is a strided view inside a larger poisoned buffer whose margins must
    # stay poisoned.
    x = rand((9, 11), torch.float64)
    shapes = []
    for s in sizes:
        shape = list(x.shape)
        shape[dim] = s
        shapes.append(shape)
    out = [poisoned(*shape, dtype=torch.float64) for shape in shapes[:-1]]
    backing = poisoned(shapes[-1][0] + 2, shapes[-1][1] + 3, dtype=torch.float64)
    out.append(backing[1:-1, 2:-1])
    assert not out[-1].is_contiguous()
    x_before = snapshot([x])
    res = comm.scatter(x, out=out, dim=dim)
    assert type(res) is tuple and len(res) == len(out) and all(r is o for r, o in zip(res, out))
    for i, (o, want) in enumerate(zip(out, x.split(sizes, dim))):
        assert_close(o, want, tol=(0, 0), what=f"out[{i}] (size {sizes[i]} along dim {dim})")
    margin = torch.ones_like(backing, dtype=torch.bool)
    margin[1:-1, 2:-1] = False
    assert backing[margin].isnan().all(), "scatter wrote outside out[-1]"
    assert_unchanged([x], x_before, what="scattered tensor")


def test_scatter_into_out_rejections_write_nothing():
    x = rand((9, 7), torch.float64)
    f64 = torch.float64

    def outs(*shapes, dtypes=None):
        return [poisoned(*s, dtype=(dtypes or {}).get(i, f64)) for i, s in enumerate(shapes)]

    # In each case the offending out is the last one: nothing is written before every
    # out has been checked.
    cases = [
        (outs((4, 7), (5, 6)), {}, ValueError,
         r"out\[1\] must have tensor's shape \(9, 7\) except along dim 0 and dtype torch.float64, "
         r"got shape \(5, 6\), torch.float64"),
        (outs((4, 7), (35,)), {}, ValueError, r"out\[1\] must have tensor's shape \(9, 7\) .*got shape \(35,\)"),
        (outs((9, 3), (8, 4)), {"dim": -1}, ValueError,
         r"out\[1\] must have tensor's shape \(9, 7\) except along dim 1 .*got shape \(8, 4\)"),
        (outs((4, 7), (0, 7), (4, 7)), {}, ValueError,
         r"the sizes of out along dim 0 must sum to 9, got \[4, 0, 4\] \(sum 8\)"),
        (outs((4, 7), (6, 7)), {}, ValueError, r"the sizes of out along dim 0 must sum to 9, got \[4, 6\] \(sum 10\)"),
        (outs((9, 3), (9, 3)), {"dim": 1}, ValueError,
         r"the sizes of out along dim 1 must sum to 7, got \[3, 3\] \(sum 6\)"),
        (outs((4, 7), (5, 7)), {"chunk_sizes": [4, 5]}, RuntimeError,
         r"'chunk_sizes' must not be specified when 'out' is specified"),
        (outs((4, 7), (5, 7), dtypes={1: torch.float32}), {}, ValueError,
         r"out\[1\] must have tensor's shape \(9, 7\) except along dim 0 and dtype torch.float64, "
         r"got shape \(5, 7\), torch.float32"),
        (outs((4, 7), (5, 7), dtypes={1: torch.int64}), {}, ValueError, r"out\[1\] .* got shape \(5, 7\), torch.int64"),
        (outs((4, 7), (5, 7)), {"devices": ["cpu", "cpu"]}, RuntimeError,
         "Exactly one of 'devices' and 'out' must be specified"),
    ]
    for out, kwargs, exc, match in cases:
        watched = [*out, x]
        before = snapshot(watched)
        with pytest.raises(exc, match=match):
            comm.scatter(x, out=out, **kwargs)
        assert_unchanged(watched, before, what=match)
    with pytest.raises(TypeError, match="out must be a non-empty list or tuple of tensors"):
        comm.scatter(x, out=[])


#: Dtypes for exact round trips beyond float32: 16-bit floats, float64 with full 53-bit
#: mantissas, int64 beyond float32's (and int32's) range, bool.
ROUND_TRIP_DTYPES = [torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.bool]


def exact_values(shape, dtype, gen=None) -> torch.Tensor:
    """Values that a cast through float32 (or a narrower integer) would change, and
    that the float64 compare in assert_close still tells apart (|int64| < 2**52)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype == torch.int64:
        return torch.randint(-(2**52), 2**52, shape, generator=gen)
    if dtype == torch.float64:
        return torch.randn(shape, generator=gen, dtype=torch.float64) * 1e3
    return rand(shape, dtype, gen=gen)


def poison_like(x: torch.Tensor) -> torch.Tensor:
    """A poisoned tensor like ``x``; for bool (no sentinel value), ``~x``."""
    return ~x if x.dtype == torch.bool else poison_(torch.empty_like(x))


@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("dtype", ROUND_TRIP_DTYPES, ids=str)
def test_scatter_gather_round_trip_dtypes(backend, dtype, dim):
    x = exact_values((7, 6), dtype)
    for sizes in (None, [2, 0, x.size(dim) - 2]):
        chunks = comm.scatter(x, ["cpu"] * 3, chunk_sizes=sizes, dim=dim)
        want = x.chunk(3, dim) if sizes is None else x.split(sizes, dim)
        assert len(chunks) == len(want)
        for i, (c, w) in enumerate(zip(chunks, want)):
            assert c.dtype == dtype, f"chunk {i} is {c.dtype}"
            assert_close(c, w, tol=(0, 0), what=f"chunk {i} of {sizes or 'chunk(3)'}")
        g = comm.gather(list(chunks), dim, "cpu")
        assert g.dtype == dtype, f"gather returned {g.dtype}"
        assert_close(g, x, tol=(0, 0), what=f"gather of {sizes or 'chunk(3)'}")
        out = poison_like(x)
        assert comm.gather(list(chunks), dim, out=out) is out
        assert_close(out, x, tol=(0, 0), what=f"gather(out=) of {sizes or 'chunk(3)'}")
        parts = [poison_like(w) for w in want]
        assert all(r is p for r, p in zip(comm.scatter(x, dim=dim, out=parts), parts, strict=True))
        for i, (p, w) in enumerate(zip(parts, want)):
            assert_close(p, w, tol=(0, 0), what=f"scatter(out=)[{i}]")


def test_scatter_default_is_tensor_chunk():
    assert [c.shape[0] for c in comm.scatter(torch.randn(10), ["cpu"] * 3)] == [4, 4, 2]


def test_gather_dim0_is_one_launch():
    ts = [torch.randn(3, 4) for _ in range(5)]
    with fastpar.use_backend("numba"), fastpar.count_launches() as n:
        g = comm.gather(ts, 0, "cpu")
    assert n.total == 1 and torch.equal(g, torch.cat(ts))


def test_gather_scalars_warns_and_unsqueezes():
    with pytest.warns(UserWarning, match="all input tensors were scalars"):
        g = comm.gather([torch.tensor(1.0), torch.tensor(2.0)], 0, "cpu")
    assert torch.equal(g, torch.tensor([1.0, 2.0]))


def test_gather_scalars_in_a_loop_reuses_their_plan():
    # The flatten takes the 0-dim tensors themselves (numel 1 each, end to end), not
    # per-call view(1)s of them, which made a new plan on every call.
    from fastpar import _plan

    ts = [torch.tensor(float(i)) for i in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comm.gather(ts, 0, "cpu")
        misses = _plan._CACHE.misses
        for step in range(3):
            for t in ts:
                t.add_(1.0)
            g = comm.gather(ts, 0, "cpu")
            assert torch.equal(g, torch.stack(ts)), f"step {step}"
    assert _plan._CACHE.misses == misses, "the same tensors again: no new plans"


def test_gather_keeps_a_shared_channels_last_layout():
    # As torch's gather (suggest_memory_format of every input).
    ts = [torch.randn(n, 3, 4, 5).to(memory_format=torch.channels_last) for n in (2, 3)]
    out = comm.gather(ts, 0, "cpu")
    assert out.is_contiguous(memory_format=torch.channels_last) and not out.is_contiguous()
    assert torch.equal(out, torch.cat(ts))
    mixed = comm.gather([ts[0], ts[1].contiguous()], 0, "cpu")
    assert mixed.is_contiguous() and torch.equal(mixed, torch.cat(ts))


def test_gather_takes_torchs_suggested_layout_of_non_contiguous_inputs():
    """torch's gather gives its result ``tensors[0]``'s suggest_memory_format when every
    input suggests the same one: channels_last by the order of the strides, contiguous
    or not. channels_last inputs sliced along a spatial dimension (not channels_last-
    contiguous) gathered into a contiguous (NCHW) result; an (N, 1, H, W) channels_last
    input (also contiguous) kept the contiguous strides."""
    cl = torch.randn(4, 3, 4, 10).to(memory_format=torch.channels_last)
    parts = [cl[:2, ..., ::2], cl[2:, ..., 1::2]]
    assert not any(p.is_contiguous() or p.is_contiguous(memory_format=torch.channels_last) for p in parts)
    got = comm.gather(parts, 0, "cpu")
    assert got.stride() == torch.empty(got.shape, memory_format=torch.channels_last).stride(), got.stride()
    assert torch.equal(got, torch.cat(parts))
    cl3 = torch.randn(2, 3, 2, 4, 6).to(memory_format=torch.channels_last_3d)[..., ::3]
    got = comm.gather([cl3, cl3], 1, "cpu")
    assert got.stride() == torch.empty(got.shape, memory_format=torch.channels_last_3d).stride(), got.stride()
    assert torch.equal(got, torch.cat([cl3, cl3], 1))
    one = [torch.randn(n, 1, 3, 4).to(memory_format=torch.channels_last) for n in (2, 3)]
    got = comm.gather(one, 0, "cpu")
    assert got.stride() == torch.empty(got.shape, memory_format=torch.channels_last).stride(), got.stride()
    assert torch.equal(got, torch.cat(one))
    mixed = comm.gather([parts[0], parts[1].contiguous()], 0, "cpu")
    assert mixed.is_contiguous() and torch.equal(mixed, torch.cat(parts))


def test_gather_to_minus_one_warns_as_torch():
    ts = [torch.randn(2, 3), torch.randn(1, 3)]
    with pytest.warns(FutureWarning, match="Using -1 to represent CPU tensor is deprecated"):
        out = comm.gather(ts, 0, -1)
    assert out.device.type == "cpu" and torch.equal(out, torch.cat(ts))

@pytest.mark.parametrize("dim", [0, 1])
def test_gather_records_autograd_as_torch(dim):
    """torch's gather copies with copy_, which autograd records; the one-launch dim-0
    path does not, so it is only taken when nothing requires grad."""
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(1 if dim == 0 else 2, 3, requires_grad=True)
    g = comm.gather([a, b], dim, "cpu")
    assert g.requires_grad and g.grad_fn is not None
    w = torch.randn(g.shape)
    (g * w).sum().backward()
    wa, wb = w.split([a.size(dim), b.size(dim)], dim)
    assert torch.equal(a.grad, wa) and torch.equal(b.grad, wb)
    if dim == 0:
        with torch.no_grad(), fastpar.use_backend("numba"), fastpar.count_launches() as n:
            comm.gather([a, b], 0, "cpu")
        assert n.total == 1  # nothing for autograd to record: the one-launch path


def _leaf_rg(*shape):
    return torch.zeros(*shape, requires_grad=True)


def _inference(*shape):
    with torch.inference_mode():
        return torch.zeros(*shape)


@pytest.mark.parametrize("op", ["broadcast", "scatter"])
@pytest.mark.parametrize("make,match", [
    (_leaf_rg, r"out\[1\] is a leaf tensor that requires grad"),
    (lambda *s: _leaf_rg(*s).view(s), r"out\[1\] is a view of a leaf tensor that requires grad"),
    (_inference, r"out\[1\] is an inference tensor"),
    (lambda *s: torch.zeros(s[-1]).expand(*s), r"out\[1\] has elements that share memory"),
    (lambda *s: (torch.zeros(2, *s, requires_grad=True) * 1).unbind(0)[1],
     r"out\[1\] is a view made by a function that returns several views"),
], ids=["leaf", "view-of-leaf", "inference", "expanded", "unbind"])
def test_broadcast_and_scatter_out_refusals_write_nothing(op, make, match):
    """What copy_ would refuse is checked for every out first: a refusal at out[1] used
    to leave out[0] written."""
    t = torch.randn(4, 2)
    shape = (4, 2) if op == "broadcast" else (2, 2)
    out = [poisoned(*shape), make(*shape)]
    before = snapshot(out[:1])
    with pytest.raises(RuntimeError, match=match):
        getattr(comm, op)(t, out=out)
    assert_unchanged(out[:1], before, what=f"out[0] of a rejected {op}")


def _copy_target_case(base_rg, make, made_with_grad, src_rg, leaf):
    """A fresh (out, src) pair: ``out`` a view of a (leaf or not) base made one way."""
    b = torch.randn(4, 3, requires_grad=base_rg)
    if not leaf:
        b = b * 1
    with torch.set_grad_enabled(made_with_grad):
        o = {"unbind": lambda: b.unbind(0)[1], "split": lambda: b.split(2)[1], "slice": lambda: b[1:3],
             "view": lambda: b.view(12)[3:6].view(1, 3), "self": lambda: b[1:3].clone() if not leaf else b}[make]()
    return o, torch.randn(o.shape, requires_grad=src_rg)


@pytest.mark.parametrize("write_with_grad", [True, False])
@pytest.mark.parametrize("make", ["unbind", "split", "slice", "view", "self"])
def test_broadcast_out_refuses_exactly_what_copy_refuses(make, write_with_grad):
    """Against torch's own ``copy_`` (autograd's check_inplace) over bases requiring grad
    or not, leaf or not, views made with grad on or off, sources requiring grad or not:
    fastpar refuses the same calls, before writing anything, and writes the rest."""
    seen = set()
    for base_rg, made_with_grad, src_rg, leaf in itertools.product([False, True], repeat=4):
        torch.manual_seed(0)
        o, src = _copy_target_case(base_rg, make, made_with_grad, src_rg, leaf)
        with torch.set_grad_enabled(write_with_grad):
            try:
                o.copy_(src)
                torch_refuses = False
            except RuntimeError:
                torch_refuses = True
        seen.add(torch_refuses)
        torch.manual_seed(0)
        o, src = _copy_target_case(base_rg, make, made_with_grad, src_rg, leaf)
        first = poisoned(*o.shape)
        case = f"base requires grad {base_rg}, made with grad {made_with_grad}, src requires grad {src_rg}, leaf {leaf}"
        with torch.set_grad_enabled(write_with_grad):
            if torch_refuses:
                with pytest.raises(RuntimeError, match=r"out\[1\] is a"):
                    comm.broadcast(src, out=[first, o])
                assert torch.isnan(first).all(), f"out[0] written by a refused call ({case})"
            else:
                comm.broadcast(src, out=[first, o])
                assert torch.equal(first, src) and torch.equal(o, src), case
    assert seen == ({True, False} if write_with_grad else {False})  # both kinds of case were met


@pytest.mark.parametrize("op", ["broadcast", "scatter", "gather"])
def test_out_partly_overlapping_its_source_is_refused_before_writing(op):
    """ATen's copies refuse an output partly overlapping its source; a refusal at out[1]
    used to leave out[0] written. The same elements (a no-op copy) are let through."""
    buf = torch.arange(12.0)
    first = poisoned(4)
    if op == "broadcast":
        src = buf[2:6]
        call = lambda: comm.broadcast(src, out=[first, buf[4:8]])
    elif op == "scatter":
        src = buf[:8]
        call = lambda: comm.scatter(src, out=[first, buf[6:10]])
    else:
        first = buf[4:12]  # slices [4:8] <- buf[0:4], [8:12] <- buf[6:10]
        call = lambda: comm.gather([buf[0:4], buf[6:10]], out=first)
    before = snapshot([buf, first])
    with pytest.raises(RuntimeError, match=r"partly overlaps the memory of"):
        call()
    assert_unchanged([buf, first], before, what=f"a rejected {op}")
    same = torch.arange(4.0)
    assert comm.broadcast(same, out=[first[:4], same])[1] is same  # the same elements: torch copies nothing


def test_out_overlap_check_follows_aten_where_it_lets_copies_through():
    """ATen judges overlap within one storage object and ignores meta tensors: two
    storages over the same memory (from_dlpack) and meta outputs are copied, as torch
    copies them; inputs that are exactly their own slices of gather's out are no-ops."""
    x = torch.arange(12.0)
    twin = torch.from_dlpack(x)  # another storage object over x's memory
    y = torch.arange(12.0)
    torch.from_dlpack(y)[4:8].copy_(y[2:6])  # what torch's copy leaves
    first = poisoned(4)
    comm.broadcast(x[2:6], out=[first, twin[4:8]])
    assert torch.equal(x, y) and torch.equal(first, torch.arange(2.0, 6.0))
    s = torch.empty(4, 3, device="meta").t()
    assert comm.broadcast(s, out=[torch.empty(3, 4, device="meta")])[0].is_meta
    for dim in (0, 1):
        buf = torch.arange(8.0).view(2, 4) if dim == 1 else torch.arange(8.0)
        before = buf.clone()
        halves = buf.split([1, 3] if dim == 1 else [4, 4], dim)
        assert comm.gather(list(halves), dim, out=buf) is buf and torch.equal(buf, before)


@pytest.mark.parametrize("op", ["broadcast", "scatter", "gather"])
def test_meta_source_into_real_out_is_refused_before_writing(op):
    meta = torch.empty(3, device="meta")
    if op == "broadcast":
        out = [poisoned(3), poisoned(3)]
        call = lambda: comm.broadcast(meta, out=out)
    elif op == "scatter":
        out = [poisoned(3), poisoned(3)]
        call = lambda: comm.scatter(torch.empty(6, device="meta"), out=out)
    else:  # the real input comes first: it used to be copied before the meta one failed
        out = [poisoned(6)]
        call = lambda: comm.gather([torch.ones(3), meta], out=out[0])
    before = snapshot(out)
    with pytest.raises(ValueError, match=r"is a meta tensor, with no data to copy into out"):
        call()
    assert_unchanged(out, before, what=f"out of a rejected {op}")


def test_reduce_out_requiring_grad_is_refused_with_grad_on():
    a = [torch.randn(3), torch.randn(2)]
    out = [poisoned(3), torch.zeros(2, requires_grad=True) * 1]
    before = snapshot(out)
    with pytest.raises(RuntimeError, match=r"out\[1\] requires grad"):
        comm.reduce_add_coalesced([a, a], "cpu", out=out)
    assert_unchanged(out, before, what="out of a rejected reduce_add_coalesced")
    with torch.no_grad():
        comm.reduce_add_coalesced([a, a], "cpu", out=out)
    assert torch.equal(out[1], 2 * a[1])



def test_reduce_out_reaching_past_its_shrunk_storage_is_refused():
    """An out tensor whose storage was shrunk in place is refused before any is written
    (the kernel wrote past its allocation), also when out's plan is cached."""
    a = [torch.randn(3), torch.randn(1024)]
    out = [poisoned(3), torch.zeros(1024)]
    comm.reduce_add_coalesced([a, a], "cpu", out=out)  # plan cached
    out[1].untyped_storage().resize_(2000)
    poison_(out[0])
    with pytest.raises(ValueError, match=r"out\[1\] reaches byte 4096 of its storage, which holds 2000 bytes"):
        comm.reduce_add_coalesced([a, a], "cpu", out=out)
    assert out[0].isnan().all(), "a rejected reduce wrote"

def test_out_leaf_requiring_grad_is_written_under_no_grad():
    t = torch.randn(4, 2)
    out = [_leaf_rg(4, 2), _leaf_rg(4, 2)]
    with torch.no_grad():
        comm.broadcast(t, out=out)
        comm.scatter(t, out=[out[0][:1], out[1][:3]])
    assert torch.equal(out[0][:1], t[:1]) and torch.equal(out[1][:3], t[1:])


def test_scatter_takes_fewer_streams_than_devices():
    # As torch's: streams[i] where given, the current stream for the rest.
    x = torch.randn(6, 3)
    chunks = comm.scatter(x, ["cpu", "cpu", "cpu"], None, 0, [None])
    assert [c.shape[0] for c in chunks] == [2, 2, 2] and torch.equal(torch.cat(chunks), x)
    outs = [poisoned(3, 3), poisoned(3, 3)]
    comm.scatter(x, streams=[None], out=outs)
    assert torch.equal(torch.cat(outs), x)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_scatter_out_copies_on_the_given_streams():
    x = torch.randn(1 << 20, 4, device="cuda")
    s = torch.cuda.Stream()
    outs = [torch.empty(1 << 19, 4, device="cuda") for _ in range(2)]
    s.wait_stream(torch.cuda.current_stream())
    comm.scatter(x, streams=[s, s], out=outs)
    s.synchronize()
    assert torch.equal(torch.cat(outs), x)


def test_empty_lists_and_iterables_as_torch():
    """torch's reduce_add_coalesced of empty lists returns (), its broadcast_coalesced of
    an empty list an empty list per device, and both take any iterable of devices or
    lists."""
    assert comm.reduce_add_coalesced([[], []], "cpu") == ()
    assert comm.broadcast_coalesced([], ["cpu", "cpu"]) == [[], []]
    t = torch.randn(3)
    assert all(torch.equal(c, t) for c in comm.broadcast(t, (d for d in ["cpu", "cpu"])))
    (r,) = comm.reduce_add_coalesced(iter([[t], [t]]), "cpu")
    assert torch.equal(r, 2 * t)
    with pytest.raises(TypeError, match="devices must be a list, tuple or other iterable of devices, got str"):
        comm.broadcast(t, "cpu")


def test_sparse_with_out_says_out_is_the_reason():
    s = torch.tensor([1.0, 2.0, 0.0]).to_sparse()
    out = [poisoned(3)]
    before = snapshot(out)
    with pytest.raises(TypeError, match=r"inputs\[0\]\[0\] has layout torch.sparse_coo; sparse COO tensors are summed only with out=None"):
        comm.reduce_add_coalesced([[s], [s]], "cpu", out=out)
    assert_unchanged(out, before, what="rejected sparse reduce into out")


def test_gather_out():
    ts = [torch.randn(2, 3), torch.randn(1, 3)]
    out = poison_(torch.empty(3, 3))
    assert comm.gather(ts, out=out) is out and torch.equal(out, torch.cat(ts))


# --------------------------------------------------------------------------- bad input
def test_reduce_bad_inputs_write_nothing():
    a = [torch.randn(2), torch.randn(3)]
    out = [poison_(torch.empty(2)), poison_(torch.empty(3))]

    cases = [
        (([a, a[:1]], "cpu"), {}, ValueError, r"inputs\[1\] .* has 1 tensors but inputs\[0\] .* has 2"),
        (([a, [torch.randn(2), torch.randn(4)]], "cpu"), {}, ValueError, r"position 1: inputs\[1\]\[1\] on cpu has shape \(4,\).*inputs\[0\]\[1\] on cpu has shape \(3,\)"),
        (([a, [torch.randn(2), torch.randn(3, dtype=torch.float64)]], "cpu"), {}, ValueError, "position 1"),
        (([a, a], 1), {}, ValueError, r"destination must be one of the inputs. devices \[.cpu.\], got cuda:1"),
        (([], "cpu"), {}, TypeError, "non-empty list"),
        (([a, a], "cpu"), {"out": [poisoned(2)]}, ValueError, "out must hold 2 tensors"),
        (([a, a], "cpu"), {"out": [poisoned(2), poisoned(4)]}, ValueError, r"out\[1\] has shape \(4,\)"),
        (([a, a], "cpu"), {"out": [poisoned(2), poisoned(3, 2)[:, 0]]}, ValueError, r"out\[1\] must be contiguous"),
        (([a, a], "cpu"), {"out": [a[0], poisoned(3)]}, ValueError, r"out\[0\] overlaps the memory of inputs\[0\]\[0\]"),
        (([a, [torch.randn(2), torch.randn(3)]], "cpu"), {"out": [out[1][:2], out[1]]}, ValueError,
         r"out\[0\] and out\[1\] share memory"),
        (([a, [torch.randn(2), torch.eye(3).to_sparse()]], "cpu"), {}, TypeError, "layout torch.sparse_coo"),
        (([[torch.randn(2), torch.ones(3, dtype=torch.bool)]] * 2, "cpu"), {"out": [out[0], poisoned(3, dtype=torch.bool)]},
         TypeError, r"inputs\[0\]\[1\]: cannot reduce torch.bool"),
        (([a, a], "cpu"), {"buffer_size": 0}, ValueError, "buffer_size must be a positive int"),
    ]
    for args, kwargs, exc, match in cases:
        kwargs = dict(kwargs)
        kwargs.setdefault("out", out)
        # Whatever the call could write: its out tensors, the default ones, the inputs.
        watched = [*kwargs["out"], *out, *a]
        before = snapshot(watched)
        with pytest.raises(exc, match=match):
            comm.reduce_add_coalesced(*args, **kwargs)
        assert_unchanged(watched, before, what=match)


def test_reduce_add_bad_inputs():
    with pytest.raises(ValueError, match=r"inputs\[1\] \(on cpu\) has shape \(3,\)"):
        comm.reduce_add([torch.randn(2), torch.randn(3)], "cpu")
    with pytest.raises(TypeError, match=r"inputs\[1\] must be a torch.Tensor"):
        comm.reduce_add([torch.randn(2), [1, 2]], "cpu")


def test_device_validation():
    with pytest.raises(ValueError, match="must not repeat a CUDA device: cuda:0 is at positions 0 and 1"):
        comm._devices([0, "cuda:0"], "devices")
    with pytest.raises(ValueError, match="mixes CPU and CUDA"):
        comm._devices(["cpu", 0], "devices")
    with pytest.raises(TypeError, match="devices must be a list"):
        comm.broadcast_coalesced([torch.randn(2)], "cpu")
    with pytest.raises(TypeError, match=r"devices\[1\] must be an int, str or torch.device, got float"):
        comm._devices(["cpu", 1.5], "devices")
    assert comm._devices(["cpu", torch.device("cpu")], "devices") == [torch.device("cpu")] * 2


def test_scatter_gather_bad_input():
    x = torch.randn(10, 3)
    with pytest.raises(ValueError, match=r"chunk_sizes must sum to tensor.size\(0\) = 10, got \[2, 3\]"):
        comm.scatter(x, ["cpu", "cpu"], chunk_sizes=[2, 3])
    with pytest.raises(RuntimeError, match="Exactly one of 'devices' and 'out'"):
        comm.scatter(x)
    with pytest.raises(ValueError, match=r"tensors\[1\] .* has shape \(2, 4\)"):
        comm.gather([torch.randn(2, 3), torch.randn(2, 4)], 0, "cpu")
    out = poison_(torch.empty(5, 3))
    with pytest.raises(ValueError, match="out must have shape"):
        comm.gather([torch.randn(2, 3), torch.randn(2, 3)], out=out)
    assert out.isnan().all()


def test_reduce_add_coalesced_out_bumps_version_counters(backend):
    """Writing into ``out`` is an in-place change autograd must see: a graph that saved
    an out tensor before the reduction refuses to run backward through stale values."""
    a = [rand((5,), torch.float32), rand((3, 2), torch.float32)]
    b = [rand((5,), torch.float32), rand((3, 2), torch.float32)]
    out = [torch.zeros(5), torch.zeros(3, 2)]
    versions = [o._version for o in out]
    comm.reduce_add_coalesced([a, b], "cpu", out=out)
    # Once each, as one in-place op (the torch reference backend's copy_ added one more).
    assert [o._version - v for o, v in zip(out, versions)] == [1, 1], [o._version for o in out]
    w = torch.ones(5, requires_grad=True)
    y = (w * out[0]).sum()  # saves out[0] for backward
    comm.reduce_add_coalesced([a, b], "cpu", out=out)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_gather_mixed_dtypes_convert_as_torch_does(backend):
    """torch's gather makes its result with tensors[0]'s dtype (gather_out: out's) and
    copy_ converts the others; it checks shapes only. Gradients come back in each
    input's own dtype."""
    a = rand((2, 3), torch.float32).requires_grad_()
    b = rand((3, 3), torch.float64).requires_grad_()
    c = torch.randint(-5, 5, (1, 3), dtype=torch.int32)
    with fastpar.use_backend(backend):
        got = fastpar.gather([a, b, c], "cpu")
        assert got.dtype == torch.float32
        assert torch.equal(got.detach(), torch.cat([a.detach(), b.detach().float(), c.float()]))
        got.sum().backward()
        assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float64
        assert torch.equal(a.grad, torch.ones_like(a)) and torch.equal(b.grad, torch.ones_like(b))
        out = poison_(torch.empty(6, 3, dtype=torch.float64))
        assert comm.gather([a.detach(), b.detach(), c], out=out) is out
        assert torch.equal(out, torch.cat([a.detach().double(), b.detach(), c.double()]))
        # The one-launch path (every input already out's dtype) and the copies agree.
        out32 = poison_(torch.empty(6, 3))
        comm.gather([a.detach(), b.detach().float(), c.float()], out=out32)
        assert torch.equal(out32, got.detach())


# ------------------------------------------------------------------ CUDA (multi-GPU)
needs_2_gpus = pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs 2+ CUDA devices")


@needs_2_gpus
@pytest.mark.parametrize("staged", [False, True], ids=["peer", "staged"])
def test_cuda_reduce_add_coalesced(staged, monkeypatch):
    from fastpar import _cuda

    if staged:
        monkeypatch.setattr(_cuda, "allocator_allows_peer_pointers", lambda: False)
    n = torch.cuda.device_count()
    lists = [[rand(s, d, device=f"cuda:{i}") for s, d in MIXED_SHAPES] for i in range(n)]
    path = comm.reduce_path([f"cuda:{i}" for i in range(n)], "cuda:0")
    if not staged and not all(torch.cuda.can_device_access_peer(0, i) for i in range(1, n)):
        pytest.skip("no peer access between these GPUs")
    assert path == ("staged" if staged else "peer")
    res = comm.reduce_add_coalesced(lists, 0)
    for r, e in zip(res, ref_sum([[t.cpu() for t in lst] for lst in lists])):
        assert r.device == torch.device("cuda:0")
        assert_close(r, e, tol=reduce_tol(r.dtype, n))


@needs_2_gpus
@pytest.mark.parametrize("staged", [False, True], ids=["peer", "staged"])
def test_cuda_reduce_is_ordered_with_the_source_devices_streams(staged, monkeypatch):
    # The reduce on cuda:0 reads cuda:1's tensor only after the work queued before the
    # call on cuda:1's current stream (the producer), and work queued there after the
    # call cannot overtake that read (a write, or the allocator reusing the memory).
    # The peer path orders itself (_cuda.wait_for, _cuda.release_to); the staged one
    # rests on its pack running on cuda:1's stream and on torch's two-way barrier
    # around a cross-device copy. Checked by values behind long sleeps, each phase
    # skipped if the host got there after its sleep had ended (nothing checked).
    from fastpar import _cuda

    if staged:
        monkeypatch.setattr(_cuda, "allocator_allows_peer_pointers", lambda: False)
    elif not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("no peer access between cuda:0 and cuda:1")
    n = 1 << 20
    src0, src1 = torch.ones(n, device="cuda:0"), torch.zeros(n, device="cuda:1")
    out = torch.empty(n, device="cuda:0")
    comm.reduce_add_coalesced([[src0], [src1]], 0, out=[out])  # compiled, pair enabled
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert comm.reduce_path(["cuda:0", "cuda:1"], "cuda:0") == ("staged" if staged else "peer")

    # The producer: cuda:1 writes 2s behind a ~0.5 s kernel; cuda:0 is idle.
    with torch.cuda.device(1):
        torch.cuda._sleep(int(1e9))
        src1.fill_(2.0)
        written = torch.cuda.Event()
        written.record()
    poison_(out)
    comm.reduce_add_coalesced([[src0], [src1]], 0, out=[out])
    if written.query():
        pytest.skip("the host returned after cuda:1's sleep had ended: the producer's order was not checked")
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert torch.equal(out.cpu(), torch.full((n,), 3.0)), "the reduce read cuda:1's tensor before its producer wrote it"

    # The overwrite: the reduce waits behind a ~0.5 s kernel on cuda:0, and cuda:1
    # writes 100s into its source as soon as the call returns.
    with torch.cuda.device(0):
        torch.cuda._sleep(int(1e9))
        slept = torch.cuda.Event()
        slept.record()
    poison_(out)
    comm.reduce_add_coalesced([[src0], [src1]], 0, out=[out])
    src1.fill_(100.0)
    if slept.query():
        pytest.skip("the host returned after cuda:0's sleep had ended: the overwrite's order was not checked")
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    assert torch.equal(out.cpu(), torch.full((n,), 3.0)), "a write queued on cuda:1 after the call overtook its read"


@needs_2_gpus
def test_cuda_broadcast_coalesced_matches_torch():
    ts = [rand(s, d, device="cuda:0") for s, d in MIXED_SHAPES]
    ours = comm.broadcast_coalesced(ts, [0, 1])
    theirs = torch.nn.parallel.comm.broadcast_coalesced(ts, [0, 1])
    for a, b in zip(ours[1], theirs[1]):
        assert a.device == b.device and torch.equal(a, b)


# ------------------------------------------------- CUDA, one GPU: the compiled kernels
# K copies held on one GPU run the peer path's kernel with every source local: the same
# compiled code a multi-GPU machine runs, minus the peer reads.
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def cuda_lists(k, shapes, *, offset=0):
    """K per-"device" lists on cuda:0; ``offset`` > 0 starts every tensor that many
    elements into its storage (no 16-byte alignment: the scalar path)."""
    def one(s, d):
        n = 1
        for x in s:
            n *= x
        return rand((offset + n,), d, device="cuda")[offset:].view(s)
    return [[one(s, d) for s, d in shapes] for _ in range(k)]


@needs_cuda
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_cuda_one_gpu_reduce_add_coalesced(k, offset):
    shapes = MIXED_SHAPES + [((65_537,), torch.float32), ((257, 129), torch.bfloat16)]
    lists = cuda_lists(k, shapes, offset=offset)
    assert comm.reduce_path(["cuda:0"] * k, "cuda:0") == "peer"
    with fastpar.count_launches() as n:
        result = comm.reduce_add_coalesced(lists, 0)
    assert n.by_op == {("triton", "reduce_add"): len({d for _, d in shapes})}, n.by_op  # one per dtype
    for i, (r, e) in enumerate(zip(result, ref_sum([[t.cpu() for t in lst] for lst in lists]))):
        assert r.device == torch.device("cuda", 0) and r.dtype == lists[0][i].dtype
        assert_close(r, e, what=f"position {i}", tol=reduce_tol(r.dtype, k))
    out = [poison_(torch.empty_like(t)) for t in lists[0]]
    assert comm.reduce_add_coalesced(lists, "cuda:0", out=out) == tuple(out)
    for i, (o, r) in enumerate(zip(out, result)):
        assert torch.equal(o, r), f"out[{i}] differs from the allocating call"


@needs_cuda
def test_cuda_one_gpu_reduce_thousand_tensors_one_launch():
    gen = torch.Generator().manual_seed(3)
    shapes = [((int(n),), torch.float16) for n in torch.randint(0, 300, (1000,), generator=gen)]
    lists = cuda_lists(4, shapes)
    out = [poison_(torch.empty_like(t)) for t in lists[0]]
    with fastpar.count_launches() as n:
        comm.reduce_add_coalesced(lists, 0, out=out)
    assert n.total == 1
    for i, (o, e) in enumerate(zip(out, ref_sum([[t.cpu() for t in lst] for lst in lists]))):
        assert_close(o, e, what=f"position {i}", tol=reduce_tol(torch.float16, 4))


@needs_cuda
def test_cuda_reduce_reusing_its_table_on_another_stream_waits_for_its_copy():
    # The first call copies its table behind a long kernel on the current stream; the
    # second reuses it on a side stream, which must wait for that copy (not for the
    # whole stream) before its kernel reads the table. Checked by order, not by a wall
    # time: while the long kernel has not finished, the side stream's work must not have
    # either. (A check after a fixed sleep failed on a loaded host, 16 xdist workers on
    # one H200: the host took longer than the kernel to get there.)
    lists = cuda_lists(3, [((4099,), torch.float32), ((33, 5), torch.float32)])
    out = [torch.empty_like(t) for t in lists[0]]
    side = torch.cuda.Stream()
    # Compiled, and a side stream used once: a process's first call on a side stream
    # blocked the host until the device was idle (H200, torch 2.11), so the check below
    # saw nothing pending.
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            comm.reduce_add_coalesced(lists, 0, out=[torch.empty_like(t) for t in lists[0]])
    torch.cuda.synchronize()
    torch.cuda._sleep(int(1e9))  # ~0.5 s on the current stream
    slept = torch.cuda.Event()
    slept.record()
    comm.reduce_add_coalesced(lists, 0, out=out)
    with torch.cuda.stream(side):
        comm.reduce_add_coalesced(lists, 0, out=out)
        done = torch.cuda.Event()
        done.record(side)
    polls = 0
    while not slept.query():
        # (done before slept, read in this order, cannot be a stale pair: slept
        # completes first whenever the side stream waits.)
        assert not done.query() or slept.query(), "the side stream ran before the reused table had been copied"
        polls += 1
    if polls == 0:
        pytest.skip("the host reached the check after the 0.5 s kernel had finished: nothing was checked")
    torch.cuda.synchronize()
    for i, (o, e) in enumerate(zip(out, ref_sum([[t.cpu() for t in lst] for lst in lists]))):
        assert_close(o, e, what=f"out[{i}]", tol=reduce_tol(torch.float32, 3))
    with torch.cuda.stream(side):  # the copy has run: no more waiting
        for o in out:
            poison_(o)
        comm.reduce_add_coalesced(lists, 0, out=out)
    torch.cuda.synchronize()
    for i, (o, e) in enumerate(zip(out, ref_sum([[t.cpu() for t in lst] for lst in lists]))):
        assert_close(o, e, what=f"again: out[{i}]", tol=reduce_tol(torch.float32, 3))


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64], ids=str)
def test_cuda_integers_wrap_as_torch(dtype):
    info = torch.iinfo(dtype)
    lists = [[torch.randint(info.min, info.max, (n,), dtype=dtype, device="cuda") for n in (1, 7, 3000)]
             for _ in range(5)]
    expected = [t.clone() for t in lists[0]]
    for lst in lists[1:]:
        for e, t in zip(expected, lst):
            e.add_(t)
    for i, (r, e) in enumerate(zip(comm.reduce_add_coalesced(lists, 0), expected)):
        assert torch.equal(r, e), f"position {i}"


@needs_cuda
def test_cuda_one_gpu_broadcast_scatter_gather():
    ts = [rand(s, d, device="cuda") for s, d in MIXED_SHAPES]
    [copies] = comm.broadcast_coalesced(ts, [0])
    assert all(a is b for a, b in zip(copies, ts)), "outputs[0] are the inputs themselves"
    x = torch.randn(10, 3)
    parts = comm.scatter(x, [0])
    assert len(parts) == 1 and parts[0].device.type == "cuda" and torch.equal(parts[0].cpu(), x)
    chunks = [torch.randn(n, 3, device="cuda") for n in (4, 0, 7)]
    with fastpar.count_launches() as n:
        on_gpu = comm.gather(chunks, 0, 0)
    assert n.by_op == {("triton", "flatten"): 1} and torch.equal(on_gpu, torch.cat(chunks))
    with pytest.warns(FutureWarning, match="Using -1 to represent CPU tensor is deprecated"):
        on_cpu = comm.gather(chunks, 0, -1)
    assert on_cpu.device.type == "cpu" and torch.equal(on_cpu, torch.cat(chunks).cpu())
    cl = [torch.randn(n, 3, 4, 5, device="cuda").to(memory_format=torch.channels_last) for n in (2, 3)]
    kept = comm.gather(cl, 0, 0)
    assert kept.is_contiguous(memory_format=torch.channels_last) and torch.equal(kept, torch.cat(cl))


@needs_cuda
def test_cuda_one_gpu_repeated_devices_scatter_and_gather_backward():
    # torch's scatter takes a device more than once, and Gather's backward scatters to
    # its inputs' devices, which repeat when two inputs share a GPU.
    x = torch.randn(6, 3)
    parts = comm.scatter(x, [0, 0])
    assert [p.device for p in parts] == [torch.device("cuda", 0)] * 2
    assert torch.equal(torch.cat([p.cpu() for p in parts]), x)
    a = torch.randn(2, 3, device="cuda", requires_grad=True)
    b = torch.randn(4, 3, device="cuda", requires_grad=True)
    g = torch.randn(6, 3, device="cuda")
    fastpar.gather([a, b], 0).backward(g)
    assert torch.equal(a.grad, g[:2]) and torch.equal(b.grad, g[2:])


@needs_cuda
def test_cuda_one_gpu_complex_and_sparse_reduce():
    lists = [[torch.randn(5, 3, dtype=torch.complex64, device="cuda"), torch.randn(7, device="cuda")] for _ in range(3)]
    res = comm.reduce_add_coalesced(lists, 0)
    for i, r in enumerate(res):
        e = sum(lst[i].cpu().to(torch.complex128 if r.is_complex() else torch.float64) for lst in lists)
        r, e = (torch.view_as_real(r), torch.view_as_real(e)) if r.is_complex() else (r, e)
        assert_close(r, e, what=f"position {i}", tol=reduce_tol(torch.float32, 3))
    sp = [torch.sparse_coo_tensor(torch.tensor([[k, 3]]), torch.randn(2, 2), (6, 2), device="cuda") for k in range(3)]
    total = comm.reduce_add_coalesced([[t] for t in sp], 0)[0]
    assert total.layout == torch.sparse_coo and total.device == torch.device("cuda", 0)
    assert_close(total.to_dense(), sum(t.to_dense() for t in sp), what="sparse sum", tol=reduce_tol(torch.float32, 3))


@needs_cuda
def test_cuda_gather_into_pinned_host_memory_is_complete_on_return():
    # Read out with no CUDA synchronisation in between: an asynchronous device-to-host
    # copy into pinned memory would still be running (torch's gather copies
    # synchronously when out is on the host, and so must fastpar's).
    n = 1 << 24
    chunks = [torch.randn(n, device="cuda") for _ in range(3)]
    out = torch.full((3 * n,), float("nan")).pin_memory()
    comm.gather(chunks, out=out)
    got = out.clone()  # a host copy: does not wait for the GPU
    assert torch.equal(got, torch.cat(chunks).cpu())


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_single_device_reduce():
    ts = [torch.randn(100, device="cuda") for _ in range(2)]  # distinct: a wrong source shows
    assert_close(comm.reduce_add(ts, 0), ts[0].double() + ts[1].double(), dtype=torch.float32)


def test_out_overlap_detection_is_exact():
    base = torch.randn(100)
    inputs = [[base[0:10], base[20:30]], [torch.randn(10), torch.randn(10)]]
    ok = [base[10:20], base[30:40]]  # adjacent, not overlapping
    want = [a.double() + b.double() for a, b in zip(*inputs)]
    comm.reduce_add_coalesced(inputs, "cpu", out=ok)
    for got, w in zip(ok, want):
        assert_close(got, w, dtype=torch.float32, what="out= adjacent to the inputs")
    for bad, where in [([base[9:19], base[40:50]], r"out\[0\] overlaps the memory of inputs\[0\]\[0\]"),
                       ([base[40:50], base[29:39]], r"out\[1\] overlaps the memory of inputs\[0\]\[1\]"),
                       ([base[40:50], base[15:25]], r"out\[1\] overlaps the memory of inputs\[0\]\[1\]")]:
        before = snapshot([base])
        with pytest.raises(ValueError, match=where):
            comm.reduce_add_coalesced(inputs, "cpu", out=bad)
        assert_unchanged([base], before, what=where)


ALLOC_SCRIPT = """
import torch
from fastpar import comm
lists = [[torch.randn(n, device="cuda") for n in (1000, 7, 65537)] for _ in range(2)]
path = comm.reduce_path(["cuda:0", "cuda:0"], "cuda:0")
assert path == "staged", (path, torch.cuda.get_allocator_backend())
res = comm.reduce_add_coalesced(lists, 0)
assert all(torch.equal(r, a + b) for r, a, b in zip(res, *lists))
print("ok")
"""


@needs_cuda
@pytest.mark.parametrize("conf", ["backend:cudaMallocAsync", "expandable_segments:True"])
def test_cuda_allocator_configs_without_raw_peer_pointers_take_the_staged_path(conf):
    # Set before CUDA initialises, hence a fresh process.
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=conf)
    res = subprocess.run([sys.executable, "-c", ALLOC_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


def test_expandable_segments_set_at_run_time_take_the_staged_path(monkeypatch):
    # The environment is not the only way to turn expandable segments on: torch's
    # run-time setter leaves PYTORCH_CUDA_ALLOC_CONF as it was. (Runs without a GPU:
    # the allocator's backend is answered, the settings string is torch's own.)
    from fastpar import _cuda

    if not hasattr(torch._C, "_accelerator_getAllocatorSettings"):
        pytest.skip("this torch does not report its allocator settings")
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    before = torch._C._accelerator_getAllocatorSettings()
    if "expandable_segments:true" in before.replace(" ", "").lower():
        pytest.skip("expandable segments are on in this process already")
    try:
        torch._C._accelerator_setAllocatorSettings("expandable_segments:True")
        assert not _cuda.allocator_allows_peer_pointers()
    finally:  # the settings as they were (torch keeps the last string set)
        torch._C._accelerator_setAllocatorSettings(before or "expandable_segments:False")
    assert _cuda.allocator_allows_peer_pointers()


def test_reduce_refuses_same_numel_different_shapes():
    # torch's reduce_add checks every input's size, not only its numel.
    with pytest.raises(ValueError, match=r"position 0: inputs\[1\]\[0\] .* shape \(4, 3\)"):
        comm.reduce_add_coalesced([[torch.ones(3, 4)], [torch.ones(4, 3)]], "cpu")


def test_reduce_out_on_another_device_is_refused():
    inputs = [[torch.ones(3)], [torch.ones(3)]]
    with pytest.raises(ValueError, match="out must be on the destination cpu, got tensors on meta"):
        comm.reduce_add_coalesced(inputs, "cpu", out=[torch.empty(3, device="meta")])


def test_reduce_out_with_more_tensors_than_positions_is_refused():
    inputs = [[torch.ones(3)], [torch.ones(3)]]
    extra = torch.zeros(3)
    with pytest.raises(ValueError, match=r"out must hold 1 tensors \(one per input position\), got 2"):
        comm.reduce_add_coalesced(inputs, "cpu", out=[torch.zeros(3), extra])
    assert not extra.any()


def test_scatter_chunk_sizes_need_one_entry_per_device():
    x = torch.arange(4.0)
    with pytest.raises(ValueError, match=r"chunk_sizes must have one entry per device \(3\), got 2"):
        comm.scatter(x, ["cpu"] * 3, chunk_sizes=[2, 2])


@pytest.mark.parametrize("op", ["scatter", "gather"])
@pytest.mark.parametrize("dim", [2, -3, True, 1.0])
def test_scatter_gather_dim_out_of_range_or_not_an_int_is_refused(op, dim):
    x = torch.randn(4, 6)
    with pytest.raises(ValueError, match=r"dim must be an int in \[-2, 2\)"):
        if op == "scatter":
            comm.scatter(x, ["cpu", "cpu"], dim=dim)
        else:
            comm.gather([x, x], dim=dim, destination="cpu")


def test_gather_scalars_warning_points_at_the_caller():
    # As the -1 destination's FutureWarning: the line that called comm.gather, not
    # fastpar's own.
    with pytest.warns(UserWarning, match="all input tensors were scalars") as rec:
        g = comm.gather([torch.tensor(1.0), torch.tensor(2.0)], 0, "cpu")
    assert torch.equal(g, torch.tensor([1.0, 2.0]))
    [w] = [w for w in rec if "scalars" in str(w.message)]
    assert w.filename == __file__


@pytest.mark.parametrize("dim", [1, -2, 3])
def test_gather_scalars_along_another_dim_raise_without_the_dim0_warning(dim):
    # 0-dim tensors become a vector only along dim 0 (torch's Gather checks dim == 0);
    # along another dim there is nothing to gather along. The call warned that it "was
    # asked to gather along dimension 0", then raised "dim must be an int in [-1, 1)".
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "all input tensors were scalars" warning
        with pytest.raises(ValueError, match=rf"0-dim.*no dimension {dim}"):
            comm.gather([torch.tensor(1.0), torch.tensor(2.0)], dim, "cpu")


def test_gather_scalars_only_when_all_are_scalars():
    with pytest.raises(ValueError, match=r"tensors\[1\] .* incompatible"):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # and no "all input tensors were scalars" warning
            comm.gather([torch.tensor(1.0), torch.tensor([2.0])], 0, "cpu")


@pytest.mark.parametrize("shape", [(12,), (3, 4), (2, 6)])
def test_gather_out_must_have_the_gathered_shape(shape):
    parts = [torch.randn(2, 3), torch.randn(2, 3)]
    out = torch.zeros(shape)
    with pytest.raises(ValueError, match=r"out must have shape \(4, 3\)"):
        comm.gather(parts, 0, out=out)
    assert not out.any()


def test_gather_into_out_with_shared_elements_is_refused_before_writing():
    # Row 0 of out is writable on its own, rows 1-2 share memory: torch's copy_ refuses
    # only the second input's copy, after the first was written; gather must refuse first.
    base = torch.zeros(1, 3)
    out = base.expand(3, 3)
    parts = [torch.ones(1, 3), torch.full((2, 3), 2.0)]
    with pytest.raises(RuntimeError, match="share memory"):
        comm.gather(parts, 0, out=out)
    assert not base.any(), "gather wrote part of out before refusing it"


def test_gather_keeps_contiguous_layout_of_tensors_also_channels_last():
    # (2, 1, 3, 3) contiguous tensors are channels_last-contiguous as well; the result is
    # laid out as torch.cat lays it out (contiguous), not channels_last.
    parts = [torch.randn(2, 1, 3, 3) for _ in range(2)]
    got = comm.gather(parts, 1, "cpu")
    ref = torch.cat(parts, 1)
    assert got.is_contiguous() and got.stride() == ref.stride()
    assert torch.equal(got, ref)


def test_gather_refuses_destination_with_out():
    parts = [torch.ones(2, 3), torch.ones(2, 3)]
    out = torch.zeros(4, 3)
    with pytest.raises(RuntimeError, match="'destination' must not be specified when 'out' is specified"):
        comm.gather(parts, 0, "cpu", out=out)
    assert not out.any()


def test_gather_minus_one_warning_points_at_the_caller():
    parts = [torch.ones(2), torch.ones(2)]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        comm.gather(parts, 0, -1)
    [w] = [w for w in rec if issubclass(w.category, FutureWarning)]
    assert w.filename == __file__


# ----------------------------------------------------------- Properties (hypothesis)
# Random lists of tensors (dtypes, shapes with 0 sizes and one in 20 of 65,537
# elements, layouts, K replicas) against float64 sums and torch's own views, copies and
# concatenations, into poisoned outputs; and random refusals, which must name what is
# wrong and write nothing.

import functools  # noqa: E402

from conftest import (  # noqa: E402
    CPU_BACKENDS, LAYOUTS, assert_same_bits, backend_properties, build, seeded, storage_of, tensor_specs)
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fastpar._validate import CAST_DTYPES  # noqa: E402

#: What the copies (broadcast, scatter, gather) move: the reducible dtypes, bool, complex.
COPY_DTYPES = [*CAST_DTYPES, torch.bool, torch.complex64, torch.complex128]
#: Layouts of a tensor written in place (an expanded one has elements sharing memory).
WRITABLE = ["contiguous", "transposed", "stepped", "offset"]
#: Special values whose float64 sum is also the one float32 (or float64) accumulation
#: gives: signed zeros, infinities, NaN (no finite values near a 16-bit type's overflow).
REDUCE_SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan")]


def target(spec, gen, against=None):
    """A writable tensor laid out as ``spec`` says, inside a poisoned base: ``(view,
    base)``. For bool (no poison value), the view holds ``~against``."""
    t = build(spec, gen, specials=False)
    base = t if t._base is None else t._base
    poison_(base)
    if t.dtype == torch.bool and against is not None:
        t.copy_(~against)
    return t, base


def assert_written(base, t, expected, what, *, nan_payloads=False):
    """``base`` holds its poison except where its view ``t`` now holds ``expected``."""
    want = base.clone()
    torch.as_strided(want, t.shape, t.stride(), t.storage_offset()).copy_(expected)
    assert_same_bits(base, want, what, nan_payloads=nan_payloads)


def describe(specs):
    return [(tuple(s), str(d).replace("torch.", ""), lay) for s, d, lay in specs]


def expected_sum(col):
    """One position's sum as torch computes it: in float64 for floats (compared within
    :func:`reduce_tol`), in the dtype's own wrapping adds for integers."""
    if col[0].dtype.is_floating_point:
        return functools.reduce(torch.add, [t.resolve_neg().to(torch.float64) for t in col])
    return functools.reduce(torch.add, col)


def check_sum(actual, expected, k, what):
    if not actual.dtype.is_floating_point:
        assert_same_bits(actual, expected, what)
        return
    assert_close(actual, expected, dtype=actual.dtype, tol=reduce_tol(actual.dtype, k), what=what)
    zero = (expected == 0) & (actual == 0)
    assert torch.equal(actual.signbit()[zero], expected.signbit()[zero]), f"{what}: a zero sum has the wrong sign"


def check_reduce(data, backend):
    """K lists of 1-6 tensors of any reducible dtype, shape and layout (each replica its
    own layouts), with or without infinities, NaN and signed zeros: reduce_add_coalesced
    allocating and into poisoned ``out`` (nothing written beside it), and reduce_add of
    the first position, equal torch's sums; the inputs are left as they were."""
    k = data.draw(st.integers(1, 5), "K")
    specs = data.draw(st.lists(tensor_specs(CAST_DTYPES), min_size=1, max_size=6), "specs")
    others = data.draw(st.lists(st.lists(st.sampled_from(LAYOUTS), min_size=len(specs), max_size=len(specs)),
                                min_size=k - 1, max_size=k - 1), "other replicas' layouts")
    specials = REDUCE_SPECIALS if data.draw(st.booleans(), "specials") else False
    gen = seeded(data)
    rows = [[lay for _, _, lay in specs], *others]
    lists = [[build((s, d, lay), gen, specials=specials, flush_bf16=backend == "triton")
              for (s, d, _), lay in zip(specs, row)] for row in rows]
    inputs = [t for lst in lists for t in lst]
    before = snapshot(inputs)
    expected = [expected_sum([lst[i] for lst in lists]) for i in range(len(specs))]
    what = f"K={k}, {describe(specs)}, layouts {rows}"

    res = comm.reduce_add_coalesced(lists, "cpu")
    assert type(res) is tuple and len(res) == len(specs), what
    for i, (r, e) in enumerate(zip(res, expected)):
        assert r.dtype == specs[i][1] and r.device.type == "cpu", f"{what}: result[{i}] is {r.dtype} on {r.device}"
        check_sum(r, e, k, f"{what}: result[{i}]")

    backings = [poisoned(e.numel() + 2, dtype=d) for e, (_, d, _) in zip(expected, specs)]
    out = [b[1:-1].view(e.shape) for b, e in zip(backings, expected)]
    got = comm.reduce_add_coalesced(lists, "cpu", out=out)
    assert len(got) == len(out) and all(g is o for g, o in zip(got, out)), what
    for i, (o, e, b) in enumerate(zip(out, expected, backings)):
        check_sum(o, e, k, f"{what}: out[{i}]")
        assert_unchanged([b[:1], b[-1:]], [poisoned(1, dtype=b.dtype)] * 2, what=f"{what}: beside out[{i}]")

    col = [lst[0] for lst in lists]
    r = comm.reduce_add(col, "cpu")
    if k == 1:
        assert r is col[0], "one input: returned as is"
    else:
        check_sum(r, expected[0], k, f"{what}: reduce_add of position 0")
    assert_unchanged(inputs, before, what=f"{what}: inputs")


test_reduce_properties, test_reduce_properties_triton_interpreter = backend_properties(
    check_reduce, triton_examples=6)


@pytest.mark.parametrize("be", CPU_BACKENDS)
def test_reduce_of_packed_and_direct_lists(be):
    """One replica's list holds a non-contiguous tensor (so it is packed, read as 1-D
    pieces), the other's is read in place (N-D tensors): the sources of one position
    differ in shape (the torch backend once added them as they were: a RuntimeError)."""
    a, b = torch.randn(3, 2), torch.randn(2, 3).t()
    c, d = torch.randn(4, 1, 2), torch.randn(4, 1, 2)
    with fastpar.use_backend(be):
        r = comm.reduce_add_coalesced([[a, c], [b, d]], "cpu")
    assert_close(r[0], a.double() + b.double(), tol=reduce_tol(torch.float32, 2), what="position 0")
    assert_close(r[1], c.double() + d.double(), tol=reduce_tol(torch.float32, 2), what="position 1")


@pytest.mark.parametrize("be", CPU_BACKENDS)
def test_broadcast_coalesced_complex128(be):
    """16-byte elements (complex128, which no Triton type holds) are copied as pairs of
    8-byte words, conjugated and non-contiguous ones included (found by
    test_broadcast_coalesced_properties: the Triton launcher raised KeyError: 16)."""
    c = torch.randn(12, dtype=torch.complex128)
    ts = [torch.randn(5, dtype=torch.complex128), torch.randn(3, 4, dtype=torch.complex128).t(),
          torch.randn((), dtype=torch.complex128), torch.randn(2, dtype=torch.complex128).conj(), torch.randn(3),
          c[::2][:0], c.as_strided((1, 2), (5, 1), 3)]  # contiguous, with strides of any size 0 or 1 dim
    with fastpar.use_backend(be):
        copies = comm.broadcast_coalesced(ts, ["cpu", "cpu", "cpu"])
    for d in (1, 2):
        for i, (c, t) in enumerate(zip(copies[d], ts)):
            assert c.shape == t.shape and torch.equal(c.resolve_conj(), t.resolve_conj()), f"copies[{d}][{i}]"


def check_broadcast_coalesced(data, backend):
    """1-8 tensors of any dtype, shape and layout, with special values, to 1-4 CPU
    replicas: outputs[0] are the inputs themselves; every other device's outputs hold
    their bits exactly, in one storage of their own (not the inputs', not another
    device's), not requiring grad; the inputs are left as they were."""
    specs = data.draw(st.lists(tensor_specs(COPY_DTYPES), min_size=1, max_size=8), "specs")
    n = data.draw(st.integers(1, 4), "devices")
    gen = seeded(data)
    ts = [build(s, gen, specials=True, flush_bf16=backend == "triton") for s in specs]
    before = snapshot(ts)
    what = f"{n} devices, {describe(specs)}"
    copies = comm.broadcast_coalesced(ts, ["cpu"] * n)
    assert len(copies) == n and len(copies[0]) == len(ts) and all(c is t for c, t in zip(copies[0], ts)), what
    seen = {storage_of(t) for t in ts if t.numel()}
    for d in range(1, n):
        assert len(copies[d]) == len(ts), what
        for i, (c, t) in enumerate(zip(copies[d], ts)):
            assert c.dtype == t.dtype and not c.requires_grad and not c.is_neg(), f"{what}: copies[{d}][{i}]"
            assert_same_bits(c, t.resolve_neg(), f"{what}: copies[{d}][{i}]")
        mine = {storage_of(c) for c in copies[d] if c.numel()}
        assert len(mine) <= 1 and not mine & seen, f"{what}: copies[{d}] are not in one storage of their own"
        seen |= mine
    assert_unchanged(ts, before, what=f"{what}: inputs")


test_broadcast_coalesced_properties, test_broadcast_coalesced_properties_triton_interpreter = backend_properties(
    check_broadcast_coalesced, triton_examples=6)


@given(data=st.data())
def test_broadcast_properties(data):
    """A tensor of any dtype, shape and layout to 1-4 CPU replicas: the first is the
    tensor, the others exact copies with storages of their own; into 1-4 poisoned ``out``
    of any writable layout: each holds the tensor's bits, nothing beside them written."""
    spec = data.draw(tensor_specs(COPY_DTYPES), "spec")
    n = data.draw(st.integers(1, 4), "devices")
    gen = seeded(data)
    t = build(spec, gen, specials=True)
    want = t.resolve_neg()
    before = snapshot([t])
    what = f"{n} devices, {describe([spec])}"
    res = comm.broadcast(t, ["cpu"] * n)
    assert type(res) is tuple and len(res) == n and res[0] is t, what
    storages = [storage_of(r) for r in res[1:]]
    for i, r in enumerate(res[1:], 1):
        assert_same_bits(r, want, f"{what}: result[{i}]")
    if t.numel():
        assert len(set(storages)) == n - 1 and storage_of(t) not in storages, f"{what}: copies share memory"
    targets = [target((spec[0], spec[1], lay), gen, want)
               for lay in data.draw(st.lists(st.sampled_from(WRITABLE), min_size=1, max_size=4), "out layouts")]
    out = [o for o, _ in targets]
    res = comm.broadcast(t, out=out)
    assert type(res) is tuple and all(r is o for r, o in zip(res, out, strict=True)), what
    for i, (o, base) in enumerate(targets):
        assert_written(base, o, want, f"{what}: out[{i}] {o.stride()}")
    assert_unchanged([t], before, what=f"{what}: tensor")


def compositions(data, total, parts, label):
    """``parts`` sizes >= 0 summing to ``total``."""
    cuts = sorted(data.draw(st.lists(st.integers(0, total), min_size=parts - 1, max_size=parts - 1), label))
    return [b - a for a, b in zip([0, *cuts], [*cuts, total])]


@given(data=st.data())
def test_scatter_properties(data):
    """A tensor of any dtype, shape (at least 1-D) and layout, along any dim, to 1-4 CPU
    replicas: by default torch's ``chunk`` and with ``chunk_sizes`` torch's ``split``, as
    the very same views; into poisoned ``out`` of any writable layout (sizes along dim
    0 among them): each holds its split's bits, nothing beside them written."""
    shape, dtype, layout = data.draw(tensor_specs(COPY_DTYPES), "spec")
    shape = shape or (data.draw(st.integers(0, 9), "size"),)
    gen = seeded(data)
    t = build((shape, dtype, layout), gen, specials=True)
    before = snapshot([t])
    dim = data.draw(st.integers(-len(shape), len(shape) - 1), "dim")
    k = data.draw(st.integers(1, 4), "devices")
    mode = data.draw(st.sampled_from(["chunk", "chunk_sizes", "out"]), "mode")
    what = f"{mode}, {k} devices, dim {dim}, {describe([(shape, dtype, layout)])}"
    if mode == "out":
        sizes = compositions(data, shape[dim], k, "sizes")
        want = t.split(sizes, dim)
        targets = []
        for s, w in zip(sizes, want):
            oshape = list(shape)
            oshape[dim] = s
            targets.append(target((tuple(oshape), dtype, data.draw(st.sampled_from(WRITABLE), "out layout")), gen,
                                  w.resolve_neg()))
        out = [o for o, _ in targets]
        res = comm.scatter(t, dim=dim, out=out)
        assert type(res) is tuple and all(r is o for r, o in zip(res, out, strict=True)), what
        for i, ((o, base), w) in enumerate(zip(targets, want)):
            assert_written(base, o, w.resolve_neg(), f"{what}: out[{i}] of {sizes}")
    else:
        sizes = compositions(data, shape[dim], k, "chunk_sizes") if mode == "chunk_sizes" else None
        want = t.chunk(k, dim) if sizes is None else t.split(sizes, dim)
        res = comm.scatter(t, ["cpu"] * k, chunk_sizes=sizes, dim=dim)
        assert type(res) is tuple and len(res) == len(want), f"{what}: {len(res)} chunks, torch gives {len(want)}"
        for i, (r, w) in enumerate(zip(res, want)):
            assert_same_bits(r.resolve_neg(), w.resolve_neg(), f"{what}: chunk {i} of {sizes}")
            assert (r.data_ptr(), r.stride(), r.is_neg()) == (w.data_ptr(), w.stride(), w.is_neg()), \
                f"{what}: chunk {i} is not the view torch's split gives"
    assert_unchanged([t], before, what=f"{what}: tensor")


def check_gather(data, backend):
    """1-4 tensors of one dtype (any) or of several (converted to the first's, or out's,
    as Tensor.copy_ converts), of any layout and any sizes along any dim: gathered onto
    the CPU or into a poisoned ``out`` of any writable layout, torch.cat's bits (nothing
    beside out written); the inputs are left as they were."""
    n = data.draw(st.integers(1, 4), "tensors")
    ndim = data.draw(st.integers(1, 3), "ndim")
    rest = data.draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim), "shape")
    dim = data.draw(st.integers(-ndim, ndim - 1), "dim")
    sizes = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n), "sizes along dim")
    if ndim == 1 and data.draw(st.integers(0, 19), "large") == 0:
        sizes[0] = 65_537
    mixed = data.draw(st.booleans(), "mixed dtypes")
    pick = st.sampled_from(ALL_DTYPES if mixed else COPY_DTYPES)
    dtypes = data.draw(st.lists(pick, min_size=n, max_size=n), "dtypes") if mixed else [data.draw(pick, "dtype")] * n
    layouts = data.draw(st.lists(st.sampled_from(LAYOUTS),
                                 min_size=n, max_size=n), "layouts")
    into = data.draw(st.sampled_from(["cpu", *WRITABLE]), "destination or out layout")
    dst = data.draw(pick, "out dtype") if mixed and into != "cpu" else dtypes[0]
    floats = all(d.is_floating_point for d in [*dtypes, dst])
    gen = seeded(data)
    shapes = []
    for s in sizes:
        shape = list(rest)
        shape[dim] = s
        shapes.append(tuple(shape))
    ts = [build(spec, gen, specials=floats or not mixed, flush_bf16=backend == "triton")
          for spec in zip(shapes, dtypes, layouts)]
    before = snapshot(ts)
    exp = torch.cat([t.resolve_neg().to(dst) for t in ts], dim)
    what = f"dim {dim}, into {into} ({dst}), {describe(list(zip(shapes, dtypes, layouts)))}"
    if into == "cpu":
        got = comm.gather(ts, dim, "cpu")
        assert got.dtype == dst, what
        assert_same_bits(got, exp, what, nan_payloads=mixed)
    else:
        o, base = target((exp.shape, dst, into), gen, exp)
        assert comm.gather(ts, dim, out=o) is o, what
        assert_written(base, o, exp, f"{what}: out {o.stride()}", nan_payloads=mixed)
    assert_unchanged(ts, before, what=f"{what}: inputs")


test_gather_properties, test_gather_properties_triton_interpreter = backend_properties(
    check_gather, triton_examples=6)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float16), (torch.float16, torch.float32)], ids=str)
def test_gather_converts_negated_views(dtypes):
    """torch 2.13's ``copy_`` from a lazily negated float16 tensor into float32 (and back)
    drops the negation (found by test_gather_properties); gather resolves it first."""
    first, second = dtypes
    t = torch._neg_view(torch.tensor([1.0, -2.0, 3.0], dtype=second).neg())  # logically [1, -2, 3]
    ones = torch.ones(2, dtype=first)
    want = torch.tensor([1.0, 1.0, 1.0, -2.0, 3.0], dtype=first)
    assert torch.equal(comm.gather([ones, t], 0, "cpu"), want)
    out = poisoned(5, dtype=first)
    comm.gather([ones, t], 0, out=out)
    assert torch.equal(out, want)


def other_dtype(data, dtype, dtypes, label):
    return data.draw(st.sampled_from([d for d in dtypes if d != dtype]), label)


def strided_like(shape, dtype):
    """A poisoned tensor of ``shape`` whose elements are every other one of a buffer:
    not contiguous (for 2+ elements)."""
    contiguous = torch.empty(shape).stride()
    return torch.as_strided(poisoned(2 * math.prod(shape), dtype=dtype), shape, [2 * s for s in contiguous])


def overlapping(shape, dtype):
    """A poisoned tensor of ``shape`` (2+ elements) whose first dim of size > 1 repeats
    one element: its elements share memory."""
    a = next(a for a, n in enumerate(shape) if n > 1)
    return poisoned(tuple(1 if b == a else n for b, n in enumerate(shape)), dtype=dtype).expand(shape)


def reduce_refusal(data, gen):
    """A valid reduce_add_coalesced call (made once first, or not, to warm the plan
    caches), then one thing made wrong in place: a replica's list, a tensor's shape or
    dtype, out's length, a tensor of out (shape, dtype, not contiguous, an input itself),
    the destination, buffer_size."""
    k = data.draw(st.integers(2, 4), "K")
    specs = data.draw(st.lists(st.tuples(st.lists(st.integers(0, 4), max_size=3).map(tuple), st.sampled_from(CAST_DTYPES),
                                         st.sampled_from(LAYOUTS)), min_size=1, max_size=4), "specs")
    lists = [[build((s, d, lay), gen, specials=False) for s, d, lay in specs] for _ in range(k)]
    out = [poisoned(s, dtype=d) for s, d, _ in specs]
    kwargs = {"out": out}
    if data.draw(st.booleans(), "warm"):
        comm.reduce_add_coalesced(lists, "cpu", out=out)
        for o in out:
            poison_(o)
    n = len(specs)
    big = [i for i, (s, _, _) in enumerate(specs) if math.prod(s) >= 2]
    direct = [(j, i) for j in range(k) for i in range(n)
              if lists[j][i].is_contiguous() and not lists[j][i].is_neg() and lists[j][i].numel()]
    kinds = ["drop", "shape", "dtype", "out length", "out shape", "out dtype", "destination", "buffer_size"]
    kinds += ["out strided"] * bool(big) + ["out is an input"] * bool(direct)
    kind = data.draw(st.sampled_from(kinds), "wrong")
    j = data.draw(st.integers(1, k - 1), "replica")
    i = data.draw(st.integers(0, n - 1), "position")
    shape, dtype, _ = specs[i]
    destination = "cpu"
    if kind == "drop":
        lists[j].pop()
        match = (rf"inputs\[{j}\] \(on cpu\) has {n - 1} tensors but inputs\[0\] \(on cpu\) has {n}" if n > 1
                 else rf"inputs\[{j}\] must contain at least one tensor, got an empty list")
    elif kind in ("shape", "dtype"):
        if kind == "shape":
            lists[j][i] = rand((*shape, 2), dtype, gen=gen)
        else:
            lists[j][i] = rand(shape, other_dtype(data, dtype, CAST_DTYPES, "other dtype"), gen=gen)
        match = rf"position {i}: inputs\[{j}\]\[{i}\] on cpu has shape"
    elif kind == "out length":
        if data.draw(st.booleans(), "longer"):
            out.append(poisoned(3))
        else:
            out.pop()
        match = (rf"out must hold {n} tensors \(one per input position\), got {len(out)}" if out
                 else r"out must contain at least one tensor, got an empty list")
    elif kind == "out shape":
        out[i] = poisoned((*shape, 2), dtype=dtype)
        match = rf"out\[{i}\] has shape \({', '.join(map(str, (*shape, 2)))},?\) and dtype"
    elif kind == "out dtype":
        out[i] = poisoned(shape, dtype=other_dtype(data, dtype, CAST_DTYPES, "other dtype"))
        match = rf"out\[{i}\] has shape .* but the inputs at position {i} have"
    elif kind == "out strided":
        i = data.draw(st.sampled_from(big), "strided position")
        out[i] = strided_like(specs[i][0], specs[i][1])
        match = rf"out\[{i}\] must be contiguous"
    elif kind == "out is an input":
        jj, i = data.draw(st.sampled_from(direct), "input")
        out[i] = lists[jj][i]
        match = rf"out\[{i}\] overlaps the memory of inputs\[\d\]\[{i}\]"
    elif kind == "destination":
        destination = data.draw(st.sampled_from([1, "cuda:0", torch.device("cuda", 2)]), "destination")
        match = r"destination must be one of the inputs' devices \['cpu'\], got cuda:\d"
    else:
        kwargs["buffer_size"] = data.draw(st.sampled_from([0, -1, 1.5, True]), "buffer_size")
        match = r"buffer_size must be a positive int, got"
    watched = [*out, *(t for lst in lists for t in lst)]
    return lambda: comm.reduce_add_coalesced(lists, destination, **kwargs), ValueError, match, watched


def broadcast_refusal(data, gen):
    """broadcast into 1-4 ``out``, one of them wrong: its shape, its dtype, expanded, an
    inference tensor, not a tensor; or no ``out`` at all, or ``devices`` as well."""
    shape, dtype, layout = data.draw(tensor_specs(COPY_DTYPES), "spec")
    t = build((shape, dtype, layout), gen, specials=False)
    out = [target((shape, dtype, lay), gen)[0]
           for lay in data.draw(st.lists(st.sampled_from(WRITABLE), min_size=1, max_size=4), "out layouts")]
    i = data.draw(st.integers(0, len(out) - 1), "which")
    kinds = ["shape", "dtype", "inference", "not a tensor", "empty", "devices too"]
    kinds += ["expanded"] * (math.prod(shape) > 1)
    kind = data.draw(st.sampled_from(kinds), "wrong")
    exc, kwargs = ValueError, {}
    if kind == "shape":
        out[i] = poisoned((*shape, 1), dtype=dtype)
        match = rf"out\[{i}\] must match tensor \(shape"
    elif kind == "dtype":
        out[i] = poisoned(shape, dtype=other_dtype(data, dtype, COPY_DTYPES, "other dtype"))
        match = rf"out\[{i}\] must match tensor \(shape"
    elif kind == "expanded":
        out[i] = overlapping(shape, dtype)
        exc, match = RuntimeError, rf"out\[{i}\] has elements that share memory"
    elif kind == "inference":
        with torch.inference_mode():
            out[i] = poisoned(shape, dtype=dtype)
        exc, match = RuntimeError, rf"out\[{i}\] is an inference tensor"
    elif kind == "not a tensor":
        out[i] = [0.0]
        exc, match = TypeError, rf"out\[{i}\] must be a torch.Tensor, got list"
    elif kind == "empty":
        out = []
        exc, match = TypeError, r"out must be a non-empty list or tuple of tensors"
    else:
        kwargs["devices"] = ["cpu"] * len(out)
        exc, match = RuntimeError, r"Exactly one of 'devices' and 'out' must be specified"
    watched = [t, *(o for o in out if isinstance(o, torch.Tensor))]
    return lambda: comm.broadcast(t, out=out, **kwargs), exc, match, watched


def scatter_refusal(data, gen):
    """scatter into ``out`` (sizes along dim that do not add up, another shape outside
    dim, another dtype, an expanded out, chunk_sizes as well), or to devices with bad
    ``chunk_sizes`` (sum, count, a negative or non-int size) or a bad ``dim``."""
    shape = tuple(data.draw(st.lists(st.integers(0, 4), min_size=1, max_size=3), "shape"))
    dtype = data.draw(st.sampled_from(COPY_DTYPES), "dtype")
    t = build((shape, dtype, data.draw(st.sampled_from(LAYOUTS), "layout")), gen, specials=False)
    ndim = len(shape)
    dim = data.draw(st.integers(-ndim, ndim - 1), "dim")
    d = dim % ndim
    k = data.draw(st.integers(1, 4), "parts")
    sizes = compositions(data, shape[d], k, "sizes")
    i = data.draw(st.integers(0, k - 1), "which")

    def out_shape(s):
        return tuple(s if a == d else n for a, n in enumerate(shape))

    out = [poisoned(out_shape(s), dtype=dtype) for s in sizes]
    kinds = ["sum", "dtype", "chunk_sizes too", "chunk_sizes sum", "chunk_sizes count", "chunk_sizes value", "dim"]
    kinds += ["shape"] * (ndim >= 2) + ["expanded"] * (math.prod(out_shape(sizes[i])) > 1)
    kind = data.draw(st.sampled_from(kinds), "wrong")
    exc, kwargs = ValueError, {"dim": dim, "out": out}
    if kind == "sum":
        out[i] = poisoned(out_shape(sizes[i] + 1), dtype=dtype)
        sizes[i] += 1
        match = rf"the sizes of out along dim {d} must sum to {shape[d]}, got \[{', '.join(map(str, sizes))}\]"
    elif kind == "shape":
        other = (d + 1) % ndim
        bad = list(out_shape(sizes[i]))
        bad[other] += 1
        out[i] = poisoned(bad, dtype=dtype)
        match = rf"out\[{i}\] must have tensor's shape .* except along dim {d} and dtype"
    elif kind == "dtype":
        out[i] = poisoned(out_shape(sizes[i]), dtype=other_dtype(data, dtype, COPY_DTYPES, "other dtype"))
        match = rf"out\[{i}\] must have tensor's shape .* except along dim {d} and dtype"
    elif kind == "expanded":
        out[i] = overlapping(out_shape(sizes[i]), dtype)
        exc, match = RuntimeError, rf"out\[{i}\] has elements that share memory"
    elif kind == "chunk_sizes too":
        kwargs["chunk_sizes"] = sizes
        exc, match = RuntimeError, r"'chunk_sizes' must not be specified when 'out' is specified"
    else:
        del kwargs["out"]
        kwargs["devices"] = ["cpu"] * k
        chunk_sizes = list(sizes)
        if kind == "chunk_sizes sum":
            chunk_sizes[i] += 1
            match = rf"chunk_sizes must sum to tensor.size\({d}\) = {shape[d]}"
        elif kind == "chunk_sizes count":
            chunk_sizes.append(0)
            match = rf"chunk_sizes must have one entry per device \({k}\), got {k + 1}"
        elif kind == "chunk_sizes value":
            chunk_sizes[i] = data.draw(st.sampled_from([-1, 1.0, True]), "bad size")
            match = r"chunk_sizes must be non-negative ints"
        else:
            kwargs["chunk_sizes"] = None
            kwargs["dim"] = data.draw(st.sampled_from([ndim, -ndim - 1, 0.0, True]), "bad dim")
            match = rf"dim must be an int in \[{-ndim}, {ndim}\)"
        kwargs.setdefault("chunk_sizes", chunk_sizes)
    watched = [t, *kwargs.get("out", ())]
    return lambda: comm.scatter(t, **kwargs), exc, match, watched


def gather_refusal(data, gen):
    """gather of tensors of which one differs outside dim, or not a tensor, or an empty
    list; into an ``out`` of the wrong shape, an expanded one, or with a destination as
    well; along a bad ``dim``."""
    n = data.draw(st.integers(1, 4), "tensors")
    shape = tuple(data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=3), "shape"))
    ndim = len(shape)
    dim = data.draw(st.integers(-ndim, ndim - 1), "dim")
    d = dim % ndim
    dtype = data.draw(st.sampled_from(COPY_DTYPES), "dtype")
    layouts = data.draw(st.lists(st.sampled_from(LAYOUTS), min_size=n, max_size=n), "layouts")
    ts = [build((shape, dtype, lay), gen, specials=False) for lay in layouts]
    full = tuple(n * s if a == d else s for a, s in enumerate(shape))
    out = poisoned(full, dtype=dtype)
    i = data.draw(st.integers(0, n - 1), "which")
    kinds = ["out shape", "destination too", "not a tensor", "empty", "dim"]
    kinds += ["shape"] * (ndim >= 2 and n >= 2) + ["expanded"] * (math.prod(full) > 1)
    kind = data.draw(st.sampled_from(kinds), "wrong")
    exc, kwargs = ValueError, {"dim": dim, "out": out}
    if kind == "shape":
        i = data.draw(st.integers(1, n - 1), "which")
        bad = list(shape)
        bad[(d + 1) % ndim] += 1
        ts[i] = rand(tuple(bad), dtype, gen=gen)
        match = rf"tensors\[{i}\] \(on cpu\) has shape .* incompatible with tensors\[0\]"
    elif kind == "out shape":
        bad = list(full)
        bad[data.draw(st.integers(0, ndim - 1), "bad dim")] += 1
        kwargs["out"] = out = poisoned(tuple(bad), dtype=dtype)
        match = r"out must have shape"
    elif kind == "expanded":
        kwargs["out"] = out = overlapping(full, dtype)
        exc, match = RuntimeError, r"out has elements that share memory"
    elif kind == "destination too":
        kwargs["destination"] = "cpu"
        exc, match = RuntimeError, r"'destination' must not be specified when 'out' is specified"
    elif kind == "not a tensor":
        ts[i] = ts[i].tolist()
        exc, match = TypeError, rf"tensors\[{i}\] must be a torch.Tensor, got list"
    elif kind == "empty":
        ts = []
        match = r"tensors must contain at least one tensor, got an empty list"
    else:
        kwargs["dim"] = data.draw(st.sampled_from([ndim, -ndim - 1, 0.5, False]), "bad dim")
        match = rf"dim must be an int in \[{-ndim}, {ndim}\)"
    watched = [out, *(t for t in ts if isinstance(t, torch.Tensor))]
    return lambda: comm.gather(ts, **kwargs), exc, match, watched


@pytest.mark.parametrize("op", [reduce_refusal, broadcast_refusal, scatter_refusal, gather_refusal],
                         ids=["reduce_add_coalesced", "broadcast", "scatter", "gather"])
@given(data=st.data())
def test_refusals_name_the_argument_and_write_nothing(op, data):
    """A random valid call of reduce_add_coalesced, broadcast, scatter or gather with one
    thing made wrong: the call raises, naming it, launches nothing and changes none of
    its tensors (out, the inputs)."""
    call, exc, match, watched = op(data, seeded(data))
    before = snapshot(watched)
    with fastpar.count_launches() as launches, pytest.raises(exc, match=match):
        call()
    assert launches.total == 0, f"a refused call launched {launches.by_op}"
    assert_unchanged(watched, before, what=f"{op.__name__}: {match}")


def test_iterables_are_taken_where_torch_iterates_them():
    """torch's ``gather`` and ``reduce_add_coalesced`` iterate what they are given, so a
    generator works there (of the tensors; of the per-device lists; of the lists'
    items). fastpar took only lists and tuples and raised TypeError. ``reduce_add``
    indexes its inputs in torch too, and a tensor, string or dict stays an error."""
    torch.manual_seed(0)
    xs = [torch.randn(3, 2) for _ in range(3)]
    assert torch.equal(comm.gather((x for x in xs), dim=1, destination="cpu"), torch.cat(xs, 1))
    lists = [[torch.randn(4), torch.randn(2, 3)] for _ in range(3)]
    want = comm.reduce_add_coalesced(lists, "cpu")
    for given in ((iter(lst) for lst in lists), [iter(lst) for lst in lists], [lists[0], iter(lists[1]), lists[2]]):
        got = comm.reduce_add_coalesced(given, "cpu")
        assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
    for bad in (torch.randn(3, 2), "ab", {"a": xs[0]}):
        with pytest.raises(TypeError, match="tensors must be a list or tuple of tensors"):
            comm.gather(bad, destination="cpu")
    with pytest.raises(TypeError, match="inputs must be a list or tuple of tensors, got generator"):
        comm.reduce_add((x for x in xs), "cpu")


@pytest.mark.parametrize("kind", ["neg", "conj"])
def test_gather_into_lazily_negated_or_conjugated_out(kind):
    """An ``out`` that is a negated or conjugated view (``z.conj().imag`` is a negated
    one) is written through its view, as torch's copies write it: the one-launch path
    raised flatten's "lazily negated view" ValueError, whose advice (resolve it) would
    write a temporary instead of ``out``."""
    dtype = torch.float32 if kind == "neg" else torch.complex64
    ts = [torch.randn(2, 3, dtype=dtype), torch.randn(1, 3, dtype=dtype)]
    base = poisoned(3, 3, dtype=dtype)
    out = torch._neg_view(base) if kind == "neg" else base.conj()
    assert comm.gather(ts, 0, out=out) is out
    assert torch.equal(out, torch.cat(ts))


def test_scatter_and_gather_take_numpy_and_tensor_ints():
    """torch's scatter and gather pass ``chunk_sizes`` and ``dim`` to C++ int64
    arguments, which take anything with ``__index__`` (numpy integers, as
    ``np.array_split`` sizes come, and integer tensors): they were refused as not ints."""
    import numpy as np

    x = torch.randn(7, 5)
    for sizes in (np.array([3, 4]), torch.tensor([3, 4]), [np.int64(3), torch.tensor(4)]):
        chunks = comm.scatter(x, ["cpu", "cpu"], sizes, dim=np.int64(0))
        assert [c.shape[0] for c in chunks] == [3, 4] and torch.equal(torch.cat(chunks), x)
    assert torch.equal(comm.gather([x, x], dim=np.int32(-1), destination="cpu"), torch.cat([x, x], -1))
    with pytest.raises(ValueError, match=r"chunk_sizes must be non-negative ints"):
        comm.scatter(x, ["cpu", "cpu"], [np.float64(3), 4])
    with pytest.raises(ValueError, match=r"chunk_sizes must be non-negative ints"):
        comm.scatter(x, ["cpu", "cpu"], [torch.tensor(True), 6])


def test_broadcast_coalesced_takes_any_iterable_of_tensors():
    """torch's broadcast_coalesced builds a list from any iterable (``[... for t in
    tensors]``); a generator was refused as not a list or tuple."""
    ts = [torch.randn(3), torch.randn(2, 2)]
    result = comm.broadcast_coalesced((t for t in ts), ["cpu", "cpu"])
    assert all(a is b for a, b in zip(result[0], ts))
    assert all(torch.equal(a, b) for a, b in zip(result[1], ts))


def test_quantized_tensors_keep_their_quantizer_or_are_refused():
    """broadcast_coalesced and gather (out=None) made tensors of a quantized dtype from
    copied bytes, with no quantizer (so no values: dequantize() failed an internal
    assert); they now raise a TypeError. gather into a quantized out takes copy_, as
    torch's, and keeps out's quantizer."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch 2.13 deprecates quantized tensors)
        q = torch.quantize_per_tensor(torch.tensor([1.0, -0.5, 0.3]), 0.1, 0, torch.qint8)
        out = torch.quantize_per_tensor(torch.zeros(6), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match=r"broadcast_coalesced: tensors\[0\]: quantized tensors"):
        comm.broadcast_coalesced([q], ["cpu", "cpu"])
    with pytest.raises(TypeError, match=r"gather: tensors\[0\]: quantized tensors"):
        comm.gather([q, q], 0, "cpu")
    assert comm.gather([q, q], 0, out=out) is out
    assert torch.equal(out.dequantize(), torch.cat([q, q]).dequantize())


def test_copy_refusals_for_quantized_tensors_write_nothing():
    """copy_ refuses a quantized source into a tensor that is not, quantized into
    quantized of another qscheme, and into a quantized tensor a source that is not
    float32 or not laid out as it is. gather copies slice by slice and broadcast output
    by output, so these refusals came after the earlier slices or outputs were written."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch 2.13 deprecates quantized tensors)
        q = torch.quantize_per_tensor(torch.tensor([1.0, -0.5, 0.3]), 0.1, 0, torch.qint8)
        qout = lambda *shape: torch.quantize_per_tensor(torch.zeros(shape), 0.1, 0, torch.qint8)
        per_channel = torch.quantize_per_channel(torch.zeros(3), torch.full((3,), 0.1), torch.zeros(3, dtype=torch.long),
                                                 0, torch.qint8)
    cases = [
        (lambda out: comm.gather([torch.ones(3), q], 0, out=out), torch.zeros(6),
         r"tensors\[1\] is quantized \(torch.qint8\) but out's slice 1 is not"),
        (lambda out: comm.gather([torch.ones(3), torch.ones(3, dtype=torch.float64)], 0, out=out), qout(6),
         r"out's slice 1 is quantized \(torch.qint8\); copy_ quantizes only float32 sources, got tensors\[1\]"),
        (lambda out: comm.gather([torch.ones(3), torch.ones(6)[::2]], 0, out=out), qout(6),
         r"copy_ quantizes tensors\[1\] only where both are contiguous"),
        (lambda out: comm.broadcast(q, out=[out, per_channel]), qout(3),
         r"out\[1\] \(torch.qint8, torch.per_channel_affine\) cannot take the quantized tensor"),
    ]
    for call, out, match in cases:
        before = out.int_repr().clone() if out.is_quantized else out.clone()
        with pytest.raises(RuntimeError, match=match):
            call(out)
        after = out.int_repr() if out.is_quantized else out
        assert torch.equal(after, before), f"{match}: out written before the refusal"
    with pytest.raises(RuntimeError, match=r"tensors\[1\] is quantized \(torch.qint8\) but the result's slice 1"):
        comm.gather([torch.ones(3), q], 0, "cpu")


def test_reduce_add_coalesced_of_empty_lists_into_an_empty_out():
    """Empty per-device lists have nothing to sum with out=None (``()``, as torch's);
    with out=[] (one tensor per position: none) they were refused as 'inputs[0] must
    contain at least one tensor'."""
    assert comm.reduce_add_coalesced([[], []], "cpu", out=[]) == ()
    with pytest.raises(ValueError, match=r"inputs\[0\] must contain at least one tensor"):
        comm.reduce_add_coalesced([[], []], "cpu", out=[torch.zeros(1)])


@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float32), (torch.float32, torch.float16)], ids=str)
def test_gather_converts_into_a_negated_out(dtypes):
    """torch 2.13's ``copy_`` of float16 into a lazily negated float32 tensor (and back)
    drops the negation, as it does from a negated source
    (test_gather_converts_negated_views): gather converts the source first."""
    src, dst = dtypes
    ts = [torch.tensor([1.0, -2.0], dtype=src), torch.tensor([3.0], dtype=src)]
    out = torch._neg_view(poisoned(3, dtype=dst))
    comm.gather(ts, 0, out=out)
    assert torch.equal(out, torch.tensor([1.0, -2.0, 3.0], dtype=dst))


def test_buffer_size_may_be_a_numpy_integer():
    """torch's broadcast_coalesced passes buffer_size to a C++ int64 argument and its
    reduce_add_coalesced compares it with byte counts: a numpy integer works in both;
    fastpar refused it as not a positive int. Bools and non-positive values still are."""
    import numpy as np

    ts = [torch.randn(3)]
    assert torch.equal(comm.broadcast_coalesced(ts, ["cpu", "cpu"], np.int64(1024))[1][0], ts[0])
    assert torch.equal(comm.reduce_add_coalesced([ts, ts], "cpu", np.int32(1024))[0], 2 * ts[0])
    for bad in (True, np.int64(0), 1.5):
        with pytest.raises(ValueError, match=r"buffer_size must be a positive int"):
            comm.reduce_add_coalesced([ts, ts], "cpu", bad)


class _TorchOnly(torch.Tensor):
    """A subclass whose ``__torch_function__`` implements torch's functions only (as a
    subclass written before fastpar existed does): fastpar's own functions are not its."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if str(getattr(func, "__module__", "")).startswith("fastpar"):
            return NotImplemented
        return super().__torch_function__(func, types, args, kwargs or {})


def test_gather_does_not_hand_its_inner_flatten_to_a_subclass():
    # comm.gather packs dim-0 inputs with fastpar's flatten; since flatten hands a
    # __torch_function__ subclass the call, gather handed it too, and a subclass that
    # knows only torch's functions failed with "no implementation found for
    # 'fastpar._flatten.flatten'" (torch's gather is not overridable: plain result).
    ts = [torch.randn(2, 3).as_subclass(_TorchOnly), torch.randn(3, 3).as_subclass(_TorchOnly)]
    out = fastpar.comm.gather(ts, 0, "cpu")
    expected = torch.cat([t.as_subclass(torch.Tensor) for t in ts])
    assert torch.equal(out.as_subclass(torch.Tensor), expected)


def test_ops_inside_torch_compile_cost_one_graph_break_each():
    # As in test_flatten: dynamo traced on into the ops' validation, plans and result
    # caches (graph breaks at every lock, numpy call and ctypes read, and warnings).
    # Each runs eagerly whole now, one graph break at its call, results as eager.
    x = rand((6, 5), torch.float32)
    ys = [rand((4, 3), torch.float32) for _ in range(3)]

    def step(x, ys):
        b = comm.broadcast(x, ["cpu", "cpu"])
        (bc0, bc1) = comm.broadcast_coalesced([x, ys[0]], ["cpu", "cpu"])
        r = comm.reduce_add([y * 2 for y in ys], "cpu")
        (rc,) = comm.reduce_add_coalesced([[y] for y in ys], "cpu")
        s = comm.scatter(x, ["cpu", "cpu"], chunk_sizes=[2, 3], dim=1)  # (every argument reaches it)
        g = comm.gather([c * 1 for c in s], 1, "cpu")
        return b[1] + bc1[0] + g, r + rc

    (xs, rs), breaks, graphs, warned = compiled_run(step, x, ys)
    assert_close(xs, 3 * x.double(), what="broadcast + broadcast_coalesced + scatter/gather")
    assert_close(rs, 3 * sum(y.double() for y in ys), what="reduce_add + reduce_add_coalesced")
    assert_one_break_per_op(breaks, graphs, warned,
                            ["broadcast", "broadcast_coalesced", "reduce_add", "reduce_add_coalesced", "scatter", "gather"])



def test_ops_run_eagerly_while_a_torch_tracer_sets_is_compiling(monkeypatch):
    # As in test_flatten: with torch.compiler.is_compiling() true and dynamo not
    # tracing (torch.export(strict=False)), each op called its eager entry, which called
    # the op again, until a RecursionError. They run as eager now.
    x = rand((6, 5), torch.float32)
    ys = [rand((4, 3), torch.float32) for _ in range(3)]
    compiling_flag_on(monkeypatch)
    b = comm.broadcast(x, ["cpu", "cpu"])
    (_, bc1) = comm.broadcast_coalesced([x, ys[0]], ["cpu", "cpu"])
    r = comm.reduce_add(ys, "cpu")
    (rc,) = comm.reduce_add_coalesced([[y] for y in ys], "cpu")
    s = comm.scatter(x, ["cpu", "cpu"], chunk_sizes=[2, 3], dim=1)
    g = comm.gather(list(s), 1, "cpu")
    assert_close(b[1], x.double(), what="broadcast")
    assert_close(bc1[0], x.double(), what="broadcast_coalesced")
    assert_close(r, sum(y.double() for y in ys), what="reduce_add")
    assert_close(rc, sum(y.double() for y in ys), what="reduce_add_coalesced")
    assert [c.shape for c in s] == [(6, 2), (6, 3)], "scatter's chunks"
    assert_close(g, x.double(), what="scatter then gather")


def test_gather_minus_one_warning_names_the_callers_line_inside_torch_compile():
    # Under torch.compile, gather runs through its eager entry, whose torch frames sat
    # between the warning's stacklevel and the user's code: the FutureWarning named
    # torch/_dynamo/eval_frame.py (so a filter by module missed it, and "default" showed
    # it once for all call sites). It names the calling line, as in eager mode.
    x = rand((4,), torch.float32)

    def step(x):
        return comm.gather([x * 1, x * 2], 0, -1)

    with pytest.warns(FutureWarning, match="Using -1") as eager:
        step(x)
    out, _, _, _ = compiled_run(step, x)
    assert_close(out, torch.cat([x, 2 * x]).double(), what="gather")
    import torch._dynamo as dynamo

    dynamo.reset()
    with pytest.warns(FutureWarning, match="Using -1") as compiled:
        torch.compile(step, backend="eager")(x)
    dynamo.reset()
    for seen in (eager, compiled):
        w = next(w for w in seen if issubclass(w.category, FutureWarning))
        assert (w.filename, w.lineno) == (__file__, step.__code__.co_firstlineno + 1), (
            f"the warning names {w.filename}:{w.lineno}, not the call in step")
