"""Faults found by trying to break the skeleton: each one reproduced, each one must hold."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time

import grpc
import pytest

from cli.client import frontend_stub, generate
from cli.cluster import LocalCluster
from common.pb.tandem.v1 import (decode_pb2, decode_pb2_grpc, discovery_pb2, frontend_pb2, frontend_pb2_grpc,
                                 prefill_pb2, prefill_pb2_grpc, sampling_pb2)
from discovery.registration import Registration
from engine.model_source import TINY
from engine.reference import reference_generate
from harness import InProcessCluster

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(etcd_server, tiny_model):
    from dataclasses import replace

    from worker.host import WorkerOptions
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-faults",
                         worker_opts=replace(WorkerOptions(num_blocks=256), prefill_timeout_s=2.0))
    c.router = c.start("router")
    c.prefill = c.start("prefill")
    c.decode = c.start("decode")
    c.wait_roles(c.router, 1, 1)
    yield c
    c.close()


def stream(address, timeout=60, **kw):
    with grpc.insecure_channel(address) as ch:
        msgs = list(frontend_pb2_grpc.FrontendServiceStub(ch).Generate(frontend_pb2.GenerateRequest(**kw),
                                                                       timeout=timeout))
    return [t for m in msgs for t in m.token_ids]


def test_tiny_temperature_is_rejected_and_decode_loop_survives(cluster):
    with pytest.raises(grpc.RpcError) as e:
        stream(cluster.router.address, token_ids=[1, 2, 3],
               sampling=sampling_pb2.SamplingParams(max_tokens=8, temperature=3.3e-39, ignore_eos=True))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("sampling.temperature")
    assert len(stream(cluster.router.address, token_ids=[1, 2, 3],
                      sampling=sampling_pb2.SamplingParams(max_tokens=4, ignore_eos=True))) == 4


def test_over_long_prompt_names_the_prompt(cluster):
    with pytest.raises(grpc.RpcError) as e:
        stream(cluster.router.address, token_ids=[1] * 5000)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("token_ids:")


def test_huge_text_is_rejected_without_tokenizing_or_stalling(cluster):
    done = []

    def other():
        done.append(stream(cluster.router.address, token_ids=[5, 6, 7],
                           sampling=sampling_pb2.SamplingParams(max_tokens=16, ignore_eos=True)))

    t = threading.Thread(target=other)
    t.start()
    start = time.perf_counter()
    with pytest.raises(grpc.RpcError) as e:
        stream(cluster.router.address, text="a" * (8 * 1024 * 1024))
    assert time.perf_counter() - start < 5
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("text:")
    t.join(60)
    assert done and len(done[0]) == 16


def prefill_request(cluster, **dest):
    request_id = dest.pop("request_id", "r1")
    rt = cluster.decode.runtime
    d = dict(backend="nixl", agent_name=rt.agent.name, base_address=rt.pool_desc.base_address,
             block_stride_bytes=rt.pool_desc.block_stride_bytes, device_id=-1, first_block_index=0, block_ids=[3])
    d.update(dest)
    return prefill_pb2.PrefillRequest(request_id=request_id, token_ids=[1, 2, 3],
                                      destination=prefill_pb2.KvDestination(**d))


@pytest.mark.parametrize("dest, field", [
    (dict(base_address=(1 << 64) - 1), "destination.base_address"),
    (dict(block_ids=[3, 3]), "destination.block_ids"),
    (dict(block_ids=[]), "destination.block_ids"),
    (dict(first_block_index=5, block_ids=[]), "destination.first_block_index"),
    (dict(block_stride_bytes=7), "destination.block_stride_bytes"),
    (dict(device_id=-7), "destination.device_id"),
    (dict(agent_name=""), "destination.agent_name"),
    (dict(backend="carrier-pigeon"), "destination.backend"),
])
def test_bad_prefill_destination_is_invalid_argument(cluster, dest, field):
    before = cluster.on_loop(lambda: cluster.prefill.runtime.pool.blocks.num_free)
    with grpc.insecure_channel(cluster.prefill.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            prefill_pb2_grpc.PrefillServiceStub(ch).Prefill(prefill_request(cluster, **dest), timeout=20)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert e.value.details().startswith(field), e.value.details()
    assert cluster.on_loop(lambda: cluster.prefill.runtime.pool.blocks.num_free) == before


def test_prefill_request_id_is_required(cluster):
    req = prefill_request(cluster)
    req.request_id = ""
    with grpc.insecure_channel(cluster.prefill.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            prefill_pb2_grpc.PrefillServiceStub(ch).Prefill(req, timeout=20)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("request_id")


def test_stalled_prefill_worker_falls_back_to_local_prefill_in_time(cluster, tiny_model, etcd_server):
    # A listener that accepts connections and never answers: a SIGSTOPped prefill worker. It is
    # in discovery (the decode worker dials no other), DRAINING so that the router avoids it.
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(16)
    address = f"127.0.0.1:{hole.getsockname()[1]}"
    record = discovery_pb2.Instance(instance_id="prefill-stalled", role=discovery_pb2.ROLE_PREFILL, address=address,
                                    model=tiny_model.name, weights_fingerprint=tiny_model.fingerprint,
                                    state=discovery_pb2.INSTANCE_STATE_DRAINING)

    async def call() -> tuple[list, float]:
        reg = Registration(etcd_server.endpoint, cluster.namespace, record, ttl_seconds=5)
        await reg.start()
        try:
            def generate() -> tuple[list, float]:
                with grpc.insecure_channel(cluster.decode.address) as ch:
                    start = time.perf_counter()
                    msgs = list(decode_pb2_grpc.DecodeServiceStub(ch).Generate(decode_pb2.DecodeRequest(
                        request_id="stalled", token_ids=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=4),
                        prefill_address=address), timeout=30))
                    return msgs, time.perf_counter() - start
            return await asyncio.to_thread(generate)
        finally:
            await reg.stop()

    prompt = [11, 12, 13, 14, 15]
    try:
        msgs, elapsed = asyncio.run(call())
        # The unanswered call's destination block is fenced while the listener is open (it could
        # still write), and returns to the pool once nothing listens there (decode_worker/fence.py).
        stats = cluster.decode.runtime.stats
        assert stats.fenced_prefills >= 1 and stats.fences_released_peer_gone == 0
    finally:
        hole.close()
    assert elapsed < 12  # up to 2 s for the record to reach the decode worker, prefill_timeout 2 s, local prefill
    got = [t for m in msgs for t in m.token_ids]
    assert got == reference_generate(tiny_model.model, prompt, 4, tiny_model.config.eos_token_ids)
    total, blocks = cluster.worker_opts.num_blocks, cluster.decode.runtime.pool.blocks
    deadline = time.time() + 20
    while cluster.on_loop(lambda: blocks.num_free) != total:
        assert time.time() < deadline, "fenced blocks kept after the stalled prefill worker's port closed"
        time.sleep(0.05)
    assert stats.fences_released_peer_gone >= 1 and stats.fences_expired == 0


def test_killed_decode_worker_is_set_aside_and_requests_go_elsewhere(tmp_path):
    async def main():
        cluster = LocalCluster(model=TINY, namespace="e2e-kill", num_decode=2, log_dir=str(tmp_path))
        async with cluster:
            cluster.stop_process("decode-0", signal.SIGKILL)  # its lease lives on for ~10 s
            ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
            try:
                return await asyncio.gather(*(generate(stub, token_ids=[7, 8, i + 1], max_tokens=3, timeout_s=60)
                                              for i in range(6)))
            finally:
                await ch.close()

    results = asyncio.run(main())
    assert all(len(r.token_ids) >= 1 for r in results)


def test_link_recovers_after_a_failed_transfer(cluster):
    rt = cluster.decode.runtime
    # Known agent, addresses outside the decode worker's registered pool: the transfer fails.
    bad = prefill_request(cluster, base_address=rt.pool_desc.base_address + (1 << 40), request_id="bad")
    with grpc.insecure_channel(cluster.prefill.address) as ch:
        stub = prefill_pb2_grpc.PrefillServiceStub(ch)
        stub_ok = True
        try:
            stub.Prefill(bad, timeout=20)
        except grpc.RpcError as exc:
            stub_ok = False
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION,
                                  grpc.StatusCode.INVALID_ARGUMENT)
    assert not stub_ok
    transfers = cluster.prefill.runtime.stats.transfers
    local = rt.stats.local_prefills
    for i in range(3):
        stream(cluster.router.address, token_ids=[40, 41, 42 + i], sampling=sampling_pb2.SamplingParams(max_tokens=2))
    assert cluster.prefill.runtime.stats.transfers == transfers + 3  # the KV still moves over NIXL
    assert rt.stats.local_prefills == local


def test_300_cancellations_at_random_points_leave_no_block_behind(cluster, tiny_model):
    import random
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 150000) for _ in range(rng.randrange(100, 400))] for _ in range(300)]

    async def storm():
        from common.grpc_server import channel
        async with channel(cluster.router.address) as ch:
            stub = frontend_pb2_grpc.FrontendServiceStub(ch)
            sem = asyncio.Semaphore(16)

            async def one(i):
                async with sem:
                    call = stub.Generate(frontend_pb2.GenerateRequest(
                        token_ids=prompts[i], sampling=sampling_pb2.SamplingParams(max_tokens=50, ignore_eos=True)),
                        timeout=60)
                    mode = i % 3
                    try:
                        if mode == 0:  # before or during prefill / transfer
                            await asyncio.sleep(rng.random() * 0.2)
                        else:  # after 1..mode*3 responses
                            n = 0
                            async for _ in call:
                                n += 1
                                if n >= rng.randrange(1, 3 * mode + 1):
                                    break
                    except grpc.aio.AioRpcError as exc:  # a full pool is a clear, retryable answer
                        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
                    finally:
                        call.cancel()

            await asyncio.gather(*(one(i) for i in range(300)))

    asyncio.run(storm())
    total = cluster.worker_opts.num_blocks

    def free():
        return (cluster.on_loop(lambda: cluster.prefill.runtime.pool.blocks.num_free),
                cluster.on_loop(lambda: cluster.decode.runtime.pool.blocks.num_free))

    deadline = time.time() + 20
    while free() != (total, total):
        assert time.time() < deadline, f"blocks still held: {free()}"
        time.sleep(0.05)
    prompt = [9, 8, 7, 6]
    assert stream(cluster.router.address, token_ids=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=5)) == \
        reference_generate(tiny_model.model, prompt, 5, tiny_model.config.eos_token_ids)


def test_decode_leaving_discovery_drops_its_transfer_metadata(cluster, tiny_model):
    extra = cluster.start("decode")
    cluster.wait_roles(cluster.router, 1, 2)
    name = extra.runtime.agent.name
    for i in range(6):  # until the new decode worker has used the prefill worker
        stream(cluster.router.address, token_ids=[60, 61, i + 1], sampling=sampling_pb2.SamplingParams(max_tokens=2))
    assert cluster.prefill.runtime.agent.has_peer(name)
    cluster.stop(extra)
    deadline = time.time() + 10
    while cluster.prefill.runtime.agent.has_peer(name):
        assert time.time() < deadline, "metadata of a departed decode worker is still cached"
        time.sleep(0.05)


def test_repeated_failures_are_logged_at_a_bounded_rate(caplog):
    import logging

    from common.ratelimit import RateLimitedLog
    limited = RateLimitedLog(logging.getLogger("t"), interval_s=60)
    with caplog.at_level("WARNING"):
        for i in range(100):
            limited.warning("peer-a", "transfer %d failed", i)
        limited.warning("peer-b", "other peer")
    assert [r.getMessage() for r in caplog.records] == ["transfer 0 failed", "other peer"]
