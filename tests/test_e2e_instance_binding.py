"""Over mTLS a worker's instance id is its certificate's instance name, and a prefill worker
writes only into the pool of the decode worker that calls it (issue 16: "discovery records are
trusted only when the worker's certificate matches the record it serves"): real processes,
one prefill and two decode workers, each with its own certificate of the cluster CA."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from cli.client import frontend_stub, generate
from cli.cluster import LocalCluster
from common.pb.tandem.v1 import discovery_pb2, prefill_pb2, prefill_pb2_grpc
from common.tls import TlsFiles
from engine.model_source import TINY

pytestmark = pytest.mark.e2e
BLOCK = 16


@pytest.fixture(scope="module")
def cluster(etcd_server, tmp_path_factory):
    c = LocalCluster(model=TINY, etcd=etcd_server.endpoint, namespace="e2e-binding", num_decode=2,
                     worker_args=["--num-blocks", "128", "--block-size", str(BLOCK)],
                     log_dir=str(tmp_path_factory.mktemp("binding")))
    asyncio.run(c.start())
    yield c
    asyncio.run(c.stop())


def test_instance_ids_are_the_certificates_names(cluster):
    assert {"prefill-0", "decode-0", "decode-1"} <= set(cluster.instances)


def test_a_decode_worker_cannot_aim_writes_at_another_decode_workers_pool(cluster, tiny_model):
    # Both decode workers serve (each has had the prefill worker write into its own pool).
    async def serve() -> list[int]:
        ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
        try:
            return [len((await generate(stub, text=f"The number {i * 37} is", max_tokens=4, timeout_s=120)).token_ids)
                    for i in range(8)]
        finally:
            await ch.close()

    assert asyncio.run(serve()) == [4] * 8
    for name in ("decode-0", "decode-1"):
        log = (cluster.log_dir / f"{name}.log").read_text()
        assert "prefilling locally" not in log, log[-2000:]
    # decode-0's certificate asks the prefill worker to write decode-1's pool (no metadata: the
    # prefill worker may hold decode-1's from decode-1's own calls).
    victim = cluster.instances["decode-1"]
    prefill = next(i for i in cluster.instances.values() if i.role == discovery_pb2.ROLE_PREFILL)
    c = tiny_model.config
    stride = c.num_kv_layers * BLOCK * c.kv_dim * 4  # float32 pool rows of one block
    folder = cluster.log_dir / "tls"
    creds = TlsFiles(str(folder / "decode-0.pem"), str(folder / "decode-0-key.pem"), str(folder / "ca.pem")).load()
    req = prefill_pb2.PrefillRequest(request_id="forged-1", token_ids=[5, 6, 7], destination=prefill_pb2.KvDestination(
        backend="auto", agent_name=victim.transfer_agent_name, base_address=1 << 20, block_stride_bytes=stride,
        device_id=-1, first_block_index=0, block_ids=[0]))
    with grpc.secure_channel(prefill.address, creds.channel()) as ch:
        with pytest.raises(grpc.RpcError) as e:
            prefill_pb2_grpc.PrefillServiceStub(ch).Prefill(req, timeout=30)
    assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, e.value.details()
    details = e.value.details()
    assert details.startswith("destination.agent_name") and "decode-1" in details and "decode-0" in details, details
    # and decode-1 still serves its own requests through the prefill worker
    assert asyncio.run(serve()) == [4] * 8
