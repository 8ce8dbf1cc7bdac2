"""Authorisation of what internal messages ask for (issue 16, docs/security.md), with real
workers, real etcd and real shared-memory transfers: a prefill worker writes only into the pool
of a decode worker in discovery, with the metadata that worker published and block ids inside
its advertised pool; a decode worker dials only prefill workers in discovery. Each attack is
made by a client in this process that holds its own transfer agent and pool, so that "nothing
written" can be read in memory the attacker chose."""

from __future__ import annotations

import asyncio
import select
import socket

import grpc
import pytest
import torch

from common.pb.tandem.v1 import (decode_pb2, decode_pb2_grpc, discovery_pb2, frontend_pb2, frontend_pb2_grpc,
                                 prefill_pb2, prefill_pb2_grpc, sampling_pb2)
from discovery.registration import Registration
from engine.reference import reference_generate
from harness import InProcessCluster
from kv_transfer import create_agent, prepare_pool
from worker.host import WorkerOptions

pytestmark = pytest.mark.e2e
PROMPT = [21, 22, 23]  # one block


@pytest.fixture(scope="module")
def cluster(etcd_server, tiny_model, one_torch_thread):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-authz",
                         worker_opts=WorkerOptions(num_blocks=64))
    c.router = c.start("router")
    c.prefill = c.start("prefill")
    c.decode = c.start("decode")
    c.wait_roles(c.router, 1, 1)
    yield c
    c.close()


class Attacker:
    """A transfer agent with its own shared-memory pool, laid out like the decode worker's."""

    def __init__(self, cluster: InProcessCluster, name: str) -> None:
        kv = cluster.decode.runtime.pool.kv
        self.pool = torch.zeros((4, *kv.shape[1:]), dtype=kv.dtype)
        prepare_pool(self.pool, "shm")
        self.agent = create_agent("shm", name)
        self.desc = self.agent.register_pool(self.pool)

    def request(self, request_id: str, **dest) -> prefill_pb2.PrefillRequest:
        d = dict(backend="shm", agent_name=self.agent.name, agent_metadata=self.agent.metadata(),
                 base_address=self.desc.base_address, block_stride_bytes=self.desc.block_stride_bytes,
                 device_id=-1, first_block_index=0, block_ids=[0])
        d.update(dest)
        return prefill_pb2.PrefillRequest(request_id=request_id, token_ids=PROMPT,
                                          destination=prefill_pb2.KvDestination(**d))

    def close(self) -> None:
        self.agent.close()


def prefill_refusal(cluster: InProcessCluster, request: prefill_pb2.PrefillRequest) -> grpc.RpcError:
    before = cluster.on_loop(lambda: cluster.prefill.runtime.pool.blocks.num_free)
    with grpc.insecure_channel(cluster.prefill.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            prefill_pb2_grpc.PrefillServiceStub(ch).Prefill(request, timeout=30)
    assert cluster.on_loop(lambda: cluster.prefill.runtime.pool.blocks.num_free) == before  # no block leaked
    return e.value


def test_destination_not_in_discovery_is_refused_and_nothing_written(cluster):
    attacker = Attacker(cluster, "not-a-decode-worker")
    try:
        err = prefill_refusal(cluster, attacker.request("evil-1"))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
        assert err.details().startswith("destination.agent_name"), err.details()
        assert not attacker.pool.any()  # the prefill worker wrote nothing into the attacker's memory
    finally:
        attacker.close()


def test_forged_metadata_for_a_decode_workers_agent_is_refused(cluster, tiny_model):
    decode = cluster.decode.runtime
    attacker = Attacker(cluster, decode.agent.name)  # claims to be the decode worker's agent
    try:
        err = prefill_refusal(cluster, attacker.request("evil-2"))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
        assert err.details().startswith("destination.agent_metadata"), err.details()
        assert not attacker.pool.any()
    finally:
        attacker.close()
    # The decode worker's own requests still get their KV from the prefill worker, into its pool.
    remote = decode.stats.remote_prefills
    prompt = [31, 32, 33, 34, 35]
    with grpc.insecure_channel(cluster.router.address) as ch:
        req = frontend_pb2.GenerateRequest(token_ids=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=4))
        got = [t for m in frontend_pb2_grpc.FrontendServiceStub(ch).Generate(req, timeout=60) for t in m.token_ids]
    assert got == reference_generate(tiny_model.model, prompt, 4, tiny_model.config.eos_token_ids)
    assert decode.stats.remote_prefills == remote + 1


