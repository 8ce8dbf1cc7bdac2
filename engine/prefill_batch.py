"""Batched chunked prefill: the next chunk of every concurrent prefill, packed into one forward.

Each prefill (a remote Prefill RPC, or a decode worker's local prefill) submits its chunks one
at a time through `PrefillBatcher.run_chunk` and awaits each before submitting the next, so a
request's chunks stay in order and its `on_chunk_done` callback (the prefill worker's
overlapped KV send) runs between them. Pending chunks wait in one FIFO queue; whenever the
model thread is free, one call takes chunks from its head while their tokens fit the budget
(`--max-prefill-tokens`) and runs them as one forward (`ModelRunner.prefill_batch`: one
`PagedKvCache` over every chunk's cached prefix plus its new tokens, one lm_head call for the
final chunks). Chunks submitted while a forward runs wait for the next one, which is what
batches concurrent prompts.

Packing rule (`pack`): strict FIFO, no overtaking. Chunks are taken from the head while the
sum of their tokens stays within the budget; the first chunk that does not fit ends the batch
and heads the next one. A single chunk larger than the whole budget runs alone (it is never
split here: chunk sizes are `engine/chunking.py`'s plan, the batcher only packs).

Failure isolation: a chunk that cannot run (bad range, block table too short, a token id
outside the vocabulary) is refused at submission with ValueError and never joins a forward.
When a batched forward raises anyway, each of its chunks is run again alone, so only the
chunk that fails gets the exception (rewriting a chunk's KV is harmless: the same values go to
the same slots of that request's own blocks).

Cancellation: a chunk still queued is dropped; a chunk already in a forward is waited for
before the cancellation is re-raised, so the caller never frees blocks a forward writes.

Everything here runs on the event loop thread except the forward, which goes through the
worker's single model thread (`run`), as every other model call does.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.runner import PrefillInput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChunkResult:
    """What one chunk's forward gave its request.

    hidden: the final-normed hidden state of the chunk's last token, [hidden].
    logits: float32 logits [vocab] of that token when the chunk asked for them, else None.
    batch_size, batch_tokens: chunks and tokens of the forward that computed it (1 and the
        chunk's own tokens when it ran alone).
    """

    hidden: torch.Tensor
    logits: torch.Tensor | None
    batch_size: int
    batch_tokens: int


def pack(chunk_tokens: Sequence[int], budget: int) -> int:
    """How many chunks from the head of the queue go into the next forward.

    Args:
        chunk_tokens: the pending chunks' token counts, oldest first (each >= 1).
        budget: tokens one forward may carry (>= 1).
    Returns:
        n >= 1 (0 for an empty queue): the longest head whose tokens sum to <= budget, or 1
        when the first chunk alone exceeds the budget (it runs alone).
    """
    n, used = 0, 0
    for t in chunk_tokens:
        if n and used + t > budget:
            break
        n, used = n + 1, used + t
        if used >= budget:
            break
    return n


@dataclass
class _Pending:
    work: PrefillInput
    future: asyncio.Future[ChunkResult]


class PrefillBatcher:
    """Packs concurrent prefill chunks into forwards of at most `budget` tokens.

    Args:
        run: awaits fn(*args) on the model thread (`WorkerRuntime.run_model`); it must wait
            for fn to finish before re-raising a cancellation.
        forward: the model-thread call for one batch (`ModelRunner.prefill_batch`):
            list[PrefillInput] -> list[(hidden [hidden], logits [vocab] | None)] in order.
        budget: `--max-prefill-tokens` (>= 1).
        vocab_size: token ids must lie in [0, vocab_size).
        block_size: tokens per KV block (to check a chunk's block table).
        observe: called on the loop thread after each forward with (chunks, tokens).
    """

    def __init__(self, run: Callable[..., Awaitable[Any]],
                 forward: Callable[[list[PrefillInput]], list[tuple[torch.Tensor, torch.Tensor | None]]],
                 budget: int, vocab_size: int, block_size: int,
                 observe: Callable[[int, int], None] | None = None) -> None:
        if budget < 1:
            raise ValueError(f"--max-prefill-tokens must be >= 1, got {budget}")
        self._run, self._forward, self.budget = run, forward, budget
        self._vocab, self._block_size, self._observe = vocab_size, block_size, observe
        self._queue: collections.deque[_Pending] = collections.deque()
        self._task: asyncio.Task[None] | None = None  # the drain loop (strong reference)

    @property
    def queued(self) -> int:
        """Chunks waiting for a forward."""
        return len(self._queue)

    async def run_chunk(self, work: PrefillInput) -> ChunkResult:
        """Compute one chunk in the next forward that has room for it.

        Raises:
            ValueError: the chunk cannot run (empty or out-of-range [start, end), a block table
                shorter than end tokens, a token id outside the vocabulary); nothing ran.
            Exception: whatever its forward raised when run alone.
        """
        self._check(work)
        item = _Pending(work, asyncio.get_running_loop().create_future())
        self._queue.append(item)
        if self._task is None or self._task.done():
            # starts on the next loop iteration: chunks submitted in this one join its first forward
            self._task = asyncio.create_task(self._drain(), name="prefill-batcher")
        try:
            return await asyncio.shield(item.future)
        except asyncio.CancelledError:
            try:
                self._queue.remove(item)  # still queued: it never joins a forward
            except ValueError:  # in a forward now: its blocks are being written, wait for it
                await asyncio.wait([item.future])
                if not item.future.cancelled():
                    item.future.exception()  # retrieved: nobody else will
            raise

    def _check(self, w: PrefillInput) -> None:
        if not 0 <= w.start < w.end <= len(w.token_ids):
            raise ValueError(f"prefill chunk [{w.start}, {w.end}) of a {len(w.token_ids)}-token prompt: "
                             "need 0 <= start < end <= prompt length")
        if len(w.block_ids) * self._block_size < w.end:
            raise ValueError(f"prefill chunk ends at token {w.end} but its block table holds "
                             f"{len(w.block_ids) * self._block_size} tokens")
        chunk = w.token_ids[w.start:w.end]
        if min(chunk) < 0 or max(chunk) >= self._vocab:
            raise ValueError(f"token_ids: an id in [{w.start}, {w.end}) is outside the vocabulary [0, {self._vocab})")

    async def _drain(self) -> None:
        while self._queue:
            n = pack([p.work.end - p.work.start for p in self._queue], self.budget)
            batch = [self._queue.popleft() for _ in range(n)]
            try:
                outcomes = await self._run(self._compute, [p.work for p in batch])
            except BaseException as exc:  # the model thread is gone (shutdown) or this task is cancelled
                for p in batch:
                    if not p.future.done():
                        if isinstance(exc, asyncio.CancelledError):
                            p.future.cancel()
                        else:
                            p.future.set_exception(exc)
                if isinstance(exc, asyncio.CancelledError):
                    for p in self._queue:
                        p.future.cancel()
                    self._queue.clear()
                raise
            tokens = sum(p.work.end - p.work.start for p in batch)
            if self._observe is not None:
                self._observe(len(batch), tokens)
            for p, out in zip(batch, outcomes, strict=True):
                if p.future.done():
                    continue
                if isinstance(out, BaseException):
                    p.future.set_exception(out)
                else:
                    p.future.set_result(out)

    def _compute(self, batch: list[PrefillInput]) -> list[ChunkResult | BaseException]:
        """On the model thread: one forward for the batch, or each chunk alone if it fails."""
        tokens = sum(w.end - w.start for w in batch)
        try:
            return [ChunkResult(h, lg, len(batch), tokens) for h, lg in self._forward(batch)]
        except Exception as exc:  # noqa: BLE001 - handed to the chunk(s) that caused it
            if len(batch) == 1:
                return [exc]
            log.warning("a batched prefill forward of %d chunks failed (%s: %s); running them one by one",
                        len(batch), type(exc).__name__, exc)
        out: list[ChunkResult | BaseException] = []
        for w in batch:
            try:
                (h, lg), = self._forward([w])
                out.append(ChunkResult(h, lg, 1, w.end - w.start))
            except Exception as exc:  # noqa: BLE001 - this chunk's own failure
                out.append(exc)
        return out
