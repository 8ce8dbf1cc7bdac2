"""A decode worker that stops answering without closing its connections (SIGSTOP): the router
takes its open calls away once health probes find it unhealthy and every request completes on
the other decode worker with exactly the fault-free tokens — mid-stream and before the first
token, with and without a client deadline, greedy and seeded. After SIGCONT the stopped worker
holds no blocks and no requests (issue 20)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.request

import pytest

from cli.client import frontend_stub
from cli.cluster import LocalCluster
from common.pb.tandem.v1 import discovery_pb2, frontend_pb2, sampling_pb2
from common.sampling_params import SamplingParams
from engine.model_source import TINY
from engine.reference import reference_generate
from engine.sampling import sample

pytestmark = pytest.mark.e2e
INTERVAL, TIMEOUT, THRESHOLD = 0.3, 0.3, 2  # router health settings: unhealthy ~0.9 s after the stop
# Detection (threshold × interval + the probe timeout) plus one re-prefill of a short prompt,
# tripled with 5 s to spare for a loaded 2-core machine; without failover the wait is unbounded.
BOUND_S = 3 * (THRESHOLD * INTERVAL + TIMEOUT) + 5.0
MAX_TOKENS = 32


def sampling(i: int) -> sampling_pb2.SamplingParams:
    if i % 2:
        return sampling_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.9, seed=500 + i)
    return sampling_pb2.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


def reference(model, prompt: list[int], s: sampling_pb2.SamplingParams) -> list[int]:
    if not s.HasField("temperature"):
        return reference_generate(model, prompt, MAX_TOKENS)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=s.temperature, seed=s.seed, ignore_eos=True)
    return reference_generate(model, prompt, MAX_TOKENS, sample_fn=lambda row, step: sample(row, params, step)[0])


def scrape(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {m[1]: float(m[2]) for m in re.finditer(r"^(\w+)(?:\{[^}]*\})? (\S+)$", text, re.M)}


def test_sigstopped_decode_worker_every_request_moves_with_exact_tokens(tiny_model, tmp_path):
    prompts = [[(37 * i + 11 * j) % 150000 + 1 for j in range(12 + i)] for i in range(12)]

    async def main():
        cluster = LocalCluster(model=TINY, namespace="e2e-stuck", num_decode=2, log_dir=str(tmp_path), metrics=True,
                               router_args=["--health-interval", str(INTERVAL), "--health-timeout", str(TIMEOUT),
                                            "--health-failure-threshold", str(THRESHOLD)])
        async with cluster:
            ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
            ids = {n: next(i for i, inst in cluster.instances.items() if inst.role == discovery_pb2.ROLE_DECODE
                           and i in (tmp_path / f"{n}.log").read_text()) for n in ("decode-0", "decode-1")}
            metrics = cluster.metrics_addresses()
            router_metrics = next(a for i, a in metrics.items()
                                  if cluster.instances[i].role == discovery_pb2.ROLE_ROUTER)

            async def one(i: int, stamps: list[float], started: asyncio.Event | None = None,
                          everyone: list[list[float]] | None = None):
                out: list[int] = []
                # Even streams set no deadline: the router's --default-deadline bounds its own calls.
                kw = {"timeout": 120} if i % 3 == 0 else {}
                async for msg in stub.Generate(frontend_pb2.GenerateRequest(token_ids=prompts[i],
                                                                            sampling=sampling(i)), **kw):
                    out += msg.token_ids
                    stamps.append(time.monotonic())
                    if started is not None and all(len(s) >= 3 for s in everyone):
                        started.set()
                return out

            async def healthy_decodes() -> int:
                resp = await stub.ExplainRoute(frontend_pb2.GenerateRequest(token_ids=[1]), timeout=5)
                return sum(c.role == "decode" for c in resp.candidates)

            # Mid-stream: 6 streams on both workers, each past its third token; stop decode-0.
            stamps: list[list[float]] = [[] for _ in range(6)]
            started = asyncio.Event()
            tasks = [asyncio.create_task(one(i, stamps[i], started, stamps)) for i in range(6)]
            await asyncio.wait_for(started.wait(), 60)
            pid = cluster.procs["decode-0"].pid
            os.kill(pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            try:
                mid = await asyncio.wait_for(asyncio.gather(*tasks), 90)
            finally:
                os.kill(pid, signal.SIGCONT)
            gaps = [max((b - a for a, b in zip(s, s[1:]) if b > stopped_at), default=0.0) for s in stamps]
            migrated = scrape(router_metrics)["tandem_router_migrations_total"]

            # Before the first token: decode-0 is back; stop decode-1 and send 6 new requests at once.
            deadline = time.monotonic() + 30
            while await healthy_decodes() < 2:
                assert time.monotonic() < deadline, "decode-0 did not come back after SIGCONT"
                await asyncio.sleep(0.1)
            pid = cluster.procs["decode-1"].pid
            os.kill(pid, signal.SIGSTOP)
            sent = time.monotonic()
            first = [[] for _ in range(6, 12)]
            try:
                before = await asyncio.wait_for(asyncio.gather(*(one(i, first[i - 6]) for i in range(6, 12))), 90)
            finally:
                os.kill(pid, signal.SIGCONT)
            ttft = [s[0] - sent for s in first]
            retried = scrape(router_metrics)["tandem_router_retries_total"]

            # After SIGCONT: the stopped workers hold nothing (their calls were cancelled).
            deadline = time.monotonic() + 30
            while True:
                held = {n: scrape(metrics[ids[n]]) for n in ids}
                left = {n: (m["tandem_worker_kv_used_blocks"], m["tandem_worker_requests_in_flight"])
                        for n, m in held.items()}
                if all(v == (0, 0) for v in left.values()):
                    break
                assert time.monotonic() < deadline, f"blocks or requests left behind: {left}"
                await asyncio.sleep(0.2)
            await ch.close()
            return mid + before, gaps, ttft, migrated, retried

    results, gaps, ttft, migrated, retried = asyncio.run(main())
    for i, got in enumerate(results):
        assert got == reference(tiny_model.model, prompts[i], sampling(i)), f"stream {i} differs"
    assert migrated >= 1 and retried >= 1, (migrated, retried)
    assert max(gaps) < BOUND_S, f"a migrated stream paused {max(gaps):.1f} s (bound {BOUND_S:.1f} s)"
    assert max(ttft) < BOUND_S + 2, f"a request waited {max(ttft):.1f} s for its first token"
