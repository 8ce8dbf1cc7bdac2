"""prefill_worker/inflight.py: which prompts wait for a prefix another prompt computes, and
that every waiter wakes (blocks cached, or the computing prompt's prefill ended any way)."""

from __future__ import annotations

import asyncio

from engine.kv_pool import PromptBlocks
from prefill_worker.inflight import InflightPrefixes, wait_for

BS = 16


def _prompt(hashes: list[int], cached: int = 0, extra_block: bool = True) -> PromptBlocks:
    """A prompt with these full-block hashes (block ids are not read here)."""
    return PromptBlocks(list(range(len(hashes) + int(extra_block))), hashes, cached)


def _announce(f: InflightPrefixes, hashes: list[int], tokens: int, cached: int = 0):
    return f.announce(_prompt(hashes, cached), tokens, BS)


def test_waits_only_when_the_shared_run_is_at_least_its_own_rest() -> None:
    f = InflightPrefixes()
    done = _announce(f, [1, 2, 3, 4], 4 * BS + 8)
    assert len(f) == 4
    # identical prompt: shares blocks 1-4, computes 8 tokens itself: waits
    assert f.should_wait(_prompt([1, 2, 3, 4]), 4 * BS + 8, BS) is not None
    # shares 1 block (16 tokens) of a 64-token prompt, would compute 48 itself: computes now
    assert f.should_wait(_prompt([1, 7, 8]), 4 * BS, BS) is None
    # blocks 1-2 cached here, 3-4 in flight (32 tokens), own rest 16; but the one computing
    # them has 72 tokens to do against this one's 48: computes now
    assert f.shared(_prompt([1, 2, 3, 4, 5], cached=2), 5 * BS, BS)[0] == 2
    assert f.should_wait(_prompt([1, 2, 3, 4, 5], cached=2), 5 * BS, BS) is None
    g = InflightPrefixes()  # the same when that one had blocks 1-2 cached too (40 tokens to do): waits
    _announce(g, [1, 2, 3, 4], 4 * BS + 8, cached=2)
    assert g.should_wait(_prompt([1, 2, 3, 4, 5], cached=2), 5 * BS, BS) is not None
    # nothing in flight right after the cached part
    assert f.should_wait(_prompt([5, 6]), 40, BS) is None
    done()
    assert len(f) == 0 and f.should_wait(_prompt([1, 2, 3, 4]), 4 * BS + 8, BS) is None


def test_never_counts_the_last_tokens_block_nor_waits_for_a_longer_prompt() -> None:
    f = InflightPrefixes()
    _announce(f, [1, 2, 3, 4, 5, 6, 7, 8], 8 * BS)  # a 128-token prompt being computed
    # a one-block prompt: its only block holds its last token, never taken from the cache
    assert f.shared(_prompt([1], extra_block=False), BS, BS)[0] == 0
    assert f.should_wait(_prompt([1], extra_block=False), BS, BS) is None
    # a prompt of exactly 4 blocks: 3 usable, own rest 16 tokens, but the one computing them
    # has 128 tokens to do against its 64: computing alone is quicker than waiting
    assert f.shared(_prompt([1, 2, 3, 4], extra_block=False), 4 * BS, BS)[0] == 3
    assert f.should_wait(_prompt([1, 2, 3, 4], extra_block=False), 4 * BS, BS) is None
    # the same 128 tokens (a burst of one prompt): 7 usable blocks, waits
    assert f.should_wait(_prompt([1, 2, 3, 4, 5, 6, 7, 8], extra_block=False), 8 * BS, BS) is not None


def test_a_second_announcer_keeps_the_first_ones_blocks_and_waiters_wake() -> None:
    async def main() -> None:
        f = InflightPrefixes()
        done_a = _announce(f, [1, 2], 2 * BS + 4)
        event_a = f.should_wait(_prompt([1, 2]), 2 * BS + 4, BS)
        done_b = _announce(f, [1, 2, 3, 4], 4 * BS + 4)  # 1, 2 stay A's; B adds 3, 4
        assert f.shared(_prompt([1, 2, 3, 4]), 4 * BS + 4, BS)[0] == 4
        event_b = f.should_wait(_prompt([1, 2, 3, 4]), 4 * BS + 4, BS)
        assert event_a is not None and event_b is not None and event_a is not event_b
        waiter = asyncio.create_task(wait_for(event_a, 5))
        await asyncio.sleep(0)
        done_a()
        done_a()  # idempotent
        assert await waiter is True
        assert f.shared(_prompt([1, 2, 3]), 3 * BS + 4, BS)[0] == 0  # A's blocks left with it
        assert f.shared(_prompt([1, 2, 3, 4], cached=2), 4 * BS + 4, BS)[0] == 2  # B's remain
        done_b()
        assert len(f) == 0 and event_b.is_set()

    asyncio.run(main())


def test_wait_is_bounded() -> None:
    async def main() -> bool:
        f = InflightPrefixes()
        _announce(f, [1, 2], 2 * BS + 4)  # never done: a wedged prefill
        event = f.should_wait(_prompt([1, 2]), 2 * BS + 4, BS)
        assert event is not None
        return await wait_for(event, 0.05)

    assert asyncio.run(main()) is False
