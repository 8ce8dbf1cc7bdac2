"""`cuda-ipc` backend: GPU KV pools of two processes on one host, copied device to device.

Why: the `nixl-cu13` wheel's UCX has no working CUDA transports on our H200 machine, so NIXL
stages GPU memory through the host at ~0.5 GB/s, against ~2,000 GB/s for a device-to-device
copy. CUDA IPC maps the peer's pool into this process, and a write is `copy_` on the GPU's copy
path.

Export: torch's own CUDA IPC (`torch.multiprocessing.reductions.reduce_tensor`, i.e.
cudaIpcGetMemHandle of the pool's allocation plus torch's reference counter), sent as JSON
fields in the agent metadata (never pickled: metadata comes from the network). The peer
rebuilds the tensor with `rebuild_cuda_tensor` (cudaIpcOpenMemHandle). A process cannot open
its own handle, so both ends must be different processes; device indices are taken as equal in
both (same CUDA_VISIBLE_DEVICES) — where opening fails, the selector falls back to NIXL.

Copies are issued on a dedicated stream of the source device that first waits for the
device's default stream (where the model wrote the blocks), so they overlap the next chunk's
compute; an event recorded after them is polled from the event loop. A CUDA copy cannot be
aborted: on a deadline or cancellation the write waits (bounded) for the event before
reporting, so the peer's blocks are never written after the outcome. The notification goes
out over the same-host socket once the event completed, so the data is in the peer's memory
when the peer hears of it.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Any

import torch

from kv_transfer.base import HOST_DEVICE, PoolDescriptor, TransferError, TransferTimeout
from kv_transfer.same_host import Peer, SameHostAgent
from kv_transfer.shm_backend import flat_bytes

logger = logging.getLogger(__name__)

_POLL_SLEEP_S = 0.0002
_SPIN_S = 0.0005  # yield-spin this long before waiting on a thread (see _copy)
_ABORT_GRACE_S = 10.0  # a queued copy of a few GB finishes well within this


def cuda_ipc_available() -> bool:
    """Whether this process can serve CUDA pools (torch with CUDA and a visible device)."""
    return torch.cuda.is_available()


def _b64(raw: Any) -> str | None:
    return None if raw is None else base64.b64encode(bytes(raw)).decode()


def _unb64(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


class CudaIpcAgent(SameHostAgent):
    """`KvTransferAgent` for CUDA pools of processes on one host (see the module docstring)."""

    BACKEND = "cuda-ipc"

    def __init__(self, name: str) -> None:
        if not cuda_ipc_available():
            raise TransferError("cuda-ipc needs torch with CUDA and a visible GPU")
        super().__init__(name)
        self._src: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None

    def _export_pool(self, tensor: torch.Tensor) -> dict[str, Any]:
        if tensor.device.type != "cuda":
            raise ValueError("the cuda-ipc backend serves CUDA pools only")
        from torch.multiprocessing.reductions import reduce_tensor
        flat = flat_bytes(tensor)
        _, args = reduce_tensor(flat)
        (_cls, size, _stride, tensor_offset, _storage_cls, _dtype, device, handle, storage_bytes,
         storage_offset, _grad, ref_handle, ref_offset, event_handle, event_sync) = args
        self._src = flat
        self._stream = torch.cuda.Stream(device=tensor.device)
        return {"device": int(device), "handle": _b64(handle), "storage_bytes": int(storage_bytes),
                "storage_offset": int(storage_offset), "tensor_offset": int(tensor_offset),
                "numel": int(size[0]), "ref_handle": _b64(ref_handle), "ref_offset": int(ref_offset),
                "event_handle": _b64(event_handle), "event_sync": bool(event_sync)}

    def _open(self, export: dict[str, Any], pool: PoolDescriptor) -> Any:
        if pool.device_id == HOST_DEVICE:
            raise TransferError("the peer's pool is not in GPU memory")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
        numel = int(export["numel"])
        if numel != pool.num_blocks * pool.block_stride_bytes:
            raise TransferError(f"peer's export ({numel} B) does not match its pool descriptor")
        try:
            return rebuild_cuda_tensor(
                torch.Tensor, torch.Size([numel]), (1,), int(export["tensor_offset"]),
                torch.storage.TypedStorage, torch.uint8, int(export["device"]),
                _unb64(export["handle"]), int(export["storage_bytes"]), int(export["storage_offset"]),
                False, _unb64(export["ref_handle"]), int(export["ref_offset"]),
                _unb64(export["event_handle"]), bool(export["event_sync"]))
        except (RuntimeError, ValueError, TypeError) as exc:  # e.g. another host's handle
            raise TransferError(f"cannot open the peer's CUDA IPC handle: {exc}") from exc

    async def _copy(self, peer: Peer, runs: list[tuple[int, int, int]], deadline: float) -> None:
        src, dst, stream = self._src, peer.memory, self._stream
        assert src is not None and stream is not None
        # The model writes the pool on the default stream: copy only what it has finished.
        stream.wait_stream(torch.cuda.default_stream(src.device))
        with torch.cuda.stream(stream):
            for s, d, n in runs:
                dst[d:d + n].copy_(src[s:s + n], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        # Measured on the H200: polling with asyncio.sleep costs ~1 ms per wake-up (epoll's
        # timeout granularity: 0.12-0.38 of a device-to-device copy); a thread waiting on
        # Event.synchronize (GIL released) costs ~0.3 ms of hand-off (small transfers 5x
        # slower). So: yield-spin for up to _SPIN_S (copies up to ~1 GB end there), then a thread.
        try:
            spin_end = time.perf_counter() + _SPIN_S
            while not done.query() and time.perf_counter() < spin_end:
                await asyncio.sleep(0)
            if not done.query():
                waiter = asyncio.get_running_loop().run_in_executor(None, done.synchronize)
                try:
                    await asyncio.wait_for(asyncio.shield(waiter), timeout=max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    raise TransferTimeout(f"write to {peer.name!r} passed its deadline") from None
        except BaseException:
            await self._quiesce(done, peer.name)
            raise

    async def _quiesce(self, done: torch.cuda.Event, peer_name: str) -> None:
        """Wait (bounded) until the queued copies ran: they cannot be aborted."""
        t_end = time.monotonic() + _ABORT_GRACE_S
        while not done.query():
            if time.monotonic() >= t_end:
                logger.error("copies to %r still queued %.0f s after their write failed",
                             peer_name, _ABORT_GRACE_S)
                return
            await asyncio.sleep(_POLL_SLEEP_S)

    def close(self) -> None:
        super().close()
        self._src = self._stream = None
