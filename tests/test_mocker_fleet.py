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
            return await run_load(cluster.router_address, reqs, speedup, timeout_s=120, progress=False)
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
