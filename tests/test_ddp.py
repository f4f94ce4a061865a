"""fastpar.ddp: DDP communication hooks and sync_params.

Two kinds of tests:

* in this process, on a one-rank gloo group: argument checks, registration errors, the
  hooks' exact values at world size 1 (the compress hooks then round each gradient once),
  and the bucket cache;
* on two real processes talking gloo over loopback (spawned, bounded by a timeout, always
  killed): a small model trained 5 steps with DDP and each fastpar hook against DDP and
  torch's corresponding hook, bucket edge cases, ``gradient_as_bucket_view=True``,
  ``sync_params``, and a rank that raises mid-step. Each process pair runs a whole group
  of scenarios and hands its results back through files; the tests below compare them.
"""
from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import time
import warnings
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from conftest import RecordingMode, assert_close, cuda
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as torch_hooks
from torch.multiprocessing.spawn import ProcessException
from torch.nn.parallel import DistributedDataParallel as DDP

import fastpar
import fastpar.ddp as fddp

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

WORLD = 2
STEPS = 5
#: Seconds a process pair may run before it is declared hung and killed.
PAIR_TIMEOUT = 120.0
#: gloo's own collective timeout inside the workers: a last resort behind PAIR_TIMEOUT.
GLOO_TIMEOUT = datetime.timedelta(seconds=60)


# ---------------------------------------------------------------------------------------
# Running functions on a pair of processes.


def _entry(rank: int, worker, outdir: str, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD))
    # Two processes on two cores: one thread each keeps them from oversubscribing.
    torch.set_num_threads(1)
    import numba

    numba.set_num_threads(1)
    # Rendezvous through a file in this run's own folder: a free port picked here could
    # be taken by another process before the ranks bind it.
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(outdir, 'store')}", rank=rank,
                            world_size=WORLD, timeout=GLOO_TIMEOUT)
    # On an exception the group is deliberately left alone: its sockets close only when
    # this process exits, after torch has written the traceback, so the peer's "connection
    # closed" error never gets reported before the error that caused it.
    result = worker(rank, *args)
    torch.save(result, os.path.join(outdir, f"{rank}.pt"))
    dist.destroy_process_group()


def run_ranks(worker, *args, timeout: float = PAIR_TIMEOUT):
    """Run ``worker(rank, *args)`` on ``WORLD`` spawned processes joined by gloo over
    loopback; return each rank's return value, in rank order.

    If a rank raises, the others are killed at once and ``RuntimeError`` is raised here
    with every failed rank's traceback, the earliest first (a peer of the failing rank
    fails too, on the closed connection); if the pair runs past ``timeout`` seconds, both
    are killed and ``TimeoutError`` is raised. No process or file outlives the call.
    """
    with tempfile.TemporaryDirectory() as outdir:
        ctx = mp.start_processes(_entry, args=(worker, outdir, args), nprocs=WORLD,
                                 join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=0.2, grace_period=1.0):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{worker.__name__}: ranks still running after {timeout:.0f} s; killed")
        except ProcessException as e:
            failures = sorted(
                (os.path.getmtime(path), rank, pickle.load(open(path, "rb")))
                for rank, path in enumerate(ctx.error_files)
                if os.path.exists(path) and os.path.getsize(path)
            )
            report = "\n".join(f"--- rank {rank} failed:\n{tb}" for _, rank, tb in failures)
            raise RuntimeError(f"{worker.__name__}: {len(failures)} rank(s) failed\n{report or e}") from e
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
            for path in ctx.error_files:  # torch leaves them in the temp directory
                if os.path.exists(path):
                    os.unlink(path)
        return [torch.load(os.path.join(outdir, f"{r}.pt")) for r in range(WORLD)]


# ---------------------------------------------------------------------------------------
# Models and the training loop the workers run.


class Net(nn.Module):
    """A small MLP. ``empty`` adds a 0-element parameter whose gradient is ready last,
    so with tiny buckets it sits alone in an empty bucket; ``f64`` adds a float64 layer
    (a second bucket dtype); ``single`` keeps one parameter (one bucket of one tensor)."""

    def __init__(self, *, empty=False, f64=False, single=False):
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0)) if empty else None
        if single:
            self.layers = nn.Linear(16, 4, bias=False)
        else:
            self.layers = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                                        nn.LayerNorm(32), nn.Linear(32, 4))
        self.f64 = nn.Linear(4, 4).double() if f64 else None

    def forward(self, x):
        if self.empty is not None:
            x = x + self.empty.sum()
        y = self.layers(x)
        if self.f64 is not None:
            y = y + self.f64(y.double()).float()
        return y


def torch_bf16_logic_hook(state, bucket):
    """torch's ``bf16_compress_hook`` body, under a name DDP does not gate on CUDA + NCCL."""
    return torch_hooks._compress_hook(torch.bfloat16, state, bucket)


HOOKS = {
    "fastpar_allreduce": fddp.allreduce_hook,
    "fastpar_bf16": fddp.bf16_compress_hook,
    "fastpar_fp16": fddp.fp16_compress_hook,
    "torch_allreduce": torch_hooks.allreduce_hook,
    "torch_fp16": torch_hooks.fp16_compress_hook,
    "torch_bf16_logic": torch_bf16_logic_hook,
}


def train(rank, hook_name, *, model=None, ddp=None, register="wrap", group=None, steps=STEPS, backend="auto"):
    """Train ``Net(**model)`` (same initial values on every rank, different data) for
    ``steps`` SGD steps under DDP with hook ``hook_name``. Returns final parameters,
    first-step gradients, the buckets the hook saw per step and fastpar launches per step.

    ``register``: ``"wrap"`` registers a recording wrapper with
    ``ddp.register_comm_hook``; ``"fastpar"`` uses ``fastpar.ddp.register`` (no record).
    ``backend``: the fastpar backend the hook's passes run on in this thread."""
    with fastpar.use_backend(backend):
        return _train(rank, hook_name, model, ddp, register, group, steps)


