"""Load reported by the workers (real etcd, gRPC and workers in process): two routers in front
of one fleet see the load the other placed, through each worker's KvEventService.WatchLoad."""

from __future__ import annotations

import time

import grpc
import pytest

from common.pb.tandem.v1 import frontend_pb2, frontend_pb2_grpc, kv_events_pb2, kv_events_pb2_grpc, sampling_pb2
from harness import InProcessCluster, wait_until

pytestmark = pytest.mark.e2e



def test_a_replica_sees_the_load_another_placed(etcd_server, tiny_model):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-load-reports")
    try:
        a, b = c.start("router"), c.start("router")
        worker = c.start("decode")
        c.wait_roles(a, 0, 1)
        c.wait_roles(b, 0, 1)
        wid = worker.runtime.instance_id
        wait_until(lambda: wid in b.servicer.load.reported, "router b has no load report from the worker")
        assert b.servicer.load.requests(wid) == 0 and b.servicer.load.active(wid) == 0

        # The worker's own stream: a first message at once, with nothing running.
        with grpc.insecure_channel(worker.address) as ch:
            first = next(kv_events_pb2_grpc.KvEventServiceStub(ch).WatchLoad(
                kv_events_pb2.WatchLoadRequest(interval_ms=10), timeout=5))
        assert first == kv_events_pb2.WorkerLoad()

        ch = grpc.insecure_channel(a.address)
        stream = frontend_pb2_grpc.FrontendServiceStub(ch).Generate(frontend_pb2.GenerateRequest(
            token_ids=list(range(20, 120)), sampling=sampling_pb2.SamplingParams(max_tokens=3900, ignore_eos=True)),
            timeout=120)
        next(stream)  # running on the worker now
        # Router b placed nothing, yet it sees the request and its KV blocks (100 prompt tokens).
        wait_until(lambda: b.servicer.load.requests(wid) == 1 and b.servicer.load.active(wid) >= 100 // 16,
              "router b does not see the request router a placed")
        assert b.servicer.load.in_flight.get(wid, 0) == 0  # its own count stays its own
        assert a.servicer.load.in_flight[wid] == 1
        stream.cancel()
        wait_until(lambda: b.servicer.load.requests(wid) == 0 and b.servicer.load.active(wid) == 0
              and a.servicer.load.requests(wid) == 0, "the cancelled request's load does not leave both views")
        ch.close()
        c.stop(worker)
        wait_until(lambda: wid not in a.servicer.load.reported and wid not in b.servicer.load.reported,
              "a departed worker's report is kept")
    finally:
        c.close()


def test_without_load_reports_a_router_counts_its_own(etcd_server, tiny_model):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-load-off")
    try:
        r = c.start("router", load_reports=False)
        c.start("decode")
        c.wait_roles(r, 0, 1)
        time.sleep(0.5)
        assert r.servicer.load.reported == {}
    finally:
        c.close()
