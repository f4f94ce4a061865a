"""fastpar._alloc: large host buffers ask for transparent huge pages, and nothing else
changes."""
from __future__ import annotations

import sys

import pytest
import torch

from fastpar import _alloc


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unavailable"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8], ids=str)
def test_empty_is_torch_empty(dtype):
    for size in [0, 1, 7, (3, 5), 65_537, 3_000_001]:
        t = _alloc.empty(size, dtype=dtype, device="cpu")
        ref = torch.empty(size, dtype=dtype)
        assert t.shape == ref.shape and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
        t.fill_(1)  # writable over its whole length
        assert bool((t == 1).all())


def test_small_buffers_are_left_alone():
    assert not _alloc.advise_huge_pages(torch.empty(1000))
    assert not _alloc.advise_huge_pages(torch.empty((_alloc._MIN_BYTES - 4) // 4))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux-only")
def test_large_buffer_takes_the_hint():
    t = torch.empty(64 << 20, dtype=torch.uint8)
    assert _alloc.advise_huge_pages(t), "madvise(MADV_HUGEPAGE) refused a 64 MiB buffer"


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="transparent huge pages off here")
def test_large_buffer_gets_huge_pages():
    # AnonHugePages of this process's mappings grows once the advised buffer is written.
    def anon_huge_kb():
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))
    before = anon_huge_kb()
    t = _alloc.empty(64 << 20, dtype=torch.uint8, device="cpu")
    t.fill_(7)
    # At least one: a fragmented host may fall back to small pages for some of them.
    assert anon_huge_kb() - before >= 2 << 10, "no huge page behind a fresh 64 MiB buffer"
    assert int(t[:: 1 << 20].sum()) == 7 * 64


def test_env_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("FASTPAR_HUGE_PAGES", "0")
    assert _alloc._load_madvise() is None
