"""Overlapped KV transfer end to end (issue 10): with a small prefill chunk, every chunk's
finished blocks are written while the next chunk computes and the decode worker starts after
the one notification; greedy tokens equal `reference_generate`, for the `shm` backend chosen
automatically on one host and for NIXL forced by the flag. A transfer failing mid-prefill ends
in one failure: the decode worker prefills locally, tokens unchanged, no block leaked."""

from __future__ import annotations

import grpc
import pytest

from common.pb.tandem.v1 import frontend_pb2, frontend_pb2_grpc, sampling_pb2
from engine.reference import reference_generate
from worker.host import WorkerOptions
from harness import InProcessCluster

pytestmark = pytest.mark.e2e
OPTS = WorkerOptions(num_blocks=128, block_size=16, chunk_size=32)


def tokens_of(n: int, offset: int) -> list[int]:
    return [(3000 + 11 * i + offset) % 150000 for i in range(n)]


def generate(address: str, prompt: list[int], max_tokens: int) -> list[int]:
    with grpc.insecure_channel(address) as ch:
        stub = frontend_pb2_grpc.FrontendServiceStub(ch)
        req = frontend_pb2.GenerateRequest(token_ids=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens))
        return [t for m in stub.Generate(req, timeout=60) for t in m.token_ids]


def start(etcd, model, namespace: str, **prefill_overrides) -> InProcessCluster:
    c = InProcessCluster(etcd, model, namespace=namespace, worker_opts=OPTS)
    c.router = c.start("router")
    c.prefill = c.start("prefill", **prefill_overrides)
    c.decode = c.start("decode", **{k: v for k, v in prefill_overrides.items() if k == "transfer_backend"})
    c.wait_roles(c.router, 1, 1)
    return c


def free_blocks(c: InProcessCluster) -> tuple[int, int]:
    return (c.on_loop(lambda: c.prefill.runtime.pool.blocks.num_free),
            c.on_loop(lambda: c.decode.runtime.pool.blocks.num_free))


@pytest.mark.parametrize("backend,expected", [("auto", "shm"), ("nixl", "nixl")])
def test_overlapped_transfer_gives_reference_tokens(etcd_server, tiny_model, one_torch_thread, backend, expected):
    if backend == "nixl":
        pytest.importorskip("nixl_cu13", reason="nixl-cu13 not installed")
    c = start(etcd_server.endpoint, tiny_model, f"overlap-{backend}", transfer_backend=backend)
    try:
        # 200 tokens: 7 chunks, 12 full blocks and a partial one; 96: chunk- and block-aligned;
        # 17: one chunk, nothing to overlap.
        for n in (200, 96, 17):
            prompt = tokens_of(n, offset=n)
            stats = c.prefill.runtime.stats
            writes = stats.backend(expected).writes
            got = generate(c.router.address, prompt, 8)
            assert got == reference_generate(tiny_model.model, prompt, 8, tiny_model.config.eos_token_ids), n
            # One write per chunk that completed blocks, plus the last one with the notification.
            ends = [*range(32, n, 32), n]
            full_chunks = sum(1 for prev, end in zip([0, *ends], ends) if end // 16 > prev // 16)
            assert stats.backend(expected).writes - writes == full_chunks + 1, n
        assert set(stats.transfer_by_backend) == {expected}
        per = stats.backend(expected)
        assert per.transfers == 3 and per.failures == 0 and per.bytes == stats.transfer_bytes > 0
        assert c.decode.runtime.stats.local_prefills == 0
    finally:
        c.close()


def test_transfer_failing_mid_prefill_falls_back_without_leaks(etcd_server, tiny_model, one_torch_thread):
    # Every write misses its 1 µs deadline: the first chunk's write fails while later chunks
    # compute, the prefill stops at the next chunk, the decode worker prefills locally.
    c = start(etcd_server.endpoint, tiny_model, "overlap-fail", transfer_timeout_s=1e-6)
    try:
        baseline = free_blocks(c)
        for n in (200, 90):
            prompt = tokens_of(n, offset=7 * n)
            got = generate(c.router.address, prompt, 6)
            assert got == reference_generate(tiny_model.model, prompt, 6, tiny_model.config.eos_token_ids)
        stats = c.prefill.runtime.stats
        assert stats.backend("shm").failures == 2 and stats.backend("shm").transfers == 0
        assert c.decode.runtime.stats.local_prefills == 2
        assert free_blocks(c) == baseline  # cached blocks count as free; nothing referenced
    finally:
        c.close()
