"""The agent workers use: one backend per peer pair, chosen from what both sides support.

`SelectingAgent` holds one agent per backend it may use (all available ones for
`--transfer-backend auto`, else just the named one), registers the pool with each that can
serve it, and publishes all of their metadata in one envelope (the `agent_metadata` bytes of
`KvDestination`). `add_peer` picks, in `PREFERENCE` order, the first backend both sides offer
that also accepts the peer (same host, mappable memory), so:

  both on one host, CUDA pools  -> cuda-ipc       both on one host, host pools -> shm
  anything else (other hosts, no shared memory, a peer with only nixl)         -> nixl

The choice is logged per peer and carried in every `TransferResult.backend` (the worker's
per-backend counters, a metric label). Notifications may arrive on any backend: a waiter
listens on all of them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
from typing import TYPE_CHECKING, Sequence

from kv_transfer.base import (KvTransferAgent, PeerName, PoolDescriptor, RemoteBlocks,
                              TransferError, TransferResult)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

BACKENDS = ("nixl", "shm", "cuda-ipc")
CHOICES = ("auto", *BACKENDS)
PREFERENCE = ("cuda-ipc", "shm", "nixl")  # fastest first; nixl works across hosts


def _new_backend(backend: str, name: str) -> KvTransferAgent:
    if backend == "nixl":
        from kv_transfer.nixl_backend import NixlAgent
        return NixlAgent(name)
    if backend == "shm":
        from kv_transfer.shm_backend import ShmAgent
        return ShmAgent(name)
    if backend == "cuda-ipc":
        from kv_transfer.cuda_ipc_backend import CudaIpcAgent
        return CudaIpcAgent(name)
    raise ValueError(f"unknown --transfer-backend {backend!r}; choose one of: " + ", ".join(CHOICES))


def prepare_pool(tensor: torch.Tensor, backend: str) -> None:
    """Move a host pool's storage into shared memory so `shm` can serve it (in place: the
    tensor keeps its identity; call before anything records its address). No-op for CUDA
    pools or backends without `shm`; a failure (e.g. a small /dev/shm) only logs, and the
    selector then uses NIXL."""
    if tensor.device.type != "cpu" or backend not in ("auto", "shm") or tensor.is_shared():
        return
    nbytes = tensor.numel() * tensor.element_size()
    try:  # tmpfs allocates lazily: a pool larger than /dev/shm would die of SIGBUS, not raise
        st = os.statvfs("/dev/shm")
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    if free < nbytes * 1.05:
        logger.warning("KV pool (%d B) does not fit in /dev/shm (%d B free): the shm transfer backend is off",
                       nbytes, free)
        return
    try:
        tensor.share_memory_()
    except RuntimeError as exc:
        logger.warning("KV pool not in shared memory (%s): the shm transfer backend is off", exc)


class SelectingAgent(KvTransferAgent):
    """A `KvTransferAgent` over several backends, one chosen per peer (module docstring).

    Args:
        backend: "auto" (every backend that starts here) or one of `BACKENDS`.
        name: agent name, non-empty and unique among communicating workers.

    Raises:
        ValueError: unknown backend or empty name. ImportError / TransferError: a backend
            named explicitly could not start (with "auto" it is skipped with a log line).
    """

    def __init__(self, backend: str, name: str) -> None:
        if backend not in CHOICES:
            raise ValueError(f"unknown --transfer-backend {backend!r}; choose one of: " + ", ".join(CHOICES))
        if not name:
            raise ValueError("transfer agent name must be non-empty")
        self._mode = backend
        self._name = PeerName(name)
        self._agents: dict[str, KvTransferAgent] = {}
        for b in (BACKENDS if backend == "auto" else (backend,)):
            try:
                self._agents[b] = _new_backend(b, name)
            except (ImportError, TransferError) as exc:
                if backend != "auto":
                    raise
                logger.info("transfer backend %s unavailable here: %s", b, exc)
        if not self._agents:
            raise TransferError("no transfer backend could start")
        self._registered: dict[str, KvTransferAgent] = {}
        self._chosen: dict[str, str] = {}  # peer name -> backend
        self._peer_md: dict[str, bytes] = {}

    @property
    def name(self) -> PeerName:
        return self._name

    @property
    def backend(self) -> str:
        return self._mode

    def backend_for(self, peer_name: str) -> str | None:
        """The backend chosen for a peer, None if the peer is unknown."""
        return self._chosen.get(peer_name)

    @property
    def backends(self) -> tuple[str, ...]:
        """Backends serving the registered pool (those peers may choose)."""
        return tuple(self._registered)

    def register_pool(self, tensor: torch.Tensor) -> PoolDescriptor:
        if self._registered:
            raise RuntimeError("a KV pool is already registered with this agent")
        desc = None
        for b, agent in self._agents.items():
            try:
                d = agent.register_pool(tensor)
            except (ValueError, TransferError) as exc:
                if self._mode != "auto" or not tensor.is_contiguous() or tensor.numel() == 0:
                    raise
                logger.info("transfer backend %s cannot serve this pool: %s", b, exc)
                continue
            self._registered[b] = agent
            desc = desc or d
        if desc is None:
            raise TransferError("no transfer backend can serve this KV pool")
        for b in [b for b in self._agents if b not in self._registered]:
            self._agents.pop(b).close()
        logger.info("transfer agent %s: backends %s", self._name, ", ".join(self._registered))
        return desc

    def metadata(self) -> bytes:
        if not self._registered:
            raise RuntimeError("register_pool before publishing metadata")
        return json.dumps({"name": self._name, "backends": {
            b: base64.b64encode(a.metadata()).decode() for b, a in self._registered.items()}}).encode()

    def add_peer(self, name: str, metadata: bytes) -> None:
        if not name or name == self._name:
            raise ValueError(f"invalid peer name {name!r} (empty or this agent's own)")
        if self._peer_md.get(name) == metadata:
            return
        try:
            envelope = json.loads(metadata)
            offered = {b: base64.b64decode(md) for b, md in envelope["backends"].items()}
            peer_name = envelope["name"]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise TransferError(f"invalid transfer metadata for peer {name!r}: {exc}") from exc
        if peer_name != name:
            raise ValueError(f"metadata is for agent {peer_name!r}, not {name!r}")
        self.remove_peer(name)
        reasons = []
        for b in PREFERENCE:
            if b not in self._registered or b not in offered:
                continue
            try:
                self._registered[b].add_peer(name, offered[b])
            except TransferError as exc:
                reasons.append(f"{b}: {exc}")
                continue
            self._chosen[name], self._peer_md[name] = b, metadata
            logger.info("transfer peer %s: backend %s%s", name, b,
                        f" (skipped {'; '.join(reasons)})" if reasons else "")
            return
        raise TransferError(f"no common transfer backend with {name!r}: we offer "
                            f"{list(self._registered)}, it offers {list(offered)}"
                            + (f"; {'; '.join(reasons)}" if reasons else ""))

    def has_peer(self, name: str) -> bool:
        return name in self._chosen

    def remove_peer(self, name: str) -> None:
        b = self._chosen.pop(name, None)
        self._peer_md.pop(name, None)
        if b is not None:
            self._registered[b].remove_peer(name)

    async def write_blocks(self, peer_name: str, src_block_ids: Sequence[int], dst: RemoteBlocks,
                           notification: bytes | None, timeout_s: float) -> TransferResult:
        b = self._chosen.get(peer_name)
        if b is None:
            if not self._registered:
                raise RuntimeError("register_pool before writing blocks")
            raise TransferError(f"unknown transfer peer {peer_name!r} (no metadata loaded)")
        return await self._registered[b].write_blocks(peer_name, src_block_ids, dst, notification,
                                                      timeout_s)

    async def wait_notification(self, message: bytes, timeout_s: float) -> PeerName:
        agents = list(self._registered.values()) or list(self._agents.values())
        if len(agents) == 1:
            return await agents[0].wait_notification(message, timeout_s)
        waits = [asyncio.ensure_future(a.wait_notification(message, timeout_s)) for a in agents]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:  # the first result, or the first error (all time out together)
                if w in done and w.exception() is None:
                    return w.result()
            return next(iter(done)).result()
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    def close(self) -> None:
        for agent in self._agents.values():
            agent.close()
        self._agents.clear()
        self._registered.clear()
        self._chosen.clear()