def test_block_id_past_the_advertised_pool_is_invalid_argument(cluster):
    decode = cluster.decode.runtime
    capacity = decode.pool.config.num_blocks
    desc = decode.pool_desc
    req = prefill_pb2.PrefillRequest(request_id="evil-3", token_ids=PROMPT, destination=prefill_pb2.KvDestination(
        backend="auto", agent_name=decode.agent.name, agent_metadata=decode.agent.metadata(),
        base_address=desc.base_address, block_stride_bytes=desc.block_stride_bytes, device_id=-1,
        first_block_index=0, block_ids=[capacity + 3]))
    err = prefill_refusal(cluster, req)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert err.details().startswith("destination.block_ids") and str(capacity) in err.details(), err.details()


def _decode_refusal(cluster: InProcessCluster, prefill_address: str) -> grpc.RpcError:
    before = cluster.on_loop(lambda: cluster.decode.runtime.pool.blocks.num_free)
    with grpc.insecure_channel(cluster.decode.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(decode_pb2_grpc.DecodeServiceStub(ch).Generate(decode_pb2.DecodeRequest(
                request_id="evil-dial", token_ids=PROMPT, sampling=sampling_pb2.SamplingParams(max_tokens=2),
                prefill_address=prefill_address), timeout=30))
    assert cluster.on_loop(lambda: cluster.decode.runtime.pool.blocks.num_free) == before
    return e.value


@pytest.fixture
def listener():
    """A TCP listener that records whether anyone connected (a would-be prefill worker)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock
    sock.close()


def _dialled(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0.5)[0])


def test_decode_worker_dials_no_prefill_address_outside_discovery(cluster, listener):
    err = _decode_refusal(cluster, f"127.0.0.1:{listener.getsockname()[1]}")
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
    assert err.details().startswith("prefill_address") and "not in discovery" in err.details(), err.details()
    assert not _dialled(listener)


def test_decode_worker_dials_no_prefill_worker_of_another_model(cluster, listener, etcd_server):
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    # DRAINING: the router routes nothing to it; the decode worker's view has it all the same.
    record = discovery_pb2.Instance(instance_id="prefill-other-model", role=discovery_pb2.ROLE_PREFILL,
                                    address=address, model="another-model", block_size=16,
                                    state=discovery_pb2.INSTANCE_STATE_DRAINING)

    async def refused() -> grpc.RpcError:
        reg = Registration(etcd_server.endpoint, cluster.namespace, record, ttl_seconds=5)
        await reg.start()
        try:
            return await asyncio.to_thread(_decode_refusal, cluster, address)
        finally:
            await reg.stop()

    err = asyncio.run(refused())
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
    assert err.details().startswith("prefill_address") and "another-model" in err.details(), err.details()
    assert not _dialled(listener)


def test_a_notification_token_over_its_limit_is_invalid_argument(cluster):
    attacker = Attacker(cluster, "token-sender")
    try:
        req = attacker.request("evil-token")
        req.notification_token = b"x" * 65
        err = prefill_refusal(cluster, req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert err.details().startswith("notification_token") and "64" in err.details(), err.details()
    finally:
        attacker.close()


def test_the_kv_is_announced_only_by_a_notification_with_the_calls_secret(cluster):
    # A decode worker waits for request id + its secret for the call (PrefillRequest.
    # notification_token, sent only to the prefill worker over the call): a peer that knows the
    # request id alone announces nothing.
    from kv_transfer.base import RemoteBlocks, TransferTimeout, notification
    victim, forger = Attacker(cluster, "victim-agent"), Attacker(cluster, "forger-agent")
    try:
        forger.agent.add_peer(victim.agent.name, victim.agent.metadata())
        nowhere = RemoteBlocks(victim.desc.base_address, victim.desc.block_stride_bytes, -1, [])
        secret = b"\x01" * 16

        async def run() -> str:
            await forger.agent.write_blocks(victim.agent.name, [], nowhere, b"req-7", 5.0)  # the id alone
            with pytest.raises(TransferTimeout):
                await victim.agent.wait_notification(notification("req-7", secret), 0.5)
            await forger.agent.write_blocks(victim.agent.name, [], nowhere, notification("req-7", secret), 5.0)
            return await victim.agent.wait_notification(notification("req-7", secret), 5.0)

        assert asyncio.run(run()) == forger.agent.name
        assert notification("req-7", secret) == b"req-7#" + secret.hex().encode() and notification("r") == b"r"
    finally:
        victim.close()
        forger.close()
