"""fastpar.rnn: layouts, one-launch packing, flatten_parameters on every mode and dtype
against unflattened copies (and a float64 reference), backends bit for bit, bad inputs
(nothing rebound), the packing kernel compiled ahead of time, and cuDNN checks on CUDA."""
from __future__ import annotations

import copy
import dataclasses
import warnings

import numpy as np
import pytest
import torch
from conftest import (
    CPU_BACKENDS,
    assert_one_break_per_op,
    assert_same_bits,
    assert_unchanged,
    BUFFER_CHANGES,
    bf16_subnormals_zeroed,
    change_in_place,
    compiled_run,
    compiling_flag_on,
    cuda,
    poison_,
    poisoned,
    snapshot,
)

import fastpar
from fastpar import rnn
from fastpar._plan import plan_for
from fastpar.rnn import RNNLayout

pytestmark = pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")

MODES = ["LSTM", "GRU", "RNN_TANH", "RNN_RELU"]
IN, HID, PROJ, SEQ, BATCH = 5, 6, 3, 4, 2
#: (num_layers, bidirectional, bias, proj_size); proj_size applies to LSTM only.
CONFIGS = {
    "1L-uni": (1, False, True, 0),
    "2L-bi-nobias": (2, True, False, 0),
    "3L-bi-proj": (3, True, True, PROJ),
    "2L-uni-nobias-proj": (2, False, False, PROJ),
}
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
#: (rtol, atol) of a module's forward/backward against the float64 module: these are
#: RNN results (sums of products through several steps), not single roundings.
RNN_TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (1e-1, 1e-1),
}


def make(mode, num_layers=1, bidirectional=False, bias=True, proj_size=0, *, dtype=torch.float32,
         device="cpu", input_size=IN, hidden_size=HID, seed=0):
    torch.manual_seed(seed)
    kw = dict(num_layers=num_layers, bidirectional=bidirectional, bias=bias, dtype=dtype, device=device)
    if mode == "LSTM":
        return torch.nn.LSTM(input_size, hidden_size, proj_size=proj_size, **kw)
    if mode == "GRU":
        return torch.nn.GRU(input_size, hidden_size, **kw)
    return torch.nn.RNN(input_size, hidden_size, nonlinearity=mode[4:].lower(), **kw)


def config(mode, name):
    num_layers, bidirectional, bias, proj = CONFIGS[name]
    return (num_layers, bidirectional, bias, proj if mode == "LSTM" else 0)


def ptrs(module):
    return [getattr(module, n).data_ptr() if getattr(module, n) is not None else None
            for n in module._flat_weights_names]


def run(module, x, gy):
    """Output, final state(s) and every weight's gradient for ``(out * gy).sum()``."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out, state = module(x)
    (out * gy).sum().backward()
    states = state if isinstance(state, tuple) else (state,)
    grads = [getattr(module, n).grad for n in module._flat_weights_names]
    return [out.detach(), *[s.detach() for s in states], x.grad, *grads]


def expected_pack(weights, layout):
    """The packed buffer of ``weights`` built without fastpar: zeros (the gaps), then each
    weight, flattened and converted to the layout's dtype through float64 (exact for
    every float source, so one rounding: ``Tensor.to``'s), slice-assigned at its offset."""
    buf = torch.zeros(layout.numel, dtype=layout.dtype, device=layout.device)
    for w, off, shape in zip(weights, layout.offsets, layout.shapes):
        flat = w.detach().reshape(-1)
        assert tuple(w.shape) == shape
        buf[off : off + flat.numel()] = flat.to(torch.float64).to(layout.dtype)
    return buf


def assert_views_of(module, buf, layout):
    base = buf.data_ptr()
    for n, off, shape in zip(layout.names, layout.offsets, layout.shapes):
        w = getattr(module, n)
        assert w.untyped_storage().data_ptr() == base, f"{n} is not in the packed buffer"
        assert w.data_ptr() == base + off * buf.element_size(), f"{n} is not at its layout offset"
        assert tuple(w.shape) == shape and w.is_contiguous()


# --- layouts ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_dense_layout_matches_module(mode, cfg):
    m = make(mode, *config(mode, cfg))
    layout = RNNLayout.for_module(m)
    assert layout.source == "dense" and layout.device == torch.device("cpu")
    assert list(layout.names) == m._flat_weights_names
    assert list(layout.shapes) == [tuple(getattr(m, n).shape) for n in m._flat_weights_names]
    numels = [w.numel() for w in m._flat_weights]
    assert list(layout.offsets) == [sum(numels[:i]) for i in range(len(numels))]
    assert layout.numel == sum(numels) and layout.gaps.shape == (0, 2)
    assert RNNLayout.for_module(m) is layout, "layouts are cached per configuration"
    assert RNNLayout.for_module(m, dtype=torch.float16).dtype == torch.float16


def test_layout_views_and_constructor_checks():
    layout = RNNLayout.for_config("GRU", 3, 4, 2, bidirectional=True)
    buf = torch.arange(layout.numel, dtype=torch.float32)
    views = layout.views(buf)
    for v, s, o in zip(views, layout.shapes, layout.offsets):
        assert tuple(v.shape) == s and v.data_ptr() == buf.data_ptr() + 4 * o
    assert views[0].reshape(-1)[0] == 0
    # Each weight has its own version counter (as torch's set_-based flattening keeps).
    before = [v._version for v in views]
    views[1].add_(1)
    assert [v._version for v in views] == [b + (i == 1) for i, b in enumerate(before)]
    # "cpu:0" names the CPU, whose tensors report "cpu": the layout must accept them.
    gru = torch.nn.GRU(3, 4)
    named = RNNLayout.for_module(gru, device="cpu:0")
    assert named.device == torch.device("cpu")
    assert rnn.pack(gru._flat_weights, named).numel() == named.numel
    with pytest.raises(ValueError, match="overlap"):
        dataclasses.replace(layout, offsets=(0,) * len(layout.offsets))
    with pytest.raises(ValueError, match="outside the buffer"):
        dataclasses.replace(layout, numel=layout.numel - 1)
    with pytest.raises(ValueError, match="one shape and one offset"):
        dataclasses.replace(layout, offsets=layout.offsets[:-1])
    with pytest.raises(ValueError, match="mode must be one of"):
        RNNLayout.for_config("LSTMX", 3, 4)
    with pytest.raises(ValueError, match="proj_size"):
        RNNLayout.for_config("GRU", 3, 4, proj_size=2)
    with pytest.raises(ValueError, match="hidden_size must be an int >= 1"):
        RNNLayout.for_config("GRU", 3, 0)
    # bool("False") is True: nn.RNNBase refuses a non-bool bias, and so does the layout.
    for bad in ("False", 0, None):
        with pytest.raises(TypeError, match=f"bias must be a bool, got {type(bad).__name__}"):
            RNNLayout.for_config("GRU", 3, 4, bias=bad)
    assert RNNLayout.for_config("GRU", 3, 4, bias=np.bool_(False)).bias is False


