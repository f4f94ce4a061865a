"""fastpar.replicate: torch's semantics, one contiguous buffer per replica, cuDNN-layout
RNN buffers, persistent buffers, and launch counts that grow with devices only."""
from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import fastpar
from fastpar import rnn
from fastpar.replicate import _POOLS, replicate


def small_net(n_linear=2):
    layers = [nn.Linear(6, 6) for _ in range(n_linear)]
    return nn.Sequential(*layers, nn.BatchNorm1d(6), nn.LSTM(6, 4, 2, bidirectional=True, batch_first=True))


def test_replicas_match_and_first_shares_storage():
    net = small_net()
    bn = net[-2]
    bn.running_mean.normal_()  # buffers that differ from their initial values
    bn.running_var.uniform_(0.5, 2.0)
    bn.num_batches_tracked.fill_(7)
    reps = replicate(net, ["cpu", "cpu", "cpu"])
    assert len(reps) == 3
    src = dict(net.named_parameters())
    src_buffers = dict(net.named_buffers())
    for j, r in enumerate(reps):
        for name, t in _plain_tensors(r):
            assert torch.equal(t, src[name])
        got = dict(r.named_buffers())
        assert got.keys() == src_buffers.keys()
        assert all(torch.equal(got[n], b) for n, b in src_buffers.items()), f"replica {j} buffers"
        if j == 0:
            assert all(t.data_ptr() == src[n].data_ptr() for n, t in _plain_tensors(r))
        else:
            assert all(t.data_ptr() != src[n].data_ptr() for n, t in _plain_tensors(r) if t.numel())


def _plain_tensors(replica):
    """Replicas hold parameter copies as plain attributes (as torch's do)."""
    out = []
    for mod_name, m in replica.named_modules():
        for k, v in vars(m).items():
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and k in m._former_parameters:
                out.append((f"{mod_name}.{k}" if mod_name else k, v))
    return out


def test_non_rnn_params_share_one_storage_and_rnn_is_flat():
    net = small_net()
    reps = replicate(net, ["cpu", "cpu"])
    r = reps[1]
    lstm = r[-1]
    rnn_ids = {id(w) for w in lstm._flat_weights}
    others = [t for n, t in _plain_tensors(r) if id(t) not in rnn_ids]
    assert len({t.untyped_storage().data_ptr() for t in others}) == 1
    assert rnn.is_flat(lstm)
    assert lstm._flat_weights[0].storage_offset() == 0


@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("source_flat", [False, True])
def test_rnn_replicas_do_not_repack_in_forward(monkeypatch, detach, source_flat):
    # RNNBase.forward re-runs flatten_parameters() (on CUDA: a fresh buffer and a copy of
    # every weight, every step) when its weights are not the objects _flat_weight_refs
    # remember. Replicas' weights are packed already: forward must leave them alone.
    net = small_net()
    if source_flat:
        rnn.flatten_parameters(net[-1])
    calls = []
    real = nn.RNNBase.flatten_parameters
    monkeypatch.setattr(nn.RNNBase, "flatten_parameters", lambda self: (calls.append(self), real(self))[1])
    reps = replicate(net, ["cpu", "cpu", "cpu"], detach=detach)
    x = torch.randn(2, 3, 6)
    for j, r in enumerate(reps):
        calls.clear()
        lstm = r[-1]
        weights = [getattr(lstm, n) for n in lstm._flat_weights_names]
        out, _ = lstm(x)
        # Replica 0 shares the source's weights: only a packed source is left alone
        # (otherwise torch's flatten_parameters packs it, as it would the source).
        expect_repack = j == 0 and not source_flat and not detach
        assert (calls == [lstm]) == expect_repack, f"replica {j}: flatten_parameters calls {len(calls)}"
        assert all(a is b for a, b in zip(lstm._flat_weights, weights))
        if j > 0:
            assert rnn.is_flat(lstm)
        ref, _ = net[-1](x)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_gradients_flow_back_through_fused_reduce():
    net = small_net().double()
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    reps = replicate(net, ["cpu", "cpu"])
    loss = sum(r[-1](r[:2](xx))[0].sum() for r, xx in zip(reps, x.chunk(2)))
    loss.backward()
    ref = small_net().double()
    ref.load_state_dict(net.state_dict())
    (ref[-1](ref[:2](x[:2]))[0].sum() + ref[-1](ref[:2](x[2:]))[0].sum()).backward()
    for (n, a), b in zip(net.named_parameters(), ref.parameters()):
        if b.grad is None:  # unused (BatchNorm here): zeros through the reduce, as in torch's DataParallel
            assert a.grad is None or not a.grad.any(), n
            continue
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=n)


@pytest.mark.parametrize("be", ["numba", "triton"])
def test_launches_grow_with_devices_not_parameters(be):
    counts = {}
    for n_linear in (1, 12):
        net = nn.Sequential(*[nn.Linear(3, 3) for _ in range(n_linear)])
        for devices in (2, 3):
            x = torch.randn(6, 3)
            with fastpar.use_backend(be), fastpar.count_launches() as n:
                reps = replicate(net, ["cpu"] * devices)
                sum(r(xx).sum() for r, xx in zip(reps, x.chunk(devices))).backward()
            counts[(n_linear, devices)] = n.total
    assert counts[(1, 2)] == counts[(12, 2)] and counts[(1, 3)] == counts[(12, 3)], counts
    assert counts[(12, 2)] <= 2, counts  # one flatten + one fused reduce


def test_buffers_are_reused_and_never_overwritten_while_referenced():
    net = nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5), nn.LSTM(5, 3, batch_first=True))
    old = replicate(net, ["cpu", "cpu"], detach=True)
    snapshot = [t.clone() for _, t in _plain_tensors(old[1])]
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    new = replicate(net, ["cpu", "cpu"], detach=True)
    assert all(torch.equal(a, t) for a, (_, t) in zip(snapshot, _plain_tensors(old[1]))), "old replica changed"
    assert all(torch.equal(t, dict(net.named_parameters())[n]) for n, t in _plain_tensors(new[1]))
    pool = _POOLS[net]
    del old, new
    gc.collect()
    replicate(net, ["cpu", "cpu"], detach=True)  # refills the freed buffers
    before = pool.allocations
    for step in range(3):
        with torch.no_grad():  # what an optimizer step and BatchNorm's update do
            for p in net.parameters():
                p.add_(0.5)
            net[1].running_mean.add_(1.0)
        reps = replicate(net, ["cpu", "cpu"], detach=True)
        # Refilled, not found holding the previous step's values.
        params, buffers = dict(net.named_parameters()), dict(net.named_buffers())
        assert all(torch.equal(t, params[n]) for n, t in _plain_tensors(reps[1])), step
        assert all(torch.equal(b, buffers[n]) for n, b in reps[1].named_buffers()), step
        del reps
    assert pool.allocations == before, "steady state allocates nothing"


