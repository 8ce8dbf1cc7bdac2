"""A worker that comes back under the same instance id (test-only TANDEM_TEST_INSTANCE_ID) is a
new incarnation: the router drops the old process's blocks and follows the new one from a
snapshot, even when the new process has already issued more event ids than the router saw
from the old one (so resuming by id alone would merge two processes' events). Issue 20."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest

from cli.client import frontend_stub
from cli.cluster import LocalCluster
from common.env import TEST_INSTANCE_ID_VAR
from common.pb.tandem.v1 import discovery_pb2, frontend_pb2, kv_events_pb2, kv_events_pb2_grpc, sampling_pb2
from discovery.watcher import InstanceWatcher
from engine.model_source import TINY
from harness import decode_locally

pytestmark = pytest.mark.e2e
WID = "decode-same-identity"


def prompt(salt: int, n: int = 64) -> list[int]:
    return [(salt * 7919 + 31 * j) % 150000 + 1 for j in range(n)]


def last_event(address: str) -> tuple[int, int]:
    """(last event id, incarnation) of a worker, from the snapshot a new subscriber gets."""
    with grpc.insecure_channel(address) as ch:
        stream = kv_events_pb2_grpc.KvEventServiceStub(ch).Subscribe(kv_events_pb2.SubscribeRequest(), timeout=10)
        snap = next(stream)
        stream.cancel()
    return snap.event_id, snap.incarnation


async def overlap(stub, tokens: list[int]) -> int:
    resp = await stub.ExplainRoute(frontend_pb2.GenerateRequest(token_ids=tokens), timeout=5)
    return next((c.overlap_blocks for c in resp.candidates if c.instance_id == WID), -1)


def test_same_identity_restart_resets_the_router_index(tmp_path, monkeypatch):
    monkeypatch.setenv(TEST_INSTANCE_ID_VAR, WID)  # inherited by the decode workers (no prefill worker here)
    a, b = prompt(1), prompt(2)

    async def wait_overlap(stub, tokens, want, timeout=20.0):
        deadline = time.monotonic() + timeout
        while (got := await overlap(stub, tokens)) != want:
            assert time.monotonic() < deadline, f"overlap {got}, want {want}"
            await asyncio.sleep(0.1)

    async def main():
        cluster = LocalCluster(model=TINY, tls=False, namespace="e2e-incarnation", num_prefill=0,
                               log_dir=str(tmp_path),
                               worker_args=["--num-blocks", "256"])
        async with cluster:
            ch, stub = frontend_stub(cluster.router_address)
            try:
                old = cluster.instances[WID]
                async for _ in stub.Generate(frontend_pb2.GenerateRequest(
                        token_ids=a, sampling=sampling_pb2.SamplingParams(max_tokens=2)), timeout=60):
                    pass
                await wait_overlap(stub, a, 4)  # 64 tokens: 4 blocks, all cached once decoded
                old_last, old_inc = await asyncio.to_thread(last_event, old.address)
                assert old_inc == old.incarnation != 0

                # The router sleeps through the restart, so the new process is ahead of it.
                router = cluster.procs["router"].pid
                os.kill(router, signal.SIGSTOP)
                try:
                    cluster.stop_process("decode-0", signal.SIGKILL)
                    cluster.spawn("decode-0b", "decode", "--port", "0", "--num-blocks", "256")
                    async with InstanceWatcher(cluster.etcd_endpoint, cluster.namespace, tls=cluster.client_tls) as watcher:
                        view = await watcher.wait_for(lambda v: WID in v and v[WID].incarnation != old.incarnation,
                                                      timeout=90)
                    new = view[WID]
                    assert new.role == discovery_pb2.ROLE_DECODE and new.address != old.address
                    i = 10
                    while (await asyncio.to_thread(last_event, new.address))[0] <= old_last + 1:
                        await asyncio.to_thread(decode_locally, new.address, [prompt(i, 40)], 2)
                        i += 1
                finally:
                    os.kill(router, signal.SIGCONT)
                # A is the old process's only; B is what the new incarnation reports.
                await wait_overlap(stub, a, 0)
                await asyncio.to_thread(decode_locally, new.address, [b], 2)
                await wait_overlap(stub, b, 4)
            finally:
                await ch.close()

    asyncio.run(main())
    assert "restarted (new incarnation" in (tmp_path / "router.log").read_text()
