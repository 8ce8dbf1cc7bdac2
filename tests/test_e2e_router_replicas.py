"""Router replicas on one port (`tandem up --routers N`, `tandem router --reuse-port`): real
processes, etcd, mutual TLS and a mocker fleet. The kernel spreads connections over the
replicas, every replica serves, and the address keeps serving when one replica is killed."""

from __future__ import annotations

import asyncio
import signal
import urllib.request

import pytest

from bench.client import run_load
from bench.traces import synthetic_prefix
from cli.client import frontend_stub
from cli.cluster import LocalCluster
from cli.top import render
from common.pb.tandem.v1 import discovery_pb2, frontend_pb2
from router.main import RouterOptions

pytestmark = pytest.mark.e2e


def _served(metrics_address: str) -> float:
    """Finished Generate requests a router counted (tandem_router_requests_total, all outcomes)."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()  # noqa: S310
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tandem_router_requests_total{"))


def test_two_routers_share_one_port_and_the_address_survives_one(tmp_path):
    reqs = synthetic_prefix(48, 4, 64, 32, 8, 2000, seed=3)

    async def main():
        cluster = LocalCluster(num_mocker=2, num_routers=2, metrics=True, namespace="e2e-replicas",
                               log_dir=str(tmp_path), mocker_args=["--speedup", "20"])
        async with cluster:
            routers = {i.instance_id: i for i in cluster.instances.values() if i.role == discovery_pb2.ROLE_ROUTER}
            assert len(routers) == 2
            assert {r.address for r in routers.values()} == {cluster.router_address}  # one address
            # (ready means both were reached through it and see both workers)
            # discovery reaches each router's view a moment after readiness (which asks for the
            # workers, not the routers): each router names both within seconds
            ch, stub = frontend_stub(cluster.router_address, cluster.client_tls, own_connection=True)
            async with ch:
                for _ in range(100):
                    status = await stub.ClusterStatus(frontend_pb2.ClusterStatusRequest(), timeout=10)
                    if len(status.routers) == 2:
                        break
                    await asyncio.sleep(0.1)
            assert [r.instance_id for r in status.routers] == sorted(routers)
            assert {r.metrics_address for r in status.routers} == {r.metrics_address for r in routers.values()}
            table = render(status)
            other = next(i for i in routers if i != status.router_instance_id)
            assert "2 routers" in table.caption and other in table.caption

            results, _ = await run_load(cluster.router_address, reqs, concurrency=8, progress=False,
                                        creds=cluster.client_tls, connections=16, timeout_s=60)
            assert len(results) == len(reqs) and all(r.ok for r in results), [r.error for r in results if not r.ok]
            served = {i: _served(r.metrics_address) for i, r in routers.items()}
            assert sum(served.values()) == len(reqs)
            # 16 connections all on one replica: odds 2 × 2^-16
            assert all(n > 0 for n in served.values()), served  # the connections went to both

            # One replica killed: new connections go to the other; nothing is refused.
            killed = next(n for n in cluster.procs if n == "router-1")
            cluster.stop_process(killed, signal.SIGKILL)
            results, _ = await run_load(cluster.router_address, reqs[:16], concurrency=8, progress=False,
                                        creds=cluster.client_tls, connections=4, timeout_s=60)
            assert all(r.ok for r in results), [r.error for r in results if not r.ok]
            ch, stub = frontend_stub(cluster.router_address, cluster.client_tls, own_connection=True)
            async with ch:
                status = await stub.ClusterStatus(frontend_pb2.ClusterStatusRequest(), timeout=10)
            alive = status.router_instance_id
            assert alive in routers and _served(routers[alive].metrics_address) >= served[alive] + 16

    asyncio.run(main())


def test_reuse_port_needs_fixed_ports():
    with pytest.raises(ValueError, match="--reuse-port"):
        RouterOptions(etcd="127.0.0.1:2379", port=0, reuse_port=True)
    with pytest.raises(ValueError, match="--http-port"):
        RouterOptions(etcd="127.0.0.1:2379", port=50051, http_port=0, reuse_port=True)
    RouterOptions(etcd="127.0.0.1:2379", port=50051, http_port=-1, reuse_port=True)


def test_a_cluster_needs_a_router():
    with pytest.raises(ValueError, match="--routers"):
        LocalCluster(num_routers=0)