def test_pool_keeps_a_few_buffers_per_slot_and_reuses_them():
    # Replicas held at once (two forwards before a backward) each get a buffer; once
    # they die, the next calls refill those instead of allocating. Held beyond the
    # pool's bound, the extra buffers are let go with their replicas.
    net = nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5))
    held = [replicate(net, ["cpu", "cpu"], detach=True) for _ in range(2)]
    pool = _POOLS[net]
    before = pool.allocations
    del held
    gc.collect()
    for step in range(3):
        with torch.no_grad():
            net[0].weight.add_(1.0)
        held = [replicate(net, ["cpu", "cpu"], detach=True) for _ in range(2)]
        params = dict(net.named_parameters())
        for reps in held:
            assert all(torch.equal(t, params[n]) for n, t in _plain_tensors(reps[1])), step
        assert held[0][1][0].weight.data_ptr() != held[1][1][0].weight.data_ptr()
        del held, reps
    assert pool.allocations == before, "two sets of replicas at a time: steady state allocates nothing"
    held = [replicate(net, ["cpu", "cpu"], detach=True) for _ in range(pool.per_key + 3)]
    assert all(len(entries) <= pool.per_key for entries in pool._slots.values())
    weights = [reps[1][0].weight.clone() for reps in held]
    with torch.no_grad():
        net[0].weight.add_(1.0)
    replicate(net, ["cpu", "cpu"], detach=True)  # (all held: a new buffer, none refilled)
    assert all(torch.equal(reps[1][0].weight, w) for reps, w in zip(held, weights)), "a held buffer was refilled"


def test_replacing_an_rnn_does_not_grow_the_pool():
    # The RNN buffers were kept under id(module): every new LSTM put in the network (the
    # old ones still alive elsewhere) added slots that stayed as long as the network.
    net = nn.Sequential(nn.Linear(5, 5), nn.LSTM(5, 3, batch_first=True))
    kept = []
    for step in range(6):
        kept.append(net[1])
        net[1] = nn.LSTM(5, 3, batch_first=True)
        reps = replicate(net, ["cpu", "cpu"], detach=True)
        params = dict(net.named_parameters())
        assert all(torch.equal(t, params[n]) for n, t in _plain_tensors(reps[1])), step
        del reps
        if step == 0:
            slots = len(_POOLS[net]._slots)
    assert len(_POOLS[net]._slots) == slots, "each replaced RNN left its buffers in the pool"


def test_replica_buffers_held_through_their_storage_object_are_not_refilled():
    # A replica's weight kept only as its Python storage object (no tensor): the use count
    # does not see it, the pool must.
    net = small_net()
    reps = replicate(net, ["cpu", "cpu"], detach=True)
    w = reps[1][0].weight
    st, off, n = w.untyped_storage(), w.storage_offset(), w.numel()
    before = w.detach().clone().reshape(-1)
    del reps, w
    gc.collect()
    with torch.no_grad():
        net[0].weight.add_(1.0)
    new = replicate(net, ["cpu", "cpu"], detach=True)
    kept = torch.empty(0).set_(st, off, (n,))
    assert torch.equal(kept, before), "a buffer still referenced through its storage object was refilled"
    assert torch.equal(new[1][0].weight, net[0].weight)


def test_replica_buffers_weakly_referenced_through_their_storage_are_not_refilled():
    # Only a weak reference to a replica weight's storage object is kept: with torch's
    # replicate it would be dead once the replicas are; the pool keeps the object alive,
    # so it must not refill the buffer that reference can still reach.
    import weakref

    net = small_net()
    reps = replicate(net, ["cpu", "cpu"], detach=True)
    w = reps[1][0].weight
    ref, off, n = weakref.ref(w.untyped_storage()), w.storage_offset(), w.numel()
    before = w.detach().clone().reshape(-1)
    del reps, w
    gc.collect()
    with torch.no_grad():
        net[0].weight.add_(1.0)
    new = replicate(net, ["cpu", "cpu"], detach=True)
    st = ref()
    if st is not None:
        kept = torch.empty(0).set_(st, off, (n,))
        assert torch.equal(kept, before), "a buffer still weakly referenced through its storage was refilled"
    assert torch.equal(new[1][0].weight, net[0].weight)


def test_concurrent_replicates_never_share_a_buffer():
    import threading
    import sys

    net = small_net()
    replicate(net, ["cpu", "cpu"], detach=True)  # the pool's buffers exist and are free
    gc.collect()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible inside get()
    try:
        for _ in range(20):
            got = [None, None]

            def run(i):
                got[i] = replicate(net, ["cpu", "cpu"], detach=True)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            a, b = (g[1][0].weight for g in got)
            assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr(), "two replicas share a buffer"
            del got, a, b
            gc.collect()
    finally:
        sys.setswitchinterval(old)


def test_buffers_requiring_grad_are_differentiable():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.ones(3, requires_grad=True))

        def forward(self, x):
            return x * self.scale

    m = M()
    reps = replicate(m, ["cpu", "cpu"])
    sum(r(torch.ones(3)).sum() for r in reps).backward()
    assert torch.equal(m.scale.grad, torch.full((3,), 2.0))
    reps = replicate(m, ["cpu", "cpu"], detach=True)
    assert not reps[1].scale.requires_grad


def test_buffers_requiring_grad_with_no_grad_forwards_between_allocate_nothing():
    # A training step (the buffer requiring grad goes through Broadcast, the others are
    # copied detached) alternated with a no_grad forward (every buffer copied detached):
    # the two modes' detached buffers differ in size, and one slot held both, so each
    # switch found it the wrong size and allocated it anew.
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4, requires_grad=True))
            self.register_buffer("shift", torch.zeros(4))

        def forward(self, x):
            return self.lin(x) * self.scale + self.shift

    net = M()
    for step in range(4):
        reps = replicate(net, ["cpu", "cpu"])
        sum(r(torch.ones(2, 4)).sum() for r in reps).backward()
        del reps
        reps = replicate(net, ["cpu", "cpu"], detach=True)
        buffers = dict(net.named_buffers())
        assert all(torch.equal(b, buffers[n]) for n, b in reps[1].named_buffers()), step
        del reps
        if step == 0:
            before = _POOLS[net].allocations
    assert _POOLS[net].allocations == before, "steady state allocates nothing"


def test_replicate_network_not_on_first_device():
    # (meta stands in for a device the network is not on; torch raises here too)
    with pytest.raises(RuntimeError, match=r"parameter 'weight' is on meta, but every parameter and buffer must be on devices\[0\] \(cpu\)"):
        replicate(nn.Linear(2, 2).to("meta"), ["cpu", "cpu"])


def test_replicate_bad_input():
    with pytest.raises(ValueError, match="must not repeat a CUDA device"):
        replicate(nn.Linear(2, 2), [0, 0])
    assert replicate(nn.Linear(2, 2), []) == []


