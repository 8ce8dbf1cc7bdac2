"""router/inflight.py CallReader: each read of an open decode call bounded by the stall timeout
(one timer per call, re-armed when it fires early) and interrupted when the call is evicted."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from router.inflight import CallReader, WorkerLost


class Stream:
    """Stands in for a grpc.aio.UnaryStreamCall: read() waits `gaps[i]` seconds for message i
    (None: forever), then EOF."""

    def __init__(self, gaps: list[float | None]) -> None:
        self.gaps = list(gaps)
        self.sent = 0

    async def read(self):
        if not self.gaps:
            return grpc.aio.EOF
        gap = self.gaps.pop(0)
        await (asyncio.sleep(gap) if gap is not None else asyncio.Event().wait())
        self.sent += 1
        return self.sent


async def _read_all(reader: CallReader, stall_s: float | None) -> list:
    out = []
    try:
        while (msg := await reader.next(stall_s)) is not grpc.aio.EOF:
            out.append(msg)
    finally:
        reader.close()
    return out


def test_reads_within_the_bound_run_past_it_in_total():
    async def main():
        lost = asyncio.get_running_loop().create_future()
        # ten reads of 30 ms each against a 100 ms bound: 300 ms in all, never one read too long
        return await _read_all(CallReader(Stream([0.03] * 10), lost, "w"), 0.1)
    assert asyncio.run(main()) == list(range(1, 11))


def test_a_silent_stream_is_lost_after_the_bound():
    async def main():
        lost = asyncio.get_running_loop().create_future()
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(WorkerLost, match="no response for 0.1 s") as info:
            await _read_all(CallReader(Stream([0.01, 0.01, None]), lost, "w"), 0.1)
        return loop.time() - start, info.value.instance_id
    took, wid = asyncio.run(main())
    assert wid == "w" and 0.1 <= took < 0.5  # detected at the bound (plus the two short reads)


def test_time_between_reads_does_not_count_and_no_bound_waits():
    async def main():
        lost = asyncio.get_running_loop().create_future()
        reader = CallReader(Stream([0.01, 0.01, 0.2]), lost, "w")
        assert await reader.next(0.05) == 1
        await asyncio.sleep(0.15)  # the caller is busy (writing to its client): not a stall
        assert await reader.next(0.05) == 2
        assert await reader.next(None) == 3  # unbounded read (before the first token)
        reader.close()
    asyncio.run(main())


def test_eviction_interrupts_a_read_and_outside_cancellation_propagates():
    async def main():
        loop = asyncio.get_running_loop()
        lost = loop.create_future()
        task = asyncio.ensure_future(_read_all(CallReader(Stream([None]), lost, "w"), None))
        await asyncio.sleep(0.01)
        lost.set_result("unhealthy")
        with pytest.raises(WorkerLost, match="unhealthy"):
            await task
        lost2 = loop.create_future()
        with pytest.raises(WorkerLost, match="already gone"):  # evicted before the read
            lost2.set_result("already gone")
            await CallReader(Stream([0.01]), lost2, "w").next(1.0)
        task = asyncio.ensure_future(_read_all(CallReader(Stream([None]), loop.create_future(), "w"), 1.0))
        await asyncio.sleep(0.01)
        task.cancel()  # the client went away: a plain cancellation, not a lost worker
        with pytest.raises(asyncio.CancelledError):
            await task
    asyncio.run(main())


def test_a_bound_that_shrinks_between_reads_is_honoured():
    async def main():
        loop = asyncio.get_running_loop()
        reader = CallReader(Stream([0.0, None]), loop.create_future(), "w")
        assert await reader.next(3.0) == 1  # leaves a timer due in 3 s
        start = loop.time()
        with pytest.raises(WorkerLost, match="no response for 0.1 s"):
            await reader.next(0.1)
        reader.close()
        return loop.time() - start
    assert asyncio.run(main()) < 1.0
