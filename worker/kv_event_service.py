"""KvEventService: streams a worker's KV event batches (docs/architecture.md) and its load
(`WatchLoad`, docs/routing.md)."""

from __future__ import annotations

import asyncio
from typing import Callable

import grpc

from common.pb.tandem.v1 import kv_events_pb2 as pb
from common.pb.tandem.v1 import kv_events_pb2_grpc as pb_grpc
from engine.kv_events import KvEventLog, event_to_proto


DEFAULT_LOAD_INTERVAL_MS = 100
MIN_LOAD_INTERVAL_MS = 10


class KvEventServicer(pb_grpc.KvEventServiceServicer):
    """`load` gives the worker's load now (None: WatchLoad answers UNIMPLEMENTED)."""

    def __init__(self, log: KvEventLog, load: Callable[[], pb.WorkerLoad] | None = None) -> None:
        self._log = log
        self._load = load

    async def WatchLoad(self, request: pb.WatchLoadRequest, context: grpc.aio.ServicerContext):
        if self._load is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker reports no load")
        interval = max(MIN_LOAD_INTERVAL_MS, request.interval_ms or DEFAULT_LOAD_INTERVAL_MS) / 1000
        last = None
        while True:
            now = self._load()
            if now != last:
                yield now
                last = now
            await asyncio.sleep(interval)

    async def Subscribe(self, request: pb.SubscribeRequest, context: grpc.aio.ServicerContext):
        last = request.from_event_id
        # A new subscriber, or one whose ids are another incarnation's, starts from a snapshot.
        new = last == 0 or self._log.other_incarnation(request.incarnation)
        while True:
            changed = self._log.changed()  # take the event before reading, so no batch is missed
            batches = None if new else self._log.since(last)
            new = False
            if batches is None:
                snap = self._log.snapshot()
                yield snap
                last = snap.event_id
            else:
                for b in batches:
                    yield pb.KvEventBatch(event_id=b.event_id, incarnation=self._log.incarnation,
                                          events=[event_to_proto(e) for e in b.events])
                    last = b.event_id
            await changed.wait()
