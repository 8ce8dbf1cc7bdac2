"""EpKvPool (decode_worker/ep_pool.py): global block ids over per-rank pools, rank choice, and
KV events merged so the router sees one worker."""

from __future__ import annotations

import torch

from common.block_hash import block_hashes
from decode_worker.ep_pool import EpKvPool
from engine.block_pool import Removed, Stored
from engine.kv_pool import KvPoolConfig

BS = 4


def make_pool(ranks=2, blocks=8) -> EpKvPool:
    cfg = KvPoolConfig(num_blocks=blocks, block_size=BS, num_layers=2, kv_dim=3)
    return EpKvPool(cfg, hash_seed=7, kv=[torch.zeros(blocks, 2, BS, 3) for _ in range(ranks)])


def test_requests_spread_and_block_ids_are_global_offsets():
    pool = make_pool()
    a = pool.allocate_prompt(list(range(10)))  # 3 blocks on rank 0 (tie -> lower rank)
    b = pool.allocate_prompt(list(range(100, 106)))  # rank 1 is now cheaper
    assert all(0 <= x < 8 for x in a.block_ids) and all(8 <= x < 16 for x in b.block_ids)
    assert pool.assigned == [1, 1]
    # the global id names the rank and the block in that rank's own storage
    assert pool.split(b.block_ids) == (1, [x - 8 for x in b.block_ids])
    assert pool.split(a.block_ids) == (0, a.block_ids)
    pool.grow(b.block_ids, 13)
    assert len(b.block_ids) == 4 and all(8 <= x < 16 for x in b.block_ids)
    pool.free(a.block_ids)
    pool.free(b.block_ids)
    assert pool.blocks.num_free == 16


def test_cached_prefix_attracts_the_request_to_its_rank():
    pool = make_pool()
    filler = pool.allocate_prompt(list(range(200, 203)))  # rank 0 busy with one block
    prefix = list(range(12))
    p = pool.allocate_prompt(prefix + [99])  # goes to rank 1 (cheaper)
    assert p.block_ids[0] >= 8
    pool.commit_prompt(p)
    pool.free(p.block_ids)
    q = pool.allocate_prompt(prefix + [98, 97])  # 3 cached blocks on rank 1 beat an idle rank
    assert q.block_ids[0] >= 8 and q.num_cached_blocks == 3
    pool.free(q.block_ids)
    pool.free(filler.block_ids)


def test_events_report_first_copy_stored_and_last_copy_removed():
    pool = make_pool(blocks=4)
    prompt = list(range(9))  # 2 full blocks
    hashes = block_hashes(prompt, BS, 7)
    a = pool.allocate_prompt(prompt)
    b_blocks = pool.ranks[1].allocate_prompt(prompt)  # the same prefix computed on rank 1 too
    pool.commit_prompt(a)
    pool.ranks[1].commit_prompt(b_blocks)
    assert pool.blocks.drain_events() == [Stored(None, tuple(hashes))]  # once, not per rank
    assert pool.blocks.num_cached == 2
    pool.free(a.block_ids)
    pool.ranks[1].free(b_blocks.block_ids)
    pool.ranks[0].blocks.allocate(4)  # evicts rank 0's copies: rank 1 still holds them
    assert pool.blocks.drain_events() == []
    pool.ranks[1].blocks.allocate(4)
    (removed,) = pool.blocks.drain_events()
    assert isinstance(removed, Removed) and sorted(removed.hashes) == sorted(hashes)
    assert pool.blocks.snapshot() == []


def test_fresh_blocks_come_from_the_rank_of_the_request():
    pool = make_pool()
    a = pool.allocate_prompt(list(range(10)))  # rank 0
    b = pool.allocate_prompt(list(range(100, 106)))  # rank 1
    assert all(8 <= x < 16 for x in pool.allocate_beside(b.block_ids, 3))
    assert all(0 <= x < 8 for x in pool.allocate_beside(a.block_ids, 2))
    assert pool.allocate_beside([], 0) == []
    from engine.block_pool import PoolExhausted
    import pytest
    with pytest.raises(PoolExhausted):  # rank 1 has 8 - 2 - 3 = 3 left, however many rank 0 has
        pool.allocate_beside(b.block_ids, 4)


def test_rank_devices():
    from engine.rank_devices import collective_backend, rank_devices
    assert rank_devices("cpu", 3, "--ep-size") == [torch.device("cpu")] * 3
    assert collective_backend(torch.device("cpu")) == "gloo" and collective_backend(torch.device("cuda", 1)) == "nccl"
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        assert rank_devices("cuda:0", n, "--ep-size") == [torch.device("cuda", r) for r in range(n)]
    else:  # the check that needs no GPU: asking for more GPUs than the machine has
        import pytest
        with pytest.raises(ValueError, match="--pp-size 2 from --device cuda:1 needs GPUs 1..2; this machine has 0"):
            rank_devices("cuda:1", 2, "--pp-size")


def test_transfer_agents_of_a_record():
    from common.pb.tandem.v1 import discovery_pb2
    from worker.peers import transfer_agents
    one = discovery_pb2.Instance(transfer_agent_name="d", transfer_metadata_sha256=b"x", kv_capacity_blocks=64)
    assert transfer_agents(one) == {"d": (b"x", 64)}
    ep = discovery_pb2.Instance(transfer_agent_name="d", transfer_metadata_sha256=b"x", kv_capacity_blocks=3 * 16,
                                rank_transfer_agents=[discovery_pb2.RankTransferAgent(name="d-ep1", metadata_sha256=b"y",
                                                                                     capacity_blocks=16),
                                                      discovery_pb2.RankTransferAgent(name="d-ep2", metadata_sha256=b"z",
                                                                                     capacity_blocks=16)])
    assert transfer_agents(ep) == {"d": (b"x", 16), "d-ep1": (b"y", 16), "d-ep2": (b"z", 16)}
    assert transfer_agents(discovery_pb2.Instance()) == {}  # a router's record: no agent
