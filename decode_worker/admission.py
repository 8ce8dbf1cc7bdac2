"""Admission control for the decode worker: keep the running requests' KV at a practical
fraction of the pool, so retraction stays rare
(docs/architecture.md, "KV capacity: pool size, admission, retraction").

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
seconds for its turn, then gets RESOURCE_EXHAUSTED. Once running, it does not hold the queue
for its whole run either: when it has decoded `solo_wait_s` (at least MIN_TURN_S; its turn
counts from its first decode step, not from the grant before its prefill) and a request
within the budget has waited as long, the decode loop retracts it (`overdue_solo`,
`yield_turn`; decode_worker/retraction.py), the waiting requests are admitted, and it waits for
its turn again ahead of the requests that arrive after that, then resumes where it stopped.

The projection is an upper bound on what a request can hold (shared prefix blocks are counted
once per request), so with practical_fraction <= 1 the pool never runs out; > 1 overcommits
(betting that requests stop at EOS before max_tokens), and retraction recovers when the bet loses.
Single-threaded: call from the worker's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import grpc

from engine.kv_pool import KvPool, PoolExhausted, PromptBlocks

log = logging.getLogger(__name__)


MIN_TURN_S = 1.0  # shortest turn of a request that runs alone before waiting requests go first


@dataclass(eq=False)
class Ticket:
    """One admitted request's reservation: `blocks` projected KV blocks; `granted_at`
    (time.monotonic()) is the start of its current turn: its grant, then (`turn_starts`) its
    first decode step, so its prefill does not use up its turn."""

    blocks: int
    released: bool = False
    granted_at: float = 0.0


@dataclass(eq=False)
class _Waiter:
    """A queued request: its projected blocks, its grant, when it queued (time.monotonic()),
    and, for a request that yielded its turn (`yield_turn`), the ticket it gets back."""

    blocks: int
    fut: asyncio.Future[Ticket]
    since: float
    resumes: Ticket | None = None


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
        self._queue: deque[_Waiter] = deque()
        self._alone: Ticket | None = None  # the admitted request that fits only alone, if any
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

    def _grant(self, blocks: int, ticket: Ticket | None = None) -> Ticket:
        """Reserve `blocks` for a new ticket, or again for `ticket` (a turn given back)."""
        self.reserved += blocks
        self.admitted += 1
        ticket = ticket or Ticket(blocks)
        ticket.granted_at = time.monotonic()
        if self._solo(blocks):
            self._alone = ticket
        return ticket

    def turn_starts(self, ticket: Ticket | None) -> None:
        """The ticket's request joins the decode batch (after its prefill, or its re-prefill after
        a yield): its turn counts from now. A long prompt's prefill may outlast --solo-wait; were
        it counted, the request would be retracted before its first decode step, at every turn."""
        if ticket is not None:
            ticket.granted_at = time.monotonic()

    def overdue_solo(self, now: float | None = None) -> Ticket | None:
        """The ticket of the request running alone, when its turn is over: it has run
        max(solo_wait_s, MIN_TURN_S) seconds and a request within the budget has waited
        solo_wait_s behind it. None otherwise."""
        t = self._alone
        if t is None or self.held:
            return None
        now = time.monotonic() if now is None else now
        if now - t.granted_at < max(self.solo_wait_s, MIN_TURN_S):
            return None
        oldest = next((w.since for w in self._queue
                       if not w.fut.done() and w.resumes is None and not self._solo(w.blocks)), None)
        return t if oldest is not None and now - oldest >= self.solo_wait_s else None

    def yield_turn(self, ticket: Ticket) -> asyncio.Future[Ticket]:
        """The request running alone gives its reservation back (the caller has retracted it)
        and queues again, ahead of every request that arrives later; the waiting requests are
        admitted now. Returns the future of its next grant (the same ticket); cancel it with
        `cancel_turn`."""
        self.reserved -= ticket.blocks
        self.admitted -= 1
        if self._alone is ticket:
            self._alone = None
        fut: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self._queue.append(_Waiter(ticket.blocks, fut, time.monotonic(), resumes=ticket))
        self._pump()
        return fut

    def cancel_turn(self, fut: asyncio.Future[Ticket]) -> None:
        """A request waiting for its turn again (`yield_turn`) went away: leave the queue, or
        give the turn back if it was granted already."""
        if fut.done() and not fut.cancelled():
            self.release(fut.result())
            return
        waiter = next((w for w in self._queue if w.fut is fut), None)
        if waiter is not None and waiter.resumes is not None:
            waiter.resumes.released = True  # it reserves nothing while it waits
        self._drop(fut)

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
        self._queue.append(_Waiter(blocks, fut, time.monotonic()))
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
        self._queue = deque(w for w in self._queue if w.fut is not fut)
        fut.cancel()
        self._pump()

    def release(self, ticket: Ticket | None) -> None:
        """Return a ticket's reservation (idempotent; None is ignored) and admit waiters."""
        if ticket is None or ticket.released:
            return
        ticket.released = True
        self.reserved -= ticket.blocks
        self.admitted -= 1
        if self._alone is ticket:
            self._alone = None
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
        alone is granted when nothing is admitted, and otherwise skipped (it holds no one back),
        except one waiting for its turn again (`yield_turn`), which holds its place."""
        kept: deque[_Waiter] = deque()
        blocked = False  # a request within the budget is waiting: those behind it wait too
        while self._queue:
            w = self._queue.popleft()
            if w.fut.done():
                continue
            holds_place = w.resumes is not None or not self._solo(w.blocks)
            if not (blocked and holds_place) and self._fits(w.blocks):
                w.fut.set_result(self._grant(w.blocks, w.resumes))
                continue
            blocked = blocked or holds_place
            kept.append(w)
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
