"""Mutual TLS between real processes (common/tls.py, docs/security.md): a local cluster with
its throw-away CA, and clients that have no certificate, one from another CA, or one naming
the wrong role, against each internal service of the prefill and decode workers."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cli.client import frontend_stub, generate
from cli.cluster import LocalCluster
from common.certs import LocalCa
from common.pb.tandem.v1 import (decode_pb2, decode_pb2_grpc, discovery_pb2, kv_events_pb2, kv_events_pb2_grpc,
                                 prefill_pb2, prefill_pb2_grpc, sampling_pb2)
from common.tls import TlsCredentials
from engine.model_source import TINY

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [f"Tell me about the number {i * 41}, briefly." for i in range(4)]


@pytest.fixture(scope="module")
def clusters(etcd_server, tmp_path_factory):
    """(the mTLS cluster, the same cluster with --insecure), both real processes."""
    made = []
    try:
        for tls in (True, False):
            c = LocalCluster(model=TINY, etcd=etcd_server.endpoint, namespace=f"e2e-tls-{tls}", tls=tls,
                             worker_args=["--num-blocks", "256"], log_dir=str(tmp_path_factory.mktemp("tls")))
            asyncio.run(c.start())
            made.append(c)
        yield made
    finally:
        for c in made:
            asyncio.run(c.stop())


def _address(cluster: LocalCluster, role: int) -> str:
    return next(i.address for i in cluster.instances.values() if i.role == role)


def _calls(address: str, creds: TlsCredentials | None):
    """One call of each service a worker at `address` serves (the one it exists for, its KV
    events, health): name -> a function raising grpc.RpcError or returning."""
    ch = grpc.secure_channel(address, creds.channel()) if creds else grpc.insecure_channel(address)

    def prefill():
        prefill_pb2_grpc.PrefillServiceStub(ch).Prefill(prefill_pb2.PrefillRequest(request_id="x", token_ids=[1, 2]),
                                                         timeout=5)

    def decode():
        req = decode_pb2.DecodeRequest(request_id="x", token_ids=[1, 2],
                                       sampling=sampling_pb2.SamplingParams(max_tokens=1))
        list(decode_pb2_grpc.DecodeServiceStub(ch).Generate(req, timeout=5))

    def kv_events():
        stream = kv_events_pb2_grpc.KvEventServiceStub(ch).Subscribe(kv_events_pb2.SubscribeRequest(), timeout=5)
        next(iter(stream))  # the snapshot

    def health():
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)

    return ch, {"prefill": prefill, "decode": decode, "kv_events": kv_events, "health": health}


def _code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


WORKERS = [("prefill", discovery_pb2.ROLE_PREFILL, ("prefill", "kv_events", "health")),
           ("decode", discovery_pb2.ROLE_DECODE, ("decode", "kv_events", "health"))]


@pytest.mark.parametrize("client", ["plaintext", "other CA"])
@pytest.mark.parametrize("worker,role,services", WORKERS, ids=[w[0] for w in WORKERS])
def test_internal_services_refuse_unauthenticated_clients(clusters, tmp_path, client, worker, role, services):
    cluster = clusters[0]
    creds = None if client == "plaintext" else LocalCa(tmp_path, "another CA").issue("router", ("router",)).load()
    ch, calls = _calls(_address(cluster, role), creds)
    with ch:
        codes = {name: _code(calls[name]) for name in services}
    assert codes == {name: grpc.StatusCode.UNAVAILABLE for name in services}  # the handshake fails


# (worker, service, a role that must not call it, the role that may)
WRONG_ROLE = [("prefill", discovery_pb2.ROLE_PREFILL, "prefill", "router", "decode"),
              ("prefill", discovery_pb2.ROLE_PREFILL, "kv_events", "decode", "router"),
              ("decode", discovery_pb2.ROLE_DECODE, "decode", "prefill", "router"),
              ("decode", discovery_pb2.ROLE_DECODE, "decode", "client", "router"),
              ("decode", discovery_pb2.ROLE_DECODE, "kv_events", "prefill", "router"),
              ("decode", discovery_pb2.ROLE_DECODE, "kv_events", "client", "admin"),
              ("prefill", discovery_pb2.ROLE_PREFILL, "kv_events", "client", "admin")]


@pytest.mark.parametrize("worker,role,service,wrong,right", WRONG_ROLE,
                         ids=[f"{w[2]}@{w[0]}-by-{w[3]}" for w in WRONG_ROLE])
def test_a_client_of_the_wrong_role_is_refused(clusters, worker, role, service, wrong, right):
    cluster = clusters[0]
    address = _address(cluster, role)
    ch, calls = _calls(address, cluster.ca.issue(f"test-{wrong}", (wrong,)).load())
    with ch:
        assert _code(calls[service]) == grpc.StatusCode.PERMISSION_DENIED
        assert _code(calls["health"]) == grpc.StatusCode.OK  # health takes any cluster role
    ch, calls = _calls(address, cluster.ca.issue(f"test-{right}", (right,)).load())
    with ch:
        assert _code(calls[service]) not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE)


def test_normal_path_over_mtls_gives_the_insecure_paths_tokens(clusters):
    secure, insecure = clusters

    async def run(cluster: LocalCluster, creds) -> list[list[int]]:
        ch, stub = frontend_stub(cluster.router_address, creds)
        try:
            return [(await generate(stub, text=p, max_tokens=8, timeout_s=120)).token_ids for p in PROMPTS]
        finally:
            await ch.close()

    assert secure.client_tls is not None and insecure.client_tls is None
    over_tls = asyncio.run(run(secure, secure.client_tls))
    ca_only = TlsCredentials(b"", b"", secure.client_tls.ca)  # the frontend's client certificates are optional
    assert asyncio.run(run(secure, ca_only)) == over_tls
    assert over_tls == asyncio.run(run(insecure, None))
    assert all(len(t) == 8 for t in over_tls)
    # Every prompt went decode -> prefill over mTLS: the decode worker fell back to local prefill for none.
    decode_log = (secure.log_dir / "decode-0.log").read_text()
    assert "prefilling locally" not in decode_log, decode_log[-2000:]

    async def plaintext() -> grpc.StatusCode:
        ch, stub = frontend_stub(secure.router_address)
        try:
            await generate(stub, text=PROMPTS[0], max_tokens=2, timeout_s=5)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            await ch.close()
        return grpc.StatusCode.OK

    assert asyncio.run(plaintext()) == grpc.StatusCode.UNAVAILABLE  # the frontend serves TLS only


def test_tandem_top_reads_a_tls_router_with_the_cluster_ca(clusters):
    """`tandem top` is a client of the router like `tandem generate`: --tls-ca (or the CA a local
    `tandem up` leaves) reaches a TLS frontend; a plaintext attempt fails with a hint."""
    secure, _ = clusters
    cmd = [sys.executable, "-m", "cli.main", "top", "--once", "--router", secure.router_address]
    r = subprocess.run([*cmd, "--tls-ca", str(secure.ca.ca_path)], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "decode" in r.stdout and "prefill" in r.stdout, r.stdout
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "tandem top: UNAVAILABLE" in r.stderr, r.stderr


def test_tandem_ups_own_etcd_takes_only_certificates_of_the_cluster_ca(tmp_path):
    """`tandem up` without --etcd starts its own etcd with TLS and client-certificate
    authentication: the cluster registers and serves through it, while a plaintext client, a
    TLS client without a certificate and one with another CA's certificate can neither read
    nor write discovery (nobody can register a fake worker)."""
    from discovery.endpoints import ETCD_ERRORS, EtcdUnavailableError, _TlsClient, connect_first, parse_endpoint

    cluster = LocalCluster(model=TINY, namespace="e2e-etcd-tls", tls=True, log_dir=str(tmp_path / "up"))

    async def main():
        async with cluster:
            endpoint = cluster.etcd_endpoint
            assert endpoint.startswith("https://127.0.0.1:")
            ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
            try:
                served = await generate(stub, text=PROMPTS[0], max_tokens=4, timeout_s=120)
            finally:
                await ch.close()
            plain = endpoint.removeprefix("https://")
            with pytest.raises(EtcdUnavailableError):  # plaintext: the TLS listener does not answer it
                await connect_first(plain, rpc_timeout=2.0)
            ep = parse_endpoint(endpoint)
            no_cert = _TlsClient(ep.host, ep.port, timeout=2, credentials=grpc.ssl_channel_credentials(
                root_certificates=cluster.client_tls.ca))
            try:
                with pytest.raises(ETCD_ERRORS) as refused:  # the handshake fails: no client certificate
                    await no_cert.put(b"/tandem/v1/e2e-etcd-tls/instances/decode/fake", b"x")
                assert isinstance(refused.value, ETCD_ERRORS), repr(refused.value)
            finally:
                await no_cert.close()
            other = LocalCa(tmp_path / "other-ca").issue("intruder", ("decode",)).load()
            with pytest.raises(EtcdUnavailableError):
                await connect_first(endpoint, rpc_timeout=2.0, tls=other)
            with pytest.raises(ValueError, match="--tls-cert"):
                await connect_first(endpoint, rpc_timeout=2.0, tls=TlsCredentials(b"", b"", cluster.client_tls.ca))
            async with await connect_first(endpoint, tls=cluster.client_tls) as member:  # a cluster certificate
                fake = await member.get(b"/tandem/v1/e2e-etcd-tls/instances/decode/fake")
                records = [kv.key for kv in (await member.get_prefix(b"/tandem/v1/e2e-etcd-tls/instances/")).kvs]
            return served, fake, records

    served, fake, records = asyncio.run(main())
    assert len(served.token_ids) == 4
    assert fake is None  # the refused write left nothing
    assert len(records) == 3  # the router and both workers registered through the TLS etcd


def test_etcd_with_tls_serves_nothing_to_a_client_without_a_certificate_on_its_peer_port(tmp_path):
    """etcd serves its whole client API (gRPC) on the peer port too. An EtcdServer with TLS
    (`tandem up`'s) must not leave that port plaintext: a process without a certificate of the
    cluster CA could otherwise put a fake worker's record there, bypassing --client-cert-auth."""
    import aetcd

    from discovery.endpoints import ETCD_ERRORS, connect_first
    from discovery.etcd_server import EtcdServer

    ca = LocalCa(tmp_path / "ca")
    member = ca.issue("router", ("router",)).load()
    key = b"/tandem/v1/e2e-etcd-peer/instances/decode/fake"

    async def main():
        intruder = aetcd.Client("127.0.0.1", etcd._peer_port, timeout=2)
        try:
            with pytest.raises(ETCD_ERRORS):
                await asyncio.wait_for(intruder.put(key, b"x"), 5)
        finally:
            await intruder.close()
        async with await connect_first(etcd.endpoint, tls=member) as client:  # the cluster's own clients work
            await client.put(b"/tandem/v1/e2e-etcd-peer/probe", b"ok")
            return await client.get(key)

    with EtcdServer(tls=ca.issue("etcd", ("etcd",))) as etcd:
        assert asyncio.run(main()) is None  # the intruder's write left nothing
        etcd.restart()  # the same flags again, on the same data
        assert asyncio.run(main()) is None


def test_health_of_a_worker_over_tls_without_a_client_certificate_says_what_is_missing(clusters):
    """`tandem health WORKER --tls-ca CA` with no client certificate: the worker's port closes
    the connection; the line says to pass --tls-cert and --tls-key (it said only "Socket
    closed"), and with them the check passes."""
    cluster = clusters[0]
    address = _address(cluster, discovery_pb2.ROLE_DECODE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}

    def health(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cli.main", "health", address, "--tls-ca", cluster.ca.ca_path,
                               *args], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    bare = health()
    assert bare.returncode == 1 and "pass --tls-cert and --tls-key" in bare.stderr, bare.stderr
    files = cluster.ca.issue("health-check", ("admin",))
    assert health("--tls-cert", files.cert, "--tls-key", files.key).returncode == 0
    # a CA of another cluster: the handshake is what failed, whatever the client certificate
    other = subprocess.run([sys.executable, "-m", "cli.main", "health", address, "--tls-ca",
                            LocalCa(Path(files.cert).parent / "other", "another CA").ca_path],
                           cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert other.returncode == 1 and "certificate of another CA" in other.stderr, other.stderr
    assert "pass --tls-cert" not in other.stderr, other.stderr
