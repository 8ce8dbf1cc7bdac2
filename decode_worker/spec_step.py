"""The decode loop's MTP speculative step (`--speculative-num-steps k`; docs/architecture.md,
"Decode runtime").

Replaces the scheduler's one-token run → postprocess with: grow each request's blocks for its
k drafts → one model-thread call (draft with the MTP module, verify in one target forward;
engine/spec_decode.py) → accept → emit 1..k+1 tokens per request, stopping at eos or
max_tokens exactly as plain decoding would → free the blocks of rejected positions.

A request drafts at most (tokens it may still generate − 1), so a verify step never produces a
token past max_tokens. Accept length (tokens emitted per verify step) is counted in
WorkerStats.spec_verify_steps / spec_emitted_tokens over steps that drafted at least one token.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import grpc

from engine.kv_pool import PoolExhausted
from engine.mtp import pool_has_mtp
from engine.spec_decode import SpecInput, accept

if TYPE_CHECKING:
    from decode_worker.scheduler import DecodeScheduler, RunningRequest

log = logging.getLogger(__name__)


class SpecDecoder:
    """Runs speculative steps for a DecodeScheduler (which owns the requests and their blocks)."""

    def __init__(self, scheduler: DecodeScheduler, num_steps: int) -> None:
        rt = scheduler.rt
        if not pool_has_mtp(rt.pool, rt.loaded.model):
            raise ValueError(f"--speculative-num-steps {num_steps}: model {rt.loaded.name} has no MTP module "
                             "(num_nextn_predict_layers = 0)")
        self.sched = scheduler
        self.k = num_steps
        log.info("MTP speculative decoding on: %d draft tokens per verify step", num_steps)

    def _input(self, req: RunningRequest) -> SpecInput:
        pool = self.sched.rt.pool
        k = max(0, min(self.k, req.params.max_tokens - req.generated - 1))
        try:  # room for the k drafts' positions; without it this request just decodes one token
            pool.grow(req.block_ids, len(req.tokens) + k)
        except PoolExhausted:
            k = 0
        n = len(req.tokens) - 1  # position of the pending token
        assert req.hidden is not None, "speculative requests carry the main hidden state"
        r = req.hidden.shape[0]
        return SpecInput(req.block_ids, n, req.hidden, req.tokens[n - r + 1:], k, req.params,
                         req.step_offset + req.generated)

    async def step(self, batch: list[RunningRequest]) -> None:
        from decode_worker.scheduler import TokenOut  # circular: the scheduler imports us

        rt = self.sched.rt
        inputs = [self._input(req) for req in batch]
        outs = await rt.run_model(rt.runner.spec_decode, inputs)
        for req, inp, out in zip(batch, inputs, outs):
            if req.cancelled:
                continue
            try:
                emitted = accept(out, req.params, inp.step)
            except (RuntimeError, ValueError) as exc:  # one request's sampling must not stop the batch
                log.exception("request %s: speculative accept failed", req.request_id)
                self.sched._finish(req, TokenOut(error=(grpc.StatusCode.INTERNAL, f"sampling failed: {exc}")))
                continue
            if inp.num_drafts:
                rt.stats.spec_verify_steps += 1
                rt.stats.spec_emitted_tokens += len(emitted)
                rt.stats.spec_draft_tokens += inp.num_drafts
                req.mtp_verify_steps += 1
                req.mtp_accepted_tokens += len(emitted) - 1  # the last one is the target's own token
            # main hidden at n..n+m: the next step's MTP extend pairs them with the new tokens
            req.hidden = out.hidden[:len(emitted)]
            finished = False
            for token, logprob, top in emitted:
                if self.sched.emit(req, token, logprob, top):
                    finished = True
                    break
            if not finished:  # free the blocks that only held rejected positions
                keep = rt.pool.blocks_for(len(req.tokens))
                rt.pool.free(req.block_ids[keep:])
                del req.block_ids[keep:]
