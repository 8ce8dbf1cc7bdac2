"""Over mTLS a worker's instance id is its certificate's instance name, and both ends of a
call check it (issue 16: "discovery records are trusted only when the worker's certificate
matches the record it serves"): a prefill worker writes only into its caller's own pool, and
the router and decode workers pass no prompt and no transfer metadata to a server whose
certificate is not the record's instance. Real processes, each with its own certificate of the
cluster CA; the attacker holds a valid certificate of that CA too."""

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


class _Impostor:
    """A server holding a valid certificate of the cluster CA (roles decode and prefill,
    instance "evil"): health SERVING, a DecodeService and a PrefillService that record every
    call they receive."""

    def __init__(self, cluster: LocalCluster) -> None:
        from concurrent import futures

        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        from common.pb.tandem.v1 import decode_pb2, decode_pb2_grpc
        from worker.session import SessionMixin
        files = cluster.ca.issue("evil", ("decode", "prefill")).load()
        self.prompts: list[list[int]] = []  # Generate calls' prompts
        self.metadata: list[bytes] = []  # Prefill calls' transfer metadata (what a write needs)
        impostor = self

        class Decode(SessionMixin, decode_pb2_grpc.DecodeServiceServicer):
            async def Generate(self, request, context):
                impostor.prompts.append(list(request.token_ids))
                yield decode_pb2.DecodeResponse(token_ids=[7], prompt_tokens=len(request.token_ids))

        class Prefill(prefill_pb2_grpc.PrefillServiceServicer):
            def Prefill(self, request, context):
                impostor.metadata.append(request.destination.agent_metadata)
                context.abort(grpc.StatusCode.UNAVAILABLE, "impostor")

        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(Decode(), self.server)
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(Prefill(), self.server)
        status = health.HealthServicer()
        status.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(status, self.server)
        port = self.server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials(
            [(files.key, files.cert)], root_certificates=files.ca, require_client_auth=False))
        self.address = f"127.0.0.1:{port}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


def test_the_router_routes_to_no_server_without_the_records_instance_certificate(cluster, etcd_server):
    # finding 3 of the issue: a record put in etcd for a server of the attacker's. Its certificate
    # is valid (the cluster CA, role decode) but names instance "evil", not the record's.
    from discovery.registration import Registration
    impostor = _Impostor(cluster)
    real = cluster.instances["decode-0"]
    record = discovery_pb2.Instance()
    record.CopyFrom(real)
    record.instance_id, record.address, record.transfer_agent_name = "decode-9", impostor.address, "decode-9"

    async def run() -> list[int]:
        reg = Registration(etcd_server.endpoint, cluster.namespace, record, ttl_seconds=30)
        await reg.start()
        ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
        try:
            await asyncio.sleep(3)  # the router sees the record and probes it (health interval)
            return [len((await generate(stub, text=f"Secret number {i}", max_tokens=3, timeout_s=60)).token_ids)
                    for i in range(10)]
        finally:
            await ch.close()
            await reg.stop()

    try:
        assert asyncio.run(run()) == [3] * 10
    finally:
        impostor.stop()
    assert impostor.prompts == []  # no prompt reached it: its handshake fails the instance name check


def test_a_decode_worker_sends_its_transfer_metadata_to_no_server_without_the_records_certificate(cluster,
                                                                                                 etcd_server):
    # A prefill record for the attacker's server: the decode worker, told to use it, dials it,
    # fails the handshake's instance name check, and prefills locally; nothing reaches it.
    from common.pb.tandem.v1 import decode_pb2, decode_pb2_grpc, sampling_pb2
    from discovery.registration import Registration
    impostor = _Impostor(cluster)
    record = discovery_pb2.Instance()
    record.CopyFrom(cluster.instances["prefill-0"])
    record.instance_id, record.address, record.transfer_agent_name = "prefill-9", impostor.address, "prefill-9"
    router_cert = cluster.ca.issue("router-test", ("router",)).load()
    decode = cluster.instances["decode-0"]

    def call() -> list[int]:
        with grpc.secure_channel(decode.address, router_cert.channel()) as ch:
            req = decode_pb2.DecodeRequest(request_id="bind-1", token_ids=[3, 4, 5, 6, 7],
                                           sampling=sampling_pb2.SamplingParams(max_tokens=3, ignore_eos=True),
                                           prefill_address=impostor.address)
            return [t for m in decode_pb2_grpc.DecodeServiceStub(ch).Generate(req, timeout=60) for t in m.token_ids]

    async def run() -> list[int]:
        reg = Registration(etcd_server.endpoint, cluster.namespace, record, ttl_seconds=30)
        await reg.start()
        try:
            await asyncio.sleep(1)  # the decode worker's discovery sees the record
            return await asyncio.to_thread(call)
        finally:
            await reg.stop()

    try:
        assert len(asyncio.run(run())) == 3  # served, by a local prefill
    finally:
        impostor.stop()
    assert impostor.metadata == []
