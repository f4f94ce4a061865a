"""The few things only a real multi-GPU machine runs: peer access and cross-device
stream ordering for kernels that read other GPUs' memory. Kept small and isolated; the
test suite runs them only where CUDA devices exist."""
from __future__ import annotations

import functools
import os

import torch


def allocator_allows_peer_pointers() -> bool:
    """False when fastpar does not rely on raw peer pointers into the allocator's memory.

    ``cudaMallocAsync`` pools need pool-specific access grants (``cudaMemPoolSetAccess``),
    which ``cudaDeviceEnablePeerAccess`` does not give. Expandable segments are mapped
    with ``cuMemMap``; torch's allocator does grant peers access to them when it enables
    a pair (``ExpandableSegment::addPeer``, called from ``get_p2p_access``, which
    :func:`_enable_pair` goes through), so the peer path should be safe there too, but
    that has not run on a multi-GPU machine yet: until it has, they take the staged path
    (correct, slower, and holding a staged copy of each other device's list on the
    destination).
    """
    if torch.cuda.get_allocator_backend() != "native":
        return False
    conf = ",".join((os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), os.environ.get("PYTORCH_ALLOC_CONF", ""),
                     _runtime_allocator_settings()))
    return "expandable_segments:true" not in conf.replace(" ", "").lower()


def _runtime_allocator_settings() -> str:
    """The allocator settings last set, where this torch can say (else ""): expandable
    segments may be turned on at run time (``torch._C._accelerator_setAllocatorSettings``,
    which ``torch.cuda.memory._set_allocator_settings`` calls), which the environment
    does not show. (Only the last string set is kept by torch: a later call setting
    another key hides an earlier ``expandable_segments:True``.)"""
    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if get is None:
        return ""
    try:
        return str(get())
    except RuntimeError:
        return ""


@functools.cache
def _enable_pair(dst: int, src: int) -> bool:
    """Let kernels on ``dst`` read ``src``'s memory. Goes through torch's own
    peer-access cache (``at::cuda::get_p2p_access``, which calls
    ``cudaDeviceEnablePeerAccess`` once per pair and tolerates "already enabled"): a
    one-element copy in each direction between the two devices triggers it, so torch
    and fastpar never disagree about what is enabled.

    The copy's dispatch enables the pair on the host, before it queues anything
    (``copy_kernel_cuda`` calls ``maybe_enable_p2p_access`` first), so nothing waits for
    the copies: a device synchronize here stalled every stream of both devices, and
    would break a CUDA graph another thread was capturing in the global mode."""
    if not torch.cuda.can_device_access_peer(dst, src):
        return False
    try:
        a = torch.zeros(1, device=f"cuda:{dst}")
        b = torch.zeros(1, device=f"cuda:{src}")
        a.copy_(b)  # get_p2p_access(src, dst): src may read dst's memory
        b.copy_(a)  # get_p2p_access(dst, src): what a kernel on dst reading src needs
    except RuntimeError:
        # cudaDeviceEnablePeerAccess failed (e.g. a device past its limit of peers):
        # torch's copies still work without it, a kernel reading raw peer pointers would
        # not, so this pair takes the staged path (remembered: no retry every call).
        return False
    return True


def enable_peer_access(dst: torch.device, sources) -> bool:
    """True if a kernel on ``dst`` may read the memory of every device in ``sources``
    (enabling peer access where needed)."""
    if not allocator_allows_peer_pointers():
        return False
    return all(s == dst or _enable_pair(dst.index, s.index) for s in sources)


def wait_for(dst: torch.device, sources) -> None:
    """Make ``dst``'s current stream wait for the work queued on each source device's
    current stream (the producers of the memory a peer kernel is about to read)."""
    dst_stream = torch.cuda.current_stream(dst)
    for s in {s for s in sources if s != dst}:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(s))
        dst_stream.wait_event(ev)


def release_to(dst: torch.device, sources) -> None:
    """Make each source device's current stream wait for ``dst``'s: nothing queued there
    afterwards (a write, or the allocator reusing freed memory) can overtake the peer
    kernel still reading it."""
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(dst))
    for s in {s for s in sources if s != dst}:
        torch.cuda.current_stream(s).wait_event(ev)


def refuse_capture(op: str, device: torch.device) -> None:
    """Raise if ``device``'s current stream is capturing a CUDA graph.

    fastpar's Triton launches read pointer tables copied from the host, some per call
    through pinned buffers that the host allocator hands out again once the call
    returns: a replayed graph would read whatever those buffers hold then (addresses of
    other tensors) and write through them; a cached plan's launches wait on the event
    of its table's copy, recorded outside any capture. So ops refuse to be captured,
    before they write anything."""
    with torch.cuda.device(device):
        capturing = torch.cuda.is_current_stream_capturing()
    if capturing:
        raise RuntimeError(
            f"fastpar's {op} cannot run while a CUDA graph is being captured on {device}: its "
            "launches read pointer tables copied from the host, which a replay would read stale. "
            "Call it outside the capture"
        )