# --- flatten_parameters: every mode, configuration and dtype ---------------------------


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_matrix_products_do_not_depend_on_alignment_here(dtype):
    # The premise of this file's bit-for-bit comparisons of packed modules with unpacked
    # ones (and of test_replicate's with torch's replicas): the same values give the
    # same products wherever the weights sit. MKL keeps that only in its reproducibility
    # mode, which conftest turns on (without it, on the Zen 5 VM, 56 of 120 of these
    # products differed). Fails if the mode is not in effect, e.g. because something
    # computed a product before conftest set MKL_CBWR.
    def moved(t, off):
        buf = torch.empty(t.numel() + off, dtype=dtype)
        return buf[off:].view(t.shape).copy_(t)

    g = torch.Generator().manual_seed(0)
    for m, k, n in [(3, 5, 16), (6, 20, 80), (40, 64, 256), (10, 32, 128)]:
        w = torch.randn(n, k, generator=g, dtype=dtype)
        x = torch.randn(m, k, generator=g, dtype=dtype)
        want = x @ w.t()
        for off in range(1, 9):
            assert torch.equal(moved(x, off) @ moved(w, off + 1).t(), want), \
                f"{m}x{k} @ {k}x{n} in {dtype}: other bits with the operands {off} elements off"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_flatten_parameters_keeps_the_module_working(mode, cfg, dtype):
    m = make(mode, *config(mode, cfg), dtype=dtype)
    ref = copy.deepcopy(m)  # unflattened, same dtype
    ref64 = copy.deepcopy(m).double()  # float64 reference
    params_before = list(m.parameters())
    sd_before = {k: v.clone() for k, v in m.state_dict().items()}
    assert not rnn.is_flat(m), "a fresh CPU module has one allocation per weight"

    with fastpar.count_launches() as n:
        buf = rnn.flatten_parameters(m)
    assert n.total == 1, f"one launch per pack, got {n.by_op}"
    layout = RNNLayout.for_module(m)
    assert buf.dtype == dtype and buf.numel() == layout.numel and buf.storage_offset() == 0
    assert rnn.is_flat(m)
    assert_views_of(m, buf, layout)
    assert all(a is b for a, b in zip(m.parameters(), params_before)), "Parameter objects must be kept"
    assert all(a is getattr(m, n) for a, n in zip(m._flat_weights, m._flat_weights_names))
    assert all(isinstance(p, torch.nn.Parameter) and p.requires_grad for p in m.parameters())
    sd = m.state_dict()
    assert list(sd) == list(sd_before)
    assert all(torch.equal(sd[k], sd_before[k]) for k in sd), "state_dict values changed"

    g = torch.Generator().manual_seed(1)
    x = torch.randn(SEQ, BATCH, IN, generator=g).to(dtype)
    gy = torch.randn(SEQ, BATCH, m(x)[0].shape[-1], generator=g).to(dtype)
    got, same, exp = run(m, x, gy), run(ref, x, gy), run(ref64, x.double(), gy.double())
    rtol, atol = RNN_TOL[dtype]
    for i, (a, b, e) in enumerate(zip(got, same, exp)):
        # Packing moves bits: the same computation on the same values, so equal results.
        assert torch.equal(a, b), f"result {i} differs from the unflattened module's"
        torch.testing.assert_close(a.double(), e, rtol=rtol, atol=atol, msg=f"result {i} vs float64")

    # An optimizer step updates the weights in place: in the packed buffer.
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.5)
    before = buf.clone()
    opt.step()
    opt_ref.step()
    assert not torch.equal(buf, before), "the step did not reach the packed buffer"
    assert rnn.is_flat(m)
    assert_same_bits(buf, expected_pack(ref._flat_weights, layout), "buffer vs the stepped reference")


def test_flatten_parameters_triton_interpreter_and_torch_backends():
    for backend, launches in (("triton", 1), ("torch", 0)):
        m = make("LSTM", 2, True, False, PROJ)
        ref = copy.deepcopy(m)
        with fastpar.use_backend(backend), fastpar.count_launches() as n:
            buf = rnn.flatten_parameters(m)
        assert n.total == launches and rnn.is_flat(m)
        assert_same_bits(buf, expected_pack(ref._flat_weights, RNNLayout.for_module(ref)), backend)


def test_flatten_parameters_is_idempotent_and_repacks_when_broken():
    m = make("GRU", 2, True)
    buf = rnn.flatten_parameters(m)
    with fastpar.count_launches() as n:
        again = rnn.flatten_parameters(m)
    assert n.total == 0 and again.data_ptr() == buf.data_ptr() and torch.equal(again, buf)
    # Replacing one weight's storage breaks flatness; the next call packs a new buffer.
    m.weight_hh_l1.data = m.weight_hh_l1.data.clone() * 2
    assert not rnn.is_flat(m)
    buf2 = rnn.flatten_parameters(m)
    assert rnn.is_flat(m) and buf2.data_ptr() != buf.data_ptr()
    layout = rnn.RNNLayout.for_module(m)
    assert torch.equal(m.weight_hh_l1, layout.views(buf2)[layout.names.index("weight_hh_l1")])


def test_load_state_dict_and_hooks_after_flatten():
    m = make("LSTM", 2, False, True, PROJ)
    other = make("LSTM", 2, False, True, PROJ, seed=5)
    seen = []
    m.weight_ih_l0.register_hook(lambda grad: seen.append(grad.shape))
    buf = rnn.flatten_parameters(m)
    m.load_state_dict(other.state_dict())
    assert rnn.is_flat(m), "load_state_dict copies in place: the buffer stays"
    assert_same_bits(buf, expected_pack(other._flat_weights, RNNLayout.for_module(other)), "after load_state_dict")
    m(torch.randn(SEQ, BATCH, IN))[0].sum().backward()
    assert seen == [m.weight_ih_l0.shape], "a tensor hook registered before flattening must still fire"


def test_module_to_after_flatten_then_flatten_again():
    m = make("RNN_TANH", 2, True)
    rnn.flatten_parameters(m)
    m.double()
    assert not rnn.is_flat(m), ".double() gives each weight its own storage again"
    buf = rnn.flatten_parameters(m)
    assert buf.dtype == torch.float64 and rnn.is_flat(m)


# --- pack -------------------------------------------------------------------------------


