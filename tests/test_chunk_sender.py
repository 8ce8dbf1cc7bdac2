"""ChunkSender over real shm agents: full blocks go after each chunk, the partial last block
and the one notification at the end, bytes exact; a failed chunk write stops the prefill with
one TransferError and leaves nothing running."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kv_transfer import TransferError, create_agent
from prefill_worker.chunk_sender import ChunkSender

BLOCK = 4  # tokens per block
SHAPE = (32, 2, BLOCK, 8)


@pytest.fixture
def agents():
    src = torch.randn(SHAPE).share_memory_()
    dst = torch.zeros(SHAPE).share_memory_()
    p, d = create_agent("shm", "cs-P"), create_agent("shm", "cs-D")
    p.register_pool(src)
    desc = d.register_pool(dst)
    p.add_peer("cs-D", d.metadata())
    yield p, d, src, dst, desc
    p.close()
    d.close()


def test_chunks_then_partial_block_then_one_notification(agents):
    p, d, src, dst, desc = agents
    prompt_blocks = [5, 6, 7, 20, 21, 9]  # 6 blocks: 22 tokens, the last block partial
    first = 1  # the decode worker already holds prompt block 0
    dst_ids = [3, 4, 5, 6, 30]
    sender = ChunkSender(p, "cs-D", prompt_blocks, first, desc.blocks(dst_ids), BLOCK, 10.0)

    async def run():
        got = asyncio.ensure_future(d.wait_notification(b"req", 10.0))
        for done in (0, 6, 12, 18, 22):  # chunk ends, as WorkerRuntime.prefill reports them
            await sender.on_chunk_done(done)
            await asyncio.sleep(0.01)
            assert not got.done()  # no notification before finish
        result = await sender.finish(b"req")
        await got
        await sender.aclose()
        return result

    result = asyncio.run(run())
    # 6 tokens: only block 0 is full (already there); 12: blocks 1-2; 18: block 3; 22: block 4;
    # finish: the partial block 5 with the notification
    assert result.writes == 4 and result.backend == "shm"
    assert result.bytes == len(dst_ids) * desc.block_stride_bytes
    for s, t in zip(prompt_blocks[first:], dst_ids):
        assert torch.equal(dst[t], src[s])
    assert not dst[[0, 1, 2]].any()


def test_failed_chunk_write_stops_with_one_error(agents):
    p, _, _, _, desc = agents
    sender = ChunkSender(p, "cs-D", list(range(8)), 0, desc.blocks(list(range(8))), BLOCK, 10.0)

    async def run():
        await sender.on_chunk_done(8)  # two blocks posted
        p.remove_peer("cs-D")  # the decode worker left
        await sender.on_chunk_done(16)  # this write fails at once (unknown peer)
        await asyncio.sleep(0.01)
        with pytest.raises(TransferError):
            await sender.on_chunk_done(24)  # the prefill stops here
        await sender.aclose()
        return sender.writes

    assert asyncio.run(run()) == 2
