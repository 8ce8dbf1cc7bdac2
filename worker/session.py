"""DecodeService.Session, served: many Generate calls on one stream, their outputs batched.

Why: a decode worker at batch 64 streams each request's tokens as its own gRPC message, and
gRPC's host cost per message (about 40–80 µs of the worker's event loop and poller thread on an
H200 host, py-spy of the served decode worker) was a third of the decode step's host path;
the router pays it again on its side. A Session carries every request the router sends to one
worker, and each SessionResponse carries what all of them produced since the previous one: one
message per decode step, however many requests stream (SGLang's scheduler sends its detokenizer
one batch per step for the same reason).

Each request runs the worker's own Generate handler in a task of its own, with a
`RequestContext` standing in for its call's context: the handler cannot tell the difference,
so the checks, admission, prefill, tokens and status codes are those of a Generate call. Its
deadline (SessionStart.timeout_s) cancels it as gRPC would (DEADLINE_EXCEEDED); a cancel
message cancels it (CANCELLED); each handler is cancelled once at most, as a call is, so its
cleanup runs to the end; the session's end (the router's call cancelled, the connection lost)
cancels every open request, so each one's handler frees its blocks as after a cancelled call.
A message the session cannot answer by id (one that does not parse, a start reusing an open
id) ends the whole session with INVALID_ARGUMENT naming the field: only a broken caller sends
one. A draining worker closes its sessions (`SessionMixin.close_sessions`): each ends once its
open requests have, so an idle one does not hold the server's grace period at shutdown.
Authorisation is the session's: RoleCheck admits the Session call once, by the caller's
certificate, as it admits a Generate call. The worker sends its headers before reading any
request, and the router writes requests only after them (router/decode_session.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc

from common import tracing
from common.lenient_parse import Unparsable
from common.pb.tandem.v1 import decode_pb2 as pb

log = logging.getLogger(__name__)

GENERATE_METHOD = "/tandem.v1.DecodeService/Generate"  # the SERVER span each session request gets
SPAN_ATTRIBUTES = tracing.rpc_attributes(GENERATE_METHOD)  # as the server interceptor gives a Generate call
# DecodeService's methods for common.grpc_server.add_lenient_service (decode workers, mocker)
DECODE_METHODS = {"Generate": ("stream", pb.DecodeRequest, pb.DecodeResponse),
                  "Session": ("bidi", pb.SessionRequest, pb.SessionResponse)}


class Aborted(Exception):
    """RequestContext.abort's exception: ends the request's handler with this status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class RequestContext:
    """What a Generate handler uses of its grpc.aio.ServicerContext, for one request of a session.

    Args:
        session: the Session call's context (its peer, certificate and metadata are the request's).
        deadline: time.monotonic() by which the request must end, or None.
    """

    def __init__(self, session: grpc.aio.ServicerContext, deadline: float | None) -> None:
        self._session, self._deadline = session, deadline

    async def abort(self, code: grpc.StatusCode, details: str = "") -> NoReturn:
        raise Aborted(code, details)

    def time_remaining(self) -> float | None:
        """Seconds left before the request's deadline (None: no deadline), as a call's context."""
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def auth_context(self) -> dict[str, list[bytes]]:
        """The caller's verified certificate (the session's): what a check of the peer reads."""
        return self._session.auth_context()


Generate = Callable[[pb.DecodeRequest, Any], AsyncIterator[pb.DecodeResponse]]


