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
message cancels it (CANCELLED); the session's end (the router's call cancelled, the
connection lost) cancels every open request, so each one's handler frees its blocks as after a
cancelled call. Authorisation is the session's: RoleCheck admits the Session call once, by the
caller's certificate, as it admits a Generate call.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc

from common import tracing
from common.lenient_parse import Unparsable
from common.pb.tandem.v1 import decode_pb2 as pb

log = logging.getLogger(__name__)

GENERATE_METHOD = "/tandem.v1.DecodeService/Generate"  # the SERVER span each session request gets
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
        return self._session.auth_context()

    def peer(self) -> str:
        return self._session.peer()

    def invocation_metadata(self) -> Any:
        return self._session.invocation_metadata()


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
        self._unparsable: Unparsable | None = None  # a request that failed to parse ends the session

    def _post(self, update: pb.SessionUpdate) -> None:
        self._outbox.append(update)
        self._ready.set()

    def _end(self, rid: int, code: grpc.StatusCode, details: str) -> None:
        self._post(pb.SessionUpdate(id=rid, end=True, status_code=code.value[0],
                                    status_details=details))

    def _start(self, start: pb.SessionStart) -> None:
        rid = start.id
        if rid in self._tasks:  # the caller keys every update by it: refuse without running anything
            self._end(rid, grpc.StatusCode.INVALID_ARGUMENT, f"id: {rid} is already open in this session")
            return
        if start.timeout_s < 0:
            self._end(rid, grpc.StatusCode.INVALID_ARGUMENT, "timeout_s: must be >= 0 seconds (0 = no deadline)")
            return
        deadline = time.monotonic() + start.timeout_s if start.timeout_s > 0 else None
        task = asyncio.get_running_loop().create_task(self._run(start, deadline))
        self._tasks[rid] = task
        task.add_done_callback(lambda t: self._done(rid, t))
        if deadline is not None:  # as gRPC ends a call at its deadline: cancel, DEADLINE_EXCEEDED
            self._timers[rid] = asyncio.get_running_loop().call_later(start.timeout_s, self._expire, rid)

    def _expire(self, rid: int) -> None:
        task = self._tasks.get(rid)
        if task is not None:
            self._expired.add(rid)
            task.cancel()

    def _cancel(self, rid: int) -> None:
        task = self._tasks.get(rid)
        if task is not None:
            task.cancel()

    async def _run(self, start: pb.SessionStart, deadline: float | None) -> tuple[grpc.StatusCode, str]:
        """Run the request's handler, posting its messages; its final status."""
        ctx = RequestContext(self._context, deadline)
        try:
            with tracing.server_span(GENERATE_METHOD, dict(start.trace_context)):
                async for msg in self._generate(start.request, ctx):
                    self._post(pb.SessionUpdate(id=start.id, response=msg))
        except Aborted as exc:
            return exc.code, exc.details
        except Exception as exc:  # noqa: BLE001 - as a handler's uncaught exception: UNKNOWN
            log.exception("request %s failed in its session", start.request.request_id)
            return grpc.StatusCode.UNKNOWN, f"Unexpected {type(exc).__name__}: {exc}"
        return grpc.StatusCode.OK, ""

    def _done(self, rid: int, task: asyncio.Task) -> None:
        """The request's task ended (perhaps cancelled before it ever ran): post its end."""
        self._tasks.pop(rid, None)
        timer = self._timers.pop(rid, None)
        if timer is not None:
            timer.cancel()
        if task.cancelled():
            if rid in self._expired:
                code, details = grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"
            else:
                code, details = grpc.StatusCode.CANCELLED, "cancelled by the caller"
        else:
            code, details = task.result()
        self._expired.discard(rid)
        self._end(rid, code, details)

    async def _read(self, requests: AsyncIterator[pb.SessionRequest]) -> None:
        try:
            async for msg in requests:
                if isinstance(msg, Unparsable):  # no id to answer it by: the session ends, naming the field
                    self._unparsable = msg
                    break
                kind = msg.WhichOneof("kind")
                if kind == "start":
                    self._start(msg.start)
                elif kind == "cancel":
                    self._cancel(msg.cancel)
        finally:  # the router closed its side: answer the open requests, then end
            self._reading = False
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
                if self._unparsable is not None:
                    await self._context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                              f"{self._unparsable.field}: {self._unparsable.reason}")
                if not self._reading and not self._tasks and not self._outbox:
                    if reader.done() and not reader.cancelled() and reader.exception() is not None:
                        raise reader.exception()
                    return
        finally:  # the call ended (cancelled, connection lost): every open request ends as cancelled
            reader.cancel()
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            if tasks:  # their handlers free their blocks (as after a cancelled call) before we return
                await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(reader, return_exceptions=True)


class SessionMixin:
    """DecodeService.Session for a servicer that has Generate: each request of the session runs
    the servicer's own Generate (list it before pb_grpc.DecodeServiceServicer in the bases)."""

    async def Session(self, request_iterator, context: grpc.aio.ServicerContext):
        async for response in SessionServer(self.Generate, context).serve(request_iterator):
            yield response