class _Tied(nn.Module):
    """A tied weight (one Parameter in two modules), a None parameter and buffer, and a
    module reached twice: what network.parameters()/buffers() deduplicate."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight
        self.shared = nn.BatchNorm1d(4)
        self.again = self.shared
        self.register_buffer("nothing", None)
        self.register_parameter("absent", None)

    def forward(self, x):
        return self.again(self.b(self.a(x)))


def test_replicate_lists_tensors_as_torch_does():
    from fastpar.replicate import _members
    net = _Tied()
    modules = list(net.modules())
    assert _members(modules, "_parameters") == list(net.parameters())
    assert [id(b) for b in _members(modules, "_buffers")] == [id(b) for b in net.buffers()]
    reps = replicate(net, ["cpu", "cpu"])
    x = torch.randn(5, 4)
    net.eval()
    for r in reps:
        r.eval()
        assert torch.allclose(r(x), net(x))
    assert reps[1].b.weight is reps[1].a.weight, "a tied weight must stay tied in the replica"


def test_replicate_asks_a_class_that_lists_its_own_parameters():
    from fastpar.replicate import _plain_members

    class Listed(nn.Module):
        # Overrides parameters(): replicate must call it, as torch's does, rather than
        # read the modules' _parameters itself.
        def __init__(self):
            super().__init__()
            self.keep = nn.Parameter(torch.ones(3))

        def parameters(self, recurse=True):
            yield self.keep

    net = Listed()
    assert not _plain_members(net) and _plain_members(nn.Linear(2, 2))
    reps = replicate(net, ["cpu", "cpu"])
    assert torch.equal(reps[1].keep, net.keep) and reps[1].keep.data_ptr() != net.keep.data_ptr()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_replica_on_source_device_shares_storage():
    net = small_net().cuda()
    [rep] = replicate(net, [0])
    for (name, p), (_, q) in zip(net.named_parameters(), rep.named_parameters()):
        assert q.data_ptr() == p.data_ptr(), name
    x = torch.randn(3, 5, 6, device="cuda")
    net.eval(), rep.eval()
    assert torch.equal(rep[:-1](x[:, 0]), net[:-1](x[:, 0]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_refilled_on_another_stream_waits_for_the_last():
    """A replica buffer the host let go may still be read by kernels queued on the
    stream current when it was handed out; refilled while another stream is current,
    that stream first waits for them."""
    from fastpar.replicate import _BufferPool

    pool, dev = _BufferPool(), torch.device("cuda", torch.cuda.current_device())
    first, second = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    with torch.cuda.stream(first):
        buf = pool.get("params", 1 << 24, dev)
        buf.fill_(1)
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time queued on `first`
        seen = buf.clone()  # the last replicas' read, behind the sleep
    del buf
    with torch.cuda.stream(second):
        again = pool.get("params", 1 << 24, dev)
        again.fill_(2)  # the next call's refill
    assert pool.allocations == 1, "the buffer must be the one reused"
    torch.cuda.synchronize()
    assert bool((seen == 1).all()), "the refill on another stream overtook the last read"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_reuses_an_idle_buffer():
    """UntypedStorage.is_shared() is True for every CUDA storage: asked as for host
    buffers, it made every CUDA buffer look dead, and the pool allocated every call."""
    from fastpar.replicate import _BufferPool

    pool, dev = _BufferPool(), torch.device("cuda", torch.cuda.current_device())
    first = pool.get("params", 1 << 20, dev)
    ptr = first.data_ptr()
    del first
    again = pool.get("params", 1 << 20, dev)
    assert again.data_ptr() == ptr and pool.allocations == 1, "an idle CUDA buffer must be reused"
    held = pool.get("params", 1 << 20, dev)  # `again` still refers to it: a new one
    assert held.data_ptr() != ptr and pool.allocations == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pool_buffer_read_on_a_later_stream_is_not_reallocated_under_the_read():
    """A buffer allocated on one stream and handed out again on another: once the pool
    lets it go, the caching allocator must not give its memory to work on the first
    stream while the second still reads it (the pool record_stream-s each handout)."""
    from fastpar.replicate import _BufferPool

    n = 1 << 24
    pool, dev = _BufferPool(), torch.device("cuda", torch.cuda.current_device())
    first, second = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    with torch.cuda.stream(first):
        buf = pool.get("params", n, dev)  # allocated on `first`
        buf.fill_(1)
    del buf
    with torch.cuda.stream(second):
        buf = pool.get("params", n, dev)  # reused on `second`, after `first`
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU time queued on `second`
        seen = buf.clone()  # a replica's read on `second`, behind the sleep
    assert pool.allocations == 1
    del buf, pool  # the buffer goes back to the caching allocator
    with torch.cuda.stream(first):
        other = torch.empty(n, dtype=torch.uint8, device=dev)  # the same block, if it were free
        other.fill_(2)
    torch.cuda.synchronize()
    assert bool((seen == 1).all()), "the buffer was reallocated and written while a later stream read it"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_cuda_replicate_steady_state_allocates_nothing():
    # Three devices where there are: RNN staging on the source serves every other device.
    devices = list(range(min(torch.cuda.device_count(), 3)))
    net = nn.Sequential(nn.Linear(5, 5), nn.BatchNorm1d(5), nn.LSTM(5, 3, batch_first=True)).cuda(devices[0])
    for _ in range(2):
        replicate(net, devices, detach=True)
        gc.collect()
    pool = _POOLS[net]
    before = pool.allocations
    for step in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.5)
        reps = replicate(net, devices, detach=True)
        params = dict(net.named_parameters())
        for r in reps[1:]:
            assert all(torch.equal(t.cpu(), params[n].cpu()) for n, t in _plain_tensors(r)), step
        del reps
        gc.collect()
    assert pool.allocations == before, "steady state allocates nothing"


def test_third_order_gradient_through_replicate_counts_every_replica():
    """ReduceAddCoalesced's backward is differentiable (BroadcastCoalesced), as torch's:
    a plain broadcast there cut replicas 1.. out of higher-order graphs, so a third
    derivative saw replica 0's half of the batch only."""
    from fastpar._functions import ReduceAddCoalesced

    torch.manual_seed(0)
    devs = [torch.device("cpu")] * 2
    a, b = (torch.randn(3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    f = lambda a, b: ReduceAddCoalesced.apply(torch.device("cpu"), 1, devs, a, b)
    assert torch.autograd.gradcheck(f, (a, b))
    (s,) = f(a, b)
    g = torch.randn(3, dtype=torch.float64, requires_grad=True)
    ga, gb = torch.autograd.grad(s, (a, b), grad_outputs=g, create_graph=True)
    assert ga.requires_grad and gb.requires_grad

    m = nn.Linear(2, 1, bias=False).double()
    x = torch.randn(4, 2, dtype=torch.float64)

    def third(forward):
        u = torch.ones(4, 1, dtype=torch.float64, requires_grad=True)
        (gw,) = torch.autograd.grad(forward(), m.weight, grad_outputs=u, create_graph=True)
        v = torch.ones_like(gw, requires_grad=True)
        (j,) = torch.autograd.grad(gw, u, grad_outputs=v, create_graph=True)
        (k,) = torch.autograd.grad(j.pow(2).sum(), v)
        return k

    dp = fastpar.DataParallel(m, device_ids=["cpu", "cpu"])
    torch.testing.assert_close(third(lambda: dp(x)), third(lambda: m(x)))


def test_replicas_made_after_inference_mode_train():
    """A replica buffer first filled under ``torch.inference_mode()`` and refilled
    outside it gives ordinary parameters (views made outside inference mode)."""
    import gc

    m = nn.Linear(64, 64)
    with torch.inference_mode():
        reps = replicate(m, ["cpu", "cpu"])
        assert reps[1].weight.is_inference()
    del reps
    gc.collect()
    reps = replicate(m, ["cpu", "cpu"])
    assert not reps[1].weight.is_inference()
    reps[1](torch.randn(3, 64)).sum().backward()
    assert m.weight.grad is not None


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_a_quantized_buffer_is_refused_before_anything_is_made():
    """A quantized buffer's copies would be its integers without its quantizer (they
    reported ``is_quantized`` False with a qint8 dtype, and ``copy_`` on them raised):
    refused, naming the buffer; one device needs no copy and is left alone."""
    m = nn.Linear(3, 3)
    m.register_buffer("q", torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8))
    with pytest.raises(TypeError, match=r"replicate: network's buffer 'q': quantized tensors \(torch.qint8\)"):
        replicate(m, ["cpu", "cpu"])
    assert m not in _POOLS, "nothing is made for a refused call"
    (only,) = replicate(m, ["cpu"])
    assert only.q.is_quantized and torch.equal(only.q.int_repr(), m.q.int_repr())


def test_sparse_buffers_and_parameters_replicate_and_train():
    """Sparse COO buffers are copied as torch's broadcast_coalesced copies them; a sparse
    parameter (where torch's Broadcast fails: autograd cannot make a view of it) gets an
    alias on the first device and copies elsewhere, and its gradient sums as sparse."""
    torch.manual_seed(0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 4, dtype=torch.float64).to_sparse())
            self.lin = nn.Linear(6, 3, dtype=torch.float64)
            self.register_buffer("shift", torch.randn(6, 3, dtype=torch.float64).relu().to_sparse())

        def forward(self, x):
            h = torch.sparse.mm(self.w, x.t()).t().tanh()
            return self.lin(h) + self.shift.to_dense().sum(0)

    net = Net()
    x = torch.randn(5, 4, dtype=torch.float64)
    net(x).pow(2).sum().backward()
    ref = {k: p.grad.to_dense().clone() for k, p in net.named_parameters()}
    expected = net(x).detach()
    net.zero_grad(set_to_none=True)
    reps = replicate(net, ["cpu", "cpu", "cpu"])
    for r in reps[1:]:
        assert r.shift.layout == r.w.layout == torch.sparse_coo
        assert torch.equal(r.shift.to_dense(), net.shift.to_dense()) and torch.equal(r.w.to_dense(), net.w.to_dense())
        assert r.w._values().data_ptr() != net.w._values().data_ptr()
    assert reps[0].w._values().data_ptr() == net.w._values().data_ptr()  # replica 0's is an alias
    dp = fastpar.DataParallel(net, device_ids=["cpu", "cpu", "cpu"])
    y = dp(x)
    torch.testing.assert_close(y, expected, rtol=1e-12, atol=1e-12)
    y.pow(2).sum().backward()
    assert net.w.grad.layout == torch.sparse_coo
    for k, p in net.named_parameters():
        torch.testing.assert_close(p.grad.to_dense(), ref[k], rtol=1e-12, atol=1e-12, msg=lambda m: f"{k}: {m}")

    # One replica (a batch smaller than the device count): the reduction's sums are the
    # gradients themselves, returned from an autograd Function, as aliases.
    net.zero_grad(set_to_none=True)
    dp(x[:1]).pow(2).sum().backward()
    single = net.w.grad.to_dense().clone()
    net.zero_grad(set_to_none=True)
    net(x[:1]).pow(2).sum().backward()
    torch.testing.assert_close(single, net.w.grad.to_dense(), rtol=1e-12, atol=1e-12)

    # Second order: the reduction's backward broadcasts the sparse gradient.
    def second(model):
        g, = torch.autograd.grad(model(x).pow(2).sum(), net.w, create_graph=True)
        return torch.autograd.grad(g.to_dense().pow(2).sum(), net.w)[0].to_dense()
    torch.testing.assert_close(second(dp), second(net), rtol=1e-12, atol=1e-12)