def _train(rank, hook_name, model, ddp, register, group, steps):
    torch.manual_seed(0)
    net = Net(**(model or {}))
    model_ddp = DDP(net, process_group=group, **(ddp or {}))
    hook = HOOKS[hook_name]
    buckets, storages = [], set()
    if register == "fastpar":
        fddp.register(model_ddp, hook)
    else:
        def recording_hook(state, bucket):
            buckets[-1].append((bucket.index(), bucket.buffer().numel(), len(bucket.parameters())))
            storages.add(bucket.buffer().untyped_storage().data_ptr())
            return hook(state, bucket)

        model_ddp.register_comm_hook(group, recording_hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
    gen = torch.Generator().manual_seed(1000 + rank)
    launches, backends, grads0 = [], [], None
    for step in range(steps):
        x = torch.randn(8, 16, generator=gen)
        target = torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        buckets.append([])
        loss = nn.functional.mse_loss(model_ddp(x), target)
        with fastpar.count_launches() as n:
            loss.backward()
        launches.append(n.total)
        backends.append(sorted({b for b, _ in n.by_op}))
        if step == 0:
            grads0 = [p.grad.clone() for p in net.parameters()]
        opt.step()
    return {
        "params": [p.detach().clone() for p in net.parameters()],
        "grads0": grads0,
        "buckets": buckets if register != "fastpar" else None,
        "launches": launches,
        "backends": backends,  # per step: the backends fastpar's launches ran on
        # Whether every gradient lives in a bucket buffer the hook saw (what
        # gradient_as_bucket_view=True promises), when the hook recorded them.
        "grads_in_buckets": None if register == "fastpar" else all(
            p.grad.untyped_storage().data_ptr() in storages for p in net.parameters() if p.numel()
        ),
    }


#: scenario -> (fastpar hook, reference hook, train() keyword arguments, comparison)
SCENARIOS = {
    "allreduce": ("fastpar_allreduce", "torch_allreduce", {"register": "fastpar"}, "exact"),
    "allreduce/bucket_view": ("fastpar_allreduce", "torch_allreduce",
                              {"ddp": {"gradient_as_bucket_view": True}}, "exact"),
    "allreduce/tiny_buckets+empty": ("fastpar_allreduce", "torch_allreduce",
                                     {"model": {"empty": True}, "ddp": {"bucket_cap_mb": 1e-5}}, "exact"),
    "allreduce/one_tensor": ("fastpar_allreduce", "torch_allreduce", {"model": {"single": True}}, "exact"),
    # The allreduce hook's in-place scale pass: Numba on CPU (above), and the Triton
    # kernel it runs on CUDA, here through the Triton interpreter.
    "allreduce/triton_pass+tiny+empty": ("fastpar_allreduce", "torch_allreduce",
                                         {"model": {"empty": True}, "ddp": {"bucket_cap_mb": 1e-5},
                                          "backend": "triton"}, "exact"),
    "allreduce/float64+group": ("fastpar_allreduce", "torch_allreduce",
                                {"model": {"f64": True}, "register": "fastpar", "group": "new"}, "exact"),
    "fp16": ("fastpar_fp16", "torch_fp16", {"register": "fastpar"}, "fp16"),
    # use_backend() around backward: both passes, the cast back too (it runs on gloo's
    # callback thread), on the Triton kernels (interpreter).
    "fp16/triton_passes": ("fastpar_fp16", "torch_fp16", {"backend": "triton"}, "fp16"),
    "fp16/bucket_view+tiny+empty": ("fastpar_fp16", "torch_fp16",
                                    {"model": {"empty": True},
                                     "ddp": {"gradient_as_bucket_view": True, "bucket_cap_mb": 1e-5}}, "fp16"),
    "bf16_vs_allreduce": ("fastpar_bf16", "torch_allreduce", {"register": "fastpar"}, "bf16"),
    "bf16_vs_torch_bf16_logic": ("fastpar_bf16", "torch_bf16_logic", {}, "bf16_tight"),
    "bf16/bucket_view+one_tensor": ("fastpar_bf16", "torch_allreduce",
                                    {"model": {"single": True}, "ddp": {"gradient_as_bucket_view": True}}, "bf16"),
    "bf16/float64+tiny": ("fastpar_bf16", "torch_allreduce",
                          {"model": {"f64": True}, "ddp": {"bucket_cap_mb": 1e-5}}, "bf16"),
}


def _train_worker(rank):
    pg = dist.new_group(list(range(WORLD)))  # collective: every rank, same order
    out = {}
    for name, (mine, ref, kw, _) in SCENARIOS.items():
        kw = dict(kw)
        if kw.get("group") == "new":
            kw["group"] = pg
        ref_kw = {k: v for k, v in kw.items() if k not in ("register", "backend")}
        out[name] = {"fastpar": train(rank, mine, **kw), "ref": train(rank, ref, **ref_kw)}
    return out


class SyncNet(nn.Module):
    """Every kind of tensor sync_params moves: float32 weights, BatchNorm running stats and
    its int64 ``num_batches_tracked``, a bfloat16 parameter, a non-contiguous parameter and
    a non-contiguous int16 buffer (a dtype gloo cannot broadcast), buffers that are
    overlapping views of another, a 0-dim parameter, an empty parameter and a bool
    buffer."""

    def __init__(self, out=4, noncontig=True):
        super().__init__()
        self.lin = nn.Linear(6, out)
        self.bn = nn.BatchNorm1d(out)
        self.bf16 = nn.Parameter(torch.randn(5, 3).bfloat16())
        self.t = nn.Parameter(torch.randn(4, 6).t()) if noncontig else None
        self.scalar = nn.Parameter(torch.randn(()))
        self.empty = nn.Parameter(torch.zeros(0, 3))
        self.register_buffer("mask", torch.rand(7) > 0.5)
        if noncontig:
            self.register_buffer("counts", torch.randint(-999, 999, (4, 6), dtype=torch.int16)[:, ::2])
            # Buffers registered as views of another (overlapping each other too): their
            # bytes must not be unpacked twice (receiving ranks raised after the broadcast).
            self.register_buffer("stats", torch.randn(6))
            self.register_buffer("stats_head", self.stats[:3])
            self.register_buffer("stats_mid", self.stats[2:5])

    def forward(self, x):
        return self.bn(self.lin(x))


def _state(m):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _unchanged(m, before) -> bool:
    """``m`` still holds the state :func:`_state` saw."""
    return all(torch.equal(before[k], v) for k, v in _state(m).items())


def _sync_worker(rank):
    out = {}
    calls = []
    real_broadcast = dist.broadcast

    def counting_broadcast(*a, **k):
        calls.append(a[0].dtype)
        return real_broadcast(*a, **k)

    for name, kw in {"mixed": {}, "contiguous": {"noncontig": False}}.items():
        torch.manual_seed(rank)  # different values on every rank
        net = SyncNet(**kw)
        for _ in range(rank + 1):  # different running stats and num_batches_tracked
            net(torch.randn(8, 6))
        before = _state(net)
        calls.clear()
        dist.broadcast = counting_broadcast
        try:
            with fastpar.count_launches() as n:
                fddp.sync_params(net, src=1)
        finally:
            dist.broadcast = real_broadcast
        out[name] = {"before": before, "after": _state(net), "broadcasts": list(calls), "launches": n.total,
                     "noncontig_still": net.t is None or not net.t.is_contiguous()}

    # Ranks that hold different modules: ValueError on every rank, not a hang.
    torch.manual_seed(rank)  # different values on each rank: a partial sync would show
    m = SyncNet(out=4 + rank)
    before = _state(m)
    try:
        fddp.sync_params(m)
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    out["mismatch_unchanged"] = _unchanged(m, before)
    # Same shapes and dtypes, but one rank holds a parameter transposed (non-contiguous):
    # refused as DDP refuses mismatched strides; the message must say which tensor and
    # how it differs (it blamed the shapes/dtypes and "the architecture").
    torch.manual_seed(rank)
    m = nn.Module()
    m.a = nn.Parameter(torch.randn(3, 4))
    m.w = nn.Parameter(torch.randn(4, 6).t().contiguous() if rank == 1 else torch.randn(4, 6).t())
    try:
        fddp.sync_params(m, src=1)
        out["layout_mismatch"] = None
    except ValueError as e:
        out["layout_mismatch"] = str(e)
    if rank == 1:  # one tensor more on rank 1: the padded per-tensor check
        m.register_buffer("extra", torch.zeros(2))
    m.w = nn.Parameter(torch.randn(6, 4))
    try:
        fddp.sync_params(m, src=1)
        out["count_mismatch"] = None
    except ValueError as e:
        out["count_mismatch"] = str(e)
    # A src outside the group: rejected before any collective.
    m = SyncNet()
    before = _state(m)
    try:
        fddp.sync_params(m, src=WORLD + 3)
        out["bad_src"] = None
    except ValueError as e:
        out["bad_src"] = str(e)
    out["bad_src_unchanged"] = _unchanged(m, before)
    # Expanded buffers (stride 0, as ``x.expand(...)`` registers them): receiving ranks
    # raised in copy_ after the broadcast, while src returned normally.
    torch.manual_seed(rank)
    m = nn.Module()
    m.register_buffer("tiled", torch.randn(3).expand(2, 3))
    m.register_buffer("cols", torch.randn(4, 1).expand(4, 5))
    # Expanded on src only, non-contiguous on the receiver: the same checksum, so the
    # same bytes must travel whatever the layouts.
    m.register_buffer("rows", torch.randn(3).expand(2, 3) if rank == 1 else torch.randn(3, 2).t())
    before = _state(m)
    try:
        fddp.sync_params(m, src=1)
        out["expanded"] = {"before": before, "after": _state(m), "strides": [b.stride() for b in m.buffers()]}
    except RuntimeError as e:
        out["expanded"] = str(e)
    # src is a global rank: rank 1 is src of a group of its own, in which its rank is 0.
    sub = dist.new_group([1])  # collective: both ranks
    torch.manual_seed(rank)
    m = nn.Linear(4, 3)
    before = _state(m)
    if rank == 1:
        fddp.sync_params(m, src=1, process_group=sub)
    else:
        # Outside the group (new_group gave it NON_GROUP_MEMBER, an int): a no-op with a
        # warning, as torch's collectives do there (it raised TypeError "got int").
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fddp.sync_params(m, src=1, process_group=sub)
            out["nonmember"] = [str(w.message) for w in caught]
        except Exception as e:  # recorded, so that the pair's other results survive
            out["nonmember"] = f"{type(e).__name__}: {e}"
    out["subgroup_src_unchanged"] = _unchanged(m, before)
    return out


def _pair_worker(rank):
    return {"train": _train_worker(rank), "sync": _sync_worker(rank)}


@pytest.fixture(scope="module")
def pair():
    # One process pair for every training and sync_params scenario: starting two
    # interpreters (torch, Numba compiles) costs more than the scenarios themselves.
    return run_ranks(_pair_worker)


@pytest.fixture(scope="module")
def trained(pair):
    return [r["train"] for r in pair]


@pytest.fixture(scope="module")
def synced(pair):
    return [r["sync"] for r in pair]


# ---------------------------------------------------------------------------------------
# Two-process tests.


def _assert_ranks_agree(results, scenario):
    for which in ("fastpar", "ref"):
        for a, b in zip(results[0][scenario][which]["params"], results[1][scenario][which]["params"]):
            assert torch.equal(a, b), f"{scenario}/{which}: ranks hold different parameters after training"


#: ((rtol, atol as a fraction of the largest reference value) for first-step gradients,
#: (rtol, atol) for parameters after 5 steps), per comparison. A compressed all-reduce
#: rounds each rank's share of a gradient and then their sum to the wire dtype: up to
#: 2**-9 relative to each (bfloat16; 2**-12 float16), and relative to the sum more where
#: ranks' gradients cancel, hence atol on the gradients' scale. Measured (2 ranks):
#: bfloat16 vs exact all-reduce 4.3e-3 and 5.7e-3 of the largest gradient, 5.8e-4 on
#: parameters; fastpar's fp16/bf16 vs torch's own compress logic: bitwise equal (x * 0.5
#: and x / 2 round alike), but not promised (subnormals round differently).
TOLERANCES = {
    "fp16": ((2e-3, 2e-3), (1e-3, 2e-4)),
    "bf16": ((2**-7, 2**-6), (1e-2, 2e-3)),
    "bf16_tight": ((8e-3, 4e-3), (4e-3, 5e-4)),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_training_matches_torch_hook(trained, scenario):
    mine, ref, kw, how = SCENARIOS[scenario]
    _assert_ranks_agree(trained, scenario)
    for rank, res in enumerate(trained):
        got, exp = res[scenario]["fastpar"], res[scenario]["ref"]
        names = [n for n, _ in Net(**kw.get("model", {})).named_parameters()]
        for i, name in enumerate(names):
            what = f"{scenario} rank {rank} {name}"
            if how == "exact":
                assert torch.equal(got["grads0"][i], exp["grads0"][i]), f"{what}: first-step gradient differs"
                assert torch.equal(got["params"][i], exp["params"][i]), f"{what}: parameters differ after {STEPS} steps"
                continue
            (g_rtol, g_atol), (p_rtol, p_atol) = TOLERANCES[how]
            scale = float(exp["grads0"][i].abs().max()) if exp["grads0"][i].numel() else 0.0
            assert_close(got["grads0"][i], exp["grads0"][i], what=f"{what} first-step gradient",
                         tol=(g_rtol, g_atol * scale))
            assert_close(got["params"][i], exp["params"][i], what=f"{what} parameters after {STEPS} steps",
                         tol=(p_rtol, p_atol))


def test_compressed_training_actually_compresses(trained):
    # Guard against a vacuous pass: the bf16 run must differ from exact all-reduce
    # somewhere, or the tolerance comparisons above prove nothing.
    res = trained[0]["bf16_vs_allreduce"]
    assert any(not torch.equal(a, b) for a, b in zip(res["fastpar"]["grads0"], res["ref"]["grads0"]))


@pytest.mark.parametrize("scenario", ["allreduce/tiny_buckets+empty", "allreduce/triton_pass+tiny+empty",
                                      "fp16/bucket_view+tiny+empty"])
def test_tiny_buckets_and_empty_bucket(trained, scenario):
    res = trained[0][scenario]["fastpar"]
    last = res["buckets"][-1]  # after DDP rebuilt its buckets (first step: one bucket)
    assert len(res["buckets"][0]) == 1, res["buckets"][0]
    assert len(last) == len(list(Net(empty=True).parameters())), f"one bucket per parameter expected, got {last}"
    assert any(numel == 0 for _, numel, _ in last), f"no empty bucket reached the hook: {last}"
    # Two fused passes per non-empty bucket for a compress hook, one (the in-place scale)
    # for the allreduce hook, none for the empty bucket.
    passes = 1 if scenario.startswith("allreduce") else 2
    for step, (seen, n) in enumerate(zip(res["buckets"], res["launches"])):
        assert n == passes * sum(1 for _, numel, _ in seen if numel), f"step {step}: {n} launches for buckets {seen}"


@pytest.mark.parametrize("scenario", ["allreduce/triton_pass+tiny+empty", "fp16/triton_passes"])
def test_backend_chosen_around_backward_runs_every_pass(trained, scenario):
    for rank in range(WORLD):
        res = trained[rank][scenario]["fastpar"]
        assert all(n > 0 for n in res["launches"]), res["launches"]
        assert res["backends"] == [["triton"]] * STEPS, res["backends"]


def test_one_tensor_bucket(trained):
    res = trained[0]["allreduce/one_tensor"]["fastpar"]
    assert all(seen == [(0, 64, 1)] for seen in res["buckets"]), res["buckets"]
    assert res["launches"] == [1] * STEPS  # the in-place scale pass
    res = trained[0]["bf16/bucket_view+one_tensor"]["fastpar"]
    assert res["launches"] == [2] * STEPS


def test_bucket_view_gradients(trained):
    for scenario in ("allreduce/bucket_view", "fp16/bucket_view+tiny+empty", "bf16/bucket_view+one_tensor"):
        assert trained[0][scenario]["fastpar"]["grads_in_buckets"] is True, scenario
    # and the check discriminates: without bucket views gradients have their own memory
    assert trained[0]["allreduce/one_tensor"]["fastpar"]["grads_in_buckets"] is False


def test_sync_params_copies_everything_from_src(synced):
    for name in ("mixed", "contiguous"):
        src_before = synced[1][name]["before"]
        for rank in range(WORLD):
            after = synced[rank][name]["after"]
            assert after.keys() == src_before.keys()
            for k, v in src_before.items():
                assert after[k].dtype == v.dtype and torch.equal(after[k], v), f"{name} rank {rank}: {k} not synced"
        # the ranks really started apart (a sync that did nothing would pass otherwise)
        assert not torch.equal(synced[0][name]["before"]["lin.weight"], src_before["lin.weight"])
        assert not torch.equal(synced[0][name]["before"]["bn.num_batches_tracked"], src_before["bn.num_batches_tracked"])
        assert synced[0][name]["noncontig_still"]
    assert not torch.equal(synced[0]["mixed"]["before"]["counts"], synced[1]["mixed"]["before"]["counts"])


def test_sync_params_is_one_coalesced_broadcast(synced):
    # Every tensor, whatever its dtype, travels in one byte buffer: non-contiguous ones
    # (a float32 parameter, an int16 buffer gloo cannot broadcast as such) through a
    # contiguous copy.
    for rank in range(WORLD):
        assert synced[rank]["contiguous"]["broadcasts"] == [torch.uint8]
        assert synced[rank]["mixed"]["broadcasts"] == [torch.uint8]
    # One pack launch on src, one unpack launch elsewhere, per broadcast buffer.
    assert synced[1]["contiguous"]["launches"] == 1
    assert synced[0]["contiguous"]["launches"] == 1


def test_sync_params_rejects_mismatched_modules_on_every_rank(synced):
    for rank in range(WORLD):
        msg = synced[rank]["mismatch"]
        assert msg is not None and "ranks hold different modules" in msg, msg
        assert synced[rank]["bad_src"] is not None and "src must be a global rank" in synced[rank]["bad_src"]
        assert synced[rank]["mismatch_unchanged"] and synced[rank]["bad_src_unchanged"], \
            f"rank {rank}: a rejected sync_params changed the module"


def test_sync_params_names_the_tensor_that_differs(synced):
    # One tensor's layout differs (same shapes and dtypes): every rank raises, naming the
    # tensor and its own layout of it.
    for rank, layout in [(0, "non-contiguous"), (1, "contiguous")]:
        msg = synced[rank]["layout_mismatch"]
        assert msg is not None and "ranks hold different modules" in msg, msg
        assert f"parameter 'w' (#1): torch.float32 (6, 4) on cpu, {layout}" in msg, msg
    # Different shapes: the first tensor that differs is named, with this rank's shape
    # (#4: SyncNet's own four parameters come before its submodules').
    for rank in range(WORLD):
        msg = synced[rank]["mismatch"]
        assert f"parameter 'lin.weight' (#4): torch.float32 ({4 + rank}, 6)" in msg, msg
    # One rank holds a tensor more: each rank says what it has at that position.
    assert "on rank 0, no tensor #2 here, another rank has one (2 parameters and buffers here, 3 on some rank)" \
        in synced[0]["count_mismatch"], synced[0]["count_mismatch"]
    assert "on rank 1, buffer 'extra' (#2): torch.float32 (2,) on cpu, contiguous here" in synced[1]["count_mismatch"], \
        synced[1]["count_mismatch"]


def test_sync_params_expanded_buffers(synced):
    for rank in range(WORLD):
        res = synced[rank]["expanded"]
        assert isinstance(res, dict), f"rank {rank}: {res}"
        assert res["strides"][:2] == [(0, 1), (1, 0)], "the buffers must stay views of their memory"
        for k, v in synced[1]["expanded"]["before"].items():
            assert torch.equal(res["after"][k], v), f"rank {rank}: {k} not synced"
    assert not torch.equal(synced[0]["expanded"]["before"]["tiled"], synced[1]["expanded"]["before"]["tiled"])


def test_sync_params_src_is_a_global_rank_in_a_subgroup(synced):
    # Rank 1 is src of the group [1], where its group rank is 0: nothing to receive, its
    # module unchanged (read as a group rank, src 1 made it receive uninitialised bytes).
    assert synced[1]["subgroup_src_unchanged"] and synced[0]["subgroup_src_unchanged"]


def test_sync_params_on_a_rank_outside_the_group_does_nothing(synced):
    got = synced[0]["nonmember"]
    assert isinstance(got, list) and any("does not belong to process_group" in w for w in got), got
    assert synced[0]["subgroup_src_unchanged"]


def _compiled_worker(rank):
    """Per hook: gradients of eager steps and of steps whose forward and backward run in
    a function compiled with ``torch.compile``, and the dynamo warnings and unraisable
    exceptions raised meanwhile (:func:`_compiled_step_grads`)."""
    out = {}
    for name, hook in [("allreduce", fddp.allreduce_hook), ("bf16", fddp.bf16_compress_hook)]:
        for backend in [None, "aot_eager"]:
            grads, caught, unraisable = _compiled_step_grads(hook, backend, seed=1 + rank)
            out[name, backend] = (grads, [w[:300] for w in caught if "ynamo" in w] + unraisable)
    return out


def test_two_ranks_under_a_compiled_backward():
    # The hooks dynamo meets when backward() runs in a compiled step (DDP's C++ reducer
    # calls them) run eagerly whole: on two ranks, where allreduce_hook's scale pass
    # launches too, the compiled steps give the eager steps' gradients, warning-free.
    results = run_ranks(_compiled_worker)
    for rank, out in enumerate(results):
        for name in ["allreduce", "bf16"]:
            eager, _ = out[name, None]
            grads, caught = out[name, "aot_eager"]
            assert not caught, (rank, name, caught)
            for got, exp in zip(grads, eager):
                assert all(torch.equal(g, e) for g, e in zip(got, exp)), (rank, name)
    for name in ["allreduce", "bf16"]:
        assert all(torch.equal(a, b) for a, b in zip(results[0][name, "aot_eager"][0][-1], results[1][name, "aot_eager"][0][-1]))


def _failing_worker(rank):
    """Rank 1's hook raises at step 2 while rank 0 waits in its all-reduce."""
    torch.manual_seed(0)
    net = Net()
    model = DDP(net)

    def hook(state, bucket):
        if rank == 1 and step == 2:
            raise RuntimeError("rank 1 fails on purpose at step 2")
        return fddp.bf16_compress_hook(state, bucket)

    model.register_comm_hook(None, hook)
    for step in range(STEPS):
        model(torch.randn(8, 16)).sum().backward()
    return "finished"


def test_rank_raising_mid_step_fails_fast():
    # "Fast" = without waiting for gloo's collective timeout: a peer left waiting for the
    # failed rank would hold the pair past this bound (below GLOO_TIMEOUT), and run_ranks
    # would raise TimeoutError instead. Start-up of two interpreters is most of the time.
    assert GLOO_TIMEOUT.total_seconds() > 50
    with pytest.raises(RuntimeError, match="rank 1 fails on purpose at step 2") as info:
        run_ranks(_failing_worker, timeout=50)
    # The cause is reported first, whatever its peer made of the closed connection.
    assert str(info.value).index("--- rank 1 failed") < str(info.value).find("--- rank 0 failed") \
        or "--- rank 0 failed" not in str(info.value), str(info.value)


# ---------------------------------------------------------------------------------------
# One-rank tests in this process.


@pytest.fixture(scope="module")
def one_rank():
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _one_rank_grads(hook, model_kw=None, ddp_kw=None, steps=3):
    """Gradients of a DDP model with ``hook`` and of a plain copy, on a world of one."""
    torch.manual_seed(0)
    net = Net(**(model_kw or {}))
    plain = Net(**(model_kw or {}))
    plain.load_state_dict(net.state_dict())
    model = DDP(net, **(ddp_kw or {}))
    fddp.register(model, hook)
    out = []
    for _ in range(steps):
        x = torch.randn(8, 16)
        net.zero_grad(), plain.zero_grad()
        model(x).square().sum().backward()
        plain(x).square().sum().backward()
        out.append([(n, p.grad.clone(), q.grad) for (n, p), q in zip(net.named_parameters(), plain.parameters())])
    return out


@pytest.mark.parametrize("ddp_kw", [{}, {"gradient_as_bucket_view": True, "bucket_cap_mb": 1e-5}],
                         ids=["default", "bucket_view+tiny"])
@pytest.mark.parametrize("hook", ["allreduce", torch.bfloat16, torch.float16])
def test_world_of_one_values_are_exact(one_rank, hook, ddp_kw):
    # Scale 1/1: allreduce_hook leaves gradients as they are; a compress hook rounds each
    # one to its dtype exactly once (torch's cast then divide would round the same here).
    h = fddp.allreduce_hook if hook == "allreduce" else fddp.compress_hook(hook)
    for step in _one_rank_grads(h, {"empty": True, "f64": True}, ddp_kw):
        for name, got, plain in step:
            exp = plain if hook == "allreduce" else plain.to(hook).to(plain.dtype)
            assert torch.equal(got, exp), f"{name}: gradient differs"


def _compiled_step_grads(hook, backend, steps=3, seed=1):
    """Gradients of a DDP model with ``hook`` whose forward *and* backward run inside a
    ``torch.compile``d step (so dynamo meets the hook the reducer calls), with the
    Python warnings and unraisable exceptions raised meanwhile."""
    import sys

    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = Net()
    model = DDP(net)
    fddp.register(model, hook)

    def step(x):
        model(x).square().sum().backward()

    if backend is not None:
        step = torch.compile(step, backend=backend)
    unraisable, old_hook = [], sys.unraisablehook
    sys.unraisablehook = unraisable.append
    grads = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.manual_seed(seed)  # the data; the model is made under seed 0
            for _ in range(steps):
                net.zero_grad()
                step(torch.randn(8, 16))
                grads.append([p.grad.clone() for p in net.parameters()])
            import gc

            gc.collect()  # what dynamo built and dropped while tracing is freed here
    finally:
        sys.unraisablehook = old_hook
        torch._dynamo.reset()
    return grads, [str(w.message) for w in caught], [repr(u.exc_value) for u in unraisable]


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("wire", [torch.float16, torch.bfloat16], ids=str)
def test_compress_hook_under_a_compiled_backward(one_rank, wire, backend):
    # backward() inside a compiled function: dynamo traces every frame autograd calls,
    # the hook DDP's reducer calls among them. It went through the hook body and the
    # bound Numba passes (which bypass the disabled launchers), warning at
    # `_bisect.bisect_left`, `copy_context` and an lru_cache in the kernels, and left
    # half-built StorageWeakRef objects whose __del__ raised. The hook runs eagerly whole.
    hook = fddp.compress_hook(wire)
    eager, _, _ = _compiled_step_grads(hook, None)
    grads, caught, unraisable = _compiled_step_grads(hook, backend)
    assert not [w for w in caught if "ynamo" in w], caught
    assert not unraisable, unraisable
    for got, exp in zip(grads, eager):
        for g, e in zip(got, exp):
            assert torch.equal(g, e)
    # the hook did run: the compiled gradients are rounded to the wire dtype
    assert all(torch.equal(g, g.to(wire).float()) for g in grads[-1])


@pytest.mark.parametrize("hook", ["allreduce", torch.bfloat16])
def test_hooks_refuse_the_python_reducers_tuples(one_rank, hook):
    # DDP built under optimize_ddp="python_reducer" calls hooks with (grad, param): a
    # bare AttributeError ("'tuple' object has no attribute 'buffer'") came out before.
    # (one_rank: state None is the default group, which must exist; without the fixture
    # the test passed only after another test had started it.)
    h = fddp.allreduce_hook if hook == "allreduce" else fddp.compress_hook(hook)
    p = nn.Parameter(torch.ones(3))
    with pytest.raises(TypeError, match=r"bucket must be a torch.distributed.GradBucket, got tuple.*python_reducer"):
        h(None, (torch.ones(3), p))


def test_register_refuses_a_python_reducer_model():
    # In a subprocess: building DDP under python_reducer changes global dynamo/inductor
    # settings (torch.nn.parallel.distributed inlined, DDP fusion passes on).
    import subprocess
    import sys

    code = (
        "import torch, torch.distributed as dist, torch._dynamo\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "import fastpar.ddp as fddp\n"
        "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
        "with torch._dynamo.config.patch(optimize_ddp='python_reducer'):\n"
        "    model = DDP(torch.nn.Linear(3, 3))\n"
        "try:\n"
        "    fddp.register(model, fddp.bf16_compress_hook)\n"
        "except TypeError as e:\n"
        "    assert 'python_reducer' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('registered on a python_reducer model')\n"
        "assert not model._comm_hooks\n"
        "dist.destroy_process_group()\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def test_compress_hook_factory():
    assert fddp.compress_hook() is fddp.bf16_compress_hook
    assert fddp.compress_hook(torch.float16) is fddp.fp16_compress_hook
    assert fddp.compress_hook(dtype=torch.float32) is fddp.compress_hook(torch.float32)
    # DDP gates hooks *named* bf16_compress_hook on CUDA + NCCL; fastpar's must not be.
    assert fddp.bf16_compress_hook.__name__ != "bf16_compress_hook"
    for bad, what in [(torch.int8, "torch.int8"), (torch.float8_e4m3fn, "float8"), ("bf16", "str 'bf16'")]:
        with pytest.raises(TypeError, match=rf"dtype must be one of .* got .*{what}"):
            fddp.compress_hook(bad)


def test_bf16_hook_registers_on_gloo_where_torch_refuses(one_rank):
    if torch.version.cuda is None:
        with pytest.raises(TypeError, match="BF16"):
            DDP(Net()).register_comm_hook(None, torch_hooks.bf16_compress_hook)
    DDP(Net()).register_comm_hook(None, fddp.bf16_compress_hook)  # plain torch API
    fddp.register(DDP(Net()), fddp.bf16_compress_hook)


def test_register_argument_errors(one_rank):
    model = DDP(Net())
    with pytest.raises(TypeError, match="ddp_model must be a torch.nn.parallel.DistributedDataParallel, got Net"):
        fddp.register(Net(), fddp.allreduce_hook)
    # torch's hooks share fastpar's names: "got allreduce_hook" read as the very hook asked for.
    with pytest.raises(TypeError, match=r"hook must be fastpar.ddp.allreduce_hook .* got "
                                        r"torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook;"):
        fddp.register(model, torch_hooks.allreduce_hook)
    with pytest.raises(TypeError, match=r"hook must be .* got str;"):
        fddp.register(model, "allreduce_hook")
    with pytest.raises(TypeError, match="state must be None .* got str"):
        fddp.register(model, fddp.allreduce_hook, state="world")


@pytest.mark.parametrize("hook", ["allreduce", torch.bfloat16])
def test_a_group_this_rank_is_not_in_is_named_as_such(one_rank, hook):
    # What new_group() hands a rank it leaves out is an int (NON_GROUP_MEMBER): as a
    # hook's state it was refused as "got int", which did not say why.
    h = fddp.allreduce_hook if hook == "allreduce" else fddp.compress_hook(hook)
    outside = dist.GroupMember.NON_GROUP_MEMBER
    msg = r"is GroupMember.NON_GROUP_MEMBER, what new_group\(\) returns on a rank it leaves out: global rank 0"
    with pytest.raises(TypeError, match="state " + msg):
        fddp.register(DDP(Net()), h, state=outside)
    with pytest.raises(TypeError, match="process_group " + msg):
        h(outside, None)


def test_register_takes_complex_parameters_as_ddp_buckets_them(one_rank):
    """DDP's buckets hold a complex gradient as its real view, so a compress hook casts
    float32 values (register refused complex64 parameters; the hook itself ran)."""
    torch.manual_seed(0)
    with pytest.warns(UserWarning, match="Complex modules"):
        model = DDP(nn.Linear(3, 3).to(torch.complex64))
    with pytest.warns(UserWarning, match="Complex modules"):
        plain = nn.Linear(3, 3).to(torch.complex64)
    plain.load_state_dict(model.module.state_dict())
    fddp.register(model, fddp.bf16_compress_hook)
    x = torch.randn(4, 3, dtype=torch.complex64)
    model(x).abs().pow(2).sum().backward()
    plain(x).abs().pow(2).sum().backward()
    for (name, p), q in zip(model.module.named_parameters(), plain.parameters()):
        exp = torch.view_as_real(q.grad).to(torch.bfloat16).float()  # world of one: rounded once
        assert torch.equal(torch.view_as_real(p.grad), exp), f"{name}: gradient differs"


def test_register_rejects_gradients_the_hook_cannot_cast(one_rank):
    with pytest.warns(UserWarning, match="Complex modules"):
        complex_model = DDP(nn.Linear(3, 3).to(torch.complex64))
    fddp.register(complex_model, fddp.allreduce_hook)  # allreduce needs no cast

    sparse = DDP(nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 1)))
    with pytest.raises(TypeError, match=r"sparse gradients, and parameter '0.weight'"):
        fddp.register(sparse, fddp.fp16_compress_hook)


def test_first_call_check_refuses_a_sparse_bucket_after_a_dense_one(one_rank):
    # A hook registered with DDP's own register_comm_hook checks each kind of bucket at
    # its first call; a dense float32 bucket checked first must not wave through a
    # sparse float32 one (it then failed inside the pass with "Cannot access data
    # pointer" instead of this TypeError).
    who = "compress_hook(bfloat16)"
    fddp._checked.clear()
    fddp._check_once(one_rank, torch.zeros(4), torch.bfloat16, who)
    sparse = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, 3), (4, 3), check_invariants=True)
    with pytest.raises(TypeError, match=r"gradient buckets must be dense to be cast; got a torch.sparse_coo bucket"):
        fddp._check_once(one_rank, sparse, torch.bfloat16, who)


