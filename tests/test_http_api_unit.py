"""Pieces of the HTTP API that need no cluster: the listening socket, the mapping of gRPC-side
field names and pydantic locations onto OpenAI parameters, the gRPC status → HTTP status table,
the generation routes' own ASGI entry (router/http_front.py) over a real uvicorn server with a
stand-in servicer."""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest

from router.http_api import STATUS, _listen, validate_port
from router.http_front import loc_name as _loc
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
    assert BenchOptions(backend="openai").http_url == ""  # the router's own, as ListModels gives it


class _Workers:
    model = "m"


class _StandIn:
    """A servicer whose Generate yields `n` responses, `delay_s` apart; records its calls."""

    def __init__(self, n: int = 4, delay_s: float = 0.0) -> None:
        from common.tokenizer import load_tokenizer
        self.workers, self.context_length, self.tokenizer = _Workers(), 4096, load_tokenizer(None)
        self.n, self.delay_s, self.calls, self.cancelled = n, delay_s, [], 0

    async def Generate(self, req, ctx):
        from common.pb.tandem.v1 import frontend_pb2 as pb
        from common.pb.tandem.v1 import sampling_pb2
        self.calls.append(req)
        try:
            for i in range(self.n):
                await asyncio.sleep(self.delay_s)
                last = i == self.n - 1
                yield pb.GenerateResponse(token_ids=[100 + i], text=f"t{i}", finish_reason=(
                    sampling_pb2.FINISH_REASON_LENGTH if last else 0), usage=pb.Usage(completion_tokens=i + 1))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def _serve(servicer, fn):
    """Run `fn(base_url)` (async) against a real uvicorn server of the HTTP API."""
    from prometheus_client import CollectorRegistry

    from router.chat_template import load_chat_template
    from router.http_api import HttpServer, OpenAIFrontend, create_app

    async def main():  # with a metrics registry, as a router's (its responses counted through a wrapped send)
        server = HttpServer(create_app(OpenAIFrontend(servicer, load_chat_template(None), CollectorRegistry())),
                            "127.0.0.1", 0)
        await server.start()
        try:
            return await fn(f"http://{server.address}")
        finally:
            await server.stop()
    return asyncio.run(main())


def test_generation_routes_refuse_bad_bodies_by_name():
    """The generation routes' own entry answers like the FastAPI routes: 400 naming the field or
    saying the JSON is invalid (also for numbers outside the gRPC request's int32 fields), 413
    over the body limit with the connection closed (from the Content-Length header, or once a
    chunked body passes the limit), 405 with Allow for another method; nothing of it reaches
    Generate, and a body sent without a JSON Content-Type is still read as JSON."""
    import httpx

    from router.http_front import MAX_BODY
    servicer = _StandIn()

    async def fn(base):
        async with httpx.AsyncClient(base_url=base) as c:
            r = [await c.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"}),
                 await c.post("/v1/chat/completions", json={"messages": [{"content": "hi"}]}),
                 await c.post("/v1/completions", content=b"{not json"),
                 await c.post("/v1/completions", content=b"[1, 2]"),
                 await raw(base, b"Content-Length: %d\r\n\r\n" % (MAX_BODY + 1)),  # refused from the header
                 await raw(base, b"Transfer-Encoding: chunked\r\n\r\n"  # refused once over the limit
                           + b"%x\r\n" % (MAX_BODY + 1) + b" " * (MAX_BODY + 1) + b"\r\n0\r\n\r\n"),
                 await c.get("/v1/completions"),
                 await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2 ** 31}),
                 await c.post("/v1/completions", json={"prompt": [5, 2 ** 31]}),
                 await c.post("/v1/completions", json={"prompt": "x", "stream": "x"}),
                 await c.post("/v1/completions", json={"prompt": "x", "stream": True,
                                                       "stream_options": {"include_usage": "maybe"}})]
            ok = await c.post("/v1/completions", content=b'{"prompt": [1, 2], "max_tokens": 4}',
                              headers={"content-type": "application/x-www-form-urlencoded"})
            return r, ok

    async def raw(base, rest: bytes):
        """POST /v1/completions over a socket of its own: (status, whether the server then closed it)."""
        host, port = base.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + rest)
        try:
            await writer.drain()
        except ConnectionError:
            pass  # the server closed while the body was still going out
        data = await reader.read()  # until the server closes the connection
        writer.close()
        return int(data.split(b" ", 2)[1]), data.split(b"\r\n\r\n", 1)[1]

    (bad_int, missing, not_json, not_object, too_big, too_big_chunked, get, huge_max, huge_id, stream,
     stream_opt), ok = _serve(servicer, fn)
    assert bad_int.status_code == 400 and bad_int.json()["error"]["param"] == "max_tokens"
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages[0].role"
    assert not_json.status_code == 400 and "not valid JSON" in not_json.json()["error"]["message"]
    assert not_object.status_code == 400 and not_object.json()["error"]["type"] == "invalid_request_error"
    for status, body in (too_big, too_big_chunked):  # and the connection closed (reader.read() returned)
        assert status == 413 and str(MAX_BODY).encode() in body
    assert get.status_code == 405 and "GET not allowed" in get.json()["error"]["message"]
    assert get.headers["allow"] == "POST"
    # outside the gRPC request's int32 fields: a 400 naming the parameter, not a 500
    assert huge_max.status_code == 400 and huge_max.json()["error"]["param"] == "max_tokens"
    assert huge_id.status_code == 400 and huge_id.json()["error"]["param"] == "prompt[1]"
    assert stream.status_code == 400 and stream.json()["error"]["param"] == "stream"
    assert stream_opt.status_code == 400 and stream_opt.json()["error"]["param"] == "stream_options.include_usage"
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "t0t1t2t3", ok.text
    assert len(servicer.calls) == 1 and list(servicer.calls[0].token_ids) == [1, 2]


