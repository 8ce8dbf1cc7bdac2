"""Blocks a silent prefill worker may still write into (issue 20).

A decode worker whose prefill call ends without an answer (its deadline passed or it was
cancelled: a stopped or wedged prefill worker) cannot know whether writes of that request are
still on their way into its pool. It prefills locally into fresh blocks and holds the blocks
it gave the prefill worker here, out of the pool, until that worker says it is done with the
request — its notification `request_id` (the transfer finished late) or `request_id/end`
(prefill_worker/service.py: sent once every write of a failed request was cancelled and
awaited) — or until `bound_s` passes. So a late write never lands in blocks the decode worker
has since reused for another request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from engine.block_pool import BlockId
from kv_transfer.base import END_SUFFIX, KvTransferAgent, TransferError

log = logging.getLogger(__name__)


class PrefillFence:
    """Holds fenced blocks (one background task per request, strong references kept).

    Args:
        agent: the decode worker's transfer agent (notifications arrive there).
        free: returns blocks to the pool (called once per fenced request, on the loop).
        bound_s: the longest a request's blocks stay fenced without word from the prefill worker.
        stats: the worker's WorkerStats; counts fenced_prefills, fences_released_by_peer,
            fences_expired.
    """

    def __init__(self, agent: KvTransferAgent, free: Callable[[list[BlockId]], None], bound_s: float,
                 stats: Any) -> None:
        self._agent, self._free, self.bound_s, self._stats = agent, free, bound_s, stats
        self._tasks: set[asyncio.Task] = set()
        self.held_blocks = 0

    def hold(self, request_id: str, block_ids: list[BlockId]) -> None:
        if not block_ids:
            return
        self._stats.fenced_prefills += 1
        self.held_blocks += len(block_ids)
        task = asyncio.get_running_loop().create_task(self._release(request_id.encode(), list(block_ids)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, rid: bytes, block_ids: list[BlockId]) -> None:
        waits = [asyncio.ensure_future(self._agent.wait_notification(m, self.bound_s)) for m in (rid, rid + END_SUFFIX)]
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if any(not w.cancelled() and w.exception() is None for w in done):
                self._stats.fences_released_by_peer += 1
            else:
                self._stats.fences_expired += 1
                log.warning("request %s: no word from its prefill worker in %.0f s; %d fenced blocks return to "
                            "the pool", rid.decode(), self.bound_s, len(block_ids))
        except (TransferError, RuntimeError):
            self._stats.fences_expired += 1
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
            self.held_blocks -= len(block_ids)
            self._free(block_ids)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
