"""`tandem bench --backend openai`: one request to the router's OpenAI-compatible HTTP API.

The same request as the gRPC client's (bench/client.py): greedy unless --temperature, `ignore_eos`,
token ids or text, streamed as server-sent events from POST /v1/completions. `logprobs: 0` (or
--top-logprobs k) makes every event carry its tokens, so each one is timed with its exact token
count, as gRPC messages are.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from bench.client import GREEDY, BenchSampling, RequestResult
from bench.traces import BenchRequest


def completion_body(req: BenchRequest, model: str, sampling: BenchSampling = GREEDY) -> dict:
    """The /v1/completions body of `req` under `sampling` (bench/client.py BenchSampling)."""
    tokens = req.prompt_tokens()
    body = {"model": model, "prompt": tokens if tokens else req.text, "max_tokens": req.output_len,
            "temperature": sampling.temperature, "ignore_eos": True, "stream": True,
            "logprobs": sampling.top_logprobs, "stream_options": {"include_usage": True}}
    if sampling.temperature > 0:
        body["seed"] = sampling.seed_of(req)
    return body


async def one_openai(http: aiohttp.ClientSession, base_url: str, model: str, req: BenchRequest, t0: float,
                     timeout_s: float, sampling: BenchSampling = GREEDY) -> RequestResult:
    res = RequestResult(req.index, start_s=time.perf_counter() - t0)
    begin = time.perf_counter()
    try:
        async with http.post(f"{base_url}/v1/completions", json=completion_body(req, model, sampling),
                             headers={"X-Request-Id": f"bench-{req.index}"},
                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status != 200:
                try:
                    err = json.loads(await r.read()).get("error", {})
                except ValueError:
                    err = {}
                res.error = f"HTTP {r.status}: {err.get('message', '')}"
            else:
                async for raw in r.content:  # one line per iteration
                    line = raw.decode().rstrip("\r\n")
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    now = time.perf_counter()
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        res.error = chunk["error"].get("message", "error")
                        break
                    if chunk.get("usage"):
                        u = chunk["usage"]
                        res.prompt_tokens, res.completion_tokens = u["prompt_tokens"], u["completion_tokens"]
                        res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                    for choice in chunk.get("choices", ()):
                        n = len((choice.get("logprobs") or {}).get("tokens") or ())
                        if n:
                            if res.ttft_s is None:
                                res.ttft_s = now - begin
                            res.chunks.append((now - t0, n))
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, aiohttp.ServerDisconnectedError) and base_url.startswith("http://"):
            # what plain HTTP to a port serving HTTPS gets: the TLS server drops the request unanswered
            res.error += f" (if that port serves HTTPS, give --http-url {base_url.replace('http://', 'https://', 1)})"
    res.end_s = time.perf_counter() - t0
    return res
