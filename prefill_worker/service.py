"""PrefillService: compute a prompt's KV in chunks and write it into the decode worker's pool.

Path of one call (docs/architecture.md, step 3): validate → authorise the destination (a
decode worker in discovery; its metadata and block ids checked against its record) → allocate blocks in this worker's
pool (reusing its prefix cache) → chunked prefill, each chunk's finished blocks written into
the decode worker's pool while the next chunk computes (`chunk_sender.py`) → cache the
prompt's full blocks → sample the first token → write the rest with the notification carrying
the request id → free this worker's references → respond.
"""

from __future__ import annotations

import logging
import time

import grpc

from common import logs, tls, tracing
from common.ratelimit import RateLimitedLog
from common.grpc_errors import abort_invalid, check_parsed
from common.pb.tandem.v1 import prefill_pb2 as pb
from common.pb.tandem.v1 import prefill_pb2_grpc as pb_grpc
from common.validation import (InvalidArgument, generated_before, sampling_from_proto, top_to_proto, validate_cache_salt,
                               validate_prompt_length, validate_request_id, validate_step_offset, validate_token_ids)
from engine.kv_pool import PromptBlocks
from engine.mtp import hidden_to_bytes
from engine.pipeline import PipelineError
from engine.sampling import sample_one
from worker.host import WorkerRuntime
from kv_transfer.base import MAX_NOTIFICATION_TOKEN_BYTES, RemoteBlocks, TransferError, notification
from kv_transfer.select import CHOICES
from prefill_worker.calls import PrefillCalls
from prefill_worker.chunk_sender import ChunkSender
from prefill_worker.inflight import MAX_WAIT_S, InflightPrefixes, wait_for
from worker.peers import DISCOVERY_WAIT_S, PeerDirectory, PermissionDenied, metadata_digest, transfer_agents

