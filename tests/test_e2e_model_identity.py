"""Model identity (real etcd, gRPC and workers in process): two workers that serve one model
name with other weights (tandem-tiny with another --seed) are never used together."""

from __future__ import annotations


import grpc
import pytest

from common.pb.tandem.v1 import discovery_pb2, frontend_pb2, frontend_pb2_grpc, sampling_pb2
from engine.model_source import TINY, load_model
from engine.reference import reference_generate
from harness import InProcessCluster, wait_until

pytestmark = pytest.mark.e2e



def test_worker_with_other_weights_is_refused(etcd_server, tiny_model, caplog):
    other = load_model(TINY, seed=1)
    assert other.fingerprint != tiny_model.fingerprint
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-identity")
    try:
        router = c.start("router")
        good = c.start("decode")
        c.wait_roles(router, 0, 1)
        c.loaded = other  # the next worker serves "tandem-tiny" with seed-1 weights
        bad = c.start("decode")
        wait_until(lambda: bad.runtime.instance_id in router.workers.instance_ids(), "second worker not in discovery")
        assert [i.instance_id for i in router.workers.candidates(discovery_pb2.ROLE_DECODE)] == [good.runtime.instance_id]
        # The router's own loop may have met the record first: it logs the refusal once, from
        # its thread, so wait for the line instead of reading the records at once.
        wait_until(lambda: any("refusing worker " + bad.runtime.instance_id in r.getMessage()
                          and "weights fingerprint" in r.getMessage() for r in caplog.records),
              "no 'refusing worker' warning for the worker with other weights")
        assert router.workers.hash_seed == good.runtime.pool.hash_seed != bad.runtime.pool.hash_seed
        ch = grpc.insecure_channel(router.address)
        stub = frontend_pb2_grpc.FrontendServiceStub(ch)
        for i in range(6):
            prompt = [11 + i, 12, 13, 14, 15]
            req = frontend_pb2.GenerateRequest(token_ids=prompt, sampling=sampling_pb2.SamplingParams(
                max_tokens=6, ignore_eos=True))
            tokens = [t for m in stub.Generate(req, timeout=60) for t in m.token_ids]
            assert tokens == reference_generate(tiny_model.model, prompt, 6)
        assert bad.runtime.stats.local_prefills == 0 and good.runtime.stats.local_prefills == 6
        status = stub.ClusterStatus(frontend_pb2.ClusterStatusRequest(), timeout=10)
        assert status.weights_fingerprint == tiny_model.fingerprint
        by_id = {w.instance_id: w for w in status.workers}
        assert by_id[good.runtime.instance_id].refused == ""
        assert by_id[good.runtime.instance_id].weights_fingerprint == tiny_model.fingerprint
        assert by_id[bad.runtime.instance_id].state == "refused"
        assert "weights fingerprint" in by_id[bad.runtime.instance_id].refused
        ch.close()
    finally:
        c.close()


def test_router_with_only_mismatched_decode_workers_says_so(etcd_server, tiny_model):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-identity-only")
    try:
        router = c.start("router")
        c.start("prefill")  # seed-0 weights, started first: its fingerprint is the accepted one
        c.wait_roles(router, 1, 0)
        c.loaded = load_model(TINY, seed=1)
        bad = c.start("decode")
        wait_until(lambda: bad.runtime.instance_id in router.workers.instance_ids(), "decode worker not in discovery")
        ch = grpc.insecure_channel(router.address)
        stub = frontend_pb2_grpc.FrontendServiceStub(ch)
        req = frontend_pb2.GenerateRequest(token_ids=[1, 2, 3], sampling=sampling_pb2.SamplingParams(max_tokens=2))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(req, timeout=30))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert bad.runtime.instance_id in err.value.details()
        assert "weights fingerprint" in err.value.details()
        ch.close()
    finally:
        c.close()