def gapped(layout, pad=3):
    """``layout`` with ``pad`` free elements before, between and after the weights (as
    cuDNN's layouts may have): a layout with gaps on CPU."""
    offsets, at = [], pad
    for s in layout.shapes:
        offsets.append(at)
        at += int(torch.Size(s).numel()) + pad
    return dataclasses.replace(layout, offsets=tuple(offsets), numel=at + pad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backends_pack_bit_identical(dtype):
    m = make("LSTM", 2, True, True, PROJ, dtype=dtype, input_size=33, hidden_size=40)
    ws = [w.detach() for w in m._flat_weights]
    ws[1] = ws[1].t().contiguous().t()  # one non-contiguous weight (same values)
    dense = RNNLayout.for_module(m)
    for layout in (dense, gapped(dense)):
        expected = expected_pack(ws, layout)
        for backend in CPU_BACKENDS:
            with fastpar.use_backend(backend), fastpar.count_launches() as n:
                out = rnn.pack(ws, layout, out=poisoned(layout.numel, dtype=dtype))
            assert n.total == (0 if backend == "torch" else 1), f"{backend}: {n.by_op}"
            assert_same_bits(out, expected, f"{backend}, {len(layout.gaps)} gaps")


def test_gaps_are_zero_filled_in_the_same_launch(backend):
    m = make("GRU", 2, True, False, input_size=7, hidden_size=9)
    layout = gapped(RNNLayout.for_module(m))
    assert len(layout.gaps) == len(layout.names) + 1
    out = poison_(torch.empty(layout.numel))
    with fastpar.count_launches() as n:
        rnn.pack(list(m._flat_weights), layout, out=out)
    assert n.total == (0 if backend == "torch" else 1)
    covered = torch.zeros(layout.numel, dtype=torch.bool)
    for w, v, off in zip(m._flat_weights, layout.views(out), layout.offsets):
        assert torch.equal(v, w.detach())
        covered[off : off + w.numel()] = True
    assert torch.equal(out[~covered], torch.zeros(int((~covered).sum()))), "gaps must be zero"
    assert_same_bits(out, expected_pack(m._flat_weights, layout), "into poisoned out")
    # A fresh buffer too (no memset behind it: the launch writes every element).
    fresh = rnn.pack(list(m._flat_weights), layout)
    assert_same_bits(fresh, expected_pack(m._flat_weights, layout), "fresh buffer")


def test_pack_casts_and_reuses_out(backend):
    m = make("LSTM", 1, True, True, PROJ)
    layout = RNNLayout.for_module(m, dtype=torch.bfloat16)
    out = poisoned(layout.numel, dtype=torch.bfloat16)
    res = rnn.pack(list(m._flat_weights), layout, out=out)
    assert res is out
    assert_same_bits(out, expected_pack(m._flat_weights, layout), "cast must match Tensor.to")
    with torch.no_grad():
        m.weight_ih_l0.mul_(2)
    poison_(out)
    v0 = out._version
    rnn.pack(list(m._flat_weights), layout, out=out)
    assert out._version > v0
    assert_same_bits(out, expected_pack(m._flat_weights, layout), "reused out")


#: Values that take each conversion's edge cases: signed zero, round-half-even ties
#: (float16 and bfloat16 at 1, float32 at 1 from float64), overflow to infinity,
#: subnormals and ties between them. Each is first stored in the source dtype (which
#: rounds it there): the source values are whatever that gives.
SPECIALS = [0.0, -0.0, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, -(1 + 3 * 2**-8), 1 + 2**-24,
            65519.0, 65520.0, -7e4, 2**-24, 2**-25, 3 * 2**-25, 2**-149, 2**-150, 1e-40,
            6e38, float("inf"), float("-inf")]
#: (source, buffer) dtypes rnn.pack converts between, each one rounding at most.
CASTS = [(torch.float32, torch.float16), (torch.float64, torch.float32), (torch.bfloat16, torch.float32),
         (torch.float16, torch.bfloat16)]
#: mode, input_size, hidden_size, num_layers, bidirectional, bias, proj_size, pad of the
#: gapped layout. "large": 126750 elements, weight_ih_l0 alone 76800 (more than one
#: 65536-element Numba chunk, with a remainder).
CAST_CONFIGS = {
    "small": ("LSTM", 9, 10, 2, True, True, PROJ, 3),
    "large": ("GRU", 200, 128, 1, False, True, 0, 5),
}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # interpreter, on inf
@pytest.mark.parametrize("cfg", [pytest.param(c, marks=[pytest.mark.slow] if "large" in c else [])
                                 for c in CAST_CONFIGS])
@pytest.mark.parametrize("src,dst", CASTS, ids=lambda d: str(d).replace("torch.", ""))
def test_pack_casts_match_float64_reference(backend, src, dst, cfg):
    mode, in_size, hid, layers, bi, bias, proj, pad = CAST_CONFIGS[cfg]
    m = make(mode, layers, bi, bias, proj, dtype=src, input_size=in_size, hidden_size=hid)
    ws = [w.detach().clone() for w in m._flat_weights]
    ws[0].view(-1)[: len(SPECIALS)] = torch.tensor(SPECIALS, dtype=torch.float64).to(src)
    if backend == "triton" and src == torch.bfloat16:
        ws[0] = bf16_subnormals_zeroed(ws[0])
    ws[1] = ws[1].t().contiguous().t()  # one non-contiguous weight (same values)
    layout = gapped(RNNLayout.for_module(m, dtype=dst), pad)
    expected = expected_pack(ws, layout)
    with fastpar.count_launches() as n:
        out = rnn.pack(ws, layout, out=poisoned(layout.numel, dtype=dst))
    assert n.total == (0 if backend == "torch" else 1), f"{backend}: {n.by_op}"
    assert_same_bits(out, expected, f"{src} -> {dst}, {layout.numel} elements")
    assert_same_bits(rnn.pack(ws, layout), expected, f"{src} -> {dst}, fresh buffer")


@pytest.mark.xfail(strict=True, reason="Triton interpreter: bfloat16 -> float32 loses subnormals "
                   "(triton.runtime.interpreter._convert_float); the GPU conversion is exact")
def test_pack_bf16_subnormals_triton_interpreter():
    layout = RNNLayout.for_config("RNN_TANH", 1, 1, bias=False, dtype=torch.float32)
    ws = [torch.tensor([[1e-40]]).to(torch.bfloat16), torch.tensor([[-2.0**-130]]).to(torch.bfloat16)]
    with fastpar.use_backend("triton"):
        out = rnn.pack(ws, layout, out=poisoned(layout.numel))
    assert_same_bits(out, expected_pack(ws, layout), "bfloat16 subnormals -> float32")


# --- bad input: clear errors, nothing written or rebound --------------------------------


@pytest.mark.parametrize("fn", [rnn.flatten_parameters, rnn.is_flat, RNNLayout.for_module])
def test_not_an_rnn(fn):
    for bad in (torch.nn.Linear(3, 4), torch.nn.LSTMCell(3, 4), "LSTM"):
        with pytest.raises(TypeError, match=r"module must be a torch.nn.RNNBase .* got"):
            fn(bad)


def _assert_rejected(m, exc, match):
    before = ptrs(m)
    with pytest.raises(exc, match=match):
        rnn.flatten_parameters(m)
    assert ptrs(m) == before, "a rejected call must rebind nothing"
    assert not rnn.is_flat(m)


def test_weights_of_different_dtypes():
    m = make("LSTM", 2, True)
    m.weight_hh_l1.data = m.weight_hh_l1.data.double()
    _assert_rejected(m, TypeError, r"one dtype: module.weight_ih_l0 is torch.float32 but module.weight_hh_l1 is torch.float64")


def test_weights_on_different_devices():
    m = make("GRU", 1, True)
    m.bias_hh_l0_reverse = torch.nn.Parameter(torch.empty(m.bias_hh_l0_reverse.shape, device="meta"))
    _assert_rejected(m, ValueError, r"one device: module.weight_ih_l0 is on cpu but module.bias_hh_l0_reverse is on meta")


@pytest.mark.parametrize("name,shape", [("weight_ih_l0", (24, 4)), ("weight_hr_l1", (3, 5)), ("bias_hh_l0", (24, 1))])
def test_weights_replaced_with_wrong_shapes(name, shape):
    m = make("LSTM", 2, False, True, PROJ)
    setattr(m, name, torch.nn.Parameter(torch.randn(shape)))
    _assert_rejected(m, ValueError, rf"module.{name} has shape \({shape[0]}, {shape[1]}\), but .* expects")


def test_tied_and_missing_weights():
    m = make("RNN_RELU", 1, True)
    m.weight_hh_l0_reverse = m.weight_hh_l0
    _assert_rejected(m, ValueError, "module.weight_hh_l0_reverse aliases module.weight_hh_l0")
    m = make("RNN_RELU", 1, False)
    m.weight_hh_l0 = None
    _assert_rejected(m, TypeError, "module.weight_hh_l0 must be a torch.Tensor, got NoneType")


def test_pack_plan_cache_does_not_keep_a_steps_weights_alive():
    """Weights packed once (an EMA copy, weights received each step): once the caller
    drops them, no cached plan, nor its cached packing group, may keep them alive."""
    import gc
    import weakref

    from fastpar import _plan

    m = torch.nn.LSTM(8, 16, num_layers=2)
    layout = RNNLayout.for_module(m)
    _plan.clear_plan_cache()
    refs = []
    for _ in range(10):
        ws = [w.detach().clone() for w in m._flat_weights]
        refs += [weakref.ref(w) for w in ws]
        out = rnn.pack(ws, layout)
        assert torch.equal(out[: ws[0].numel()], ws[0].reshape(-1))
        del ws
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive <= len(m._flat_weights), f"{alive} of {len(refs)} weights of past steps kept alive"


def test_inference_weight_is_refused_before_anything_is_rebound():
    m = make("GRU", 1, False)
    with torch.inference_mode():
        w = torch.nn.Parameter(torch.randn_like(m.weight_hh_l0))
    m.weight_hh_l0 = w
    _assert_rejected(m, RuntimeError, "module.weight_hh_l0 is an inference tensor")
    with torch.inference_mode():  # where set_ may rebind it
        m2 = make("LSTM", 1, False)
        rnn.flatten_parameters(m2)
        assert rnn.is_flat(m2)


def _inference_poisoned(n):
    with torch.inference_mode():
        return poisoned(n)


def test_flatten_parameters_of_a_meta_module_says_so():
    with pytest.raises(ValueError, match=r"module's weights are meta tensors"):
        rnn.flatten_parameters(torch.nn.LSTM(3, 2, device="meta"))


def test_pack_bad_out_and_weights():
    m = make("LSTM", 1, False, True, PROJ)
    ws = list(m._flat_weights)
    layout = RNNLayout.for_module(m)
    n = layout.numel
    cases = [
        (dict(out=poisoned(n - 1)), ValueError, rf"exactly {n} elements .*got {n - 1} \(too small\)"),
        (dict(out=poisoned(n + 1)), ValueError, r"too large"),
        (dict(out=poisoned(n + 1)[1:]), ValueError, "storage offset 0"),
        (dict(out=poisoned(n, dtype=torch.float64)), TypeError, "dtype torch.float32"),
        (dict(out=torch.empty(n, device="meta")), ValueError, "must be on cpu"),
        (dict(out=poisoned(2, n)[:, 0]), ValueError, "contiguous 1-D"),
        (dict(out=[0.0] * n), TypeError, "out must be a torch.Tensor, got list"),
        # What flatten refuses of its out (pack took them: a negated view was written
        # negated, an inference tensor outside inference mode, and a tensor requiring
        # grad without its history).
        (dict(out=torch._neg_view(poisoned(n))), ValueError, "out is a lazily negated view"),
        (dict(out=_inference_poisoned(n)), RuntimeError, "out is an inference tensor"),
        (dict(out=poisoned(n).requires_grad_()), RuntimeError, "out requires grad"),
        (dict(out=poisoned(n).requires_grad_() * 1), RuntimeError, "out requires grad"),
    ]
    for kwargs, exc, match in cases:
        out = kwargs["out"]
        # The weights, and the rejected out buffer itself (a meta tensor holds no data).
        watched = ws + ([out] if isinstance(out, torch.Tensor) and out.device.type == "cpu" else [])
        before = snapshot(watched)
        with pytest.raises(exc, match=match):
            rnn.pack(ws, layout, **kwargs)
        assert_unchanged(watched, before, what=match)
    buf = rnn.pack(ws, layout)
    with pytest.raises(ValueError, match=r"out overlaps the memory of weights\[0\]"):
        rnn.pack(layout.views(buf), layout, out=buf)
    with pytest.raises(ValueError, match=r"weights must hold the layout's 5 weights"):
        rnn.pack(ws[:-1], layout)
    with pytest.raises(ValueError, match=r"weights\[1\] \(weight_hh_l0\) has shape"):
        rnn.pack([ws[0], ws[0], *ws[2:]], layout)
    with pytest.raises(TypeError, match=r"weights\[0\] is torch.float32 but weights\[2\] is torch.float64"):
        rnn.pack([ws[0], ws[1], ws[2].double(), *ws[3:]], layout)
    with pytest.raises(TypeError, match="layout must be an RNNLayout, got dict"):
        rnn.pack(ws, {})
    with pytest.raises(TypeError, match="weights must be a list or tuple of tensors"):
        rnn.pack(ws[0], layout)
    with pytest.raises(TypeError, match="must have dtype torch.float32"):
        layout.views(torch.empty(n, dtype=torch.float16))


# ---------------------------------------------------------------------------------------
# Bound packs: rnn.pack(weights, layout, out=out) called again with the same weights,
# layout and out object, none of them changed, skips the checks and the launch set-up
# (as flatten(out=) does, fastpar._flatten._Bound).


def test_repeated_packs_skip_the_checks_until_something_changes(monkeypatch):
    # That Python took 0.2-0.3 ms of a 0.5-1 ms GRU(512, 512, 2) pack measured right
    # after the previous one: the pack ran at 57-68% of a copy_ of its bytes.
    from fastpar import _dispatch, _tuning
    from fastpar.kernels.ops_numba import flatten as numba_flatten

    monkeypatch.delenv("FASTPAR_BACKEND", raising=False)
    m = make("LSTM", 2, True, True, PROJ, input_size=7, hidden_size=9)
    ws = list(m._flat_weights)
    same, cast = RNNLayout.for_module(m), RNNLayout.for_module(m, dtype=torch.bfloat16)
    outs = {same: torch.empty(same.numel), cast: torch.empty(cast.numel, dtype=torch.bfloat16)}
    asked = []

    def spy(module, name):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **kw: asked.append(name) or real(*a, **kw))

    spy(rnn, "_check_out")
    spy(rnn, "_check_shapes")
    spy(_tuning, "params")
    spy(_dispatch, "kernel")
    spy(numba_flatten, "bind_broadcast")
    spy(numba_flatten, "bind_copy")

    def asks(layout, launches, weights=ws):
        out = poison_(outs[layout])
        k = len(asked)
        with fastpar.count_launches() as n:
            assert rnn.pack(weights, layout, out=out) is out
        assert_same_bits(out, expected_pack(weights, layout), f"pack into {layout.dtype}")
        assert dict(n.by_op) == launches
        return len(asked) - k

    raw, casting = {("numba", "broadcast"): 1}, {("numba", "flatten"): 1}
    assert asks(same, raw) > 0
    assert [asks(same, raw) for _ in range(3)] == [0, 0, 0], "nothing changed: the bound pack must stand"
    assert asks(cast, casting) > 0 and asks(cast, casting) == 0  # a casting pack is bound too
    assert asks(same, raw) == 0, "both bound packs are kept"
    # An equal layout that is another object is checked (then bound for itself).
    twin = dataclasses.replace(same)
    outs[twin] = outs[same]
    assert asks(twin, raw) > 0 and asks(twin, raw) == 0
    with fastpar.use_backend("torch"):
        assert asks(same, {}) > 0 and asks(same, {}) > 0  # the torch backend binds nothing
    asks(same, raw)
    assert asks(same, raw) == 0
    with _tuning.forced({("flatten", "numba"): {"chunk": 64}}):
        assert asks(same, raw) > 0 and asks(same, raw) == 0
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert asks(same, raw) > 0 and asks(same, raw) == 0
    finally:
        torch.set_num_threads(threads)
    assert asks(same, raw) > 0 and asks(same, raw) == 0
    # A weight replaced in place (new memory): the plan is checked and built again.
    with torch.no_grad():
        m.weight_hh_l1.data = m.weight_hh_l1.data * 3
    assert asks(same, raw) > 0 and asks(same, raw) == 0
    # The same tensors in another list (the plan cache knows them: bound or not, the
    # values must come out right; asks() checks them).
    asks(same, raw, weights=list(ws))
    # more_outs (replicate's host replicas) are never bound: every call checks them.
    extra = torch.empty(same.numel)
    for _ in range(2):
        k = len(asked)
        rnn._pack(ws, same, poison_(outs[same]), True, [poison_(extra)])
        assert len(asked) > k
        for o in (outs[same], extra):
            assert_same_bits(o, expected_pack(ws, same), "more_outs")


