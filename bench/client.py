"""The load generator: sends BenchRequests to a router's FrontendService.Generate and times them.

Each request starts at its arrival time divided by `speedup` (trace timestamps, or a Poisson
process), or — with `concurrency` > 0 — as soon as one of `concurrency` slots is free. Every
streamed message is timed; results are in real seconds (bench/metrics.py scales them back to
trace time by `speedup`). Token-id prompts are sent as token ids, text prompts as text.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass, field

import grpc

from bench.traces import BenchRequest
from common.grpc_server import channel
from common.pb.tandem.v1 import frontend_pb2, frontend_pb2_grpc, sampling_pb2


@dataclass
class RequestResult:
    index: int
    start_s: float = 0.0  # real seconds after the run's start
    ttft_s: float | None = None  # real seconds from start to the first token
    end_s: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (seconds after start, tokens)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


@dataclass(frozen=True)
class BenchSampling:
    """How every bench request samples: greedy by default; with temperature > 0 request i draws
    with seed `seed + i` modulo 2^64 (a run reproduces its tokens); top_logprobs: each generated token's
    k likeliest alternatives are asked for too (0..20), as a client reading them would."""

    temperature: float = 0.0
    top_logprobs: int = 0
    seed: int = 0

    def seed_of(self, req: BenchRequest) -> int:
        """Request `req`'s seed: seed + its index, modulo 2^64 (the seeds' range)."""
        return (self.seed + req.index) % 2 ** 64

    def proto(self, req: BenchRequest) -> sampling_pb2.SamplingParams:
        """The gRPC API's sampling parameters of `req` (max_tokens its output length, ignore_eos)."""
        params = sampling_pb2.SamplingParams(max_tokens=req.output_len, temperature=self.temperature,
                                             ignore_eos=True, top_logprobs=self.top_logprobs)
        if self.temperature > 0:
            params.seed = self.seed_of(req)
        return params


GREEDY = BenchSampling()


async def _one(stub: frontend_pb2_grpc.FrontendServiceStub, req: BenchRequest, t0: float, timeout_s: float,
               sampling: BenchSampling = GREEDY) -> RequestResult:
    res = RequestResult(req.index, start_s=time.perf_counter() - t0)
    msg = frontend_pb2.GenerateRequest(
        request_id=f"bench-{req.index}", text=req.text, token_ids=req.prompt_tokens(), sampling=sampling.proto(req))
    begin = time.perf_counter()
    try:
        async for out in stub.Generate(msg, timeout=timeout_s):
            now = time.perf_counter()
            if out.token_ids:
                if res.ttft_s is None:
                    res.ttft_s = now - begin
                res.chunks.append((now - t0, len(out.token_ids)))
            if out.HasField("usage"):
                res.prompt_tokens = out.usage.prompt_tokens
                res.completion_tokens = out.usage.completion_tokens
                res.cached_tokens = out.usage.cached_tokens
    except grpc.aio.AioRpcError as exc:
        res.error = f"{exc.code().name}: {exc.details()}"
    res.end_s = time.perf_counter() - t0
    return res


def _http_client(http_url: str, connections: int, api_key: str = "", ca_file: str = ""):
    """An aiohttp session with a connection per request in flight (sending `api_key` as a
    bearer token), or a null context without http_url. aiohttp, not httpx: its C parser keeps
    the client's own cost out of the TTFT it reports (on the 2-core machine httpx's pure-Python
    HTTP/1.1 added about 2.4 ms to a streamed request's TTFT, aiohttp about 0.3 ms)."""
    import contextlib
    if not http_url:
        return contextlib.nullcontext()
    import aiohttp
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=connections, ssl=_https_trust(ca_file)),
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else None)


def _https_trust(ca_file: str = ""):
    """The certificates an https:// --http-url may chain to: the system's (SSL_CERT_FILE), the
    cluster CA of --tls-ca (a router's --http-tls-cert issued by `tandem certs`, or `tandem up
    --https`), and --http-ca (a CA of the HTTP API's own)."""
    import ssl

    from common import tls
    context = ssl.create_default_context()
    if ca_file:
        context.load_verify_locations(cafile=ca_file)
    if tls.TLS is not None and tls.TLS.ca:
        context.load_verify_locations(cadata=tls.TLS.ca.decode())
    return context


PROGRESS_EVERY_S = 15.0  # a progress line this often when stderr is not a terminal


