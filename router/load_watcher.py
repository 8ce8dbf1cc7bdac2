"""One KvEventService.WatchLoad stream per worker, feeding the router's LoadTracker with each
worker's own account of its load (requests, KV blocks held, prompt tokens not yet prefilled).

With it, several routers in front of one fleet place requests on one view of the load (each
adds only what it placed since the worker's last report; router/load.py). A worker that
answers UNIMPLEMENTED (it reports no load) is not asked again until it restarts; a stream that
fails is retried with backoff, and meanwhile the worker is scored on this router's own counts.
`--load-reports off` turns it off (each router then counts only what it placed itself).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from common.pb.tandem.v1 import discovery_pb2, kv_events_pb2, kv_events_pb2_grpc
from router.load import LoadTracker
from router.workers import WorkerSet

log = logging.getLogger(__name__)


class LoadWatcher:
    def __init__(self, load: LoadTracker, workers: WorkerSet, interval_ms: int = 100,
                 max_backoff_s: float = 5.0) -> None:
        self.load = load
        self.workers = workers
        self.interval_ms = interval_ms
        self.max_backoff_s = max_backoff_s
        self.reports = 0  # load messages applied
        self._tasks: dict[str, asyncio.Task] = {}
        self._key: dict[str, tuple[str, int]] = {}  # (address, incarnation) each stream was opened for

    def sync(self) -> None:
        """Watch every compatible worker in discovery; stop watching the ones that left."""
        current = {i.instance_id: i for role in (discovery_pb2.ROLE_PREFILL, discovery_pb2.ROLE_DECODE)
                   for i in self.workers.candidates(role, serving_only=False)}
        for wid in list(self._tasks):
            if wid not in current or self._key.get(wid) != (current[wid].address, current[wid].incarnation):
                self._tasks.pop(wid).cancel()
                self._key.pop(wid, None)
                self.load.forget(wid)
        for wid, inst in current.items():
            if wid not in self._tasks:
                self._key[wid] = (inst.address, inst.incarnation)
                self._tasks[wid] = asyncio.create_task(self._follow(wid), name=f"load-{wid}")

    async def _follow(self, wid: str) -> None:
        backoff = 0.05
        while True:
            try:
                inst = self.workers.instance(wid)
                if inst is None:
                    return
                stub = kv_events_pb2_grpc.KvEventServiceStub(self.workers.channel(inst))
                async for msg in stub.WatchLoad(kv_events_pb2.WatchLoadRequest(interval_ms=self.interval_ms)):
                    self.load.report(wid, msg.requests, msg.active_blocks, msg.queued_prefill_tokens)
                    self.reports += 1
                    backoff = 0.05
            except grpc.aio.AioRpcError as exc:
                self.load.forget(wid)
                self.workers.stream_broke(wid, exc)
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("worker %s reports no load: scored on this router's own counts", wid)
                    return
                log.debug("load reports from %s: %s", wid, exc.code().name)
            except LookupError:
                return
            self.load.forget(wid)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    async def close(self) -> None:
        for t in self._tasks.values():
            t.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
