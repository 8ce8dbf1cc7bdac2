"""The decode calls the router has open, by worker, so that a worker found failed can have
every one of its calls taken away at once (in-flight failover).

A worker that stops answering without closing its connections (a stopped process, a wedged
host) leaves its streams open forever: nothing arrives, nothing fails. The router therefore
ends them itself, and migrates each request exactly as it does after a broken stream:

- when health probes turn the worker unhealthy (router/health.py: `on_unhealthy`),
- when the worker leaves discovery (router/main.py: membership changes),
- when a running stream has produced no response for `stall_s` seconds (`next_message`;
  router/stall.py sets it from the worker's observed inter-token latency).

`OpenCalls.evict(worker, reason)` resolves each open call's `lost` future; the call's reader,
`next_message`, has its read interrupted by it and raises `WorkerLost`. Single-threaded: use
from the router's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Iterator

import grpc


class WorkerLost(Exception):
    """The worker of an open call was found failed; the request moves elsewhere."""

    def __init__(self, instance_id: str, reason: str) -> None:
        super().__init__(f"worker {instance_id}: {reason}")
        self.instance_id = instance_id
        self.reason = reason


class OpenCalls:
    def __init__(self) -> None:
        self._by_worker: dict[str, set[asyncio.Future[str]]] = {}
        self.evicted = 0  # counter: calls taken away from a failed worker

    @contextlib.contextmanager
    def open(self, instance_id: str) -> Iterator[asyncio.Future[str]]:
        """Register one call to `instance_id` for its duration; yields its `lost` future, which
        `evict` resolves with the reason."""
        lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        calls = self._by_worker.setdefault(instance_id, set())
        calls.add(lost)
        try:
            yield lost
        finally:
            calls.discard(lost)
            if not calls and self._by_worker.get(instance_id) is calls:
                del self._by_worker[instance_id]

    def evict(self, instance_id: str, reason: str) -> int:
        """Take every open call away from `instance_id`; returns how many."""
        n = 0
        for lost in self._by_worker.get(instance_id, ()):
            if not lost.done():
                lost.set_result(reason)
                n += 1
        self.evicted += n
        return n

    def workers(self) -> list[str]:
        """Instance ids with at least one open call."""
        return list(self._by_worker)

    def count(self, instance_id: str) -> int:
        return len(self._by_worker.get(instance_id, ()))


async def next_message(call: grpc.aio.UnaryStreamCall, lost: asyncio.Future[str], instance_id: str,
                       stall_s: float | None):
    """The call's next response (grpc.aio.EOF at its end).

    Args:
        stall_s: seconds to wait for it (None = no bound).
    Raises:
        WorkerLost: the call was evicted, or nothing arrived within stall_s seconds.
        grpc.aio.AioRpcError: the call failed.
    """
    if lost.done():
        raise WorkerLost(instance_id, lost.result())
    # The read runs in the caller's task, interrupted by cancelling it (a stall, or `lost`): the
    # router reads one message per streamed token or so, and a task plus asyncio.wait for each
    # read was a large share of its CPU time at high token rates.
    task = asyncio.current_task()
    assert task is not None
    why: list[str] = []  # the interruption's reason; empty while none
    active = True  # false once this read is over: a late callback must not cancel a later await

    def interrupt(reason: str) -> None:
        if active and not why:
            why.append(reason)
            task.cancel()

    def on_lost(fut: asyncio.Future[str]) -> None:
        interrupt(fut.result())

    lost.add_done_callback(on_lost)
    timer = None if stall_s is None else asyncio.get_running_loop().call_later(
        stall_s, interrupt, f"no response for {stall_s:.3g} s on a running stream (max(--token-stall-timeout, "
        "--token-stall-itl-factor × the worker's ITL × tokens per message))")
    try:
        return await call.read()  # a cancelled read cancels the call (grpc.aio), as the caller would
    except asyncio.CancelledError:
        if not why or task.uncancel() > 0:
            raise  # cancelled from outside (the client went away), perhaps as well as by us
        raise WorkerLost(instance_id, why[0]) from None
    finally:
        active = False
        if timer is not None:
            timer.cancel()
        lost.remove_done_callback(on_lost)