def test_rnn_buffers_are_reused_with_three_host_replicas():
    net = nn.Sequential(nn.Linear(5, 5), nn.LSTM(5, 3, batch_first=True))
    replicate(net, ["cpu"] * 3, detach=True)
    gc.collect()
    replicate(net, ["cpu"] * 3, detach=True)
    gc.collect()
    pool = _POOLS[net]
    before = pool.allocations
    for _ in range(3):
        reps = replicate(net, ["cpu"] * 3, detach=True)
        assert all(torch.equal(r[1].weight_hh_l0, net[1].weight_hh_l0) for r in reps)
        del reps
        gc.collect()
    assert pool.allocations == before, "steady state allocates nothing"


@pytest.mark.parametrize("replicas", [2, 3])
def test_host_rnn_packs_are_not_bound(monkeypatch, replicas):
    """replicate packs host replicas' RNNs into new views of pooled buffers every step:
    binding them (rnn.pack binds a caller's out= for its next call) cost about 30 us a
    RNN a step and never hit. With one extra host replica the pack took no more_outs and
    was bound every step."""
    net = nn.Sequential(nn.Linear(5, 5), nn.LSTM(5, 3, 2, batch_first=True))
    binds = []
    real = rnn._bind_pack
    monkeypatch.setattr(rnn, "_bind_pack", lambda *a, **kw: binds.append(1) or real(*a, **kw))
    for _ in range(4):
        reps = replicate(net, ["cpu"] * replicas, detach=True)
        for r in reps[1:]:
            assert rnn.is_flat(r[1])
            for name in net[1]._flat_weights_names:
                assert torch.equal(getattr(r[1], name), getattr(net[1], name)), name
        del reps
        gc.collect()
    assert binds == []


def test_rnn_with_weights_of_two_dtypes_replicates_generically():
    m = nn.GRU(3, 4)
    m.bias_hh_l0.data = m.bias_hh_l0.data.double()
    reps = replicate(m, ["cpu", "cpu"])
    for n, p in m.named_parameters():
        q = getattr(reps[1], n)
        assert q.dtype == p.dtype and torch.equal(q, p), n