def test_a_pack_without_out_leaves_the_bound_out_pack_alone(monkeypatch):
    """pack(weights, layout) allocates its buffer: nothing is bound for it. Bound, it
    took the layout's slot from the caller's out=, whose next pack missed (every call,
    in a loop that packs both ways) and paid the bind again."""
    m = make("GRU", 2, True, True, input_size=7, hidden_size=9)
    ws = list(m._flat_weights)
    layout = RNNLayout.for_module(m)
    out = torch.empty(layout.numel)
    for _ in range(2):
        rnn.pack(ws, layout, out=out)
    asked = []
    real = rnn._check_out
    monkeypatch.setattr(rnn, "_check_out", lambda *a, **kw: asked.append(a[2]) or real(*a, **kw))
    for _ in range(3):
        fresh = rnn.pack(ws, layout)
        assert_same_bits(fresh, expected_pack(ws, layout), "pack without out=")
        rnn.pack(ws, layout, out=poison_(out))
        assert_same_bits(out, expected_pack(ws, layout), "bound pack")
    assert asked == [], "the out= packs between packs without out= must stay bound"


#: change of a bound out -> what the next pack must do: raise (exception, match), or
#: None: write the new memory.
_OUT_CHANGES = {
    "resize_smaller": (ValueError, "exactly"),
    "resize_larger": (ValueError, "exactly"),
    "set_other_storage": None,
    "data_other_tensor": None,
    "data_other_dtype": (TypeError, "dtype torch.float32"),
    "as_strided_noncontiguous": (ValueError, "contiguous 1-D"),
    "storage_offset": (ValueError, "storage offset 0"),
    "storage_shrunk": (ValueError, "storage"),
    "requires_grad": (RuntimeError, "out requires grad"),
    "negated": (ValueError, "lazily negated"),
    "view_as_2d": (ValueError, "1-D"),
}