log = logging.getLogger(__name__)


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(self, runtime: WorkerRuntime, decoders: PeerDirectory) -> None:
        self.rt = runtime
        self.decoders = decoders  # the decode workers this worker may write into
        self._peer_digests: dict[str, bytes] = {}  # agent name -> digest of the metadata loaded for it
        self._failures = RateLimitedLog(log)  # one line per decode agent per 5 s
        self.calls = PrefillCalls()  # running calls by request id, and the abandoned ids (calls.py)
        self.inflight = InflightPrefixes()  # block hashes being computed now (inflight.py)

    def forget_peer(self, agent_name: str) -> None:
        """Drop cached transfer metadata of a decode worker's agent (it left discovery)."""
        self._peer_digests.pop(agent_name, None)
        if agent_name and self.rt.agent.has_peer(agent_name):
            self.rt.agent.remove_peer(agent_name)
            log.info("decode worker's transfer agent %s left discovery: metadata dropped", agent_name)

    async def _authorize(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> None:
        """The destination must be a decode worker of this model in discovery, its block ids in
        that worker's advertised pool and its metadata the one the worker published (by
        digest), so a caller can neither aim writes at another process's memory nor past the
        pool. Over mTLS (where RoleCheck has already admitted only decode workers'
        certificates) the destination must also be the caller's own: its record's instance id
        is the instance name the caller's certificate carries, so one decode worker cannot have
        writes aimed at another's pool, not even with the metadata this worker still holds
        from the other's own calls.

        Raises:
            PermissionDenied: destination.agent_name not in discovery or not the caller's, or
                destination.agent_metadata not the record's. InvalidArgument:
                destination.block_ids past the record's kv_capacity_blocks.
        """
        dst = request.destination
        remaining = context.time_remaining()
        wait_s = DISCOVERY_WAIT_S if remaining is None else max(0.0, min(DISCOVERY_WAIT_S, remaining / 4))
        if self.decoders.recently_gone_agent(dst.agent_name):
            wait_s = 0.0
        record = await self.decoders.find(lambda i: dst.agent_name in transfer_agents(i),
                                          "destination.agent_name", f"decode agent {dst.agent_name!r}", wait_s)
        # the agent's own digest and pool size: an EP decode worker has one agent per rank
        digest, capacity = transfer_agents(record)[dst.agent_name]
        if tls.TLS is not None:
            callers = tls.peer_instances(context)
            if record.instance_id not in callers:
                raise PermissionDenied("destination.agent_name",
                                       f"decode agent {dst.agent_name!r} is {record.instance_id}'s, and the caller's "
                                       f"certificate names instance {', '.join(sorted(callers)) or '(none)'}: a "
                                       "decode worker may ask only for writes into its own pool")
        if dst.block_ids and max(dst.block_ids) >= capacity:
            raise InvalidArgument("destination.block_ids",
                                  f"block id {max(dst.block_ids)} is outside {record.instance_id}'s pool of "
                                  f"{capacity} blocks (agent {dst.agent_name!r})")
        if not digest:
            raise PermissionDenied("destination.agent_metadata",
                                   f"{record.instance_id} publishes no transfer metadata digest in discovery")
        if dst.agent_metadata and metadata_digest(dst.agent_metadata) != digest:
            raise PermissionDenied("destination.agent_metadata",
                                   f"not the transfer metadata {record.instance_id} published in discovery "
                                   "(only that worker may send it)")
        if not dst.agent_metadata and self._peer_digests.get(dst.agent_name) != digest:
            self.forget_peer(dst.agent_name)  # loaded for an earlier record of that name: ask again

    def _validate(self, request: pb.PrefillRequest) -> None:
        """Every check that needs no compute runs before the prefill starts."""
        check_parsed(request)
        if not request.request_id:
            raise InvalidArgument("request_id", "must be set (the transfer notification carries it)")
        validate_request_id(request.request_id, internal=True)
        validate_token_ids(list(request.token_ids), self.rt.vocab_size)
        validate_prompt_length(len(request.token_ids), self.rt.context_length, "token_ids")
        validate_step_offset(request.sampling_step_offset, len(request.token_ids))
        validate_cache_salt(request.cache_salt)
        if len(request.notification_token) > MAX_NOTIFICATION_TOKEN_BYTES:
            raise InvalidArgument("notification_token", f"{len(request.notification_token)} bytes, at most "
                                  f"{MAX_NOTIFICATION_TOKEN_BYTES}")
        dst = request.destination
        if dst.backend not in CHOICES:  # the backend itself is chosen from both agents' metadata
            raise InvalidArgument("destination.backend", f"{dst.backend!r} is not one of {', '.join(CHOICES)}")
        if not dst.agent_name or dst.agent_name == self.rt.agent.name:
            raise InvalidArgument("destination.agent_name", f"{dst.agent_name!r} is empty or this worker's own agent")
        n_blocks = self.rt.pool.blocks_for(len(request.token_ids))
        if dst.first_block_index >= n_blocks:
            raise InvalidArgument("destination.first_block_index",
                                  f"{dst.first_block_index} is past the prompt's {n_blocks} blocks")
        if len(dst.block_ids) != n_blocks - dst.first_block_index:
            raise InvalidArgument("destination.block_ids",
                                  f"expected {n_blocks - dst.first_block_index} blocks after first_block_index "
                                  f"{dst.first_block_index} for {len(request.token_ids)} tokens, got {len(dst.block_ids)}")
        if len(set(dst.block_ids)) != len(dst.block_ids):
            raise InvalidArgument("destination.block_ids", "block ids repeat")
        # Both pools must store the same bytes for the same KV (dtype and FP8 scale); checked
        # before the stride so a dtype mismatch is named as such.
        pool_cfg = self.rt.pool.config
        dtype = dst.kv_cache_dtype or str(self.rt.loaded.model.dtype).removeprefix("torch.")
        if dtype != pool_cfg.dtype_name:
            raise InvalidArgument("destination.kv_cache_dtype",
                                  f"{dtype!r} differs from this worker's KV cache dtype {pool_cfg.dtype_name!r} "
                                  "(set the same --kv-cache-dtype on prefill and decode workers)")
        # the field is a float32: compare to its precision
        if pool_cfg.quantized and abs((dst.kv_cache_scale or 1.0) - pool_cfg.scale) > 1e-6 * pool_cfg.scale:
            raise InvalidArgument("destination.kv_cache_scale",
                                  f"{dst.kv_cache_scale or 1.0} differs from this worker's FP8 KV scale "
                                  f"{pool_cfg.scale} (set the same --kv-cache-scale)")
        stride = self.rt.pool_desc.block_stride_bytes
        if dst.block_stride_bytes != stride:
            raise InvalidArgument("destination.block_stride_bytes",
                                  f"{dst.block_stride_bytes} differs from this worker's {stride} (same model and "
                                  "block size required)")
        if dst.device_id < -1:
            raise InvalidArgument("destination.device_id", f"must be -1 (host) or a device index, got {dst.device_id}")
        end = dst.base_address + (max(dst.block_ids) + 1) * stride
        if dst.base_address == 0 or end >= 1 << 64:
            raise InvalidArgument("destination.base_address", "the destination blocks do not fit in 64-bit addresses")

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        if self.rt.draining:  # the decode worker prefills locally instead
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker is draining")
        logs.request_id.set(getattr(request, "request_id", ""))  # this RPC's task only; may be unparsable
        tracing.current_span().set_attribute("tandem.request_id", getattr(request, "request_id", ""))
        with self.rt.serving():
            return await self._prefill(request, context)

    async def _prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        try:
            self._validate(request)
            params = sampling_from_proto(request.sampling, len(request.token_ids), self.rt.context_length,
                                         self.rt.vocab_size)
            await self._authorize(request, context)
        except InvalidArgument as exc:
            await abort_invalid(context, exc)
        except PermissionDenied as exc:
            self._failures.warning(request.destination.agent_name, "request %s refused: %s",
                                   request.request_id, exc)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        if request.return_last_hidden and self.rt.pipeline is not None:  # hidden states stay in the last stage
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "return_last_hidden: not served by a pipeline-parallel prefill worker (--pp-size > 1)")
        dst = request.destination
        if dst.agent_metadata:
            try:
                self.rt.agent.add_peer(dst.agent_name, dst.agent_metadata)
            except (TransferError, ValueError) as exc:
                await abort_invalid(context, InvalidArgument("destination.agent_metadata", str(exc)))
            self._peer_digests[dst.agent_name] = metadata_digest(dst.agent_metadata)
        elif not self.rt.agent.has_peer(dst.agent_name):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"destination.agent_metadata: unknown agent {dst.agent_name!r}; send its metadata")
        if self.calls.abandoned(request.request_id):  # e.g. queued here behind a SIGSTOP
            await _abort_abandoned(context)
        tokens = list(request.token_ids)
        pool = self.rt.pool
        prompt = await self._allocate(tokens, context, self.rt.seed_for(request.cache_salt))
        remote = RemoteBlocks(dst.base_address, dst.block_stride_bytes, dst.device_id, list(dst.block_ids))
        # The deadline counts from this call's arrival here; a process stopped and resumed
        # mid-call finds it passed and posts nothing more (the decode worker gave up).
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        sender = ChunkSender(self.rt.agent, dst.agent_name, prompt.block_ids, dst.first_block_index, remote,
                             pool.block_size, self.rt.opts.transfer_timeout_s, deadline=deadline)
        if not self.calls.start(request.request_id, sender):  # abandoned while its blocks were allocated
            pool.free(prompt.block_ids)
            self.rt.events.publish()
            await _abort_abandoned(context)
        forget = False
        backend = self.rt.agent.backend_for(dst.agent_name) or self.rt.agent.backend
        # prompts sharing its prefix may wait for it to be cached (inflight.py)
        cached = self.inflight.announce(prompt, len(tokens), pool.block_size)
        try:
            start = prompt.num_cached_blocks * pool.block_size
            try:
                await sender.on_chunk_done(start)  # blocks from this worker's prefix cache go at once
                hidden = None
                try:
                    if request.return_last_hidden:
                        # MTP KV rows and the hidden state, for a decode worker that drafts with them
                        out = await self.rt.prefill_outputs(prompt.block_ids, tokens, start, mtp=True,
                                                            on_chunk_done=sender.on_chunk_done)
                        hidden, logits = out.hidden, out.logits
                    else:
                        logits = await self.rt.prefill(prompt.block_ids, tokens, start,
                                                       on_chunk_done=sender.on_chunk_done)
                except PipelineError as exc:  # the worker reports NOT_SERVING; the decode worker goes elsewhere
                    await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
                pool.commit_prompt(prompt)
                cached()
                self.rt.events.publish()
                history = generated_before(request.token_ids, request.sampling_step_offset, params)
                token, logprob, top = sample_one(logits, params, request.sampling_step_offset, history)
                # The span covers the exposed part: earlier chunks' writes overlapped the prefill.
                with tracing.span("tandem.kv_transfer", {"tandem.transfer.backend": backend,
                                                         "tandem.transfer.blocks": len(dst.block_ids),
                                                         "tandem.transfer.peer": dst.agent_name}) as span:
                    result = await sender.finish(notification(request.request_id, request.notification_token))
                    span.set_attributes({"tandem.transfer.backend": result.backend,
                                         "tandem.transfer.bytes": result.bytes,
                                         "tandem.transfer.seconds": result.seconds,
                                         "tandem.transfer.writes": result.writes,
                                         "tandem.transfer.exposed_seconds": result.exposed_seconds})
            except TransferError as exc:
                # Not transfer failures (the peer is fine): abandoned, or past the call's deadline.
                if self.calls.abandoned(request.request_id):
                    await _abort_abandoned(context)
                if deadline is not None and time.monotonic() >= deadline:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"no KV write past the call's deadline: {exc}")
                # Forget the peer: its connection may be broken for good. The decode worker
                # then resends its metadata (FAILED_PRECONDITION) and a fresh connection is made.
                self.rt.stats.backend(backend).failures += 1
                self.rt.stats.backend(backend).writes += sender.writes
                self._failures.warning(dst.agent_name, "request %s: KV transfer to %s failed: %s", request.request_id,
                                       dst.agent_name, exc)
                forget = True
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {exc}")
            self.rt.stats.prefill_cached_tokens += start
            self.rt.stats.transfers += 1
            self.rt.stats.transfer_bytes += result.bytes
            self.rt.stats.transfer_seconds += result.seconds
            self.rt.metrics.transfer_duration.labels(result.backend).observe(result.seconds)
            per = self.rt.stats.backend(result.backend)
            per.transfers += 1
            per.writes += result.writes
            per.bytes += result.bytes
            per.seconds += result.seconds
            per.exposed_seconds += result.exposed_seconds
            return pb.PrefillResponse(first_token_id=token, first_token_logprob=logprob,
                                      first_token_top_logprobs=top_to_proto(top),
                                      cached_tokens=start, transfer_bytes=result.bytes,
                                      transfer_seconds=result.seconds,
                                      last_hidden=hidden_to_bytes(hidden) if request.return_last_hidden else b"")
        finally:
            cached()
            await sender.aclose()  # writes still running are cancelled before the blocks go
            self.calls.end(request.request_id, sender)
            self.rt.stats.late_writes_refused += sender.late_refused
            if forget:
                self.rt.agent.remove_peer(dst.agent_name)
            pool.free(prompt.block_ids)
            self.rt.events.publish()

    async def _allocate(self, tokens: list[int], context: grpc.aio.ServicerContext, seed: int) -> PromptBlocks:
        """The prompt's blocks (RESOURCE_EXHAUSTED when the pool is full). When the blocks right
        after its cached prefix are being computed for another prompt now, and they cover at
        least what it would compute after them, it first waits for them to be cached
        (prefill_worker/inflight.py), at most half the call's remaining time."""
        prompt = await self.rt.allocate_prompt(tokens, context, seed, count=False)
        event = self.inflight.should_wait(prompt, len(tokens), self.rt.pool.block_size)
        if event is None:
            self.rt.count_prefix_lookup(len(tokens), prompt)
            return prompt
        self.rt.pool.free(prompt.block_ids)  # nothing is held while it waits
        self.rt.stats.prefill_inflight_waits += 1
        remaining = context.time_remaining()
        await wait_for(event, MAX_WAIT_S if remaining is None else remaining / 2)
        return await self.rt.allocate_prompt(tokens, context, seed)

    async def Abandon(self, request: pb.AbandonRequest, context: grpc.aio.ServicerContext) -> pb.AbandonResponse:
        """The decode worker stopped waiting for this request's Prefill and holds its blocks
        (decode_worker/fence.py): answered once no write of it can reach them (calls.py)."""
        try:
            check_parsed(request)
            if not request.request_id:
                raise InvalidArgument("request_id", "must be set")
            validate_request_id(request.request_id, internal=True)
        except InvalidArgument as exc:
            await abort_invalid(context, exc)
        logs.request_id.set(request.request_id)
        notified = await self.calls.abandon(request.request_id)
        log.info("request %s abandoned by its decode worker: no further KV write", request.request_id)
        return pb.AbandonResponse(notified=notified)


async def _abort_abandoned(context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.ABORTED, "request_id: abandoned by the decode worker (its call ended "
                        "before this one started here); nothing was written")
