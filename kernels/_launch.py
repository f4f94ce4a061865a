"""A cheap kernel-launch counter that tests and benchmarks can read."""
from __future__ import annotations

import collections
import threading


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
