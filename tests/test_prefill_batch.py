"""Batched chunked prefill (engine/prefill_batch.py): the packing rule, exactness of several
concurrent prompts through one worker's batcher against `reference_generate`, MTP rows and
failure isolation inside a batch, and cancellation mid-batch leaving no block referenced."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from common.pb.tandem.v1 import discovery_pb2
from engine.prefill_batch import PrefillBatcher, pack
from engine.reference import reference_generate
from engine.runner import DecodeInput, PrefillInput
from worker.host import WorkerOptions, WorkerRuntime


@pytest.mark.parametrize("tokens,budget,expected", [
    ([], 64, 0),
    ([32, 32, 32], 64, 2),  # exactly the budget
    ([32, 16, 8], 64, 3),  # under it
    ([16, 64, 8], 64, 1),  # the second does not fit: it heads the next forward (no overtaking by 8)
    ([100, 8], 64, 1),  # a chunk over the whole budget runs alone
    ([8, 100], 64, 1),
    ([1] * 10, 4, 4),
])
def test_pack_takes_the_fifo_head_within_the_budget(tokens, budget, expected):
    assert pack(tokens, budget) == expected


def _fake_batcher(budget: int, forwards: list[list[tuple[int, int]]], fail_start: int | None = None):
    """A batcher whose forward records (request id, chunk start) per call; chunk start fail_start fails."""
    async def run(fn, *args):
        return fn(*args)

    def forward(batch):
        forwards.append([(b.block_ids[0], b.start) for b in batch])
        if fail_start is not None and any(b.start == fail_start for b in batch):
            raise RuntimeError(f"chunk at {fail_start} fails")
        return [(torch.tensor([float(b.start)]), None) for b in batch]

    return PrefillBatcher(run, forward, budget, vocab_size=100, block_size=16)


def test_batcher_packs_concurrent_requests_and_keeps_each_requests_order():
    forwards: list[list[tuple[int, int]]] = []
    done: dict[int, list[int]] = {}

    async def request(b: PrefillBatcher, rid: int, n_chunks: int, chunk: int):
        prompt = [1] * (n_chunks * chunk)
        for k in range(n_chunks):  # as WorkerRuntime.prefill_outputs: chunk k + 1 after chunk k
            out = await b.run_chunk(PrefillInput([rid] * 64, prompt, k * chunk, (k + 1) * chunk))
            assert out.hidden.item() == k * chunk
            done.setdefault(rid, []).append(k * chunk)

    async def main():
        b = _fake_batcher(48, forwards)
        await asyncio.gather(request(b, 0, 3, 16), request(b, 1, 3, 16), request(b, 2, 2, 16), request(b, 3, 2, 32))

    asyncio.run(main())
    assert done == {0: [0, 16, 32], 1: [0, 16, 32], 2: [0, 16], 3: [0, 32]}
    # First forward: the FIFO head within 48 tokens (requests 0, 1, 2); request 3's 32 waits.
    assert forwards[0] == [(0, 0), (1, 0), (2, 0)]
    assert forwards[1] == [(3, 0)]  # 32 tokens, then the next chunks of 0 (16) fill it
    for f in forwards:
        assert sum(32 if rid == 3 else 16 for rid, _ in f) <= 48
        assert len({rid for rid, _ in f}) == len(f)  # one chunk per request per forward
    assert sum(len(f) for f in forwards) == 10 and len(forwards) < 10


def test_failing_chunk_fails_alone_and_bad_chunks_are_refused():
    forwards: list[list[tuple[int, int]]] = []

    async def main():
        b = _fake_batcher(64, forwards, fail_start=16)
        ok = b.run_chunk(PrefillInput([0] * 4, [1] * 32, 0, 16))
        bad = b.run_chunk(PrefillInput([1] * 4, [1] * 32, 16, 32))
        results = await asyncio.gather(ok, bad, return_exceptions=True)
        assert results[0].hidden.item() == 0 and results[0].batch_size == 1
        assert isinstance(results[1], RuntimeError)
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await b.run_chunk(PrefillInput([0] * 4, [1, 100], 0, 2))
        with pytest.raises(ValueError, match="block table"):
            await b.run_chunk(PrefillInput([0], [1] * 32, 0, 32))
        with pytest.raises(ValueError, match="start < end"):
            await b.run_chunk(PrefillInput([0] * 4, [1] * 32, 8, 8))

    asyncio.run(main())
    # The batched forward failed, then each chunk ran alone; the refused chunks never ran.
    assert forwards == [[(0, 0), (1, 16)], [(0, 0)], [(1, 16)]]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, vocab, (48,), generator=g).tolist()  # 3 blocks of 16
    fresh = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (70, 33, 9, 21, 64)]
    return [shared + fresh[0], fresh[1], shared + fresh[2], fresh[3] + shared, shared + fresh[4]]


async def _prefill_and_decode(rt: WorkerRuntime, prompt: list[int], new_tokens: int) -> list[int]:
    """Local prefill through the batcher, then greedy decode alone; blocks freed at the end."""
    prompt_blocks = rt.pool.allocate_prompt(prompt)
    rt.count_prefix_lookup(len(prompt), prompt_blocks)
    blocks = prompt_blocks.block_ids
    try:
        start = prompt_blocks.num_cached_blocks * rt.pool.block_size
        out = await rt.prefill_outputs(blocks, prompt, start)
        rt.pool.commit_prompt(prompt_blocks)
        seq = prompt + [int(out.logits.argmax())]
        while len(seq) - len(prompt) < new_tokens:
            rt.pool.grow(blocks, len(seq))
            logits = await rt.run_model(rt.runner.decode, [DecodeInput(blocks, len(seq) - 1, seq[-1])])
            seq.append(int(logits[0].argmax()))
        return seq[len(prompt):]
    finally:
        rt.pool.free(blocks)


@pytest.mark.parametrize("dynamic", [False, True])
def test_concurrent_batched_prefills_give_reference_tokens(tiny_model, one_torch_thread, dynamic):
    prompts = _prompts(tiny_model.config.vocab_size)
    # static: chunk 16 with a 40-token budget, up to two chunks per forward, several forwards per
    # prompt; dynamic: base chunk 32 over 8-token blocks, so the fitted plan can shrink chunks as
    # the prefix grows (its sizes come from this machine's timings), packed within 64 tokens
    opts = (WorkerOptions(num_blocks=256, block_size=8, chunk_size=32, max_prefill_tokens=64,
                          enable_dynamic_chunking=True, dynamic_chunk_smoothing=1.0) if dynamic
            else WorkerOptions(num_blocks=128, chunk_size=16, max_prefill_tokens=40))
    rt = WorkerRuntime(discovery_pb2.ROLE_DECODE, opts, tiny_model)

    async def main():
        # the first prompt alone caches the shared prefix; then the others run concurrently
        first = await _prefill_and_decode(rt, prompts[0], 4)
        rest = await asyncio.gather(*(_prefill_and_decode(rt, p, 4) for p in prompts[1:]))
        return [first, *rest]

    try:
        free = rt.pool.blocks.num_free
        got = asyncio.run(main())
        assert rt.pool.blocks.num_free == free
    finally:
        rt.close()
    for p, g in zip(prompts, got):
        assert g == reference_generate(tiny_model.model, p, 4), len(p)
    assert rt.stats.prefix_hit_tokens == 2 * 48  # prompts 2 and 4 start after the cached shared prefix
    assert rt.stats.prefill_chunks > rt.stats.prefill_forwards  # some forwards carried several chunks
    hist = rt.metrics.registry.get_sample_value
    assert hist("tandem_worker_prefill_batch_tokens_count") == rt.stats.prefill_forwards
    assert hist("tandem_worker_prefill_batch_chunks_sum") == rt.stats.prefill_chunks


def test_batched_mtp_rows_equal_per_request_rows(tiny_model, one_torch_thread):
    """Two prompts' chunks in shared forwards write the same MTP KV rows as each prompt alone."""
    prompts = _prompts(tiny_model.config.vocab_size)[1:3]
    rows = []
    for budget in (16, 64):  # 16: one chunk per forward; 64: both prompts' chunks together
        rt = WorkerRuntime(discovery_pb2.ROLE_DECODE, WorkerOptions(num_blocks=64, chunk_size=16,
                                                                    max_prefill_tokens=budget), tiny_model)

        async def one(p):
            blocks = rt.pool.allocate_prompt(p).block_ids
            hidden = await rt.prefill_hidden(blocks, p, 0, mtp=True)
            return blocks, hidden

        async def main():
            return await asyncio.gather(*(one(p) for p in prompts))

        try:
            out = asyncio.run(main())
        finally:
            rt.close()
        mtp_layer = tiny_model.config.num_hidden_layers
        rows.append([(rt.pool.kv[b, mtp_layer].reshape(-1, rt.pool.kv.shape[-1])[:len(p) - 1].clone(), h)
                     for (b, h), p in zip(out, prompts)])
        assert (rt.stats.prefill_chunks > rt.stats.prefill_forwards) == (budget == 64)
    for (kv_a, h_a), (kv_b, h_b) in zip(*rows):
        torch.testing.assert_close(kv_a, kv_b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h_a, h_b, rtol=1e-5, atol=1e-5)


