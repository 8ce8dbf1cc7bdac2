"""FrontendService: the client-facing API (DESIGN.md sections 2 and 5).

Generate: validate → tokenize → choose a decode worker and a prefill worker → call the
decode worker with the prefill worker's address and the remaining deadline → stream tokens
back as text deltas, cutting at stop strings. Cancelling the client's call cancels the
decode call, which frees every block on both workers.
"""

from __future__ import annotations

import logging
import random
import uuid

import grpc

from common.grpc_errors import abort_invalid, check_parsed
from common.pb.tandem.v1 import decode_pb2, decode_pb2_grpc, discovery_pb2, sampling_pb2
from common.pb.tandem.v1 import frontend_pb2 as pb
from common.pb.tandem.v1 import frontend_pb2_grpc as pb_grpc
from common.tokenizer import IncrementalDetokenizer, TextTokenizer
from common.validation import InvalidArgument, sampling_from_proto, sampling_to_proto, validate_token_ids
from router.policy import LeastLoaded
from router.stop_strings import StopMatcher
from router.workers import WorkerSet

log = logging.getLogger(__name__)


class FrontendServicer(pb_grpc.FrontendServiceServicer):
    def __init__(self, workers: WorkerSet, tokenizer: TextTokenizer, vocab_size: int, context_length: int) -> None:
        self.workers = workers
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_length = context_length
        # One policy per role: each rotates its own ties.
        self.decode_policy = LeastLoaded()
        self.prefill_policy = LeastLoaded()

    def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        check_parsed(request)
        if request.model and request.model != self.workers.model:
            raise LookupError(f"model: unknown model {request.model!r}; this router serves {self.workers.model!r}")
        if request.text and request.token_ids:
            raise InvalidArgument("text", "set exactly one of text and token_ids, not both")
        if request.text:
            tokens = self.tokenizer.encode(request.text)
            if not tokens:
                raise InvalidArgument("text", "prompt is empty")
            return tokens
        if not request.token_ids:
            raise InvalidArgument("text", "prompt is empty (set text or token_ids)")
        validate_token_ids(list(request.token_ids), self.vocab_size)
        return list(request.token_ids)

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.ModelInfo(
            name=self.workers.model, context_length=self.context_length, vocab_size=self.vocab_size,
            block_size=self.workers.block_size)])

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            tokens = self._prompt(request)
            params = sampling_from_proto(request.sampling, len(tokens), self.context_length,
                                         default_seed=random.getrandbits(63))
        except InvalidArgument as exc:
            await abort_invalid(context, exc)
        except LookupError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        request_id = request.request_id or uuid.uuid4().hex
        decode = self.decode_policy.choose(self.workers.candidates(discovery_pb2.ROLE_DECODE), self.workers.in_flight)
        if decode is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")
        prefill = self.prefill_policy.choose(self.workers.candidates(discovery_pb2.ROLE_PREFILL), self.workers.in_flight)
        log.debug("request %s: decode=%s prefill=%s", request_id, decode.instance_id,
                  prefill.instance_id if prefill else "local")
        chosen = [decode] + ([prefill] if prefill else [])
        for inst in chosen:
            self.workers.in_flight[inst.instance_id] += 1
        call = decode_pb2_grpc.DecodeServiceStub(self.workers.channel(decode)).Generate(
            decode_pb2.DecodeRequest(request_id=request_id, token_ids=tokens, sampling=sampling_to_proto(params),
                                     prefill_address=prefill.address if prefill else ""),
            timeout=context.time_remaining())
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopMatcher(params.stop)
        completion = cached = 0
        try:
            async for msg in call:
                if prefill is not None and completion == 0 and msg.token_ids:
                    self.workers.in_flight[prefill.instance_id] -= 1  # prefill is done
                    chosen.remove(prefill)
                cached = cached or msg.cached_tokens
                completion += len(msg.token_ids)
                text, stopped = stops.feed(detok.push(list(msg.token_ids), final=bool(msg.finish_reason)))
                reason = sampling_pb2.FINISH_REASON_STOP if stopped else msg.finish_reason
                out = pb.GenerateResponse(request_id=request_id, token_ids=msg.token_ids, text=text,
                                          logprobs=msg.logprobs, finish_reason=reason)
                if reason:
                    if not stopped:
                        out.text += stops.flush()
                    out.usage.CopyFrom(pb.Usage(prompt_tokens=len(tokens), completion_tokens=completion,
                                                cached_tokens=cached))
                    yield out
                    return
                yield out
        except grpc.aio.AioRpcError as exc:
            log.info("request %s: decode worker %s answered %s: %s", request_id, decode.instance_id,
                     exc.code().name, exc.details())
            await context.abort(exc.code(), exc.details() or "decode worker failed")
        finally:
            call.cancel()
            for inst in chosen:
                self.workers.in_flight[inst.instance_id] -= 1