@pytest.mark.parametrize("change", BUFFER_CHANGES)
def test_bound_pack_sees_its_out_changed_in_place(change):
    """After packs that bound ``out``, the same object changed in place is checked
    again: refused as a new one would be (writing nothing), or written at its new
    memory (the old memory left alone)."""
    m = make("GRU", 2, True, True, input_size=7, hidden_size=9)
    ws = list(m._flat_weights)
    layout = RNNLayout.for_module(m)
    out = torch.empty(layout.numel)
    for _ in range(3):  # bound, then used bound
        rnn.pack(ws, layout, out=poison_(out))
    assert_same_bits(out, expected_pack(ws, layout), "bound pack")
    old_memory = out.detach().view(-1)  # the memory it was bound to (an alias)
    poison_(old_memory)
    change_in_place(out, change)
    expected = _OUT_CHANGES[change]
    if expected is not None:
        exc, match = expected
        watched = ws + [old_memory] + ([] if change == "storage_shrunk" else [out.detach()])
        before = snapshot(watched)
        with pytest.raises(exc, match=match):
            rnn.pack(ws, layout, out=out)
        assert_unchanged(watched, before, what=change)
    else:
        rnn.pack(ws, layout, out=out)
        assert out.data_ptr() != old_memory.data_ptr()
        assert_same_bits(out, expected_pack(ws, layout), "the new memory")
        assert_unchanged([old_memory], snapshot([poison_(old_memory.clone())]), what="the old memory")


def test_is_flat_false_for_mismatches():
    m = make("GRU", 1)
    rnn.flatten_parameters(m)
    shape = m.weight_ih_l0.shape
    m.weight_ih_l0.data = m.weight_ih_l0.data.view(-1)  # in place, contiguous: only its shape is wrong
    assert not rnn.is_flat(m)
    m.weight_ih_l0.data = m.weight_ih_l0.data.view(shape)
    assert rnn.is_flat(m)
    m.weight_ih_l0.data = m.weight_ih_l0.data.t().contiguous().t()  # right shape, not contiguous
    assert not rnn.is_flat(m)
    m.weight_ih_l0 = torch.nn.Parameter(torch.randn(3, 3))
    assert not rnn.is_flat(m)


# --- ahead of time: the packing kernel for sm_80 / sm_90 -------------------------------


@pytest.mark.parametrize("cc", [80, 90])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_packing_kernel_compiles_for_gpu(cc, dtype):
    """Packing is the multi-tensor copy in its same-dtype, to-flat configuration; an
    RNN layout with sizes in multiples of 8 (as real ones are) takes the vector path."""
    from fastpar.kernels.ops_triton import aot
    from fastpar.kernels.ops_triton._common import align_elems

    m = make("LSTM", 2, True, False, 8, dtype=dtype, input_size=64, hidden_size=32)
    layout = gapped(RNNLayout.for_module(m), pad=8)
    plan = plan_for(list(m._flat_weights), "weights")
    group = rnn._packing_group(plan.groups[0], layout)
    assert group.aligned(align_elems(dtype, dtype)), "the packing group must allow 128-bit vectors"
    ptx = aot.compile_copy(cc, src=dtype, dst=dtype, to_flat=True, aligned=True)
    assert ".entry" in ptx and "ld.global.v4" in ptx and "st.global.v4" in ptx


# --- CUDA: cuDNN's own layout and no repacking warning ---------------------------------


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("mode,cfg", [("LSTM", "3L-bi-proj"), ("LSTM", "2L-uni-nobias-proj"),
                                      ("GRU", "2L-bi-nobias"), ("RNN_TANH", "1L-uni")])
def test_cuda_layout_is_cudnns(mode, cfg, dtype):
    m = make(mode, *config(mode, cfg), dtype=dtype, device="cuda")
    # nn.RNNBase flattened it through torch._cudnn_rnn_flatten_weight on construction.
    ws = m._flat_weights
    layout = RNNLayout.for_module(m)
    assert layout.source == "cudnn"
    assert list(layout.offsets) == [w.storage_offset() for w in ws]
    assert layout.numel * layout.dtype.itemsize == ws[0].untyped_storage().nbytes()
    assert rnn.is_flat(m)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("mode,cfg", [("LSTM", "3L-bi-proj"), ("LSTM", "2L-uni-nobias-proj"),
                                      ("GRU", "2L-bi-nobias"), ("RNN_RELU", "1L-uni")])