def test_disconnect_at_once_cancels_the_call_and_answers_nothing():
    """A client whose disconnect is the next ASGI message after its body (before the first
    response) cancels the call; the route answers 499 to nobody instead of waiting for ever."""
    from router.chat_template import load_chat_template
    from router.http_api import OpenAIFrontend, create_app

    servicer = _StandIn(n=4, delay_s=0.05)
    app = create_app(OpenAIFrontend(servicer, load_chat_template(None), None))
    body = b'{"prompt": [1, 2, 3], "stream": true}'
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"host", b"x")], "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
    messages = [{"type": "http.request", "body": body, "more_body": False}, {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(msg):
        sent.append(msg)

    async def main():
        await asyncio.wait_for(app(scope, receive, send), 5)
        await asyncio.sleep(0.1)  # the call's task finishes its cancellation

    asyncio.run(main())
    assert sent and sent[0]["status"] == 499 and all(m.get("more_body") is not True for m in sent)
    assert len(servicer.calls) <= 1 and servicer.cancelled == len(servicer.calls)


def test_client_leaving_mid_stream_cancels_the_call():
    """Over a real server: the client closes a streamed response after its first event; the
    call's Generate is cancelled (the decode call and its KV blocks go with it)."""
    import httpx

    servicer = _StandIn(n=50, delay_s=0.02)

    async def fn(base):
        async with httpx.AsyncClient(base_url=base) as c:
            async with c.stream("POST", "/v1/completions", json={"prompt": [1], "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break
        for _ in range(100):
            if servicer.cancelled:
                return
            await asyncio.sleep(0.02)

    _serve(servicer, fn)
    assert servicer.cancelled == 1


@pytest.mark.parametrize("chat", [False, True])
def test_text_events_equal_the_encoded_chunk(chat):
    """The per-token event built from cached bytes is byte for byte the chunk object's event."""
    from router.http_api import TextEvents, _sse
    from router.openai_protocol import ResponseShape

    shape = ResponseShape(chat, 'req-"1"\\', "tandem-tiny")
    events = TextEvents(shape)
    for text in ["x", " the", '"quoted" \\ back', "line\nbreak\t", "é ü 漢字 🙂", "\x01\x1f", "null"]:
        assert events(text) == _sse(shape.chunk(text, None, None)), text


@pytest.mark.parametrize("stream", [True, False])
def test_client_gone_after_pipelining_a_second_request_cancels_the_call(stream):
    """uvicorn tells a disconnect only to a connection's last request: a client that pipelined
    a second request behind a long one and closed the socket must still cancel the first call
    (Generation.watch polls the connection), not leave it running to its max_tokens."""
    servicer = _StandIn(n=200, delay_s=0.02)  # 4 s if nobody cancels it

    async def fn(base):
        host, port = base.removeprefix("http://").split(":")
        body = b'{"prompt": [1, 2], "stream": %s}' % (b"true" if stream else b"false")
        one = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(one + one)  # the second request waits behind the first on this connection
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.close()
        t0 = time.perf_counter()
        while not servicer.cancelled and time.perf_counter() - t0 < 3:
            await asyncio.sleep(0.02)
        return time.perf_counter() - t0

    waited = _serve(servicer, fn)
    assert servicer.cancelled >= 1 and waited < 1.5, (servicer.cancelled, waited)


@pytest.mark.parametrize("message, param, said", [({"role": "bot", "content": "x"}, "messages[1].role", "must be one of"),
                                                  ({"role": "user"}, "messages[1].content", "a user message needs content")])
def test_a_bad_chat_message_is_named_by_its_index(message, param, said):
    """The message at fault, not the template's error about all of them (param "messages")."""
    from common.validation import InvalidArgument
    req = ChatCompletionRequest(messages=[{"role": "system", "content": "s"}, message])
    with pytest.raises(InvalidArgument, match=said) as exc:
        req.template_messages()
    assert exc.value.field == param
    # an assistant turn of tool calls has no content: still accepted
    assert ChatCompletionRequest(messages=[{"role": "assistant"}]).template_messages()[0]["content"] == ""


@pytest.mark.parametrize("prompt, field", [("", "prompt"), ([], "prompt"), ([""], "prompt[0]"), (["a", ""], "prompt[1]")])
def test_an_empty_completion_prompt_names_prompt(prompt, field):
    from common.validation import InvalidArgument
    with pytest.raises(InvalidArgument, match=rf"{field.replace('[', '.').replace(']', '.')}: is empty") as exc:
        CompletionRequest(prompt=prompt).to_generate("r")
    assert exc.value.field == field


def test_choices_of_a_batch_with_n_their_ids_seeds_and_order():
    from common.pb.tandem.v1 import frontend_pb2 as pb
    from router.openai_protocol import MAX_CHOICES, usage
    from common.validation import MAX_REQUEST_ID_CHARS
    rid = "x" * 128
    choices = CompletionRequest(prompt=[[1, 2], [4, 5], [3]], n=2, seed=2 ** 64 - 1, temperature=1.0).to_generate(rid)
    assert [(c.index, c.prompt_index) for c in choices] == [(0, 0), (1, 0), (2, 1), (3, 1), (4, 2), (5, 2)]
    assert [c.request.sampling.seed for c in choices] == [2 ** 64 - 1, 0] * 3  # seed + j, mod 2^64
    assert [list(c.request.token_ids) for c in choices] == [[1, 2], [1, 2], [4, 5], [4, 5], [3], [3]]
    assert [c.request.text for c in CompletionRequest(prompt=["a", "b"]).to_generate("r")] == ["a", "b"]
    assert all(len(c.request.request_id) <= MAX_REQUEST_ID_CHARS for c in choices)
    ids = [c.request.request_id for c in choices]
    assert len(set(ids)) == 6 and ids[5].endswith("-5") and ids[0].startswith("x" * 100)
    # a per-request tag: choice 1 of request "abc" is not a request whose own id is "abc-1"
    other = CompletionRequest(prompt=[[1, 2], [4, 5], [3]], n=2).to_generate(rid)
    assert not {c.request.request_id for c in other} & set(ids)
    two = [c.request.request_id for c in CompletionRequest(prompt="p", n=2).to_generate("abc")]
    assert two[1] != "abc-1" and two[1].startswith("abc-") and two[1].endswith("-1")
    one = CompletionRequest(prompt=[[1, 2]]).to_generate("r")  # a batch of one: prompt[0], as sent
    assert [(c.index, c.prompt_index, c.request.request_id) for c in one] == [(0, 0, "r")]
    assert CompletionRequest(prompt=[1, 2]).to_generate("r")[0].prompt_index is None
    assert len(CompletionRequest(prompt="a", n=MAX_CHOICES).to_generate("r")) == MAX_CHOICES
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], n=3).to_generate("c", "hi")
    assert [c.request.request_id[:2] + c.request.request_id[-2:] for c in chat] == ["c--0", "c--1", "c--2"]
    assert not chat[0].request.sampling.HasField("seed")
    # each prompt counted once (its first choice's), every choice's completion tokens
    parts = [pb.Usage(prompt_tokens=p, completion_tokens=k, cached_tokens=c)
             for p, k, c in [(2, 5, 0), (2, 4, 2), (7, 3, 1), (7, 1, 7)]]
    assert usage(parts, 2) == {"prompt_tokens": 9, "completion_tokens": 13, "total_tokens": 22,
                               "prompt_tokens_details": {"cached_tokens": 1}}


def test_a_chat_reply_also_stops_at_the_models_end_of_turn():
    from common.validation import InvalidArgument
    msgs = [{"role": "user", "content": "hi"}]
    stops = lambda **kw: list(ChatCompletionRequest(messages=msgs, **kw).to_generate("c", "p", ("\n\n",))[0]
                              .request.sampling.stop)
    assert stops() == ["\n\n"] and stops(stop="x") == ["x", "\n\n"] and stops(stop=["\n\n", "y"]) == ["\n\n", "y"]
    assert stops(stop=["s"] * 15) == ["s"] * 15 + ["\n\n"]
    with pytest.raises(InvalidArgument, match="16 stop strings; at most 15 here") as exc:
        stops(stop=[str(i) for i in range(16)])
    assert exc.value.field == "stop"
    # a completion has no turns: only its own stop strings
    assert list(CompletionRequest(prompt="p", stop="x").to_generate("r")[0].request.sampling.stop) == ["x"]


def test_loc_name_skips_union_members_and_brackets_object_keys():
    from router.http_front import loc_name
    assert loc_name(("messages", 0, "content", "list[ContentPart]", 0, "text")) == "messages[0].content[0].text"
    assert loc_name(("body", "prompt", "list[int]", 1)) == "prompt[1]"
    assert loc_name(("logit_bias", "50")) == "logit_bias[50]" and loc_name(("logit_bias", "abc")) == "logit_bias.abc"
    assert loc_name(("stream_options", "include_usage")) == "stream_options.include_usage"


def test_plain_http_to_the_https_port_is_logged_and_the_port_keeps_serving(tmp_path, caplog):
    """A real uvicorn server over real TLS (a local CA's certificate): plain HTTP sent to it gets
    nothing that parses, and the router logs one warning saying so (asyncio drops TLS handshake
    errors silently); two more within the minute are counted, not logged; a client that trusts the
    certificate is still served; one that does not trust it is not counted as plain HTTP."""
    import logging

    import httpx

    from common.certs import LocalCa
    from router.http_api import HttpServer

    files = LocalCa(tmp_path / "ca").issue("router", ("router",))

    async def app(scope, receive, send):  # the smallest ASGI app: 200 "ok"
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    async def main() -> HttpServer:
        server = HttpServer(app, "127.0.0.1", 0, tls_cert=files.cert, tls_key=files.key)
        await server.start()
        try:
            async with httpx.AsyncClient(timeout=10) as plain:
                for _ in range(3):
                    with pytest.raises(httpx.HTTPError):
                        await plain.get(f"http://{server.address}/")
            async with httpx.AsyncClient(timeout=10) as untrusting:  # the system's CAs: handshake refused
                with pytest.raises(httpx.ConnectError):
                    await untrusting.get(f"https://{server.address}/")
            async with httpx.AsyncClient(verify=files.ca, timeout=10) as client:
                r = await client.get(f"https://{server.address}/")
            assert r.status_code == 200 and r.text == "ok"
        finally:
            await server.stop()
        return server

    with caplog.at_level(logging.WARNING, logger="router.http_port"):
        server = asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "router.http_port"]
    assert server.plain_http.total == 3
    assert len(lines) == 1 and "plain HTTP reached the HTTPS API port (1 connection since" in lines[0], lines
    assert "https://" in lines[0]


def test_x_request_id_is_the_requests_id_or_refused_by_name():
    """A client's X-Request-Id names the request (echoed, and the Generate call's id); one
    longer than the gRPC API's limit, or with bytes no printable ASCII, is a 400 naming the
    header, not an id cut short or re-encoded."""
    import httpx
    servicer = _StandIn(n=1)

    async def fn(base):
        async with httpx.AsyncClient() as http:
            body = {"prompt": [1, 2], "max_tokens": 1}
            ok = await http.post(base + "/v1/completions", json=body, headers={"X-Request-Id": "job-7"})
            long = await http.post(base + "/v1/completions", json=body, headers={"X-Request-Id": "x" * 129})
            odd = await http.post(base + "/v1/completions", json=body, headers={"X-Request-Id": "bad id/\xfc".encode("latin-1")})
            return ok, long, odd

    ok, long, odd = _serve(servicer, fn)
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "job-7" and ok.json()["id"].endswith("job-7")
    assert servicer.calls[0].request_id.startswith("job-7")
    for r, said in ((long, "129 characters; at most 128"), (odd, "printable ASCII")):
        assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Id", r.text
        assert said in r.json()["error"]["message"], r.text
    assert len(servicer.calls) == 1  # the refused ones reached no Generate


@pytest.mark.parametrize("model, body, param, said", [
    ("completion", '{"prompt": 5}', "prompt",
     "prompt: must be a string, an array of integers, an array of strings or an array of arrays of integers"),
    ("completion", '{"prompt": ["a", [1, 2]]}', "prompt", "an array of arrays of integers"),
    ("completion", '{"prompt": "a", "stop": ["a", 5]}', "stop[1]", "stop[1]: Input should be a valid string"),
    ("chat", '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
     "messages[0].content[0].text", "Input should be a valid string"),
    ("completion", '{"prompt": "a", "logit_bias": {"list[x]": "y"}}', "logit_bias", "valid number"),
    ("completion", '{"prompt": "a", "stop": 5}', "stop", "stop: must be a string or an array of strings"),
    ("chat", '{"messages": []}', "messages", "messages: must not be empty"),
    ("chat", '{"messages": [{"role": "user", "content": 5}]}', "messages[0].content",
     "must be a string or an array of objects"),
    ("completion", '{"prompt": "a", "max_tokens": "x"}', "max_tokens", "max_tokens: Input should be a valid integer")])
def test_a_wrong_type_says_every_form_the_parameter_takes(model, body, param, said):
    """pydantic's first error of a union names its first member only ("Input should be a valid
    string" for a prompt of token ids gone wrong): the 400 names the parameter and all its forms."""
    import json

    from pydantic import ValidationError

    from router.http_front import validation_error
    cls = ChatCompletionRequest if model == "chat" else CompletionRequest
    with pytest.raises(ValidationError) as exc:
        cls.model_validate_json(body)
    error = json.loads(validation_error(exc.value.errors(include_url=False)).body)["error"]
    assert error["param"] == param and said in error["message"], error


@pytest.mark.parametrize("extra, param", [({"functions": [{"name": "f"}]}, "functions"),
                                          ({"function_call": {"name": "f"}}, "function_call"),
                                          ({"tool_choice": "required"}, "tool_choice"),
                                          ({"tool_choice": {"type": "function", "function": {"name": "f"}}},
                                           "tool_choice")])
def test_tool_calls_in_any_form_are_refused_by_name(extra, param):
    """The older `functions` / `function_call` and a `tool_choice` that asks for a call are
    refused as `tools` is (they were taken and ignored); "none" and "auto" stay no-ops."""
    from common.validation import InvalidArgument
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InvalidArgument) as exc:
        ChatCompletionRequest(messages=messages, **extra).to_generate("r", "hi")
    assert exc.value.field == param
    for noop in ({"tool_choice": "none"}, {"tool_choice": "auto"}, {"function_call": "none"}, {"functions": []}):
        assert ChatCompletionRequest(messages=messages, **noop).to_generate("r", "hi")
