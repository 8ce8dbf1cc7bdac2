"""Pieces of the HTTP API that need no cluster: the listening socket, the mapping of gRPC-side
field names and pydantic locations onto OpenAI parameters, the gRPC status → HTTP status table."""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from router.http_api import STATUS, _listen, _loc, validate_port
from router.openai_protocol import ChatCompletionRequest, CompletionRequest, param_name


def test_accepted_connections_have_tcp_nodelay():
    """Streamed events must not wait for the client's delayed ACK (asyncio sets TCP_NODELAY only
    on sockets whose proto is IPPROTO_TCP)."""
    async def main() -> int:
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        def on_connect(reader, writer) -> None:
            accepted.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        sock = _listen("127.0.0.1", 0)
        server = await asyncio.start_server(on_connect, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        value = await asyncio.wait_for(accepted, 5)
        writer.close()
        server.close()
        await server.wait_closed()
        return value

    assert asyncio.run(main()) == 1


def test_taken_port_is_an_oserror():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(OSError):
            _listen("127.0.0.1", taken.getsockname()[1])


@pytest.mark.parametrize("port", [-2, 65536])
def test_http_port_range_names_the_flag(port):
    with pytest.raises(ValueError, match="--http-port"):
        validate_port(port)


@pytest.mark.parametrize("field, chat, extra, want", [
    ("text", False, {}, "prompt"),
    ("text", True, {}, "messages"),
    ("token_ids[7]", False, {}, "prompt[7]"),
    ("sampling.max_tokens", False, {}, "max_tokens"),
    ("sampling.max_tokens", True, {"max_completion_tokens": 3}, "max_completion_tokens"),
    ("sampling.max_tokens", True, {"max_tokens": 3}, "max_tokens"),
    ("sampling.top_p", True, {}, "top_p"),
    ("model", False, {}, "model"),
])
def test_param_name(field, chat, extra, want):
    req = (ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], **extra) if chat
           else CompletionRequest(prompt="x", **extra))
    assert param_name(field, req) == want


def test_pydantic_locations():
    assert _loc(("body", "messages", 0, "content")) == "messages[0].content"
    assert _loc(("body", "prompt", "str")) == "prompt"
    assert _loc(("body", "max_tokens")) == "max_tokens"


def test_status_table():
    assert {c: s for c, (s, _) in STATUS.items()} == {
        grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
        grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
        grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.UNAUTHENTICATED: 401,
        grpc.StatusCode.PERMISSION_DENIED: 403}


def test_http_layer_timings_cover_every_streamed_event():
    """HttpTimings over a real uvicorn server with a stand-in servicer yielding 4 responses."""
    import httpx

    from common.pb.tandem.v1 import frontend_pb2 as pb
    from common.pb.tandem.v1 import sampling_pb2
    from common.tokenizer import load_tokenizer
    from router.chat_template import load_chat_template
    from router.http_api import HttpServer, OpenAIFrontend, create_app

    class Workers:
        model = "m"

    class Servicer:
        workers, context_length, tokenizer = Workers(), 4096, load_tokenizer(None)

        async def Generate(self, req, ctx):
            for i in range(3):
                yield pb.GenerateResponse(token_ids=[100 + i], text=f"t{i}", logprobs=[-0.5])
            yield pb.GenerateResponse(token_ids=[7], text="!", logprobs=[-0.1], usage=pb.Usage(prompt_tokens=3,
                                      completion_tokens=4), finish_reason=sampling_pb2.FINISH_REASON_LENGTH)

    async def main() -> OpenAIFrontend:
        frontend = OpenAIFrontend(Servicer(), load_chat_template(None), None)
        server = HttpServer(create_app(frontend), "127.0.0.1", 0)
        await server.start()
        try:
            async with httpx.AsyncClient() as client:
                for _ in range(5):
                    async with client.stream("POST", f"http://{server.address}/v1/completions",
                                             json={"prompt": [1, 2, 3], "stream": True}) as r:
                        events = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                    assert events[-1] == "data: [DONE]" and len(events) == 5
        finally:
            await server.stop()
        return frontend

    t = asyncio.run(main()).timings
    assert (len(t.before_s), len(t.first_s), len(t.token_s)) == (5, 5, 15)
    assert all(0 < x < 1 for x in [*t.before_s, *t.first_s, *t.token_s])
    assert t.summary().startswith("http layer: before Generate n=5 p50_us=")


@pytest.mark.parametrize("kw, flag", [({"backend": "rest"}, "--backend"),
                                      ({"backend": "openai", "http_url": "127.0.0.1:8000"}, "--http-url")])
def test_bench_backend_options_name_the_flag(kw, flag):
    from bench.main import BenchOptions

    with pytest.raises(ValueError, match=flag):
        BenchOptions(**kw)
    assert BenchOptions(backend="openai").http_url == "http://127.0.0.1:8000"
