"""The router's side of DecodeService.Session: one stream per decode worker channel, many calls.

A decode worker batches what all of a session's requests produced since its previous message
into one SessionResponse (worker/session.py), so the router receives one message per decode
step per worker instead of one per streaming request, and the worker sends one. Here each
request is a `SessionCall`, read as a Generate call is (`read()`: a DecodeResponse, then
grpc.aio.EOF, or grpc.aio.AioRpcError with the status its Generate call would have ended
with), so the router's retry and migration code does not change. A call's deadline is kept
here as gRPC keeps a call's (DEADLINE_EXCEEDED, and the worker is told to cancel it), and
cancelling a call tells the worker, which ends the request as a cancelled call.

When the session's stream fails (the worker died, its channel was closed), every open call
fails with that status, and the next request to the worker opens a new session. A worker that
does not serve Session (an older version answers UNIMPLEMENTED before reading any request: the
router writes its requests only once the worker's headers came) gets each request as a Generate
call of its own instead, from then on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import deque

import grpc

from common import tracing
from common.pb.tandem.v1 import decode_pb2 as pb
from common.pb.tandem.v1 import decode_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

GENERATE_METHOD = "/tandem.v1.DecodeService/Generate"  # the CLIENT span each request gets
_EMPTY = grpc.aio.Metadata()


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The exception a grpc.aio call ending with this status raises."""
    return grpc.aio.AioRpcError(code, _EMPTY, _EMPTY, details)


