"""Fencing of a prefill call that ended unanswered (issue 20), unit level: the prefill worker's
PrefillCalls / ChunkSender stop every write of an abandoned request (over real shm agents), and
the decode worker's PrefillFence holds the blocks until Abandon is answered, or the bound."""

from __future__ import annotations

import asyncio
import socket
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from decode_worker.fence import REFUSED_CHECKS, PrefillFence, nothing_listens
from kv_transfer import TransferError, create_agent
from prefill_worker.calls import PrefillCalls
from prefill_worker.chunk_sender import ChunkSender

BLOCK = 4
SHAPE = (32, 2, BLOCK, 8)


@pytest.fixture
def agents():
    src = torch.randn(SHAPE).share_memory_()
    dst = torch.zeros(SHAPE).share_memory_()
    p, d = create_agent("shm", "fence-P"), create_agent("shm", "fence-D")
    p.register_pool(src)
    desc = d.register_pool(dst)
    p.add_peer("fence-D", d.metadata())
    yield p, d, src, dst, desc
    p.close()
    d.close()


def test_abandon_mid_transfer_stops_every_later_write(agents):
    p, d, src, dst, desc = agents
    calls = PrefillCalls()
    sender = ChunkSender(p, "fence-D", [5, 6, 7, 8], 0, desc.blocks([1, 2, 3, 4]), BLOCK, 10.0)

    async def run():
        assert calls.start("r1", sender)
        await sender.on_chunk_done(8)  # blocks 0-1 posted (and written: small writes run at once)
        await asyncio.sleep(0.01)
        notified = await calls.abandon("r1")
        with pytest.raises(TransferError, match="abandoned"):
            await sender.on_chunk_done(16)
        with pytest.raises(TransferError, match="abandoned"):
            await sender.finish(b"r1")
        await sender.aclose()
        calls.end("r1", sender)
        return notified

    assert asyncio.run(run()) is False
    assert torch.equal(dst[1], src[5]) and torch.equal(dst[2], src[6])
    assert not dst[[3, 4]].any()  # nothing after the abandon
    assert sender.late_refused == 2 and calls.abandons == 1


def test_abandon_before_the_call_starts_refuses_it_and_after_it_ended_reports_the_notification(agents):
    p, d, src, dst, desc = agents
    calls = PrefillCalls(capacity=2)

    async def run():
        assert await calls.abandon("queued") is False  # not here yet (e.g. behind a SIGSTOP)
        late = ChunkSender(p, "fence-D", [5], 0, desc.blocks([1]), BLOCK, 10.0)
        assert not calls.start("queued", late) and calls.abandoned("queued")
        done = ChunkSender(p, "fence-D", [6], 0, desc.blocks([2]), BLOCK, 10.0)
        assert calls.start("done", done)
        await done.finish(b"done")
        await d.wait_notification(b"done", 5.0)
        await done.aclose()
        calls.end("done", done)
        return await calls.abandon("done")

    assert asyncio.run(run()) is True
    asyncio.run(calls.abandon("x"))  # capacity 2: the oldest abandoned id is forgotten first
    assert not calls.abandoned("queued") and calls.abandoned("x")


def test_no_write_past_the_calls_deadline(agents):
    p, d, src, dst, desc = agents
    sender = ChunkSender(p, "fence-D", [5, 6], 0, desc.blocks([1, 2]), BLOCK, 10.0,
                         deadline=time.monotonic() - 0.1)

    async def run():
        with pytest.raises(TransferError, match="deadline"):
            await sender.on_chunk_done(8)
        await sender.aclose()

    asyncio.run(run())
    assert sender.late_refused == 1 and not dst.any()


def rpc_error(code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="test")


def fence_run(answers: list, bound_s: float, refused: bool = False):
    """Hold blocks [3, 4] behind an Abandon that fails/answers per `answers` (and a TCP connect
    refused or not); returns (seconds until freed, freed lists, stats, attempts)."""
    stats = SimpleNamespace(fenced_prefills=0, fences_released_by_peer=0, fences_released_peer_gone=0,
                            fences_expired=0)
    freed: list[list[int]] = []
    attempts: list[float] = []
    agent = create_agent("shm", "fence-unit")

    async def abandon(timeout_s: float) -> bool:
        attempts.append(timeout_s)
        answer = answers.pop(0) if answers else None
        if answer is None:  # a stopped worker: nothing until the attempt's deadline
            await asyncio.sleep(timeout_s)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)
        if isinstance(answer, grpc.StatusCode):
            raise rpc_error(answer)
        return answer

    async def run():
        fence = PrefillFence(agent, freed.append, bound_s, 0.1, stats)
        t0 = time.monotonic()
        async def gone() -> bool:
            return refused

        fence.hold("r", [3, 4], abandon, gone)
        assert fence.held_blocks == 2 and not freed
        await asyncio.wait_for(fence.released.wait(), bound_s + 5)
        assert fence.held_blocks == 0
        await fence.close()
        return time.monotonic() - t0

    try:
        took = asyncio.run(run())
    finally:
        agent.close()
    return took, freed, stats, attempts


def test_fence_released_once_abandon_is_answered():
    took, freed, stats, attempts = fence_run([None, grpc.StatusCode.UNAVAILABLE, False], bound_s=30.0)
    assert freed == [[3, 4]] and len(attempts) == 3 and took < 5.0
    assert (stats.fenced_prefills, stats.fences_released_by_peer, stats.fences_expired) == (1, 1, 0)


def test_fence_expires_at_the_bound_without_an_answer():
    took, freed, stats, attempts = fence_run([], bound_s=0.5)
    assert freed == [[3, 4]] and 0.45 <= took < 5.0 and len(attempts) >= 2
    assert (stats.fences_released_by_peer, stats.fences_expired) == (0, 1)


def test_fence_released_once_nothing_listens_at_the_address():
    unavailable = [grpc.StatusCode.UNAVAILABLE] * 100
    took, freed, stats, attempts = fence_run(unavailable, bound_s=30.0, refused=True)
    assert freed == [[3, 4]] and REFUSED_CHECKS[1] <= took < 10.0
    assert (stats.fences_released_peer_gone, stats.fences_released_by_peer, stats.fences_expired) == (1, 0, 0)
    # Refused Abandon calls to a host whose port still accepts (a stopped process) keep the fence.
    took, freed, stats, attempts = fence_run([grpc.StatusCode.UNAVAILABLE] * 100, bound_s=1.5, refused=False)
    assert stats.fences_expired == 1 and took >= 1.4


def test_nothing_listens_tells_a_closed_port_from_a_listening_one():
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(4)  # never accepts: like a SIGSTOPped process, the kernel completes the handshake
    address = f"127.0.0.1:{hole.getsockname()[1]}"
    try:
        assert asyncio.run(nothing_listens(address)) is False
    finally:
        hole.close()
    assert asyncio.run(nothing_listens(address)) is True
