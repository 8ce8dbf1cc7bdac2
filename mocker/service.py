"""DecodeService and PrefillService of a simulated worker, over a MockEngine.

The same RPCs, validation and status codes as decode_worker/service.py and
prefill_worker/service.py; tokens are `engine.output_token(i)` (no model, so no EOS: a request
runs to max_tokens). A decode call with a prefill address asks that (mock) prefill worker to
compute the prompt; the KV "transfer" is the prefill worker waiting `TimingModel.transfer_s`
before it answers. The decode worker reports its own prefix-cache hits in `cached_tokens`, as
a real one does.
"""

from __future__ import annotations

import asyncio
import uuid

import grpc

from common.grpc_errors import abort_invalid, check_parsed
from common.grpc_server import channel
from common.pb.tandem.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, sampling_pb2
from common.validation import (InvalidArgument, sampling_from_proto, top_to_proto, validate_prompt_length,
                               validate_token_ids)
from mocker.driver import RealTimeDriver
from mocker.engine import Kind, RequestTooLarge, SimRequest, State, output_token
from worker.session import SessionMixin

TRANSFER_BACKEND = "mock"  # KvDestination.backend between simulated workers


class _Worker:
    """What both servicers share: the engine's driver, the model's limits, the drain flag."""

    def __init__(self, driver: RealTimeDriver, vocab_size: int, context_length: int) -> None:
        self.driver = driver
        self.engine = driver.engine
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.draining = False
        self.in_flight = 0

    async def _validated(self, request, context: grpc.aio.ServicerContext):
        try:
            check_parsed(request)
            validate_token_ids(list(request.token_ids), self.vocab_size)
            validate_prompt_length(len(request.token_ids), self.context_length, "token_ids")
            return sampling_from_proto(request.sampling, len(request.token_ids), self.context_length, self.vocab_size)
        except InvalidArgument as exc:
            await abort_invalid(context, exc)

    async def _submit(self, req: SimRequest, context: grpc.aio.ServicerContext) -> None:
        try:
            self.driver.submit(req)
        except RequestTooLarge as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))

    async def _check_engine(self, context: grpc.aio.ServicerContext) -> None:
        if self.driver.failed is not None:
            await context.abort(grpc.StatusCode.INTERNAL, f"mock engine failed: {self.driver.failed}")


class MockDecodeServicer(_Worker, SessionMixin, decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, driver: RealTimeDriver, vocab_size: int, context_length: int, agent_name: str) -> None:
        super().__init__(driver, vocab_size, context_length)
        self.agent_name = agent_name
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def _remote_prefill(self, request: decode_pb2.DecodeRequest, req: SimRequest, timeout_s: float) -> bool:
        """Have the prefill worker compute the prompt; False when it failed (prefill here then)."""
        bs = self.engine.pool.block_size
        first = req.prompt.num_cached_blocks
        dst = prefill_pb2.KvDestination(
            backend=TRANSFER_BACKEND, agent_name=self.agent_name, base_address=1,
            block_stride_bytes=bs * self.engine.timing.kv_bytes_per_token, device_id=-1,
            first_block_index=first, block_ids=req.block_ids[first:])
        if request.prefill_address not in self._channels:
            self._channels[request.prefill_address] = channel(request.prefill_address)
        stub = prefill_pb2_grpc.PrefillServiceStub(self._channels[request.prefill_address])
        try:
            await stub.Prefill(prefill_pb2.PrefillRequest(request_id=req.request_id, token_ids=req.token_ids,
                                                          sampling=request.sampling, destination=dst),
                               timeout=timeout_s)
            return True
        except grpc.aio.AioRpcError:
            return False

    async def Generate(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "decode worker is draining")
        params = await self._validated(request, context)
        changed = asyncio.Event()
        kind = Kind.REMOTE_KV if request.prefill_address else Kind.LOCAL
        req = SimRequest(request.request_id or uuid.uuid4().hex, list(request.token_ids), params.max_tokens, kind,
                         on_change=lambda _r: changed.set())
        self.in_flight += 1
        try:
            await self._submit(req, context)
            if kind is Kind.REMOTE_KV:
                while req.state is State.WAITING:
                    await changed.wait()
                    changed.clear()
                    await self._check_engine(context)
                remaining = context.time_remaining()
                ok = await self._remote_prefill(request, req, 30.0 if remaining is None else remaining / 2)
                self.engine.kv_arrived(req, ok)
                self.driver.wake()
            sent = 0
            while True:
                await changed.wait()
                changed.clear()
                await self._check_engine(context)
                n, done = req.generated, req.state is State.DONE
                if n == sent and not done:
                    continue
                ids = [output_token(i) for i in range(sent, n)]
                # each token is certain (log-probability 0), so it is its own only alternative
                msg = decode_pb2.DecodeResponse(token_ids=ids, logprobs=[0.0] * (n - sent), top_logprobs=[
                    top_to_proto(((t, 0.0),)) for t in ids] if params.top_logprobs else [])
                if sent == 0 and n:
                    msg.prompt_tokens = len(req.token_ids)
                    msg.cached_tokens = req.cached_tokens
                if done:
                    msg.finish_reason = sampling_pb2.FINISH_REASON_LENGTH
                sent = n
                yield msg
                if done:
                    return
        finally:
            self.in_flight -= 1
            self.engine.cancel(req)
            self.driver.wake()

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()


class MockPrefillServicer(_Worker, prefill_pb2_grpc.PrefillServiceServicer):
    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill worker is draining")
        await self._validated(request, context)
        if request.destination.backend != TRANSFER_BACKEND:
            await abort_invalid(context, InvalidArgument(
                "destination.backend", f"{request.destination.backend!r} is not this worker's backend "
                                       f"{TRANSFER_BACKEND!r}"))
        done = asyncio.Event()
        req = SimRequest(request.request_id or uuid.uuid4().hex, list(request.token_ids), 1, Kind.PREFILL_ONLY,
                         on_change=lambda r: done.set() if r.state is State.DONE else None)
        self.in_flight += 1
        try:
            await self._submit(req, context)
            await done.wait()
            await self._check_engine(context)
            bs = self.engine.pool.block_size
            moved = max(0, len(req.token_ids) - request.destination.first_block_index * bs)
            timing = self.engine.timing
            seconds = timing.transfer_s(moved)
            await asyncio.sleep(seconds / timing.speedup)
            return prefill_pb2.PrefillResponse(first_token_id=output_token(0), cached_tokens=req.cached_tokens,
                                               transfer_bytes=moved * timing.kv_bytes_per_token,
                                               transfer_seconds=seconds)
        finally:
            self.in_flight -= 1
            self.engine.cancel(req)
            self.driver.wake()