def test_rnns_sharing_a_weight():
    """A replica's weight is one tensor in one buffer: of two RNNs sharing a Parameter,
    the first is packed and the second holds the shared weight where the first's layout
    put it (the tie kept); an RNN repeating one Parameter is not packed (found by the
    replicate property: the second RNN's pack overwrote the first's view, leaving the
    first unpacked after a wasted pack)."""
    a, b, c = nn.GRU(4, 4), nn.GRU(4, 4), nn.GRU(4, 4)
    b.weight_hh_l0 = a.weight_hh_l0
    c.weight_ih_l0 = c.weight_hh_l0
    net = nn.Sequential(a, b, c)
    with fastpar.count_launches() as n:
        reps = replicate(net, ["cpu", "cpu", "cpu"])
    for j in (1, 2):
        ra, rb, rc = reps[j]
        assert rnn.is_flat(ra), f"replica {j}: the first RNN is packed"
        assert rb.weight_hh_l0 is ra.weight_hh_l0 and rc.weight_ih_l0 is rc.weight_hh_l0, f"replica {j}: ties"
        for m, r in zip(net, reps[j]):
            for name, p in m.named_parameters():
                assert torch.equal(getattr(r, name), p), f"replica {j}: {name}"
    # One launch for the plain copies (one dtype), one packing the first RNN for both
    # replicas: no pack for the others.
    assert n.total == 2, n.by_op


def test_global_registration_hooks_fire_for_replica_buffers():
    from torch.nn.modules.module import register_module_buffer_registration_hook
    seen = []
    handle = register_module_buffer_registration_hook(lambda mod, name, buf: seen.append((type(mod).__name__, name)))
    try:
        net = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
        seen.clear()
        replicate(net, ["cpu", "cpu"])  # torch's replicate: setattr -> register_buffer -> hook
    finally:
        handle.remove()
    names = [n for n, _ in net[1].named_buffers()]
    assert sorted(seen) == sorted(("BatchNorm1d", n) for n in names for _ in range(2))


def test_frozen_parameter_copies_do_not_require_grad():
    net = nn.Linear(2, 2)
    net.bias.requires_grad_(False)
    reps = replicate(net, ["cpu", "cpu"])
    for r in reps:
        assert r.weight.requires_grad and not r.bias.requires_grad


def test_backward_reduces_only_the_parameters_that_need_a_gradient(monkeypatch):
    """Autograd hands zeros for the frozen parameters' (non-differentiable) copies;
    Broadcast's backward summed them too, every step (a frozen backbone: all of it),
    and threw the sums away. Only the trainable ones are reduced now."""
    import copy

    from fastpar import comm

    reduced = []
    real = comm.reduce_add_coalesced

    def spy(inputs, destination=None, *args, **kwargs):
        reduced.append([t.shape for t in inputs[0]])
        return real(inputs, destination, *args, **kwargs)

    monkeypatch.setattr(comm, "reduce_add_coalesced", spy)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3), nn.Linear(3, 2)).double()
    for p in [net[0].weight, net[0].bias, net[1].bias]:
        p.requires_grad_(False)
    ref = copy.deepcopy(net)
    x = torch.randn(4, 5, dtype=torch.float64)
    reps = replicate(net, ["cpu", "cpu"])
    sum(r(xx).sum() for r, xx in zip(reps, x.chunk(2))).backward()
    assert reduced == [[net[1].weight.shape, net[2].weight.shape, net[2].bias.shape]]
    ref(x).sum().backward()
    for (n, a), b in zip(net.named_parameters(), ref.parameters()):
        if b.grad is None:
            assert a.grad is None, n
        else:
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12, msg=n)


def test_pool_allocates_anew_when_the_network_grows():
    net = nn.Sequential(nn.Linear(2, 2))
    replicate(net, ["cpu", "cpu"], detach=True)  # its buffers are free again at once
    gc.collect()
    net[0] = nn.Linear(40, 40)  # the parameters now need more bytes than the kept buffer
    r = replicate(net, ["cpu", "cpu"], detach=True)[1]
    assert torch.equal(r[0].weight, net[0].weight) and torch.equal(r[0].bias, net[0].bias)


def test_replicate_runs_eagerly_while_a_torch_tracer_sets_is_compiling(monkeypatch):
    # With torch.compiler.is_compiling() true and dynamo not tracing
    # (torch.export(strict=False)), replicate called its eager entry, which called it
    # again, until a RecursionError. It runs as eager now.
    from conftest import compiling_flag_on

    net = small_net()
    compiling_flag_on(monkeypatch)
    reps = replicate(net, ["cpu", "cpu"])
    src = dict(net.named_parameters())
    for j, r in enumerate(reps):
        for name, t in _plain_tensors(r):
            assert torch.equal(t, src[name]), f"replica {j}: {name}"


# ---------------------------------------------------------------------------------------
# Properties (hypothesis): random module trees against torch.nn.parallel.replicate itself,
# its device copies done on the host (torch's own replicate needs CUDA devices).

import sys  # noqa: E402

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import assert_same_bits, seeded  # noqa: E402

D = 4  # every leaf maps (rows, D) to (rows, D)


class _HostBroadcast(torch.autograd.Function):
    """torch's ``Broadcast`` with host copies: device 0's outputs are the inputs
    themselves (as ``comm.broadcast_coalesced`` returns them), the others clones;
    outputs of inputs that need no gradient are non-differentiable; backward sums the
    copies' gradients (absent ones materialised as zeros, as in torch)."""

    @staticmethod
    def forward(ctx, n, *inputs):
        ctx.n = n
        outs = [list(inputs)] + [[t.clone() for t in inputs] for _ in range(n - 1)]
        ctx.mark_non_differentiable(*[o[i] for o in outs for i, need in enumerate(ctx.needs_input_grad[1:]) if not need])
        return tuple(t for o in outs for t in o)

    @staticmethod
    def backward(ctx, *grads):
        k = len(grads) // ctx.n
        return (None, *[sum(grads[i + j * k] for j in range(ctx.n)) for i in range(k)])


def _host_broadcast_coalesced_reshape(tensors, devices, detach=False):
    if not tensors:
        return []
    if detach:
        return [list(tensors)] + [[t.detach().clone() for t in tensors] for _ in devices[1:]]
    copies = _HostBroadcast.apply(len(devices), *tensors)
    return [list(copies[i : i + len(tensors)]) for i in range(0, len(copies), len(tensors))]


def torch_replicate(network, n, detach):
    """``torch.nn.parallel.replicate`` on ``n`` host "devices"."""
    mod = sys.modules["torch.nn.parallel.replicate"]
    real = mod._broadcast_coalesced_reshape
    mod._broadcast_coalesced_reshape = _host_broadcast_coalesced_reshape
    try:
        return mod.replicate(network, list(range(n)), detach=detach)
    finally:
        mod._broadcast_coalesced_reshape = real


class Leaf(nn.Module):
    """Parameters (one maybe frozen, an integer one that is frozen), buffers of several
    dtypes (one maybe requiring grad, one non-persistent), a None parameter and buffer."""

    def __init__(self, dtype, scale_rg):
        super().__init__()
        self.dtype = dtype
        self.w = nn.Parameter(torch.ones(D, dtype=dtype))
        self.b = nn.Parameter(torch.zeros(D, dtype=dtype))
        self.steps = nn.Parameter(torch.arange(D, dtype=torch.int32), requires_grad=False)
        self.register_buffer("scale", torch.ones(D, dtype=dtype, requires_grad=scale_rg))
        self.register_buffer("count", torch.zeros(D, dtype=torch.int64))
        self.register_buffer("mask", torch.ones(D, dtype=torch.bool))
        self.register_buffer("extra", torch.zeros(D, dtype=torch.float16), persistent=False)
        self.register_buffer("nothing", None)
        self.register_parameter("absent", None)

    def forward(self, x):
        y = x.to(self.dtype) * self.w * self.scale + self.b
        y = torch.where(self.mask, y, -y) + self.count + self.steps + self.extra
        return y.to(torch.float64)


