"""`tandem up --mocker 32` and `tandem bench`'s load generator: 1,000 requests of the shipped
Mooncake slice over the gRPC API (router in kv mode, 32 simulated workers in one process, each
its own server and etcd record), with no error."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace

import pytest

from bench import traces
from bench.client import run_load
from bench.metrics import summarize
from cli.cluster import LocalCluster

pytestmark = pytest.mark.e2e


def test_1000_requests_against_32_mocked_workers(monkeypatch, etcd_server):
    monkeypatch.setenv("TANDEM_BLOCK_SIZE", "512")  # router and mocker processes inherit it
    speedup = 100.0
    reqs = [replace(r, output_len=min(r.output_len, 32)) for r in traces.load_mooncake(traces.DEFAULT_TRACE, 151646)]
    assert len(reqs) == 1000

    async def go():
        cluster = LocalCluster(num_mocker=32, etcd=etcd_server.endpoint, namespace="mocker-fleet",
                               router_args=["--health-interval", "5"],
                               mocker_args=["--num-blocks", "512", "--speedup", str(speedup)], ready_timeout_s=120)
        await cluster.start()
        try:
            return await run_load(cluster.router_address, reqs, speedup, timeout_s=120, progress=False,
                                  creds=cluster.client_tls)
        finally:
            await cluster.stop()

    results, wall = asyncio.run(go())
    errors = [r.error for r in results if not r.ok]
    assert not errors, errors[:5]
    s = summarize(reqs, results, wall, speedup)
    assert s["completed"] == 1000
    assert s["total_output_tokens"] == sum(r.output_len for r in reqs)
    assert 0 < s["block_hit_rate"] <= traces.oracle_hit_rate(reqs)["block"] + 1e-9
    print(f"1000 requests, 32 mocked workers: {wall:.1f} s wall, load {os.getloadavg()[0]:.1f}, "
          f"hit {s['block_hit_rate']:.3f}")


def test_disaggregated_mocked_workers_in_process(etcd_server):
    """2 simulated prefill + 2 decode workers and a router on one loop: every prompt is
    prefilled remotely, and a group's shared prefix is found in the prefill workers' caches."""
    from common.pb.tandem.v1 import discovery_pb2
    from mocker.fleet import MockerOptions
    from mocker.fleet import run as run_mocker
    from router.main import RouterOptions
    from router.main import run as run_router

    ns = "mocker-disagg"

    async def go():
        loop = asyncio.get_running_loop()
        got_workers, got_router = loop.create_future(), loop.create_future()
        stop = asyncio.Event()
        mocker = asyncio.create_task(run_mocker(
            MockerOptions(num_workers=2, num_prefill=2, block_size=16, num_blocks=256, speedup=50,
                          etcd=etcd_server.endpoint, namespace=ns), ready=got_workers.set_result, stop=stop))
        router = asyncio.create_task(run_router(
            RouterOptions(etcd=etcd_server.endpoint, namespace=ns, model="tandem-mock", block_size=16, kv_recent_s=5.0),
            ready=lambda s, sv: got_router.set_result((s, sv)), stop=stop))
        workers = await asyncio.wait_for(got_workers, 60)
        server, servicer = await asyncio.wait_for(got_router, 60)
        for _ in range(200):
            if (len(servicer.workers.candidates(discovery_pb2.ROLE_PREFILL)) == 2
                    and len(servicer.workers.candidates(discovery_pb2.ROLE_DECODE)) == 2):
                break
            await asyncio.sleep(0.05)
        reqs = traces.poisson_arrivals(traces.synthetic_prefix(40, groups=2, prefix_len=256, suffix_len=32,
                                                               output_len=8, vocab=151646), rate=100.0)
        try:
            results, _ = await run_load(f"127.0.0.1:{server.port}", reqs, timeout_s=60, progress=False)
        finally:
            stop.set()
            await asyncio.gather(mocker, router)
        return results, workers

    results, workers = asyncio.run(go())
    assert [r.error for r in results if not r.ok] == []
    assert all(r.completion_tokens == 8 for r in results)
    prefill = [w.engine.stats for w in workers if w.role == discovery_pb2.ROLE_PREFILL]
    decode = [w.engine.stats for w in workers if w.role == discovery_pb2.ROLE_DECODE]
    assert sum(s.requests for s in prefill) == 40 and sum(s.prefill_tokens for s in decode) == 0
    assert sum(s.cached_tokens for s in prefill) >= 256 * 30  # all but a few find their group's prefix
