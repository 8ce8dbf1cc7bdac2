"""Approximate KV index for engines that publish no KV events (the router's `approx` mode).

Without events the router cannot know what a worker caches, so it assumes: after routing a
request to worker w, w holds the request's blocks for `ttl_s` seconds (refreshed whenever
another request with those blocks is routed there), and at most `max_blocks_per_worker` of
them. Over the bound, the least recently routed request's blocks go first, its last block
first (leaf first, like an engine's LRU, so what stays is still a usable prefix). Lookups work
exactly as with `KvIndex` (`overlaps`: leading blocks per worker).

Bookkeeping: every `record` call is one batch (its sequence number, expiry time and hashes);
per worker, ``owner[hash]`` is the sequence number of the latest batch that recorded the hash,
so a batch only drops the hashes it still owns (a later request refreshed the others). Expiry
is lazy: a FIFO of (expiry, worker) per batch tells `expire` which workers have due batches, so
a call costs O(blocks of the batches that came due), each recorded block being looked at once
when its batch expires or is evicted: no scan of live entries. `now` is any monotonic clock in
seconds (e.g. `time.monotonic()`); it must not go backwards between calls (if it does, entries
just live longer).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from itertools import repeat
from typing import Sequence

from router.kv_index import KvIndex, WorkerId

__all__ = ["ApproxIndex"]


@dataclass
class _Worker:
    owner: dict[int, int] = field(default_factory=dict)        # hash -> seq of its latest batch
    # batches, oldest first: [expiry (s), seq, hashes leaf first, how many already consumed]
    batches: deque[list] = field(default_factory=deque)


class ApproxIndex:
    """TTL- and size-bounded guess of each worker's cached blocks, built on `KvIndex`.

    Args:
        ttl_s: seconds a recorded block is assumed to stay cached (default 120 s).
        max_blocks_per_worker: blocks assumed held per worker at most (default 1,000,000).
    """

    def __init__(self, ttl_s: float = 120.0, max_blocks_per_worker: int = 1_000_000) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        if max_blocks_per_worker < 1:
            raise ValueError(f"max_blocks_per_worker must be >= 1, got {max_blocks_per_worker}")
        self.ttl_s = float(ttl_s)
        self.max_blocks_per_worker = int(max_blocks_per_worker)
        self.index = KvIndex()
        self._workers: dict[WorkerId, _Worker] = {}
        self._due: deque[tuple[float, WorkerId]] = deque()       # (expiry, worker), one per batch
        self._seq = 0
        self.expired_blocks = 0
        """Blocks dropped because their TTL passed."""
        self.evicted_blocks = 0
        """Blocks dropped because a worker exceeded `max_blocks_per_worker`."""

    def record(self, worker: WorkerId, hashes: Sequence[int], now: float) -> None:
        """After routing a request with block hashes `hashes` (prompt order) to `worker` at time
        `now` (s): assume the worker holds them until `now + ttl_s` (refreshing any it had)."""
        self.expire(now)
        st = self._workers.get(worker)
        if st is None:
            st = self._workers[worker] = _Worker()
            self.index.add_worker(worker)
        if not hashes:
            return
        self._seq += 1
        expiry = now + self.ttl_s
        st.owner.update(zip(hashes, repeat(self._seq)))
        st.batches.append([expiry, self._seq, hashes[::-1], 0])
        self._due.append((expiry, worker))
        self.index.apply_stored(worker, None, hashes)
        over = len(st.owner) - self.max_blocks_per_worker
        if over > 0:
            self.evicted_blocks += self._evict(worker, st, over)

    def _evict(self, worker: WorkerId, st: _Worker, n: int) -> int:
        """Drop `n` blocks of `worker`, oldest batch first, leaf first within a batch."""
        owner = st.owner
        victims: list[int] = []
        while len(victims) < n:
            b = st.batches[0]
            _, seq, hs, k = b
            while k < len(hs) and len(victims) < n:
                h = hs[k]
                k += 1
                if owner.get(h) == seq:
                    del owner[h]
                    victims.append(h)
            if k == len(hs):
                st.batches.popleft()      # its FIFO entry, when due, finds nothing left
            else:
                b[3] = k
        self.index.apply_removed(worker, victims)
        return len(victims)

    def expire(self, now: float) -> int:
        """Drop every block whose expiry time is <= `now`. Returns the number dropped.
        Called by `record` and `overlaps`; O(blocks of the batches that came due)."""
        due = self._due
        dropped = 0
        while due and due[0][0] <= now:
            _, worker = due.popleft()
            st = self._workers.get(worker)
            if st is None:
                continue
            owner, batches = st.owner, st.batches
            victims: list[int] = []
            while batches and batches[0][0] <= now:
                _, seq, hs, k = batches.popleft()
                get = owner.get
                victims += [h for h in (hs[k:] if k else hs) if get(h) == seq]
            if victims:
                for h in victims:
                    del owner[h]
                self.index.apply_removed(worker, victims)
                dropped += len(victims)
        self.expired_blocks += dropped
        return dropped

    def overlaps(self, hashes: Sequence[int], now: float) -> dict[WorkerId, int]:
        """Per worker, the number of leading blocks of `hashes` it is assumed to hold at `now`
        (entries past their TTL do not count); workers with 0 omitted. See `KvIndex.overlaps`.

        Includes the expiry work that came due (about 0.5 µs per expired block); a caller that
        wants lookups lean can call `expire(now)` from a timer between requests."""
        self.expire(now)
        return self.index.overlaps(hashes)

    def remove_worker(self, worker: WorkerId) -> int:
        """Forget `worker` (it left discovery). Returns the number of blocks it was assumed to
        hold. Its FIFO entries are skipped when they come due."""
        self._workers.pop(worker, None)
        return self.index.remove_worker(worker)

    def num_blocks(self, worker: WorkerId) -> int:
        """Blocks `worker` is assumed to hold (expired ones included until the next call)."""
        return self.index.num_blocks(worker)

    def workers(self) -> list[WorkerId]:
        return self.index.workers()


class KvWithRecent:
    """kv mode with `--kv-recent`: a worker's overlap is the longer of what its KV events say
    (`KvIndex`) and the prefix of a request routed to it in the last `recent_s` seconds. A
    prompt's blocks reach the index only when its prefill finishes; until then, a follow-up
    sharing the prefix (the next turn of a conversation, under a high arrival rate) would
    otherwise see no overlap anywhere."""

    def __init__(self, index: KvIndex, recent_s: float, clock=None) -> None:
        self.index = index
        self.recent = ApproxIndex(ttl_s=recent_s)
        self.clock = clock or time.monotonic

    def record(self, worker: WorkerId, hashes: Sequence[int]) -> None:
        self.recent.record(worker, hashes, self.clock())

    def overlaps(self, hashes: Sequence[int]) -> dict[WorkerId, int]:
        out = self.index.overlaps(hashes)
        for w, n in self.recent.overlaps(hashes, self.clock()).items():
            if n > out.get(w, 0):
                out[w] = n
        return out

    def remove_worker(self, worker: WorkerId) -> None:
        self.recent.remove_worker(worker)
