"""A cheap kernel-launch counter that tests and benchmarks can read."""
from __future__ import annotations

import collections
import os
import threading

#: The process ``fastpar`` was imported in (``fastpar/__init__`` imports this module).
#: A forked child of it has another PID: see :func:`forked`.
IMPORT_PID = os.getpid()


def forked() -> bool:
    """True in a process forked after ``fastpar`` was imported, or in a DataLoader
    worker (which may have been forked before fastpar was first imported there).

    GNU OpenMP, which torch and Numba's ``omp`` layer share, cannot start a parallel
    region in a forked child once its parent has used it: the child is killed
    ("fork() called from a process already using GNU OpenMP") or waits forever at the
    region's barrier. Launchers run serially where this is True."""
    if os.getpid() != IMPORT_PID:
        return True
    from torch.utils.data import get_worker_info

    return get_worker_info() is not None


class LaunchCounter:
    """Counts kernel launches per ``(backend, op)``.

    Launchers call :meth:`record` once per launch. Reading is cheap; use
    :func:`fastpar.count_launches` to measure one region of code.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.total = 0
        self.by_op: collections.Counter[tuple[str, str]] = collections.Counter()

    def record(self, backend: str, op: str, n: int = 1) -> None:
        with self._lock:
            self.total += n
            self.by_op[(backend, op)] += n

    def snapshot(self) -> tuple[int, collections.Counter]:
        with self._lock:
            return self.total, collections.Counter(self.by_op)


launches = LaunchCounter()
