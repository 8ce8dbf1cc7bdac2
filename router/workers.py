"""The router's view of the workers: discovery's instances, filtered to those it may use,
with one gRPC channel per worker."""

from __future__ import annotations

import logging
import time

import grpc

from common.grpc_server import channel
from common.pb.tandem.v1 import discovery_pb2

log = logging.getLogger(__name__)


class WorkerSet:
    """Which workers can serve this router's model (same name, block size and hash seed)."""

    def __init__(self, watcher, model: str, block_size: int, hash_seed: int) -> None:
        self._watcher = watcher
        self.model = model
        self.block_size = block_size
        self.hash_seed = hash_seed
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._refused: set[str] = set()
        self.refused_workers = 0  # counter: workers refused for model, block size or hash seed
        self._aside: dict[str, float] = {}  # instance id -> monotonic time it may be used again
        self.set_aside_s = 5.0
        self.health = None  # router.health.HealthTracker, when probing: unhealthy workers are not candidates

    def _compatible(self, inst: discovery_pb2.Instance) -> bool:
        if inst.model == self.model and inst.block_size == self.block_size and inst.hash_seed == self.hash_seed:
            return True
        if inst.instance_id not in self._refused:  # say it once, never score it silently
            self._refused.add(inst.instance_id)
            self.refused_workers += 1
            log.warning("refusing worker %s at %s: model=%s block_size=%d hash_seed=%d, router has "
                        "model=%s block_size=%d hash_seed=%d", inst.instance_id, inst.address, inst.model,
                        inst.block_size, inst.hash_seed, self.model, self.block_size, self.hash_seed)
        return False

    def candidates(self, role: int, serving_only: bool = True) -> list[discovery_pb2.Instance]:
        """Compatible instances of `role` in discovery now: by default only SERVING ones that
        are neither set aside nor unhealthy."""
        now = time.monotonic()
        return [i for i in self._watcher.instances().values()
                if i.role == role and self._compatible(i)
                and (not serving_only or (i.state == discovery_pb2.INSTANCE_STATE_SERVING
                                          and self._aside.get(i.instance_id, 0.0) <= now
                                          and (self.health is None or self.health.healthy(i.instance_id))))]

    def instance_ids(self) -> list[str]:
        """Every instance in discovery now (any role, state or compatibility)."""
        return list(self._watcher.instances())

    def set_aside(self, instance_id: str, seconds: float | None = None) -> None:
        """Route nothing new to a worker that refused a connection, for `seconds` (default
        set_aside_s): long enough for its lease to expire if it died. Counts as a transport
        failure for health."""
        self._aside[instance_id] = time.monotonic() + (self.set_aside_s if seconds is None else seconds)
        if self.health is not None:
            self.health.record_transport_failure(instance_id, "refused a call")

    def channel(self, inst: discovery_pb2.Instance) -> grpc.aio.Channel:
        return self.channel_for(inst.address)

    def channel_for(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = channel(address)
        return ch

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
