"""The OpenAI-compatible HTTP API of the router (`--http-port`), beside its gRPC API.

Routes: POST /v1/completions, POST /v1/chat/completions (JSON, or server-sent events ending
with `data: [DONE]` when `stream` is true), GET /v1/models, GET /health and GET /metrics.

The seam with the gRPC API is `FrontendServicer.Generate` itself: a request is mapped onto a
`tandem.v1.GenerateRequest` (router/openai_protocol.py) and run through the same Generate —
validation, tokenization, routing, retry and migration, stop strings, metrics and spans — with
`HttpCallContext` standing in for the gRPC servicer context (the three methods Generate uses:
abort, time_remaining, code). Each choice of a request (one, unless `n` > 1 or a batch of
prompts: router/openai_protocol.py `Choice`) runs in its own task (`Generation`), inside a SERVER
span; the HTTP side reads every choice's first response (an error before them is a status),
then each task writes its later ones as server-sent events itself; the client going away
cancels the tasks (`ConnectionWatch`), which cancels the decode calls and frees the request's KV
blocks on both workers.

With --api-keys, the completions and models routes need `Authorization: Bearer <key>` (401
with OpenAI's error object when it is missing or unknown) and /metrics an admin key (403 for
another); /health stays open for probes. The key's tenant is set for the request's Generate
(router/api_keys.py), so it gets that tenant's prefix cache only.

uvicorn's server runs on the router's own event loop (`HttpServer`), on a socket bound here so
that a taken port is an OSError naming --http-port.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import ssl
import time
import uuid
from collections import deque
from typing import Any, Awaitable, Callable

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from common import tracing
from common.pb.tandem.v1 import discovery_pb2
from common.pb.tandem.v1 import frontend_pb2 as pb
from common.pb.tandem.v1 import sampling_pb2
from common.validation import InvalidArgument, validate_request_id
from router.http_front import Front, error_response, validation_error
from router.http_port import HTTP_OFF, validate_port  # noqa: F401 (re-exported)
from router.http_port import PlainHttpLog, load_certificate, watch_handshakes
from router.http_port import url as http_url
from router.api_keys import KeyRefused, KeyRing, current_tenant, one_authorization
from router.chat_template import ChatTemplate, TemplateError
from router.openai_protocol import (FINISH_REASONS, ChatCompletionRequest, Choice, CompletionRequest,
                                    ResponseShape, Token, error_body, in_own_words, param_name, text_offsets,
                                    token_logprobs, usage)

log = logging.getLogger(__name__)
HTTP_PARSER = "httptools"  # uvicorn's C parser (llhttp); its pure-Python h11 costs more CPU per request

# gRPC status → (HTTP status, OpenAI error type). Anything else is a bug: 500.
STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
}


class HttpTimings:
    """Wall time the HTTP layer adds around FrontendServicer.Generate, for the last 100,000
    requests of one choice (a request of several holds each choice's responses until every
    choice has its first one: that wait is not the HTTP layer's): `before` from the request's
    arrival (uvicorn hands it over) to Generate's start (parsing, validation, chat template, the
    request's task); `first` and `token` from a GenerateResponse leaving Generate to its
    server-sent event written to the socket (the event's JSON and uvicorn's write), for the first
    response and for each later one."""

    def __init__(self) -> None:
        self.before_s: deque[float] = deque(maxlen=100_000)
        self.first_s: deque[float] = deque(maxlen=100_000)
        self.token_s: deque[float] = deque(maxlen=100_000)

    def summary(self) -> str:
        def stats(xs: deque[float]) -> str:
            if not xs:
                return "n=0"
            s = sorted(xs)
            return f"n={len(s)} p50_us={s[len(s) // 2] * 1e6:.0f} p99_us={s[min(len(s) - 1, int(0.99 * len(s)))] * 1e6:.0f}"
        return (f"http layer: before Generate {stats(self.before_s)}; first event {stats(self.first_s)}; "
                f"later events {stats(self.token_s)}")


class Aborted(Exception):
    """Generate ended the call with a gRPC status (context.abort)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class HttpCallContext:
    """What FrontendServicer.Generate needs of a grpc.aio.ServicerContext, for an HTTP call:
    `abort` raises Aborted (as grpc.aio's raises to end the RPC), there is no deadline."""

    def __init__(self) -> None:
        self._code: grpc.StatusCode | None = None

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code = code
        raise Aborted(code, details)

    def time_remaining(self) -> float | None:
        return None

    def code(self) -> grpc.StatusCode | None:
        return self._code


class ClientGone(Exception):
    """The client closed the connection before the response was ready."""


class ChoiceFailed(Exception):
    """A choice's call ended with an error status (`error`) while its answer was collected."""

    def __init__(self, choice: Choice, error: Aborted) -> None:
        super().__init__(str(error))
        self.choice, self.error = choice, error


TRANSPORT_POLL_S = 0.25  # how often a request checks that its connection is still open (ConnectionWatch)
_GONE = object()  # Generation's last item when its task was cancelled (the client went away)


class Generation:
    """One Generate call (one choice of a request) in its own task (so that its spans nest and it
    can be cancelled from the HTTP side whatever that is doing). Its items — (response,
    perf_counter() when it left Generate), then None at the end or an Aborted — go to a queue
    that `next()` reads, until `stream_to(sink)`: from then on the task hands each item to the
    sink itself, with no queue and no second task in between (one event per streamed token).
    Cancelling the task (`cancel`, or the request's ConnectionWatch) cancels the decode call and
    frees its KV blocks on both workers; a reader waiting in `next()` then gets ClientGone."""

    def __init__(self, servicer: Any, request: pb.GenerateRequest, span_name: str, headers: dict[str, str]) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._sink: Callable[[Any], Awaitable[None]] | None = None
        self.started = 0.0  # perf_counter() when Generate was called
        self.last_put = 0.0  # perf_counter() when the response last returned by next() left Generate
        self.task = asyncio.create_task(self._run(servicer, request, span_name, headers),
                                        name=f"http {request.request_id}")
        # cancelled (also before its first step, when _run could not see it): a reader in
        # next() must not wait for ever
        self.task.add_done_callback(lambda t: t.cancelled() and self._queue.put_nowait(_GONE))

    async def _deliver(self, item: Any) -> None:
        if self._sink is not None:
            await self._sink(item)
        else:
            self._queue.put_nowait(item)

    async def _run(self, servicer: Any, request: pb.GenerateRequest, span_name: str, headers: dict[str, str]) -> None:
        self.started = time.perf_counter()
        try:
            with tracing.server_span(span_name, headers, {"http.route": span_name.split(" ", 1)[1],
                                                          "tandem.request_id": request.request_id}):
                async for out in servicer.Generate(request, HttpCallContext()):
                    await self._deliver((out, time.perf_counter()))
            end: Any = None
        except Aborted as exc:
            end = exc
        except Exception as exc:  # a bug: the client gets a 500 with its repr, the log the traceback
            log.exception("request %s failed", request.request_id)
            end = Aborted(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")
        await self._deliver(end)

    async def next(self) -> pb.GenerateResponse | None:
        """The next response; None after the last one.

        Raises:
            Aborted: the call ended with an error status.
            ClientGone: the call was cancelled (the client disconnected).
        """
        item = await self._queue.get()
        if isinstance(item, Aborted):
            raise item
        if item is _GONE:
            raise ClientGone
        if item is None:
            return None
        out, self.last_put = item
        return out

    async def stream_to(self, sink: Callable[[Any], Awaitable[None]]) -> None:
        """Hand every item not read yet to `sink` (those queued first, in order), then return
        when the call's task has ended, also when it was cancelled (the client went away)."""
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is _GONE:
                return
            await sink(item)
        self._sink = sink  # the queue is empty and nothing awaited since: no item can slip between
        try:
            await asyncio.shield(self.task)  # a cancelled response leaves the task to its own cancel
        except asyncio.CancelledError:
            if not self.task.cancelled() or asyncio.current_task().cancelling():
                raise  # this coroutine itself was cancelled, not only the call

    def cancel(self) -> None:
        self.task.cancel()


async def _first(gen: Generation) -> pb.GenerateResponse | None | Aborted | ClientGone:
    """The Generation's first response (None: it ended without one), or the error next() raised."""
    try:
        return await gen.next()
    except (Aborted, ClientGone) as exc:
        return exc


async def _firsts(gens: list[Generation]
                  ) -> tuple[list[pb.GenerateResponse | None], tuple[int, Aborted | ClientGone] | None]:
    """(every Generation's first response in order, None), or, as soon as one of them fails,
    ([], (its index, its error)) without waiting for the others' first tokens (a choice queued
    behind its own request's others would otherwise hold the error back until they finish)."""
    if len(gens) == 1:  # the usual request: no task
        first = await _first(gens[0])
        return ([], (0, first)) if isinstance(first, (Aborted, ClientGone)) else ([first], None)
    tasks = {asyncio.ensure_future(_first(g)): i for i, g in enumerate(gens)}
    firsts: list[pb.GenerateResponse | None] = [None] * len(gens)
    pending = set(tasks)
    try:
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            failed = [(tasks[t], t.result()) for t in done if isinstance(t.result(), (Aborted, ClientGone))]
            if failed:
                return [], min(failed, key=lambda f: f[0])
            for t in done:
                firsts[tasks[t]] = t.result()
        return firsts, None
    finally:
        for t in pending:
            t.cancel()


def _template_param(messages: list, said: str) -> str:
    """The parameter a chat template's refusal is about: `messages[i].role` where it ends by
    naming a role it got ("... got tool", as templates that raise on a role say) and message i
    is the first of that role, else `messages`."""
    got = said.rsplit("got ", 1)[-1].strip().strip("'\".") if "got " in said else ""
    i = next((i for i, m in enumerate(messages) if got and m.role == got), None)
    return f"messages[{i}].role" if i is not None else "messages"


class ConnectionWatch:
    """A request's one disconnect watch: cancels every Generation of the request once ASGI
    `receive` says the client disconnected, or once `transport` (the connection, when the
    server exposes it) is closing. uvicorn also answers `http.disconnect` once the response is
    complete; by then the calls have ended and the cancel does nothing. The transport is polled
    because uvicorn tells a disconnect only to the connection's last request: a client that
    pipelined a second request and went away would otherwise leave this one running to its
    max_tokens. One watch per request, however many choices: ASGI's `receive` has one reader."""

    def __init__(self, gens: list[Generation], receive: Callable[[], Awaitable[dict]],
                 transport: asyncio.BaseTransport | None = None) -> None:
        self.gens = gens
        self._timer: asyncio.TimerHandle | None = None

        async def until_gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self._cancel_calls()
        self._watch = asyncio.create_task(until_gone(), name=f"{gens[0].task.get_name()} watch")
        if transport is not None:
            self._poll(transport)

    def _cancel_calls(self) -> None:
        for g in self.gens:
            g.cancel()

    def _poll(self, transport: asyncio.BaseTransport) -> None:
        if all(g.task.done() for g in self.gens):
            return
        if transport.is_closing():
            self._cancel_calls()
            return
        self._timer = asyncio.get_running_loop().call_later(TRANSPORT_POLL_S, self._poll, transport)

    def cancel(self) -> None:
        """The response is over: stop watching, and cancel any call still running."""
        self._cancel_calls()
        self._watch.cancel()
        if self._timer is not None:
            self._timer.cancel()


_JSON = json.JSONEncoder(separators=(",", ":"))  # json.dumps with arguments builds an encoder per call
_MARK = "\x00"  # never in a response's id or model (HTTP headers and model names carry no NUL)


def _sse(obj: dict) -> bytes:
    return b"data: " + _JSON.encode(obj).encode() + b"\n\n"


class TextEvents:
    """The server-sent event of a chunk that carries only text (no finish reason, no logprobs,
    not the first): the chunk's bytes around its text are the same for every token of a
    choice, so they are encoded once and each event is prefix + the text as a JSON string +
    suffix, byte for byte what `_sse(shape.chunk(text, None, None, index=index))` gives."""

    def __init__(self, shape: ResponseShape, index: int = 0) -> None:
        whole = _sse(shape.chunk(_MARK, None, None, index=index))
        self.prefix, self.suffix = whole.split(_JSON.encode(_MARK).encode())

    def __call__(self, text: str) -> bytes:
        return self.prefix + _JSON.encode(text).encode() + self.suffix


DONE = b"data: [DONE]\n\n"


class _EventStream(Response):
    """Server-sent events of a request's Generations (one per choice), each written by its
    Generation's own task as each response leaves Generate (`Generation.stream_to`), through
    uvicorn's own send (the middlewares' send wrappers only watch for the response's start,
    which goes through them). The choices' chunks interleave as they come, each naming its
    index; once every choice has finished come the usage chunk (with include_usage) and
    `data: [DONE]`. An error of a choice after the 200 went out is one more event, then
    `[DONE]`, and the other choices are cancelled. The client leaving cancels every choice
    (ConnectionWatch), as does any other end of the response."""

    def __init__(self, api: "OpenAIFrontend", gens: list[Generation], firsts: list[pb.GenerateResponse | None],
                 choices: list[Choice], shape: ResponseShape, req: Any, headers: dict[str, str],
                 watch: ConnectionWatch) -> None:
        # no Response.__init__: its headers would carry a Content-Length (the body is chunked)
        self.status_code, self.background, self.body = 200, None, b""
        self.raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                            *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items())]
        self.api, self.gens, self.firsts, self.choices = api, gens, firsts, choices
        self.shape, self.req, self.watch = shape, req, watch
        self._closed = False  # the response's [DONE] went out
        self._usages: list[pb.Usage | None] = [None] * len(gens)  # each choice's, once finished

    def _choice_sink(self, c: Choice, event: Callable[..., Awaitable[None]]) -> Callable[[Any], Awaitable[None]]:
        """What handles the items of choice c's Generation (see Generation)."""
        text_event = TextEvents(self.shape, c.index)
        first_event, done, token_chars = True, False, 0  # token_chars: the choice's tokens' texts so far
        req, shape, api = self.req, self.shape, self.api

        async def item(it: Any) -> None:
            nonlocal first_event, done, token_chars
            if self._closed or done:
                return
            if isinstance(it, Aborted):  # after the 200 went out: the error as one more event, and the end
                self._closed = True
                body = api.aborted_body(it, req, c.prompt_index)
                if len(self.choices) > 1:  # which one (OpenAI's error object has no index of its own)
                    body["error"]["message"] = f"choice {c.index}: {body['error']['message']}"
                await event(_sse(body))
                await event(DONE)
                self.watch.cancel()  # the other choices
                return
            if it is None:  # Generate ended (after its finish, which ends the choice first)
                done = True
                await self._choice_done(c, None, event)
                return
            out, left = it
            finish = FINISH_REASONS.get(out.finish_reason)
            if out.text and not (finish or first_event or req.want_logprobs):
                await event(text_event(out.text), left, False)  # most events: text only
            elif out.text or finish or first_event or req.want_logprobs:
                lp = None
                if req.want_logprobs:
                    lp, token_chars = api._logprobs(shape.chat, out, token_chars)
                await event(_sse(shape.chunk(out.text, finish, lp, first=first_event, index=c.index)), left,
                            first_event)
                first_event = False
            if finish:
                done = True
                await self._choice_done(c, out.usage, event)
        return item

    async def _choice_done(self, c: Choice, u: pb.Usage | None, event: Callable[..., Awaitable[None]]) -> None:
        self._usages[c.index] = u if u is not None else pb.Usage()
        if self._closed or any(x is None for x in self._usages):
            return
        self._closed = True  # the last choice: the response's end
        if self.req.include_usage:
            await event(_sse(self.shape.usage_chunk(usage(self._usages, self.req.n))))
        await event(DONE)

    async def __call__(self, scope, receive, send) -> None:
        raw_send = scope.get("tandem.send", send)
        timings = self.api.timings if len(self.choices) == 1 else None  # (see HttpTimings)

        async def event(body: bytes, left_generate: float | None = None, first: bool = False) -> None:
            await raw_send({"type": "http.response.body", "body": body, "more_body": True})
            if left_generate is not None and timings is not None:
                (timings.first_s if first else timings.token_s).append(time.perf_counter() - left_generate)

        sinks = [self._choice_sink(c, event) for c in self.choices]
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            for sink, first, gen in zip(sinks, self.firsts, self.gens):
                await sink((first, gen.last_put) if first is not None else None)
            # each returns at its call's end, or once the client went away
            if len(self.gens) == 1:
                await self.gens[0].stream_to(sinks[0])
            else:
                await asyncio.gather(*(gen.stream_to(sink) for gen, sink in zip(self.gens, sinks)))
            await raw_send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.watch.cancel()