@pytest.mark.parametrize("config, device, dtype, match", [
    ("cpu:nccl,cuda:nccl", "cpu", torch.float32, "NCCL, which only reduces CUDA tensors"),
    ("nccl", "cuda", torch.bfloat16, "NCCL reduces bfloat16 from version 2.10"),
    ("cpu:gloo,cuda:nccl", "cpu", torch.float8_e4m3fn, "gloo backend cannot all-reduce torch.float8_e4m3fn"),
    ("gloo", "cpu", torch.int16, "gloo backend cannot all-reduce torch.int16"),
    ("cuda:nccl", "cpu", torch.float32, "no backend for cpu tensors"),
])
def test_backend_dtype_table(one_rank, monkeypatch, config, device, dtype, match):
    monkeypatch.setattr(fddp, "_nccl_version", lambda: (2, 9, 0) if torch.cuda.is_available() else None)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
    with pytest.raises((TypeError, RuntimeError), match=match):
        fddp._check_reducible(one_rank, torch.device(device), dtype, "hook", "gradients")


def test_unsupported_backend_fails_at_registration_and_at_first_call(one_rank, monkeypatch):
    # On a (simulated) NCCL group, CPU gradients cannot be reduced: register() says so
    # before touching the model; a hook registered directly says so in its first call,
    # before any collective, so every rank raises alike instead of one hanging.
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cpu:nccl,cuda:nccl")
    monkeypatch.setattr(fddp, "_checked", weakref.WeakKeyDictionary())
    with pytest.raises(TypeError, match="only reduces CUDA tensors; gradients of parameter"):
        fddp.register(DDP(Net()), fddp.fp16_compress_hook)
    model = DDP(Net())
    model.register_comm_hook(None, fddp.fp16_compress_hook)
    with pytest.raises(TypeError, match="only reduces CUDA tensors; torch.float32 gradient buckets"):
        model(torch.randn(2, 16)).sum().backward()


