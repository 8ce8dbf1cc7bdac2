"""The router's global KV index: which workers hold which KV blocks (docs/architecture.md, step 2).

A block is identified by its chained 64-bit block hash (`common/block_hash.py`): block i's hash
covers blocks 0..i, so equal hashes mean equal prefixes, and a flat map
``hash -> holders`` is equivalent to a radix tree over the chained hashes (what NVIDIA Dynamo
calls its indexer). The index is fed by the workers' KV events
(``BlockStored{parent_hash, block_hashes[]}``, ``BlockRemoved{block_hashes[]}``,
``AllBlocksCleared``, and a full snapshot on (re)subscription) and answers one question on the
hot path of every request: for a request's block hashes, how many *leading* blocks does each
worker hold (its overlap)?

Representation:

* every worker gets a small bit index (freed indices are reused, lowest first, so masks stay
  small); ``_holders: dict[hash, int]`` maps a block hash to the bitmask of the workers
  holding it (a Python int, so any number of workers works: beyond 64 it is just a wider int);
* ``_blocks[bit]: dict[hash, None]`` lists what each worker holds, so removing a worker,
  clearing it or replacing it from a snapshot touches only its own blocks. (A dict rather than a
  set: dicts holding only ints are not tracked by Python's cycle collector, sets always are; with
  sets a full collection walked every block, about 40 ms per million blocks, a latency spike
  on the router's event loop. With dicts the whole index is invisible to the collector.)

A lookup (`overlaps`) walks the request's hashes in order with ``active &= holders[h]``; the
bits that drop out at depth d are the workers whose overlap is d; the walk stops as soon as no
worker is left, so its cost is O(longest overlap + 1) dictionary probes, independent of the
number of blocks in the index (tools/bench_router.py measures it).

Not thread-safe: the router owns one index per worker pool and uses it from one asyncio loop.
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass
from itertools import repeat
from typing import Iterable, NewType, Sequence

WorkerId = NewType("WorkerId", str)

__all__ = ["WorkerId", "KvIndex", "KvIndexCounters"]


@dataclass
class KvIndexCounters:
    """Monotonic event/block counters of a `KvIndex` (for metrics and debugging).

    All block counts are in blocks (one block = `block_size` tokens of one worker's KV cache).
    """

    stored_events: int = 0
    """`apply_stored` calls (BlockStored events)."""
    stored_blocks: int = 0
    """(worker, block) entries added by stored events and snapshots."""
    stored_duplicates: int = 0
    """Blocks in stored events that the worker already held (no-op; a repeated event)."""
    unknown_parent: int = 0
    """Stored events whose parent hash the worker did not hold (applied anyway)."""
    removed_events: int = 0
    """`apply_removed` calls (BlockRemoved events)."""
    removed_blocks: int = 0
    """(worker, block) entries removed by removed events, clears, snapshots and worker removal."""
    removed_unknown: int = 0
    """Blocks in removed events that the worker did not hold (no-op, counted)."""
    cleared: int = 0
    """`clear_worker` calls (AllBlocksCleared events)."""
    snapshots: int = 0
    """`replace_worker` calls (full snapshots applied)."""
    workers_added: int = 0
    """Workers that joined the index (`add_worker` of a new worker, or first event of one)."""
    workers_removed: int = 0
    """Workers removed with `remove_worker`."""

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class KvIndex:
    """For each block hash, the set of workers holding it.

    Event methods (`apply_stored`, `apply_removed`, `clear_worker`, `replace_worker`) add the
    worker implicitly if it is unknown, so the first event of a new worker needs no separate
    `add_worker`. `remove_worker` is for a worker that left discovery: all its blocks leave.
    """

    __slots__ = ("_bit_of", "_worker_of", "_bitmask", "_blocks", "_free_bits", "_holders",
                 "_total", "counters")

    def __init__(self) -> None:
        self._bit_of: dict[WorkerId, int] = {}
        self._worker_of: list[WorkerId | None] = []      # bit -> worker (None: free)
        self._bitmask: list[int] = []                    # bit -> 1 << bit (shared int objects)
        self._blocks: list[dict[int, None] | None] = []  # bit -> hashes that worker holds
        self._free_bits: list[int] = []                  # min-heap of freed bits
        self._holders: dict[int, int] = {}               # hash -> bitmask of holders
        self._total = 0                                  # sum of len(_blocks[b])
        self.counters = KvIndexCounters()

    # ------------------------------------------------------------------ workers

    def add_worker(self, worker: WorkerId) -> None:
        """Make `worker` known (holding no blocks). Idempotent: a known worker is unchanged."""
        self._bit(worker)

    def _bit(self, worker: WorkerId) -> int:
        bit = self._bit_of.get(worker)
        if bit is not None:
            return bit
        if self._free_bits:
            bit = heapq.heappop(self._free_bits)
            self._worker_of[bit] = worker
            self._blocks[bit] = {}
        else:
            bit = len(self._worker_of)
            self._worker_of.append(worker)
            self._bitmask.append(1 << bit)
            self._blocks.append({})
        self._bit_of[worker] = bit
        self.counters.workers_added += 1
        return bit

    def remove_worker(self, worker: WorkerId) -> int:
        """Forget `worker` and all its blocks (it left discovery). Returns the number of blocks
        it held (0 for an unknown worker). Its bit index is freed for reuse."""
        bit = self._bit_of.pop(worker, None)
        if bit is None:
            return 0
        n = self._drop_all(bit)
        self._worker_of[bit] = None
        self._blocks[bit] = None
        heapq.heappush(self._free_bits, bit)
        self.counters.workers_removed += 1
        return n

    def clear_worker(self, worker: WorkerId) -> int:
        """AllBlocksCleared: all of `worker`'s blocks leave, the worker stays known. Returns
        the number of blocks removed."""
        bit = self._bit(worker)
        self.counters.cleared += 1
        return self._drop_all(bit)

    def _drop_all(self, bit: int) -> int:
        blocks = self._blocks[bit]
        assert blocks is not None
        self._blocks[bit] = {}
        self._unset(bit, blocks)
        n = len(blocks)
        self._total -= n
        self.counters.removed_blocks += n
        return n

    def _unset(self, bit: int, hashes: Iterable[int]) -> None:
        """Clear `bit` in the holder masks of `hashes` (each must currently have it set)."""
        holders = self._holders
        bm = self._bitmask[bit]
        for h in hashes:
            m = holders[h] ^ bm
            if m:
                holders[h] = m
            else:
                del holders[h]

    def replace_worker(self, worker: WorkerId, hashes: Iterable[int]) -> tuple[int, int]:
        """Apply a full snapshot: afterwards `worker` holds exactly `hashes`.

        Only the difference is applied, so a snapshot equal to the current state is cheap.
        Returns (blocks added, blocks removed).
        """
        bit = self._bit(worker)
        old = self._blocks[bit]
        assert old is not None
        new = dict.fromkeys(hashes)
        gone = old.keys() - new.keys()
        added = new.keys() - old.keys()
        self._unset(bit, gone)
        self._set(bit, added)
        self._blocks[bit] = new
        self._total += len(added) - len(gone)
        c = self.counters
        c.snapshots += 1
        c.stored_blocks += len(added)
        c.removed_blocks += len(gone)
        return len(added), len(gone)

    # ------------------------------------------------------------------ events

    def _set(self, bit: int, hashes: Iterable[int]) -> None:
        """Set `bit` in the holder masks of `hashes` (idempotent)."""
        holders = self._holders
        get = holders.get
        bm = self._bitmask[bit]
        for h in hashes:
            m = get(h)
            # a block's first holder shares the precomputed `1 << bit` object (saves memory)
            holders[h] = bm if m is None else m | bm

    def apply_stored(self, worker: WorkerId, parent: int | None, hashes: Sequence[int]) -> int:
        """BlockStored: `worker` now holds `hashes` (chained, in prompt order; `parent` is the
        hash of the block before hashes[0], None for a prompt's first block).

        Blocks it already holds are counted (`stored_duplicates`) and otherwise ignored, so a
        repeated event is harmless. A parent the worker does not hold is counted
        (`unknown_parent`) but the blocks are still applied: the event stream is the truth, and
        a gap is the subscriber's to detect (router/kv_subscriber.py resyncs from a snapshot).
        Returns the number of blocks newly held.
        """
        bit = self._bit(worker)
        blocks = self._blocks[bit]
        assert blocks is not None
        c = self.counters
        c.stored_events += 1
        if parent is not None and parent not in blocks:
            c.unknown_parent += 1
        n0 = len(blocks)
        blocks.update(zip(hashes, repeat(None)))
        added = len(blocks) - n0
        self._set(bit, hashes)   # setting an already set bit is a no-op
        self._total += added
        c.stored_blocks += added
        c.stored_duplicates += len(hashes) - added
        return added

    def apply_removed(self, worker: WorkerId, hashes: Iterable[int]) -> int:
        """BlockRemoved: `worker` no longer holds `hashes`. A block it does not hold is a no-op,
        counted in `removed_unknown`. Returns the number of blocks actually removed."""
        bit = self._bit(worker)
        blocks = self._blocks[bit]
        assert blocks is not None
        holders = self._holders
        bm = self._bitmask[bit]
        removed = unknown = 0
        for h in hashes:
            if h in blocks:
                del blocks[h]
                m = holders[h] ^ bm
                if m:
                    holders[h] = m
                else:
                    del holders[h]
                removed += 1
            else:
                unknown += 1
        self._total -= removed
        c = self.counters
        c.removed_events += 1
        c.removed_blocks += removed
        c.removed_unknown += unknown
        return removed

    # ------------------------------------------------------------------ lookups

    def overlaps(self, hashes: Sequence[int]) -> dict[WorkerId, int]:
        """Per worker, the number of LEADING blocks of `hashes` it holds (in blocks).

        A worker's count stops at its first missing block, even if it holds later ones (a
        later block without its prefix is useless for prefix reuse). Workers with overlap 0 are
        omitted. Cost: one dict probe per block up to the longest overlap + 1, plus one step per
        worker with a non-zero overlap (hot path of every routing decision).

        Args:
            hashes: the request's chained block hashes in prompt order, as Python ints (from
                `common.block_hash.block_hashes`; numpy integers work but are slower).
        """
        if not hashes:
            return {}
        get = self._holders.get
        active = get(hashes[0], 0)
        if not active:
            return {}
        worker_of = self._worker_of
        out: dict[WorkerId, int] = {}
        depth = 1
        it = iter(hashes)
        next(it)
        for h in it:
            m = active & get(h, 0)
            if m != active:
                gone = active ^ m
                while gone:
                    low = gone & -gone
                    out[worker_of[low.bit_length() - 1]] = depth
                    gone ^= low
                if not m:
                    return out
                active = m
            depth += 1
        while active:
            low = active & -active
            out[worker_of[low.bit_length() - 1]] = depth
            active ^= low
        return out

    def holders(self, block_hash: int) -> list[WorkerId]:
        """The workers holding `block_hash` (in bit order)."""
        m = self._holders.get(block_hash, 0)
        out = []
        while m:
            low = m & -m
            out.append(self._worker_of[low.bit_length() - 1])
            m ^= low
        return out  # type: ignore[return-value]

    def holds(self, worker: WorkerId, block_hash: int) -> bool:
        bit = self._bit_of.get(worker)
        return bit is not None and block_hash in self._blocks[bit]  # type: ignore[operator]

    def num_blocks(self, worker: WorkerId) -> int:
        """Blocks `worker` holds (0 for an unknown worker)."""
        bit = self._bit_of.get(worker)
        return 0 if bit is None else len(self._blocks[bit])  # type: ignore[arg-type]

    def blocks(self, worker: WorkerId) -> frozenset[int]:
        """A copy of the hashes `worker` holds (for debugging and tests; O(blocks))."""
        bit = self._bit_of.get(worker)
        return frozenset() if bit is None else frozenset(self._blocks[bit])  # type: ignore[arg-type]

    def workers(self) -> list[WorkerId]:
        """Known workers, in the order they were added."""
        return list(self._bit_of)

    def __contains__(self, worker: object) -> bool:
        return worker in self._bit_of

    def __len__(self) -> int:
        return len(self._bit_of)

    @property
    def unique_blocks(self) -> int:
        """Distinct block hashes held by at least one worker."""
        return len(self._holders)

    @property
    def total_entries(self) -> int:
        """(worker, block) pairs: the sum of `num_blocks` over all workers."""
        return self._total
