"""The decode calls the router has open, by worker, so that a worker found failed can have
every one of its calls taken away at once (in-flight failover).

A worker that stops answering without closing its connections (a stopped process, a wedged
host) leaves its streams open forever: nothing arrives, nothing fails. The router therefore
ends them itself, and migrates each request exactly as it does after a broken stream:

- when health probes turn the worker unhealthy (router/health.py: `on_unhealthy`) and another
  decode worker is healthy, or once one is (router/service.py `worker_unhealthy`, `move_stranded`),
- when the worker leaves discovery (router/main.py: membership changes),
- when a running stream has produced no response for `stall_s` seconds (`CallReader`;
  router/stall.py sets it from the worker's observed inter-token latency).

`OpenCalls.evict(worker, reason)` resolves each open call's `lost` future; the call's reader,
`CallReader`, has its read interrupted by it and raises `WorkerLost`. Single-threaded: use
from the router's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Callable, Iterator

import grpc

if TYPE_CHECKING:
    from router.decode_session import SessionCall


class WorkerLost(Exception):
    """The worker of an open call was found failed; the request moves elsewhere."""

    def __init__(self, instance_id: str, reason: str) -> None:
        super().__init__(f"worker {instance_id}: {reason}")
        self.instance_id = instance_id
        self.reason = reason


class OpenCalls:
    def __init__(self) -> None:
        self._by_worker: dict[str, set[asyncio.Future[str]]] = {}
        # each call's gated sampling fields (SamplingParams.speculation_needs), where it sets any:
        # a decode worker running MTP may not serve them, so a failed worker's call may have nowhere to go
        self._needs: dict[asyncio.Future[str], tuple[str, ...]] = {}
        self.evicted = 0  # counter: calls taken away from a failed worker

    @contextlib.contextmanager
    def open(self, instance_id: str, needs: tuple[str, ...] = ()) -> Iterator[asyncio.Future[str]]:
        """Register one call to `instance_id` for its duration; yields its `lost` future, which
        `evict` resolves with the reason. needs: the request's SamplingParams.speculation_needs."""
        lost: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        calls = self._by_worker.setdefault(instance_id, set())
        calls.add(lost)
        if needs:
            self._needs[lost] = needs
        try:
            yield lost
        finally:
            calls.discard(lost)
            self._needs.pop(lost, None)
            if not calls and self._by_worker.get(instance_id) is calls:
                del self._by_worker[instance_id]

    def evict(self, instance_id: str, reason: str,
              keep: Callable[[tuple[str, ...]], bool] | None = None) -> int:
        """Take every open call away from `instance_id`, but those whose needs `keep` says to
        leave on it (no other healthy decode worker serves them); returns how many were taken."""
        n = 0
        for lost in self._by_worker.get(instance_id, ()):
            if keep is not None and keep(self._needs.get(lost, ())):
                continue
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


class CallReader:
    """Reads one open call's responses, each read bounded by a stall timeout and interrupted
    when the call is evicted (`lost`). Reads run in the caller's task, interrupted by
    cancelling it: at high token rates a task plus asyncio.wait per read, or even a timer and
    a done-callback per read, were a large share of the router's CPU time; here one timer per
    call is re-armed only when it fires early, and the `lost` callback is added once.
    Use from the router's event loop; `close()` when done with the call."""

    def __init__(self, call: grpc.aio.UnaryStreamCall | SessionCall, lost: asyncio.Future[str],
                 instance_id: str) -> None:
        self.call, self.lost, self.instance_id = call, lost, instance_id
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task | None = None  # the reading task while a read is in progress
        self._why: list[str] = []  # the interruption's reason; empty while none
        self._deadline = 0.0  # loop time by which the current read must end (with a stall bound)
        self._stall_s: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        lost.add_done_callback(self._on_lost)

    def _interrupt(self, reason: str) -> None:
        if self._task is not None and not self._why:
            self._why.append(reason)
            self._task.cancel()

    def _on_lost(self, fut: asyncio.Future[str]) -> None:
        self._interrupt(fut.result())

    def _check(self) -> None:
        self._timer = None
        if self._task is None or self._stall_s is None:
            return  # no read in progress (the next one re-arms), or it has no bound
        if self._loop.time() >= self._deadline:
            self._interrupt(f"no response for {self._stall_s:.3g} s on a running stream (max(--token-stall-timeout, "
                            "--token-stall-itl-factor × the worker's ITL × tokens per message))")
        else:
            self._timer = self._loop.call_at(self._deadline, self._check)

    async def next(self, stall_s: float | None):
        """The call's next response (grpc.aio.EOF at its end).

        Args:
            stall_s: seconds to wait for it (None = no bound).
        Raises:
            WorkerLost: the call was evicted, or nothing arrived within stall_s seconds.
            grpc.aio.AioRpcError: the call failed.
        """
        if self.lost.done():
            raise WorkerLost(self.instance_id, self.lost.result())
        task = asyncio.current_task()
        assert task is not None
        self._task, self._stall_s = task, stall_s
        if stall_s is not None:
            self._deadline = self._loop.time() + stall_s
            # A pending timer that fires early re-arms itself (_check); one that would fire
            # late (the bound shrank since it was set) is replaced.
            if self._timer is not None and self._timer.when() > self._deadline:
                self._timer.cancel()
                self._timer = None
            if self._timer is None:
                self._timer = self._loop.call_at(self._deadline, self._check)
        try:
            return await self.call.read()  # the caller cancels the call after an interrupted read
        except asyncio.CancelledError:
            if not self._why or task.uncancel() > 0:
                raise  # cancelled from outside (the client went away), perhaps as well as by us
            raise WorkerLost(self.instance_id, self._why[0]) from None
        finally:
            self._task = None

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.lost.remove_done_callback(self._on_lost)
