"""The router's view of the workers: discovery's instances, filtered to those it may use,
with one gRPC channel per worker instance.

Channel lifecycle: a channel is opened on first use for an instance in discovery, replaced
when the instance's record moves to another address, and closed when the instance leaves
discovery (`prune`, on every membership change), so the router never keeps dialling an
address whose record is gone and the pool is bounded by the instances in discovery."""

from __future__ import annotations

import asyncio
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
        self._channels: dict[str, tuple[str, grpc.aio.Channel]] = {}  # instance id -> (address, channel)
        self._closing: set[asyncio.Task] = set()  # strong references to channel closes
        self.channels_closed = 0  # counter: channels closed because their instance left or moved
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

    def instance(self, instance_id: str) -> discovery_pb2.Instance | None:
        """The instance's record in discovery now, or None once it left."""
        return self._watcher.instances().get(instance_id)

    def channel(self, inst: discovery_pb2.Instance) -> grpc.aio.Channel:
        return self.channel_to(inst.instance_id, inst.address)

    def channel_to(self, instance_id: str, address: str) -> grpc.aio.Channel:
        """The channel to this instance at `address` (opened now if needed; a record that moved
        to another address gets a new one, the old one is closed).

        Raises:
            LookupError: the instance is not in discovery at that address (never dial a
                departed address).
        """
        inst = self.instance(instance_id)
        if inst is None or inst.address != address:
            raise LookupError(f"worker {instance_id} at {address} is no longer in discovery")
        entry = self._channels.get(instance_id)
        if entry is not None and entry[0] == address:
            return entry[1]
        if entry is not None:
            log.info("worker %s moved from %s to %s: new channel", instance_id, entry[0], address)
            self._close(entry[1])
        ch = channel(address)
        self._channels[instance_id] = (address, ch)
        return ch

    def prune(self) -> list[str]:
        """Close the channels of instances no longer in discovery, or whose record moved to
        another address; returns the instance ids whose channel was closed. (Their open calls
        end CANCELLED: call after migrating them.)"""
        present = self._watcher.instances()
        gone = [wid for wid, (addr, _) in self._channels.items()
                if wid not in present or present[wid].address != addr]
        for wid in gone:
            self._close(self._channels.pop(wid)[1])
        return gone

    def channel_count(self) -> int:
        return len(self._channels)

    def _close(self, ch: grpc.aio.Channel) -> None:
        self.channels_closed += 1
        task = asyncio.get_running_loop().create_task(ch.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for _, ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)