def test_bucket_cache_drops_rebuilt_buckets(one_rank):
    fddp._buckets.clear()
    model = DDP(Net(), bucket_cap_mb=1e-5)
    fddp.register(model, fddp.bf16_compress_hook)
    for _ in range(4):
        model(torch.randn(2, 16)).sum().backward()
    live = len(list(model.parameters()))  # one bucket per parameter after the rebuild
    # The first step's single bucket was freed by DDP's rebuild and dropped from the cache.
    entries = list(fddp._buckets._entries.values())
    assert len(entries) == live and not any(e.alive.expired() for e in entries)


def test_release_buffers_frees_the_low_precision_buffers(one_rank):
    import gc
    import weakref

    fddp._buckets.clear()
    model = DDP(Net())
    fddp.register(model, fddp.bf16_compress_hook)
    for _ in range(3):
        model(torch.randn(2, 16)).sum().backward()
    lows = [weakref.ref(low) for e in fddp._buckets._entries.values() for low in e.low.values()]
    assert lows and all(r() is not None for r in lows)
    del model
    gc.collect()
    assert any(r() is not None for r in lows)  # kept until a hook sees a new bucket ...
    fddp.release_buffers()
    gc.collect()
    assert all(r() is None for r in lows)  # ... or until released


def test_sync_params_argument_errors(one_rank):
    with pytest.raises(TypeError, match="module must be a torch.nn.Module, got list"):
        fddp.sync_params([nn.Linear(2, 2)])
    lin = nn.Linear(2, 2)
    before = _state(lin)
    with pytest.raises(TypeError, match="src must be an int"):
        fddp.sync_params(lin, src=0.0)
    with pytest.raises(ValueError, match=r"src must be a global rank in the process group \[0\], got 1"):
        fddp.sync_params(lin, src=1)
    with pytest.raises(TypeError, match="process_group must be None .* got int"):
        fddp.sync_params(lin, process_group=0)
    assert _unchanged(lin, before), "a rejected call changed the module"
    m = SyncNet()
    before = _state(m)
    fddp.sync_params(m)  # world of one: a no-op that still checks and broadcasts
    assert _unchanged(m, before)


