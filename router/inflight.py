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
`next_message`, races every read against it and raises `WorkerLost`. Single-threaded: use
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
    read = asyncio.ensure_future(call.read())
    done, _ = await asyncio.wait((read, lost), timeout=stall_s, return_when=asyncio.FIRST_COMPLETED)
    if read in done:
        return read.result()
    read.cancel()  # the caller cancels the call itself
    raise WorkerLost(instance_id, lost.result() if lost.done() else f"no response for {stall_s:.3g} s on a running "
                     "stream (max(--token-stall-timeout, --token-stall-itl-factor × the worker's ITL))")
