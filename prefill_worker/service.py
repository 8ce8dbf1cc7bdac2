"""PrefillService: compute a prompt's KV in chunks and write it into the decode worker's pool.

Path of one call (DESIGN.md section 5, step 3): validate → allocate blocks in this worker's
pool (reusing its prefix cache) → chunked prefill → cache the prompt's full blocks →
sample the first token → one-sided WRITE of the blocks the decode worker lacks, with a
notification carrying the request id → free this worker's references → respond.
"""

from __future__ import annotations

import logging

import grpc

from common.grpc_errors import abort_invalid, check_parsed
from common.pb.tandem.v1 import prefill_pb2 as pb
from common.pb.tandem.v1 import prefill_pb2_grpc as pb_grpc
from common.validation import InvalidArgument, sampling_from_proto, validate_token_ids
from engine.kv_pool import PoolExhausted
from engine.sampling import sample
from engine.worker_host import WorkerRuntime
from kv_transfer.base import RemoteBlocks, TransferError

log = logging.getLogger(__name__)


class PrefillServicer(pb_grpc.PrefillServiceServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.rt = runtime

    def _validate(self, request: pb.PrefillRequest) -> None:
        check_parsed(request)
        validate_token_ids(list(request.token_ids), self.rt.vocab_size)
        dst = request.destination
        if dst.backend != self.rt.opts.transfer_backend:
            raise InvalidArgument("destination.backend",
                                  f"{dst.backend!r} is not this worker's backend {self.rt.opts.transfer_backend!r}")
        expected = self.rt.pool.blocks_for(len(request.token_ids)) - dst.first_block_index
        if dst.first_block_index * self.rt.pool.block_size >= len(request.token_ids) or len(dst.block_ids) != expected:
            raise InvalidArgument("destination.block_ids",
                                  f"expected {expected} blocks after first_block_index {dst.first_block_index} "
                                  f"for {len(request.token_ids)} tokens, got {len(dst.block_ids)}")

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext) -> pb.PrefillResponse:
        try:
            self._validate(request)
            params = sampling_from_proto(request.sampling, len(request.token_ids), self.rt.context_length)
        except InvalidArgument as exc:
            await abort_invalid(context, exc)
        dst = request.destination
        if dst.agent_metadata:
            self.rt.agent.add_peer(dst.agent_name, dst.agent_metadata)
        elif not self.rt.agent.has_peer(dst.agent_name):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"destination.agent_metadata: unknown agent {dst.agent_name!r}; send its metadata")
        tokens = list(request.token_ids)
        pool = self.rt.pool
        try:
            prompt = pool.allocate_prompt(tokens)
        except PoolExhausted as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        try:
            start = prompt.num_cached_blocks * pool.block_size
            logits = await self.rt.prefill(prompt.block_ids, tokens, start)
            pool.commit_prompt(prompt)
            self.rt.events.publish()
            token, logprob = sample(logits, params, step=0)
            remote = RemoteBlocks(dst.base_address, dst.block_stride_bytes, dst.device_id, list(dst.block_ids))
            try:
                result = await self.rt.agent.write_blocks(
                    dst.agent_name, prompt.block_ids[dst.first_block_index:], remote,
                    request.request_id.encode(), self.rt.opts.transfer_timeout_s)
            except TransferError as exc:
                log.warning("request %s: KV transfer to %s failed: %s", request.request_id, dst.agent_name, exc)
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"KV transfer failed: {exc}")
            self.rt.stats.prefill_cached_tokens += start
            self.rt.stats.transfers += 1
            self.rt.stats.transfer_bytes += result.bytes
            self.rt.stats.transfer_seconds += result.seconds
            return pb.PrefillResponse(first_token_id=token, first_token_logprob=logprob,
                                      cached_tokens=start, transfer_bytes=result.bytes,
                                      transfer_seconds=result.seconds)
        finally:
            pool.free(prompt.block_ids)
            self.rt.events.publish()
