"""kv_transfer over real NIXL/UCX (no mocks), in one process and across two."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from kv_transfer import (KvTransferAgent, PoolDescriptor, RemoteBlocks, TransferError,
                         TransferTimeout, create_agent, merge_runs)

pytest.importorskip("nixl_cu13", reason="NIXL (nixl-cu13) not installed")

SHAPE = (16, 2, 4, 8)  # [num_blocks, num_layers, block_size, kv_dim], as the engine's pool
SENTINEL = -7.0
# Scattered ids; (3,4,5)->(7,8,9) and (10,11)->(12,13) merge, the rest do not.
SRC_IDS = [3, 4, 5, 0, 10, 11, 15]
DST_IDS = [7, 8, 9, 1, 12, 13, 4]
EXPECTED_DESCS = 4


def _source_pool(dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(SHAPE, generator=gen).to(dtype)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)  # byte-for-byte comparison, any dtype


def _check_written(src: torch.Tensor, dst: torch.Tensor) -> str:
    """'' if dst holds src's blocks at DST_IDS and the sentinel elsewhere, else why not."""
    sentinel = _raw(torch.full(SHAPE[1:], SENTINEL).to(dst.dtype))
    for b in range(SHAPE[0]):
        if b in DST_IDS:
            want = _raw(src[SRC_IDS[DST_IDS.index(b)]])
            if not torch.equal(_raw(dst[b]), want):
                return f"block {b} differs from source block {SRC_IDS[DST_IDS.index(b)]}"
        elif not torch.equal(_raw(dst[b]), sentinel):
            return f"untouched block {b} was modified"
    return ""


@pytest.fixture
def pair():
    """(P, D, P's source pool, D's destination pool descriptor, D's pool), P knows D."""
    def make(dtype: torch.dtype = torch.float32):
        p, d = create_agent("nixl", "test-P"), create_agent("nixl", "test-D")
        agents.extend([p, d])
        src = _source_pool(dtype)
        dst = torch.full(SHAPE, SENTINEL).to(dtype)
        p.register_pool(src)
        desc = d.register_pool(dst)
        p.add_peer("test-D", d.metadata())
        return p, d, src, desc, dst
    agents: list[KvTransferAgent] = []
    yield make
    for a in agents:
        a.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_scattered_write_in_process(pair, dtype):
    p, d, src, desc, dst = pair(dtype)
    assert desc == PoolDescriptor(dst.data_ptr(), dst[0].numel() * dst.element_size(), -1, 16)

    async def run():
        waiter = asyncio.create_task(d.wait_notification(b"req-1", 5.0))
        result = await p.write_blocks("test-D", SRC_IDS, desc.blocks(DST_IDS), b"req-1", 5.0)
        return result, await waiter

    result, sender = asyncio.run(run())
    assert sender == "test-P"
    assert result.bytes == len(SRC_IDS) * desc.block_stride_bytes
    assert result.descriptors == EXPECTED_DESCS and result.seconds > 0
    assert _check_written(src, dst) == ""


def _child(conn, dtype_name: str) -> None:
    """Destination side in its own process: owns the pool, verifies, reports over `conn`."""
    dtype = getattr(torch, dtype_name)
    dst = torch.full(SHAPE, SENTINEL).to(dtype)
    with create_agent("nixl", "test-D-child") as d:
        desc = d.register_pool(dst)
        conn.send((d.metadata(), tuple(desc)))
        try:
            sender = asyncio.run(d.wait_notification(b"req-xp", 20.0))
        except TransferTimeout as exc:
            conn.send(("", str(exc)))
            return
        conn.send((sender, _check_written(_source_pool(dtype), dst)))


def test_scattered_write_across_processes():
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_child, args=(child_end, "bfloat16"), daemon=True)
    child.start()
    try:
        assert parent_end.poll(30), "child did not publish its metadata"
        metadata, desc = parent_end.recv()
        desc = PoolDescriptor(*desc)
        with create_agent("nixl", "test-P-parent") as p:
            p.register_pool(_source_pool(torch.bfloat16))
            p.add_peer("test-D-child", metadata)
            p.add_peer("test-D-child", metadata)  # cached: a no-op
            result = asyncio.run(p.write_blocks("test-D-child", SRC_IDS, desc.blocks(DST_IDS),
                                                b"req-xp", 10.0))
            assert result.descriptors == EXPECTED_DESCS
            assert parent_end.poll(30), "child did not report"
            sender, problem = parent_end.recv()
        assert (sender, problem) == ("test-P-parent", "")
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0


def _idle_child(conn) -> None:
    """A destination that publishes its pool, then only lets its progress thread serve."""
    with create_agent("nixl", "test-D-idle") as d:
        desc = d.register_pool(torch.zeros(SHAPE))
        conn.send((d.metadata(), tuple(desc)))
        conn.recv()  # blocks until the parent stops or kills this process


