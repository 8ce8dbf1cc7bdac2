"""An EP rank that dies mid-stream fails the decode loop (INTERNAL to the running requests,
NOT_SERVING to health probes) instead of hanging the worker in a collective."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.tandem.v1 import decode_pb2, decode_pb2_grpc, sampling_pb2
from harness import InProcessCluster

pytestmark = pytest.mark.e2e


def test_dead_rank_fails_the_loop_not_hangs(etcd_server, tiny_model):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-ep-fail")
    try:
        decode = c.start("decode", ep_size=2)
        ch = grpc.insecure_channel(decode.address)
        stub = decode_pb2_grpc.DecodeServiceStub(ch)
        req = decode_pb2.DecodeRequest(token_ids=list(range(100, 130)),
                                       sampling=sampling_pb2.SamplingParams(max_tokens=3000, ignore_eos=True))
        stream = stub.Generate(req, timeout=120)
        next(stream)  # the request runs
        decode.runtime.engine._procs[0].kill()  # rank 1 dies
        t0 = time.time()
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert time.time() - t0 < 60  # detected from a broken pipe/connection, not a gloo timeout
        health = health_pb2_grpc.HealthStub(ch)
        deadline = time.time() + 10
        while health.Check(health_pb2.HealthCheckRequest(service="")).status != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.time() < deadline
            time.sleep(0.05)
        ch.close()
    finally:
        c.close()