class OpenAIFrontend:
    """The routes' logic over one router's FrontendServicer."""

    def __init__(self, servicer: Any, template: ChatTemplate, registry: CollectorRegistry | None,
                 keys: KeyRing | None = None) -> None:
        self.servicer = servicer
        self.keys = keys  # None: an open front (no --api-keys)
        self.template = template
        self.registry = registry
        self.created = int(time.time())
        self._tokens_seen: dict[int, Token] = {}
        self.timings = HttpTimings()

    # -- errors ------------------------------------------------------------------------------
    @staticmethod
    def error(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
              headers: dict[str, str] | None = None) -> JSONResponse:
        return error_response(status, message, type_, param, code, headers)

    def authorize(self, request: Request, admin_only: bool = False) -> JSONResponse | None:
        """None when the request may go on (its tenant set for this task), else the 401/403."""
        if self.keys is None:
            return None
        try:
            current_tenant.set(self.keys.authenticate(one_authorization(request.headers.getlist("authorization")),
                                                      admin_only))
        except KeyRefused as exc:
            if exc.unauthenticated:
                return self.error(401, str(exc), "invalid_request_error", None, "invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
            return self.error(403, str(exc), "permission_error", None, "permission_denied")
        return None

    def invalid(self, exc: InvalidArgument, req: Any, headers: dict[str, str]) -> JSONResponse:
        param = param_name(exc.field, req)
        message = str(exc).split(": ", 1)[1] if ": " in str(exc) else str(exc)
        return self.error(400, f"{param}: {message}", "invalid_request_error", param, headers=headers)

    def aborted(self, exc: Aborted, req: Any, headers: dict[str, str], prompt_index: int | None = None
                ) -> JSONResponse:
        body = self.aborted_body(exc, req, prompt_index)
        return JSONResponse(body, status_code=STATUS.get(exc.code, (500,))[0], headers=headers)

    def aborted_body(self, exc: Aborted, req: Any, prompt_index: int | None = None) -> dict:
        """OpenAI's error object for a call that ended with a gRPC status (prompt_index: the
        batch prompt the call continued, which a parameter error names)."""
        status, type_ = STATUS.get(exc.code, (500, "internal_error"))
        field, sep, message = exc.details.partition(": ")
        if exc.code == grpc.StatusCode.INVALID_ARGUMENT and sep and " " not in field:
            param = param_name(field, req, prompt_index)
            return error_body(f"{param}: {in_own_words(message, param)}", type_, param)
        if exc.code == grpc.StatusCode.NOT_FOUND and field == "model":
            return error_body(exc.details, type_, "model", "model_not_found")
        return error_body(exc.details, type_, None, exc.code.name.lower())

    # -- generation --------------------------------------------------------------------------
    def _tokens(self, ids: list[int]) -> list[Token]:
        """Each id as logprobs list it (openai_protocol.Token), remembered per id."""
        tok = self.servicer.tokenizer
        out = []
        for i in ids:
            seen = self._tokens_seen.get(i)
            if seen is None:
                shown, raw, in_text = tok.token_listing(i)
                seen = self._tokens_seen[i] = Token(shown, raw, len(in_text))
            out.append(seen)
        return out

    def _logprobs(self, chat: bool, out: pb.GenerateResponse, start: int = 0) -> tuple[dict, int]:
        """The logprobs of one response message whose first token's text starts at character
        `start` of its choice's tokens' texts (`text_offsets`), and where the next message's starts."""
        tokens = self._tokens(list(out.token_ids))
        tops = None
        if out.top_logprobs:  # (the request asked for its tokens' alternatives: one entry a token)
            tops = [list(zip(self._tokens(list(t.token_ids)), t.logprobs)) for t in out.top_logprobs]
        if chat:  # (chat's logprobs have no offsets)
            return token_logprobs(chat, tokens, list(out.logprobs), tops=tops), start
        offsets, end = text_offsets(start, [t.chars for t in tokens])
        return token_logprobs(chat, tokens, list(out.logprobs), offsets, tops), end

    async def generate(self, request: Request, req: CompletionRequest | ChatCompletionRequest, route: str) -> Response:
        """A generation route's request, validated and authorized (router/http_front.py: the
        caller's `authorize` set this task's tenant, which Generation's tasks inherit)."""
        chat = isinstance(req, ChatCompletionRequest)
        request_id = request.headers.get("x-request-id", "")
        try:  # refused, not cut or re-encoded: the id a client logs must be the one in ours
            validate_request_id(request_id)
        except InvalidArgument as exc:
            return self.error(400, f"X-Request-Id: {exc.reason}", "invalid_request_error", "X-Request-Id")
        request_id = request_id or uuid.uuid4().hex
        headers = {"X-Request-Id": request_id}
        try:
            if chat:
                prompt = self.template.render(req.template_messages(), add_generation_prompt=True)
                choices = req.to_generate(request_id, prompt, self.template.turn_end)
            else:
                choices = req.to_generate(request_id)
        except InvalidArgument as exc:
            return self.invalid(exc, req, headers)
        except TemplateError as exc:
            param = _template_param(req.messages, str(exc))
            return self.error(400, f"{param}: {exc}", "invalid_request_error", param, headers=headers)
        span, request_headers = f"POST {route}", dict(request.headers)
        gens = [Generation(self.servicer, c.request, span, request_headers) for c in choices]
        cycle = request.scope.get("tandem.cycle")  # uvicorn's request cycle: it holds the connection
        watch = ConnectionWatch(gens, request.receive, getattr(cycle, "transport", None))
        try:  # an error before every choice's first response: a status, at once
            firsts, failed = await _firsts(gens)
        except BaseException:
            watch.cancel()
            raise
        if failed is not None:
            watch.cancel()  # the other choices
            index, exc = failed
            if isinstance(exc, ClientGone):  # e.g. during a long prefill: cancelled, as a disconnect mid-stream is
                return Response(status_code=499)
            return self.aborted(exc, req, headers, choices[index].prompt_index)
        if len(gens) == 1:  # (see HttpTimings)
            self.timings.before_s.append(gens[0].started - request.scope.get("tandem.arrived", gens[0].started))
        shape = ResponseShape(chat, request_id, self.servicer.workers.model)
        if req.stream:
            return _EventStream(self, gens, firsts, choices, shape, req, headers, watch)
        try:
            results = await asyncio.gather(*(self._collect(c, g, first, shape, req)
                                             for c, g, first in zip(choices, gens, firsts)))
            return JSONResponse(shape.final([r[:3] for r in results], usage([r[3] for r in results], req.n)),
                                headers=headers)
        except ChoiceFailed as failed:
            return self.aborted(failed.error, req, headers, failed.choice.prompt_index)
        except ClientGone:
            return Response(status_code=499)
        finally:
            watch.cancel()

    async def _collect(self, c: Choice, gen: Generation, out: pb.GenerateResponse | None, shape: ResponseShape,
                       req) -> tuple[str, str, dict | None, pb.Usage]:
        """Choice c's whole answer: (text, finish reason, logprobs, usage).

        Raises:
            ChoiceFailed: its call ended with an error status.
            ClientGone: its call was cancelled (the client went away).
        """
        text: list[str] = []
        ids: list[int] = []
        lps: list[float] = []
        tops: list[sampling_pb2.TopLogprobs] = []
        try:
            while out is not None:
                text.append(out.text)
                ids.extend(out.token_ids)
                lps.extend(out.logprobs)
                tops.extend(out.top_logprobs)
                if out.finish_reason:
                    break
                out = await gen.next()
        except Aborted as exc:
            raise ChoiceFailed(c, exc) from None
        assert out is not None and out.finish_reason, "Generate ended without a finish reason"
        whole = pb.GenerateResponse(token_ids=ids, logprobs=lps, top_logprobs=tops)
        logprobs = self._logprobs(shape.chat, whole)[0] if req.want_logprobs else None
        return "".join(text), FINISH_REASONS[out.finish_reason], logprobs, out.usage

    # -- the rest ----------------------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [self.model_card()]}

    def model_card(self) -> dict:
        s = self.servicer
        return {"id": s.workers.model, "object": "model", "created": self.created, "owned_by": "tandem",
                "max_model_len": s.context_length}

    def health(self) -> JSONResponse:
        decode = len(self.servicer.workers.candidates(discovery_pb2.ROLE_DECODE))
        prefill = len(self.servicer.workers.candidates(discovery_pb2.ROLE_PREFILL))
        body = {"status": "ok" if decode else "no decode worker", "decode_workers": decode, "prefill_workers": prefill}
        return JSONResponse(body, status_code=200 if decode else 503)

    async def metrics(self) -> Response:
        if self.registry is None:
            return self.error(404, "this router has no metrics registry", "invalid_request_error")
        # The collectors run on this loop (common/metrics.py FunctionCollector): scrape off it.
        data = await asyncio.to_thread(generate_latest, self.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)


def create_app(api: OpenAIFrontend) -> Front:
    """The HTTP API as one ASGI app: router/http_front.py serves the generation routes, this
    FastAPI app the rest."""
    # FastAPI's own OpenTelemetry spans are off: Generation opens the request's SERVER span,
    # named and nested like the gRPC path's (docs/observability.md).
    app = FastAPI(title="Tandem OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None,
                  telemetry={"tracing": False, "metrics": False, "logs": False, "operation_spans": False})

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors())

    @app.exception_handler(404)
    async def not_found(request: Request, exc: Exception) -> JSONResponse:
        return api.error(404, f"no route {request.method} {request.url.path}", "invalid_request_error")

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc: Exception) -> JSONResponse:
        return api.error(405, f"{request.method} not allowed on {request.url.path}", "invalid_request_error")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return api.authorize(request) or JSONResponse(api.models())

    @app.get("/v1/models/{model:path}")
    async def model(model: str, request: Request) -> Response:
        refused = api.authorize(request)
        if refused is not None:
            return refused
        if model != api.servicer.workers.model:
            return api.error(404, f"model: unknown model {model!r}; this router serves {api.servicer.workers.model!r}",
                             "invalid_request_error", "model", "model_not_found")
        return JSONResponse(api.model_card())

    @app.get("/health")
    async def health() -> Response:
        return api.health()

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:  # the cluster's state: admin keys only
        return api.authorize(request, admin_only=True) or await api.metrics()

    return Front(api, app)


