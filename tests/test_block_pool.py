import pytest
import torch

from common.block_hash import block_hashes
from engine.block_pool import BlockPool, Cleared, PoolExhausted, Removed, Stored
from engine.kv_pool import KvPool, KvPoolConfig, PagedKvCache

SEED = 123


def pool(n=8, bs=4) -> KvPool:
    return KvPool(KvPoolConfig(num_blocks=n, block_size=bs, num_layers=2, kv_dim=3), SEED)


def test_allocate_and_free_restore_free_count():
    p = BlockPool(4)
    blocks = p.allocate(3)
    assert p.num_free == 1 and all(p.refs(b) == 1 for b in blocks)
    p.free(blocks)
    assert p.num_free == 4


def test_exhaustion_takes_nothing():
    p = BlockPool(2)
    p.allocate(1)
    with pytest.raises(PoolExhausted) as e:
        p.allocate(2)
    assert e.value.needed == 2 and e.value.free == 1 and p.num_free == 1


def test_prefix_reuse_and_refcounts():
    kv = pool()
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    a = kv.allocate_prompt(tokens)
    assert a.num_cached_blocks == 0 and len(a.block_ids) == 3
    kv.commit_prompt(a)
    b = kv.allocate_prompt(tokens + [99, 98])
    assert b.num_cached_blocks == 2 and b.block_ids[:2] == a.block_ids[:2]
    assert kv.blocks.refs(a.block_ids[0]) == 2
    kv.free(a.block_ids)
    kv.free(b.block_ids)
    assert kv.blocks.num_free == 8


def test_fully_cached_prompt_recomputes_last_block():
    kv = pool()
    tokens = list(range(8))  # exactly 2 blocks
    a = kv.allocate_prompt(tokens)
    kv.commit_prompt(a)
    kv.free(a.block_ids)
    b = kv.allocate_prompt(tokens)
    assert b.num_cached_blocks == 1  # at least one token is computed, into a private block
    assert b.block_ids[1] != a.block_ids[1]


def test_lru_eviction_order_and_events():
    p = BlockPool(3)
    h = block_hashes(list(range(12)), 4, SEED)
    b1 = p.allocate(1)
    p.cache(b1, h[:1], None)
    b2 = p.allocate(1)
    p.cache(b2, h[1:2], h[0])
    p.free(b1)
    p.free(b2)  # b1 is least recently used
    assert p.drain_events() == [Stored(None, (h[0],)), Stored(h[0], (h[1],))]
    got = p.allocate(1)  # the never-cached block goes first
    assert got != b1 and got != b2 and p.num_cached == 2
    got2 = p.allocate(1)
    assert got2 == b1 and p.match_prefix(h[:2]) == []
    assert p.drain_events() == [Removed((h[0],))]


def test_duplicate_hash_is_cached_once_and_removed_once():
    p = BlockPool(4)
    h = block_hashes(list(range(4)), 4, SEED)
    x, y = p.allocate(2)
    p.cache([x], h, None)
    p.cache([y], h, None)  # a second copy of the same block: not cached again
    assert p.drain_events() == [Stored(None, (h[0],))]
    p.free([x, y])
    p.allocate(4)
    assert p.drain_events() == [Removed((h[0],))]


def test_clear_cache_emits_cleared():
    p = BlockPool(2)
    b = p.allocate(1)
    p.cache(b, [1], None)
    p.clear_cache()
    assert p.drain_events()[-1] == Cleared() and p.match_prefix([1]) == []


def test_cancel_frees_everything():
    kv = pool()
    a = kv.allocate_prompt(list(range(9)))
    kv.grow(a.block_ids, 13)
    assert len(a.block_ids) == 4
    kv.free(a.block_ids)
    assert kv.blocks.num_free == 8


def test_paged_cache_writes_slots_and_reads_context():
    kv = pool()
    blocks = kv.blocks.allocate(2)
    cache = PagedKvCache(kv, [(blocks, 0, 6)])
    latent = torch.arange(18, dtype=torch.float32).reshape(6, 3)
    (ctx,) = cache.update(1, latent)
    assert torch.equal(ctx, latent)
    assert torch.equal(kv.kv[blocks[1], 1, 1], latent[5])
    cache2 = PagedKvCache(kv, [(blocks, 6, 1)])
    (ctx2,) = cache2.update(1, torch.ones(1, 3))
    assert torch.equal(ctx2[:6], latent) and torch.equal(ctx2[6], torch.ones(3))