def test_stalled_then_dead_peer_fails_promptly():
    """A peer that stalls times out, one that leaves errors, neither hangs."""
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_idle_child, args=(child_end,), daemon=True)
    child.start()
    try:
        assert parent_end.poll(30), "child did not publish its metadata"
        metadata, desc = parent_end.recv()
        dst = PoolDescriptor(*desc).blocks([0, 1])
        with create_agent("nixl", "test-P-stall") as p:
            p.register_pool(_source_pool(torch.float32))
            p.add_peer("test-D-idle", metadata)
            asyncio.run(p.write_blocks("test-D-idle", [0, 1], dst, b"ok", 10.0))
            os.kill(child.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            # UCX may finish a one-sided write into a stopped process's memory (a kernel copy
            # on one host) or time out waiting for it; either way it must not outlive its deadline.
            try:
                asyncio.run(p.write_blocks("test-D-idle", [0, 1], dst, b"stalled", 0.5))
            except TransferTimeout:
                pass
            assert time.monotonic() - t0 < 5.0  # the 0.5 s timeout, with room for a loaded machine
            os.kill(child.pid, signal.SIGKILL)
            child.join(10)
            t0 = time.monotonic()
            with pytest.raises(TransferError):
                asyncio.run(p.write_blocks("test-D-idle", [0, 1], dst, b"gone", 10.0))
            assert time.monotonic() - t0 < 5.0  # well before the 10 s timeout: NIXL reports the disconnect
    finally:
        if child.is_alive():
            child.kill()
            child.join()


@pytest.mark.parametrize("src,dst,runs", [
    ([], [], []),
    ([5], [2], [(50, 20, 10)]),
    ([0, 1, 2, 3], [4, 5, 6, 7], [(0, 40, 40)]),
    ([0, 1, 2], [4, 6, 7], [(0, 40, 10), (10, 60, 20)]),  # dst breaks the first run
    ([0, 2, 3], [4, 5, 6], [(0, 40, 10), (20, 50, 20)]),  # src breaks the first run
    ([3, 2, 1], [3, 2, 1], [(30, 30, 10), (20, 20, 10), (10, 10, 10)]),  # descending: no merge
    ([1, 1], [0, 1], [(10, 0, 10), (10, 10, 10)]),  # a source block may be sent twice
    ([7, 8, 0, 1, 9], [0, 1, 2, 3, 4], [(70, 0, 20), (0, 20, 20), (90, 40, 10)]),
])
def test_merge_runs(src, dst, runs):
    assert merge_runs(src, dst, 10) == runs
    assert sum(length for _, _, length in runs) == 10 * len(src)


@pytest.mark.parametrize("src,dst,stride", [
    ([0, 1], [0], 8),      # lengths differ
    ([0, 1], [3, 3], 8),   # two sources into one block
    ([-1], [0], 8),        # negative id
    ([0], [0], 0),         # no stride
])
def test_merge_runs_rejects(src, dst, stride):
    with pytest.raises(ValueError):
        merge_runs(src, dst, stride)


def test_unknown_peer_fails_promptly(pair):
    p, d, _, desc, _ = pair()
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="unknown transfer peer"):
        asyncio.run(p.write_blocks("nobody", [0], desc.blocks([0]), b"x", 5.0))
    p.remove_peer("test-D")
    assert not p.has_peer("test-D")
    with pytest.raises(TransferError):
        asyncio.run(p.write_blocks("test-D", [0], desc.blocks([0]), b"x", 5.0))
    assert time.monotonic() - t0 < 1.0


def test_bad_destination_and_arguments(pair):
    p, _, _, desc, _ = pair()
    outside = RemoteBlocks(desc.base_address, desc.block_stride_bytes, -1, [desc.num_blocks])
    with pytest.raises(TransferError):  # beyond D's registered memory: NIXL refuses
        asyncio.run(p.write_blocks("test-D", [0], outside, b"x", 5.0))
    with pytest.raises(ValueError):
        desc.blocks([desc.num_blocks])
    wrong_stride = desc._replace(block_stride_bytes=desc.block_stride_bytes * 2).blocks([0])
    with pytest.raises(ValueError, match="stride"):
        asyncio.run(p.write_blocks("test-D", [0], wrong_stride, b"x", 5.0))
    with pytest.raises(ValueError):  # source id beyond P's pool
        asyncio.run(p.write_blocks("test-D", [SHAPE[0]], desc.blocks([0]), b"x", 5.0))
    with pytest.raises(ValueError, match="--transfer-backend"):
        create_agent("carrier-pigeon", "x")


def test_wait_notification_times_out(pair):
    _, d, _, _, _ = pair()
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        asyncio.run(d.wait_notification(b"never-sent", 0.3))
    assert 0.29 <= time.monotonic() - t0 < 0.8


def test_concurrent_transfers_each_get_their_notification(pair):
    p, d, src, desc, dst = pair()

    async def run():
        # Waiters registered in the opposite order of the writes, plus a notification that
        # arrives before anyone waits for it (it must be buffered, not lost).
        wait_b = asyncio.create_task(d.wait_notification(b"req-B", 5.0))
        wait_a = asyncio.create_task(d.wait_notification(b"req-A", 5.0))
        await asyncio.sleep(0)
        results = await asyncio.gather(
            p.write_blocks("test-D", SRC_IDS[:3], desc.blocks(DST_IDS[:3]), b"req-A", 5.0),
            p.write_blocks("test-D", SRC_IDS[3:], desc.blocks(DST_IDS[3:]), b"req-B", 5.0),
            p.write_blocks("test-D", [], desc.blocks([]), b"req-C", 5.0))
        senders = await asyncio.gather(wait_a, wait_b, d.wait_notification(b"req-C", 5.0))
        return results, senders

    results, senders = asyncio.run(run())
    assert senders == ["test-P"] * 3
    assert [r.descriptors for r in results] == [1, EXPECTED_DESCS - 1, 0]
    assert results[2].bytes == 0
    assert _check_written(src, dst) == ""
    with pytest.raises(TransferTimeout):  # each notification is consumed once
        asyncio.run(d.wait_notification(b"req-A", 0.05))
