"""Retraction (docs/architecture.md, "KV capacity: pool size, admission, retraction"): when a
decode step needs KV blocks that are not there — even after evicting cached prefixes, which
`BlockPool.allocate` does by itself, so "free" below counts unreferenced cached blocks —
retract running requests, fewest generated tokens first and the longest prompt breaking ties
(SGLang's order: the least work is lost), until the rest have blocks for `HEADROOM_STEPS`
steps. A retracted request's blocks are freed (its prompt's full blocks stay in the prefix
cache until evicted) and it waits, ahead of new admissions, to resume: it re-prefills locally
from prompt + tokens generated so far (all but the last token, whose KV the next decode step
writes), rejoins the batch, and streams on from where it stopped — same queue, same sampling
steps, so no token is repeated or lost.

Single-threaded: runs on the worker's event loop, between decode steps.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING, Iterable

import grpc

from engine.kv_pool import PoolExhausted, PromptBlocks

if TYPE_CHECKING:
    from decode_worker.scheduler import DecodeScheduler, RunningRequest

log = logging.getLogger(__name__)

HEADROOM_STEPS = 8  # retract until the remaining batch has blocks for this many steps


def retraction_order(reqs: Iterable[RunningRequest]) -> list[RunningRequest]:
    """Victims first: fewest generated tokens, then the longest prompt."""
    return sorted(reqs, key=lambda r: (r.generated, -r.prompt_len))


class Retractor:
    """Frees KV for a step by retracting running requests, and resumes them later.

    `tokens_per_step` is how many tokens one step writes per request (1 for plain decode; a
    speculative step writes its drafts too). Where the overlap loop launches several steps at
    once (--decode-steps-per-launch), only the first step's tokens are planned here: the loop
    cuts a launch short where the free blocks end (decode_worker/overlap.py `_plan`), and
    planning the whole launch would retract, or refuse a request that fills the pool, earlier
    than one step at a time does.
    """

    def __init__(self, scheduler: DecodeScheduler, tokens_per_step: int = 1) -> None:
        self.sched = scheduler
        self.rt = scheduler.rt
        self.tokens_per_step = tokens_per_step
        self.waiting: deque[RunningRequest] = deque()  # retracted, to resume in this order
        # requests that ran alone and yielded their turn: waiting in admission for the next one
        self.yielded: dict[RunningRequest, asyncio.Future] = {}
        self._tasks: set[asyncio.Task] = set()  # re-prefills (strong references)

    def _tokens_after(self, req: RunningRequest, steps: int) -> int:
        """Tokens req's KV holds after `steps` more steps (no further than its max_tokens)."""
        left = max(1, req.params.max_tokens - req.generated)  # one step per token still to generate
        return len(req.tokens) - 1 + min(steps * self.tokens_per_step, left)

    def _need(self, reqs: Iterable[RunningRequest], steps: int) -> int:
        """New blocks reqs need so that `steps` more steps fit."""
        return sum(self._need_one(r, steps) for r in reqs)

    def blocks_for_next_step(self, reqs: Iterable[RunningRequest]) -> int:
        """New blocks reqs need for one more step (the overlap loop's later steps of a launch)."""
        return self._need(reqs, 1)

    def _need_one(self, req: RunningRequest, steps: int) -> int:
        """New blocks req needs so that `steps` more steps fit."""
        return max(0, self.rt.pool.blocks_for(self._tokens_after(req, steps)) - len(req.block_ids))

    def make_room(self, batch: list[RunningRequest]) -> list[RunningRequest]:
        """Retract until the batch's next step fits; returns the requests still in the batch.

        A request that alone needs more blocks than the whole pool ends with RESOURCE_EXHAUSTED.
        """
        pool = self.rt.pool
        total = 0  # the next step's new blocks (computed once: this runs before every step)
        for req in list(batch):
            need = self._need_one(req, 1)
            if need + len(req.block_ids) > pool.config.num_blocks:
                batch.remove(req)
                if req.tokens and req.tokens[-1] < 0:
                    # steps of the overlap loop are in flight for it, their KV within its blocks:
                    # it ends once they are post-processed, so their tokens are streamed first
                    continue
                self.sched._finish(req, _exhausted(f"request needs {need + len(req.block_ids)} KV "
                                                   f"blocks; the pool has {pool.config.num_blocks}"))
            else:
                total += need
        if total <= pool.blocks.num_free:
            return batch
        # Under the overlap loops, blocks released while a step is in flight come back once it
        # completes (a victim's too): counting them keeps one shortage from retracting every
        # request, and where they cover the step, this round launches nothing and the loop
        # collects the step in flight first, freeing them.
        if total <= self._free_soon():
            return []
        while batch and self._need(batch, HEADROOM_STEPS) > self._free_soon():
            if len(self.sched.running) == 1 and self._need(batch, 1) <= self._free_soon():
                break  # the last running request keeps going while its own step fits
            victim = retraction_order(self.sched.running)[0]
            self.retract(victim)
            if victim in batch:
                batch.remove(victim)
        return batch if self._need(batch, 1) <= pool.blocks.num_free else []

    def _free_soon(self) -> int:
        """Free blocks now plus those the step in flight's completion frees (overlap loops)."""
        return self.rt.pool.blocks.num_free + self.sched.pending_free_blocks()

    def retract(self, req: RunningRequest) -> None:
        """Take req out of the batch, free its blocks, and queue it to resume."""
        held = self._take_out(req)
        self.rt.stats.retractions += 1
        self.waiting.append(req)
        self.sched.admission.hold()
        log.info("retracted request %s (%d generated, prompt %d tokens, %d blocks freed): KV pool full, "
                 "%d running, %d retracted", req.request_id, req.generated, req.prompt_len, held,
                 len(self.sched.running), len(self.waiting))

    def yield_solo(self) -> None:
        """The request that fits only alone has had its turn while requests within the budget
        wait (Admission.overdue_solo, --solo-wait): retract it so that they are admitted; it
        waits in admission for its next turn, ahead of later arrivals, then resumes like any
        retracted request. Not while it is still prefilling (it is not running yet)."""
        adm = self.sched.admission
        ticket = adm.overdue_solo()
        req = next((r for r in self.sched.running if r.ticket is ticket), None) if ticket else None
        if req is None:
            return
        held = self._take_out(req)
        self.rt.stats.solo_yields += 1
        fut = adm.yield_turn(ticket)
        self.yielded[req] = fut
        fut.add_done_callback(lambda f, req=req: self._turn_again(req, f))
        log.info("request %s runs alone (%d generated, %d blocks freed) and requests wait behind it: retracted "
                 "for them (--solo-wait %g s); it resumes at its next turn", req.request_id, req.generated, held,
                 adm.solo_wait_s)

    def _turn_again(self, req: RunningRequest, fut: asyncio.Future) -> None:
        """Admission gave a yielded request its next turn: resume it as a retracted one."""
        if fut.cancelled() or self.yielded.pop(req, None) is None:
            return  # cancelled meanwhile (cancel_turn has settled the ticket)
        self.sched.admission.hold()
        self.waiting.append(req)
        self.sched._wake.set()

    def _take_out(self, req: RunningRequest) -> int:
        """Remove req from the batch and free its blocks; returns how many it held."""
        self.sched.running.remove(req)
        req.flush()  # its stream pauses until it resumes: what it generated goes out now
        self.sched.release(req.block_ids)  # the overlap loops defer it past the step in flight
        # The plain overlap loop may have a step in flight for req: its token is dropped at
        # post-processing (req is no longer running), so its placeholder goes too. The request
        # resumes from its last real token and samples the dropped one again (same step index:
        # the same token); nothing was streamed for it.
        while req.tokens and req.tokens[-1] < 0:
            req.tokens.pop()
        held = len(req.block_ids)
        req.block_ids = []
        return held

    def _drop(self, req: RunningRequest) -> None:
        self.sched.admission.unhold()
        self.sched.admission.release(req.ticket)

    def resume_ready(self) -> None:
        """Start re-prefilling the retracted requests (in order) that fit now with headroom,
        or the first one when nothing runs."""
        pool = self.rt.pool
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            self._drop(req)
        for req in [r for r in self.yielded if r.cancelled]:
            self.sched.admission.cancel_turn(self.yielded.pop(req))
        while self.waiting:
            req = self.waiting[0]
            own = pool.blocks_for(self._tokens_after(req, HEADROOM_STEPS))
            idle = not self.sched.running and not self._tasks
            if not idle and own + self._need(self.sched.running, HEADROOM_STEPS) > pool.blocks.num_free:
                return
            try:
                prompt = pool.allocate_prompt(req.tokens[:-1], req.hash_seed)
            except PoolExhausted:
                return  # blocks held by prompts being prefilled; a release wakes the scheduler
            self.waiting.popleft()
            task = asyncio.create_task(self._reprefill(req, prompt), name=f"reprefill-{req.request_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _reprefill(self, req: RunningRequest, prompt: PromptBlocks) -> None:
        tokens = req.tokens[:-1]
        start = prompt.num_cached_blocks * self.rt.pool.block_size
        resumed = False
        try:
            if self.sched.spec is not None:  # MTP: the MTP KV rows and the hidden state the first draft needs
                req.hidden = (await self.rt.prefill_hidden(prompt.block_ids, tokens, start, mtp=True))[None]
            else:
                await self.rt.prefill(prompt.block_ids, tokens, start)  # logits unused: tokens[-1] is known
            if not req.cancelled:
                self.rt.pool.commit_prompt(prompt)
                self.rt.events.publish()
                req.block_ids = prompt.block_ids
                log.info("resumed request %s: re-prefilled %d tokens (%d from the prefix cache)", req.request_id,
                         len(tokens), start)
                self.sched.admission.unhold()
                self.sched.add(req)
                resumed = True
        except asyncio.CancelledError:  # fail_all: the decode loop is down
            req.out.put_nowait(_error(grpc.StatusCode.INTERNAL, "decode loop stopped during re-prefill"))
            raise
        except Exception as exc:  # noqa: BLE001 - the stream ends with the cause; the loop goes on
            log.exception("request %s: re-prefill after retraction failed", req.request_id)
            req.out.put_nowait(_error(grpc.StatusCode.INTERNAL, f"re-prefill after retraction failed: {exc}"))
        finally:
            if not resumed:
                self.rt.pool.free(prompt.block_ids)
                self._drop(req)

    def fail_all(self, error: str) -> None:
        """The decode loop failed: end every retracted request with INTERNAL."""
        for task in list(self._tasks):
            task.cancel()
        while self.waiting:
            req = self.waiting.popleft()
            req.out.put_nowait(_error(grpc.StatusCode.INTERNAL, error))
            self._drop(req)
        for req, fut in list(self.yielded.items()):
            del self.yielded[req]
            req.out.put_nowait(_error(grpc.StatusCode.INTERNAL, error))
            self.sched.admission.cancel_turn(fut)


def _error(code: grpc.StatusCode, message: str):
    from decode_worker.scheduler import TokenOut
    return TokenOut(error=(code, message))


def _exhausted(message: str):
    return _error(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
