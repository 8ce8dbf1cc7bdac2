"""Workers joining and leaving through etcd: the router uses a worker that starts after it
and stops choosing a worker that stopped — no restarts."""

from __future__ import annotations

import grpc
import pytest

from common.pb.tandem.v1 import frontend_pb2, frontend_pb2_grpc, sampling_pb2
from harness import InProcessCluster

pytestmark = pytest.mark.e2e


def test_late_worker_is_used_and_stopped_worker_is_not(etcd_server, tiny_model):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-membership")
    ch = None
    try:
        router = c.start("router")
        first = c.start("decode")
        c.wait_roles(router, 0, 1)
        ch = grpc.insecure_channel(router.address)
        stub = frontend_pb2_grpc.FrontendServiceStub(ch)

        def send(n):
            for i in range(n):
                req = frontend_pb2.GenerateRequest(token_ids=[5, 6, 7, i + 1], sampling=sampling_pb2.SamplingParams(max_tokens=2))
                assert list(stub.Generate(req, timeout=30))

        send(2)  # no prefill worker yet: the decode worker prefills locally
        assert first.runtime.stats.local_prefills == 2
        prefill = c.start("prefill")
        late = c.start("decode")
        c.wait_roles(router, 1, 2)
        send(6)
        assert late.runtime.stats.remote_prefills > 0  # the late decode worker got requests
        assert prefill.runtime.stats.transfers == 6  # and the late prefill worker all prefills
        c.stop(late)
        c.wait_roles(router, 1, 1)
        before = first.runtime.stats.remote_prefills
        send(4)
        assert first.runtime.stats.remote_prefills == before + 4
    finally:
        if ch is not None:
            ch.close()
        c.close()
