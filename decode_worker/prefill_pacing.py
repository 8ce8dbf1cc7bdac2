"""A decode worker's local prefill, paced against its decode steps.

A decode worker prefills locally when no prefill worker is usable (none registered, the call
failed) and when it re-prefills a retracted request. On a GPU a chunk of 8,192 tokens takes
tens to hundreds of milliseconds; run whole between two decode steps, it stalls every running
stream for that long. While requests are decoding, `PrefillPacer` cuts each planned chunk
into pieces of at most `--prefill-tokens-per-decode-step` tokens (whole blocks) and lets one
piece into the model thread per launched decode step, so the streams' inter-token latency
stays about one decode step plus one piece. With nothing decoding, chunks run whole and at
once: pacing costs a prefill nothing when no stream is waiting.

SGLang's mixed chunk puts the prefill tokens into the decode step's own forward; here the two
alternate on the model thread (the decode step replays its CUDA graph, the piece runs the
prefill forward), which keeps both paths as they are and bounds the stall by the piece size.

The budget is per decode step, not per prefill: concurrent local prefills take turns (one
piece per step in all, first come first served), so two of them do not double the stall.
Where the decode loop launches N steps at once (--decode-steps-per-launch), a piece can only go
in between two launches, and the loop queues its next launch as soon as one returns: a piece
is then N × the tokens, one per launch, so a prefill takes as many decode steps as at one step
per launch (the streams wait one larger piece per N steps).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

# Longest wait for a decode step before a piece runs anyway: the loop may be about to idle
# (its last request finishing) or stalled; a prefill is never held up for longer than this.
STEP_WAIT_S = 0.25


class PrefillPacer:
    """Pieces of local prefill chunks, one per decode step while requests decode.

    Args:
        tokens_per_step: most prompt tokens computed between two decode steps (rounded down to
            whole blocks, at least one); 0 = no pacing (chunks run whole).
        block_size: tokens per KV block: pieces end on block boundaries (but for a chunk's end).
        decoding: whether requests are decoding now (the scheduler's running list is not empty).
        stats: the worker's WorkerStats: counts prefill_paced_pieces (pieces let in between
            decode steps) and prefill_pace_timeouts (pieces that ran after STEP_WAIT_S without one).
        steps_per_launch: the decode loop's steps per launch now (a piece is that many steps' tokens).
    """

    def __init__(self, tokens_per_step: int, block_size: int, decoding: Callable[[], bool], stats: Any,
                 steps_per_launch: Callable[[], int] = lambda: 1) -> None:
        if tokens_per_step < 0:
            raise ValueError(f"--prefill-tokens-per-decode-step must be >= 0 (0 = off), got {tokens_per_step}")
        self.tokens = max(block_size, tokens_per_step // block_size * block_size) if tokens_per_step else 0
        self._block = block_size
        self._decoding = decoding
        self._steps = 0  # decode steps launched so far
        self._stepped = asyncio.Event()  # set at each launched step
        self._last_piece_step = -1  # self._steps when the last paced piece was let in
        self._turn = asyncio.Lock()  # one paced piece at a time across concurrent prefills
        self._steps_per_launch = steps_per_launch
        self.stats = stats

    def step_launched(self) -> None:
        """The decode loop launched a step (DecodeScheduler.count_step)."""
        self._steps += 1
        self._stepped.set()

    def active(self) -> bool:
        return self.tokens > 0 and self._decoding()

    def piece_end(self, pos: int, end: int) -> int:
        """End of the piece starting at token pos of a chunk ending at end: at most `tokens` ×
        the loop's steps per launch further, on a block boundary, never past end, always past pos."""
        cut = (pos // self._block) * self._block + self.tokens * max(1, self._steps_per_launch())
        return end if cut >= end else max(cut, pos + 1)

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[bool]:
        """Hold while submitting one piece: waits (while requests decode) for a decode step
        launched since the previous paced piece, then yields True (the piece must be cut to
        `piece_end`); yields False at once when nothing decodes (run the chunk whole)."""
        if not self.active():
            yield False
            return
        async with self._turn:
            while self._steps == self._last_piece_step and self.active():
                self._stepped.clear()
                try:
                    await asyncio.wait_for(self._stepped.wait(), STEP_WAIT_S)
                except TimeoutError:
                    self.stats.prefill_pace_timeouts += 1
                    break
            self._last_piece_step = self._steps
            self.stats.prefill_paced_pieces += 1
            yield True