def test_sync_params_refuses_uninitialized_lazy_tensors(one_rank, monkeypatch):
    # A lazy module before its first forward: torch's detach() raised a ValueError naming
    # neither sync_params nor the tensor. Refused as DDP refuses it (RuntimeError), naming
    # the tensor, before any collective.
    collectives = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: collectives.append(a))
    with pytest.raises(RuntimeError, match=r"sync_params: module has an uninitialized parameter '1\.weight' "
                                           r"\(a lazy module before its first forward\)"):
        fddp.sync_params(nn.Sequential(nn.Linear(2, 2), nn.LazyLinear(4)))
    m = nn.Linear(2, 2)
    m.register_buffer("stats", nn.parameter.UninitializedBuffer())
    with pytest.raises(RuntimeError, match="uninitialized buffer 'stats'"):
        fddp.sync_params(m)
    assert not collectives


def test_sync_params_inside_a_compiled_function(one_rank):
    # dynamo traced on through sync_params' packing, checksum and collectives, warning at
    # each builtin (zlib.crc32, ...): the call is a graph break and runs eagerly.
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    net = Net()
    before = {k: v.clone() for k, v in net.state_dict().items()}

    def f(x):
        fddp.sync_params(net)
        return net(x)

    x = torch.randn(2, 16)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = torch.compile(f, backend="eager")(x)
    finally:
        torch._dynamo.reset()
    assert not [str(w.message) for w in caught if "ynamo" in str(w.message)], [str(w.message) for w in caught]
    assert torch.equal(got, net(x))
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())


def test_sync_params_refuses_a_device_the_group_has_no_backend_for(one_rank, monkeypatch):
    # CPU tensors on an NCCL group (simulated; "cuda:nccl" is what init_process_group("nccl")
    # configures): torch raised in that device's broadcast, after the other devices'
    # broadcasts had written part of the module. Now refused before any collective.
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append("all_reduce"))
    monkeypatch.setattr(dist, "broadcast", lambda *a, **k: calls.append("broadcast"))
    m = SyncNet()
    before = _state(m)
    with pytest.raises(RuntimeError, match=r"sync_params: the process group has no backend for cpu tensors "
                                           r"\(its backends: cuda:nccl\), and the module has parameters "
                                           r"or buffers on cpu"):
        fddp.sync_params(m)
    assert calls == [] and _unchanged(m, before)


class _FakeGroup:
    """Stands in for a process group of any size in the scaling tests below."""

    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n


class _FakeBucket:
    def __init__(self, buf):
        self._buf = buf

    def buffer(self):
        return self._buf


def _fake_all_reduce(tensor, group=None, async_op=False):
    # "Everyone else sent zeros": the sum is this rank's (pre-scaled) share.
    fut = torch.futures.Future()
    fut.set_result([tensor])

    class Work:
        def get_future(self):
            return fut

    return Work()


@pytest.fixture
def fake_collectives(monkeypatch):
    """Hooks called directly on fake groups: all-reduces return this rank's share, every
    group is gloo, and nothing counts as checked yet."""
    monkeypatch.setattr(dist, "all_reduce", _fake_all_reduce)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "gloo")
    monkeypatch.setattr(fddp, "_group_of", lambda state, name="state": state)
    monkeypatch.setattr(fddp, "_checked", weakref.WeakKeyDictionary())


@pytest.mark.parametrize("n", [2, 3, 4, 6, 8, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("be", ["numba", "triton", "torch"])
def test_allreduce_scaling_is_torch_division_for_any_world_size(fake_collectives, n, dtype, be):
    # torch's allreduce_hook divides; for world sizes that are not powers of two a
    # multiplication by 1/n would differ in the last bit, so fastpar's must divide too.
    x = (torch.randn(70001, generator=torch.Generator().manual_seed(n)) * 3).to(dtype)
    mine, theirs = x.clone(), x.clone()
    with fastpar.use_backend(be):
        got = fddp.allreduce_hook(_FakeGroup(n), _FakeBucket(mine)).wait()
    exp = torch_hooks.allreduce_hook(_FakeGroup(n), _FakeBucket(theirs)).wait()
    assert got is mine, "the future must hold the bucket buffer itself"
    assert torch.equal(got, exp), f"world size {n}: {(got != exp).sum()} elements differ from torch's division"
    assert torch.equal(exp, x / n)


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [2, 3, 8])
def test_compress_hook_single_rank_share(fake_collectives, wire, n):
    # With a fake all-reduce the hook's result is one rank's share, scaled and cast once
    # and cast back: x * (1/n) rounded to the wire dtype from float32.
    x = torch.randn(70001, generator=torch.Generator().manual_seed(n)) * 3
    buf = x.clone()
    with fastpar.count_launches() as launches:
        got = fddp.compress_hook(wire)(_FakeGroup(n), _FakeBucket(buf)).wait()
    assert got is buf
    exp = (x * torch.tensor(1.0 / n, dtype=torch.float32)).to(wire).float()
    assert torch.equal(got, exp)
    assert launches.total == 2
    if n == 2:  # a power of two: exactly the correctly rounded share
        assert torch.equal(got, (x.double() / n).float().to(wire).float())


# ---------------------------------------------------------------------------------------
# The in-place scale op the allreduce hook runs, and the resolved passes.

SCALE_SIZES = [0, 1, 7, 65536 + 3, 131072]


def _specials(dtype):
    """Values whose bits a careless pass would change: signed zeros, infinities, a NaN,
    float32 subnormals (flushed by a kernel compiled with fast-math), 16-bit overflow."""
    return torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -3e-39,
                         70000.0, 1.0, -3.0], dtype=torch.float32).to(dtype)


