"""`shm` backend: host KV pools in shared memory, written by a plain copy (same host only).

Why: on one host NIXL/UCX moves host memory with CMA (process_vm_writev) on one thread inside
the post call, holding the GIL — about half of a one-thread memcpy on our 2-core machine
(docs/bench/transfer.md). With the pool in shared memory the writer maps the peer's pool and
copies with torch's `copy_`, in a worker thread with the GIL released: memcpy speed, and the
event loop (and the model thread) keep running during the copy.

Export: the pool tensor's storage must be in shared memory (`tensor.share_memory_()`, which
`kv_transfer.prepare_pool` does for host pools); its file descriptor (torch's
`_share_fd_cpu_`) is opened by the peer as /proc/<pid>/fd/<fd> — the same permission UCX's CMA
needs (same user, ptrace allowed), so where this fails the selector falls back to NIXL.

Copies run in slices of `_SLICE_BYTES`; between slices the copy thread checks for a deadline,
a cancellation and the peer's liveness, so a failed write stops within one slice and never
outlives its outcome.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kv_transfer.base import HOST_DEVICE, PoolDescriptor, TransferError, TransferTimeout
from kv_transfer.same_host import Peer, SameHostAgent

_SLICE_BYTES = 8 << 20
_INLINE_BYTES = 1 << 20  # smaller writes copy on the loop thread: a thread hop costs more
_COPY_THREADS = 8  # threads for all writes; concurrent writes of different requests share them


def default_parallel() -> int:
    """Copy threads per large write: memory bandwidth needs more than one core's copy, and
    each thread copies with one core (torch's intra-op threads are not used off the main
    thread). At most 4, and half the cores so the model keeps some."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The contiguous tensor's memory as a flat uint8 tensor (any dtype: f32, bf16, fp8)."""
    return tensor.reshape(-1).view(torch.uint8)


class ShmAgent(SameHostAgent):
    """`KvTransferAgent` for host pools in shared memory (see the module docstring)."""

    BACKEND = "shm"

    def __init__(self, name: str, parallel: int | None = None) -> None:
        super().__init__(name)
        self._src: torch.Tensor | None = None
        self._parallel = parallel or default_parallel()
        self._executor = ThreadPoolExecutor(max(_COPY_THREADS, 2 * self._parallel),
                                            thread_name_prefix=f"kv-shm-{name}")

    def _export_pool(self, tensor: torch.Tensor) -> dict[str, Any]:
        if tensor.device.type != "cpu":
            raise ValueError("the shm backend serves host (CPU) pools only")
        if not tensor.is_shared():
            raise ValueError("the host pool is not in shared memory (call kv_transfer.prepare_pool)")
        fd, size = tensor.untyped_storage()._share_fd_cpu_()
        self._src = flat_bytes(tensor)
        return {"pid": os.getpid(), "fd": int(fd), "storage_bytes": int(size),
                "offset": tensor.storage_offset() * tensor.element_size()}

    def _open(self, export: dict[str, Any], pool: PoolDescriptor) -> Any:
        if pool.device_id != HOST_DEVICE:
            raise TransferError("the peer's pool is not in host memory")
        path = f"/proc/{int(export['pid'])}/fd/{int(export['fd'])}"
        try:
            fd = os.open(path, os.O_RDWR)
            try:
                # MAP_POPULATE maps every page now (~0.2 s per GB once per peer), not on the
                # first write's page faults.
                mapped = mmap.mmap(fd, 0, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            finally:
                os.close(fd)
        except (OSError, ValueError) as exc:
            raise TransferError(f"cannot map the peer's pool ({path}): {exc}") from exc
        start = int(export["offset"])
        end = start + pool.num_blocks * pool.block_stride_bytes
        if end > len(mapped):
            raise TransferError(f"peer's pool ({end} B) exceeds its shared memory ({len(mapped)} B)")
        return torch.frombuffer(mapped, dtype=torch.uint8)[start:end]  # keeps the mapping alive

    async def _copy(self, peer: Peer, runs: list[tuple[int, int, int]], deadline: float) -> None:
        src, dst = self._src, peer.memory
        assert src is not None
        stop = threading.Event()
        if sum(n for _, _, n in runs) <= _INLINE_BYTES:
            _copy_runs(src, dst, runs, deadline, stop, peer)
            return
        # Large writes: `parallel` threads, each taking every parallel-th slice.
        slices = _slices(runs)
        k = max(1, min(self._parallel, len(slices) // 2))
        loop = asyncio.get_running_loop()
        futs = [loop.run_in_executor(self._executor, _copy_runs, src, dst, slices[i::k], deadline, stop, peer)
                for i in range(k)]
        fut = asyncio.gather(*futs)
        try:
            await asyncio.wait_for(asyncio.shield(fut), max(deadline - time.monotonic(), 0))
        except (TimeoutError, asyncio.CancelledError, TransferError) as exc:
            # Stop the copy threads and wait for them (at most one slice each), so no byte
            # moves after the outcome; every thread's own error is retrieved and dropped.
            stop.set()
            await asyncio.wait(futs)
            for f in [*futs, fut]:
                if f.done() and not f.cancelled():
                    f.exception()
            if isinstance(exc, TimeoutError):
                raise TransferTimeout(f"write to {peer.name!r} passed its deadline") from None
            raise

    def close(self) -> None:
        super().close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._src = None


def _slices(runs: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Runs cut into pieces of at most _SLICE_BYTES."""
    return [(s + off, d + off, min(_SLICE_BYTES, n - off)) for s, d, n in runs for off in range(0, n, _SLICE_BYTES)]


def _copy_runs(src: torch.Tensor, dst: torch.Tensor, runs: list[tuple[int, int, int]],
               deadline: float, stop: threading.Event, peer: Peer) -> None:
    """On a copy thread: src[s:s+n] -> dst[d:d+n] for every run, slice by slice; between
    slices it stops on `stop`, the deadline, or the peer leaving."""
    for i, (s, d, n) in enumerate(_slices(runs)):
        if stop.is_set():
            raise TransferError(f"write to {peer.name!r} stopped")
        if time.monotonic() >= deadline:
            raise TransferTimeout(f"write to {peer.name!r} passed its deadline")
        if i and not peer.alive():
            raise TransferError(f"transfer peer {peer.name!r} disconnected during the write")
        dst[d:d + n].copy_(src[s:s + n])