def _listen(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket. proto must be IPPROTO_TCP (socket.create_server leaves it 0):
    asyncio sets TCP_NODELAY only on accepted sockets of that proto, and without it a
    keep-alive connection's first streamed events wait ~40 ms for the client's delayed ACK."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:  # router replicas of this host on one port (--reuse-port)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


class HttpServer:
    """uvicorn serving `app` on the running event loop (no signal handlers, no logging set-up:
    the router owns both). `await start()`, then `address`; `await stop()` lets requests in
    flight finish for up to `grace_s`, then cancels them. With `tls_cert` and `tls_key` (PEM
    files) it serves HTTPS."""

    def __init__(self, app: Front, host: str, port: int, grace_s: float = 2.0, reuse_port: bool = False,
                 tls_cert: str = "", tls_key: str = "", host_flag: str = "--host") -> None:
        self.config = uvicorn.Config(app, host=host, port=port, lifespan="off", log_config=None, access_log=False,
                                     timeout_graceful_shutdown=grace_s, log_level="warning", http=HTTP_PARSER,
                                     ssl_certfile=tls_cert or None, ssl_keyfile=tls_key or None)
        self.scheme = "https" if tls_cert else "http"
        self.tls_cert, self.tls_key = tls_cert, tls_key
        self.server = uvicorn.Server(self.config)
        self.host, self.port, self.reuse_port, self.host_flag = host, port, reuse_port, host_flag
        self._sock: socket.socket | None = None
        self._ticks: asyncio.Task | None = None
        self.address = ""  # host:port once started (the bound host: 0.0.0.0 for every interface)
        self.plain_http = PlainHttpLog()  # HTTPS: handshakes that failed on plain HTTP, logged

    @property
    def url(self) -> str:
        """scheme://host:port once started (an IPv6 host in brackets)."""
        return http_url(self.scheme, self.address)

    def reload_certificate(self) -> None:
        """Load --http-tls-cert and --http-tls-key again (SIGHUP: a renewed certificate): new
        connections get it, open ones keep theirs. Raises ValueError (the old one stays)."""
        if self.config.ssl is not None:
            # into a context of its own first: a pair that fails half-way (a certificate whose key
            # is not the one given) would leave the serving context with a certificate and no key
            load_certificate(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), self.tls_cert, self.tls_key)
            load_certificate(self.config.ssl, self.tls_cert, self.tls_key)

    async def start(self) -> None:
        """Raises:
            OSError: the port could not be bound (the message names --http-port)."""
        try:
            self._sock = _listen(self.host, self.port, self.reuse_port)
        except OSError as exc:
            raise OSError(exc.errno, f"--http-port {self.port}: cannot listen on {self.host}:{self.port} "
                                     f"({self.host_flag}): {exc.strerror}") from None
        self._sock.setblocking(False)
        self.address = f"{self.host}:{self._sock.getsockname()[1]}"
        self.config.load()
        if self.config.ssl is not None:
            watch_handshakes(self.config.ssl, self.plain_http)
        self.server.lifespan = self.config.lifespan_class(self.config)
        await self.server.startup(sockets=[self._sock])
        self._ticks = asyncio.create_task(self.server.main_loop(), name="http ticks")  # strong ref; date header

    async def stop(self) -> None:
        if self._ticks is None:
            return
        self.server.should_exit = True
        await self._ticks
        self._ticks = None
        await self.server.shutdown(sockets=[self._sock])
