"""prefill_worker/inflight.py: which prompts wait for a prefix another prompt computes, and
that every waiter wakes (blocks cached, or the computing prompt's prefill ended any way)."""

from __future__ import annotations

import asyncio

from engine.kv_pool import PromptBlocks
from prefill_worker.inflight import InflightPrefixes, wait_for

BS = 16


def _prompt(hashes: list[int], cached: int = 0) -> PromptBlocks:
    return PromptBlocks(list(range(len(hashes) + 1)), hashes, cached)


def test_waits_only_when_the_shared_run_is_at_least_its_own_rest() -> None:
    f = InflightPrefixes()
    done = f.announce(_prompt([1, 2, 3, 4]))
    assert len(f) == 4
    # shares blocks 1-2 (32 tokens), would compute 40 - 32 = 8 more tokens itself: waits
    assert f.should_wait(_prompt([1, 2, 9]), 40, BS) is not None
    # shares 1 block (16 tokens) of a 64-token prompt: computes now
    assert f.should_wait(_prompt([1, 7, 8, 9]), 64, BS) is None
    # its cached prefix counts as neither: blocks 1-2 cached, 3-4 in flight (32), own rest 16
    assert f.shared(_prompt([1, 2, 3, 4, 5], cached=2))[0] == 2
    assert f.should_wait(_prompt([1, 2, 3, 4, 5], cached=2), 5 * BS + 0, BS) is not None
    # nothing in flight right after the cached part
    assert f.should_wait(_prompt([5, 6]), 40, BS) is None
    done()
    assert len(f) == 0 and f.should_wait(_prompt([1, 2, 9]), 40, BS) is None


def test_a_second_announcer_keeps_the_first_ones_blocks_and_waiters_wake() -> None:
    async def main() -> None:
        f = InflightPrefixes()
        done_a = f.announce(_prompt([1, 2]))
        event_a = f.should_wait(_prompt([1, 2, 3]), 40, BS)
        done_b = f.announce(_prompt([1, 2, 3, 4]))  # 1, 2 stay A's; B adds 3, 4
        assert f.shared(_prompt([1, 2, 3, 4, 5]))[0] == 4
        event_b = f.should_wait(_prompt([1, 2, 3, 4, 5]), 80, BS)
        assert event_a is not None and event_b is not None and event_a is not event_b
        waiter = asyncio.create_task(wait_for(event_a, 5))
        await asyncio.sleep(0)
        done_a()
        done_a()  # idempotent
        assert await waiter is True
        assert f.shared(_prompt([1, 2, 3]))[0] == 0  # A's blocks left with it
        assert f.shared(_prompt([1, 2, 3, 4], cached=2))[0] == 2  # B's remain
        done_b()
        assert len(f) == 0 and event_b.is_set()

    asyncio.run(main())


def test_wait_is_bounded() -> None:
    async def main() -> bool:
        f = InflightPrefixes()
        f.announce(_prompt([1, 2]))  # never done: a wedged prefill
        event = f.should_wait(_prompt([1, 2, 3]), 40, BS)
        assert event is not None
        return await wait_for(event, 0.05)

    assert asyncio.run(main()) is False
