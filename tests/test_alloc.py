"""fastpar._alloc: large host buffers ask for transparent huge pages, and nothing else
changes."""
from __future__ import annotations

import gc
import sys

import pytest
import torch

from conftest import assert_close, poison_

from fastpar import _alloc


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unavailable"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
def test_empty_is_torch_empty(dtype):
    for size in [0, 1, 7, (3, 5), 65_537, 3_000_001]:
        t = _alloc.empty(size, dtype=dtype, device="cpu")
        ref = torch.empty(size, dtype=dtype)
        assert t.shape == ref.shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
        t.fill_(1)  # writable over its whole length
        assert bool((t == 1).all())


def test_small_buffers_are_left_alone():
    assert not _alloc.advise_huge_pages(torch.empty(1000))
    assert not _alloc.advise_huge_pages(torch.empty((_alloc._MIN_BYTES - 4) // 4))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux-only")
def test_large_buffer_takes_the_hint():
    t = torch.empty(64 << 20, dtype=torch.uint8)
    assert _alloc.advise_huge_pages(t), "madvise(MADV_HUGEPAGE) refused a 64 MiB buffer"


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages off here")
def test_large_buffer_gets_huge_pages():
    # AnonHugePages of this process's mappings grows once the advised buffer is written.
    def anon_huge_kb():
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
    before = anon_huge_kb()
    t = _alloc.empty(64 << 20, dtype=torch.uint8, device="cpu")
    t.fill_(7)
    # At least one: a fragmented host may fall back to small pages for some of them.
    assert anon_huge_kb() - before >= 2 << 10, "no huge page behind a fresh 64 MiB buffer"
    assert int(t[:: 1 << 20].sum()) == 7 * 64


def test_env_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("FASTPAR_HUGE_PAGES", "0")
    assert _alloc._load_madvise() is None


# ------------------------------------------------------------------------ ResultCache
N = (_alloc._REUSE_MIN_BYTES // 4) + 5  # float32 elements: just over the caching threshold


def _storage_ptr(t):
    return t.untyped_storage().data_ptr()


def test_result_cache_reuses_a_buffer_once_nothing_refers_to_it():
    cache = _alloc.ResultCache(max_bytes=1 << 30)
    a, reused = cache.empty(N, torch.float32, "cpu")
    assert not reused
    ptr = _storage_ptr(a)
    piece = a[10:20]
    del a
    b, reused = cache.empty(N, torch.float32, "cpu")  # `piece` still refers to the first
    assert not reused and _storage_ptr(b) != ptr
    del piece, b
    c, reused = cache.empty(N, torch.float32, "cpu")
    assert reused and _storage_ptr(c) == ptr  # the first kept buffer, free again


def test_result_cache_never_hands_out_a_buffer_in_use():
    cache = _alloc.ResultCache(max_bytes=1 << 30)
    held = [cache.empty(N, torch.float32, "cpu")[0] for _ in range(4)]  # per_key=2 kept, 4 live
    assert len({_storage_ptr(t) for t in held}) == 4
    for t in held:
        t.fill_(1.0)
    fresh, _ = cache.empty(N, torch.float32, "cpu")
    fresh.fill_(2.0)
    assert all(bool((t == 1.0).all()) for t in held), "a live result's memory was handed out again"


def _held_storage(t):
    return t.untyped_storage()  # the Python storage object alone, no tensor


def _held_typed_storage(t):
    return t.storage()  # a TypedStorage over it (warns: deprecated)


def _shared(t):
    t.share_memory_()  # what sending it to another process does, in place
    return None


@pytest.mark.filterwarnings("ignore:TypedStorage is deprecated:UserWarning")
@pytest.mark.parametrize("hold", [_held_storage, _held_typed_storage, _shared],
                         ids=["untyped storage", "typed storage", "moved to shared memory"])
def test_result_cache_sees_references_the_use_count_does_not(hold):
    # torch keeps one Python storage object per storage, and the use count goes through
    # that very object: holding it (or a TypedStorage over it) does not raise the count.
    cache = _alloc.ResultCache(max_bytes=1 << 30)
    a, _ = cache.empty(N, torch.float32, "cpu")
    a.fill_(2.0)
    kept = hold(a)
    ptr = _storage_ptr(a)  # after hold: share_memory_() moves the data
    del a
    b, reused = cache.empty(N, torch.float32, "cpu")
    b.fill_(5.0)
    assert not reused and _storage_ptr(b) != ptr, "a buffer still referenced was handed out again"
    if kept is not None:
        untyped = kept.untyped() if hasattr(kept, "untyped") else kept
        assert torch.empty(0).set_(untyped, 0, (2,)).tolist() == [2.0, 2.0]


def test_result_cache_sees_a_weak_reference_to_the_storage():
    # torch frees a result's storage object with its last tensor, so a weak reference to
    # it dies then; the cache keeps that object alive, and a weak reference kept past the
    # results must keep the buffer out of reuse (it would hand back refilled memory).
    import weakref

    cache = _alloc.ResultCache(max_bytes=1 << 30)
    a, _ = cache.empty(N, torch.float32, "cpu")
    a.fill_(2.0)
    ref, ptr = weakref.ref(a.untyped_storage()), _storage_ptr(a)
    del a
    b, reused = cache.empty(N, torch.float32, "cpu")
    b.fill_(5.0)
    assert not reused and _storage_ptr(b) != ptr, "a buffer still weakly referenced was handed out again"
    assert torch.empty(0).set_(ref(), 0, (2,)).tolist() == [2.0, 2.0]


def test_reduce_results_weakly_referenced_storage_is_not_refilled():
    import weakref

    from fastpar import comm

    lists = [[torch.randn(N), torch.randn(3, 5)] for _ in range(2)]
    comm.reduce_add_coalesced(lists, "cpu")  # compile first (see the test above)
    gc.collect()
    comm._RESULTS.clear()
    r = comm.reduce_add_coalesced(lists, "cpu")
    ref, kept = weakref.ref(r[0].untyped_storage()), r[0][:4].clone()
    del r
    for _ in range(2):  # both kept buffers of the key
        again = comm.reduce_add_coalesced([[torch.full((N,), 7.0), torch.zeros(3, 5)]] * 2, "cpu")
        del again
    storage = ref()
    if storage is not None:  # torch's own results: the object died with them
        assert torch.equal(torch.empty(0).set_(storage, 0, (4,)), kept), "a later call refilled it"


def test_result_cache_sees_the_base_of_what_it_handed_out():
    # What empty() returns must not lead back to the kept tensor: as a view, its _base
    # was that very tensor, held without raising the storage's use count.
    cache = _alloc.ResultCache(max_bytes=1 << 30)
    a, _ = cache.empty(N, torch.float32, "cpu")
    a.fill_(2.0)
    base, ptr = a._base, _storage_ptr(a)
    del a
    b, reused = cache.empty(N, torch.float32, "cpu")
    b.fill_(5.0)
    if base is not None:
        assert not reused and _storage_ptr(b) != ptr, "a buffer still referenced through _base was handed out again"
        assert base[:2].tolist() == [2.0, 2.0]
    else:  # nothing held: the buffer is free
        assert reused and _storage_ptr(b) == ptr


def test_buffer_pool_sees_the_base_of_what_it_handed_out():
    from fastpar.replicate import _BufferPool

    pool, dev = _BufferPool(), torch.device("cpu")
    a = pool.get("k", 64, dev)
    a.fill_(2)
    base = a._base
    del a
    b = pool.get("k", 64, dev)
    b.fill_(5)
    if base is not None:
        assert pool.allocations == 2, "a buffer still referenced through _base was handed out again"
        assert base[:2].tolist() == [2, 2]
    else:  # nothing held: the buffer is free
        assert pool.allocations == 1


def test_result_cache_replaces_a_resized_buffer():
    cache = _alloc.ResultCache(max_bytes=1 << 30, per_key=1)
    a, _ = cache.empty(N, torch.float32, "cpu")
    a.untyped_storage().resize_(0)
    del a
    b, reused = cache.empty(N, torch.float32, "cpu")
    assert not reused and b.untyped_storage().nbytes() == N * 4
    ptr = _storage_ptr(b)
    b.fill_(1.0)
    del b
    c, reused = cache.empty(N, torch.float32, "cpu")  # the dead slot was replaced by b's
    assert reused and _storage_ptr(c) == ptr


def test_result_cache_keys_on_dtype_and_size_and_keeps_small_or_other_devices_out():
    cache = _alloc.ResultCache(max_bytes=1 << 30)
    a, _ = cache.empty(N, torch.float32, "cpu")
    ptr = _storage_ptr(a)
    del a
    b, reused = cache.empty(N, torch.int32, "cpu")
    assert not reused
    c, reused = cache.empty(N + 1, torch.float32, "cpu")
    assert not reused
    small, reused = cache.empty(10, torch.float32, "cpu")
    assert not reused and cache._bytes == 3 * N * 4 + 4
    d, reused = cache.empty(N, torch.float32, "cpu")
    assert reused and _storage_ptr(d) == ptr


def test_result_cache_limits_bytes_least_recently_used_first():
    cache = _alloc.ResultCache(max_bytes=2 * N * 4)
    a, _ = cache.empty(N, torch.float32, "cpu")
    b, _ = cache.empty(N + 1, torch.float32, "cpu")  # over the limit: the oldest key goes
    assert cache._bytes <= cache.max_bytes
    del a, b
    _, reused_b = cache.empty(N + 1, torch.float32, "cpu")
    _, reused_a = cache.empty(N, torch.float32, "cpu")
    assert reused_b and not reused_a
    off = _alloc.ResultCache(max_bytes=0)
    x, _ = off.empty(N, torch.float32, "cpu")
    del x
    assert not off.empty(N, torch.float32, "cpu")[1] and off._bytes == 0


def test_reduce_results_reuse_their_buffer_only_when_dropped():
    from fastpar import comm

    lists = [[torch.randn(N), torch.randn(3, 5)] for _ in range(3)]
    # A call that compiles its Numba kernel leaves its frame, and so its results, in a
    # reference cycle (with Numba's compiler frames) until the collector runs:
    # compile first, so that `del` below frees the results at once (this failed one CI
    # run in two when the collector happened not to run in between).
    comm.reduce_add_coalesced(lists, "cpu")
    gc.collect()
    comm._RESULTS.clear()
    r1 = comm.reduce_add_coalesced(lists, "cpu")
    ptr, kept = _storage_ptr(r1[0]), r1[1].clone()
    r2 = comm.reduce_add_coalesced(lists, "cpu")  # r1 alive: another buffer
    assert _storage_ptr(r2[0]) != ptr and torch.equal(r1[1], kept)
    # The reused buffer must be written again, not found holding the sums (no loop
    # variable may outlive this: it would keep a result, and so the buffer, alive).
    _ = [poison_(r) for r in r1]
    del r1, r2, _
    lists = [[torch.randn(N), torch.randn(3, 5)] for _ in range(3)]  # and new values
    r3 = comm.reduce_add_coalesced(lists, "cpu")
    assert _storage_ptr(r3[0]) == ptr, "the first call's buffer, free again, was not reused"
    for i, got in enumerate(r3):
        assert_close(got, sum(lst[i].double() for lst in lists), dtype=torch.float32,
                     tol=(4e-6, 4e-6), what=f"reused result {i}")  # 3 addends: 2 roundings


def test_empty_cache_releases_kept_buffers_and_plans_but_not_live_results():
    import fastpar
    from fastpar import _plan, comm

    lists = [[torch.randn(N), torch.randn(3, 5)] for _ in range(2)]
    comm.reduce_add_coalesced(lists, "cpu")  # compiled (see above), then collected
    gc.collect()
    alive = comm.reduce_add_coalesced(lists, "cpu")
    kept = [r.clone() for r in alive]
    dropped = fastpar.flatten([torch.randn(N)])
    del dropped
    assert _alloc.RESULTS._bytes > 0 and _alloc.RESULTS._slots and len(_plan._CACHE) > 0
    fastpar.empty_cache()
    assert _alloc.RESULTS._bytes == 0 and not _alloc.RESULTS._slots, "result buffers still kept"
    assert len(_plan._CACHE) == 0, "plans still cached"
    for i, (r, k) in enumerate(zip(alive, kept)):
        assert torch.equal(r, k), f"live result {i} changed"
    # The next call allocates anew and sums right.
    again = comm.reduce_add_coalesced(lists, "cpu")
    assert _storage_ptr(again[0]) != _storage_ptr(alive[0])
    for i, got in enumerate(again):
        assert_close(got, sum(lst[i].double() for lst in lists), dtype=torch.float32, what=f"result {i} after")


def test_empty_cache_releases_the_ddp_hooks_buffers(monkeypatch):
    import fastpar
    import fastpar.ddp

    calls = []
    monkeypatch.setattr(fastpar.ddp, "release_buffers", lambda: calls.append(1))
    fastpar.empty_cache()
    assert calls == [1]


def test_result_cache_threads_never_share_a_live_buffer():
    import threading

    cache = _alloc.ResultCache(max_bytes=1 << 30, per_key=3)
    live, errors, lock = {}, [], threading.Lock()

    def worker(k):
        for i in range(40):
            buf, _ = cache.empty(N, torch.float32, "cpu")
            ptr = _storage_ptr(buf)
            with lock:
                if ptr in live:
                    errors.append(f"thread {k} got the buffer thread {live[ptr]} holds")
                live[ptr] = k
            buf[:100].fill_(k)
            if not bool((buf[:100] == k).all()):
                errors.append(f"thread {k}: its buffer was written by another thread")
            with lock:
                del live[ptr]
            del buf

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


def test_gc_paused_nests_and_restores():
    assert gc.isenabled()
    with _alloc.gc_paused():
        assert not gc.isenabled()
        with _alloc.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled(), "an inner block turned the collector back on"
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="boom"):
        with _alloc.gc_paused():
            raise RuntimeError("boom")
    assert gc.isenabled(), "not restored after an exception"


def test_gc_paused_keeps_a_callers_disable():
    gc.disable()
    try:
        with _alloc.gc_paused():
            pass
        assert not gc.isenabled(), "turned on a collector the caller had turned off"
    finally:
        gc.enable()


def test_gc_paused_overlapping_threads():
    """Blocks in two threads that overlap in either order: the collector is off while
    either runs and back on once both have ended."""
    import threading

    for first_out in (0, 1):
        entered = [threading.Event(), threading.Event()]
        leave = [threading.Event(), threading.Event()]
        seen = []

        def run(i):
            with _alloc.gc_paused():
                entered[i].set()
                leave[i].wait(10)
                seen.append(gc.isenabled())

        threads = [threading.Thread(target=run, args=(i,)) for i in (0, 1)]
        for t, e in zip(threads, entered):
            t.start()
            assert e.wait(10)
        leave[first_out].set()
        threads[first_out].join(10)
        assert not gc.isenabled(), "one block ended and turned the collector on under the other"
        leave[1 - first_out].set()
        threads[1 - first_out].join(10)
        assert seen == [False, False] and gc.isenabled()


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_gc_paused_in_another_thread_does_not_outlive_a_fork():
    """A process forked while another thread is inside a gc_paused block (a DataLoader
    worker forked while a background thread splits a result into views) holds only the
    forking thread: that block never ends there, so the child must not inherit the
    pause (it ran with the collector off for good) nor a held lock."""
    import os
    import threading

    inside, leave = threading.Event(), threading.Event()

    def hold():
        with _alloc.gc_paused():
            inside.set()
            leave.wait(30)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert inside.wait(10)
        assert not gc.isenabled()
        r, w = os.pipe()
        import warnings

        with warnings.catch_warnings():  # (3.12+: "use of fork() may lead to deadlocks")
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - the child reports through the pipe
            try:
                os.close(r)
                at_start = gc.isenabled()
                with _alloc.gc_paused():
                    inside_block = gc.isenabled()
                after = gc.isenabled()
                os.write(w, f"{int(at_start)}{int(inside_block)}{int(after)}".encode())
            finally:
                os._exit(0)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            got = f.read().decode()
        os.waitpid(pid, 0)
        # on at the start, off inside its own block, on again after it
        assert got == "101", f"child: collector enabled at start/inside/after = {got!r}"
    finally:
        leave.set()
        t.join(10)
    assert gc.isenabled()


def _recording_madvise(monkeypatch):
    calls = []

    def fake(addr, length, advice):
        calls.append((addr, length, advice))
        return 0

    monkeypatch.setattr(_alloc, "_madvise", fake)
    return calls


@pytest.mark.parametrize("offset", [0, 1, 4093, (1 << 20) + 3])
def test_hint_covers_only_whole_huge_pages_inside_the_tensor(monkeypatch, offset):
    calls = _recording_madvise(monkeypatch)
    base = torch.empty(offset + (9 << 20) + 12345, dtype=torch.uint8)
    t = base[offset:]  # an unaligned start and end
    assert _alloc.advise_huge_pages(t)
    [(lo, length, advice)] = calls
    start, end = t.data_ptr(), t.data_ptr() + t.numel()
    assert advice == _alloc._MADV_HUGEPAGE
    assert lo % _alloc._HUGE == 0 and length % _alloc._HUGE == 0 and length > 0
    assert start <= lo and lo + length <= end, "madvise reaches memory the tensor does not own"
    assert lo - start < _alloc._HUGE and end - (lo + length) < _alloc._HUGE  # and every whole page


def test_hint_threshold_is_inclusive(monkeypatch):
    calls = _recording_madvise(monkeypatch)
    assert _alloc.advise_huge_pages(torch.empty(_alloc._MIN_BYTES, dtype=torch.uint8))
    assert len(calls) == 1
    assert not _alloc.advise_huge_pages(torch.empty(_alloc._MIN_BYTES - 1, dtype=torch.uint8))
    assert len(calls) == 1


def test_result_cache_threshold_is_inclusive():
    cache = _alloc.ResultCache(max_bytes=1 << 30)
    below, reused = cache.empty(_alloc._REUSE_MIN_BYTES - 1, torch.uint8, "cpu")
    assert not reused and cache._bytes == 0
    at, reused = cache.empty(_alloc._REUSE_MIN_BYTES, torch.uint8, "cpu")
    assert not reused and cache._bytes == _alloc._REUSE_MIN_BYTES
    ptr = at.data_ptr()
    del at, below
    again, reused = cache.empty(_alloc._REUSE_MIN_BYTES, torch.uint8, "cpu")
    assert reused and again.data_ptr() == ptr


def test_flatten_and_reduce_share_one_result_cache():
    # One FASTPAR_RESULT_CACHE_MB budget for both.
    from fastpar import comm

    assert comm._RESULTS is _alloc.RESULTS


def test_result_cache_never_hands_out_a_reused_buffer_in_use():
    cache = _alloc.ResultCache(max_bytes=1 << 30, per_key=1)
    a, _ = cache.empty(N, torch.float32, "cpu")
    ptr = _storage_ptr(a)
    del a
    b, reused = cache.empty(N, torch.float32, "cpu")
    assert reused and _storage_ptr(b) == ptr
    b.fill_(1.0)
    c, reused = cache.empty(N, torch.float32, "cpu")  # b, the reused buffer, is still alive
    assert not reused and _storage_ptr(c) != ptr
    c.fill_(2.0)
    assert bool((b == 1.0).all()), "a live result's memory was handed out again"


def test_result_cache_reuse_moves_a_key_to_most_recently_used():
    cache = _alloc.ResultCache(max_bytes=2 * (N + 2) * 4)
    a, _ = cache.empty(N, torch.float32, "cpu")
    b, _ = cache.empty(N + 1, torch.float32, "cpu")
    del a, b
    a, reused = cache.empty(N, torch.float32, "cpu")  # key N used again: now the newest
    assert reused
    del a
    c, _ = cache.empty(N + 2, torch.float32, "cpu")  # over the limit: the oldest key goes (N + 1)
    del c
    assert cache.empty(N, torch.float32, "cpu")[1], "the most recently used key was dropped"
    assert not cache.empty(N + 1, torch.float32, "cpu")[1]


def test_result_cache_counts_bytes_of_a_replaced_buffer_once():
    cache = _alloc.ResultCache(max_bytes=(2 * N + 1) * 4, per_key=1)
    a, _ = cache.empty(N, torch.float32, "cpu")
    a.untyped_storage().resize_(0)
    del a
    b, reused = cache.empty(N, torch.float32, "cpu")  # the dead slot is replaced
    assert not reused and cache._bytes == N * 4
    del b
    c, _ = cache.empty(N + 1, torch.float32, "cpu")  # both fit in the limit
    del c
    assert cache._bytes == (2 * N + 1) * 4
    assert cache.empty(N, torch.float32, "cpu")[1], "a replaced buffer was counted twice"


def test_result_cache_keeps_at_most_per_key_buffers():
    cache = _alloc.ResultCache(max_bytes=1 << 30, per_key=1)
    x, _ = cache.empty(N, torch.float32, "cpu")
    y, _ = cache.empty(N, torch.float32, "cpu")  # x alive: a new buffer, not kept (per_key=1)
    assert cache._bytes == N * 4
    del x, y
    x, reused_x = cache.empty(N, torch.float32, "cpu")
    y, reused_y = cache.empty(N, torch.float32, "cpu")
    assert reused_x and not reused_y


def test_result_cache_keeps_a_buffer_of_exactly_max_bytes():
    cache = _alloc.ResultCache(max_bytes=N * 4)
    a, _ = cache.empty(N, torch.float32, "cpu")
    assert cache._bytes == N * 4
    del a
    assert cache.empty(N, torch.float32, "cpu")[1]


def test_result_cache_buffer_over_max_bytes_leaves_the_cache_alone():
    cache = _alloc.ResultCache(max_bytes=(N + 1) * 4)
    a, _ = cache.empty(N, torch.float32, "cpu")
    del a
    big, reused = cache.empty(2 * N, torch.float32, "cpu")  # over max_bytes: not cached
    assert not reused and cache._bytes == N * 4
    del big
    assert cache.empty(N, torch.float32, "cpu")[1], "a buffer over the limit evicted the kept ones"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_idle_buffer_on_cuda_is_idle_when_unreferenced():
    # (UntypedStorage.is_shared() is True for every CUDA storage: not a sign of a send.)
    slot = _alloc.IdleBuffer(torch.empty(1024, dtype=torch.uint8, device="cuda"))
    assert slot.intact() and slot.idle()
    view = slot.buf.view(-1)
    assert not slot.idle()
    del view
    assert slot.idle()


def test_readme_limits_name_every_reused_result_buffer_and_the_threshold():
    # The README's limits said the reused host results were reduce_add_coalesced's "of
    # 4 MiB or more" after flatten's results joined the cache and the threshold fell to
    # _REUSE_MIN_BYTES: a reader keeping a StorageWeakRef to a flatten result was not
    # told it may be refilled. The bullet names both ops and the threshold in force.
    import pathlib

    readme = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    bullet = readme[readme.index("* Buffers fastpar reuses"):]
    bullet = bullet[: bullet.index("\n* ")]
    assert f"{_alloc._REUSE_MIN_BYTES >> 20} MiB or more" in bullet, bullet
    assert "`flatten` without `out=`" in bullet and "`reduce_add_coalesced`" in bullet, bullet

