"""Block accounting for a paged KV pool: reference counts, prefix cache, LRU eviction.

Blocks are ids 0..num_blocks-1. A block is *referenced* while some request uses it. A block
whose contents are a full, hashed prompt block is *cached*: its hash maps to it in the prefix
cache, and it stays cached after its last reference goes, on an LRU free list, until the
space is needed. Unhashed free blocks are handed out before cached ones (O(1) both ways,
like vLLM's `v1/core/block_pool.py`).

The pool itself emits the KV events through `events`: BlockStored when a hash enters the prefix
cache, BlockRemoved when it leaves (eviction), AllBlocksCleared. Only one block per hash is ever
cached, so "removed" is reported exactly when the last copy goes.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import NewType, Sequence

from common.block_hash import BlockHash

BlockId = NewType("BlockId", int)


class PoolExhausted(Exception):
    """Not enough free blocks; `needed` and `free` are block counts."""

    def __init__(self, needed: int, free: int) -> None:
        super().__init__(f"KV pool exhausted: need {needed} blocks, {free} free")
        self.needed = needed
        self.free = free


@dataclass(frozen=True)
class Stored:
    parent: BlockHash | None
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class Removed:
    hashes: tuple[BlockHash, ...]


@dataclass(frozen=True)
class Cleared:
    pass


PoolEvent = Stored | Removed | Cleared


@dataclass
class _Block:
    refs: int = 0
    hash: BlockHash | None = None
    parent: BlockHash | None = None


@dataclass
class BlockPool:
    """Reference-counted blocks with a prefix cache keyed by block hash.

    Invariants: a block is in the free list iff refs == 0; `cached[h] == b` iff
    blocks[b].hash == h. Events are appended to `events` and drained by the owner.
    """

    num_blocks: int
    _blocks: list[_Block] = field(init=False)
    _free: OrderedDict[BlockId, None] = field(init=False)  # front = evicted first
    _cached: dict[BlockHash, BlockId] = field(init=False)
    events: list[PoolEvent] = field(init=False)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        self._blocks = [_Block() for _ in range(self.num_blocks)]
        self._free = OrderedDict((BlockId(i), None) for i in range(self.num_blocks))
        self._cached = {}
        self.events = []

    @property
    def num_free(self) -> int:
        """Blocks with no reference (cached ones included: they can be evicted)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def refs(self, block: BlockId) -> int:
        return self._blocks[block].refs

    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[BlockId]:
        """Blocks caching the longest leading run of `hashes` (no references taken)."""
        out: list[BlockId] = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, blocks: Sequence[BlockId]) -> None:
        """Take one reference on each block (cached blocks leave the free list)."""
        for b in blocks:
            blk = self._blocks[b]
            if blk.refs == 0:
                del self._free[b]
            blk.refs += 1

    def allocate(self, n: int) -> list[BlockId]:
        """Take n blocks with one reference each, evicting LRU cached blocks if needed.

        Raises:
            PoolExhausted: fewer than n blocks are free; nothing is taken then.
        """
        if n > len(self._free):
            raise PoolExhausted(n, len(self._free))
        out: list[BlockId] = []
        evicted: list[BlockHash] = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            blk = self._blocks[b]
            if blk.hash is not None:
                evicted.append(blk.hash)
                del self._cached[blk.hash]
                blk.hash = blk.parent = None
            blk.refs = 1
            out.append(b)
        if evicted:
            self.events.append(Removed(tuple(evicted)))
        return out

    def free(self, blocks: Sequence[BlockId]) -> None:
        """Drop one reference on each block. Freed cached blocks become most recently used;
        freed uncached blocks go to the front so they are reused first."""
        for b in reversed(blocks):  # a request's tail blocks are evicted before its head
            blk = self._blocks[b]
            assert blk.refs > 0, f"double free of block {b}"
            blk.refs -= 1
            if blk.refs == 0:
                self._free[b] = None
                if blk.hash is None:
                    self._free.move_to_end(b, last=False)

    def cache(self, blocks: Sequence[BlockId], hashes: Sequence[BlockHash],
              parent: BlockHash | None) -> None:
        """Enter full blocks into the prefix cache under their hashes (blocks[i] ↔ hashes[i]).

        A hash already cached by another block keeps that block; a block already cached
        under the same hash is skipped. Emits one Stored event for the newly cached run(s).
        """
        assert len(blocks) == len(hashes)
        run: list[BlockHash] = []
        run_parent = prev = parent
        for b, h in zip(blocks, hashes):
            blk = self._blocks[b]
            if blk.hash is None and h not in self._cached:
                if not run:
                    run_parent = prev
                blk.hash, blk.parent = h, prev
                self._cached[h] = b
                run.append(h)
            elif run:
                self.events.append(Stored(run_parent, tuple(run)))
                run = []
            prev = h
        if run:
            self.events.append(Stored(run_parent, tuple(run)))

    def clear_cache(self) -> None:
        """Forget every cached hash (blocks in use stay allocated); emits Cleared."""
        for blk in self._blocks:
            blk.hash = blk.parent = None
        self._cached.clear()
        self.events.append(Cleared())

    def snapshot(self) -> list[Stored]:
        """Every cached block as Stored events (parent first order not guaranteed)."""
        return [Stored(self._blocks[b].parent, (h,)) for h, b in self._cached.items()]

    def drain_events(self) -> list[PoolEvent]:
        out, self.events = self.events, []
        return out
