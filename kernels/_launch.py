"""A cheap kernel-launch counter that tests and benchmarks can read."""
from __future__ import annotations

import collections
import os
import threading
import weakref

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
    global _get_worker_info
    if os.getpid() != IMPORT_PID:
        return True
    if _get_worker_info is None:  # imported here once: torch.utils.data is slow to import
        from torch.utils.data import get_worker_info as _get_worker_info
    return _get_worker_info() is not None


_get_worker_info = None


#: Every lock made by :func:`fork_safe_lock` (held weakly: a lock goes with its owner).
_FORK_SAFE_LOCKS: "weakref.WeakSet" = weakref.WeakSet()


def fork_safe_lock(lock=None):
    """``lock`` (a new ``threading.RLock`` by default), made free again in a forked child.

    A child of ``fork()`` holds a copy of every lock as it was, but only the forking
    thread: a lock another thread held at that instant (a DDP hook on gloo's callback
    thread, a replica thread, a user thread inside a fastpar call) is held by no one
    there and would never be released, and the child's first fastpar call that takes it
    (every launch counts itself under one) would wait forever. As the standard library
    does for its own locks (``logging``, ``concurrent.futures``), the child re-creates
    them: what they guarded was left by threads that do not exist there.

    Except a lock the forking thread itself holds (a fork from inside a ``with lock:``
    block, e.g. a logging handler or ``__del__`` run while fastpar holds one): that thread
    goes on in the child and leaves the block, whose release would raise on a lock made
    anew ("release unlocked lock"). An ``RLock`` knows its owner (``_is_owned``, the
    forking thread keeps its ident in the child), so the default is one: a plain
    ``Lock`` passed in cannot tell and is always made anew."""
    if lock is None:
        lock = threading.RLock()
    _FORK_SAFE_LOCKS.add(lock)
    return lock


def _reinit_locks_after_fork() -> None:
    for lock in list(_FORK_SAFE_LOCKS):
        owned = getattr(lock, "_is_owned", None)
        if owned is None or not owned():  # (held by the forking thread: it releases it)
            lock._at_fork_reinit()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reinit_locks_after_fork)


class LaunchCounter:
    """Counts kernel launches per ``(backend, op)``.

    Launchers call :meth:`record` once per launch. Reading is cheap; use
    :func:`fastpar.count_launches` to measure one region of code.
    """

    def __init__(self) -> None:
        self._lock = fork_safe_lock()
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
