"""FrontendService: the client-facing API (docs/architecture.md, "The path of one request").

Generate: validate → tokenize → route (router/placement.py: decode worker, and prefill worker
or local prefill) → call the decode worker with the prefill worker's address and the remaining
deadline → stream tokens back as text deltas, cutting at stop strings. Cancelling the
client's call cancels the decode call, which frees every block on both workers.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections import deque
from dataclasses import replace

import grpc

from common import logs, tracing
from common.grpc_errors import abort_invalid, check_parsed
from common.pb.tandem.v1 import decode_pb2, discovery_pb2, sampling_pb2
from common.pb.tandem.v1 import frontend_pb2 as pb
from common.pb.tandem.v1 import frontend_pb2_grpc as pb_grpc
from common.tokenizer import IncrementalDetokenizer, TextTokenizer
from common.sampling_params import SamplingParams
from common.validation import (InvalidArgument, refuse_under_speculation, sampling_from_proto, sampling_to_proto,
                               validate_prompt_length, validate_request_id, validate_token_ids)
from router.api_keys import cache_salt
from router.decision import RouteDecision
from router.decode_session import DecodeSessions
from router.inflight import CallReader, OpenCalls, WorkerLost
from router.speculation import decode_serves, speculative_sampling
from router.stall import StallRule
from router.load import LoadTracker
from router.metrics import RouterMetrics
from router.placement import NoWorker, Placement
from router.stop_strings import StopMatcher, feed_tokens
from router.workers import WorkerSet

log = logging.getLogger(__name__)
# Decode failures that are the worker's, not the request's: retry or migrate. (A deadline
# or a client error would fail the same way anywhere.)
MIGRATABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})


def route_span_attributes(d: RouteDecision, attempt: int) -> dict:
    """The `tandem.route` span's attributes: the decision's inputs (every candidate's overlap,
    load and cost, as parallel arrays) and its choice."""
    c = d.candidates
    return {
        "tandem.route.mode": d.mode, "tandem.route.attempt": attempt, "tandem.prompt_tokens": d.prompt_tokens,
        "tandem.route.prompt_blocks": d.prompt_blocks, "tandem.route.decision_seconds": d.seconds,
        "tandem.route.candidates.instance_id": [x.instance_id for x in c],
        "tandem.route.candidates.role": [x.role for x in c],
        "tandem.route.candidates.overlap_blocks": [x.overlap_blocks for x in c],
        "tandem.route.candidates.load": [float(x.load) for x in c],
        "tandem.route.candidates.cost": [float(x.cost) for x in c],
        "tandem.route.candidates.queued_blocks": [float(x.queued_blocks) for x in c],
        "tandem.route.candidates.shared_blocks": [x.shared_blocks for x in c],
        "tandem.route.prefill_weight": d.prefill_weight,
        "tandem.route.decode_instance": d.decode.instance_id,
        "tandem.route.prefill_instance": d.prefill.instance_id if d.prefill else "",
        "tandem.route.local_prefill": d.prefill is None,
        "tandem.route.local_prefill_reason": d.local_prefill_reason,
    }


def decision_to_proto(d: RouteDecision) -> pb.ExplainRouteResponse:
    chosen = {d.decode.instance_id} | ({d.prefill.instance_id} if d.prefill else set())
    return pb.ExplainRouteResponse(
        mode=d.mode, prompt_tokens=d.prompt_tokens, prompt_blocks=d.prompt_blocks,
        candidates=[pb.RouteCandidate(instance_id=c.instance_id, role=c.role, overlap_blocks=c.overlap_blocks,
                                      load=c.load, cost=c.cost, chosen=c.instance_id in chosen,
                                      queued_blocks=c.queued_blocks, shared_blocks=c.shared_blocks)
                    for c in d.candidates],
        decode_instance_id=d.decode.instance_id, prefill_instance_id=d.prefill.instance_id if d.prefill else "",
        local_prefill_reason=d.local_prefill_reason, decision_seconds=d.seconds, text=d.explain(),
        prefill_weight=d.prefill_weight)


class FrontendServicer(pb_grpc.FrontendServiceServicer):
    def __init__(self, workers: WorkerSet, placement: Placement, load: LoadTracker, tokenizer: TextTokenizer,
                 vocab_size: int, context_length: int, on_routed=None, metrics: RouterMetrics | None = None) -> None:
        self.workers = workers
        self.placement = placement
        self.load = load
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.http_url = ""  # the HTTP API's base URL where clients reach it (router.main sets it; ListModels)
        self.context_length = context_length
        self.on_routed = on_routed  # approx mode: remember the routed blocks
        self.migration_limit = 3  # decode failures one request may survive (retries and migrations)
        self.default_deadline_s = 600.0  # deadline of a client call that sets none (router → worker calls)
        self.stall = StallRule(0.0, 0.0)  # how long a running stream may be silent (router/stall.py; off here)
        self.open_calls = OpenCalls()  # decode calls in flight, by worker: evicted when it fails
        self.sessions = DecodeSessions()  # one Session stream per decode worker channel (decode_session.py)
        self.migrations = 0  # counter: requests continued on another decode worker mid-stream
        self.retries = 0  # counter: decode calls retried on another worker before any token
        self.running = 0  # Generate calls in progress
        self._idle = asyncio.Event()  # set while running == 0 (the drain waits on it)
        self._idle.set()
        self.draining = False  # set on SIGTERM (router/main.py drain): new Generate calls get UNAVAILABLE
        self.metrics = metrics or RouterMetrics()
        self.cluster_status = None  # async (request, context) -> ClusterStatusResponse, set by router/main.py
        tokenizer.max_token_bytes  # computed once here, not on the first request
        # Per-request router overhead (validation, tokenization, hashing, lookup, scoring, up to
        # issuing the decode call) in seconds, for the last 100,000 requests: wall time, and the
        # router thread's CPU time (robust to other processes competing for the cores).
        self.overhead_s: deque[float] = deque(maxlen=100_000)
        self.overhead_cpu_s: deque[float] = deque(maxlen=100_000)
        self.decision_s: deque[float] = deque(maxlen=100_000)  # hash + index lookup + scoring only
        self.decision_cpu_s: deque[float] = deque(maxlen=100_000)  # its CPU time (no waiting for a core)
        self.decision_hash_s: deque[float] = deque(maxlen=100_000)  # of which hashing the prompt's blocks

    def overhead_summary(self) -> str:
        if not self.overhead_s:
            return "router overhead: no requests"
        def stats(samples) -> str:
            xs = sorted(samples)
            pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6  # noqa: E731
            return f"mean_us={sum(xs) / len(xs) * 1e6:.0f} p50_us={pick(0.5):.0f} p99_us={pick(0.99):.0f}"

        return (f"router overhead: n={len(self.overhead_s)} decision (hash, look up, score) "
                f"{stats(self.decision_s)} (hashing {stats(self.decision_hash_s)}; look up and score "
                f"{stats(d - h for d, h in zip(self.decision_s, self.decision_hash_s))}; cpu {stats(self.decision_cpu_s)}); whole request up to the decode call: wall {stats(self.overhead_s)}, "
                f"cpu {stats(self.overhead_cpu_s)}")

    def _prompt(self, request: pb.GenerateRequest) -> list[int]:
        """Checks that need no tokenizing; returns the token ids (empty for a text prompt)."""
        check_parsed(request)
        if request.model and request.model != self.workers.model:
            raise LookupError(f"model: unknown model {request.model!r}; this router serves {self.workers.model!r}")
        if request.text and request.token_ids:
            raise InvalidArgument("text", "set exactly one of text and token_ids, not both")
        if request.text:
            return []
        if not request.token_ids:
            raise InvalidArgument("text", "prompt is empty (set text or token_ids)")
        validate_token_ids(list(request.token_ids), self.vocab_size)
        validate_prompt_length(len(request.token_ids), self.context_length, "token_ids")
        return list(request.token_ids)

    async def _tokenize(self, request: pb.GenerateRequest) -> list[int]:
        """Text prompts are bounded before tokenizing (a token covers at most
        max_token_bytes bytes, so longer text cannot fit the context), and long ones are
        tokenized off the event loop so other streams keep flowing."""
        text = request.text
        limit = self.context_length * self.tokenizer.max_token_bytes
        if len(text) > limit or len(text.encode()) > limit:
            raise InvalidArgument("text", f"prompt text of {len(text.encode())} bytes cannot fit the context "
                                          f"length of {self.context_length} tokens")
        tokens = self.tokenizer.encode(text) if len(text) < 4096 else await asyncio.to_thread(self.tokenizer.encode, text)
        if not tokens:
            raise InvalidArgument("text", "prompt is empty")
        validate_prompt_length(len(tokens), self.context_length, "text")
        return tokens

    async def _validated(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        try:
            tokens = self._prompt(request)  # first: an unparsable request is named by its field
            validate_request_id(request.request_id)
            if request.text:
                tokens = await self._tokenize(request)
            params = sampling_from_proto(request.sampling, len(tokens), self.context_length, self.vocab_size,
                                         default_seed=random.getrandbits(63))
        except InvalidArgument as exc:
            await abort_invalid(context, exc)
        except LookupError as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        return tokens, params

    async def _route(self, tokens: list[int], context: grpc.aio.ServicerContext,
                     exclude: frozenset[str] = frozenset(),
                     params: SamplingParams | None = None) -> tuple[RouteDecision, list[int]]:
        """Placement.route for the caller's tenant; UNAVAILABLE where no decode worker is left
        (saying, with params, which excluded workers do not serve a field it sets and why)."""
        try:  # the caller's tenant (router/api_keys.py): its own prefix cache only
            return self.placement.route(tokens, exclude, cache_salt())
        except NoWorker as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc) + self._unserved_note(params, exclude))
            raise

    def _unserved_note(self, params: SamplingParams | None, exclude: frozenset[str]) -> str:
        """'; <field>: <worker> runs speculative decoding (MTP), which ...' for the first excluded
        decode worker that does not serve a field params sets ('' where none): why a worker
        that is up was not used."""
        for iid in sorted(exclude) if params is not None and params.speculation_needs else ():
            inst = self.workers.instance(iid)
            if inst is None or decode_serves(inst, params.speculation_needs):
                continue
            try:
                refuse_under_speculation(params, f"{iid} runs", speculative_sampling(inst))
            except InvalidArgument as exc:
                return f"; {exc}, or retry once a decode worker that serves it is up"
        return ""

    @staticmethod
    def _attempt_span(attempt: int, failed: tuple[str, str] | None, generated: int):
        """Attempts after the first run inside a `tandem.migration` span (a retry when no token
        was generated yet); the first one needs none."""
        if attempt == 0:
            return tracing.NO_SPAN_CM
        return tracing.span("tandem.migration", {
            "tandem.migration.attempt": attempt, "tandem.migration.kind": "migration" if generated else "retry",
            "tandem.migration.from_instance": failed[0] if failed else "",
            "tandem.migration.reason": failed[1] if failed else "", "tandem.migration.tokens_generated": generated})

    async def _traced_route(self, tokens: list[int], context: grpc.aio.ServicerContext, attempt: int,
                            exclude: frozenset[str], params: SamplingParams) -> tuple[RouteDecision, list[int]]:
        """_route inside a `tandem.route` span carrying the decision's inputs and choice."""
        with tracing.span("tandem.route") as span:
            decision, hashes = await self._route(tokens, context, exclude, params)
            if span.is_recording():
                span.set_attributes(route_span_attributes(decision, attempt))
        self.metrics.observe_decision(decision)
        return decision, hashes

    async def ListModels(self, request: pb.ListModelsRequest, context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.ModelInfo(
            name=self.workers.model, context_length=self.context_length, vocab_size=self.vocab_size,
            block_size=self.workers.block_size, http_url=self.http_url)])

    async def ExplainRoute(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.ExplainRouteResponse:
        tokens, params = await self._validated(request, context)
        decision, _ = await self._route(tokens, context, await self._unfit_decoders(params, context), params)
        return decision_to_proto(decision)

    async def ClusterStatus(self, request: pb.ClusterStatusRequest,
                            context: grpc.aio.ServicerContext) -> pb.ClusterStatusResponse:
        return await self.cluster_status(request, context)

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):
        """Generate with its metrics: TTFT, inter-token latency, duration, outcome and status
        code; the request id is on every log line and on the RPC's span."""
        # getattr: an unparsable request (common/lenient_parse.py) is answered by _validated.
        request_id = getattr(request, "request_id", "") or uuid.uuid4().hex
        logs.request_id.set(request_id)  # this RPC's task only
        if self.draining:  # before counting it: the drain waits only for the calls it let in
            await context.abort(grpc.StatusCode.UNAVAILABLE, "router is draining (shutting down); "
                                "send the request to another router")
        timer = self.metrics.request_timer()
        outcome, code = "error", grpc.StatusCode.UNKNOWN
        self.running += 1
        self._idle.clear()
        try:
            async for out in self._generate(request, context, request_id):
                timer.tokens(len(out.token_ids))
                if out.finish_reason:
                    outcome = sampling_pb2.FinishReason.Name(out.finish_reason).removeprefix("FINISH_REASON_").lower()
                    span = tracing.current_span()
                    if span.is_recording():
                        span.set_attributes({"tandem.request_id": request_id, "tandem.finish_reason": outcome,
                                             "tandem.prompt_tokens": out.usage.prompt_tokens,
                                             "tandem.completion_tokens": out.usage.completion_tokens,
                                             "tandem.cached_tokens": out.usage.cached_tokens})
                yield out
            code = grpc.StatusCode.OK
        except (asyncio.CancelledError, GeneratorExit):
            remaining = context.time_remaining()
            outcome = "cancelled"
            code = grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else \
                grpc.StatusCode.CANCELLED
            raise
        except BaseException:
            code = context.code() or grpc.StatusCode.UNKNOWN  # set by context.abort
            raise
        finally:
            self.running -= 1
            if self.running == 0:
                self._idle.set()
            timer.done(outcome, code.name)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no Generate call is in progress; False if timeout_s passed first."""
        from common.lifecycle import wait_set
        return await wait_set(self._idle, timeout_s)

    async def _generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext, request_id: str):
        arrived, arrived_cpu = time.perf_counter(), time.thread_time()
        tokens, params = await self._validated(request, context)
        detok = IncrementalDetokenizer(self.tokenizer)
        stops = StopMatcher(params.stop)
        generated: list[int] = []
        cached = 0
        # Retry and migration (docs/operations.md): when the decode worker fails (refuses the
        # call, dies mid-stream, drains), it is set aside and the request continues on another
        # one with prompt + tokens generated so far; sampling resumes at the same step, so the
        # client sees one uninterrupted stream with exactly the tokens a fault-free run gives.
        failed: tuple[str, str] | None = None  # (decode instance id, status code) of the last failure
        # Every router → worker call carries a deadline: the client's, or default_deadline_s from arrival.
        remaining = context.time_remaining()
        deadline = time.monotonic() + (remaining if remaining is not None else self.default_deadline_s)
        refused_by: set[str] = set()  # decode workers whose pool cannot hold this request
        for attempt in range(1 + self.migration_limit):
            with self._attempt_span(attempt, failed, len(generated)):
                unfit = await self._unfit_decoders(params, context, refuse=attempt == 0)
                decision, hashes = await self._traced_route(tokens + generated, context, attempt,
                                                            frozenset(refused_by) | unfit, params)
                self.decision_s.append(decision.seconds)
                self.decision_cpu_s.append(decision.cpu_seconds)
                self.decision_hash_s.append(decision.hash_seconds)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("request %s routed:\n%s", request_id, decision.explain())
                if self.on_routed is not None:
                    self.on_routed(decision, hashes)
                prefill = decision.prefill
                prompt_now = tokens + generated
                load = self.load.start(decision.decode.instance_id, prefill.instance_id if prefill else None,
                                       len(prompt_now), decision.uncached_tokens(self.workers.block_size), hashes,
                                       local_prefill=prefill is None)
                sampling = sampling_to_proto(replace(params, max_tokens=params.max_tokens - len(generated)))
                worker = decision.decode.instance_id
                try:
                    ch = self.workers.channel_to(worker, decision.decode.address)
                except LookupError as exc:  # left discovery since it was chosen: like a refused call
                    ch, lookup_error = None, str(exc)
                # on the worker's session: its tokens come batched with its other requests' (decode_session.py)
                call = None if ch is None else self.sessions.start(ch, decode_pb2.DecodeRequest(
                    request_id=f"{request_id}.{attempt}" if attempt else request_id,
                    token_ids=prompt_now, sampling=sampling, prefill_address=prefill.address if prefill else "",
                    sampling_step_offset=len(generated), cache_salt=cache_salt()),
                    timeout_s=max(0.0, deadline - time.monotonic()))
                if attempt == 0:
                    self.overhead_s.append(time.perf_counter() - arrived)
                    self.overhead_cpu_s.append(time.thread_time() - arrived_cpu)
                streamed = len(generated)
                last_at = 0.0  # when this call's previous message arrived (ITL samples for the stall rule)
                with self.open_calls.open(worker, params.speculation_needs) as lost:
                    reader = None
                    try:
                        if call is None:
                            raise WorkerLost(worker, lookup_error)
                        reader = CallReader(call, lost, worker)
                        while True:
                            # The stall bound starts once the stream runs (before its first token the
                            # worker may be prefilling a long prompt; health covers that stretch).
                            msg = await reader.next(self.stall.timeout_s(worker) if len(generated) > streamed else None)
                            if msg is grpc.aio.EOF:
                                break
                            now = time.monotonic()
                            if len(generated) > streamed:
                                self.stall.observe(worker, now - last_at, len(msg.token_ids))
                            last_at = now
                            if msg.token_ids and len(generated) == streamed:
                                self.load.prefill_finished(load)
                            self.load.grow(load, len(generated) - streamed, len(generated) - streamed + len(msg.token_ids))
                            cached = cached or msg.cached_tokens
                            text, stopped, used = feed_tokens(stops, detok, list(msg.token_ids),
                                                              bool(msg.finish_reason))
                            generated.extend(msg.token_ids[:used])  # nothing past a stop string
                            reason = sampling_pb2.FINISH_REASON_STOP if stopped else msg.finish_reason
                            out = pb.GenerateResponse(request_id=request_id, token_ids=msg.token_ids[:used], text=text,
                                                      logprobs=msg.logprobs[:used], finish_reason=reason,
                                                      top_logprobs=msg.top_logprobs[:used])
                            if reason:
                                self.load.request_finished(len(generated))
                                if not stopped:
                                    out.text += stops.flush()
                                out.usage.CopyFrom(pb.Usage(prompt_tokens=len(tokens), completion_tokens=len(generated),
                                                            cached_tokens=cached))
                                yield out
                                return
                            yield out
                        return
                    except WorkerLost as exc:
                        log.warning("request %s: taken from decode worker %s after %d tokens: %s", request_id, worker,
                                    len(generated), exc.reason)
                        if attempt < self.migration_limit:
                            self.workers.set_aside(worker)
                            failed = (worker, "WORKER_LOST")
                            self._count_move(request_id, generated)
                            continue
                        await context.abort(grpc.StatusCode.UNAVAILABLE, f"decode worker {worker} failed ({exc.reason}) "
                                            f"and --migration-limit {self.migration_limit} is reached")
                    except grpc.aio.AioRpcError as exc:
                        log.info("request %s: decode worker %s answered %s: %s", request_id, decision.decode.instance_id,
                                 exc.code().name, exc.details())
                        if (exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and not generated
                                and attempt < self.migration_limit and self._larger_pool(worker, refused_by)):
                            refused_by.add(worker)  # this request only: the worker stays in rotation
                            failed = (worker, exc.code().name)
                            continue
                        if exc.code() in MIGRATABLE and attempt < self.migration_limit:
                            self.workers.set_aside(decision.decode.instance_id)
                            failed = (decision.decode.instance_id, exc.code().name)
                            self._count_move(request_id, generated)
                            continue
                        await context.abort(exc.code(), exc.details() or "decode worker failed")
                    finally:
                        if reader is not None:
                            reader.close()
                        if call is not None:
                            call.cancel()
                        self.load.finish(load)

    def _count_move(self, request_id: str, generated: list[int]) -> None:
        if generated:
            self.migrations += 1
            log.info("request %s: migrating after %d tokens", request_id, len(generated))
        else:
            self.retries += 1

    async def _unfit_decoders(self, params: SamplingParams, context: grpc.aio.ServicerContext,
                              refuse: bool = True) -> frozenset[str]:
        """The decode workers not to place params on: those running MTP speculative decoding
        that do not serve a field it sets (`decode_serves`: penalties, and from an MTP worker of
        an earlier release top log-probabilities and logit biases too), which they refuse:
        INVALID_ARGUMENT naming the field when every decode worker in discovery would, draining
        or set aside ones included (a fit one that is only unavailable for now leaves routing to
        answer UNAVAILABLE, which clients retry). refuse False (a retry or migration: tokens may
        have gone out already): never INVALID_ARGUMENT, routing answers UNAVAILABLE where no
        worker fits."""
        needs = params.speculation_needs
        if not needs:
            return frozenset()
        known = self.workers.candidates(discovery_pb2.ROLE_DECODE, serving_only=False)
        unfit = frozenset(d.instance_id for d in known if not decode_serves(d, needs))
        if refuse and known and len(unfit) == len(known):
            # name a field no decode worker serves where there is one (else the request would come
            # back for the next); workers that each lack another field: the first one's
            served = {n for d in known for n in speculative_sampling(d)}
            if all(n in served for n in needs):
                served = set(speculative_sampling(min(known, key=lambda d: d.instance_id)))
            try:
                refuse_under_speculation(params, "every decode worker here runs", tuple(served))
            except InvalidArgument as exc:
                await abort_invalid(context, exc)
        return unfit

    def _larger_pool(self, worker: str, refused_by: set[str]) -> bool:
        """Whether a decode worker other than those that refused has a larger KV pool than `worker`."""
        inst = self.workers.instance(worker)
        have = inst.kv_capacity_blocks if inst is not None else 0
        return any(c.kv_capacity_blocks > have for c in self.workers.candidates(discovery_pb2.ROLE_DECODE)
                   if c.instance_id != worker and c.instance_id not in refused_by)

    def evict_worker(self, instance_id: str, reason: str, only_placeable: bool = False) -> None:
        """Take every open call away from a failed decode worker: each request migrates (with
        only_placeable, not those that no other healthy decode worker serves: an MTP one that
        does not serve a sampling field they set)."""
        keep = (lambda needs: not self._other_decode(instance_id, needs)) if only_placeable else None
        n = self.open_calls.evict(instance_id, reason, keep)
        if n:
            log.warning("decode worker %s %s: moving its %d open calls to other workers", instance_id, reason, n)

    def worker_unhealthy(self, instance_id: str, reason: str) -> None:
        """Health probes found a worker failed (router/health.py `on_unhealthy`): its open calls
        move to other decode workers, unless none is healthy now. Then they stay on it, since
        taking them would only fail them: a draining worker (NOT_SERVING) streams them on to the
        end of its drain; a stopped process's streams break when its connection's keepalive
        (--keepalive-time + --keepalive-timeout) or its lease gives up, a hung engine's by the
        stall rule once they have a first token, else at their deadline. They move as soon as
        another decode worker is healthy (`move_stranded`), or migrate when they break."""
        n = self.open_calls.count(instance_id)
        if n and not self._other_decode(instance_id):
            log.warning("decode worker %s %s, but no other decode worker is healthy: its %d open calls stay on it",
                        instance_id, reason, n)
            return
        # a call asking for what the healthy MTP workers do not serve stays while no other worker serves it
        self.evict_worker(instance_id, reason, only_placeable=True)

    def _other_decode(self, instance_id: str, needs: tuple[str, ...] = ()) -> bool:
        """Whether a decode worker other than this one is healthy (and serves `needs`:
        SamplingParams.speculation_needs)."""
        return any(c.instance_id != instance_id and decode_serves(c, needs)
                   for c in self.workers.candidates(discovery_pb2.ROLE_DECODE))

    def move_stranded(self, _changed: str = "") -> None:
        """Move the calls that stayed on an unhealthy decode worker (`worker_unhealthy`) once
        another decode worker is healthy: after a discovery change or a worker's recovery."""
        health = self.workers.health
        if health is None:
            return
        for wid in self.open_calls.workers():
            if not health.healthy(wid) and self._other_decode(wid):
                self.evict_worker(wid, "unhealthy (another decode worker is healthy now)", only_placeable=True)

    def on_membership(self) -> None:
        """After a discovery change: evict the calls of workers that left, then close their channels."""
        present = set(self.workers.instance_ids())
        self.stall.forget_except(present)
        for wid in self.open_calls.workers():
            if wid not in present:
                self.evict_worker(wid, "left discovery")
        self.move_stranded()
        self.workers.prune()
