"""The KV pools of an expert-parallel decode worker's ranks, seen as one pool.

With data-parallel attention each EP rank owns its requests and their KV: rank r has its own
`KvPool` (blocks, prefix cache, LRU) over its own storage (shared memory on a CPU, its GPU's
HBM), which the worker registers with a transfer agent of rank r's own, so a prefill worker
writes a request's blocks straight into the owning rank's pool. Block ids handed out are
*global*: rank r's local block b is `r * num_blocks + b`; `split` gives the rank and the local
ids a KvDestination carries.

`EpKvPool` offers what the decode service and scheduler use of a `KvPool` (allocate_prompt,
commit_prompt, grow, free, block_size, kv, blocks, hash_seed, config), so they run unchanged.
"""

from __future__ import annotations

import dataclasses

import torch

from common.block_hash import BlockHash, block_hashes
from engine.block_pool import BlockId, BlockPool, Cleared, PoolEvent, PoolExhausted, Removed, Stored
from engine.kv_pool import KvPool, KvPoolConfig, PromptBlocks


class EpBlocks:
    """KV events and counters over every rank's BlockPool: to the router the worker holds a
    block hash while any rank caches it, so Stored is sent for a hash's first copy and Removed
    when its last copy goes."""

    def __init__(self, pools: list[BlockPool]) -> None:
        self._pools = pools
        self._holders: dict[BlockHash, set[int]] = {}

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self._pools)

    @property
    def num_free(self) -> int:
        return sum(p.num_free for p in self._pools)

    @property
    def num_cached(self) -> int:
        return len(self._holders)

    def clear_cache(self) -> None:
        for p in self._pools:
            p.clear_cache()

    def _drop(self, h: BlockHash, rank: int) -> bool:
        """Rank no longer caches h; True when no rank does."""
        holders = self._holders.get(h)
        if holders is None or rank not in holders:
            return False
        holders.discard(rank)
        if not holders:
            del self._holders[h]
            return True
        return False

    def drain_events(self) -> list[PoolEvent]:
        out: list[PoolEvent] = []
        for rank, pool in enumerate(self._pools):
            for ev in pool.drain_events():
                if isinstance(ev, Stored):
                    run: list[BlockHash] = []
                    prev = run_parent = ev.parent
                    for h in ev.hashes:
                        holders = self._holders.setdefault(h, set())
                        first = not holders
                        holders.add(rank)
                        if first:
                            if not run:
                                run_parent = prev
                            run.append(h)
                        elif run:
                            out.append(Stored(run_parent, tuple(run)))
                            run = []
                        prev = h
                    if run:
                        out.append(Stored(run_parent, tuple(run)))
                elif isinstance(ev, Removed):
                    gone = tuple(h for h in ev.hashes if self._drop(h, rank))
                    if gone:
                        out.append(Removed(gone))
                else:
                    assert isinstance(ev, Cleared)
                    gone = tuple(h for h in list(self._holders) if self._drop(h, rank))
                    if gone:
                        out.append(Removed(gone))
        return out

    def snapshot(self) -> list[Stored]:
        seen: set[BlockHash] = set()
        out = []
        for pool in self._pools:
            for st in pool.snapshot():
                if st.hashes[0] not in seen:
                    seen.add(st.hashes[0])
                    out.append(st)
        return out


