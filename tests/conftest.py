"""Shared test helpers: a dtype-keyed tolerance table, one verbose assert helper, input
generators and output poisoning."""
from __future__ import annotations

import math
import os
import re
import warnings

# MKL's matrix products can round differently when an operand sits at another
# alignment, unless its conditional numerical reproducibility mode is on (2-core Zen 5 VM,
# 2026-11-27, MKL 2024.0: 56 of 120 products of x @ W.t() with x and W moved off their
# 64-byte boundaries differed in the last bits, in float32 from x 4-28 bytes off a 32-byte
# boundary and in float64 from x or W 8 bytes off a 16-byte one; with MKL_CBWR set to
# AUTO, COMPATIBLE or AVX2, none did). Tests compare modules whose weights sit in
# fastpar's buffers (packed RNNs, replicas) with torch's, whose weights sit elsewhere,
# bit for bit: without the mode, on some host CPU a BLAS path picked by alignment could
# fail them. MKL reads the variable at its first call, so it is set here, before torch
# computes anything; a value given in the environment is kept.
os.environ.setdefault("MKL_CBWR", "AUTO")

import pytest
import torch
from torch.overrides import TorchFunctionMode
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")

# Property-based tests (hypothesis). Examples are drawn afresh every run (no
# derandomize): CI explores new inputs each time, and a failure prints the blob that
# replays it (@reproduce_failure). No per-example deadline: an example may be the first
# to compile a Numba kernel (seconds). HYPOTHESIS_PROFILE=soak runs 50x the examples.
_CI_EXAMPLES = 40
_HEALTH = [HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
settings.register_profile("ci", max_examples=_CI_EXAMPLES, deadline=None, print_blob=True, suppress_health_check=_HEALTH)
settings.register_profile("soak", max_examples=2000, deadline=None, print_blob=True, suppress_health_check=_HEALTH)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def examples(n: int) -> settings:
    """Settings for a property test that runs ``n`` examples under the ``ci`` profile
    (for tests whose examples are slow, e.g. under the Triton interpreter), and
    proportionally more under ``soak``."""
    return settings(max_examples=max(1, n * settings.default.max_examples // _CI_EXAMPLES))


def backend_properties(check, *, triton_examples: int):
    """The property ``check(data, backend)`` as the two tests each backend property
    gets: on numba and torch (the profile's examples), and under the Triton interpreter
    (``triton_examples``: see :func:`examples`), each inside ``fastpar.use_backend``.
    Assign them to two ``test_*`` names of the test module."""
    import fastpar
    from hypothesis import given

    @pytest.mark.parametrize("be", ["numba", "torch"])
    @given(data=st.data())
    def on_cpu_backends(be, data):
        with fastpar.use_backend(be):
            check(data, be)

    # numpy's warnings from the interpreter's arithmetic on the special values drawn
    # (inf + -inf, a cast of inf): the results are compared, the warnings say nothing.
    @pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")
    @examples(triton_examples)
    @given(data=st.data())
    def under_triton_interpreter(data):
        with fastpar.use_backend("triton"):
            check(data, "triton")

    return on_cpu_backends, under_triton_interpreter


#: (rtol, atol) against a float64 reference, per result dtype. For 16-bit floats: one
#: rounding to nearest (unit roundoff 2**-11 for float16, 2**-8 for bfloat16) plus a
#: float32 rounding of the computation before it; atol is half a float16 subnormal
#: spacing rounded up (bfloat16 has float32's range: no subnormals in these tests), so
#: small values are checked as tightly as large ones.
TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1.5e-6, 1e-6),
    torch.float16: (2**-11 + 2**-22, 6e-8),
    torch.bfloat16: (2**-8 + 2**-22, 1e-38),
    torch.int64: (0, 0),
    torch.int32: (0, 0),
    torch.int16: (0, 0),
    torch.int8: (0, 0),
    torch.uint8: (0, 0),
}
FLOAT_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INT_DTYPES = [torch.int32, torch.int64]
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES
#: Backends that run on CPU tensors here (triton = the Triton interpreter).
CPU_BACKENDS = ["numba", "triton", "torch"]

HAS_CUDA = torch.cuda.is_available()
cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, dtype=None, what: str = "", tol=None):
    """Compare ``actual`` with a (float64) reference within ``TOL[dtype]`` (infinities
    exactly, NaN where the reference has NaN); on failure,
    report how many elements differ, the worst one's index and both values, and any
    NaN (poison) left in ``actual``."""
    dtype = dtype or actual.dtype
    rtol, atol = tol or TOL[dtype]
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != expected {tuple(expected.shape)}"
    a = actual.detach().to("cpu", torch.float64).reshape(-1)
    e = expected.detach().to("cpu", torch.float64).reshape(-1)
    if a.numel() == 0:
        return
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    bad = (a - e).abs() > atol + rtol * e.abs()
    # An infinity on either side must be matched exactly: |x - inf| > atol + rtol * inf
    # is inf > inf (or > NaN with rtol 0): false, and would let any value stand for one.
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    bad |= (inf_a | inf_e) & (a != e)
    bad |= nan_a != nan_e
    bad &= ~(nan_a & nan_e)
    if bad.any():
        idx = bad.nonzero().flatten()
        i = int(idx[(a - e).abs()[idx].nan_to_num(float("inf")).argmax()])
        raise AssertionError(
            f"{what}: {len(idx)} of {a.numel()} elements differ beyond rtol={rtol}, atol={atol} "
            f"({dtype}); worst at flat index {i}: got {a[i].item()!r}, expected {e[i].item()!r}; "
            f"first bad indices {idx[:8].tolist()}; NaNs in result: {int(nan_a.sum())} (expected {int(nan_e.sum())})"
        )


