"""Where a CUDA ``reduce_add_coalesced`` call's time goes (a stand-alone script for a lent
GPU, not a pytest suite): ``python benchmarks/probe_reduce_host.py [OUT_DIR [DEVICE]]``.

``benchmarks/probe_reduce_cuda.py`` on an H200 (2026-11-26, evening) found the host's
time per call (250-590 us, nothing synchronised inside a burst) about equal to
``do_bench``'s time per call even for four one-tensor lists, where the Python side
should take tens of microseconds: either the host waits on the GPU inside the call, or
it is the bottleneck. This separates the two, per workload and layout:

* ``bench_us``: ``triton.testing.do_bench`` median;
* ``host_us`` / ``drain_us``: 20 calls with no synchronisation (the host's time), and the
  time until the GPU has finished them too, per call;
* ``kernel_us``: the reduce kernel's own device time per call (``torch.profiler``, CUPTI);
* ``runtime``: the CUDA runtime calls made in those 20 calls with their host time
  (a blocking one stands out);
* ``per_call_table``: ``bench_us`` and the host's time again with a table made per call
  (a probe-only patch of ``ReduceGroup.device_table`` dropping its ``table_cache``), as
  calls without a cached ``out=`` make it (DataParallel's backward): the table's cost;
* ``cprofile``: the Python functions with the most own time in 50 calls.

Its first run (``results/gpu/h200-host-probe-before-20261126.json``) answered it: the
Transformer's reduce kernel takes 204 us (100% of ``copy_``), the call 340 us, its host
368 us, of which the per-call table took about 190 (cached: bench 211 us, host 181).
``ReduceGroup.device_table`` now keeps the table for a cached ``out=`` plan; the second
run (``...-after-20261126.json``, on another machine) is at that code. (Those two runs
had a ``cached_table`` column, a patch that reused every table; the probe now measures
the other way round, ``per_call_table``, since the default keeps the table.)
"""
from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import sys
import time

import torch

import fastpar
from fastpar import _plan
from fastpar._workloads import WORKLOADS, nbytes

K = 4
CALLS = 20


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def _bench_us(fn, dev: str) -> float:
    if dev == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def _host_drain_us(fn, dev: str) -> tuple[float, float]:
    host = drain = float("inf")
    for _ in range(3):
        _sync(dev)
        t = time.perf_counter()
        for _ in range(CALLS):
            fn()
        t1 = time.perf_counter()
        _sync(dev)
        t2 = time.perf_counter()
        host = min(host, (t1 - t) / CALLS * 1e6)
        drain = min(drain, (t2 - t) / CALLS * 1e6)
    return host, drain


def _profile(fn, dev: str) -> tuple[float | None, list]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    _sync(dev)
    with profile(activities=acts) as prof:
        for _ in range(CALLS):
            fn()
        _sync(dev)
    kernel = None
    runtime = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if "reduce_add_kernel" in e.key:
            kernel = dev_us / CALLS
        if e.key.startswith("cuda") or e.key.startswith("cu") or e.count >= CALLS:
            runtime.append(dict(name=e.key, count=e.count, cpu_us=e.cpu_time_total / CALLS,
                                self_cpu_us=e.self_cpu_time_total / CALLS, device_us=dev_us / CALLS))
    runtime.sort(key=lambda r: -r["self_cpu_us"])
    return kernel, runtime[:15]


def _cprofile(fn) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(50):
        fn()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14)
    return s.getvalue()


class _PerCallTables:
    """Patch ``ReduceGroup.device_table`` to make every table anew (probe only)."""

    def __enter__(self):
        self.orig = orig = _plan.ReduceGroup.device_table

        def per_call(group, block, device):
            group.table_cache = None
            return orig(group, block, device)

        _plan.ReduceGroup.device_table = per_call
        return self

    def __exit__(self, *exc):
        _plan.ReduceGroup.device_table = self.orig


def main(out_dir: str | None, dev: str) -> None:
    rows, texts = [], []
    for wname in ["transformer", "lstm", "tiny"]:
        torch.manual_seed(0)
        ts = WORKLOADS[wname][0](dev)
        numel = sum(t.numel() for t in ts)
        for layout in ["lists", "bench", "flat"]:
            dest = dev
            if layout == "lists":
                copies = [[t.clone() for t in ts] for _ in range(K)]
                out = [torch.empty_like(t) for t in ts]
            elif layout == "bench":
                # As fastpar.bench sets it up: the workload's own tensors as the first
                # copy, and a torch.device destination. (Its host time per call on an
                # H200, 351 us, was 1.5x this probe's "lists" row in the same call.)
                copies = [ts] + [[t.clone() for t in ts] for _ in range(K - 1)]
                out = [torch.empty_like(t) for t in ts]
                dest = ts[0].device
            else:
                copies = [[torch.randn(numel, device=dev)] for _ in range(K)]
                out = [torch.empty(numel, device=dev)]

            def reduce():
                fastpar.comm.reduce_add_coalesced(copies, dest, out=out)

            reduce()
            bench = _bench_us(reduce, dev)
            host, drain = _host_drain_us(reduce, dev)
            kernel, runtime = _profile(reduce, dev)
            with _PerCallTables():
                reduce()
                per_call = _bench_us(reduce, dev)
                p_host, p_drain = _host_drain_us(reduce, dev)
            prof = _cprofile(reduce)
            row = dict(workload=wname, layout=layout, n_tensors=len(ts), bytes=nbytes(ts), bench_us=bench,
                       host_us=host, drain_us=drain, kernel_us=kernel, per_call_table_bench_us=per_call,
                       per_call_table_host_us=p_host, per_call_table_drain_us=p_drain, runtime=runtime)
            rows.append(row)
            line = (f"{wname:11s} {layout:5s} bench {bench:7.1f} us  host {host:7.1f}  drain {drain:7.1f}  "
                    f"kernel {kernel if kernel is not None else float('nan'):7.1f}  | per-call table: bench {per_call:7.1f}  "
                    f"host {p_host:7.1f}  drain {p_drain:7.1f}")
            print(line, flush=True)
            texts.append(line + "\n" + "\n".join(
                f"    {r['name'][:60]:60s} n={r['count']:5d} cpu {r['cpu_us']:8.1f} self {r['self_cpu_us']:8.1f} "
                f"dev {r['device_us']:8.1f} us/call" for r in runtime) + "\n" + prof)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "host-probe.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0) if dev == "cuda" else dev,
                           torch=torch.__version__, K=K, calls=CALLS, rows=rows), f, indent=1)
        with open(os.path.join(out_dir, "host-probe.txt"), "w") as f:
            f.write("\n\n".join(texts))


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0] if a else None, a[1] if len(a) > 1 else "cuda")