def test_cuda_forward_after_packing_does_not_warn(mode, cfg, dtype):
    m = make(mode, *config(mode, cfg), dtype=dtype, device="cuda")
    for w in m._flat_weights:  # scatter the weights, as replicas' are
        w.data = w.data.clone()
    assert not rnn.is_flat(m)
    ref = copy.deepcopy(m)
    torch_buf = copy.deepcopy(m)
    torch_buf.flatten_parameters()  # torch's own packing, for the bits of the gaps
    with fastpar.count_launches() as n:
        buf = rnn.flatten_parameters(m)
    assert n.total == 1 and rnn.is_flat(m)
    # Bit for bit the buffer torch._cudnn_rnn_flatten_weight builds (gaps zero in both).
    theirs = _storage_as(torch_buf._flat_weights[0], buf.numel())
    assert torch.equal(buf.view(torch.uint8), theirs.view(torch.uint8))
    x = torch.randn(SEQ, BATCH, IN, device="cuda", dtype=dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*single contiguous chunk")
        out = m(x)[0]
    assert torch.equal(out, torch_buf(x)[0])
    with pytest.warns(UserWarning, match="single contiguous chunk"):
        ref(x)  # the scattered copy: cuDNN repacks and warns


def _storage_as(w, numel):
    return torch.empty(0, dtype=w.dtype, device=w.device).set_(w.untyped_storage(), 0, (numel,))


@cuda
def test_cuda_pack_one_launch_matches_reference():
    m = make("LSTM", 2, True, False, PROJ, device="cuda", input_size=33, hidden_size=40)
    layout = RNNLayout.for_module(m)
    ws = [w.detach().clone() for w in m._flat_weights]
    with fastpar.count_launches() as n:
        gpu = rnn.pack(ws, layout)
    assert n.total == 1
    assert_same_bits(gpu, expected_pack(ws, layout), "CUDA pack")


@cuda
def test_cuda_replaced_zero_source_is_kept_alive():
    # A layout with a larger gap than any before replaces the zero buffer the gaps copy
    # from. A pack on another stream may still be reading the old one, which the caching
    # allocator would otherwise hand out again once the cached groups holding it go.
    m = make("GRU", 1, False, False, device="cuda", input_size=7, hidden_size=9)
    ws = [w.detach() for w in m._flat_weights]
    small = gapped(RNNLayout.for_module(m), pad=8)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        first = rnn.pack(ws, small)
    old = rnn._ZEROS[(small.device, torch.float32)]
    large = gapped(RNNLayout.for_module(m), pad=old.numel() + 100)  # a gap the old one can't serve
    second = rnn.pack(ws, large)
    new = rnn._ZEROS[(large.device, torch.float32)]
    assert new is not old and new.numel() > old.numel(), (old.numel(), new.numel())
    assert any(z is old for z in rnn._RETIRED_ZEROS), "the replaced zero buffer was let go"
    side.synchronize()
    assert_same_bits(first, expected_pack(ws, small), "pack on a side stream")
    assert_same_bits(second, expected_pack(ws, large), "pack after the replacement")


# --- found by mutation testing: layout checks, is_flat, flatten_parameters


def test_layout_refuses_a_one_element_overlap():
    layout = RNNLayout.for_config("GRU", 3, 4)
    offs = list(layout.offsets)
    offs[1:] = [o - 1 for o in offs[1:]]  # weight_hh_l0 starts on weight_ih_l0's last element
    with pytest.raises(ValueError, match="weight_ih_l0 and weight_hh_l0 overlap"):
        dataclasses.replace(layout, offsets=tuple(offs))


def test_layout_refuses_a_negative_offset():
    layout = RNNLayout.for_config("GRU", 3, 4)
    with pytest.raises(ValueError, match=r"weight_ih_l0 at \[-1, 35\) lies outside"):
        dataclasses.replace(layout, offsets=(-1, *layout.offsets[1:]))


def test_is_flat_false_for_a_non_contiguous_weight_at_its_offset():
    m = make("RNN_TANH", 1)  # weight_hh_l0 is square: a transposed view has its shape
    rnn.flatten_parameters(m)
    w = m.weight_hh_l0
    with torch.no_grad():  # same storage, same data pointer, same shape, transposed strides
        w.set_(w.untyped_storage(), w.storage_offset(), w.shape, (1, w.shape[0]))
    assert not w.is_contiguous()
    assert not rnn.is_flat(m), "cuDNN would read this weight as a dense matrix: transposed"
    expected = w.detach().clone()
    buf = rnn.flatten_parameters(m)
    assert rnn.is_flat(m) and m.weight_hh_l0.is_contiguous()
    assert torch.equal(RNNLayout.for_module(m).views(buf)[1], expected)


def test_flatten_parameters_keeps_the_values_of_a_lazily_negated_weight():
    # z.conj().imag is a real tensor with the neg bit: its memory holds -values. The pack
    # resolves it, and set_ kept the bit, so the weight read negated after the call.
    m = make("GRU", 1)
    z = torch.randn(m.weight_hh_l0.shape, dtype=torch.complex64)
    m.weight_hh_l0 = torch.nn.Parameter(z.conj().imag)
    assert m.weight_hh_l0.is_neg()
    ref = copy.deepcopy(m)
    x = torch.randn(SEQ, BATCH, IN)
    rnn.flatten_parameters(m)
    assert rnn.is_flat(m) and not m.weight_hh_l0.is_neg()
    assert torch.equal(m.weight_hh_l0, ref.weight_hh_l0)
    torch.testing.assert_close(m(x)[0], ref(x)[0], rtol=0, atol=0)
    # In place at its offset, but negated: cuDNN would read the bits, so not flat.
    with torch.no_grad():
        torch._C._set_neg(m.weight_hh_l0, True)
    expected = m.weight_hh_l0.detach().clone()
    assert not rnn.is_flat(m)
    buf = rnn.flatten_parameters(m)
    assert rnn.is_flat(m) and torch.equal(m.weight_hh_l0, expected)
    assert torch.equal(RNNLayout.for_module(m).views(buf)[1], expected)


class _Scale(torch.nn.Module):
    def forward(self, w):
        return 2 * w


def test_is_flat_is_false_not_an_error_for_a_parametrized_weight():
    m = make("GRU", 1)
    rnn.flatten_parameters(m)
    torch.nn.utils.parametrize.register_parametrization(m, "weight_hh_l0", _Scale())
    assert rnn.is_flat(m) is False  # documented: raises only for a non-RNNBase


def test_gaps_larger_than_any_before_are_zero_filled(monkeypatch):
    monkeypatch.setattr(rnn, "_ZEROS", {})  # start from no zero source, whatever ran before
    m = make("GRU", 1, input_size=7, hidden_size=9, dtype=torch.float64)
    dense = RNNLayout.for_module(m)
    for pad in (3, 5000):  # the zero source was made for small gaps first; then a large one
        layout = gapped(dense, pad=pad)
        out = rnn.pack(list(m._flat_weights), layout, out=poisoned(layout.numel, dtype=torch.float64))
        assert torch.equal(out, expected_pack(m._flat_weights, layout)), f"pad={pad}"


def test_layout_for_module_refuses_reordered_weight_names():
    m = make("GRU", 1)
    names = list(m._flat_weights_names)
    names[2], names[3] = names[3], names[2]  # bias_hh_l0 before bias_ih_l0: same shapes
    m._flat_weights_names = names
    with pytest.raises(ValueError, match="differ from nn.RNNBase's"):
        RNNLayout.for_module(m)


def test_layout_refuses_proj_size_equal_to_hidden_size():
    with pytest.raises(ValueError):  # as torch.nn.LSTM does
        torch.nn.LSTM(3, 4, proj_size=4)
    with pytest.raises(ValueError, match="proj_size must be 0, or in"):
        RNNLayout.for_config("LSTM", 3, 4, proj_size=4)


def test_pack_refuses_a_conversion_the_kernels_do_not_support():
    m = make("GRU", 1)
    layout = RNNLayout.for_module(m, dtype=torch.complex64)
    with pytest.raises(TypeError, match="pack: cannot convert torch.float32 to torch.complex64"):
        rnn.pack(list(m._flat_weights), layout)


def test_flatten_parameters_refreshes_a_stale_flat_weights_list():
    m = make("GRU", 1)
    ref = copy.deepcopy(m)
    new = torch.nn.Parameter(torch.randn_like(m.weight_hh_l0))
    m._parameters["weight_hh_l0"] = new  # bypasses RNNBase.__setattr__: _flat_weights is stale
    ref.weight_hh_l0 = torch.nn.Parameter(new.detach().clone())
    rnn.flatten_parameters(m)
    assert m._flat_weights[1] is new
    x = torch.randn(4, 2, 5)
    torch.testing.assert_close(m(x)[0], ref(x)[0], rtol=0, atol=0)


def test_views_with_one_element_gaps():
    layout = gapped(RNNLayout.for_config("GRU", 3, 4, bidirectional=True), pad=1)
    buf = torch.arange(layout.numel, dtype=torch.float32)
    for v, s, o in zip(layout.views(buf), layout.shapes, layout.offsets):
        assert tuple(v.shape) == s and v.data_ptr() == buf.data_ptr() + 4 * o


def test_layout_for_module_with_only_the_device_given_still_checks_dtypes():
    m = make("GRU", 1)
    m.bias_hh_l0.data = m.bias_hh_l0.data.double()  # "the dtype of the module's weights" is not one dtype
    with pytest.raises(TypeError, match="must all have one dtype"):
        RNNLayout.for_module(m, device="cpu")
    assert RNNLayout.for_module(m, device="cpu", dtype=torch.float32).dtype == torch.float32  # both given: no question


def test_layout_takes_lists_as_tuples():
    """A layout given lists (``dataclasses.replace(layout, offsets=[...])``) equals the one
    given tuples and packs: it is a dict key, and its shapes are compared with Size."""
    m = make("GRU", 1)
    layout = RNNLayout.for_module(m)
    listed = dataclasses.replace(layout, names=list(layout.names), offsets=list(layout.offsets),
                                 shapes=[list(s) for s in layout.shapes])
    assert listed == layout and hash(listed) == hash(layout)
    out = rnn.pack(list(m._flat_weights), listed, out=poisoned(layout.numel))
    assert_same_bits(out, expected_pack(m._flat_weights, layout), "a layout given lists")


def test_layout_of_a_module_built_with_numpy_ints():
    """nn.RNNBase type-checks only input_size and hidden_size: a module built with
    ``num_layers=np.int64(2)`` (or a numpy proj_size) runs in torch, and its layout is
    the one of the same module built with Python ints (the sizes were refused as "not
    an int >= 1")."""
    np = pytest.importorskip("numpy")
    for kind, kw in ((torch.nn.GRU, {"num_layers": np.int64(2)}), (torch.nn.LSTM, {"proj_size": np.int32(3)})):
        torch.manual_seed(0)
        m = kind(IN, HID, **kw)
        plain = RNNLayout.for_module(kind(IN, HID, **{k: int(v) for k, v in kw.items()}))
        layout = RNNLayout.for_module(m)
        assert layout == plain and all(type(getattr(layout, k)) is int for k in kw)
        ref = copy.deepcopy(m)
        x = torch.randn(SEQ, BATCH, IN)
        rnn.flatten_parameters(m)
        assert rnn.is_flat(m)
        torch.testing.assert_close(m(x)[0], ref(x)[0], rtol=0, atol=0)
        replica = fastpar.replicate(ref, ["cpu", "cpu"])[1]  # (replicate and DataParallel refused it too)
        torch.testing.assert_close(replica(x)[0], ref(x)[0], rtol=0, atol=0)
    with pytest.raises(TypeError, match="num_layers must be an int >= 1, got float 2.0"):
        RNNLayout.for_config("GRU", 3, 4, 2.0)
    with pytest.raises(ValueError, match="num_layers must be an int >= 1, got 0"):
        RNNLayout.for_config("GRU", 3, 4, np.int64(0))


def test_layout_constructor_checks_mode_dtype_and_device():
    """The public constructor checks what for_config checks: a string device is made a
    torch.device (pack said "weights must be on cpu (the layout's device), got cpu"), a
    string dtype and an unknown mode are refused up front."""
    m = make("GRU", 1)
    layout = RNNLayout.for_module(m)
    as_str = dataclasses.replace(layout, device="cpu")
    assert as_str.device == torch.device("cpu") and as_str == layout
    out = rnn.pack(list(m._flat_weights), as_str, out=poisoned(layout.numel))
    assert_same_bits(out, expected_pack(m._flat_weights, layout), "a layout given device='cpu'")
    with pytest.raises(TypeError, match="dtype must be a torch.dtype, got str 'float32'"):
        dataclasses.replace(layout, dtype="float32")
    with pytest.raises(ValueError, match="mode must be one of LSTM, GRU, RNN_TANH, RNN_RELU; got 'XXX'"):
        dataclasses.replace(layout, mode="XXX")


# ---------------------------------------------------------------------------------------
# Properties (hypothesis): random configurations, dtypes, weight layouts and sharing,
# packed on every CPU backend against expected_pack, bit for bit; flatten_parameters on
# the same modules (views of the buffer, or refused for tied weights).

from hypothesis import strategies as st  # noqa: E402

from conftest import LAYOUTS, backend_properties, rand  # noqa: E402


@st.composite
def rnn_cases(draw, backend):
    """A configuration (any mode, sizes 1..7, 1..3 layers, bias, direction, projection),
    source and buffer dtypes, a layout per weight, tied slots, and a gap pad."""
    mode = draw(st.sampled_from(MODES), "mode")
    hidden = draw(st.integers(1, 7), "hidden_size")
    proj = draw(st.integers(0, hidden - 1), "proj_size") if mode == "LSTM" else 0
    cfg = dict(mode=mode, input_size=draw(st.integers(1, 7), "input_size"), hidden_size=hidden,
               num_layers=draw(st.integers(1, 3), "num_layers"), bidirectional=draw(st.booleans(), "bidirectional"),
               bias=draw(st.booleans(), "bias"), proj_size=proj)
    src = draw(st.sampled_from(DTYPES), "src dtype")
    dst = draw(st.one_of(st.just(src), st.sampled_from(DTYPES)), "buffer dtype")
    shapes = RNNLayout.for_config(**cfg).shapes
    layouts = draw(st.lists(st.sampled_from(LAYOUTS), min_size=len(shapes), max_size=len(shapes)), "layouts")
    # Tied slots: a later weight is an earlier one of the same shape (the same tensor).
    ties = {}
    for j in range(len(shapes)):
        same = [i for i in range(j) if shapes[i] == shapes[j] and i not in ties]
        if same and draw(st.integers(0, 5), f"tie {j}?") == 0:
            ties[j] = draw(st.sampled_from(same), f"tie {j} to")
    return dict(cfg=cfg, src=src, dst=dst, layouts=layouts, ties=ties,
                one_storage=draw(st.booleans(), "one storage"), pad=draw(st.integers(0, 3), "pad"),
                specials=draw(st.booleans(), "specials"), seed=draw(st.integers(0, 2**32 - 1), "seed"),
                flush_bf16=backend == "triton")


def laid_out(values, how, gen):
    """A tensor of ``values``' values (``expanded``: its first row repeated) laid out as
    ``how`` says."""
    shape, dtype = values.shape, values.dtype
    if how == "transposed" and values.dim() == 2:
        return values.t().contiguous().t()
    if how == "stepped":
        base = poisoned((shape[0] * 2, *shape[1:]), dtype=dtype)
        base[::2] = values
        return base[::2]
    if how == "offset":
        skip = int(torch.randint(1, 5, (), generator=gen))
        base = poisoned(values.numel() + skip, dtype=dtype)
        base[skip:] = values.reshape(-1)
        return base[skip:].view(shape)
    if how == "expanded":
        return values[:1].expand(shape)
    if how == "negative":
        return torch._neg_view(values.neg())
    return values


def rnn_weights(case):
    """The case's weights, in ``_flat_weights_names`` order: fresh values from its seed
    (with SPECIALS among the first one's, on request), each laid out as drawn; tied slots
    the same tensor; with ``one_storage``, the contiguous ones carved out of one tensor
    in reverse order (a module packed for another layout)."""
    gen = torch.Generator().manual_seed(case["seed"])
    src = case["src"]
    shapes = RNNLayout.for_config(**case["cfg"]).shapes
    values = [rand(s, src, gen=gen) for s in shapes]
    if case["specials"]:
        k = min(len(SPECIALS), values[0].numel())
        values[0].view(-1)[:k] = torch.tensor(SPECIALS[:k], dtype=torch.float64).to(src)
    if case["flush_bf16"] and src == torch.bfloat16:
        values = [bf16_subnormals_zeroed(v) for v in values]
    ws = [laid_out(v, how, gen) for v, how in zip(values, case["layouts"])]
    if case["one_storage"]:
        plain = [i for i, how in enumerate(case["layouts"]) if how == "contiguous"][::-1]
        base = poisoned(sum(ws[i].numel() for i in plain), dtype=src)
        at = 0
        for i in plain:
            base[at : at + ws[i].numel()] = ws[i].reshape(-1)
            ws[i] = base[at : at + ws[i].numel()].view(ws[i].shape)
            at += ws[i].numel()
    for j, i in case["ties"].items():
        ws[j] = ws[i]
    return ws


def check_pack_property(case, backend):
    """pack of any weights into a poisoned buffer (dense or gapped layout, any dtype
    pair) equals expected_pack bit for bit, in one launch (none on torch); allocating
    too; the weights are not written; and the layout's views of the buffer give each
    weight back, converted."""
    ws = rnn_weights(case)
    cfg = case["cfg"]
    dense = RNNLayout.for_config(**cfg, dtype=case["dst"])
    # The layout itself, against torch's module of the configuration (on meta: no memory):
    # its weights in _flat_weights_names order, back to back.
    tm = torch.nn.RNNBase(cfg["mode"], cfg["input_size"], cfg["hidden_size"], cfg["num_layers"], bias=cfg["bias"],
                          bidirectional=cfg["bidirectional"], proj_size=cfg["proj_size"], device="meta")
    numels = [w.numel() for w in tm._flat_weights]
    assert dense.names == tuple(tm._flat_weights_names) and dense.source == "dense"
    assert dense.shapes == tuple(tuple(w.shape) for w in tm._flat_weights)
    assert dense.offsets == tuple(sum(numels[:i]) for i in range(len(numels))) and dense.numel == sum(numels)
    layout = gapped(dense, case["pad"])
    expected = expected_pack([w.resolve_neg() for w in ws], layout)
    before = snapshot(ws)
    what = f"{case['cfg']} {case['src']} -> {case['dst']}, layouts {case['layouts']}, ties {case['ties']}"
    out = poisoned(layout.numel, dtype=case["dst"])
    with fastpar.count_launches() as n:
        assert rnn.pack(ws, layout, out=out) is out
    assert n.total == (0 if backend == "torch" else 1), f"{backend}: {n.by_op}"
    assert_same_bits(out, expected, f"{what}, into out")
    assert_same_bits(rnn.pack(ws, layout), expected, f"{what}, allocating")
    assert_unchanged(ws, before, what=f"{what}: a weight")
    for name, w, v, off in zip(layout.names, ws, layout.views(out), layout.offsets):
        assert v.data_ptr() == out.data_ptr() + off * out.element_size(), f"{what}: view of {name}"
        assert_same_bits(v, w.resolve_neg().to(torch.float64).to(case["dst"]), f"{what}: view of {name}")


def check_flatten_property(case, backend):
    """flatten_parameters of a module holding those weights (as Parameters' data):
    refused, rebinding nothing, where two slots are tied; otherwise one launch (none on
    torch) packs expected_pack's buffer, every Parameter (the same objects) becomes a
    view of it at its layout offset, a second call packs nothing, and the forward is
    that of the module with its weights placed there by plain torch, bit for bit."""
    cfg = case["cfg"]
    ws = rnn_weights({**case, "layouts": [h if h != "negative" else "contiguous" for h in case["layouts"]]})
    m = make(cfg["mode"], cfg["num_layers"], cfg["bidirectional"], cfg["bias"], cfg["proj_size"],
             dtype=case["src"], input_size=cfg["input_size"], hidden_size=cfg["hidden_size"])
    names = list(m._flat_weights_names)
    for j, (name, w) in enumerate(zip(names, ws)):
        if j in case["ties"]:
            setattr(m, name, getattr(m, names[case["ties"][j]]))
        else:
            getattr(m, name).data = w
    if case["ties"]:
        j, i = next(iter(case["ties"].items()))
        _assert_rejected(m, ValueError, f"module.{names[j]} aliases module.{names[i]}")
        return
    # The reference: the module with its weights placed in expected_pack's buffer by
    # plain torch (where a weight sits changes the CPU BLAS's rounding: a module with
    # separately allocated weights may differ in the last bit).
    ref = copy.deepcopy(m)
    ref_layout = RNNLayout.for_module(ref)
    placed = expected_pack(ws, ref_layout)
    with torch.no_grad():
        for w, off, shape in zip(ref._flat_weights, ref_layout.offsets, ref_layout.shapes):
            w.set_(placed.untyped_storage(), off, shape, torch.empty(shape, device="meta").stride())
    params = list(m.parameters())
    with fastpar.count_launches() as n:
        buf = rnn.flatten_parameters(m)
    assert n.total == (0 if backend == "torch" else 1), f"{backend}: {n.by_op}"
    layout = RNNLayout.for_module(m)
    assert buf.dtype == case["src"] and buf.storage_offset() == 0 and buf.numel() == layout.numel
    assert_same_bits(buf, expected_pack(ws, layout), f"{cfg} {case['src']}: flatten_parameters' buffer")
    assert rnn.is_flat(m)
    assert_views_of(m, buf, layout)
    assert all(a is b for a, b in zip(m.parameters(), params)), "Parameter objects must be kept"
    assert all(w is getattr(m, n) for w, n in zip(m._flat_weights, names))
    with fastpar.count_launches() as n:
        again = rnn.flatten_parameters(m)
    assert n.total == 0 and again.data_ptr() == buf.data_ptr(), "a flat module is left as it is"
    gen = torch.Generator().manual_seed(case["seed"] ^ 1)
    x = torch.randn(3, 2, cfg["input_size"], generator=gen).to(case["src"])
    for i, (a, b) in enumerate(zip(run(m, x, 1), run(ref, x, 1))):
        assert_same_bits(a, b, f"{cfg} {case['src']}: result {i} vs the torch-placed module's", nan_payloads=True)


def check_rnn_case(data, backend):
    case = data.draw(rnn_cases(backend), "case")
    check_pack_property(case, backend)
    if case["dst"] == case["src"]:
        check_flatten_property(case, backend)


_overflow_ok = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # on inf
test_pack_and_flatten_properties, test_pack_and_flatten_properties_triton_interpreter = map(
    _overflow_ok, backend_properties(check_rnn_case, triton_examples=5))


def test_is_flat_does_not_evaluate_a_parametrized_weight():
    """A query: it must not run the parametrization (spectral_norm's, in training mode,
    updates its power-iteration buffers in place on every evaluation)."""
    m = make("GRU", 1)
    torch.nn.utils.parametrizations.spectral_norm(m, "weight_ih_l0")
    sn = m.parametrizations.weight_ih_l0[0]
    before = [t.clone() for t in sn.buffers()]
    assert rnn.is_flat(m) is False
    for a, (name, b) in zip(before, sn.named_buffers()):
        assert torch.equal(a, b), f"is_flat ran the parametrization: {name} changed"


def test_pack_and_flatten_parameters_inside_torch_compile_cost_one_graph_break_each():
    # As in test_flatten: dynamo traced on into the layout checks and the plan. Each
    # call runs eagerly whole now, one graph break, results as eager.
    m = torch.nn.LSTM(5, 4, num_layers=2, bidirectional=True)
    layout = RNNLayout.for_module(m)
    weights = [w.detach().clone() for w in m._flat_weights]
    expected = rnn.pack(weights, layout)

    def step(weights):
        return rnn.pack([w * 1 for w in weights], layout)

    packed, breaks, graphs, warned = compiled_run(step, weights)
    assert_same_bits(packed, expected, "pack under torch.compile")
    assert_one_break_per_op(breaks, graphs, warned, ["pack"])

    def step(m):
        return rnn.flatten_parameters(m) * 1

    # dynamo declines a frame that takes an RNN module unless allow_rnn is set (it runs
    # it eagerly and compiles the frames it calls one by one: see the README's Limits).
    # Each call rebinds m's weights to views of its new buffer: dynamo's guards on them
    # fail, and the second call compiles again.
    import torch._dynamo as dynamo

    with dynamo.config.patch(allow_rnn=True):
        buf, breaks, graphs, warned = compiled_run(step, m, reuse=False)
    assert_same_bits(buf, expected, "flatten_parameters under torch.compile")
    assert rnn.is_flat(m)
    assert_one_break_per_op(breaks, graphs, warned, ["flatten_parameters"])


def test_pack_and_flatten_parameters_run_eagerly_while_a_torch_tracer_sets_is_compiling(monkeypatch):
    # With torch.compiler.is_compiling() true and dynamo not tracing
    # (torch.export(strict=False)), each called its eager entry, which called it again,
    # until a RecursionError. They run as eager now.
    m = torch.nn.LSTM(5, 4, num_layers=2, bidirectional=True)
    layout = RNNLayout.for_module(m)
    weights = [w.detach().clone() for w in m._flat_weights]
    expected = rnn.pack(weights, layout)
    compiling_flag_on(monkeypatch)
    assert_same_bits(rnn.pack(weights, layout), expected, "pack")
    assert_same_bits(rnn.flatten_parameters(m), expected, "flatten_parameters")
    assert rnn.is_flat(m)
