"""DecodeService: take a request from the router, get its prompt KV, decode, stream tokens.

Path of one call (docs/architecture.md, steps 2–4): validate → check that the prefill worker
named is one in discovery (else PERMISSION_DENIED, nothing dialled) → admission (wait in the worker's
queue while the admitted requests' projected KV fills the practical share of the pool;
RESOURCE_EXHAUSTED when the queue is full) → allocate the prompt's blocks (reusing this
worker's prefix cache) → ask the
prefill worker to write the missing blocks here (or prefill locally when no prefill worker
was given or it failed) → wait for the transfer notification → cache the prompt blocks →
stream the first token → join the continuous batch until finished or cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from typing import NamedTuple

import grpc
import torch

from common import logs, tls, tracing
from common.grpc_errors import abort_invalid, check_parsed
from common.grpc_server import channel
from common.ratelimit import RateLimitedLog
from common.pb.tandem.v1 import decode_pb2 as pb
from common.pb.tandem.v1 import decode_pb2_grpc as pb_grpc
from common.pb.tandem.v1 import prefill_pb2, prefill_pb2_grpc, sampling_pb2
from common.sampling_params import SamplingParams
from common.validation import (InvalidArgument, generated_before, refuse_under_speculation, sampling_from_proto,
                               top_from_proto, top_to_proto, validate_cache_salt, validate_prompt_length,
                               validate_request_id, validate_step_offset, validate_token_ids)
from decode_worker.admission import admit_or_abort
from decode_worker.fence import PrefillFence, nothing_listens
from decode_worker.scheduler import DecodeScheduler, RunningRequest
from engine.block_pool import BlockId
from engine.kv_pool import PoolExhausted, PromptBlocks
from engine.mtp import hidden_from_bytes
from engine.sampling import sample_one
from worker.host import WorkerRuntime
from worker.session import SessionMixin
from kv_transfer.base import TransferError, notification
from worker.peers import DISCOVERY_WAIT_S, PeerDirectory, PermissionDenied

log = logging.getLogger(__name__)
# Prefill call outcomes the prefill worker's handler itself returns, refusing before any write or
# after its writes were stopped and awaited (prefill_worker/service.py: the sender closes before
# the status goes). Every other outcome may mean it never answered and may still write: a
# deadline, a cancellation, and also UNAVAILABLE / UNKNOWN / INTERNAL, which a broken transport
# (keepalive's ping timeout, a reset connection) gives as well as the handler; those are fenced.
ANSWERED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
            grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.ABORTED, grpc.StatusCode.UNAUTHENTICATED,
            grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.NOT_FOUND)
FENCE_WAIT_S = 10.0  # longest a new request waits for fenced blocks to come back before RESOURCE_EXHAUSTED
FENCE_ATTEMPT_S = 1.0  # one Abandon attempt: a resumed prefill worker frees the fence within about this


class Prefilled(NamedTuple):
    """What a prefill gives the decode loop: the first token, and with MTP the last prompt
    token's final-normed hidden state [1, hidden] (engine/mtp.py); `top`: the first token's most
    likely alternatives, (id, logprob) pairs, where the request asked (sampling.top_logprobs)."""

    token: int
    logprob: float
    hidden: torch.Tensor | None
    top: tuple[tuple[int, float], ...] = ()


def _decode_span_attributes(span, running: RunningRequest) -> None:
    """Tokens this call generated (the first one, from prefill, included) and, with MTP, the
    accepted draft tokens and verify steps (decode_worker/spec_step.py counts them)."""
    span.set_attribute("tandem.decode.tokens", running.resolved)
    if running.mtp_verify_steps:
        span.set_attribute(tracing.MTP_ACCEPTED_TOKENS, running.mtp_accepted_tokens)
        span.set_attribute("tandem.mtp.verify_steps", running.mtp_verify_steps)


class DecodeServicer(SessionMixin, pb_grpc.DecodeServiceServicer):
    def __init__(self, runtime: WorkerRuntime, scheduler: DecodeScheduler, prefills: PeerDirectory) -> None:
        self.rt = runtime
        self.scheduler = scheduler
        self.prefills = prefills  # the prefill workers this worker may dial
        scheduler.admission.solo_wait_s = runtime.opts.solo_wait_s
        self._channels: dict[str, grpc.aio.Channel] = {}  # prefill address -> its one channel
        # prefill address -> the TLS name its channel checks (over mTLS, the instance of the
        # record it was opened for: only that process gets our transfer metadata)
        self._channel_names: dict[str, str | None] = {}
        self._closing: set[asyncio.Task] = set()  # channels of departed prefill workers, closing
        # (prefill address, agent name): prefill workers that hold that agent's metadata (one agent
        # per EP rank on an expert-parallel worker)
        self._metadata_sent: set[tuple[str, str]] = set()
        self._failures = RateLimitedLog(log)  # one line per prefill worker per 5 s
        # A prefill call that ended unanswered may still write: its blocks wait here (fence.py)
        # until the prefill worker answers Abandon. Bound, for one that never answers: its own
        # writes stop at the call's deadline (counted from the call's arrival there) and each
        # lasts at most --transfer-timeout, so twice both covers a worker resumed mid-call.
        self.fence = PrefillFence(runtime.agent, self._free_fenced,
                                  2 * (runtime.opts.prefill_timeout_s + runtime.opts.transfer_timeout_s),
                                  FENCE_ATTEMPT_S, runtime.stats)

    def _free_fenced(self, block_ids: list) -> None:
        self.rt.pool.free(block_ids)
        self.rt.events.publish()
        self.scheduler._wake.set()  # a retracted request may be waiting for these blocks, the loop idle

    def _stub(self, address: str, instance_id: str) -> prefill_pb2_grpc.PrefillServiceStub:
        """A stub on the one channel to the prefill worker `instance_id` at `address` (opened at
        first use, closed when its record leaves discovery: `forget_prefill`)."""
        name = tls.instance_server_name(instance_id)
        if address in self._channels and self._channel_names.get(address) != name:
            self.forget_prefill(address)  # another instance serves the address now
        if address not in self._channels:
            self._channels[address] = channel(address, server_name=name)
            self._channel_names[address] = name
        return prefill_pb2_grpc.PrefillServiceStub(self._channels[address])

    def channel_count(self) -> int:
        """Open channels to prefill workers (tandem_worker_prefill_channels)."""
        return len(self._channels)

    def forget_prefill(self, address: str) -> None:
        """The prefill worker at `address` left discovery: close its channel, so that nothing
        dials the address again (gRPC reconnects a channel by itself), and forget that it held
        our agent metadata. Calls still open on it get `--prefill-timeout` to end by
        themselves; the next request that names the address is refused by the PeerDirectory."""
        self._metadata_sent = {k for k in self._metadata_sent if k[0] != address}
        self._channel_names.pop(address, None)
        ch = self._channels.pop(address, None)
        if ch is None:
            return
        self.rt.stats.prefill_channels_closed += 1
        task = asyncio.get_running_loop().create_task(ch.close(grace=self.rt.opts.prefill_timeout_s),
                                                      name=f"close-prefill-channel-{address}")
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _remote_prefill(self, address: str, instance_id: str, request_id: str, tokens: list[int],
                              prompt: PromptBlocks, sampling: sampling_pb2.SamplingParams, timeout_s: float,
                              step_offset: int, cache_salt: str, secret: bytes) -> Prefilled:
        """Have the prefill worker `instance_id` at `address` write our missing blocks; returns
        the first token (and, with MTP speculative decoding, the last prompt token's hidden
        state). `secret`: the call's, which its transfer notification must carry.

        Raises:
            grpc.aio.AioRpcError: the prefill worker failed or refused.
            TransferError: the KV did not arrive in time.
        """
        # the agent of the pool that holds the blocks (on an EP worker, the owning rank's), and
        # the blocks' ids in that pool
        (agent, desc, metadata), local_ids = self.rt.transfer_target(prompt.block_ids)
        sent_key = (address, agent.name)
        dst = prefill_pb2.KvDestination(
            backend=self.rt.opts.transfer_backend, agent_name=agent.name,
            base_address=desc.base_address, block_stride_bytes=desc.block_stride_bytes, device_id=desc.device_id,
            first_block_index=prompt.num_cached_blocks, block_ids=local_ids[prompt.num_cached_blocks:],
            kv_cache_dtype=self.rt.pool.config.dtype_name, kv_cache_scale=self.rt.pool.config.scale)
        req = prefill_pb2.PrefillRequest(request_id=request_id, token_ids=tokens, sampling=sampling, destination=dst,
                                         sampling_step_offset=step_offset,
                                         return_last_hidden=self.scheduler.spec is not None, cache_salt=cache_salt,
                                         notification_token=secret)
        # Agent metadata travels once per prefill worker; resent when it says it lacks it. One
        # stub for both attempts: the retry must not reopen a channel that forget_prefill closed
        # in between (the record left), and a worker forgotten meanwhile is not marked as holding it.
        stub = self._stub(address, instance_id)
        for attempt in range(2):
            if sent_key not in self._metadata_sent or attempt:
                req.destination.agent_metadata = metadata  # the bytes discovery has the digest of
            if attempt and address not in self._channels:  # it answered, then its record left
                raise TransferError(f"prefill worker at {address} left discovery")
            try:
                resp = await stub.Prefill(req, timeout=timeout_s)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or attempt:
                    raise
        if address in self._channels:
            self._metadata_sent.add(sent_key)
        with tracing.span("tandem.kv_receive", {"tandem.transfer.backend": self.rt.opts.transfer_backend,
                                                "tandem.transfer.blocks": len(dst.block_ids),
                                                "tandem.transfer.bytes": resp.transfer_bytes,
                                                "tandem.transfer.seconds": resp.transfer_seconds}):
            await agent.wait_notification(notification(request_id, secret), self.rt.opts.transfer_timeout_s)
        hidden = None
        if self.scheduler.spec is not None:
            cfg = self.rt.loaded.config
            try:
                hidden = hidden_from_bytes(resp.last_hidden, cfg.hidden_size, self.rt.loaded.model.dtype,
                                           self.rt.pool.kv.device)[None]
            except ValueError as exc:  # e.g. an older prefill worker: the caller prefills here
                raise TransferError(f"prefill response unusable for MTP: {exc}") from None
        top = top_from_proto(resp.first_token_top_logprobs, self.rt.vocab_size, sampling.top_logprobs)
        return Prefilled(resp.first_token_id, resp.first_token_logprob, hidden, top)

    async def _prefill_address(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext) -> str:
        """The prefill worker to dial: request.prefill_address when it is a prefill worker of this
        model in discovery; "" (prefill here) when it left discovery lately (the router's view
        may lag ours).

        Raises:
            PermissionDenied: prefill_address is not (and was not lately) a prefill worker in
                discovery: nothing is dialled.
        """
        address = request.prefill_address
        if not address:
            return ""
        remaining = context.time_remaining()
        wait_s = DISCOVERY_WAIT_S if remaining is None else max(0.0, min(DISCOVERY_WAIT_S, remaining / 4))
        try:
            await self.prefills.find(lambda i: i.address == address, "prefill_address",
                                     f"prefill worker {address!r}",
                                     0.0 if self.prefills.recently_gone(address) else wait_s)
        except PermissionDenied as exc:
            if not self.prefills.recently_gone(address):
                raise
            self._failures.warning(address, "request %s: %s (left lately); prefilling locally",
                                   request.request_id, exc)
            return ""
        return address

    async def _still_in_discovery(self, address: str, request_id: str) -> str | None:
        """The instance id of the prefill worker checked by `_prefill_address` if it is still in
        discovery, else None: the request may have waited in admission since, and a record that
        left meanwhile had its channel closed (`forget_prefill`); dialling it now would open one
        that nothing closes. The id is the one the call's channel checks over mTLS."""
        try:
            record = await self.prefills.find(lambda i: i.address == address, "prefill_address",
                                              f"prefill worker {address!r}", 0.0)
        except PermissionDenied as exc:
            self._failures.warning(address, "request %s: %s (it left while the request waited); prefilling "
                                   "locally", request_id, exc)
            return None
        return record.instance_id

    async def _prefill(self, request: pb.DecodeRequest, request_id: str, prompt: PromptBlocks,
                       params: SamplingParams, timeout_s: float, prefill_address: str) -> Prefilled:
        tokens = list(request.token_ids)
        instance = await self._still_in_discovery(prefill_address, request_id) if prefill_address else None
        if instance is not None:
            # the call's secret: only the prefill worker it reaches can announce its KV as written
            secret = secrets.token_bytes(16)
            try:
                first = await self._remote_prefill(prefill_address, instance, request_id, tokens, prompt,
                                                   request.sampling, timeout_s, request.sampling_step_offset,
                                                   request.cache_salt, secret)
                self.rt.stats.remote_prefills += 1
                return first
            except (grpc.aio.AioRpcError, TransferError) as exc:
                detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                self._failures.warning(prefill_address, "request %s: prefill on %s failed (%s); prefilling "
                                       "locally", request_id, prefill_address, detail)
                if isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in ANSWERED:
                    like = list(prompt.block_ids)  # fresh blocks come from the pool (EP rank) holding these
                    try:
                        self._fence(prefill_address, instance, request_id, prompt, secret)
                    except PoolExhausted as short:  # wait a little for blocks (the fenced ones too) to come back
                        await self._refill(prompt, short.needed, like)
            except asyncio.CancelledError:  # the request ended while the prefill worker had it
                try:
                    self._fence(prefill_address, instance, request_id, prompt, secret)
                except PoolExhausted:
                    pass  # nothing more to run for it: the fenced blocks are held all the same
                raise
        self.rt.stats.local_prefills += 1
        start = prompt.num_cached_blocks * self.rt.pool.block_size
        spec = self.scheduler.spec is not None
        out = await self.rt.prefill_outputs(prompt.block_ids, tokens, start, mtp=spec)
        hidden = out.hidden
        history = generated_before(request.token_ids, request.sampling_step_offset, params)
        token, logprob, top = sample_one(out.logits, params, request.sampling_step_offset, history)
        return Prefilled(token, logprob, hidden[None] if spec else None, top)

    def _fence(self, address: str, instance_id: str, request_id: str, prompt: PromptBlocks, secret: bytes) -> None:
        """Swap the blocks the prefill worker at `address` was given for fresh ones (the prompt
        then holds only blocks no late write can reach) and fence the old ones until it
        answers Abandon (decode_worker/fence.py).

        Raises:
            PoolExhausted: no fresh blocks (the old ones are fenced all the same).
        """
        given = prompt.block_ids[prompt.num_cached_blocks:]
        prompt.block_ids[prompt.num_cached_blocks:] = []
        name = tls.instance_server_name(instance_id)  # the instance the call went to

        async def abandon(timeout_s: float) -> bool:
            # A channel of its own: the fence must reach a prefill worker whose record has left
            # (stopped, its lease expired, it may resume and write), and must not put back the
            # cached channel that forget_prefill closed. Attempts are rare (failed calls only).
            async with channel(address, server_name=name) as ch:
                resp = await prefill_pb2_grpc.PrefillServiceStub(ch).Abandon(
                    prefill_pb2.AbandonRequest(request_id=request_id), timeout=timeout_s)
            return resp.notified

        # a late transfer's notification arrives at the agent of the pool that holds the blocks
        agent = self.rt.transfer_target(given)[0].agent if given else None
        self.fence.hold(request_id, given, abandon, lambda: nothing_listens(address),
                        notification(request_id, secret), agent=agent)
        prompt.block_ids.extend(self.rt.pool.allocate_beside(given, len(given)))  # PoolExhausted.needed: len(given)

    async def _refill(self, prompt: PromptBlocks, n: int, like: list[BlockId]) -> None:
        """Give the prompt its n fresh blocks, waiting up to FENCE_WAIT_S for the pool to free
        some (a fence on a prefill worker that died is released within about two seconds: its
        port refuses connections). Raises PoolExhausted when the wait ends first."""
        deadline = time.monotonic() + FENCE_WAIT_S
        while True:
            try:
                prompt.block_ids.extend(self.rt.pool.allocate_beside(like, n))
                return
            except PoolExhausted:
                if time.monotonic() >= deadline:
                    raise
            self.fence.released.clear()
            try:  # a fence's release sets the event; other requests free blocks without it: poll too
                await asyncio.wait_for(self.fence.released.wait(), 0.2)
            except (TimeoutError, asyncio.TimeoutError):
                pass

    async def Generate(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        if self.rt.draining:  # the router retries on another decode worker
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is draining")
        logs.request_id.set(getattr(request, "request_id", ""))  # this RPC's task only; may be unparsable
        with self.rt.serving():
            async for msg in self._generate(request, context):
                self.rt.stats.generated_tokens += len(msg.token_ids)
                yield msg

    async def _generate(self, request: pb.DecodeRequest, context: grpc.aio.ServicerContext):
        try:
            check_parsed(request)
            validate_request_id(request.request_id, internal=True)
            validate_token_ids(list(request.token_ids), self.rt.vocab_size)
            validate_prompt_length(len(request.token_ids), self.rt.context_length, "token_ids")
            validate_step_offset(request.sampling_step_offset, len(request.token_ids))
            validate_cache_salt(request.cache_salt)
            params = sampling_from_proto(request.sampling, len(request.token_ids), self.rt.context_length,
                                         self.rt.vocab_size)
            if self.scheduler.spec is not None:
                refuse_under_speculation(params, "this decode worker runs")
            prefill_address = await self._prefill_address(request, context)
        except InvalidArgument as exc:
            await abort_invalid(context, exc)
        except PermissionDenied as exc:
            self._failures.warning(request.prefill_address, "request %s refused: %s", request.request_id, exc)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        request_id = request.request_id or uuid.uuid4().hex
        tokens = list(request.token_ids)
        seed = self.rt.seed_for(request.cache_salt)  # tenants share no cached prefix (docs/security.md)
        pool = self.rt.pool
        # capacity: wait for admission (RESOURCE_EXHAUSTED when the queue is full), then the blocks
        admission = self.scheduler.admission
        ticket = await admit_or_abort(admission, len(tokens), params.max_tokens, context)
        try:
            # fenced blocks come back too (decode_worker/fence.py): wait for them as for running
            # requests, but for FENCE_WAIT_S at most (a fence may last 2 × (prefill + transfer
            # timeout)); then RESOURCE_EXHAUSTED, and the router tries another decode worker. So
            # do the blocks of a request that ended under the overlap loop (freed after its step).
            began = time.monotonic()
            prompt = await admission.allocate_prompt(
                tokens, lambda: admission.admitted > 1 or self.scheduler.frees_pending()
                or (self.fence.held_blocks > 0 and time.monotonic() - began < FENCE_WAIT_S), seed)
            self.rt.count_prefix_lookup(len(tokens), prompt)
        except PoolExhausted as exc:
            admission.release(ticket)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except BaseException:
            admission.release(ticket)
            raise
        rpc_span = tracing.current_span()
        if rpc_span.is_recording():
            rpc_span.set_attributes({"tandem.request_id": request_id, "tandem.prompt_tokens": len(tokens),
                                     "tandem.cached_tokens": prompt.num_cached_blocks * pool.block_size,
                                     "tandem.prefill_address": request.prefill_address,
                                     "tandem.sampling_step_offset": request.sampling_step_offset})
        running: RunningRequest | None = None
        try:
            # A stalled prefill worker must leave time to prefill here instead.
            remaining = context.time_remaining()
            timeout_s = self.rt.opts.prefill_timeout_s
            if remaining is not None:
                timeout_s = min(timeout_s, remaining / 2)
            try:
                token, logprob, hidden, top = await self._prefill(request, request_id, prompt, params, timeout_s,
                                                                  prefill_address)
            except PoolExhausted:  # its prefill worker went silent and no fresh blocks are left here
                await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker did not answer and the KV pool has "
                                    "no free blocks for a local prefill")
            pool.commit_prompt(prompt)
            self.rt.events.publish()
            yield pb.DecodeResponse(token_ids=[token], logprobs=[logprob], prompt_tokens=len(tokens),
                                    cached_tokens=prompt.num_cached_blocks * pool.block_size,
                                    top_logprobs=[top_to_proto(top)] if params.top_logprobs else [])
            if token in self.scheduler.eos and not params.ignore_eos:
                yield pb.DecodeResponse(finish_reason=sampling_pb2.FINISH_REASON_EOS)
                return
            if params.max_tokens == 1:
                yield pb.DecodeResponse(finish_reason=sampling_pb2.FINISH_REASON_LENGTH)
                return
            if self.scheduler.failed is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "decode loop is down on this worker")
            running = RunningRequest(request_id, tokens + [token], len(tokens), prompt.block_ids, params,
                                     step_offset=request.sampling_step_offset, hidden=hidden, ticket=ticket,
                                     hash_seed=seed)
            self.scheduler.add(running)
            with tracing.span("tandem.decode") as span:
                try:
                    while True:
                        outs = [await running.out.get()]
                        while not running.out.empty():
                            outs.append(running.out.get_nowait())
                        msg = pb.DecodeResponse()
                        for out in outs:
                            if out.error is not None:
                                await context.abort(*out.error)
                            if out.token is not None:
                                msg.token_ids.append(out.token)
                                msg.logprobs.append(out.logprob)
                                if params.top_logprobs:
                                    msg.top_logprobs.append(top_to_proto(out.top))
                            msg.finish_reason = out.finish_reason or msg.finish_reason
                        yield msg
                        if msg.finish_reason:
                            span.set_attribute("tandem.finish_reason", sampling_pb2.FinishReason.Name(
                                msg.finish_reason).removeprefix("FINISH_REASON_").lower())
                            return
                finally:
                    if span.is_recording():
                        _decode_span_attributes(span, running)
        finally:
            if running is None:
                pool.free(prompt.block_ids)
                admission.release(ticket)  # capacity
                self.rt.events.publish()
            else:
                self.scheduler.cancel(running)

    async def close(self) -> None:
        await self.fence.close()
        for ch in self._channels.values():
            await ch.close()
        for task in list(self._closing):
            task.cancel()
