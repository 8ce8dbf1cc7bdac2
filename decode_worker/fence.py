"""Blocks a silent prefill worker may still write into (issue 20).

A decode worker whose prefill call ends without an answer (its deadline passed or it was
cancelled: a stopped, wedged or slow prefill worker) cannot know whether writes of that
request are still on their way into its pool. It prefills locally into fresh blocks and holds
the blocks it gave the prefill worker here, out of the pool, until the prefill worker answers
`Abandon(request_id)` — which it does only once no write of that request can reach us any
more (prefill_worker/calls.py: running writes stopped and awaited, a call still queued there
refused when it arrives) — or until nothing listens at its address any more (two TCP connects
refused, `REFUSED_CHECKS` apart: the process is dead, or it finished draining, so its
in-flight requests and their writes are over; a stopped process keeps its listening socket and
the kernel still accepts connections for it) — or until `bound_s` passes. So a late write
never lands in blocks this worker has since given to another request.

`Abandon` is retried (each attempt at most `attempt_s`) so a prefill worker resumed after a
SIGSTOP, or reachable again, answers within about one attempt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Literal

import grpc

from engine.block_pool import BlockId
from kv_transfer.base import KvTransferAgent, TransferError

log = logging.getLogger(__name__)

# Abandon(timeout_s) -> notified: the prefill worker's answer (raises grpc.aio.AioRpcError).
AbandonCall = Callable[[float], Awaitable[bool]]
# () -> True when a TCP connect to the prefill worker's address is refused (`nothing_listens`).
GoneCheck = Callable[[], Awaitable[bool]]
RETRY_PAUSE_S = 0.2  # after a fast failure (connection refused), before the next attempt
REFUSED_CHECKS = 2, 1.0  # refused connects needed, and the least seconds between the first and last


async def nothing_listens(address: str, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connect to `address` (host:port, [v6]:port) is refused: no process listens.
    A timeout or any other error is not "refused" (a stopped or unreachable host)."""
    host, _, port = address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host.strip("[]"), int(port)), timeout_s)
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError, TimeoutError, asyncio.TimeoutError):
        return False
    writer.close()
    return False


class PrefillFence:
    """Holds fenced blocks (one background task per request, strong references kept).

    Args:
        agent: the decode worker's transfer agent (a late transfer's notification arrives there).
        free: returns blocks to the pool (called once per fenced request, on the loop).
        bound_s: the longest a request's blocks stay fenced without an answer from the prefill worker.
        attempt_s: the longest one Abandon attempt waits.
        stats: the worker's WorkerStats; counts fenced_prefills, fences_released_by_peer,
            fences_released_peer_gone, fences_expired.
    """

    def __init__(self, agent: KvTransferAgent, free: Callable[[list[BlockId]], None], bound_s: float,
                 attempt_s: float, stats: Any) -> None:
        self._agent, self._free, self._stats = agent, free, stats
        self.bound_s, self.attempt_s = bound_s, attempt_s
        self._tasks: set[asyncio.Task] = set()
        self.held_blocks = 0
        self.released = asyncio.Event()  # set at every release; a waiter clears it before waiting

    def hold(self, request_id: str, block_ids: list[BlockId], abandon: AbandonCall, gone: GoneCheck,
             message: bytes | None = None, agent: KvTransferAgent | None = None) -> None:
        """Hold `block_ids` until `abandon` is answered, `gone` holds (see the module docstring)
        or bound_s passes. `message`: the call's transfer notification (default: the request id
        alone), consumed when the prefill worker says it sent it, at `agent` (default: the
        fence's; an EP worker's blocks have their rank's agent). Call from the loop."""
        if not block_ids:
            return
        self._stats.fenced_prefills += 1
        self.held_blocks += len(block_ids)
        message = request_id.encode() if message is None else message
        task = asyncio.get_running_loop().create_task(self._release(request_id, list(block_ids), abandon, gone,
                                                                    message, agent or self._agent),
                                                      name=f"fence-{request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, request_id: str, block_ids: list[BlockId], abandon: AbandonCall,
                       gone: GoneCheck, message: bytes, agent: KvTransferAgent) -> None:
        try:
            outcome = await self._abandon(message, abandon, gone, agent)
            if outcome == "answered":
                self._stats.fences_released_by_peer += 1
            elif outcome == "gone":
                self._stats.fences_released_peer_gone += 1
            else:
                self._stats.fences_expired += 1
                log.warning("request %s: its prefill worker did not answer Abandon in %.1f s; %d fenced blocks "
                            "return to the pool", request_id, self.bound_s, len(block_ids))
        finally:
            self.held_blocks -= len(block_ids)
            self._free(block_ids)
            self.released.set()

    async def _abandon(self, message: bytes, abandon: AbandonCall, gone: GoneCheck,
                       agent: KvTransferAgent) -> Literal["answered", "gone", "expired"]:
        """"answered" once the prefill worker answered, "gone" once nothing listens at its
        address, "expired" at the bound."""
        end = time.monotonic() + self.bound_s
        first_refused: float | None = None
        needed, spread_s = REFUSED_CHECKS
        refused = 0
        while (left := end - time.monotonic()) > 0:
            started = time.monotonic()
            try:
                notified = await abandon(min(self.attempt_s, left))
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE and await gone():
                    first_refused = first_refused or time.monotonic()
                    refused += 1
                    if refused >= needed and time.monotonic() - first_refused >= spread_s:
                        return "gone"
                else:
                    first_refused, refused = None, 0
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # it cannot answer: wait out the bound
                    await asyncio.sleep(max(0.0, end - time.monotonic()))
                    return "expired"
                if time.monotonic() - started < RETRY_PAUSE_S:  # refused at once: do not spin
                    await asyncio.sleep(min(RETRY_PAUSE_S, max(0.0, end - time.monotonic())))
                continue
            if notified:  # its transfer had completed late: consume the notification it sent
                try:
                    await agent.wait_notification(message, max(0.1, min(self.attempt_s, left)))
                except (TransferError, RuntimeError):
                    pass  # the transfer is over either way; an unclaimed notification ages out
            return "answered"
        return "expired"

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
