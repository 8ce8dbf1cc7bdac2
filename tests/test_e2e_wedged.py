"""A wedged engine (one model call that never ends, via a test hook) turns the worker's health
NOT_SERVING within about one probe period after --stall-timeout, so the router stops choosing
it though its gRPC server still answers; it returns once the engine makes progress."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc
import pytest

from common.pb.tandem.v1 import discovery_pb2, frontend_pb2, frontend_pb2_grpc, sampling_pb2
from worker.host import WorkerOptions
from harness import InProcessCluster

pytestmark = pytest.mark.e2e


def test_wedged_engine_leaves_routing_and_comes_back(etcd_server, tiny_model):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-wedged",
                         worker_opts=replace(WorkerOptions(num_blocks=256), stall_timeout_s=1.0))
    try:
        router = c.start("router", health_interval_s=0.2, health_timeout_s=0.2, health_failure_threshold=2)
        a, b = c.start("decode"), c.start("decode")
        c.wait_roles(router, 0, 2)

        def routable():
            return {i.instance_id for i in router.workers.candidates(discovery_pb2.ROLE_DECODE)}

        async def wedge():  # the test hook: occupy the model thread for 8 s
            asyncio.ensure_future(a.runtime.run_model(time.sleep, 8.0))

        c.call(wedge())
        t0 = time.time()
        while a.runtime.instance_id in routable():
            # stall timeout 1 s + watchdog period 0.25 s + 2 probes of 0.2 s, with room for a busy machine
            assert time.time() - t0 < 6.0, "router still chooses the wedged worker"
            time.sleep(0.02)
        with grpc.insecure_channel(router.address) as ch:
            stub = frontend_pb2_grpc.FrontendServiceStub(ch)
            before = b.runtime.stats.local_prefills
            for i in range(3):
                req = frontend_pb2.GenerateRequest(token_ids=[3, 4, i + 1], sampling=sampling_pb2.SamplingParams(max_tokens=2))
                assert list(stub.Generate(req, timeout=30))
            assert b.runtime.stats.local_prefills == before + 3  # all went to the healthy worker
        deadline = time.time() + 20
        while a.runtime.instance_id not in routable():
            assert time.time() < deadline, "the worker did not come back after the engine recovered"
            time.sleep(0.05)
    finally:
        c.close()