class EpKvPool:
    """Per-rank KV pools with global block ids (single-threaded: the event-loop thread)."""

    def __init__(self, rank_config: KvPoolConfig, hash_seed: int, kv: list[torch.Tensor]) -> None:
        """kv: each rank's storage [num_blocks, num_layers, block_size, kv_dim] (in shared memory
        on a CPU, in the rank's HBM on GPUs); the worker registers each with a transfer agent of
        its own (worker/host.py)."""
        self.ep_size = len(kv)
        self.rank_config = rank_config
        self.config = dataclasses.replace(rank_config, num_blocks=self.ep_size * rank_config.num_blocks)
        self.hash_seed = hash_seed
        self.ranks = [KvPool(rank_config, hash_seed, kv=t) for t in kv]
        self.kv = self.ranks[0].kv  # rank 0's storage: its device is the worker's
        self.blocks = EpBlocks([p.blocks for p in self.ranks])
        self.assigned = [0] * self.ep_size  # prompts placed on each rank (a counter for tests/metrics)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def split(self, block_ids: list[BlockId]) -> tuple[int, list[BlockId]]:
        """(owning rank, local block ids) of one request's global block ids."""
        nb = self.rank_config.num_blocks
        rank = block_ids[0] // nb
        local = [BlockId(b - rank * nb) for b in block_ids]
        assert all(0 <= b < nb for b in local), f"blocks {block_ids} span several ranks"
        return rank, local

    def _global(self, rank: int, block_ids: list[BlockId]) -> list[BlockId]:
        return [BlockId(rank * self.rank_config.num_blocks + b) for b in block_ids]

    def choose_rank(self, token_ids: list[int], seed: int | None = None) -> list[int]:
        """Ranks in order of preference for a new prompt: lowest cost first, where cost =
        blocks to compute (not in that rank's prefix cache) + blocks in use there — the router's
        kv cost with prefill_weight 1 (docs/routing.md, "The cost"), so requests spread over idle ranks
        and a shared prefix is reused where it is cached. Ties go to the lower rank."""
        bs = self.block_size
        hashes = block_hashes(token_ids, bs, self.hash_seed if seed is None else seed)
        need = self.blocks_for(len(token_ids))
        costs = []
        for r, pool in enumerate(self.ranks):
            overlap = len(pool.blocks.match_prefix(hashes)[: (len(token_ids) - 1) // bs])
            in_use = pool.config.num_blocks - pool.blocks.num_free
            costs.append((need - overlap + in_use, r))
        return [r for _, r in sorted(costs)]

    def allocate_prompt(self, token_ids: list[int], seed: int | None = None) -> PromptBlocks:
        """Blocks for a prompt on the cheapest rank that has room (see `choose_rank`); `seed`
        as KvPool.allocate_prompt's.

        Raises:
            PoolExhausted: no rank has enough free blocks (nothing is held then).
        """
        exc: PoolExhausted | None = None
        for rank in self.choose_rank(token_ids, seed):
            try:
                p = self.ranks[rank].allocate_prompt(token_ids, seed)
            except PoolExhausted as e:
                exc = e
                continue
            self.assigned[rank] += 1
            return PromptBlocks(self._global(rank, p.block_ids), p.hashes, p.num_cached_blocks)
        assert exc is not None
        raise exc

    def allocate_beside(self, like: list[BlockId], n: int) -> list[BlockId]:
        """n fresh blocks on the rank that holds `like` (a request's blocks; may be empty when
        n is 0). Raises PoolExhausted: that rank has fewer free blocks (nothing is taken)."""
        if n == 0:
            return []
        rank, _ = self.split(like)
        return self._global(rank, self.ranks[rank].blocks.allocate(n))

    def commit_prompt(self, prompt: PromptBlocks) -> None:
        rank, local = self.split(prompt.block_ids)
        self.ranks[rank].commit_prompt(PromptBlocks(local, prompt.hashes, prompt.num_cached_blocks))

    def grow(self, block_ids: list[BlockId], num_tokens: int) -> None:
        """Extend a request's (non-empty) block list on its own rank to hold num_tokens.

        Raises:
            PoolExhausted: that rank has not enough free blocks.
        """
        need = self.blocks_for(num_tokens) - len(block_ids)
        if need > 0:
            rank, _ = self.split(block_ids)
            block_ids.extend(self._global(rank, self.ranks[rank].blocks.allocate(need)))

    def free(self, block_ids: list[BlockId]) -> None:
        if block_ids:
            rank, local = self.split(block_ids)
            self.ranks[rank].free(local)
