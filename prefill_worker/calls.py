"""The prefill calls running on this worker, by request id, and the decode workers' Abandon calls.

A decode worker whose Prefill call ended unanswered (its deadline passed, or the request was
cancelled: this worker was stopped, wedged or slow) holds the destination blocks out of its
pool (decode_worker/fence.py) and calls `Abandon(request_id)` until this worker answers. The
answer must mean "no KV write of that request can reach you any more", whatever state the
call is in here:

- running: its `ChunkSender` refuses every later post and its running writes are cancelled
  and awaited before the answer;
- not started yet (still in gRPC's queue, e.g. behind a SIGSTOP): the id is remembered, and
  the call is refused when it arrives, before it allocates or writes anything;
- over: nothing can write; `notified` says whether its notification went out (the decode
  worker then consumes it).

Memory is bounded: the last `capacity` abandoned and notified ids are kept. A Prefill call
that reaches its handler after `capacity` later abandons of other requests would not be
refused; with request ids unique per request, that needs thousands of abandons while it
waits in the queue.

Single-threaded: use from the worker's event loop.
"""

from __future__ import annotations

from collections import OrderedDict

from prefill_worker.chunk_sender import ChunkSender

CAPACITY = 4096


class PrefillCalls:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self._running: dict[str, ChunkSender] = {}
        self._abandoned: OrderedDict[str, None] = OrderedDict()
        self._notified: OrderedDict[str, None] = OrderedDict()
        self._capacity = capacity
        self.abandons = 0  # counter: Abandon calls answered

    def start(self, request_id: str, sender: ChunkSender) -> bool:
        """Register a call about to post its first write; False when its decode worker has
        abandoned it already (refuse the call: nothing may be written)."""
        if request_id in self._abandoned:
            return False
        self._running[request_id] = sender
        return True

    def abandoned(self, request_id: str) -> bool:
        return request_id in self._abandoned

    def end(self, request_id: str, sender: ChunkSender) -> None:
        """The call is over and its writes are awaited (`ChunkSender.aclose` returned)."""
        if self._running.get(request_id) is sender:
            del self._running[request_id]
        if sender.notified:
            _remember(self._notified, request_id, self._capacity)

    async def abandon(self, request_id: str) -> bool:
        """Stop every write of `request_id` now and for good; returns whether its notification
        was sent (the transfer had completed). Returns after the running writes are awaited."""
        _remember(self._abandoned, request_id, self._capacity)
        self.abandons += 1
        sender = self._running.get(request_id)
        if sender is not None:
            await sender.abandon()
            return sender.notified
        return request_id in self._notified


def _remember(ids: OrderedDict[str, None], request_id: str, capacity: int) -> None:
    ids[request_id] = None
    ids.move_to_end(request_id)
    while len(ids) > capacity:
        ids.popitem(last=False)
