"""Reference K-way reduce-add in plain torch ops, accumulating like the kernels (float32
for 16-bit floats, int64 for integers)."""
from __future__ import annotations

import torch

_ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def _per_tensor(side, numels):
    # A side is either the N tensors or one 1-D buffer holding them end to end.
    if isinstance(side, torch.Tensor):
        return side.split_with_sizes(numels.tolist())
    return side


@torch.no_grad()  # (the kernels write outside autograd: results carry no history)
def reduce_add(group) -> None:
    """Write ``sum_k src[k][t]`` into every destination ``t`` of ``group``."""
    acc_dtype = _ACC.get(group.dtype, group.dtype if group.dtype.is_floating_point else torch.int64)
    sources = [_per_tensor(s, group.numels) for s in group.sources]
    for t, dst in enumerate(_per_tensor(group.destinations, group.numels)):
        # Flat pieces: a source may be the tensor itself (N-D) or its piece of a packed
        # buffer (1-D), and the sources of one position mix the two.
        acc = sources[0][t].reshape(-1).to(group.device, acc_dtype)
        for src in sources[1:]:
            acc = acc + src[t].reshape(-1).to(group.device, acc_dtype)
        dst.data.copy_(acc.view(dst.shape))  # (.data: the caller bumps each version once)
