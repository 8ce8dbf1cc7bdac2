"""The overlap scheduler with MTP speculative steps (`--speculative-num-steps k` on CUDA).

As decode_worker/overlap.py, step i + 1 is launched before step i's tokens reach the host; a
speculative step emits a variable number of tokens (1..k+1), so the host does not even know
where a request's next step starts. It need not: each request's next input ids, hidden rows and
length live in its device slot (engine/spec_batch.py), which the step itself rewrites. The host
keeps per request only what it knows for sure — the tokens post-processed so far — plus the
steps still in flight, which bound its position: n <= len(tokens) - 1 + (k + 1) × in flight.

Loop: schedule step i + 1 (block tables with room for that bound + k + 1) → launch it →
collect and post-process step i (the only wait) → repeat. Consequences handled here:
- A step writes up to k + 1 positions past a request's pending token; positions past its
  last possible token (max_tokens) go to a scratch block, so a request near its end needs no
  blocks it will never use, and its tokens past max_tokens are dropped.
- Tokens a request emits after it finished (eos in an earlier step) are dropped.
- Blocks released while a step is in flight are freed after that step completes; blocks past
  what the steps in flight use are trimmed when a step's tokens are post-processed.
- A request whose in-flight steps may already reach max_tokens waits for their post-processing.
Output is exactly the plain loop's (engine/spec_decode.py's accept rule: every emitted token
is the token k = 0 would emit).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from decode_worker.overlap import DeferredFrees
from engine.kv_pool import PoolExhausted
from engine.overlap_runner import LaunchedSpecStep, SpecOverlapRunner
from engine.sampling import for_row
from engine.spec_batch import SpecRow

if TYPE_CHECKING:
    from decode_worker.scheduler import DecodeScheduler, RunningRequest

log = logging.getLogger(__name__)


class SpecOverlapLoop(DeferredFrees):
    """The MTP decode loop with device-resident request state.

    overlapped=False (`--disable-overlap-schedule` on the fast path) post-processes each step
    right after launching it: the same steps, forwards and graphs, schedule → run → postprocess
    in turn.
    """

    def __init__(self, scheduler: DecodeScheduler, overlapped: bool = True) -> None:
        super().__init__(scheduler)
        self.overlapped = overlapped
        rt = scheduler.rt
        self.k = rt.opts.speculative_num_steps
        # a slot per request that has been in a batch and still runs: at most max_running (the
        # batch is a prefix of the running list, whose order only changes by removals)
        self.runner = SpecOverlapRunner(rt.runner, 2 * rt.opts.max_running, self.k)
        graphs = getattr(rt.runner, "graphs", None)
        # positions past a request's last possible token are written here (never freed)
        self.scratch = graphs.scratch if graphs is not None else rt.pool.blocks.allocate(1)[0]
        self._slot: dict[RunningRequest, int] = {}
        self._pending: dict[RunningRequest, list[int]] = {}  # blocks granted to each step in flight
        self._inflight: tuple[list[RunningRequest], LaunchedSpecStep] | None = None

    def _row(self, req: RunningRequest) -> SpecRow | None:
        """Grow req's blocks for its next step; None when they are not there (it waits)."""
        pool, k1 = self.sched.rt.pool, self.k + 1
        pending = self._pending.setdefault(req, [])
        if req.generated + len(pending) >= req.params.max_tokens:
            return None  # its last allowed token may already be in flight
        upper = len(req.tokens) - 1 + len(pending) * k1  # bound on its pending token's position
        last = req.prompt_len + req.params.max_tokens - 1  # tokens whose KV can matter
        try:
            pool.grow(req.block_ids, min(upper + k1, last))
        except PoolExhausted:
            return None  # the steps in flight free blocks or retraction makes room
        width = pool.blocks_for(upper + k1)
        table = req.block_ids[:width] + [self.scratch] * (width - len(req.block_ids))
        return SpecRow(self._slot[req], table, req.params, req.step_offset - req.prompt_len)

    def _schedule(self) -> tuple[list[RunningRequest], list[SpecRow], list[tuple]]:
        candidates = self.sched._schedule()
        live = set(self.sched.running)
        for req in [r for r in self._slot if r not in live]:  # finished, cancelled or retracted
            self.runner.slots.free(self._slot.pop(req))
            self._pending.pop(req, None)
        batch, rows, inits = [], [], []
        for req in candidates:
            fresh = req not in self._slot
            if fresh:  # a new or resumed request: its slot starts from the prefill's hidden state
                assert req.hidden is not None, "speculative requests carry the main hidden state"
                self._slot[req] = self.runner.slots.allocate()
            row = self._row(req)
            if fresh:
                inits.append((self._slot[req], req.hidden, list(req.tokens)))
                req.hidden = None
            if row is not None:
                batch.append(req)
                rows.append(row)
        return batch, rows, inits

    def _launch(self, inits: list[tuple], rows: list[SpecRow]) -> LaunchedSpecStep | None:
        for slot, hidden, tokens in inits:
            self.runner.init(slot, hidden, tokens)
        return self.runner.launch(rows) if rows else None

    async def run(self) -> None:
        sched, rt = self.sched, self.sched.rt
        while True:
            batch, rows, inits = self._schedule()
            rt.events.publish()
            if not batch and self._inflight is None:
                if inits:
                    await rt.run_model(self._launch, inits, [])
                sched._last_step = None
                sched._wake.clear()
                await sched._wake.wait()
                continue
            launched = None
            step = await rt.run_model(self._launch, inits, rows)
            if step is not None:
                for req in batch:
                    self._pending[req].append(len(req.block_ids))
                launched = (batch, step)
                sched.count_step(len(batch))
            if self.overlapped:  # step i + 1 is in flight while step i is post-processed
                previous, self._inflight = self._inflight, launched
            else:  # in turn: post-process the step just launched (collect waits for it)
                previous = launched
            deferred, self._deferred, self._settling = self._deferred, [], True
            if previous is not None:
                await self._postprocess(*previous)
            for block_ids in deferred:  # their last reader (the previous step) has completed
                rt.pool.free(block_ids)
            self._settling = False

    async def _postprocess(self, batch: list[RunningRequest], step: LaunchedSpecStep) -> None:
        rt = self.sched.rt
        rows = await rt.run_model(SpecOverlapRunner.collect, step)
        running = set(self.sched.running)
        for req, emitted in zip(batch, rows):
            pending = self._pending.get(req)
            if pending:
                pending.pop(0)
            # a retracted request is out of `running` until its re-prefill, which starts only
            # after this post-processing, so its stale tokens are never applied
            if req not in running or req.cancelled:
                continue  # finished by an earlier step (these tokens are dropped) or cancelled
            rt.stats.spec_verify_steps += 1
            rt.stats.spec_emitted_tokens += len(emitted)
            rt.stats.spec_draft_tokens += self.k
            req.mtp_verify_steps += 1
            req.mtp_accepted_tokens += len(emitted) - 1  # the last one is the target's own token
            if any(self.sched.emit(req, token, logprob, for_row(top, req.params))
                   for token, logprob, top in emitted):
                continue  # finished: emit stopped at its last token
            # blocks past the step in flight and the confirmed tokens: no step reads them
            keep = max(pending[0] if pending else 0, rt.pool.blocks_for(len(req.tokens)))
            if len(req.block_ids) > keep:
                rt.pool.free(req.block_ids[keep:])
                del req.block_ids[keep:]