class RNNLeaf(nn.Module):
    """An RNN whose output has D features, run over the rows as one sequence."""

    def __init__(self, kind, bidirectional, proj, num_layers, dtype):
        super().__init__()
        self.dtype = dtype
        ndir = 2 if bidirectional else 1
        out = D // ndir
        kw = dict(num_layers=num_layers, bidirectional=bidirectional, dtype=dtype)
        if kind == "LSTM":
            self.rnn = nn.LSTM(D, out + 1, proj_size=out, **kw) if proj else nn.LSTM(D, out, **kw)
        else:
            self.rnn = getattr(nn, kind)(D, out, **kw)

    def forward(self, x):
        return self.rnn(x.to(self.dtype))[0].to(torch.float64)


def run_tree(m, x):
    """The forward of a tree of containers (run in order) and leaves, in float64."""
    if isinstance(m, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        for child in (m.values() if isinstance(m, nn.ModuleDict) else m):
            x = run_tree(child, x)
        return x
    if isinstance(m, nn.Linear):
        return m(x.to(m.weight.dtype)).to(torch.float64)
    if isinstance(m, nn.BatchNorm1d):
        return m(x.to(m.running_mean.dtype)).to(torch.float64)
    return m(x)


@st.composite
def module_trees(draw):
    """A random tree (depth <= 3) of Sequential / ModuleList / ModuleDict over leaves
    (Linear, BatchNorm1d, Leaf, an RNN), some subtrees reached twice, some parameters
    tied to another of their shape and dtype, some frozen, some modules in eval mode."""
    made = []

    def leaf():
        kind = draw(st.sampled_from(["Linear", "BatchNorm1d", "Leaf", "RNN"]))
        dtype = draw(st.sampled_from([torch.float32, torch.float64]))
        if kind == "Linear":
            return nn.Linear(D, D, bias=draw(st.booleans()), dtype=dtype)
        if kind == "BatchNorm1d":
            return nn.BatchNorm1d(D, affine=draw(st.booleans()), dtype=dtype)
        if kind == "Leaf":
            return Leaf(draw(st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16])),
                        draw(st.booleans()))
        rnn_kind = draw(st.sampled_from(["LSTM", "GRU", "RNN"]))
        return RNNLeaf(rnn_kind, draw(st.booleans()), rnn_kind == "LSTM" and draw(st.booleans()),
                       draw(st.integers(1, 2)), dtype)

    def node(depth):
        if made and draw(st.integers(0, 6)) == 0:
            return draw(st.sampled_from(made))  # a subtree reached twice
        if depth >= 3 or draw(st.integers(0, 2)) == 0:
            m = leaf()
        else:
            children = [node(depth + 1) for _ in range(draw(st.integers(1, 3)))]
            kind = draw(st.sampled_from(["Sequential", "ModuleList", "ModuleDict"]))
            if kind == "ModuleDict":
                m = nn.ModuleDict({f"k{i}": c for i, c in enumerate(children)})
            else:
                m = nn.Sequential(*children) if kind == "Sequential" else nn.ModuleList(children)
        made.append(m)
        return m

    root = node(0)
    if not isinstance(root, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        root = nn.Sequential(root)
    slots = [(m, k) for m in root.modules() for k, p in m._parameters.items() if p is not None]
    for i, (m, k) in enumerate(slots):
        p = m._parameters[k]
        same = [(a, b) for a, b in slots[:i] if a._parameters[b].shape == p.shape and a._parameters[b].dtype == p.dtype
                and a._parameters[b] is not p]
        if same and draw(st.integers(0, 4)) == 0:
            a, b = draw(st.sampled_from(same))
            setattr(m, k, a._parameters[b])  # tied (RNNBase.__setattr__ keeps _flat_weights in step)
    for p in root.parameters():
        if p.is_floating_point() and draw(st.integers(0, 5)) == 0:
            p.requires_grad_(False)
    for m in root.modules():
        if draw(st.integers(0, 4)) == 0:
            m.eval()
    return root


def fill_(net, gen):
    """Fresh values from ``gen`` in every parameter and buffer (positive running_var)."""
    with torch.no_grad():
        for name, t in [*net.named_parameters(), *net.named_buffers()]:
            if t.dtype == torch.bool:
                t.copy_(torch.rand(t.shape, generator=gen) < 0.7)
            elif not t.is_floating_point():
                t.copy_(torch.randint(-5, 6, t.shape, generator=gen))
            elif name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=gen) + 0.5)
            else:
                t.copy_(torch.randn(t.shape, generator=gen))


def _state(replica):
    """Per module (in ``modules()`` order): type, training flag, children's indices, and
    every parameter slot and buffer as (name, tensor or None)."""
    modules = list(replica.modules())
    index = {id(m): i for i, m in enumerate(modules)}
    out = []
    for m in modules:
        children = {k: None if c is None else index[id(c)] for k, c in m._modules.items()}
        params = [(k, m._parameters.get(k, m.__dict__.get(k))) for k in sorted({*m._parameters, *m.__dict__.get("_former_parameters", ())})]
        buffers = [(k, m._buffers[k]) for k in m._buffers]
        out.append((type(m), m.training, children, sorted(m._parameters), params, buffers,
                    set(m._non_persistent_buffers_set)))
    return out


def _tensors(state):
    return [t for *_, params, buffers, _ in state for _, t in params + buffers if t is not None]


def _pattern(tensors):
    """Which of ``tensors`` are the same object: index of each one's first occurrence."""
    first = {}
    return [first.setdefault(id(t), i) for i, t in enumerate(tensors)]


