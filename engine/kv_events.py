"""KV event batches of one worker: a bounded ring with monotonically increasing ids.

The block pool records Stored/Removed/Cleared events as it changes; `publish()` turns the
pending ones into one batch with the next event id. Subscribers that are new or fell behind the
ring start from a snapshot of every cached block.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from common.pb.tandem.v1 import kv_events_pb2 as pb
from engine.block_pool import BlockPool, Cleared, PoolEvent, Removed, Stored


def event_to_proto(ev: PoolEvent) -> pb.KvEvent:
    if isinstance(ev, Stored):
        stored = pb.BlockStored(block_hashes=list(ev.hashes))
        if ev.parent is not None:
            stored.parent_hash = ev.parent
        return pb.KvEvent(stored=stored)
    if isinstance(ev, Removed):
        return pb.KvEvent(removed=pb.BlockRemoved(block_hashes=list(ev.hashes)))
    assert isinstance(ev, Cleared)
    return pb.KvEvent(cleared=pb.AllBlocksCleared())


@dataclass(frozen=True)
class EventBatch:
    event_id: int
    events: tuple[PoolEvent, ...]


class KvEventLog:
    """Ring of recent batches for one pool; `capacity` is in batches. `incarnation`: the worker
    process's (Instance.incarnation), stamped on every batch; ids count within it."""

    def __init__(self, blocks: BlockPool, capacity: int = 1024, incarnation: int = 0) -> None:
        self._blocks = blocks
        self.incarnation = incarnation
        self._ring: deque[EventBatch] = deque(maxlen=capacity)
        self.last_event_id = 0
        self._changed = asyncio.Event()
        # Why subscribers got snapshots (besides being new): counted for metrics.
        self.future_subscribers = 0  # asked from an id this worker never issued
        self.behind_subscribers = 0  # asked from an id that left the ring
        self.other_incarnation_subscribers = 0  # asked from an id of another incarnation

    def publish(self) -> None:
        """Turn the pool's pending events into one batch (no-op when there are none)."""
        events = self._blocks.drain_events()
        if not events:
            return
        self.last_event_id += 1
        self._ring.append(EventBatch(self.last_event_id, tuple(events)))
        self._changed.set()
        self._changed = asyncio.Event()

    def other_incarnation(self, incarnation: int) -> bool:
        """Whether a subscriber's `incarnation` (nonzero) is another process's: its event ids
        mean nothing here, so it needs a snapshot (counted)."""
        if incarnation and incarnation != self.incarnation:
            self.other_incarnation_subscribers += 1
            return True
        return False

    def since(self, event_id: int) -> list[EventBatch] | None:
        """Batches after event_id, or None when the ring no longer holds them all."""
        if event_id > self.last_event_id:
            self.future_subscribers += 1
            return None  # it saw an earlier incarnation of this worker
        if event_id == self.last_event_id:
            return []
        if self._ring[0].event_id > event_id + 1:
            self.behind_subscribers += 1
            return None  # fell behind the ring
        return [b for b in self._ring if b.event_id > event_id]

    def snapshot(self) -> pb.KvEventBatch:
        return pb.KvEventBatch(event_id=self.last_event_id, snapshot=True, incarnation=self.incarnation,
                               events=[event_to_proto(e) for e in self._blocks.snapshot()])

    def changed(self) -> asyncio.Event:
        """An event set by the next publish(): take it *before* reading, then await it."""
        return self._changed
