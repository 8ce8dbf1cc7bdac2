"""Admission control for the decode worker: keep the running requests' KV at a practical
fraction of the pool, so retraction stays rare (DESIGN.md sections 6 and 8).

A request is admitted when the admitted requests' *projected* KV — each one's prompt +
max_tokens, in blocks, capped at the pool — plus its own fits `practical_fraction` of the
pool; otherwise it waits in a bounded FIFO queue in the worker (one more than `max_queued` gets
RESOURCE_EXHAUSTED at once, so the router can try elsewhere). While retracted requests wait to
resume (`hold`), new requests wait behind them.

What cannot fit is refused, not started: a request whose prompt + max_tokens needs more blocks
than the whole pool gets RESOURCE_EXHAUSTED at once, naming the numbers (it would stream until
the pool ran out and fail then, after holding every other request back). A request larger than
the budget but within the pool fits only *alone*: it is admitted when nothing else is admitted,
never holds the queue behind it (requests that fit go past it), and waits at most `solo_wait_s`
seconds for its turn, then gets RESOURCE_EXHAUSTED.

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

    def __init__(self, pool: KvPool, practical_fraction: float, max_queued: int, solo_wait_s: float = 5.0) -> None:
        self.pool = pool
        self.solo_wait_s = solo_wait_s  # seconds a request that fits only alone may wait (--solo-wait)
        self.capacity = pool.config.num_blocks
        self.budget = max(1, math.floor(practical_fraction * self.capacity))
        self.max_queued = max_queued
        self.reserved = 0  # projected blocks of admitted requests
        self.admitted = 0  # admitted requests not yet released
        self.held = 0  # retracted requests waiting to resume: they go first
        self.waited = 0  # requests that had to queue (a counter, for metrics and tests)
        self._queue: deque[tuple[int, asyncio.Future[Ticket]]] = deque()  # (projected blocks, grant)
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

    def _solo(self, blocks: int) -> bool:
        """Whether a request of `blocks` projected blocks fits only when nothing else runs."""
        return blocks > self.budget

    def _grant(self, blocks: int) -> Ticket:
        self.reserved += blocks
        self.admitted += 1
        return Ticket(blocks)

    async def admit(self, prompt_tokens: int, max_tokens: int) -> Ticket:
        """Wait until the request fits, then reserve its projected blocks. Requests within the
        budget are admitted in FIFO order; one that fits only alone waits beside them.

        Raises:
            Refused: prompt + max_tokens cannot fit the whole pool, the queue is full, or a
                request that fits only alone did not get its turn within solo_wait_s seconds.
            asyncio.CancelledError: the caller went away while queued (nothing is held).
        """
        need = self.pool.blocks_for(prompt_tokens + max_tokens)
        if need > self.capacity:
            raise Refused(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {need} KV blocks of "
                          f"{self.pool.block_size} tokens; this worker's whole pool has {self.capacity} blocks")
        blocks = self.projected_blocks(prompt_tokens, max_tokens)
        fut: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self._queue.append((blocks, fut))
        self._pump()
        if fut.done():
            return fut.result()
        if len(self._queue) > self.max_queued:
            self._drop(fut)
            raise Refused(f"decode queue full ({self.max_queued} requests waiting for KV capacity)")
        self.waited += 1
        try:
            if not self._solo(blocks):
                return await fut
            try:
                return await asyncio.wait_for(asyncio.shield(fut), self.solo_wait_s)
            except (TimeoutError, asyncio.TimeoutError):
                if fut.done():
                    return fut.result()  # granted just as the wait ended
                self._drop(fut)
                raise Refused(f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) needs {blocks} KV blocks, "
                              f"more than the admission budget of {self.budget} (--practical-fraction of "
                              f"{self.capacity}): it runs only alone, and the worker was not free within "
                              f"{self.solo_wait_s:g} s (--solo-wait)") from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(fut.result())  # granted just as the caller went away
            else:
                self._drop(fut)
            raise

    def _drop(self, fut: asyncio.Future[Ticket]) -> None:
        """Take a waiter out of the queue (it was refused or went away) and admit the rest."""
        self._queue = deque(e for e in self._queue if e[1] is not fut)
        fut.cancel()
        self._pump()

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
        """Grant waiters in order: requests within the budget strictly FIFO; one that fits only
        alone is granted when nothing is admitted, and otherwise skipped (it holds no one back)."""
        kept: deque[tuple[int, asyncio.Future[Ticket]]] = deque()
        blocked = False  # a request within the budget is waiting: those behind it wait too
        while self._queue:
            blocks, fut = self._queue.popleft()
            if fut.done():
                continue
            if not (blocked and not self._solo(blocks)) and self._fits(blocks):
                fut.set_result(self._grant(blocks))
                continue
            blocked = blocked or not self._solo(blocks)
            kept.append((blocks, fut))
        self._queue = kept

    async def allocate_prompt(self, tokens: list[int], busy: Callable[[], bool],
                             seed: int | None = None) -> PromptBlocks:
        """The prompt's blocks, waiting for running requests to free some when the pool is
        momentarily full (only possible when practical_fraction > 1 overcommits); `seed`: the
        request's block-hash seed (KvPool.allocate_prompt).

        Raises:
            PoolExhausted: full while `busy()` is False (nothing running will free blocks).
        """
        while True:
            try:
                return self.pool.allocate_prompt(tokens, seed)
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
