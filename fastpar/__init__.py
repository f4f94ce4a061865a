"""fastpar: single-launch data-parallel kernels for PyTorch.

Multi-tensor flatten/unflatten, fused reduce-add (:mod:`fastpar.comm`), cuDNN-layout RNN
packing (:mod:`fastpar.rnn`), and drop-ins for ``torch.nn.parallel``'s ``DataParallel``,
``data_parallel``, ``replicate``, ``scatter``, ``gather`` and ``parallel_apply`` (the
same names at the top level, as there), on Triton (CUDA) and Numba (CPU) kernels. DDP communication hooks live in
:mod:`fastpar.ddp` (``import fastpar.ddp``; it needs ``torch.distributed``).
"""
from __future__ import annotations

import contextlib

from . import comm, rnn
from .kernels import _launch as _kernels_launch  # noqa: F401  (pins the PID forked children compare with)
from ._dispatch import backend_for, use_backend
from ._flatten import flatten, unflatten, unflatten_into
from ._plan import clear_plan_cache
from ._tuning import TuningWarning
from .data_parallel import DataParallel, data_parallel
from .parallel_apply import parallel_apply
from .replicate import replicate
from .scatter_gather import gather, scatter

__version__ = "0.1.0"

__all__ = [
    "DataParallel",
    "TuningWarning",
    "__version__",
    "backend_for",
    "clear_plan_cache",
    "comm",
    "count_launches",
    "data_parallel",
    "empty_cache",
    "flatten",
    "gather",
    "parallel_apply",
    "replicate",
    "rnn",
    "scatter",
    "unflatten",
    "unflatten_into",
    "use_backend",
]


class LaunchCount:
    """Launches recorded inside a :func:`count_launches` block (read after it ends)."""

    total: int = 0
    by_op: dict

    def __repr__(self) -> str:
        ops = ", ".join(f"{b}/{op}: {n}" for (b, op), n in sorted(self.by_op.items()))
        return f"LaunchCount(total={self.total}{', ' + ops if ops else ''})"


def empty_cache() -> None:
    """Release the memory fastpar keeps for reuse, as :func:`torch.cuda.empty_cache`
    does for CUDA's caching allocator.

    Drops the host result buffers kept for the results of ``flatten`` and
    ``reduce_add_coalesced`` (up to ``FASTPAR_RESULT_CACHE_MB``, 1 GiB by default), every
    cached plan (:func:`clear_plan_cache`, with the references it holds to tensors) and
    the DDP hooks' per-bucket buffers (:func:`fastpar.ddp.release_buffers`, where
    :mod:`fastpar.ddp` is in use). A buffer whose results are still alive is freed when
    they die; the tensors themselves keep their values. ``replicate``'s per-model
    buffers live and die with their module. Safe at any time: later calls allocate anew.
    """
    import sys

    from ._alloc import RESULTS

    RESULTS.clear()
    clear_plan_cache()
    ddp = sys.modules.get(f"{__name__}.ddp")
    if ddp is not None:
        ddp.release_buffers()


@contextlib.contextmanager
def count_launches():
    """Count the kernel launches made by fastpar while the ``with`` block runs::

        with fastpar.count_launches() as n:
            fastpar.flatten(params)
        assert n.total == 1

    The counter is process-wide: launches made meanwhile by other threads count too
    (replica threads of ``DataParallel`` and autograd's backward threads, which is what
    a count of a step wants; another thread's unrelated work is counted as well).
    """
    from .kernels import launches

    total0, by0 = launches.snapshot()
    result = LaunchCount()
    result.by_op = {}
    try:
        yield result
    finally:
        total1, by1 = launches.snapshot()
        result.total = total1 - total0
        result.by_op = {k: v for k, v in (by1 - by0).items() if v}
