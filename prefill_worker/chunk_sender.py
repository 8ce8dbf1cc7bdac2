"""Send a request's KV blocks to the decode worker while the rest of the prompt computes.

After each prefill chunk (`WorkerRuntime.prefill(on_chunk_done=...)`) the blocks that became
full are posted as a data-only write, in the background, so the next chunk computes while they
move; `finish` waits for those writes, then writes what is left — the blocks of the last chunk
and the partial last block — with the one notification carrying the request id. By the
`write_blocks` ordering rule the notification reaches the decode worker after every block,
so it starts decoding only when all of them arrived (issue 10; docs/architecture.md, step 5).

Exactly one outcome per request: `finish` returns a `SendResult`, or the first failure is
raised (as `TransferError`) from `on_chunk_done` or `finish`; `aclose` (always, in a
`finally`) cancels and awaits any write still running, so no transfer reads blocks after the
request frees them. `abandon` (the decode worker's Abandon call, prefill_worker/calls.py) does the
same from outside the request and refuses every later post, so once it returns no write of
this request can reach the decode worker's blocks.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import dataclass
from typing import Sequence

from common.env import TEST_STOP_AFTER_WRITES_VAR, read_env
from kv_transfer.base import KvTransferAgent, RemoteBlocks, TransferError, TransferResult


@dataclass(frozen=True)
class SendResult:
    """What one request's transfer did. bytes: payload bytes. writes: write_blocks calls.
    seconds: first post to notification sent. exposed_seconds: `finish` call (prefill done)
    to notification sent — the transfer time left on the critical path. backend: its name."""

    bytes: int
    writes: int
    seconds: float
    exposed_seconds: float
    backend: str


class ChunkSender:
    """Posts one request's blocks chunk by chunk (see the module docstring).

    Args:
        agent: this worker's transfer agent; peer: the decode worker's agent name.
        src_block_ids: the prompt's blocks in this worker's pool, all of them.
        first_block_index: prompt blocks before it are already at the decode worker.
        dst: the decode worker's pool and destination ids for prompt blocks
            first_block_index, first_block_index + 1, ...
        block_size: tokens per block. timeout_s: limit of each write (> 0).
        overlap: False sends everything in `finish` (one write, the pre-issue-10 behaviour).
        deadline: time.monotonic() at which the decode worker's call ends (None: none). No
            write is posted after it and none may run past it: the decode worker has stopped
            waiting and fenced the blocks (decode_worker/fence.py); a process resumed after
            a SIGSTOP must not write into them.
    """

    def __init__(self, agent: KvTransferAgent, peer: str, src_block_ids: Sequence[int],
                 first_block_index: int, dst: RemoteBlocks, block_size: int, timeout_s: float,
                 overlap: bool = True, deadline: float | None = None) -> None:
        if len(src_block_ids) - first_block_index != len(dst.block_ids):
            raise ValueError(f"{len(dst.block_ids)} destination blocks for "
                             f"{len(src_block_ids) - first_block_index} prompt blocks")
        self._agent, self._peer = agent, peer
        self._src, self._first, self._dst = list(src_block_ids), first_block_index, dst
        self._block_size, self._timeout_s, self._overlap = block_size, timeout_s, overlap
        self._next = first_block_index  # prompt block index of the first block not yet posted
        self._writes: list[asyncio.Task[TransferResult]] = []
        self._t0: float | None = None
        self._deadline = deadline
        self._abandoned = False
        self._last: asyncio.Task[TransferResult] | None = None  # the write carrying the notification
        self.late_refused = 0  # writes not posted: the call's deadline had passed, or it was abandoned

    def _time_left(self) -> float:
        """Seconds the next write may take; raises TransferError (counted in late_refused) when
        the request was abandoned or the call's deadline has passed."""
        if self._abandoned:
            self.late_refused += 1
            raise TransferError("the decode worker abandoned this request: no further KV write")
        if self._deadline is None:
            return self._timeout_s
        left = self._deadline - time.monotonic()
        if left <= 0:
            self.late_refused += 1
            raise TransferError("the decode worker's call ended (deadline passed): no further KV write")
        return min(self._timeout_s, left)

    def _post(self, end_block: int, notification: bytes | None) -> asyncio.Task[TransferResult]:
        self._time_left()  # refused now rather than when the write starts
        lo, hi = self._next, max(end_block, self._next)
        dst = self._dst._replace(block_ids=list(self._dst.block_ids[lo - self._first:hi - self._first]))
        self._next = hi
        if self._t0 is None:
            self._t0 = time.monotonic()
        task = asyncio.ensure_future(self._write(self._src[lo:hi], dst, notification))
        self._writes.append(task)
        _test_stop_hook()
        return task

    async def _write(self, src: list[int], dst: RemoteBlocks, notification: bytes | None) -> TransferResult:
        # Checked again when the write starts: a process stopped between the post and this
        # point (SIGSTOP) must not start a write the decode worker no longer waits for.
        return await self._agent.write_blocks(self._peer, src, dst, notification, self._time_left())

    def _raise_failed(self) -> None:
        for w in self._writes:
            if w.done() and not w.cancelled() and w.exception() is not None:
                _reraise(w.exception())

    async def on_chunk_done(self, num_tokens: int) -> None:
        """`WorkerRuntime.prefill`'s callback: post the blocks now full (num_tokens tokens of
        the prompt have their KV in the pool). Raises TransferError if an earlier write of
        this request failed, which stops the prefill."""
        self._raise_failed()
        if self._overlap and num_tokens // self._block_size > self._next:
            self._post(num_tokens // self._block_size, None)
            # Let the write's first step run now, before the next chunk is queued: GPU backends
            # order their copies after the kernels queued so far (this chunk's), not the next.
            await asyncio.sleep(0)

    async def finish(self, notification: bytes) -> SendResult:
        """After the whole prompt is in the pool: wait for the chunk writes, then write the
        remaining blocks (partial last block included) with the notification.

        Raises:
            TransferError (TransferTimeout): the first failure among this request's writes.
        """
        t_finish = time.monotonic()
        for w in list(self._writes):
            await self._outcome(w)
        last = self._last = self._post(len(self._src), notification)
        await self._outcome(last)
        results = [w.result() for w in self._writes]
        t_end = time.monotonic()
        assert self._t0 is not None
        return SendResult(bytes=sum(r.bytes for r in results), writes=len(results),
                          seconds=t_end - self._t0, exposed_seconds=t_end - t_finish,
                          backend=results[-1].backend)

    async def _outcome(self, write: asyncio.Task[TransferResult]) -> None:
        try:
            await write
        except (TransferError, ValueError) as exc:
            _reraise(exc)
        except asyncio.CancelledError:
            if self._abandoned and write.cancelled():  # `abandon` cancelled it, not our caller
                raise TransferError("the decode worker abandoned this request: its writes were stopped") from None
            raise

    async def aclose(self) -> None:
        """Cancel writes still running and wait until each has released its handle."""
        pending = [w for w in self._writes if not w.done()]
        for w in pending:
            w.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        for w in self._writes:  # retrieve every outcome: no "exception never retrieved"
            if w.done() and not w.cancelled():
                w.exception()

    async def abandon(self) -> None:
        """The decode worker stopped waiting for this request: refuse every later post, then
        cancel and await the writes still running (`aclose`)."""
        self._abandoned = True
        await self.aclose()

    @property
    def notified(self) -> bool:
        """Whether the write carrying the notification completed (the decode worker got it)."""
        last = self._last
        return last is not None and last.done() and not last.cancelled() and last.exception() is None

    @property
    def writes(self) -> int:
        """write_blocks calls posted so far."""
        return len(self._writes)


_STOP_AFTER_WRITES = read_env(TEST_STOP_AFTER_WRITES_VAR, int)  # test-only (common/env.py)
_posted = 0  # writes posted by this process, for the hook


def _test_stop_hook() -> None:
    """Test-only: SIGSTOP this process once, after its N-th post (TANDEM_TEST_STOP_AFTER_WRITES)."""
    global _posted
    if _STOP_AFTER_WRITES is None:
        return
    _posted += 1
    if _posted == _STOP_AFTER_WRITES:
        os.kill(os.getpid(), signal.SIGSTOP)


def _reraise(exc: BaseException | None) -> None:
    if isinstance(exc, TransferError):
        raise exc
    raise TransferError(f"KV write refused: {exc}") from exc
