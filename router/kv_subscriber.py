"""One KvEventService subscription per worker, feeding the router's KvIndex.

Batches carry a per-worker event id increasing by one. A batch that repeats or precedes the last
applied id is dropped (counted); a batch that skips ids is a gap: the subscription restarts from
event 0, which makes the worker send a full snapshot that replaces what the index held for it.
Restarts back off (up to `max_backoff_s`), so a worker that keeps answering with gaps cannot
drive a resync loop. When a worker leaves discovery its subscription ends and all its blocks
leave the index.

Incarnations (issue 20): event ids count within one worker process, named by the incarnation
in its discovery record and in every batch. When either shows a new incarnation under a known
instance id (the worker restarted under the same identity), everything the index held for it
is dropped at once and the subscription starts again from a snapshot; the subscribe request
names the incarnation its `from_event_id` belongs to, so the worker never resumes another
process's ids. A record that moves to another address is followed by a new subscription there.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc

from common.pb.tandem.v1 import discovery_pb2, kv_events_pb2, kv_events_pb2_grpc
from router.kv_index import KvIndex
from router.workers import WorkerSet

log = logging.getLogger(__name__)


@dataclass
class SubscriberCounters:
    batches: int = 0
    events: int = 0  # events applied (stored, removed, cleared), snapshots' stored events included
    snapshots: int = 0
    duplicates: int = 0  # batches at or before the last applied id (dropped)
    gaps: int = 0  # batches after a missing id (resync)
    stream_errors: int = 0
    incarnations: int = 0  # restarts of a known worker seen (record or batch): its blocks reset
    moves: int = 0  # records that moved to another address: subscription moved with them


class KvEventSubscriber:
    def __init__(self, index: KvIndex, workers: WorkerSet, max_backoff_s: float = 5.0) -> None:
        self.index = index
        self.workers = workers
        self.max_backoff_s = max_backoff_s
        self.counters = SubscriberCounters()
        self._tasks: dict[str, asyncio.Task] = {}  # strong references
        self.last_event_id: dict[str, int] = {}
        self.incarnation: dict[str, int] = {}  # the incarnation last_event_id belongs to (0 = unknown)
        self._address: dict[str, str] = {}  # the address each subscription was started for

    def sync(self) -> None:
        """Subscribe to every compatible worker in discovery; drop the ones that left."""
        current = {i.instance_id: i for role in (discovery_pb2.ROLE_PREFILL, discovery_pb2.ROLE_DECODE)
                   for i in self.workers.candidates(role, serving_only=False)}
        for wid in list(self._tasks):
            if wid not in current:
                self._tasks.pop(wid).cancel()
                self.last_event_id.pop(wid, None)
                self.incarnation.pop(wid, None)
                self._address.pop(wid, None)
                removed = self.index.remove_worker(wid)
                log.info("worker %s left discovery: %d blocks left the index", wid, removed)
        for wid, inst in current.items():
            if wid in self._tasks:
                known = self.incarnation.get(wid, 0)
                if inst.incarnation and known and inst.incarnation != known:
                    self._reset(wid, inst.incarnation, "its discovery record")
                elif self._address.get(wid) == inst.address:
                    continue
                else:  # same incarnation, new address: resume there from the last applied id
                    self.counters.moves += 1
                    log.info("worker %s moved to %s: KV event subscription follows", wid, inst.address)
                self._tasks.pop(wid).cancel()
            else:
                self.index.add_worker(wid)
                self.incarnation.setdefault(wid, inst.incarnation)
            self._address[wid] = inst.address
            self._tasks[wid] = asyncio.create_task(self._follow(inst), name=f"kv-events-{wid}")

    def _reset(self, wid: str, incarnation: int, source: str) -> None:
        """A new incarnation of a known worker: drop its blocks; the next subscription starts
        from a snapshot of the new process."""
        self.counters.incarnations += 1
        dropped = self.index.clear_worker(wid)
        log.info("worker %s restarted (new incarnation %x, seen in %s): %d blocks left the index; "
                 "resubscribing from a snapshot", wid, incarnation, source, dropped)
        self.last_event_id[wid] = 0
        self.incarnation[wid] = incarnation

    async def _follow(self, inst: discovery_pb2.Instance) -> None:
        wid = inst.instance_id
        backoff = 0.05
        while True:
            last = self.last_event_id.get(wid, 0)
            try:
                # The channel of the record now: a record that moved is followed to its new address.
                current = self.workers.instance(wid)
                if current is None:
                    return  # left discovery; sync() drops its blocks
                stub = kv_events_pb2_grpc.KvEventServiceStub(self.workers.channel(current))
                request = kv_events_pb2.SubscribeRequest(from_event_id=last,
                                                         incarnation=self.incarnation.get(wid, 0))
                async for batch in stub.Subscribe(request):
                    if not self._apply(wid, batch):
                        break  # gap: resubscribe from 0 for a snapshot
                    backoff = 0.05
            except grpc.aio.AioRpcError as exc:
                self.counters.stream_errors += 1
                self.workers.stream_broke(wid, exc)
                log.debug("KV events from %s: %s", wid, exc.code().name)
            except LookupError:
                return  # left discovery between the two looks
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    def _apply(self, wid: str, batch: kv_events_pb2.KvEventBatch) -> bool:
        """Apply one batch; False when a gap or a new incarnation requires a snapshot."""
        self.counters.batches += 1
        known = self.incarnation.get(wid, 0)
        if batch.incarnation and known and batch.incarnation != known and not batch.snapshot:
            self._reset(wid, batch.incarnation, "a KV event batch")
            return False
        if batch.incarnation:
            self.incarnation[wid] = batch.incarnation
        if batch.snapshot:
            self.counters.snapshots += 1
            self.index.replace_worker(wid, [h for e in batch.events if e.HasField("stored")
                                            for h in e.stored.block_hashes])
            self.counters.events += len(batch.events)
            self.last_event_id[wid] = batch.event_id
            return True
        last = self.last_event_id.get(wid, 0)
        if batch.event_id <= last:
            self.counters.duplicates += 1
            return True
        if batch.event_id != last + 1:
            self.counters.gaps += 1
            log.info("KV events from %s: gap after %d (got %d); resyncing from a snapshot", wid, last, batch.event_id)
            self.last_event_id[wid] = 0
            return False
        self.counters.events += len(batch.events)
        for ev in batch.events:
            kind = ev.WhichOneof("event")
            if kind == "stored":
                parent = ev.stored.parent_hash if ev.stored.HasField("parent_hash") else None
                self.index.apply_stored(wid, parent, list(ev.stored.block_hashes))
            elif kind == "removed":
                self.index.apply_removed(wid, list(ev.removed.block_hashes))
            elif kind == "cleared":
                self.index.clear_worker(wid)
        self.last_event_id[wid] = batch.event_id
        return True

    async def close(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
