"""Continuous-batching decode loop: schedule → run → postprocess, one step at a time.

Requests join after their prompt's KV is in the pool and leave when finished or
cancelled; each step decodes one token for every running request. Once added, a request's
blocks belong to the scheduler, which frees them between steps (never while a forward
that reads them is running).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import grpc
import torch

from common.pb.tandem.v1 import sampling_pb2
from common.sampling_params import SamplingParams
from decode_worker.admission import Admission, Ticket
from decode_worker.prefill_pacing import PrefillPacer
from decode_worker.retraction import Retractor
from engine.block_pool import BlockId
from engine.runner import DecodeInput
from engine.sampling import StepTokens, for_row
from worker.host import WorkerRuntime
from decode_worker.overlap import decode_loop
from decode_worker.spec_step import SpecDecoder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenOut:
    """One generated token, or the end of the stream (finish_reason or error set)."""

    token: int | None = None
    logprob: float = 0.0
    top: tuple[tuple[int, float], ...] = ()  # its most likely tokens, (id, logprob) (sampling.top_logprobs)
    finish_reason: int = sampling_pb2.FINISH_REASON_UNSPECIFIED
    error: tuple[grpc.StatusCode, str] | None = None


@dataclass(eq=False)
class RunningRequest:
    request_id: str
    tokens: list[int]  # prompt + generated; the last one's KV is not in the pool yet
    prompt_len: int
    block_ids: list[BlockId]
    params: SamplingParams
    step_offset: int = 0  # tokens generated before this worker (a migrated request)
    out: asyncio.Queue[TokenOut] = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    hidden: torch.Tensor | None = None  # MTP: main hidden of positions not yet in MTP KV (spec_step.py)
    mtp_verify_steps: int = 0  # MTP: verify steps of this request (the decode span's attributes)
    mtp_accepted_tokens: int = 0  # MTP: draft tokens accepted (emitted minus the bonus token)
    ticket: Ticket | None = None  # capacity: its admission reservation, released when it finishes
    hash_seed: int | None = None  # its block-hash seed (its tenant's cache salt); None = the pool's
    held: list[TokenOut] = field(default_factory=list)  # tokens not yet handed to the stream (--stream-interval)

    def sampling_row(self) -> tuple:
        """The sampling row of its next token (engine.sampling.SamplingRows.build): (params,
        step index), and for a penalized request the tokens generated so far (those of its
        migrated-from workers too: token_ids' last step_offset; the overlap loop's placeholders
        of tokens in flight included)."""
        step = self.step_offset + self.generated
        if not self.params.penalized:
            return self.params, step
        return self.params, step, self.tokens[self.prompt_len - self.step_offset:]

    @property
    def generated(self) -> int:
        """Tokens generated so far, the placeholders of steps in flight included (overlap loop)."""
        return len(self.tokens) - self.prompt_len

    @property
    def resolved(self) -> int:
        """Tokens generated so far without the trailing placeholders (ids below 0) of steps still
        in flight or dropped (a cancelled request's launch: its later steps' tokens never land)."""
        end = len(self.tokens)
        while end > self.prompt_len and self.tokens[end - 1] < 0:
            end -= 1
        return end - self.prompt_len

    def send(self, out: TokenOut, interval: int) -> None:
        """Hand one generated token to the RPC's stream once `interval` tokens are held (the
        stream sends what it finds queued as one message, so each hand-over is one message)."""
        self.held.append(out)
        if len(self.held) >= interval:
            self.flush()

    def flush(self) -> None:
        """Hand every held token to the stream now (at the end, or before the request pauses)."""
        for out in self.held:
            self.out.put_nowait(out)
        self.held.clear()


class DecodeScheduler:
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime
        self.running: list[RunningRequest] = []
        self._wake = asyncio.Event()
        self.eos = runtime.loaded.config.eos_token_ids
        self.steps = 0
        self.stream_interval = runtime.opts.stream_interval  # tokens per stream message (--stream-interval)
        self._last_step: float | None = None  # perf_counter of the last launch (None after idling)
        self._last_rows: list[int] = []  # requests in each step of that launch
        self.failed: BaseException | None = None
        self.on_failure = None  # async callable: the worker marks itself NOT_SERVING
        k = runtime.opts.speculative_num_steps  # hook: MTP speculative steps (spec_step.py)
        self.spec = SpecDecoder(self, k) if k else None
        self.release = runtime.pool.free  # how finished requests' blocks are freed (overlap defers it)
        self.overlap = decode_loop(self, runtime)  # hook: overlap loop, device-resident MTP loop, or None
        # capacity: admission (used by the servicer) and retraction (decode_worker/admission.py, retraction.py)
        self.admission = Admission(runtime.pool, runtime.opts.practical_fraction, runtime.opts.max_queued)
        self.admission.on_release = self._wake.set
        self.retraction = Retractor(self, tokens_per_step=k + 1)  # an MTP step writes its drafts too
        # local prefills (prefill_outputs) in pieces between decode steps while requests run
        self.pacer = PrefillPacer(runtime.opts.prefill_tokens_per_decode_step, runtime.opts.block_size,
                                  lambda: bool(self.running), runtime.stats,
                                  lambda: getattr(self.overlap, "steps_per_launch", 1))
        runtime.prefill_pacer = self.pacer

    def count_step(self, rows: int) -> None:
        """Count one launched decode step of `rows` requests (count_launch of one step)."""
        self.count_launch([rows])

    def count_launch(self, rows: list[int]) -> None:
        """Count one launch of len(rows) decode steps queued back to back (rows[j]: requests in
        step j; --decode-steps-per-launch) and the wall time since the previous launch when the
        loop did not idle in between (WorkerStats.decode_*: the step cadence). That time is
        the previous launch's: its steps ran in it, so it is split evenly over them."""
        now = time.perf_counter()
        stats = self.rt.stats
        if self._last_step is not None and self._last_rows:
            span = now - self._last_step
            stats.decode_busy_steps += len(self._last_rows)
            stats.decode_busy_step_rows += sum(self._last_rows)
            stats.decode_step_seconds += span
            # each of the previous launch's requests waited span / its steps for each token: the
            # sum over rows / the rows is the time per token a stream sees (a step of a large
            # batch counts once per request in it, as in the clients' TPOT; the cadence counts
            # it once)
            stats.decode_row_seconds += span * sum(self._last_rows) / len(self._last_rows)
        self._last_step = now
        self._last_rows = list(rows)
        stats.decode_steps += len(rows)
        stats.decode_step_rows += sum(rows)
        self.steps += len(rows)
        for _ in rows:
            self.pacer.step_launched()

    def frees_pending(self) -> bool:
        """Whether blocks already released will come back to the pool by themselves: the overlap
        loops free a finished, cancelled or retracted request's blocks only once the step in
        flight has completed (its ticket is back at once, so the next request is admitted first).
        Not once the loop has failed: then nothing completes."""
        return self.overlap is not None and not self.overlap.idle and self.failed is None

    def pending_free_blocks(self) -> int:
        """Blocks released while a step is in flight, freed once it completes (0 off the overlap
        loops, which free at once)."""
        return getattr(self.overlap, "pending_blocks", 0)

    def add(self, req: RunningRequest) -> None:
        """Take ownership of req (its blocks are freed by the scheduler from now on)."""
        self.admission.turn_starts(req.ticket)  # capacity: a lone request's turn is its decoding time
        self.running.append(req)
        self._wake.set()

    def cancel(self, req: RunningRequest) -> None:
        req.cancelled = True
        self._wake.set()

    def _finish(self, req: RunningRequest, out: TokenOut | None) -> None:
        req.flush()
        self.running.remove(req)
        self.release(req.block_ids)
        self.admission.release(req.ticket)  # capacity
        if out is not None:
            req.out.put_nowait(out)

    def _schedule(self) -> list[RunningRequest]:
        for req in [r for r in self.running if r.cancelled]:
            self._finish(req, None)
        self.retraction.yield_solo()  # capacity: one running alone lets waiting requests in after its turn
        self.retraction.resume_ready()  # capacity: retracted requests re-prefill when they fit
        batch = self.retraction.make_room(self.running[: self.rt.opts.max_running])  # capacity: retract if short
        for req in batch:
            self.rt.pool.grow(req.block_ids, len(req.tokens))  # make_room left enough free blocks
        return batch

    def _postprocess(self, batch: list[RunningRequest], step: StepTokens) -> None:
        for req, token, logprob, top in zip(batch, *step):
            if not req.cancelled:
                self.emit(req, token, logprob, for_row(top, req.params))

    def emit(self, req: RunningRequest, token: int, logprob: float, top: tuple[tuple[int, float], ...] = ()) -> bool:
        """Append and stream one generated token (with its most likely alternatives `top`, where
        asked for); finish req at eos or max_tokens (True then)."""
        req.tokens.append(token)
        reason = sampling_pb2.FINISH_REASON_UNSPECIFIED
        if token in self.eos and not req.params.ignore_eos:
            reason = sampling_pb2.FINISH_REASON_EOS
        elif req.generated >= req.params.max_tokens:
            reason = sampling_pb2.FINISH_REASON_LENGTH
        req.send(TokenOut(token, logprob, top), self.stream_interval)
        if reason != sampling_pb2.FINISH_REASON_UNSPECIFIED:
            self._finish(req, TokenOut(finish_reason=reason))
            return True
        return False

    async def run(self) -> None:
        """The decode loop. If it ever fails, every running request ends with INTERNAL, the
        failure is logged, and `failed` is set so the worker reports NOT_SERVING."""
        try:
            await (self.overlap.run() if self.overlap is not None else self._loop())
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("decode loop failed; failing %d running requests", len(self.running))
            self.failed = exc
            for req in list(self.running):
                self._finish(req, TokenOut(error=(grpc.StatusCode.INTERNAL, f"decode loop failed: {exc}")))
            self.retraction.fail_all(f"decode loop failed: {exc}")  # capacity
            if self.on_failure is not None:
                await self.on_failure()
            raise

    async def _loop(self) -> None:
        while True:
            batch = self._schedule()
            self.rt.events.publish()
            if not batch:
                self._last_step = None
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.spec is not None:  # hook: one MTP draft + verify step instead
                await self.spec.step(batch)
                self.count_step(len(batch))
                continue
            inputs = [DecodeInput(r.block_ids, len(r.tokens) - 1, r.tokens[-1]) for r in batch]
            sampling = [r.sampling_row() for r in batch]
            step = await self.rt.run_model(self.rt.runner.decode_tokens, inputs, sampling)
            self.count_step(len(batch))
            self._postprocess(batch, step)
