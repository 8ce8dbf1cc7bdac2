"""Admission control for the decode worker: keep the running requests' KV at a practical
fraction of the pool, so retraction stays rare (DESIGN.md sections 6 and 8).

A request is admitted when the admitted requests' *projected* KV — each one's prompt +
max_tokens, in blocks, capped at the pool — plus its own fits `practical_fraction` of the
pool; otherwise it waits in a bounded FIFO queue in the worker (one more than `max_queued` gets
RESOURCE_EXHAUSTED at once, so the router can try elsewhere). One request is always admitted
when nothing else is, so a request larger than the budget still runs alone. While retracted
requests wait to resume (`hold`), new requests wait behind them.

The projection is an upper bound on what a request can hold (shared prefix blocks are counted
once per request), so with practical_fraction <= 1 the pool never runs out; > 1 overcommits
(betting that requests stop at EOS before max_tokens), and retraction recovers when the bet loses.
Single-threaded: call from the worker's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

import grpc

from engine.kv_pool import KvPool, PoolExhausted, PromptBlocks

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Ticket:
    """One admitted request's reservation: `blocks` projected KV blocks."""

    blocks: int
    released: bool = False


class Refused(Exception):
    """Admission refused at once; answered with RESOURCE_EXHAUSTED (the router may retry elsewhere)."""


class Admission:
    """Admit requests against a KV budget of floor(practical_fraction × pool blocks)."""

    def __init__(self, pool: KvPool, practical_fraction: float, max_queued: int) -> None:
        self.pool = pool
        self.capacity = pool.config.num_blocks
        self.budget = max(1, math.floor(practical_fraction * self.capacity))
        self.max_queued = max_queued
        self.reserved = 0  # projected blocks of admitted requests
        self.admitted = 0  # admitted requests not yet released
        self.held = 0  # retracted requests waiting to resume: they go first
        self.waited = 0  # requests that had to queue (a counter, for metrics and tests)
        self._queue: deque[tuple[int, asyncio.Future[Ticket]]] = deque()
        self._freed = asyncio.Event()
        self.on_release: Callable[[], None] | None = None  # the scheduler's wake-up

    @property
    def queued(self) -> int:
        return len(self._queue)

    def projected_blocks(self, prompt_tokens: int, max_tokens: int) -> int:
        """Blocks a request holds at its longest (prompt + max_tokens), capped at the pool."""
        return min(self.pool.blocks_for(prompt_tokens + max_tokens), self.capacity)

    def _fits(self, blocks: int) -> bool:
        return self.held == 0 and (self.admitted == 0 or self.reserved + blocks <= self.budget)

    def _grant(self, blocks: int) -> Ticket:
        self.reserved += blocks
        self.admitted += 1
        return Ticket(blocks)

    async def admit(self, prompt_tokens: int, max_tokens: int) -> Ticket:
        """Wait (FIFO) until the request fits, then reserve its projected blocks.

        Raises:
            Refused: the prompt alone cannot fit the pool, or the queue is full.
            asyncio.CancelledError: the caller went away while queued (nothing is held).
        """
        if self.pool.blocks_for(prompt_tokens + 1) > self.capacity:
            raise Refused(f"prompt of {prompt_tokens} tokens needs {self.pool.blocks_for(prompt_tokens + 1)} KV "
                          f"blocks; the pool has {self.capacity}")
        blocks = self.projected_blocks(prompt_tokens, max_tokens)
        if not self._queue and self._fits(blocks):
            return self._grant(blocks)
        if len(self._queue) >= self.max_queued:
            raise Refused(f"decode queue full ({self.max_queued} requests waiting for KV capacity)")
        fut: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self._queue.append((blocks, fut))
        self.waited += 1
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())  # granted just as the caller went away
            else:
                self._queue = deque(e for e in self._queue if e[1] is not fut)
            self._pump()
            raise

    def release(self, ticket: Ticket | None) -> None:
        """Return a ticket's reservation (idempotent; None is ignored) and admit waiters."""
        if ticket is None or ticket.released:
            return
        ticket.released = True
        self.reserved -= ticket.blocks
        self.admitted -= 1
        self._freed.set()
        self._pump()
        if self.on_release is not None:
            self.on_release()

    def hold(self) -> None:
        """A retracted request waits to resume: admit nothing new until it has."""
        self.held += 1

    def unhold(self) -> None:
        self.held -= 1
        assert self.held >= 0
        self._pump()

    def _pump(self) -> None:
        while self._queue and self._fits(self._queue[0][0]):
            blocks, fut = self._queue.popleft()
            if not fut.done():
                fut.set_result(self._grant(blocks))

    async def allocate_prompt(self, tokens: list[int], busy: Callable[[], bool]) -> PromptBlocks:
        """The prompt's blocks, waiting for running requests to free some when the pool is
        momentarily full (only possible when practical_fraction > 1 overcommits).

        Raises:
            PoolExhausted: full while `busy()` is False (nothing running will free blocks).
        """
        while True:
            try:
                return self.pool.allocate_prompt(tokens)
            except PoolExhausted:
                if not busy():
                    raise
            self._freed.clear()
            try:  # a release sets _freed; retractions free blocks without one, hence the poll
                await asyncio.wait_for(self._freed.wait(), 0.05)
            except (TimeoutError, asyncio.TimeoutError):
                pass


async def admit_or_abort(admission: Admission, prompt_tokens: int, max_tokens: int,
                         context: grpc.aio.ServicerContext) -> Ticket:
    """Admission for an RPC handler: RESOURCE_EXHAUSTED (the reason) when refused."""
    try:
        return await admission.admit(prompt_tokens, max_tokens)
    except Refused as exc:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        raise
