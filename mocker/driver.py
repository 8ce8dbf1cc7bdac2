"""Runs a MockEngine in real time: iterations take their simulated duration / speedup.

To stay light with 100+ engines on 2 cores, one wake-up runs as many iterations as fit in
`tick_s` of real time (their simulated durations added up), sleeps until the real time they
end at, then tells the requests what changed: tokens reach clients in groups, like SGLang's
--stream-interval. A first token ends the group at once, so TTFT is not rounded up to a tick.
Time lost to a busy CPU is not made up (the engine idles, as a real one would on a stall).
"""

from __future__ import annotations

import asyncio
import logging

from mocker.engine import MockEngine, SimRequest

log = logging.getLogger(__name__)


class RealTimeDriver:
    def __init__(self, engine: MockEngine, speedup: float, tick_s: float = 0.05) -> None:
        self.engine = engine
        self.speedup = speedup
        self.tick_s = tick_s
        self._wake = asyncio.Event()
        self.failed: BaseException | None = None

    def wake(self) -> None:
        """Call after submitting, cancelling or delivering KV, so the loop looks again."""
        self._wake.set()

    def notify(self) -> None:
        for req in self.engine.take_changed():
            if req.on_change is not None:
                req.on_change(req)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        try:
            while True:
                busy = engine.has_work()  # admits: a REMOTE_KV admission is in `changed` now
                self.notify()  # before sleeping, or its stream would wait for the next wake-up
                if not busy:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                start = loop.time()
                sim = 0.0
                while engine.has_work() and sim < self.tick_s * self.speedup:
                    firsts = engine.stats.first_tokens
                    sim += engine.step()
                    if engine.stats.first_tokens != firsts:
                        break  # a prompt finished: deliver its first token now
                await asyncio.sleep(max(0.0, start + sim / self.speedup - loop.time()))
                self.notify()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported to every stream, then re-raised
            log.exception("mock engine failed")
            self.failed = exc
            e = self.engine
            for req in [*e.waiting, *e.prefilling, *e.running, *e.await_kv]:
                if req.on_change is not None:
                    req.on_change(req)  # its stream sees `failed` and ends with INTERNAL
            raise

    def submit(self, req: SimRequest) -> None:
        self.engine.submit(req)
        self.wake()
