"""Probe of the CUDA K-way reduce's share of ``copy_`` bandwidth (a stand-alone script for
a lent GPU, not a pytest suite): ``python benchmarks/probe_reduce_cuda.py [OUT.json]``.

``python -m fastpar bench`` on an H200 gave the K=4 ``reduce_add_coalesced`` 61-70% of
``copy_`` on the Transformer gradients and 70% then 97% on the LSTM's, with the same
launch parameters, where every copy kernel ran at 94-100%. This separates the candidate
causes in one run:

* ``layout``: the bench's lists (each copy a list of separately allocated tensors) against
  one flat tensor per copy of the same total size (the same kernel, one tensor), and
  against ``views``: the same lists carved out of one flat buffer per copy (the list's
  structure with the flat layout's placement);
* ``alloc``: two fresh allocations of each, so that where the copies land can differ;
* ``params``: launch parameters (``BLOCK``, ``num_warps``) around the defaults.

GB/s counts bytes read plus written ((K + 1) x the list's bytes); ``copy_`` is one
device-to-device copy of the list's bytes, measured beside each row; ``host`` is the
host's time per call (the Python side and the launch), which bounds do_bench's time
from below once it exceeds the kernel's.

Three runs on one H200 (``results/gpu/h200-reduce-probe*.json``) gave the Transformer's
lists 41-99% with either parameter set and the LSTM's 97-103%: the spread is between
runs, not parameters; the host column was added after them, to test whether the
Transformer's call (four lists of 184 tensors) is host-bound there.
"""
from __future__ import annotations

import json
import sys

import torch
import triton.testing

import fastpar
from fastpar import _tuning
from fastpar.autotune import host_per_call
from fastpar._workloads import WORKLOADS, nbytes

K = 4
PARAMS = [None, (1024, 4), (4096, 4), (4096, 8), (8192, 8)]  # None: the launcher's defaults
LAYOUTS = ["lists", "flat", "views"]
WORKLOAD_NAMES = ["transformer", "lstm"]


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _host_us(fn) -> float:
    """Host time per call in us (``fastpar.autotune.host_per_call``: the best of three
    bursts of 20 calls, nothing synchronised inside a burst): where it exceeds the
    kernel's time, do_bench's rounds wait on the host, and the GB/s above measure the
    host, not the kernel."""
    return host_per_call(fn, torch.cuda.synchronize) * 1e6


def main(path=None) -> None:
    rows = []
    for wname in WORKLOAD_NAMES:
        torch.manual_seed(0)
        ts = WORKLOADS[wname][0]("cuda")
        size = nbytes(ts)
        numel = sum(t.numel() for t in ts)
        for layout in LAYOUTS:
            for alloc in range(2):
                if layout == "lists":
                    copies = [[t.clone() for t in ts] for _ in range(K)]
                    out = [torch.empty_like(t) for t in ts]
                elif layout == "views":
                    copies = [list(fastpar.unflatten(fastpar.flatten(ts), ts)) for _ in range(K)]
                    out = list(fastpar.unflatten(torch.empty(numel, device="cuda"), ts))
                else:
                    copies = [[torch.randn(numel, device="cuda")] for _ in range(K)]
                    out = [torch.empty(numel, device="cuda")]
                src, dst = torch.empty(numel, device="cuda"), torch.empty(numel, device="cuda")
                copy_gbps = 2 * size / _ms(lambda: dst.copy_(src)) / 1e6

                def reduce():
                    fastpar.comm.reduce_add_coalesced(copies, 0, out=out)

                for p in PARAMS:
                    table = {} if p is None else {("reduce_add", "triton"): {"block": p[0], "num_warps": p[1]}}
                    with _tuning.forced(table):
                        ms = _ms(reduce)
                        host_us = _host_us(reduce)
                    gbps = (K + 1) * size / ms / 1e6
                    rows.append(dict(workload=wname, layout=layout, alloc=alloc, params=p or "default",
                                     ms=ms, host_us=host_us, gbps=gbps, copy_gbps=copy_gbps, of_copy=gbps / copy_gbps,
                                     src_addrs=[c[0].data_ptr() % (1 << 30) for c in copies]))
                    print(f"{wname:11s} {layout:5s} alloc{alloc} {str(p or 'default'):10s} "
                          f"{ms * 1e3:8.1f} us {gbps:7.0f} GB/s  copy_ {copy_gbps:7.0f}  {gbps / copy_gbps:6.1%}  "
                          f"host {host_us:6.1f} us",
                          flush=True)
    if path:
        with open(path, "w") as f:
            from fastpar.kernels.ops_triton import reduce_add as R

            json.dump({"defaults": {"block": R.DEFAULT_BLOCK, "num_warps": R.DEFAULT_NUM_WARPS},
                       "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "triton": triton.__version__, "K": K, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    # python benchmarks/probe_reduce_cuda.py [OUT.json [layouts [params [workloads]]]], the
    # last three comma-separated (params as BLOCKxWARPS or "default"), e.g.
    # out.json lists,views default,4096x8 transformer
    args = sys.argv[1:]
    if len(args) > 1:
        LAYOUTS = args[1].split(",")
    if len(args) > 2:
        PARAMS = [None if p == "default" else tuple(int(x) for x in p.split("x")) for p in args[2].split(",")]
    if len(args) > 3:
        WORKLOAD_NAMES = args[3].split(",")
    main(args[0] if args else None)
