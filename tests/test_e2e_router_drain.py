"""SIGTERM on the router (real processes): NOT_SERVING, DRAINING in etcd, new Generate calls
refused with UNAVAILABLE, the streams in flight finish with all their tokens, exit 0 within
--drain-timeout; a second signal exits at once."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cli.client import frontend_stub
from cli.cluster import LocalCluster
from common.grpc_server import channel
from common.pb.tandem.v1 import discovery_pb2, frontend_pb2, sampling_pb2
from discovery.watcher import InstanceWatcher
from engine.model_source import TINY
from engine.reference import reference_generate

pytestmark = pytest.mark.e2e

DRAIN_TIMEOUT_S = 60.0


def _request(prompt: list[int], max_tokens: int) -> frontend_pb2.GenerateRequest:
    return frontend_pb2.GenerateRequest(token_ids=prompt, sampling=sampling_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True))


async def _stream(stub, prompt: list[int], max_tokens: int, started: asyncio.Event, counter: list[int],
                  n: int) -> list[int]:
    tokens: list[int] = []
    async for msg in stub.Generate(_request(prompt, max_tokens), timeout=180):
        if msg.token_ids and not tokens:
            counter[0] += 1
            if counter[0] == n:
                started.set()
        tokens += list(msg.token_ids)
    return tokens


async def _router_state(watcher: InstanceWatcher) -> int | None:
    routers = [i for i in watcher.instances().values() if i.role == discovery_pb2.ROLE_ROUTER]
    return routers[0].state if routers else None


def test_router_drains_twenty_streams_on_sigterm(tiny_model, tmp_path):
    prompts = [[100 + i, 7, 8, 9, 10 + i] for i in range(20)]
    max_tokens = 40

    async def main():
        cluster = LocalCluster(model=TINY, tls=False, namespace="e2e-router-drain", worker_args=["--num-blocks", "1024"],
                               router_args=["--drain-timeout", str(DRAIN_TIMEOUT_S)], log_dir=str(tmp_path))
        async with cluster:
            ch, stub = frontend_stub(cluster.router_address)
            started, counter = asyncio.Event(), [0]
            try:
                streams = [asyncio.create_task(_stream(stub, p, max_tokens, started, counter, len(prompts)))
                           for p in prompts]
                await asyncio.wait_for(started.wait(), 120)  # all 20 streaming
                router = cluster.procs["router"]
                router.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                async with InstanceWatcher(cluster.etcd_endpoint, cluster.namespace, tls=cluster.client_tls) as watcher:
                    while await _router_state(watcher) != discovery_pb2.INSTANCE_STATE_DRAINING:
                        assert time.monotonic() - signalled < 10, "router record never DRAINING"
                        await asyncio.sleep(0.02)
                async with channel(cluster.router_address) as probe:
                    health = await health_pb2_grpc.HealthStub(probe).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in stub.Generate(_request([1, 2, 3], 2), timeout=10):
                        pass
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "draining" in refused.value.details()
                in_flight_at_refusal = sum(not s.done() for s in streams)
                results = await asyncio.gather(*streams)
                code = await asyncio.to_thread(cluster.stop_process, "router", None, DRAIN_TIMEOUT_S + 10)
                exited_after = time.monotonic() - signalled
            finally:
                await ch.close()
        return results, code, exited_after, in_flight_at_refusal

    results, code, exited_after, in_flight = asyncio.run(main())
    assert in_flight > 0  # the refusal came while streams were still running
    for p, tokens in zip(prompts, results):
        assert tokens == reference_generate(tiny_model.model, p, max_tokens)
    assert code == 0
    assert exited_after < DRAIN_TIMEOUT_S


def test_second_sigterm_stops_the_router_at_once(tmp_path):
    async def main():
        cluster = LocalCluster(model=TINY, tls=False, num_prefill=0, namespace="e2e-router-drain2",
                               worker_args=["--num-blocks", "1024"], router_args=["--drain-timeout", "120"],
                               log_dir=str(tmp_path))
        async with cluster:
            ch, stub = frontend_stub(cluster.router_address)
            try:
                call = stub.Generate(_request([5, 6, 7], 2000), timeout=180)
                await call.read()  # streaming
                router = cluster.procs["router"]
                router.send_signal(signal.SIGTERM)
                await asyncio.sleep(1.0)
                assert router.poll() is None  # draining: the stream holds it
                router.send_signal(signal.SIGTERM)
                t0 = time.monotonic()
                code = await asyncio.to_thread(cluster.stop_process, "router", None, 10)
                call.cancel()
                return code, time.monotonic() - t0
            finally:
                await ch.close()

    code, took = asyncio.run(main())
    assert code == 1
    assert took < 5
