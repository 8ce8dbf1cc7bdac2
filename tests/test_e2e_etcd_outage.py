"""etcd down for 15 s under load: no request fails (routers keep their last view), and every
worker is registered again afterwards."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from common.pb.tandem.v1 import frontend_pb2, frontend_pb2_grpc, sampling_pb2
from discovery.etcd_server import EtcdServer
from discovery.watcher import InstanceWatcher
from harness import InProcessCluster

pytestmark = pytest.mark.e2e


def test_etcd_outage_under_load(tiny_model):
    with EtcdServer() as etcd:
        c = InProcessCluster(etcd.endpoint, tiny_model, namespace="e2e-outage")
        try:
            router = c.start("router")
            c.start("prefill")
            c.start("decode")
            c.wait_roles(router, 1, 1)
            outage = threading.Thread(target=etcd.restart, kwargs={"downtime": 15.0})
            results: list[bool] = []
            with grpc.insecure_channel(router.address) as ch:
                stub = frontend_pb2_grpc.FrontendServiceStub(ch)
                outage.start()
                i = 0
                while outage.is_alive() or i < 10:
                    req = frontend_pb2.GenerateRequest(token_ids=[5, 6, 7, i % 100 + 1],
                                                       sampling=sampling_pb2.SamplingParams(max_tokens=3))
                    results.append(len([t for m in stub.Generate(req, timeout=30) for t in m.token_ids]) >= 1)
                    i += 1
                    time.sleep(0.1)
            outage.join()
            assert len(results) > 50 and all(results)
            c.wait_roles(router, 1, 1, timeout=30)

            async def listed() -> set[str]:  # what etcd itself holds now, through a new watcher
                async with InstanceWatcher(etcd.endpoint, "e2e-outage") as fresh:
                    await fresh.wait_for(lambda v: len(v) >= 3, timeout=30)
                    return set(fresh.instances())

            assert {h.runtime.instance_id for h in c.handles if h.runtime} <= c.call(listed())
        finally:
            c.close()