class SessionCall:
    """One request on a session, read as a grpc.aio UnaryStreamCall. Use on the router's loop."""

    def __init__(self, session: DecodeSession, rid: int, span, request: pb.DecodeRequest,
                 deadline: float) -> None:
        self._session, self.id, self._span = session, rid, span
        self._request, self._deadline = request, deadline  # deadline: loop time
        self._items: deque = deque()  # DecodeResponse, then the final (code, details)
        self._waiter: asyncio.Future | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._inner: grpc.aio.UnaryStreamCall | None = None  # a worker without Session: its Generate call
        self.done = False

    def _end_here(self, code: grpc.StatusCode, details: str) -> bool:
        """This call's part of the session is over with this status (its span ends with it);
        False if it already was."""
        if self.done:
            return False
        self.done = True
        if self._timer is not None:
            self._timer.cancel()
        self._session._forget(self.id)
        tracing.end_client_span(self._span, code, details)
        return True

    def _as_generate(self, stub: pb_grpc.DecodeServiceStub) -> None:
        """Carry on as a Generate call of its own (the worker does not serve Session: an older
        version; it never saw this request)."""
        if self._end_here(grpc.StatusCode.UNIMPLEMENTED, "sent as a Generate call instead"):
            remaining = self._deadline - asyncio.get_running_loop().time()
            self._inner = stub.Generate(self._request, timeout=max(0.0, remaining))
            self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _push(self, item) -> None:
        self._items.append(item)
        self._wake()

    def _deliver(self, update: pb.SessionUpdate) -> None:
        if update.HasField("response"):
            self._push(update.response)
        if update.end:
            self._finish(_CODES.get(update.status_code, grpc.StatusCode.UNKNOWN), update.status_details)

    def _finish(self, code: grpc.StatusCode, details: str) -> None:
        """The call is over with this status: no item follows."""
        if self._end_here(code, details):
            self._push((code, details))

    def _expire(self) -> None:
        self.cancel(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    async def read(self):
        """The next DecodeResponse, or grpc.aio.EOF after the last.

        Raises:
            grpc.aio.AioRpcError: the call ended with a status other than OK.
        """
        while not self._items:
            if self._inner is not None:
                return await self._inner.read()
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        item = self._items[0]
        if isinstance(item, tuple):  # the end stays: every later read gives it again
            code, details = item
            if code == grpc.StatusCode.OK:
                return grpc.aio.EOF
            raise rpc_error(code, details)
        self._items.popleft()
        return item

    def cancel(self, code: grpc.StatusCode = grpc.StatusCode.CANCELLED, details: str = "Locally cancelled") -> bool:
        """End the call here (its worker is told to cancel the request); False if already over."""
        if self._inner is not None:
            return self._inner.cancel()
        if self.done:
            return False
        self._session._send(pb.SessionRequest(cancel=self.id))
        self._finish(code, details)
        return True


class DecodeSession:
    """One Session call on a decode worker's channel, shared by that worker's requests."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self.stub = pb_grpc.DecodeServiceStub(channel)
        self._call = self.stub.Session()
        self._calls: dict[int, SessionCall] = {}
        self._ids = itertools.count(1)
        self._out: list[pb.SessionRequest] = []
        self._out_ready = asyncio.Event()
        self.error: tuple[grpc.StatusCode, str] | None = None  # set once the stream failed
        self.unimplemented = False  # the worker has no Session (an older version): Generate calls instead
        self.responses = 0  # SessionResponses received (each one a turn of the worker's loop)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._write()), loop.create_task(self._read())]

    @property
    def open_calls(self) -> int:
        return len(self._calls)

    def start(self, request: pb.DecodeRequest, timeout_s: float) -> SessionCall:
        """Start `request` on the worker with a deadline `timeout_s` seconds from now."""
        span, carrier = tracing.client_span(GENERATE_METHOD)
        call = SessionCall(self, next(self._ids), span, request, asyncio.get_running_loop().time() + timeout_s)
        if self.unimplemented:
            call._as_generate(self.stub)
            return call
        if self.error is not None:
            call._finish(*self.error)
            return call
        if timeout_s <= 0:  # as a call whose deadline passed before it started
            call._finish(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            return call
        self._calls[call.id] = call
        call._timer = asyncio.get_running_loop().call_later(timeout_s, call._expire)
        self._send(pb.SessionRequest(start=pb.SessionStart(request=request, id=call.id, timeout_s=timeout_s,
                                                           trace_context=carrier)))
        return call

    def _send(self, msg: pb.SessionRequest) -> None:
        if self.error is None:
            self._out.append(msg)
            self._out_ready.set()

    def _forget(self, rid: int) -> None:
        self._calls.pop(rid, None)

    async def _write(self) -> None:
        try:
            # the worker's handler sends its headers first: a worker without Session (an older
            # version) has answered UNIMPLEMENTED by then, and no start is written into a call
            # already over (grpc.aio would report that write's failure as INTERNAL instead)
            await self._call.initial_metadata()
            if self._call.done():
                return
            while True:
                await self._out_ready.wait()
                self._out_ready.clear()
                batch, self._out = self._out, []
                for msg in batch:
                    await self._call.write(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the reader reports the stream's status
            log.debug("decode session write failed: %r", exc)

    async def _read(self) -> None:
        code, details = grpc.StatusCode.UNAVAILABLE, "the decode worker ended the session"
        try:
            async for resp in self._call:
                self.responses += 1
                for update in resp.updates:
                    call = self._calls.get(update.id)
                    if call is not None:
                        call._deliver(update)
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or "decode session failed"
        except asyncio.CancelledError:
            code, details = grpc.StatusCode.CANCELLED, "decode session closed"
            raise
        finally:
            self._fail(code, details)

    def _fail(self, code: grpc.StatusCode, details: str) -> None:
        """The stream is over: every open call ends with its status; no new call starts here."""
        if self.error is None:
            self.error = (code, details)
            if code == grpc.StatusCode.UNIMPLEMENTED:
                self.unimplemented = True
                log.warning("a decode worker does not serve DecodeService.Session (an older version?): its requests "
                            "go as one Generate call each")
        for call in list(self._calls.values()):
            if self.unimplemented:
                call._as_generate(self.stub)
            else:
                call._finish(code, details)
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._call.cancel()

    def close(self) -> None:
        """End the session (its open calls end CANCELLED)."""
        self._fail(grpc.StatusCode.CANCELLED, "decode session closed")


class DecodeSessions:
    """The router's sessions, one per decode worker channel (a failed one is replaced)."""

    def __init__(self) -> None:
        self._by_channel: dict[grpc.aio.Channel, DecodeSession] = {}  # (channels hash by identity)

    def start(self, channel: grpc.aio.Channel, request: pb.DecodeRequest, timeout_s: float) -> SessionCall:
        """`request` started on `channel`'s session (opened now if none is open)."""
        session = self._by_channel.get(channel)
        if session is None or (session.error is not None and not session.unimplemented):
            self.prune()
            session = self._by_channel[channel] = DecodeSession(channel)
        return session.start(request, timeout_s)

    def session(self, channel: grpc.aio.Channel) -> DecodeSession | None:
        """The session on `channel` (None when none was opened)."""
        return self._by_channel.get(channel)

    def prune(self) -> None:
        """Forget the sessions that failed (their channel closed, their worker died), and those of
        workers without Session (kept to send their requests as Generate calls) once their
        channel is closed."""
        def gone(session: DecodeSession) -> bool:
            if session.error is None:
                return False
            return not session.unimplemented or session.channel.get_state(False) == grpc.ChannelConnectivity.SHUTDOWN
        for ch in [ch for ch, s in self._by_channel.items() if gone(s)]:
            del self._by_channel[ch]

    def __len__(self) -> int:
        return len(self._by_channel)

    def close(self) -> None:
        for session in self._by_channel.values():
            session.close()
        self._by_channel.clear()


_CODES = {c.value[0]: c for c in grpc.StatusCode}
