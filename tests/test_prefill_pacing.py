"""A decode worker's local prefill in pieces between decode steps (decode_worker/prefill_pacing.py)."""

from __future__ import annotations

import asyncio

import pytest

from common.sampling_params import SamplingParams
from decode_worker.prefill_pacing import PrefillPacer
from worker.host import WorkerStats
from engine.reference import reference_generate
from decode_helpers import generate


def test_piece_end_cuts_whole_blocks_within_the_chunk():
    p = PrefillPacer(64, 16, lambda: True, WorkerStats())
    assert p.piece_end(0, 256) == 64
    assert p.piece_end(64, 256) == 128
    assert p.piece_end(200, 256) == 256  # the chunk's end, not a block boundary past it
    assert p.piece_end(250, 256) == 256
    assert p.piece_end(40, 1000) == 96  # an unaligned start: the piece ends on the next cut boundary
    assert PrefillPacer(100, 16, lambda: True, WorkerStats()).tokens == 96  # rounded down to whole blocks
    assert PrefillPacer(5, 16, lambda: True, WorkerStats()).tokens == 16  # at least one block
    with pytest.raises(ValueError, match="--prefill-tokens-per-decode-step"):
        PrefillPacer(-1, 16, lambda: True, WorkerStats())
    # two decode steps per launch: a piece goes in per launch, so it holds two steps' tokens
    two = PrefillPacer(64, 16, lambda: True, WorkerStats(), lambda: 2)
    assert two.piece_end(0, 1000) == 128 and two.piece_end(40, 1000) == 160 and two.piece_end(0, 100) == 100


def test_pieces_wait_for_a_decode_step_each_and_take_turns():
    """While decoding: every paced piece after the first waits for a decode step launched
    since the previous piece, across concurrent prefills; with nothing decoding, no wait."""
    async def main():
        decoding = [True]
        p = PrefillPacer(16, 16, lambda: decoding[0], WorkerStats())
        let_in: list[tuple[str, int]] = []  # (prefill, steps launched when its piece went in)

        async def prefill(name: str, pieces: int) -> None:
            for _ in range(pieces):
                async with p.turn() as paced:
                    assert paced
                    let_in.append((name, p._steps))
                    await asyncio.sleep(0)  # the piece's forward

        async def decode_loop(steps: int) -> None:
            for _ in range(steps):
                await asyncio.sleep(0.01)
                p.step_launched()

        loop = asyncio.create_task(decode_loop(12))
        await asyncio.gather(prefill("a", 4), prefill("b", 4))
        await loop
        steps = [s for _, s in let_in]
        assert len(let_in) == 8 and {n for n, _ in let_in} == {"a", "b"}
        assert steps == sorted(steps) and len(set(steps)) == 8, steps  # one piece per step in all
        assert p.stats.prefill_paced_pieces == 8 and p.stats.prefill_pace_timeouts == 0

        decoding[0] = False
        async with p.turn() as paced:
            assert not paced  # nothing decodes: the chunk runs whole, at once
        assert p.stats.prefill_paced_pieces == 8

    asyncio.run(main())


def test_a_paced_piece_does_not_wait_forever_for_a_step():
    async def main():
        p = PrefillPacer(16, 16, lambda: True, WorkerStats())
        async with p.turn():
            pass
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        async with p.turn() as paced:  # no decode step ever comes
            assert paced
        assert loop.time() - t0 >= 0.2 and p.stats.prefill_pace_timeouts == 1

    asyncio.run(main())


def test_local_prefill_paced_between_decode_steps_gives_reference_tokens(tiny_model, one_torch_thread):
    """Float32 on CPU: prompts prefilled locally while earlier ones decode, their 128-token
    chunks cut into 16-token pieces, give reference_generate's greedy tokens, and the pieces
    really were interleaved with decode steps."""
    vocab = tiny_model.config.vocab_size
    prompts = [[(7 * i + 3 * j) % vocab for j in range(n)] for i, n in enumerate((40, 300, 170))]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in prompts]
    got, rt = asyncio.run(generate(tiny_model, 0, prompts, params, chunk_size=128,
                                   prefill_tokens_per_decode_step=16))
    for prompt, out in zip(prompts, got):
        assert out == reference_generate(tiny_model.model, prompt, 24)
    stats = rt.stats
    # prompts 2 and 3 prefill while prompt 1 (then 1 and 2) decode: 19 + 11 pieces of 16 tokens at most
    assert 10 <= stats.prefill_paced_pieces <= 30, stats.prefill_paced_pieces
    assert stats.prefill_pace_timeouts == 0
    assert stats.prefill_forwards >= stats.prefill_paced_pieces + 1