def _poisoned_views(sizes, dtype, seed, gap=5, poison=-7.0):
    """Tensors of ``sizes`` as slices of one buffer filled with ``poison``, ``gap``
    elements apart: whatever a kernel writes outside them stays visible."""
    total = sum(sizes) + gap * (len(sizes) + 1)
    store = torch.full((total,), poison, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    views, pos = [], gap
    for n in sizes:
        v = store[pos:pos + n]
        v.copy_((torch.randn(n, generator=gen, dtype=torch.float64) * 4).to(dtype))
        if n >= 10:
            v[:10] = _specials(dtype)
        views.append(v)
        pos += n + gap
    return store, views


def _bits(t):
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _same_bits(a, b) -> bool:
    """Bit for bit equal, except that any NaN matches any NaN: torch itself turns a
    bfloat16 NaN into 0x7FC0 on its scalar path and into 0xFFFF on its vectorised one."""
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(_bits(a)[~nan], _bits(b)[~nan])


@pytest.mark.parametrize("launch_kw", [{}, {"chunk": 1000, "parallel_min_bytes": 0}], ids=["default", "chunked_parallel"])
@pytest.mark.parametrize("factor, divide", [(0.5, False), (0.125, False), (3.0, True), (6.0, True), (2.0, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_numba_scale_kernel_against_float64_and_torch(dtype, factor, divide, launch_kw):
    from fastpar.kernels.ops_numba import scale as numba_scale

    from fastpar._plan import plan_for

    for sizes in [SCALE_SIZES, *([n] for n in SCALE_SIZES)]:
        store, views = _poisoned_views(sizes, dtype, seed=len(sizes) + int(factor))
        before = store.clone()
        group = plan_for(views, "t", cache=False).groups[0]
        with fastpar.count_launches() as launches:
            numba_scale.scale(group, factor, divide, **launch_kw)
        assert launches.total == (1 if sum(sizes) else 0)
        # Poison between and around the tensors untouched.
        inside = torch.zeros(len(store), dtype=torch.bool)
        for v in views:
            inside[v.storage_offset():v.storage_offset() + v.numel()] = True
        assert torch.equal(_bits(store[~inside]), _bits(before[~inside])), "wrote outside the tensors"
        for v, x in zip(views, (before[v.storage_offset():v.storage_offset() + v.numel()] for v in views)):
            # float64 reference: exact for a float32 product, and a float64 quotient
            # rounded to float32 is the correctly rounded float32 quotient (53 >= 2*24+2);
            # 16-bit floats then round from that float32, as torch does.
            x64 = x.double()
            exact = x64 / factor if divide else x64 * factor
            ref = exact if dtype == torch.float64 else exact.float().to(dtype)
            finite = torch.isfinite(x) & ~torch.isnan(x)
            assert torch.equal(v[finite], ref[finite]), f"sizes {sizes}: differs from the float64 reference"
            # and bit for bit what torch's in-place op leaves, specials included
            mine = x.clone()
            (mine.div_(factor) if divide else mine.mul_(factor))
            assert _same_bits(v, mine), f"sizes {sizes}: differs from torch's {'div_' if divide else 'mul_'}"


@pytest.mark.parametrize("be", ["triton", "torch"])
@pytest.mark.parametrize("factor, divide", [(0.25, False), (3.0, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_scale_other_backends_match_torch(be, dtype, factor, divide):
    # The same op in the Triton kernel (through the interpreter here) and the reference.
    from fastpar import _dispatch
    from fastpar._plan import plan_for

    store, views = _poisoned_views([0, 1, 7, 4099], dtype, seed=3)
    before = store.clone()
    _dispatch._kernel(be, "scale")(plan_for(views, "t", cache=False).groups[0], factor, divide)
    exp = before.clone()
    for v in views:
        piece = exp[v.storage_offset():v.storage_offset() + v.numel()]
        piece.div_(factor) if divide else piece.mul_(factor)
    assert _same_bits(store, exp)


def test_hook_passes_bump_the_bucket_version_once(backend):
    # As buf.div_(n) would (the torch reference backend's copy_ added one more).
    buf = torch.randn(1000)
    entry, v = fddp._Bucket(buf), buf._version
    fddp._launch("scale", entry, buf, buf, 0.5)
    assert buf._version == v + 1
    low = torch.randn(1000, dtype=torch.bfloat16)
    fddp._launch("unflatten_into", entry, buf, low, None)
    assert buf._version == v + 2 and torch.equal(buf, low.float())


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cuda_hook_scale_pass_matches_torch(dtype):
    """The allreduce hook's pass on a CUDA bucket (Triton; the NCCL test runs at world
    size 1, where the hook does not scale): x * (1/4) bit for bit as torch's mul_."""
    buf = torch.randn(3 * 4099 + 5, device="cuda").to(dtype)
    exp = buf.clone().mul_(0.25)
    with fastpar.count_launches() as n:
        fddp._launch("scale", fddp._Bucket(buf), buf, buf, 0.25)
    torch.cuda.synchronize()
    assert n.by_op == {("triton", "scale"): 1}, n.by_op
    assert torch.equal(buf, exp)


def test_scale_rejects_other_dtypes():
    from fastpar.kernels.ops_numba import scale as numba_scale
    from fastpar.kernels.ops_triton import scale as triton_scale

    from fastpar._plan import plan_for

    group = plan_for([torch.arange(5)], "t", cache=False).groups[0]
    for launcher in (numba_scale.scale, triton_scale.scale):
        with pytest.raises(TypeError, match="group must hold .* tensors to be scaled, got torch.int64"):
            launcher(group, 0.5, False)
    with pytest.raises(ValueError, match=r"chunk must be a positive int \(elements per block\), got 0"):
        numba_scale.bind(plan_for([torch.ones(3)], "t", cache=False).groups[0], 0.5, False, chunk=0)


@pytest.mark.parametrize("numel", SCALE_SIZES)
@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
def test_allreduce_hook_is_one_bitwise_pass(fake_collectives, numel, n, dtype):
    # Every bucket size, specials included: torch's hook and fastpar's leave the same
    # bits, and fastpar's took exactly one Numba pass (none for an empty bucket).
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(numel + n)) * 3).to(dtype)
    if numel >= 10:
        x[:10] = _specials(dtype)
    mine, theirs = x.clone(), x.clone()
    with fastpar.use_backend("numba"), fastpar.count_launches() as launches:
        got = fddp.allreduce_hook(_FakeGroup(n), _FakeBucket(mine)).wait()
    exp = torch_hooks.allreduce_hook(_FakeGroup(n), _FakeBucket(theirs)).wait()
    assert got is mine
    assert _same_bits(got, exp)
    assert launches.by_op == ({("numba", "scale"): 1} if numel else {}), launches.by_op


@pytest.mark.parametrize("src, dst, scale, op", [
    (torch.float32, torch.bfloat16, 0.5, "flatten"),
    (torch.float32, torch.float16, 1 / 3, "flatten"),
    (torch.float64, torch.float32, 0.25, "flatten"),
    (torch.float32, torch.bfloat16, None, "unflatten_into"),
    (torch.float32, torch.float16, None, "unflatten_into"),
    (torch.float32, torch.float32, None, "flatten"),
], ids=str)
@pytest.mark.parametrize("numel", [1, 65536 + 3, 1 << 19])
def test_resolved_pass_matches_the_launcher(src, dst, scale, op, numel):
    # _launch binds the Numba copy kernel itself (mirroring ops_numba.flatten's
    # launcher); it must write what the launcher writes, on one thread and on all.
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(numel), dtype=torch.float64) * 3).to(src)
    x[:1] = float("nan")
    other = torch.randn(numel, dtype=torch.float64).to(dst)
    entry = fddp._Bucket(x)
    if op == "flatten":
        got, exp = torch.full_like(other, -1.0), torch.full_like(other, -1.0)
        with fastpar.use_backend("numba"), fastpar.count_launches() as launches:
            fddp._launch(op, entry, x, got, scale)
        _dispatch_kernel("numba", op)(entry.group, exp, scale)
    else:
        bucket, ref = x.clone(), x.clone()
        entry = fddp._Bucket(bucket)
        with fastpar.use_backend("numba"), fastpar.count_launches() as launches:
            fddp._launch(op, entry, bucket, other, scale)
        _dispatch_kernel("numba", op)(fddp._Bucket(ref).group, other, scale)
        got, exp = bucket, ref
    assert _same_bits(got, exp)
    assert launches.by_op == {("numba", op): 1}
    # And both against an independent float64 reference (they share the kernel).
    want = (x if op == "flatten" else other).double() * (1.0 if scale is None else scale)
    assert_close(got, want, what=f"{op} {src}->{dst} scale {scale}")


def _dispatch_kernel(backend, op):
    from fastpar import _dispatch

    return _dispatch._kernel(backend, op)


def test_resolved_passes_follow_backend_and_tuning_changes():
    from fastpar import _tuning

    buf = torch.randn(5000)
    low = torch.zeros(5000, dtype=torch.bfloat16)
    entry = fddp._Bucket(buf)
    exp = (buf * 0.5).bfloat16()
    seen = []
    for backend in ["numba", "triton", "torch", "numba"]:
        low.fill_(0)
        with fastpar.use_backend(backend), fastpar.count_launches() as launches:
            fddp._launch("flatten", entry, buf, low, 0.5)
        assert torch.equal(low, exp), backend
        seen.append(dict(launches.by_op))
    assert seen == [{("numba", "flatten"): 1}, {("triton", "flatten"): 1}, {}, {("numba", "flatten"): 1}]
    # A forced tuning table (as fastpar.autotune measures with) is picked up at the next
    # call: the pass is resolved again with its parameters.
    key = ("flatten", low.data_ptr(), low.dtype, 0.5, False)
    with _tuning.forced({("flatten", "numba"): {"chunk": 1024}}):
        low.fill_(0)
        fddp._launch("flatten", entry, buf, low, 0.5)
        assert entry.passes[key].tuned == {"chunk": 1024}
        assert torch.equal(low, exp)
    low.fill_(0)
    fddp._launch("flatten", entry, buf, low, 0.5)
    assert entry.passes[key].tuned != {"chunk": 1024} and torch.equal(low, exp)


def test_resolved_passes_skip_the_lookups_until_what_they_depend_on_changes(monkeypatch):
    # Asking _dispatch.backend_for_type and _tuning.params at every pass cost 5-8 us of a
    # 1 MB compress pass's 35-45 us (measured in loops alternating it with torch's pass).
    # A pass now re-asks only when the use_backend override, FASTPAR_BACKEND or the
    # tuning state changed; each change still takes effect at the next call.
    from fastpar import _dispatch, _tuning

    monkeypatch.delenv("FASTPAR_BACKEND", raising=False)
    buf = torch.randn(5000)
    low = torch.zeros(5000, dtype=torch.bfloat16)
    entry = fddp._Bucket(buf)
    exp = (buf * 0.5).bfloat16()
    asked = []
    real_backend, real_params = _dispatch.backend_for_type, _tuning.params
    monkeypatch.setattr(_dispatch, "backend_for_type", lambda t: asked.append("backend") or real_backend(t))
    monkeypatch.setattr(_tuning, "params", lambda *a, **kw: asked.append("params") or real_params(*a, **kw))

    def run(expected_launches):
        poison = torch.full_like(low, float("nan"))
        low.copy_(poison)
        with fastpar.count_launches() as launches:
            fddp._launch("flatten", entry, buf, low, 0.5)
        assert torch.equal(low, exp)
        assert dict(launches.by_op) == expected_launches

    def asks(expected_launches):
        n = len(asked)
        run(expected_launches)
        return len(asked) - n

    numba = {("numba", "flatten"): 1}
    assert asks(numba) > 0
    assert [asks(numba) for _ in range(3)] == [0, 0, 0], "nothing changed: the resolved pass must stand"
    monkeypatch.setenv("FASTPAR_BACKEND", "torch")
    assert asks({}) > 0 and asks({}) == 0  # (the torch reference backend counts no launch)
    monkeypatch.delenv("FASTPAR_BACKEND")
    assert asks(numba) > 0 and asks(numba) == 0
    with fastpar.use_backend("triton"):
        assert asks({("triton", "flatten"): 1}) > 0 and asks({("triton", "flatten"): 1}) == 0
    assert asks(numba) > 0 and asks(numba) == 0
    _tuning.reload()  # the tables are read again: so are the parameters
    assert asks(numba) > 0 and asks(numba) == 0
    with _tuning.forced({("flatten", "numba"): {"chunk": 1024}}):
        assert asks(numba) > 0 and asks(numba) == 0
    assert asks(numba) > 0 and asks(numba) == 0


def test_resolved_passes_per_bucket_are_bounded():
    # A backend that returned a new result tensor every step must not grow the cache.
    buf = torch.randn(300)
    entry = fddp._Bucket(buf)
    for step in range(3 * fddp._MAX_PASSES_PER_BUCKET):
        result = torch.randn(300, dtype=torch.bfloat16)  # a fresh "all-reduced" tensor
        fddp._launch("unflatten_into", entry, buf, result, None)
        assert torch.equal(buf, result.float()), step
        assert len(entry.passes) <= fddp._MAX_PASSES_PER_BUCKET


def test_resolved_passes_hold_no_bucket():
    # A cached pass must not keep its bucket alive: DDP frees its first-iteration buckets
    # and the cache drops their entries only once their storage is gone.
    import gc

    fddp._buckets.clear()
    buf = torch.randn(1000)
    entry = fddp._buckets.get(buf)
    for be in ["numba", "triton", "torch"]:
        with fastpar.use_backend(be):
            fddp._launch("scale", entry, buf, buf, 0.5)
            low = entry.low.setdefault(torch.bfloat16, torch.empty(1000, dtype=torch.bfloat16))
            fddp._launch("flatten", entry, buf, low, 0.5)
            fddp._launch("unflatten_into", entry, buf, low, None)
    assert len(entry.passes) == 3
    alive = entry.alive
    del buf
    gc.collect()
    assert alive.expired(), "a cached pass keeps the bucket's storage alive"
    fddp._buckets.clear()


# ---------------------------------------------------------------------------------------
# CUDA + NCCL (one GPU): the hooks' compiled Triton passes against torch's own hooks.

NCCL_SCRIPT = """
import torch, torch.distributed as dist, torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as th
import fastpar, fastpar.ddp as fddp

torch.cuda.set_device(0)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)


def run(hook, ours, bucket_view):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)).cuda()
    model = DDP(net, device_ids=[0], gradient_as_bucket_view=bucket_view, bucket_cap_mb=1e-3)
    if ours:
        fddp.register(model, hook)
    else:
        model.register_comm_hook(None, hook)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ops = set()
    for _ in range(3):
        x = torch.randn(8, 16, device="cuda", generator=gen)
        opt.zero_grad()
        with fastpar.count_launches() as n:
            model(x).square().sum().backward()
        ops |= set(n.by_op)
        opt.step()
    return [p.detach().cpu() for p in net.parameters()], ops


# At world size 1 every hook's division is by 1 and a compress hook rounds each gradient
# once: fastpar's fused passes must give torch's hooks' bits.
for bucket_view in (False, True):
    for ours, theirs, passes in ((fddp.allreduce_hook, th.allreduce_hook, False),
                                 (fddp.fp16_compress_hook, th.fp16_compress_hook, True),
                                 (fddp.bf16_compress_hook, th.bf16_compress_hook, True)):
        got, ops = run(ours, True, bucket_view)
        exp, _ = run(theirs, False, bucket_view)
        for i, (a, b) in enumerate(zip(got, exp)):
            assert torch.equal(a, b), (theirs.__name__, bucket_view, i, (a - b).abs().max().item())
        assert all(backend == "triton" for backend, _ in ops), ops
        assert ops or not passes, (theirs.__name__, "no fastpar pass ran")
dist.destroy_process_group()
print("ok")
"""


@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs CUDA and NCCL")
def test_cuda_nccl_hooks_match_torch_hooks_bit_for_bit():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", NCCL_SCRIPT], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout + res.stderr


def test_hooks_take_torch_hooks_argument_names():
    import inspect

    names = lambda f: list(inspect.signature(f).parameters)  # noqa: E731
    assert names(fddp.allreduce_hook) == names(torch_hooks.allreduce_hook) == ["process_group", "bucket"]
    for ours in (fddp.fp16_compress_hook, fddp.bf16_compress_hook, fddp.compress_hook(torch.float16)):
        assert names(ours) == names(torch_hooks.fp16_compress_hook)


# --- found by mutation testing: hook checks, bucket cache, register


def test_first_call_check_is_per_hook(one_rank, monkeypatch):
    # allreduce_hook takes sparse buckets; that must not wave a sparse bucket through a
    # compress hook's check later (same group, device, dtype and layout).
    monkeypatch.setattr(fddp, "_checked", weakref.WeakKeyDictionary())
    sparse = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1, 3), (4, 3), check_invariants=True)
    fddp._check_once(one_rank, sparse, sparse.dtype, "allreduce_hook")
    with pytest.raises(TypeError, match="gradient buckets must be dense to be cast"):
        fddp._check_once(one_rank, sparse, torch.bfloat16, "compress_hook(bfloat16)")


def test_first_call_check_state_goes_with_its_group(monkeypatch):
    # Keyed on the group object, held weakly: a destroyed group's entry goes with it, so a
    # new group (which may take the old one's id) is checked afresh.
    import gc

    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "gloo")
    monkeypatch.setattr(fddp, "_checked", weakref.WeakKeyDictionary())
    group = _FakeGroup(2)
    fddp._check_once(group, torch.zeros(4), torch.bfloat16, "compress_hook(bfloat16)")
    assert len(fddp._checked) == 1
    del group
    gc.collect()
    assert len(fddp._checked) == 0, "a destroyed group's checks must not be reused"


