"""Reference K-way reduce-add in plain torch ops (float64-free: accumulates like the
kernels, float32 for 16-bit floats). Works on the raw addresses of a ReduceGroup by
viewing them through the tensors the group was built from."""
from __future__ import annotations

import torch

_ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def reduce_add(group) -> None:
    """Write ``sum_k src[k][t]`` into every destination ``t`` of ``group``."""
    acc_dtype = _ACC.get(group.dtype, torch.int64 if not group.dtype.is_floating_point else group.dtype)
    for t in range(len(group.numels)):
        srcs = [group.sources[k][t] for k in range(group.n_sources)]
        acc = srcs[0].to(group.device, acc_dtype)
        for s in srcs[1:]:
            acc = acc + s.to(group.device, acc_dtype)
        group.destinations[t].copy_(acc.view_as(group.destinations[t]))
