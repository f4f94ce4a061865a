"""``fastpar.parallel_apply``: torch's argument rules, with CPU replicas."""
from __future__ import annotations

import contextvars
import time

import pytest
import torch
from conftest import assert_close, assert_one_break_per_op, compiled_run, compiling_flag_on
from torch import nn

from fastpar.parallel_apply import parallel_apply


def test_none_devices_take_the_inputs_device():
    mods = [nn.Linear(2, 2).double(), nn.Linear(2, 2).double()]
    xs = [torch.randn(3, 2, dtype=torch.float64) for _ in mods]
    for devices in (None, [None, None], [None, "cpu"], iter(["cpu", None])):
        outs = parallel_apply(mods, [(x,) for x in xs], None, devices)
        for m, x, o in zip(mods, xs, outs):
            torch.testing.assert_close(o, m(x), rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, the current CUDA device (as torch)")
def test_none_device_without_a_tensor_input_is_an_error_without_cuda():
    calls = []

    class Rec(nn.Module):
        def forward(self, **kw):
            calls.append(kw)
            return kw["x"]

    x = torch.randn(2)
    with pytest.raises(ValueError, match=r"devices\[1\] is None and inputs\[1\] holds no tensor"):
        parallel_apply([Rec(), Rec()], [(), ()], [{"x": x}, {"x": x}], ["cpu", None])
    assert calls == [], "no replica may run when one cannot be placed"
    outs = parallel_apply([Rec(), Rec()], [(), ()], [{"x": x}, {"x": x}], ["cpu", "cpu"])
    assert all(o is x for o in outs)


def test_length_mismatches_name_the_argument():
    mods = [nn.Identity(), nn.Identity()]
    x = torch.randn(2)
    with pytest.raises(ValueError, match="modules and inputs must have the same length, got 2 and 1"):
        parallel_apply(mods, [(x,)])
    with pytest.raises(ValueError, match=r"kwargs_tup must have one entry per module \(2\), got 1"):
        parallel_apply(mods, [(x,), (x,)], [{}])
    with pytest.raises(ValueError, match=r"devices must have one entry per module \(2\), got 3"):
        parallel_apply(mods, [(x,), (x,)], None, ["cpu"] * 3)


def test_kwargs_tup_that_is_not_one_dict_per_module_is_named():
    """One module's keywords passed as kwargs_tup (a dict) raised a bare KeyError: 0 with
    one module (as torch's does) and a TypeError from each replica with more; a None
    entry failed in the replica."""
    calls = []

    class Rec(nn.Module):
        def forward(self, x):
            calls.append(x)
            return x

    x = torch.randn(2)
    with pytest.raises(TypeError, match=r"kwargs_tup must be a sequence of dicts, one per module, got a dict "
                                        r"\(keys \['x'\]\)"):
        parallel_apply([Rec()], [()], {"x": x}, ["cpu"])
    with pytest.raises(TypeError, match=r"kwargs_tup must be a sequence of dicts, one per module, got a dict"):
        parallel_apply([Rec(), Rec()], [(), ()], {"x": x, "y": 1}, ["cpu", "cpu"])
    with pytest.raises(TypeError, match=r"kwargs_tup\[1\] must be a dict of keyword arguments, got NoneType"):
        parallel_apply([Rec(), Rec()], [(), ()], ({"x": x}, None), ["cpu", "cpu"])
    assert calls == [], "no replica may run"
    import types
    outs = parallel_apply([Rec(), Rec()], [(), ()], [{"x": x}, types.MappingProxyType({"x": x})], ["cpu", "cpu"])
    assert all(o is x for o in outs)


def test_top_level_names_are_torch_nn_parallel_s():
    import fastpar
    from fastpar import scatter_gather

    # As in torch.nn.parallel: the functions, under the same names, at the top level.
    assert fastpar.parallel_apply is parallel_apply
    assert fastpar.scatter is scatter_gather.scatter and fastpar.gather is scatter_gather.gather
    assert {"parallel_apply", "scatter", "gather", "replicate", "data_parallel", "DataParallel"} <= set(fastpar.__all__)


@pytest.mark.parametrize("exc", [ValueError, SystemExit, KeyboardInterrupt])
def test_replica_exception_is_reraised_naming_the_replica(exc):
    # SystemExit and KeyboardInterrupt too: caught as Exception only, they ended the
    # replica's thread (quietly, for SystemExit) and the caller met a bare KeyError: 1
    # for the missing result.
    finished = []

    class Slow(nn.Module):
        def forward(self, x):
            time.sleep(0.2)
            finished.append(True)
            return x

    class Fails(nn.Module):
        def forward(self, x):
            raise exc("replica failed on purpose")

    x = torch.randn(2)
    with pytest.raises(exc, match=r"(?s)in replica 1 on device cpu.*replica failed on purpose"):
        parallel_apply([Slow(), Fails()], [(x,), (x,)], None, ["cpu", "cpu"])
    assert finished == [True], "the other replica's thread must have finished"
    if not issubclass(exc, Exception):
        # One replica runs in the caller's thread: the exception reaches it as it is.
        with pytest.raises(exc, match=r"^replica failed on purpose$"):
            parallel_apply([Fails()], [(x,)], None, ["cpu"])


def test_grad_mode_is_carried_into_the_replicas():
    mods = [nn.Linear(2, 2), nn.Linear(2, 2)]
    xs = [(torch.randn(3, 2),) for _ in mods]
    with torch.no_grad():
        outs = parallel_apply(mods, xs, None, ["cpu", "cpu"])
    assert not any(o.requires_grad for o in outs)
    outs = parallel_apply(mods, xs, None, ["cpu", "cpu"])
    assert all(o.requires_grad for o in outs)


def test_inference_mode_is_carried_into_the_replicas():
    mods = [nn.Linear(2, 2), nn.Linear(2, 2)]
    xs = [(torch.randn(3, 2),) for _ in mods]
    with torch.inference_mode():
        outs = parallel_apply(mods, xs, None, ["cpu", "cpu"])
    assert all(o.is_inference() for o in outs)
    outs = parallel_apply(mods, xs, None, ["cpu", "cpu"])
    assert not any(o.is_inference() for o in outs) and all(o.requires_grad for o in outs)


def test_enable_grad_inside_inference_mode_is_carried_into_the_replicas():
    """Entering inference mode turns grad mode off; the caller's enable_grad() inside it
    must still hold in the replicas (modules that branch on is_grad_enabled() see it)."""
    class GradMode(nn.Module):
        def forward(self, x):
            return torch.tensor([float(torch.is_grad_enabled()), float(torch.is_inference_mode_enabled())])

    xs = [(torch.randn(1),), (torch.randn(1),)]
    for outer in (torch.inference_mode, torch.no_grad):
        with outer(), torch.enable_grad():
            want = GradMode()(*xs[0]).tolist()
            got = [o.tolist() for o in parallel_apply([GradMode(), GradMode()], xs, None, ["cpu", "cpu"])]
        assert got == [want, want], (outer.__name__, got, want)
    with torch.inference_mode():
        want = GradMode()(*xs[0]).tolist()
        got = [o.tolist() for o in parallel_apply([GradMode(), GradMode()], xs, None, ["cpu", "cpu"])]
    assert got == [want, want] == [[0.0, 1.0]] * 2, got


def test_autocast_is_carried_into_the_replicas():
    mods = [nn.Linear(4, 4), nn.Linear(4, 4)]
    xs = [(torch.randn(3, 4),) for _ in mods]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = parallel_apply(mods, xs, None, ["cpu", "cpu"])
        ref = [m(*x) for m, x in zip(mods, xs)]
    assert [o.dtype for o in outs] == [r.dtype for r in ref] == [torch.bfloat16] * 2
    for o, r in zip(outs, ref):
        assert torch.equal(o, r)


_var = contextvars.ContextVar("fastpar_test_var", default="unset")


def test_context_variables_are_carried_into_the_replicas():
    class Read(nn.Module):
        def forward(self, x):
            return _var.get()

    token = _var.set("caller")
    try:
        outs = parallel_apply([Read(), Read()], [(torch.ones(1),)] * 2, None, ["cpu", "cpu"])
    finally:
        _var.reset(token)
    assert outs == ["caller", "caller"]


def test_none_device_resolved_to_an_unsupported_device_is_named_in_the_caller():
    """A None entry takes its input's device; one that is neither CUDA nor the CPU (a
    meta tensor) is refused by name, as an explicit entry is. It used to pass
    unchecked, the worker thread died outside its try block (its traceback printed)
    and the caller got a bare KeyError(0)."""
    import threading

    died = []
    hook, threading.excepthook = threading.excepthook, lambda args: died.append(args.exc_type)
    try:
        x = torch.randn(2, device="meta")
        with pytest.raises(ValueError, match=r"devices\[0\] .*must be a CUDA device or 'cpu', got meta"):
            parallel_apply([nn.Identity(), nn.Identity()], [(x,), (x,)])
    finally:
        threading.excepthook = hook
    assert died == [], f"a replica thread died: {died}"


class _KeyErrorModule(nn.Module):
    def forward(self, *args):
        return {}["wonderful"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_none_device_without_a_tensor_input_is_the_current_cuda_device_as_in_torch():
    """torch resolves a None entry with ``_get_device_index(None, True)``: the current
    CUDA device (its worker's search of the input for a tensor is never reached with
    CUDA). torch's own test_parallel_apply_passes_exception passes inputs=(None, None)
    and no devices; fastpar raised ValueError('cannot be resolved') instead."""
    seen = []

    class Where(nn.Module):
        def forward(self, *args, **kw):
            seen.append(torch.cuda.current_device())
            return kw.get("x")

    x = torch.randn(2)
    outs = parallel_apply([Where(), Where()], [(), ()], [{"x": x}, {"x": x}])
    assert all(o is x for o in outs) and seen == [torch.cuda.current_device()] * 2
    with pytest.raises(KeyError, match=r"Caught KeyError in replica \d on device \d+\.\n[\s\S]+wonderful"):
        parallel_apply(modules=(_KeyErrorModule(), _KeyErrorModule()), inputs=(None, None))


def test_replica_failure_names_a_cuda_device_by_index_as_torch():
    """torch's worker writes 'in replica {i} on device {index}' (its own
    test_parallel_apply_passes_exception matches 'on device 0.'); fastpar wrote
    'on device cuda:0'. Host replicas keep 'on device cpu' (run below)."""
    from fastpar.parallel_apply import _where

    assert _where(1, torch.device("cuda", 0)) == "in replica 1 on device 0"
    assert _where(0, torch.device("cuda", 3)) == "in replica 0 on device 3"
    with pytest.raises(KeyError, match=r"Caught KeyError in replica 1 on device cpu\.\n[\s\S]+wonderful"):
        parallel_apply([nn.Identity(), _KeyErrorModule()], [(torch.ones(1),)] * 2, None, ["cpu", "cpu"])


def test_parallel_apply_inside_torch_compile_is_one_graph_break():
    # Traced, dynamo warned at the thread machinery (_thread.allocate_lock, get_ident,
    # contextvars.copy_context) and built nothing from it; the threads run eagerly now.
    torch.manual_seed(0)
    mods = [nn.Linear(3, 2), nn.Linear(3, 2)]
    xs = [torch.randn(4, 3), torch.randn(5, 3)]

    def step(xs):
        return parallel_apply(mods, [(x * 1,) for x in xs], None, ["cpu", "cpu"])

    outs, breaks, graphs, warned = compiled_run(step, xs)
    for i, (o, m, x) in enumerate(zip(outs, mods, xs)):
        ref = torch.nn.functional.linear(x.double(), m.weight.double(), m.bias.double())  # float64
        assert_close(o, ref, what=f"replica {i}")
    assert_one_break_per_op(breaks, graphs, warned, ["parallel_apply"])



def test_parallel_apply_runs_eagerly_while_a_torch_tracer_sets_is_compiling(monkeypatch):
    # With torch.compiler.is_compiling() true and dynamo not tracing
    # (torch.export(strict=False)), parallel_apply called its eager entry, which called
    # it again, until a RecursionError. It runs as eager now.
    torch.manual_seed(0)
    mods = [nn.Linear(3, 2), nn.Linear(3, 2)]
    xs = [torch.randn(4, 3), torch.randn(5, 3)]
    compiling_flag_on(monkeypatch)
    outs = parallel_apply(mods, [(x,) for x in xs], None, ["cpu", "cpu"])
    for i, (o, m, x) in enumerate(zip(outs, mods, xs)):
        ref = torch.nn.functional.linear(x.double(), m.weight.double(), m.bias.double())  # float64
        assert_close(o, ref, what=f"replica {i}")
