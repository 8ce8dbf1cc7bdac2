"""The GPU hot path (engine/fast_decode.py) against the plain path, in float32 on a CPU:
batched absorbed-MLA decode attention over the paged pool and the all-experts MoE."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.fast_decode import BatchedDecodeKv, tables_tensor, use_dense_experts
from engine.kv_pool import KvPool, KvPoolConfig, PagedKvCache
from engine.model import build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_batched_decode_matches_plain_path(tiny_model) -> None:
    c = dataclasses.replace(tiny_model.config, vocab_size=3000, bos_token_id=1, eos_token_id=(2,))
    plain, fast = build_model(c, seed=3), build_model(c, seed=3)
    assert use_dense_experts(fast) == c.num_kv_layers - c.first_k_dense_replace  # MTP too
    lens = [5, 17, 40]  # context before the step
    pool = KvPool(KvPoolConfig(num_blocks=16, block_size=8, num_layers=c.num_kv_layers, kv_dim=c.kv_dim), 1)
    tables = []
    for i, n in enumerate(lens):  # prefill each sequence through the plain path
        blocks = pool.blocks.allocate(pool.blocks_for(n + 1))
        ids = torch.tensor([(31 * j + i) % 3000 for j in range(n)])
        with torch.inference_mode():
            plain(ids, torch.arange(n), [n], PagedKvCache(pool, [(blocks, 0, n)]))
        tables.append(blocks)
    ids, pos = torch.tensor([7, 8, 9]), torch.tensor(lens)
    before = pool.kv.clone()
    with torch.inference_mode():
        want = plain.logits(plain(ids, pos, [1, 1, 1], PagedKvCache(pool, [(t, n, 1) for t, n in zip(tables, lens)])))
        written = pool.kv.clone()
        pool.kv.copy_(before)
        kv = BatchedDecodeKv(pool, tables_tensor(tables, 6, pool.kv.device), pos + 1)
        got = fast.logits(fast(ids, pos, [1, 1, 1], kv))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pool.kv, written, atol=1e-5, rtol=0)  # same KV rows written
    assert torch.equal(got.argmax(-1), want.argmax(-1))