def test_cancelled_mid_batch_frees_every_block(tiny_model, one_torch_thread):
    """Of requests A, B, C (first chunks queued in that order, two fit the budget), A is
    cancelled while its chunk is in a forward and C while its chunk is queued: A's caller waits
    for the forward before freeing, C leaves the queue, B completes; no block stays referenced."""
    rt = WorkerRuntime(discovery_pb2.ROLE_PREFILL, WorkerOptions(num_blocks=64, chunk_size=16,
                                                                 max_prefill_tokens=32), tiny_model)
    gate, entered = threading.Event(), threading.Event()
    real_forward = rt.batcher._forward

    def gated(batch):  # the first forward holds the model thread until the test releases it
        if not gate.is_set():
            entered.set()
            assert gate.wait(60)
        return real_forward(batch)

    rt.batcher._forward = gated
    prompts = _prompts(tiny_model.config.vocab_size)[:3]

    async def one(p):
        blocks = rt.pool.allocate_prompt(p).block_ids
        try:
            return await rt.prefill(blocks, p, 0)
        finally:
            rt.pool.free(blocks)

    async def main():
        free = rt.pool.blocks.num_free
        tasks = [asyncio.create_task(one(p)) for p in prompts]
        await asyncio.to_thread(entered.wait, 60)  # A's and B's first chunks are in the forward
        assert rt.batcher.queued == 1  # C's waits: A + B fill the 32-token budget
        tasks[0].cancel()
        tasks[2].cancel()
        for _ in range(20):
            await asyncio.sleep(0)
        assert not tasks[0].done() and tasks[2].done()  # A waits for its forward; C left the queue
        assert rt.batcher.queued == 0
        gate.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        return free, results

    try:
        free, results = asyncio.run(main())
        assert isinstance(results[0], asyncio.CancelledError) and isinstance(results[2], asyncio.CancelledError)
        assert int(results[1].argmax()) == reference_generate(tiny_model.model, prompts[1], 1)[0]
        assert rt.stats.prefill_forwards == 3  # A + B, then B's last two chunks alone: C never ran
        assert rt.pool.blocks.num_free == free
    finally:
        gate.set()
        rt.close()


def test_max_prefill_tokens_option_from_flag_env_and_file(tmp_path, monkeypatch):
    from test_config import effective
    assert effective(["prefill"])["max_prefill_tokens"].value == WorkerOptions().max_prefill_tokens == 16384
    monkeypatch.setenv("TANDEM_MAX_PREFILL_TOKENS", "4096")
    assert effective(["decode"])["max_prefill_tokens"].value == 4096
    path = tmp_path / "t.toml"
    path.write_text("[worker]\nmax_prefill_tokens = 512\n")
    monkeypatch.delenv("TANDEM_MAX_PREFILL_TOKENS")
    assert effective(["prefill", "--config", str(path)])["max_prefill_tokens"].value == 512
    assert effective(["prefill", "--max-prefill-tokens", "64"])["max_prefill_tokens"].value == 64
    with pytest.raises(ValueError, match="--max-prefill-tokens must be >= 1"):
        WorkerOptions(max_prefill_tokens=0)