def _check_like_torch(net, fp_reps, th_reps, detach):
    src = _state(net)
    for j, (f, r) in enumerate(zip(fp_reps, th_reps)):
        fs, rs = _state(f), _state(r)
        assert len(fs) == len(rs) == len(src), f"replica {j}: {len(fs)} modules, torch's {len(rs)}"
        for i, (a, b) in enumerate(zip(fs, rs)):
            assert a[:4] == b[:4], f"replica {j}, module {i}: type, training, children, _parameters keys"
            assert a[6] == b[6], f"replica {j}, module {i}: non-persistent buffers"
            for (ka, ta), (kb, tb), (ks, ts) in zip(a[4] + a[5], b[4] + b[5], src[i][4] + src[i][5]):
                what = f"replica {j}, module {i} ({a[0].__name__}).{ka}"
                assert ka == kb and (ta is None) == (tb is None), what
                if ta is None:
                    continue
                assert type(ta) is type(tb) or detach and j == 0, f"{what}: {type(ta).__name__}, torch's {type(tb).__name__}"
                assert ta.requires_grad == tb.requires_grad, f"{what}: requires_grad"
                assert (ta.grad_fn is None) == (tb.grad_fn is None), f"{what}: grad_fn {ta.grad_fn}, torch's {tb.grad_fn}"
                assert_same_bits(ta.detach(), tb.detach(), what)
                assert (ta is ts) == (tb is ts), f"{what}: is the source's own tensor"
                if j == 0:
                    assert ta.data_ptr() == ts.data_ptr(), f"{what}: replica 0 must share the source's memory"
        assert _pattern(_tensors(fs)) == _pattern(_tensors(rs)), f"replica {j}: which tensors are one object (ties)"
    # Replicas 1.. own their memory: no two distinct tensors among theirs and the
    # source's share a byte.
    spans, seen = [], set()
    for t in _tensors(src) + [t for rep in fp_reps[1:] for t in _tensors(_state(rep))]:
        if id(t) not in seen and t.numel():
            seen.add(id(t))
            assert t.is_contiguous()
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t.shape))
    spans.sort(key=lambda s: s[0])
    for a, b in zip(spans, spans[1:]):
        assert a[1] <= b[0], f"two replica tensors overlap: {a[2]} at [{a[0]}, {a[1]}) and {b[2]} from {b[0]}"


def _check_rnns(net, fp_reps, flat_before):
    claimed = set()  # weights of the RNNs packed so far: a weight sits in one buffer
    for i, m in enumerate(net.modules()):
        if not isinstance(m, nn.RNNBase):
            continue
        assert [id(w) for w in m._flat_weights] == flat_before[i], "the source's _flat_weights changed"
        ids = [id(w) for w in m._flat_weights]
        packable = len(set(ids)) == len(ids) and claimed.isdisjoint(ids)  # no weight tied within or to an earlier RNN
        if packable:
            claimed.update(ids)
        for j, rep in enumerate(fp_reps):
            r = list(rep.modules())[i]
            assert all(w is getattr(r, n) for w, n in zip(r._flat_weights, r._flat_weights_names)), f"replica {j}"
            if j == 0:
                continue
            if packable:  # (an RNN left unpacked keeps the source's refs, as torch's replicate leaves them)
                assert rnn.is_flat(r), f"replica {j}: RNN {i} not packed in its layout"
                assert all(ref() is w for ref, w in zip(r._flat_weight_refs, r._flat_weights)), f"replica {j}: refs"


def _grads(net):
    return [t.grad for t in [*net.parameters(), *net.buffers()]]


@pytest.mark.filterwarnings("ignore:LSTM with projections is not supported with oneDNN")
@pytest.mark.parametrize("be", ["numba", "torch"])
@given(data=st.data())
def test_replicate_matches_torch_property(be, data):
    """Any tree replicated on 1-3 host devices, with or without detach, gives replicas
    whose state is torch.nn.parallel.replicate's (types, training flags, children,
    parameter slots and buffers: values bit for bit, dtypes, requires_grad, graph,
    which tensors are one object; replica 0 the source's own memory, the others
    memory of their own), packed RNNs, the same forward bit for bit, and the same
    gradients on the source (sums in another order: to rounding)."""
    net = data.draw(module_trees(), "tree")
    n = data.draw(st.integers(1, 3), "devices")
    detach = data.draw(st.booleans(), "detach")
    gen = seeded(data)
    fill_(net, gen)
    if data.draw(st.booleans(), "flatten the source's RNNs"):
        for m in net.modules():
            if isinstance(m, nn.RNNBase) and len({id(w) for w in m._flat_weights}) == len(m._flat_weights):
                rnn.flatten_parameters(m)
    flat_before = {i: [id(w) for w in m._flat_weights] for i, m in enumerate(net.modules()) if isinstance(m, nn.RNNBase)}
    with fastpar.use_backend(be):
        fp_reps = replicate(net, ["cpu"] * n, detach=detach)
    th_reps = torch_replicate(net, n, detach)
    _check_like_torch(net, fp_reps, th_reps, detach)
    _check_rnns(net, fp_reps, flat_before)

    xs = [torch.randn(3, D, generator=gen, dtype=torch.float64) for _ in range(n)]
    gys = [torch.randn(3, D, generator=gen, dtype=torch.float64) for _ in range(n)]
    outs = {}
    for name, reps in (("fastpar", fp_reps), ("torch", th_reps)):
        outs[name] = [run_tree(r, x) for r, x in zip(reps, xs)]
    for j, (a, b) in enumerate(zip(outs["fastpar"], outs["torch"])):
        assert_same_bits(a.detach(), b.detach(), f"replica {j}'s forward", nan_payloads=True)
    # (BatchNorm's running statistics, updated by the forward in training mode)
    _check_like_torch(net, fp_reps, th_reps, detach)
    if detach or not any(o.requires_grad for o in outs["torch"]):
        return
    grads = {}
    for name in ("fastpar", "torch"):
        net.zero_grad(set_to_none=True)
        for b in net.buffers():
            b.grad = None
        with fastpar.use_backend(be):
            sum((o * gy).sum() for o, gy in zip(outs[name], gys)).backward()
        grads[name] = _grads(net)
    for i, (a, b) in enumerate(zip(grads["fastpar"], grads["torch"])):
        assert (a is None) == (b is None), f"gradient {i}: {'None' if a is None else 'set'}, torch's {'None' if b is None else 'set'}"
        if a is not None:
            eps = torch.finfo(a.dtype).eps
            # (A float16 tree can overflow to inf and NaN: those must sit where torch's
            # do, and must not make the tolerance NaN.)
            finite = b[torch.isfinite(b)]
            scale = float(finite.abs().max().double()) if finite.numel() else 0.0
            torch.testing.assert_close(a, b, rtol=8 * eps, atol=8 * eps * max(scale, 1.0), equal_nan=True,
                                       msg=f"gradient {i}")


@pytest.mark.parametrize("flagged", [False, True], ids=["parameter", "flagged-plain-tensor"])
@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("custom_setattr", [False, True], ids=["plain", "custom-setattr"])
def test_replicas_register_parameters_as_torch_does(custom_setattr, detach, flagged):
    """Under detach=True, replica 0 holds the source's own Parameters (torch's broadcast
    returns device 0's inputs) and Module.__setattr__ registers them: so does fastpar,
    on its direct path (plain classes) and through setattr (a class customising it).
    Every other copy (all of them without detach) is a new plain tensor, held as a plain
    attribute, never registered (the direct path skips Parameter's isinstance for them).

    ``flagged``: the weight is a plain ``torch.Tensor`` with ``_is_param`` set (what
    ``nn.Parameter`` makes of a custom tensor, and ``DTensor.to_local()`` of a
    ``Parameter(DTensor)``), which passes ``isinstance(t, nn.Parameter)``: under
    detach=True torch registers replica 0's (the source's own), so the direct path must
    not take it for a copy it made although its type is exactly ``torch.Tensor``."""
    class Custom(nn.Linear):
        def __setattr__(self, k, v):
            super().__setattr__(k, v)

    net = Custom(2, 2) if custom_setattr else nn.Linear(2, 2)
    if flagged:
        w = net.weight.detach().clone().requires_grad_()
        w._is_param = True
        assert type(w) is torch.Tensor and isinstance(w, nn.Parameter)
        net.weight = w
        assert net._parameters["weight"] is w
    th = torch_replicate(net, 3, detach=detach)
    fp = replicate(net, ["cpu"] * 3, detach=detach)
    for j, (f, t) in enumerate(zip(fp, th)):
        names = [n for n, _ in t.named_parameters()]
        assert names == (["weight", "bias"] if j == 0 and detach else []), f"torch's replica {j}: {names}"
        assert [n for n, _ in f.named_parameters()] == names, f"replica {j}"
        for k in ("weight", "bias"):
            assert (k in vars(f)) == (k in vars(t)), f"replica {j}: {k} held as torch's replica holds it"
            assert torch.equal(getattr(f, k), getattr(net, k)), f"replica {j}.{k}"
            if j > 0 or not detach:
                assert type(getattr(f, k)) is torch.Tensor and getattr(f, k) is not getattr(net, k)
                assert getattr(f, k).requires_grad == (not detach), f"replica {j}.{k}"
    assert (fp[0].weight is net.weight) == detach and (fp[0].bias is net.bias) == detach