def test_first_call_check_is_per_process_group(one_rank, monkeypatch):
    # Two DDP models on two groups: a check passed on a gloo group says nothing about
    # a group whose backend for CPU tensors is NCCL.
    nccl_group = _FakeGroup(2)
    monkeypatch.setattr(dist, "get_backend_config",
                        lambda group=None: "cpu:nccl,cuda:nccl" if group is nccl_group else "gloo")
    monkeypatch.setattr(fddp, "_checked", weakref.WeakKeyDictionary())
    buf = torch.zeros(4)
    fddp._check_once(one_rank, buf, torch.bfloat16, "compress_hook(bfloat16)")
    with pytest.raises(TypeError, match="only reduces CUDA tensors"):
        fddp._check_once(nccl_group, buf, torch.bfloat16, "compress_hook(bfloat16)")


def test_hooks_follow_a_change_of_world_size_on_the_same_bucket(fake_collectives):
    # Resolved passes are cached per bucket; the scale they were bound with is part of
    # what must match (the same bucket reduced over groups of different sizes).
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    buf = x.clone()
    for n in (2, 4, 2):
        buf.copy_(x)
        got = fddp.allreduce_hook(_FakeGroup(n), _FakeBucket(buf)).wait()
        assert torch.equal(got, x / n), f"allreduce_hook, world size {n}"
        buf.copy_(x)
        got = fddp.bf16_compress_hook(_FakeGroup(n), _FakeBucket(buf)).wait()
        assert torch.equal(got, (x * (1.0 / n)).bfloat16().float()), f"bf16 hook, world size {n}"


def test_hooks_bump_the_buckets_version_counter(fake_collectives):
    # torch's hooks write the bucket with div_/copy_, which autograd sees; fastpar's
    # kernels write through raw pointers and must bump the version themselves.
    for hook in (fddp.allreduce_hook, fddp.bf16_compress_hook):
        buf = torch.randn(100)
        before = buf._version
        hook(_FakeGroup(2), _FakeBucket(buf)).wait()
        assert buf._version > before, hook.__name__


def test_allreduce_hook_averages_a_sparse_bucket_as_torch(fake_collectives):
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.randn(2, 3), (4, 3), check_invariants=True).coalesce()
    got = fddp.allreduce_hook(_FakeGroup(2), _FakeBucket(sparse.clone())).wait()
    exp = torch_hooks.allreduce_hook(_FakeGroup(2), _FakeBucket(sparse.clone())).wait()
    assert torch.equal(got.to_dense(), exp.to_dense())
    assert torch.equal(got.to_dense(), sparse.to_dense() / 2)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("hook", ["allreduce", torch.bfloat16, torch.float16], ids=str)
def test_hooks_on_a_strided_bucket_buffer_write_only_its_elements(fake_collectives, hook, n):
    # A bucket buffer that is not one run of memory (a wrapper hook's bucket.set_buffer
    # of a strided view): the passes, bound to the buffer's address and numel, wrote the
    # first numel elements of memory from there (the view's gaps and past its end) and
    # left the view's own elements unscaled; torch's hooks scale the view itself.
    mine_base = torch.randn(40, generator=torch.Generator().manual_seed(n)) * 3
    theirs_base = mine_base.clone()
    mine, theirs = mine_base[::2], theirs_base[::2]
    if hook == "allreduce":
        got = fddp.allreduce_hook(_FakeGroup(n), _FakeBucket(mine)).wait()
        exp = torch_hooks.allreduce_hook(_FakeGroup(n), _FakeBucket(theirs)).wait()
    else:
        got = fddp.compress_hook(hook)(_FakeGroup(n), _FakeBucket(mine)).wait()
        exp = (theirs * (1.0 / n)).to(hook).float()
        theirs.copy_(exp)
    assert got is mine, "the future must hold the bucket buffer itself"
    assert torch.equal(got, exp)
    assert torch.equal(mine_base, theirs_base), "the hook wrote outside the bucket's elements"


def test_compress_hooks_keep_one_buffer_per_wire_dtype(fake_collectives):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 3
    buf = x.clone()
    for wire in (torch.bfloat16, torch.float16, torch.bfloat16):
        buf.copy_(x)
        got = fddp.compress_hook(wire)(_FakeGroup(2), _FakeBucket(buf)).wait()
        assert torch.equal(got, (x * 0.5).to(wire).float()), f"{wire}"


def test_register_skips_parameters_ddp_ignores(one_rank):
    # A sparse embedding DDP is told to ignore (it is synchronized otherwise) does not
    # reach the hook, so a compress hook may be registered.
    net = nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Linear(3, 1))
    DDP._set_params_and_buffers_to_ignore_for_model(net, ["0.weight"])
    model = DDP(net)
    fddp.register(model, fddp.fp16_compress_hook)
    model(torch.tensor([[1, 2]])).sum().backward()
    assert model.module[1].weight.grad is not None


def test_register_defaults_to_the_models_process_group(one_rank, monkeypatch):
    pg = dist.new_group([0])
    model = DDP(nn.Linear(4, 2), process_group=pg)
    fddp.register(model, fddp.bf16_compress_hook)
    seen = []
    real = dist.all_reduce

    def recording_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        seen.append(group)
        return real(tensor, op=op, group=group, async_op=async_op)

    monkeypatch.setattr(dist, "all_reduce", recording_all_reduce)
    model(torch.randn(3, 4)).sum().backward()
    assert seen and all(g is pg for g in seen), seen


