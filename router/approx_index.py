"""Approximate KV index for engines that publish no KV events (DESIGN.md section 4, "Approximate
mode").

Without events the router cannot know what a worker caches, so it assumes: after routing a
request to worker w, w holds the request's blocks for `ttl_s` seconds (refreshed whenever
another request with those blocks is routed there), and at most `max_blocks_per_worker` of
them (the least recently routed ones are dropped first, like an LRU cache would). Lookups then
work exactly as with `KvIndex` (`overlaps`: leading blocks per worker).

Expiry is lazy and amortized O(expired blocks): each `record` call appends one entry
(expiry time, worker) to a FIFO; a lookup pops only the FIFO entries that are due and, for each,
drops the worker's oldest blocks whose expiry has passed. Per worker, blocks are kept in an
`OrderedDict` in recording order, which (with one TTL for all, and non-decreasing `now`) is also
expiry order. `now` is any monotonic clock in seconds (e.g. `time.monotonic()`), and must not go
backwards between calls (if it does, entries just live longer).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import islice, repeat
from typing import Sequence

from router.kv_index import KvIndex, WorkerId

__all__ = ["ApproxIndex"]


class ApproxIndex:
    """TTL- and size-bounded guess of each worker's cached blocks, built on `KvIndex`.

    Args:
        ttl_s: seconds a recorded block is assumed to stay cached (default 120 s).
        max_blocks_per_worker: blocks assumed held per worker at most (default 1,000,000);
            recording more drops that worker's least recently recorded blocks first.
    """

    def __init__(self, ttl_s: float = 120.0, max_blocks_per_worker: int = 1_000_000) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_blocks_per_worker < 1:
            raise ValueError(f"max_blocks_per_worker must be >= 1, got {max_blocks_per_worker}")
        self.ttl_s = float(ttl_s)
        self.max_blocks_per_worker = int(max_blocks_per_worker)
        self.index = KvIndex()
        # worker -> {hash: expiry time}, oldest (first to expire) first
        self._lru: dict[WorkerId, OrderedDict[int, float]] = {}
        # (expiry time, worker) per record call, in call order (so in expiry order)
        self._due: deque[tuple[float, WorkerId]] = deque()
        self.expired_blocks = 0
        """Blocks dropped because their TTL passed."""
        self.evicted_blocks = 0
        """Blocks dropped because a worker exceeded `max_blocks_per_worker`."""

    def record(self, worker: WorkerId, hashes: Sequence[int], now: float) -> None:
        """After routing a request with block hashes `hashes` to `worker` at time `now` (s):
        assume the worker holds them until `now + ttl_s` (refreshing any it already had)."""
        self.expire(now)
        lru = self._lru.get(worker)
        if lru is None:
            lru = self._lru[worker] = OrderedDict()
            self.index.add_worker(worker)
        if not hashes:
            return
        expiry = now + self.ttl_s
        pop = lru.pop
        for h in hashes:           # re-recorded blocks move to the young end
            pop(h, None)
        lru.update(zip(hashes, repeat(expiry)))
        self.index.apply_stored(worker, None, hashes)
        self._due.append((expiry, worker))
        over = len(lru) - self.max_blocks_per_worker
        if over > 0:
            victims = list(islice(lru, over))
            for h in victims:
                del lru[h]
            self.index.apply_removed(worker, victims)
            self.evicted_blocks += over

    def expire(self, now: float) -> int:
        """Drop every block whose expiry time is <= `now`. Returns the number dropped.
        Called by `record` and `overlaps`; O(blocks dropped + record calls that came due)."""
        due = self._due
        dropped = 0
        while due and due[0][0] <= now:
            _, worker = due.popleft()
            lru = self._lru.get(worker)
            if not lru:
                continue
            victims = []
            for h, exp in lru.items():
                if exp > now:
                    break
                victims.append(h)
            if victims:
                for h in victims:
                    del lru[h]
                self.index.apply_removed(worker, victims)
                dropped += len(victims)
        self.expired_blocks += dropped
        return dropped

    def overlaps(self, hashes: Sequence[int], now: float) -> dict[WorkerId, int]:
        """Per worker, the number of leading blocks of `hashes` it is assumed to hold at `now`
        (entries past their TTL do not count); workers with 0 omitted. See `KvIndex.overlaps`."""
        self.expire(now)
        return self.index.overlaps(hashes)

    def remove_worker(self, worker: WorkerId) -> int:
        """Forget `worker` (it left discovery). Returns the number of blocks it was assumed to
        hold. Its stale FIFO entries are skipped when they come due."""
        self._lru.pop(worker, None)
        return self.index.remove_worker(worker)

    def num_blocks(self, worker: WorkerId) -> int:
        """Blocks `worker` is assumed to hold (expired ones included until the next call)."""
        return self.index.num_blocks(worker)

    def workers(self) -> list[WorkerId]:
        return self.index.workers()