@pytest.mark.parametrize("detach", [False, True])
def test_graph_module_with_a_root_parameter_replicates(detach):
    """fx's GraphModule makes its replica by ``__copy__``, which registers the root's
    Parameters again: each replica's entry was left beside its copy, so
    ``replica.parameters()`` gave the source's Parameter while ``forward`` used the copy
    (torch's replicate raises "cannot assign ... as parameter 'w'" here). Now the copy
    replaces the entry as for any module; values and gradients are torch's."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 4))
            self.lin = nn.Linear(4, 2)

        def forward(self, x):
            return self.lin(x @ self.w)

    gm = torch.fx.symbolic_trace(Net())
    assert "w" in gm._parameters
    x = torch.randn(5, 3)
    reps = replicate(gm, ["cpu"] * 3, detach=detach)
    for j, r in enumerate(reps):
        own = [n for n, _ in r.named_parameters()]
        assert own == (["w", "lin.weight", "lin.bias"] if j == 0 and detach else []), f"replica {j}: {own}"
        assert torch.equal(r.w, gm.w) and (r.w is gm.w) == (j == 0 and detach), f"replica {j}.w"
        assert torch.equal(r(x), gm(x)), f"replica {j}'s output"
    if not detach:
        sum(r(x).sum() for r in reps).backward()
        expected = torch.autograd.grad(gm(x).sum(), gm.w)[0] * 3
        torch.testing.assert_close(gm.w.grad, expected, msg="w's gradient from 3 replicas")


def test_broadcast_coalesced_marks_copies_of_inputs_without_grad_non_differentiable():
    """ReduceAddCoalesced's backward (BroadcastCoalesced, run in double backward) marks
    the copies of gradients that need none non-differentiable, as torch's Broadcast
    does; they required grad (and carried a graph) before."""
    from fastpar._functions import BroadcastCoalesced

    devs = [torch.device("cpu")] * 3
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, dtype=torch.float64)
    outs = BroadcastCoalesced.apply(devs, a, b)
    assert [o.requires_grad for o in outs] == [True, False] * 3
    assert all(torch.equal(o, t) for o, t in zip(outs, (a, b) * 3))
    (ga,) = torch.autograd.grad(sum(o.sum() for o in outs[0::2]), a)
    assert torch.equal(ga, torch.full_like(a, 3.0))


@pytest.mark.parametrize("detach", [False, True])
def test_replicate_does_not_run_an_rnn_weights_parametrization(detach):
    """torch's replicate reads only ``_parameters``; it never evaluates a parametrized
    weight. Evaluating spectral_norm's in training mode runs a power iteration that
    updates its ``_u``/``_v`` buffers in place: replicate must leave them as they were."""
    torch.manual_seed(0)
    m = nn.LSTM(4, 3)
    torch.nn.utils.parametrizations.spectral_norm(m, "weight_hh_l0")
    sn = m.parametrizations.weight_hh_l0[0]
    before = [t.clone() for t in sn.buffers()]
    th = torch_replicate(m, 2, detach)
    assert all(torch.equal(a, b) for a, b in zip(before, sn.buffers())), "torch's replicate changed them"
    replicate(m, ["cpu", "cpu"], detach=detach)
    for a, (name, b) in zip(before, sn.named_buffers()):
        assert torch.equal(a, b), f"replicate ran the parametrization: {name} changed"
    assert th  # (torch's replicas made, for the comparison above)


def test_uninitialized_lazy_parameter_is_refused_by_name():
    # A lazy module before its first forward has no shape to copy: the flatten's numel
    # raised torch's generic "uninitialized parameter in numel" error from deep inside
    # the pack; the refusal names the parameter and what to do, before any buffer.
    net = nn.Sequential(nn.Linear(3, 4), nn.LazyLinear(2))
    with pytest.raises(RuntimeError, match=r"parameter '1\.weight' is uninitialized.*forward pass"):
        replicate(net, ["cpu", "cpu"])
    assert isinstance(net[1].weight, nn.parameter.UninitializedParameter)
    assert net not in _POOLS  # refused before any buffer was set aside
    x = torch.randn(5, 3)
    net(x)  # initialized on devices[0]: replicated as any module
    for r in replicate(net, ["cpu", "cpu"]):
        assert torch.equal(r(x), net(x))


def test_broadcast_and_replicate_run_eagerly_inside_torch_compile():
    # After a few compiles of broadcast_coalesced (dynamo then makes sizes dynamic),
    # replicate traced under aot_eager failed in torch's alias replay of its byte views
    # ("self.size(-1) must be divisible by 4 to view Byte as Float"). Both run eagerly
    # whole inside a compiled function: the copies and replicas are right, the
    # gradients reach the source.
    from fastpar import comm

    torch._dynamo.reset()
    try:
        n = 1 << 19
        ts = [torch.ones(n // 2), torch.arange(n // 2, dtype=torch.float32)]
        bc = torch.compile(lambda xs: comm.broadcast_coalesced(xs, ["cpu", "cpu"]), backend="aot_eager")
        for _ in range(3):
            copies = bc(ts)
            assert all(torch.equal(c, t) for c, t in zip(copies[1], ts))
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        x = torch.randn(3, 4)

        def step(x):
            return [m(x) for m in fastpar.replicate(net, ["cpu", "cpu"])]

        outs = torch.compile(step, backend="aot_eager")(x)
        want = net(x)
        assert len(outs) == 2 and all(torch.allclose(o, want) for o in outs)
        net.zero_grad()
        sum(o.sum() for o in outs).backward()
        got = [p.grad.clone() for p in net.parameters()]
        net.zero_grad()
        (2 * net(x).sum()).backward()  # two replicas' gradients, summed into the source
        for g, p in zip(got, net.parameters()):
            assert torch.allclose(g, p.grad)
    finally:
        torch._dynamo.reset()