def test_compress_hook_refuses_an_integer_bucket_before_any_collective(one_rank, monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(fddp, "_checked", weakref.WeakKeyDictionary())
    with pytest.raises(TypeError, match="scale needs floating-point tensors"):
        fddp.bf16_compress_hook(one_rank, _FakeBucket(torch.arange(6, dtype=torch.int32)))
    assert calls == []


def test_register_checks_every_gradient_dtype(one_rank, monkeypatch):
    # A float32 parameter checked first must not wave through a float64 one the backend
    # (here a gloo that is told not to reduce float64) cannot reduce.
    monkeypatch.setattr(fddp, "_GLOO_DTYPES", fddp._GLOO_DTYPES - {torch.float64})
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())
    with pytest.raises(TypeError, match=r"cannot all-reduce torch.float64 tensors.*parameter '1.weight'"):
        fddp.register(DDP(net), fddp.allreduce_hook)


def test_bucket_cache_tells_apart_buckets_at_one_address(fake_collectives):
    # A bucket's entry (its bound passes and low-precision buffer) is for its size: a
    # smaller live bucket starting at the same address must not reuse it (the bound
    # passes would write past the smaller bucket's end).
    whole = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    store = whole.clone()
    fddp.bf16_compress_hook(_FakeGroup(2), _FakeBucket(store)).wait()
    store.copy_(whole)
    head = store[:10]
    got = fddp.bf16_compress_hook(_FakeGroup(2), _FakeBucket(head)).wait()
    assert torch.equal(got, (whole[:10] * 0.5).bfloat16().float())
    assert torch.equal(store[10:], whole[10:]), "the hook wrote outside its bucket"


def test_bucket_cache_does_not_hand_a_new_bucket_a_freed_ones_entry(one_rank):
    # A new bucket allocated where a freed one was (same address, size and dtype: what
    # the allocator does after DDP rebuilds its buckets) must get an entry that tracks
    # *its* storage; a stale entry is dropped while in use, its buffers reallocated.
    # frombuffer over one bytearray: a new storage at the freed one's address, for sure.
    import gc

    fddp._buckets.clear()
    memory = bytearray(4 * 4096)
    old = torch.frombuffer(memory, dtype=torch.float32)
    fddp._buckets.get(old)
    del old
    gc.collect()
    new = torch.frombuffer(memory, dtype=torch.float32)
    assert not fddp._buckets.get(new).alive.expired()
    fddp._buckets.clear()


# --- found by a review against torch's DDP: models with fastpar hooks stay copyable


def test_register_keeps_a_default_group_model_copyable(one_rank):
    # DDP pickles and deep-copies itself (its __getstate__) when its group is the default
    # one, as after ddp.register_comm_hook(None, hook). register() stored the model's
    # ProcessGroup as the hook's state, which cannot be pickled: copy.deepcopy(model)
    # and torch.save(model) then raised for every fastpar hook.
    import copy

    model = DDP(Net())
    fddp.register(model, fddp.bf16_compress_hook)
    clone = copy.deepcopy(model)
    assert [h for h, _ in clone._comm_hooks] == [fddp.bf16_compress_hook]
    model(torch.randn(3, 16)).sum().backward()  # and the hook still runs
    model = DDP(Net())
    fddp.register(model, fddp.allreduce_hook)
    assert _saved_and_loaded(model)._comm_hooks == [(fddp.allreduce_hook, None)]


def _saved_and_loaded(obj):
    """``obj`` through ``torch.save`` and ``torch.load`` (in memory)."""
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_compress_hooks_pickle_as_torch_hooks_do(one_rank):
    # torch's fp16/bf16 hooks are module functions, so a DDP model holding one pickles;
    # fastpar's are made per dtype and named apart from torch's, and pickle could not
    # find them by name ("attribute lookup fastpar_compress_hook_bfloat16 ... failed").
    import subprocess
    import sys

    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        hook = fddp.compress_hook(dtype)
        assert pickle.loads(pickle.dumps(hook)) is hook, dtype
    model = DDP(Net())
    model.register_comm_hook(None, fddp.bf16_compress_hook)
    assert _saved_and_loaded(model)._comm_hooks == [(fddp.bf16_compress_hook, None)]
    # A fresh interpreter finds a hook made only on demand here (float32).
    data = pickle.dumps(fddp.compress_hook(torch.float32))
    res = subprocess.run([sys.executable, "-c", "import pickle, sys, fastpar.ddp; "
                          "print(pickle.loads(sys.stdin.buffer.read())._fastpar_wire)"],
                         input=data, capture_output=True, timeout=120)
    assert res.returncode == 0 and res.stdout.decode().strip() == "torch.float32", res.stderr.decode()


def test_sync_params_nonmember_warning_names_the_callers_line_inside_torch_compile(one_rank):
    # Under torch.compile, sync_params runs through its eager entry, whose torch frames
    # sat between the warning's stacklevel and the user's code: the warning for a rank
    # outside the group named torch/_dynamo/eval_frame.py. It names the calling line,
    # as in eager mode.
    import torch._dynamo

    net = Net()
    before = _state(net)

    def f(x):
        fddp.sync_params(net, process_group=dist.GroupMember.NON_GROUP_MEMBER)
        return x * 2

    x = torch.randn(3)
    torch._dynamo.reset()
    try:
        with pytest.warns(UserWarning, match="does not belong to process_group") as eager:
            f(x)
        with pytest.warns(UserWarning, match="does not belong to process_group") as compiled:
            got = torch.compile(f, backend="eager")(x)
    finally:
        torch._dynamo.reset()
    assert torch.equal(got, x * 2)
    assert _unchanged(net, before), "a non-member's sync_params changed the module"
    for seen in (eager, compiled):
        w = next(w for w in seen if "does not belong" in str(w.message))
        assert (w.filename, w.lineno) == (__file__, f.__code__.co_firstlineno + 1), (
            f"the warning names {w.filename}:{w.lineno}, not the call in f")


def test_sync_params_unpacks_without_handing_a_mode_its_internal_call():
    # unflatten_into now hands an active TorchFunctionMode (and __torch_function__
    # subclasses) the call, as flatten does; sync_params's own unpacking step must not
    # show up there as a user call (its packing uses flatten_plain for the same reason).
    src = [torch.randn(3), torch.randn(2, 2)]
    flat = torch.cat([t.reshape(-1) for t in src])
    dst = [torch.full((3,), float("nan")), torch.full((2, 2), float("nan"))]
    with RecordingMode() as mode:
        fddp._unpack(flat, dst)
    assert fastpar.unflatten_into not in mode.seen, mode.seen
    assert all(torch.equal(d, t) for d, t in zip(dst, src))


# ---------------------------------------------------------------------------------------
# A bucket big enough for the streamed cast (two processes).


class BigNet(nn.Module):
    """One 7.08M-element weight (28.3 MB): alone in its bucket with ``bucket_cap_mb=25``,
    and its compress and decompress passes move 42 MB, past the Numba copy kernel's
    32 MiB streaming threshold."""

    def __init__(self):
        super().__init__()
        self.big = nn.Linear(2048, 3456, bias=False)
        self.head = nn.Linear(3456, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.big(x)))


def _big_bucket_worker(rank):
    from fastpar.kernels.ops_numba import flatten as numba_flatten

    casts = set()
    real = numba_flatten._copy_kernel_for

    def recording(*args):  # the last argument: the streamed cast's kinds, or None
        casts.add(args[-1])
        return real(*args)

    numba_flatten._copy_kernel_for = recording
    out = {"casts": casts}
    for name, (hook, bucket_view) in {"fastpar_fp16": ("fastpar_fp16", False),
                                      "fastpar_fp16/bucket_view": ("fastpar_fp16", True),
                                      "fastpar_bf16": ("fastpar_bf16", False),
                                      "torch_fp16": ("torch_fp16", False),
                                      "torch_bf16_logic": ("torch_bf16_logic", False)}.items():
        torch.manual_seed(0)
        net = BigNet()
        model = DDP(net, bucket_cap_mb=25, gradient_as_bucket_view=bucket_view)
        model.register_comm_hook(None, HOOKS[hook])
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.5)
        gen = torch.Generator().manual_seed(1000 + rank)
        grads0 = None
        for step in range(3):
            x, target = torch.randn(4, 2048, generator=gen), torch.randn(4, 4, generator=gen)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), target).backward()
            if step == 0:
                grads0 = [p.grad.clone() for p in net.parameters()]
            opt.step()
        out[name] = {"grads0": grads0, "params": [p.detach().clone() for p in net.parameters()]}
    return out


@pytest.mark.slow
def test_compress_hooks_on_a_bucket_big_enough_to_stream():
    # The DDP compress hooks' passes over a 28 MB float32 bucket take the Numba kernel's
    # streamed cast (vector conversion, non-temporal stores); training with them matches
    # torch's own compress logic, also with gradient_as_bucket_view=True.
    from fastpar.kernels.ops_numba import _common as numba_common

    results = run_ranks(_big_bucket_worker)
    for rank, res in enumerate(results):
        if numba_common.HAS_STREAM:
            assert {("f32", "f16"), ("f16", "f32"), ("f32", "bf16"), ("bf16", "f32")} <= res["casts"], res["casts"]
        else:  # no streaming stores off x86-64: the typed loop everywhere
            assert res["casts"] == {None}, res["casts"]
        for mine, ref, how in [("fastpar_fp16", "torch_fp16", "fp16"), ("fastpar_fp16/bucket_view", "torch_fp16", "fp16"),
                               ("fastpar_bf16", "torch_bf16_logic", "bf16_tight")]:
            (g_rtol, g_atol), (p_rtol, p_atol) = TOLERANCES[how]
            for i, (got, exp) in enumerate(zip(res[mine]["grads0"], res[ref]["grads0"])):
                assert_close(got, exp, what=f"rank {rank} {mine} gradient {i}",
                             tol=(g_rtol, g_atol * float(exp.abs().max())))
            for i, (got, exp) in enumerate(zip(res[mine]["params"], res[ref]["params"])):
                assert_close(got, exp, what=f"rank {rank} {mine} parameter {i}", tol=(p_rtol, p_atol))
    for name in ("fastpar_fp16", "fastpar_bf16"):
        for a, b in zip(results[0][name]["params"], results[1][name]["params"]):
            assert torch.equal(a, b), f"{name}: ranks hold different parameters after training"
