"""Batched chunked prefill end to end with real processes (etcd, router, prefill and decode
workers, `cli/cluster.py`): eight concurrent requests of several chunks each give exactly
`reference_generate`'s greedy tokens (the un-batched, un-chunked sequential run), and the
prefill worker's /metrics show that its forwards carried chunks of several prompts."""

from __future__ import annotations

import pytest

from common.pb.tandem.v1 import discovery_pb2
from engine.reference import reference_generate
from harness import serve_at_once

pytestmark = pytest.mark.e2e
PROMPT_TOKENS, CHUNK = 256, 32  # 8 chunks per prompt


def _serve_at_once(prompts: list[list[int]], namespace: str, tmp_path, chunk: int, budget: int):
    """Send every prompt at once through a local cluster (6 greedy tokens each); returns the
    results and the prefill and decode workers' /metrics samples."""
    results, metrics, _, _ = serve_at_once(prompts, 6, namespace=namespace, log_dir=str(tmp_path),
                                           worker_args=["--num-blocks", "512", "--chunk-size", str(chunk),
                                                        "--max-prefill-tokens", str(budget)])
    return results, metrics[discovery_pb2.ROLE_PREFILL], metrics[discovery_pb2.ROLE_DECODE]


def test_concurrent_prompts_share_prefill_forwards_and_match_reference(tiny_model, tmp_path):
    vocab = tiny_model.config.vocab_size
    prompts = [[(5000 + 977 * r + 31 * i) % vocab for i in range(PROMPT_TOKENS)] for r in range(8)]

    results, prefill, decode = _serve_at_once(prompts, "e2e-prefill-batch", tmp_path, CHUNK, 256)
    for p, r in zip(prompts, results):
        assert r.token_ids == reference_generate(tiny_model.model, p, 6, tiny_model.config.eos_token_ids)
    assert decode["tandem_worker_remote_prefills_total"] == 8 and decode["tandem_worker_local_prefills_total"] == 0
    chunks, forwards = prefill["tandem_worker_prefill_chunks_total"], prefill["tandem_worker_prefill_forwards_total"]
    assert chunks == 8 * PROMPT_TOKENS // CHUNK
    assert forwards < chunks, (forwards, chunks)  # some forwards carried chunks of several prompts
    assert prefill["tandem_worker_prefill_batch_tokens_count"] == forwards
    assert prefill["tandem_worker_prefill_batch_tokens_sum"] == 8 * PROMPT_TOKENS


def test_prompts_sharing_a_prefix_in_flight_wait_for_it_and_match_reference(tiny_model, tmp_path):
    """Eight prompts of 512 tokens, 448 of them shared, sent at once: the first to arrive
    computes the prefix, the others wait for its blocks to be cached (prefill_worker/inflight.py)
    and compute only their own 64 tokens; every answer is still reference_generate's."""
    vocab = tiny_model.config.vocab_size
    shared = [(7000 + 13 * i) % vocab for i in range(448)]
    prompts = [shared + [(9000 + 577 * r + 31 * i) % vocab for i in range(64)] for r in range(8)]

    results, prefill, _ = _serve_at_once(prompts, "e2e-prefill-inflight", tmp_path, 32, 64)
    for p, r in zip(prompts, results):
        assert r.token_ids == reference_generate(tiny_model.model, p, 6, tiny_model.config.eos_token_ids)
    waits = prefill["tandem_worker_prefill_inflight_waits_total"]
    assert waits >= 1, prefill
    computed = prefill["tandem_worker_prefill_batch_tokens_sum"]
    assert computed <= 8 * 512 - 448 * waits, (computed, waits)  # each waiter took the shared blocks from the cache
    assert prefill["tandem_worker_prefix_cache_hit_tokens_total"] >= 448 * waits
