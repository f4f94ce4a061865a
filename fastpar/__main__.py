"""``python -m fastpar``: ``info`` (environment and backends)."""
from __future__ import annotations

import argparse
import platform
import sys


def _info(args) -> int:
    import warnings

    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    import numba
    import torch
    import triton

    import fastpar
    from fastpar import _dispatch

    print(f"fastpar {fastpar.__version__}  python {platform.python_version()}  {platform.machine()}")
    print(f"torch {torch.__version__}  triton {triton.__version__}  numba {numba.__version__}")
    devices = [torch.device("cpu")] + [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    print("devices:")
    for d in devices:
        name = torch.cuda.get_device_name(d) if d.type == "cuda" else platform.processor() or "cpu"
        print(f"  {str(d):8s} {name:40s} backend={_dispatch.backend_for(d)}")
    if torch.cuda.device_count() > 1:
        n = torch.cuda.device_count()
        peers = [f"{i}->{j}" for i in range(n) for j in range(n) if i != j and torch.cuda.can_device_access_peer(i, j)]
        print(f"  peer access: {', '.join(peers) or 'none'}")
    print("triton ahead-of-time compile (no GPU needed):")
    from fastpar.kernels.ops_triton import aot

    for cc in (80, 90):
        try:
            ptx = aot.compile_copy(cc)
            vec = "128-bit vector loads" if "ld.global.v4" in ptx else "scalar loads"
            print(f"  sm_{cc}: ok ({vec} on the aligned fp32 copy)")
        except Exception as e:  # report, don't crash: this is a diagnostic
            print(f"  sm_{cc}: FAILED: {type(e).__name__}: {e}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastpar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, devices, the backend of each, Triton AOT check")
    args = parser.parse_args(argv)
    return {"info": _info}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