class SessionServer:
    """One Session call: starts its requests' handlers, batches their messages into responses.

    Args:
        generate: the worker's Generate handler (an async generator of DecodeResponse).
        context: the Session call's context.
    """

    def __init__(self, generate: Generate, context: grpc.aio.ServicerContext) -> None:
        self._generate, self._context = generate, context
        self._tasks: dict[int, asyncio.Task] = {}  # SessionStart.id -> its handler's task
        self._timers: dict[int, asyncio.TimerHandle] = {}  # SessionStart.id -> its deadline's timer
        self._expired: set[int] = set()  # ids of requests cancelled by their deadline
        self._outbox: list[pb.SessionUpdate] = []
        self._ready = asyncio.Event()  # the outbox has updates, or the reader ended
        self._reading = True
        self._violation = ""  # a request the session cannot answer by id (unparsable, id reused): it ends
        self.closing = False  # set by close(): end once no request is open

    def _post(self, update: pb.SessionUpdate) -> None:
        self._outbox.append(update)
        self._ready.set()

    def _end(self, rid: int, code: grpc.StatusCode, details: str) -> None:
        self._post(pb.SessionUpdate(id=rid, end=True, status_code=code.value[0],
                                    status_details=details))

    def _start(self, start: pb.SessionStart) -> None:
        rid = start.id
        if rid in self._tasks:  # updates keyed by it could not be told apart: the session ends (serve)
            self._violation = f"id: {rid} is already open in this session"
            self._ready.set()
            return
        if not math.isfinite(start.timeout_s) or start.timeout_s < 0:
            self._end(rid, grpc.StatusCode.INVALID_ARGUMENT,
                      f"timeout_s: must be a number of seconds >= 0 (0 = no deadline), got {start.timeout_s}")
            return
        deadline = time.monotonic() + start.timeout_s if start.timeout_s > 0 else None
        task = asyncio.get_running_loop().create_task(self._run(start, deadline))
        self._tasks[rid] = task
        task.add_done_callback(lambda t: self._done(rid, t))
        if deadline is not None:  # as gRPC ends a call at its deadline: cancel, DEADLINE_EXCEEDED
            self._timers[rid] = asyncio.get_running_loop().call_later(start.timeout_s, self._expire, rid)

    def _expire(self, rid: int) -> None:
        self._cancel(rid, expired=True)

    def _cancel(self, rid: int, expired: bool = False) -> None:
        """Cancel a request's handler once, as gRPC cancels a call once (a second cancel, from
        the caller's deadline racing the worker's own, would interrupt the handler's cleanup);
        `expired`: by its deadline (DEADLINE_EXCEEDED)."""
        task = self._tasks.get(rid)
        if task is not None and not task.cancelling():
            if expired:
                self._expired.add(rid)
            task.cancel()

    async def _run(self, start: pb.SessionStart, deadline: float | None) -> tuple[grpc.StatusCode, str]:
        """Run the request's handler, posting its messages; its final status (also on its span)."""
        ctx = RequestContext(self._context, deadline)
        code, details, cancelled = grpc.StatusCode.OK, "", None
        with tracing.server_span(GENERATE_METHOD, dict(start.trace_context), SPAN_ATTRIBUTES) as span:
            try:
                async for msg in self._generate(start.request, ctx):
                    self._post(pb.SessionUpdate(id=start.id, response=msg))
            except Aborted as exc:
                code, details = exc.code, exc.details
            except asyncio.CancelledError as exc:  # re-raised once the span has the call's status
                cancelled = exc
                code, details = self._cancelled_status(start.id)
            except Exception as exc:  # noqa: BLE001 - as a handler's uncaught exception: UNKNOWN
                log.exception("request %s failed in its session", start.request.request_id)
                code, details = grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}"
            tracing.set_rpc_status(span, code, details)
        if cancelled is not None:
            raise cancelled
        return code, details

    def _cancelled_status(self, rid: int) -> tuple[grpc.StatusCode, str]:
        if rid in self._expired:
            return grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
        return grpc.StatusCode.CANCELLED, "cancelled by the caller"

    def _done(self, rid: int, task: asyncio.Task) -> None:
        """The request's task ended (perhaps cancelled before it ever ran): post its end."""
        self._tasks.pop(rid, None)
        timer = self._timers.pop(rid, None)
        if timer is not None:
            timer.cancel()
        if task.cancelled():
            code, details = self._cancelled_status(rid)
        else:
            code, details = task.result()
        self._expired.discard(rid)
        self._end(rid, code, details)

    async def _read(self, requests: AsyncIterator[pb.SessionRequest]) -> None:
        try:
            async for msg in requests:
                if isinstance(msg, Unparsable):  # no id to answer it by: the session ends, naming the field
                    self._violation = f"{msg.field}: {msg.reason}"
                    self._ready.set()
                    break
                kind = msg.WhichOneof("kind")
                if kind == "start":
                    self._start(msg.start)
                elif kind == "cancel":
                    self._cancel(msg.cancel)
        finally:  # the router closed its side: answer the open requests, then end
            self._reading = False
            self._ready.set()

    def close(self) -> None:
        """End the session once no request is open (new starts are still served meanwhile)."""
        self.closing = True
        self._ready.set()

    async def serve(self, requests: AsyncIterator[pb.SessionRequest]) -> AsyncIterator[pb.SessionResponse]:
        """The Session's responses: every update posted since the previous response, in one."""
        reader = asyncio.get_running_loop().create_task(self._read(requests))
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                if self._outbox:
                    batch, self._outbox = self._outbox, []
                    yield pb.SessionResponse(updates=batch)
                if self._violation:
                    await self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, self._violation)
                if (not self._reading or self.closing) and not self._tasks and not self._outbox:
                    return
        finally:  # the call ended (cancelled, connection lost): every open request ends as cancelled
            reader.cancel()
            tasks = list(self._tasks.values())
            for rid in list(self._tasks):
                self._cancel(rid)
            if tasks:  # their handlers free their blocks (as after a cancelled call) before we return
                await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(reader, return_exceptions=True)


class SessionMixin:
    """DecodeService.Session for a servicer that has Generate: each request of the session runs
    the servicer's own Generate (list it before pb_grpc.DecodeServiceServicer in the bases)."""

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        await context.send_initial_metadata(())  # the caller writes its requests once it has these
        server = SessionServer(self.Generate, context)
        open_sessions = self.__dict__.setdefault("_open_sessions", set())
        open_sessions.add(server)
        try:
            async for response in server.serve(request_iterator):
                yield response
        finally:
            open_sessions.discard(server)

    def close_sessions(self) -> None:
        """End every session once its open requests have ended (a draining worker, before its
        server stops: an idle session would otherwise hold the server's grace period)."""
        for server in self.__dict__.get("_open_sessions", ()):
            server.close()