def compiled_run(fn, *args, reuse: bool = True):
    """``fn(*args)`` compiled by dynamo (``backend="eager"``) from a clean dynamo state,
    run twice (with ``reuse``, the second call must reuse the first's graphs: not so
    where ``fn`` rebinds what dynamo guards on, e.g. a module's parameters that
    ``rnn.flatten_parameters`` replaces by views of its buffer): ``(result of the second
    call, graph-break reasons {reason: count}, graphs dynamo built, messages of the
    warnings raised)``. A fastpar op met by dynamo should cost one graph break, at its
    call, with nothing inside it traced."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(fn, backend="eager")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        compiled(*args)
        graphs = counters["stats"]["unique_graphs"]
        result = compiled(*args)
    assert not reuse or counters["stats"]["unique_graphs"] == graphs, "the second call built new graphs (a recompile)"
    breaks = dict(counters["graph_break"])
    torch._dynamo.reset()
    return result, breaks, graphs, [str(w.message) for w in seen]


def assert_one_break_per_op(breaks: dict, graphs: int, warned: list, ops: list) -> None:
    """What :func:`compiled_run` saw of a function calling each of ``ops`` (fastpar
    functions, by name): every graph break is at a call of one of them, each names it
    (dynamo keys breaks by their reason, so two calls of one op share a key), at most
    one graph more than calls, and no warning from dynamo or inductor."""
    named = [re.findall(r"function `(\w+)`", reason) for reason in breaks]
    assert sorted(n[0] for n in named if n) == sorted(set(ops)) and len(breaks) == len(set(ops)), (
        f"expected graph breaks at {sorted(set(ops))} only, got {len(breaks)} kinds: "
        + "; ".join(r.splitlines()[0] + " " + str(n) for r, n in zip(breaks, named))
    )
    assert graphs <= len(ops) + 1, f"expected at most {len(ops) + 1} graphs around {len(ops)} breaks, dynamo built {graphs}"
    noise = [w for w in warned if "ynamo" in w or "nductor" in w]
    assert not noise, f"dynamo/inductor warned: {noise}"


def compiling_flag_on(monkeypatch) -> None:
    """Make ``torch.compiler.is_compiling()`` true with dynamo not tracing: what
    ``torch.export`` with ``strict=False`` (and a compile session's AOT tracing) does
    while Python runs eagerly. fastpar's calls must then run as in eager mode: the eager
    entries (:func:`fastpar._dispatch.eager_entry`) are for dynamo's tracing only.
    Skips where torch keeps no such flag."""
    if not hasattr(torch.compiler, "_is_compiling_flag"):
        pytest.skip("this torch has no torch.compiler._is_compiling_flag")
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert torch.compiler.is_compiling() and not torch.compiler.is_dynamo_compiling()


def assert_same_bits(actual, expected, what: str = "", *, nan_payloads: bool = False):
    """``actual`` holds exactly ``expected``'s shape, dtype and bits: values first
    (:func:`assert_close` with no tolerance: names the worst element and any NaN poison
    left), then the bits (signed zeros); complex tensors as their real views. With
    ``nan_payloads``, a NaN matches any NaN: torch's own conversion paths give bfloat16
    NaNs different payloads."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.is_complex():
        actual, expected = (torch.view_as_real(x.resolve_conj().contiguous()) for x in (actual, expected))
    assert_close(actual, expected, what=what, tol=(0, 0))
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
    a, e = actual.detach().cpu(), expected.detach().cpu()
    differ = a.view(ints) != e.view(ints)
    if nan_payloads and a.dtype.is_floating_point:
        differ &= ~(a.isnan() & e.isnan())
    bad = differ.nonzero().flatten()
    assert not len(bad), f"{what}: equal values but different bits at {bad[:8].tolist()}"


def bf16_subnormals_zeroed(w: torch.Tensor) -> torch.Tensor:
    """``w`` with its bfloat16 subnormals replaced by 0 (signed zeros kept): the Triton
    interpreter's bfloat16 -> float32 conversion loses them (test_rnn records it as an
    xfail; the GPU conversion is exact)."""
    w = w.clone()
    flat = w.view(-1)
    flat[(flat != 0) & (flat.abs() < torch.finfo(torch.bfloat16).tiny)] = 0
    return w


#: In-place changes of a 1-D buffer a bound call was made for (fastpar._flatten._Bound):
#: the next call must see each one (tests of flatten(out=) and rnn.pack(out=)).
BUFFER_CHANGES = ("resize_smaller", "resize_larger", "set_other_storage", "data_other_tensor",
                  "data_other_dtype", "as_strided_noncontiguous", "storage_offset", "storage_shrunk",
                  "requires_grad", "negated", "view_as_2d")


def change_in_place(buf: torch.Tensor, change: str) -> None:
    """Change the 1-D ``buf`` in place as :data:`BUFFER_CHANGES` names (the object stays
    the same; its memory, shape, dtype or flags do not)."""
    n = buf.numel()
    if change == "resize_smaller":
        buf.resize_(n - 1)
    elif change == "resize_larger":
        buf.resize_(n + 1)
    elif change == "set_other_storage":
        buf.set_(torch.empty(n, dtype=buf.dtype).untyped_storage())
    elif change == "data_other_tensor":
        buf.data = torch.empty(n, dtype=buf.dtype)
    elif change == "data_other_dtype":
        buf.data = torch.empty(n, dtype=torch.int32 if buf.dtype.is_floating_point else torch.float32)
    elif change == "as_strided_noncontiguous":
        buf.as_strided_((n // 2,), (2,))
    elif change == "storage_offset":
        buf.set_(torch.empty(n + 1, dtype=buf.dtype).untyped_storage(), 1, (n,))
    elif change == "storage_shrunk":
        buf.untyped_storage().resize_(buf.untyped_storage().nbytes() - 4)
    elif change == "requires_grad":
        buf.requires_grad_(True)
    elif change == "negated":
        buf.data = torch._neg_view(buf.data)
    elif change == "view_as_2d":
        buf.as_strided_((1, n), (n, 1))
    else:
        raise ValueError(f"unknown change {change!r}")


def snapshot(tensors) -> list:
    """Copies of ``tensors`` for :func:`assert_unchanged` (taken before a call that must
    write nothing)."""
    return [t.detach().clone() for t in tensors]


def assert_unchanged(tensors, before, *, what: str = "") -> None:
    """Every tensor still holds exactly what :func:`snapshot` saw (NaN matches NaN, so
    poisoned outputs compare equal to themselves); names the first one that changed."""
    for i, (t, b) in enumerate(zip(tensors, before)):
        t = t.detach()
        if t.dtype.is_floating_point:
            same = torch.equal(t.isnan(), b.isnan()) and torch.equal(t.nan_to_num(0.0), b.nan_to_num(0.0))
        else:
            same = torch.equal(t, b)
        assert same, f"{what}: tensor {i} (shape {tuple(t.shape)}, {t.dtype}) was written by a rejected call"


def poisoned(*shape, **kwargs) -> torch.Tensor:
    """``torch.empty(*shape, **kwargs)`` filled by :func:`poison_`."""
    return poison_(torch.empty(*shape, **kwargs))


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (floats) or a sentinel (integers) so unwritten elements show."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(-7 if t.dtype.is_signed else 77)


def rand(shape, dtype, *, gen=None, device="cpu") -> torch.Tensor:
    """Fresh random values exactly representable in ``dtype`` (for bool, either; for
    complex, standard normal parts)."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool().to(device)
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=torch.complex64).to(dtype).to(device)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype).to(device)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -(2**20)), min(info.max, 2**20)
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(dtype).to(device)


# Inputs for property tests (hypothesis): shapes, dtypes and layouts drawn, values from
# a seeded torch.Generator.
def seeded(data) -> torch.Generator:
    """A torch.Generator seeded by a value drawn from hypothesis' ``data`` (so a failing
    example replays its tensors too)."""
    return torch.Generator().manual_seed(data.draw(st.integers(0, 2**32 - 1), "seed"))


def storage_of(t: torch.Tensor) -> int:
    """Address of ``t``'s storage (tensors sharing one have the same)."""
    return t.untyped_storage().data_ptr()


LAYOUTS = ["contiguous", "transposed", "stepped", "offset", "expanded", "negative"]
#: Values that stress the conversions of float -> float (not float -> integer: C++
#: leaves NaN, infinities and out-of-range values undefined there, and torch with it).
SPECIALS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -3e-39, 65504.0, 65520.0, 1e30, 3.0e38,
            2.0**-24, 2.0**-25 * 3, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-9]


@st.composite
def tensor_specs(draw, dtypes):
    """(shape, dtype, layout) of one input; shapes of up to 3 dims with sizes 0..6 (one
    in 20 a single dim of 65,537, beyond one block of the kernels)."""
    dtype = draw(st.sampled_from(dtypes))
    if draw(st.integers(0, 19)) == 0:
        shape = (65_537,)
    else:
        shape = tuple(draw(st.lists(st.integers(0, 6), max_size=3)))
    return shape, dtype, draw(st.sampled_from(LAYOUTS))


def build(spec, gen, *, specials, flush_bf16: bool = False):
    """A tensor of ``spec``'s shape and dtype, laid out as it says (``expanded`` repeats
    one row; ``negative`` is a lazy negative view where the dtype has one), with fresh
    values from ``gen`` (:func:`rand`) and, with ``specials`` (True: ``SPECIALS``, or a
    list of values), some of those among them. With ``flush_bf16``, bfloat16 subnormals
    are zeroed (the Triton interpreter loses them)."""
    shape, dtype, layout = spec
    if layout == "transposed" and len(shape) >= 2:
        base_shape = tuple(reversed(shape))
    elif layout == "stepped" and len(shape) >= 1:
        base_shape = (shape[0] * 2,) + shape[1:]
    elif layout == "offset":
        base_shape = (math.prod(shape) + 3,)
    elif layout == "expanded" and len(shape) >= 1:
        base_shape = (1,) + shape[1:]
    else:
        base_shape = shape
    base = rand(base_shape, dtype, gen=gen)
    if specials and dtype.is_floating_point and base.numel():
        n = base.numel()
        values = SPECIALS if specials is True else specials
        pick = torch.randint(0, len(values), (min(n, 8),), generator=gen)
        base.view(-1)[torch.randint(0, n, (len(pick),), generator=gen)] = \
            torch.tensor(values, dtype=torch.float64)[pick].to(dtype)
    if flush_bf16 and dtype == torch.bfloat16:
        base = bf16_subnormals_zeroed(base)
    if layout == "transposed" and len(shape) >= 2:
        t = base.permute(*reversed(range(len(shape))))
    elif layout == "stepped" and len(shape) >= 1:
        t = base[::2]
    elif layout == "offset":
        t = base[3:].view(shape)
    elif layout == "expanded" and len(shape) >= 1:
        t = base.expand(shape)
    else:
        t = base
    if layout == "negative" and dtype.is_floating_point:
        t = torch._neg_view(t.neg())  # the same values behind a lazy negation bit
    return t


@pytest.fixture(params=CPU_BACKENDS)
def backend(request):
    import fastpar

    with fastpar.use_backend(request.param):
        yield request.param


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the item (``item.rep_call``), so that a fixture's
    teardown checks can tell a test that skipped or failed from one that ran through."""
    rep = yield
    setattr(item, f"rep_{rep.when}", rep)
    return rep


def body_passed(request) -> bool:
    """True when the requesting test's body ran and passed (for fixture teardown checks)."""
    rep = getattr(request.node, "rep_call", None)
    return rep is not None and rep.passed


@pytest.fixture(scope="session", autouse=True)
def _no_tuned_files(tmp_path_factory):
    """Every test runs the kernels with their default parameters: ``FASTPAR_RESULTS_DIR``
    points at an empty folder for the session. Otherwise a tuned file for the machine
    (this checkout's ``results/autotune/``, or the caller's ``FASTPAR_RESULTS_DIR``)
    picks chunk sizes and parallel thresholds, and which code paths a test exercises
    depends on the machine it runs on (a legal winner, parallel_min_bytes = 2**62, turns
    the Numba parallel path off). Tests of tuning set their own folder
    (test_autotune's ``results`` fixture)."""
    from fastpar import _tuning

    mp = pytest.MonkeyPatch()
    mp.setenv("FASTPAR_RESULTS_DIR", str(tmp_path_factory.mktemp("no-tuned-files")))
    _tuning.reload()
    yield
    mp.undo()
    _tuning.reload()


@pytest.fixture(autouse=True)
def _fresh_plans():
    import fastpar

    fastpar.clear_plan_cache()
    yield


class RecordingMode(TorchFunctionMode):
    """A ``TorchFunctionMode`` that records every function handed to it (``.seen``) and
    runs it unchanged: what a tracer or a profiler built on modes would see of a call."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))
