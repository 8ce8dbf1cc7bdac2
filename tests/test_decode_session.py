"""DecodeService.Session over real gRPC on loopback: worker/session.py serving a Generate
handler, router/decode_session.py calling it. Many requests share one stream; each behaves as
its own Generate call (tokens, status, deadline, cancellation); what the requests produce in
one turn of the worker's loop travels as one message."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from common.grpc_server import add_lenient_service, channel, start_server
from common.pb.tandem.v1 import decode_pb2 as pb
from router.decode_session import DecodeSessions
from worker.session import DECODE_METHODS, SessionMixin

SERVICE = "tandem.v1.DecodeService"


class Stepped(SessionMixin):
    """A decode worker stand-in: each request yields one token per `step()`, all requests at
    once (as a decode step wakes every running request's stream), up to max_tokens; request ids
    name what else happens: "hang" never yields, "abort" ends RESOURCE_EXHAUSTED after one token,
    "crash" raises."""

    def __init__(self) -> None:
        self._tick = asyncio.Condition()
        self.ticks = 0
        self.ended: list[str] = []  # request ids whose handler ended (finally ran), in order
        self.waiting = 0  # handlers waiting for the next step

    async def step(self) -> None:
        async with self._tick:
            self.ticks += 1
            self._tick.notify_all()

    async def Generate(self, request: pb.DecodeRequest, context):
        try:
            if request.request_id == "hang":
                await asyncio.Event().wait()
            seen = self.ticks
            for i in range(request.sampling.max_tokens):
                async with self._tick:
                    self.waiting += 1
                    try:
                        await self._tick.wait_for(lambda: self.ticks > seen)
                    finally:
                        self.waiting -= 1
                    seen = self.ticks
                yield pb.DecodeResponse(token_ids=[100 + i], logprobs=[-0.5])
                if request.request_id == "abort":
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "pool is full")
                if request.request_id == "crash":
                    raise RuntimeError("boom")
        finally:
            self.ended.append(request.request_id)


async def _serve(servicer, methods=DECODE_METHODS):
    return await start_server("127.0.0.1:0", [lambda s: add_lenient_service(s, SERVICE, servicer, methods)],
                              [SERVICE])


@contextlib.asynccontextmanager
async def _served(servicer, methods=DECODE_METHODS):
    """(the servicer's server on loopback, a channel to it, the router's sessions), closed after."""
    server = await _serve(servicer, methods)
    ch = channel(f"127.0.0.1:{server.port}")
    sessions = DecodeSessions()
    try:
        yield server, ch, sessions
    finally:
        sessions.close()
        await ch.close()
        await server.stop(0)


def _request(rid: str, n: int = 3) -> pb.DecodeRequest:
    req = pb.DecodeRequest(request_id=rid, token_ids=[1, 2, 3])
    req.sampling.max_tokens = n
    return req


async def _drain(call) -> tuple[list[int], grpc.StatusCode, str]:
    tokens = []
    try:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                return tokens, grpc.StatusCode.OK, ""
            tokens.extend(msg.token_ids)
    except grpc.aio.AioRpcError as exc:
        return tokens, exc.code(), exc.details()


async def _until(pred, what: str, timeout_s: float = 5.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


def test_requests_share_one_stream_and_each_step_is_one_message() -> None:
    async def main() -> None:
        servicer = Stepped()
        async with _served(servicer) as (server, ch, sessions):
            calls = [sessions.start(ch, _request(f"r{i}", 4), 30) for i in range(16)]
            readers = [asyncio.ensure_future(_drain(c)) for c in calls]
            session = sessions.session(ch)
            await _until(lambda: servicer.waiting == 16, "all 16 handlers waiting for the first step")
            before = session.responses
            for _ in range(4):
                await servicer.step()
                await _until(lambda: servicer.waiting == 16 or session.open_calls == 0, "the step ran")
                await _until(lambda: session.responses > before, "the step's tokens arrived")
                await asyncio.sleep(0.05)  # nothing else is produced until the next step
                before = session.responses
            results = await asyncio.gather(*readers)
            assert len(sessions) == 1  # one stream for every request
            for tokens, code, _ in results:
                assert code == grpc.StatusCode.OK and tokens == [100, 101, 102, 103]
            # 4 steps × 16 requests' tokens + 16 ends in 4 or 5 messages (the ends may travel
            # with the last tokens or just after), never one per request
            assert session.responses <= 5, session.responses
            assert session.open_calls == 0
    asyncio.run(main())


def test_statuses_are_those_of_a_generate_call_and_others_keep_streaming() -> None:
    async def main() -> None:
        servicer = Stepped()
        async with _served(servicer) as (server, ch, sessions):
            names = ["abort", "crash", "ok"]
            readers = [asyncio.ensure_future(_drain(sessions.start(ch, _request(n, 3), 30))) for n in names]
            for _ in range(3):
                await asyncio.sleep(0.05)
                await servicer.step()
            (a_tok, a_code, a_det), (c_tok, c_code, c_det), (ok_tok, ok_code, _) = await asyncio.gather(*readers)
            assert (a_tok, a_code, a_det) == ([100], grpc.StatusCode.RESOURCE_EXHAUSTED, "pool is full")
            assert c_tok == [100] and c_code == grpc.StatusCode.UNKNOWN and "boom" in c_det
            assert (ok_tok, ok_code) == ([100, 101, 102], grpc.StatusCode.OK)
    asyncio.run(main())


def test_deadline_and_cancel_end_the_handler_on_the_worker() -> None:
    async def main() -> None:
        servicer = Stepped()
        async with _served(servicer) as (server, ch, sessions):
            late = sessions.start(ch, _request("hang"), 0.3)
            tokens, code, _ = await _drain(late)
            assert (tokens, code) == ([], grpc.StatusCode.DEADLINE_EXCEEDED)
            await _until(lambda: "hang" in servicer.ended, "the worker cancelled the expired request's handler")
            gone = sessions.start(ch, _request("unwanted", 50), 30)
            stays = sessions.start(ch, _request("stays", 2), 30)
            await asyncio.sleep(0.1)
            assert gone.cancel()
            assert not gone.cancel()  # already over
            await _until(lambda: "unwanted" in servicer.ended, "the worker cancelled the request's handler")
            assert (await _drain(gone))[1] == grpc.StatusCode.CANCELLED
            reader = asyncio.ensure_future(_drain(stays))
            for _ in range(2):
                await asyncio.sleep(0.05)
                await servicer.step()
            assert await reader == ([100, 101], grpc.StatusCode.OK, "")
            # a deadline already passed fails at once, as a call's would
            assert (await _drain(sessions.start(ch, _request("x"), 0.0)))[1] == grpc.StatusCode.DEADLINE_EXCEEDED
    asyncio.run(main())


def test_a_broken_session_fails_its_calls_and_the_next_request_opens_a_new_one() -> None:
    async def main() -> None:
        servicer = Stepped()
        server = await _serve(servicer)
        port = server.port
        ch = channel(f"127.0.0.1:{port}")
        sessions = DecodeSessions()
        try:
            open_call = sessions.start(ch, _request("hang"), 30)
            await _until(lambda: sessions.session(ch).open_calls == 1, "started")
            await asyncio.sleep(0.1)
            await server.stop(0)  # the worker goes away mid-stream
            tokens, code, _ = await _drain(open_call)
            assert tokens == [] and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            await _until(lambda: "hang" in servicer.ended, "the worker ended the handler with its session")
            server = await start_server(f"127.0.0.1:{port}", [lambda s: add_lenient_service(
                s, SERVICE, servicer, DECODE_METHODS)], [SERVICE])
            again = sessions.start(ch, _request("after", 1), 30)
            reader = asyncio.ensure_future(_drain(again))
            await _until(lambda: servicer.waiting == 1, "the request runs on a new session", 10)
            await servicer.step()
            assert await reader == ([100], grpc.StatusCode.OK, "")
        finally:
            sessions.close()
            await ch.close()
            await server.stop(0)
    asyncio.run(main())


def test_a_request_that_does_not_parse_ends_the_session_naming_the_field() -> None:
    async def main() -> None:
        server = await _serve(Stepped())
        ch = channel(f"127.0.0.1:{server.port}")
        try:
            raw = pb.SessionRequest(start=pb.SessionStart(request=pb.DecodeRequest(request_id="Q7Q7"), id=1))
            bad = raw.SerializeToString().replace(b"Q7Q7", b"Q\xff\xfeQ")
            call = ch.stream_stream("/tandem.v1.DecodeService/Session", request_serializer=lambda b: b,
                                    response_deserializer=pb.SessionResponse.FromString)(iter([bad]))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                async for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "start.request.request_id" in err.value.details()
        finally:
            await ch.close()
            await server.stop(0)
    asyncio.run(main())


class OldWorker:
    """A decode worker of a version without Session: Generate only."""

    async def Generate(self, request: pb.DecodeRequest, context):
        for i in range(request.sampling.max_tokens):
            yield pb.DecodeResponse(token_ids=[200 + i])


def test_a_worker_without_session_gets_one_generate_call_per_request() -> None:
    async def main() -> None:
        async with _served(OldWorker(), {"Generate": DECODE_METHODS["Generate"]}) as (server, ch, sessions):
            first = await asyncio.gather(*[_drain(sessions.start(ch, _request(f"a{i}", 2), 30)) for i in range(3)])
            later = await _drain(sessions.start(ch, _request("b", 3), 30))  # the session is not tried again
            assert first == [([200, 201], grpc.StatusCode.OK, "")] * 3
            assert later == ([200, 201, 202], grpc.StatusCode.OK, "")
            assert sessions.session(ch).unimplemented
            other = channel(f"127.0.0.1:{server.port}")
            await ch.close()  # its worker left: the next session opened elsewhere forgets it
            assert (await _drain(sessions.start(other, _request("c", 1), 30)))[1] == grpc.StatusCode.OK
            assert len(sessions) == 1 and sessions.session(other) is not None
            await other.close()
    asyncio.run(main())


class SlowCleanup(SessionMixin):
    """A handler whose cleanup awaits (as one telling a peer to abandon would)."""

    def __init__(self) -> None:
        self.cleanups: list[str] = []

    async def Generate(self, request: pb.DecodeRequest, context):
        try:
            await asyncio.Event().wait()
            yield pb.DecodeResponse()
        finally:
            try:
                await asyncio.sleep(0.05)
                self.cleanups.append("done")
            except asyncio.CancelledError:
                self.cleanups.append("interrupted")
                raise


def test_a_deadline_cancels_the_handler_once_so_its_cleanup_completes() -> None:
    # the caller's timer and the worker's own fire together at a deadline: one cancellation only
    async def main() -> None:
        servicer = SlowCleanup()
        async with _served(servicer) as (server, ch, sessions):
            for i in range(4):
                assert (await _drain(sessions.start(ch, _request(f"d{i}"), 0.2)))[1] == grpc.StatusCode.DEADLINE_EXCEEDED
                await asyncio.sleep(0.15)
            assert servicer.cleanups == ["done"] * 4
    asyncio.run(main())


def test_closing_sessions_lets_an_idle_worker_stop_without_its_grace_period() -> None:
    async def main() -> None:
        servicer = Stepped()
        async with _served(servicer) as (server, ch, sessions):
            call = sessions.start(ch, _request("one", 1), 30)
            reader = asyncio.ensure_future(_drain(call))
            await _until(lambda: servicer.waiting == 1, "running")
            servicer.close_sessions()  # a request still open: the session stays until it ends
            await servicer.step()
            assert await reader == ([100], grpc.StatusCode.OK, "")
            t0 = asyncio.get_running_loop().time()
            await server.stop(2.0)
            assert asyncio.get_running_loop().time() - t0 < 1.0
    asyncio.run(main())


def test_each_request_gets_generate_spans_with_its_status() -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from common import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    previous = tracing.use_provider(provider)

    async def main() -> None:
        servicer = Stepped()
        async with _served(servicer) as (server, ch, sessions):
            readers = [asyncio.ensure_future(_drain(sessions.start(ch, _request(n, 1), 30))) for n in ("ok", "abort")]
            await _until(lambda: servicer.waiting == 2, "running")
            await servicer.step()
            await asyncio.gather(*readers)
            await _until(lambda: len(exporter.get_finished_spans()) == 4, "four spans")
    try:
        asyncio.run(main())
    finally:
        tracing.use_provider(previous)
    spans = exporter.get_finished_spans()
    servers = [s for s in spans if s.kind.name == "SERVER"]
    clients = [s for s in spans if s.kind.name == "CLIENT"]
    assert {s.name for s in spans} == {"/tandem.v1.DecodeService/Generate"} and len(servers) == len(clients) == 2
    for s in servers:
        assert s.attributes["rpc.system"] == "grpc" and s.attributes["rpc.method"] == "Generate"
        assert s.parent is not None and s.parent.span_id in {c.context.span_id for c in clients}
    assert sorted(s.attributes["rpc.grpc.status_code"] for s in servers) == [0, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]
    assert sorted(c.attributes["rpc.grpc.status_code"] for c in clients) == [0, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]]


def test_a_start_reusing_an_open_id_ends_the_session_and_a_bad_timeout_is_refused() -> None:
    async def main() -> None:
        servicer = Stepped()
        server = await _serve(servicer)
        ch = channel(f"127.0.0.1:{server.port}")
        try:
            from common.pb.tandem.v1 import decode_pb2_grpc as pb_grpc
            call = pb_grpc.DecodeServiceStub(ch).Session()
            await call.write(pb.SessionRequest(start=pb.SessionStart(request=_request("nan"), id=1,
                                                                     timeout_s=float("nan"))))
            first = await call.read()
            assert [(u.id, u.end, u.status_code) for u in first.updates] == [
                (1, True, grpc.StatusCode.INVALID_ARGUMENT.value[0])]
            assert first.updates[0].status_details.startswith("timeout_s:")
            await call.write(pb.SessionRequest(start=pb.SessionStart(request=_request("hang"), id=5)))
            await call.write(pb.SessionRequest(start=pb.SessionStart(request=_request("other"), id=5)))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while (await call.read()) is not grpc.aio.EOF:
                    pass
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == "id: 5 is already open in this session"
            await _until(lambda: "hang" in servicer.ended, "the open request's handler was cancelled")
        finally:
            await ch.close()
            await server.stop(0)
    asyncio.run(main())
