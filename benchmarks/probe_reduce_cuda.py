"""Probe of the CUDA K-way reduce's share of ``copy_`` bandwidth (a stand-alone script for
a lent GPU, not a pytest suite): ``python benchmarks/probe_reduce_cuda.py [OUT.json]``.

``python -m fastpar bench`` on an H200 gave the K=4 ``reduce_add_coalesced`` 61-70% of
``copy_`` on the Transformer gradients and 70% then 97% on the LSTM's, with the same
launch parameters, where every copy kernel ran at 94-100%. This separates the candidate
causes in one run:

* ``layout``: the bench's lists (each copy a list of separately allocated tensors) against
  one flat tensor per copy of the same total size (the same kernel, one tensor);
* ``alloc``: two fresh allocations of each, so that where the copies land can differ;
* ``params``: launch parameters (``BLOCK``, ``num_warps``) around the defaults.

GB/s counts bytes read plus written ((K + 1) x the list's bytes); ``copy_`` is one
device-to-device copy of the list's bytes, measured beside each row.
"""
from __future__ import annotations

import json
import sys

import torch
import triton.testing

import fastpar
from fastpar import _tuning
from fastpar._workloads import WORKLOADS

K = 4
PARAMS = [None, (1024, 4), (4096, 4), (4096, 8), (8192, 8)]  # None: the launcher's defaults


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main(path=None) -> None:
    rows = []
    for wname in ["transformer", "lstm"]:
        torch.manual_seed(0)
        ts = WORKLOADS[wname][0]("cuda")
        nbytes = sum(t.numel() * t.element_size() for t in ts)
        numel = sum(t.numel() for t in ts)
        for layout in ["lists", "flat"]:
            for alloc in range(2):
                if layout == "lists":
                    copies = [[t.clone() for t in ts] for _ in range(K)]
                    out = [torch.empty_like(t) for t in ts]
                else:
                    copies = [[torch.randn(numel, device="cuda")] for _ in range(K)]
                    out = [torch.empty(numel, device="cuda")]
                src, dst = torch.empty(numel, device="cuda"), torch.empty(numel, device="cuda")
                copy_ms = _ms(lambda: dst.copy_(src))
                for p in PARAMS:
                    table = {} if p is None else {("reduce_add", "triton"): {"block": p[0], "num_warps": p[1]}}
                    with _tuning.forced(table):
                        ms = _ms(lambda: fastpar.comm.reduce_add_coalesced(copies, 0, out=out))
                    gbps = (K + 1) * nbytes / ms / 1e6
                    copy_gbps = 2 * nbytes / copy_ms / 1e6
                    rows.append(dict(workload=wname, layout=layout, alloc=alloc, params=p or "default",
                                     ms=ms, gbps=gbps, copy_gbps=copy_gbps, of_copy=gbps / copy_gbps,
                                     src_addrs=[c[0].data_ptr() % (1 << 30) for c in copies]))
                    print(f"{wname:11s} {layout:5s} alloc{alloc} {str(p or 'default'):10s} "
                          f"{ms * 1e3:8.1f} us {gbps:7.0f} GB/s  copy_ {copy_gbps:7.0f}  {gbps / copy_gbps:6.1%}",
                          flush=True)
    if path:
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "triton": triton.__version__, "K": K, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