def progress_line(results: list, seconds: float) -> str:
    """How far a run is: requests done of all, and where some failed, how many and the first
    one's error (so a run that fails request after request says why at once, not at its end)."""
    done = [r for r in results if r is not None]
    failed = [r for r in done if not r.ok]
    said = ""
    if failed:
        first = min(failed, key=lambda r: r.end_s).error
        said = f" ({len(failed)} failed; the first: {first[:200]})"
    return f"tandem bench: {len(done)}/{len(results)} requests done{said}, {seconds:.0f} s"


async def _progress_lines(results: list, t0: float) -> None:
    """Every PROGRESS_EVERY_S: `progress_line` on stderr."""
    while True:
        await asyncio.sleep(PROGRESS_EVERY_S)
        print(progress_line(results, time.perf_counter() - t0), file=sys.stderr, flush=True)


@dataclass
class LoadState:
    """What `run_load` has so far, readable by its caller after an interrupt (Ctrl-C): each
    request's result (None while in flight or not sent) and the run's start
    (time.perf_counter(); None before the first request)."""

    results: list = field(default_factory=list)
    t0: float | None = None

    def finished(self) -> tuple[list[RequestResult], float]:
        """The finished requests' results and the wall seconds since the start."""
        wall = time.perf_counter() - self.t0 if self.t0 is not None else 0.0
        return [r for r in self.results if r is not None], wall


async def run_load(router: str, reqs: list[BenchRequest], speedup: float = 1.0, concurrency: int = 0,
                   timeout_s: float = 600.0, progress: bool = True, http_url: str = "",
                   model: str = "", creds=None, api_key: str = "", connections: int = 1, http_ca: str = "",
                   sampling: BenchSampling = GREEDY, state: LoadState | None = None
                   ) -> tuple[list[RequestResult], float]:
    """Send every request; returns (results in request order, wall seconds of the run).

    With `http_url` (e.g. "http://127.0.0.1:8000") the requests go to that OpenAI-compatible
    API for `model` (bench/openai_client.py) instead of `router`'s gRPC API. `creds`
    (common.tls.TlsCredentials): TLS to the router (default: this process's, common/tls.py).
    `api_key`: sent as a bearer token on both APIs (a router with --api-keys). `http_ca`: a CA
    file an https:// API's certificate may chain to, besides the system's and the router's
    TLS CA (`creds`). `connections`:
    gRPC channels of their own TCP connection, request i on channel i mod connections (router
    replicas sharing one port each take some of the connections). `sampling`: every request's
    (`BenchSampling`; greedy by default). `state`: filled as the run goes (`LoadState`), so a
    caller interrupted mid-run can still report the requests that finished."""
    from tqdm import tqdm

    # disable=None: tqdm turns itself off when stderr is not a terminal (logs stay readable);
    # there a line every PROGRESS_EVERY_S says how far the run is instead
    bar = tqdm(total=len(reqs), unit="req", disable=None if progress else True, dynamic_ncols=True)
    lines = progress and not sys.stderr.isatty()
    state = state if state is not None else LoadState()
    state.results = results = [None] * len(reqs)
    from cli.client import bearer_token
    token = bearer_token(api_key) if api_key else ()
    async with contextlib.AsyncExitStack() as stack, _http_client(http_url, concurrency or len(reqs), api_key, http_ca) as http:
        chans = [await stack.enter_async_context(channel(router, creds, token, own_connection=connections > 1))
                 for _ in range(connections)]
        stubs = [frontend_pb2_grpc.FrontendServiceStub(ch) for ch in chans]
        await asyncio.gather(*(ch.channel_ready() for ch in chans))
        t0 = state.t0 = time.perf_counter()

        def send(i: int, req: BenchRequest):
            if http is None:
                return _one(stubs[i % len(stubs)], req, t0, timeout_s, sampling)
            from bench.openai_client import one_openai
            return one_openai(http, http_url, model, req, t0, timeout_s, sampling)
        slots = asyncio.Semaphore(concurrency) if concurrency > 0 else None

        async def fire(i: int, req: BenchRequest) -> None:
            if slots is None:
                delay = req.arrival_s / speedup - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                results[i] = await send(i, req)
            else:
                async with slots:
                    results[i] = await send(i, req)
            bar.update(1)
            if not results[i].ok:
                bar.set_postfix(failed=sum(1 for r in results if r is not None and not r.ok))

        ticker = asyncio.create_task(_progress_lines(results, t0)) if lines else None
        try:
            await asyncio.gather(*(fire(i, r) for i, r in enumerate(reqs)))
        finally:
            if ticker is not None:
                ticker.cancel()
        wall = time.perf_counter() - t0
    bar.close()
    return [r for r in results if r is not None], wall
