"""The router's health tracking of its workers (docs/operations.md lists its flags and bounds).

Every `interval_s` the tracker calls `grpc.health.v1.Health/Check` (overall service "") on
each prefill and decode worker the router's WorkerSet knows (whatever its discovery state),
over the router's own channel to it, each probe bounded by `timeout_s`. NOT_SERVING, a
transport error and a timeout are failures; `failure_threshold` consecutive failures make a
worker unhealthy and one successful probe makes it healthy again. The request path adds
transport failures with `record_transport_failure` (a decode worker refusing a call). A probe
that cannot connect at all (nothing listens at the worker's address: its process is gone) makes
the worker unhealthy at once, and a stream to the worker that breaks (its KV events, its load
reports) asks for such a probe now (`probe_soon`), not at the next round: a killed worker
process is out of routing within milliseconds instead of `failure_threshold` rounds.
Client errors (INVALID_ARGUMENT, over-long prompts...) never count: `counts_against_worker`.

Unknown and new workers are healthy. A worker that leaves discovery is forgotten. Health does
not depend on etcd: during an etcd outage the router keeps its last view of the workers and
health is what stops routing to one that died.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.tandem.v1 import discovery_pb2

log = logging.getLogger(__name__)

ROLES = (discovery_pb2.ROLE_PREFILL, discovery_pb2.ROLE_DECODE)

# Status codes of a worker's answer that say nothing about the worker's health: the request
# was bad, or the caller gave up. Everything else (UNAVAILABLE, DEADLINE_EXCEEDED on a probe,
# INTERNAL, UNKNOWN...) counts.
CLIENT_CODES = frozenset({
    grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
})


def refused_connection(exc: grpc.aio.AioRpcError) -> bool:
    """Whether a call failed because no connection to the address could be made (gRPC core's
    "failed to connect to all addresses": refused, unreachable, a failed TLS handshake), as
    against a call that reached a server and failed there."""
    return exc.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in (exc.details() or "").lower()


def counts_against_worker(code: grpc.StatusCode) -> bool:
    """Whether an error answered by a worker on the request path is a worker failure."""
    return code not in CLIENT_CODES


@dataclass
class WorkerHealth:
    """One worker's health state and counters."""

    instance_id: str
    address: str = ""
    healthy: bool = True
    consecutive_failures: int = 0
    probes: int = 0
    probe_failures: int = 0
    transport_failures: int = 0  # reported by the request path
    state_changes: int = 0
    last_error: str = ""
    since: float = 0.0  # monotonic time of the last state change (or of being first seen)


class HealthTracker:
    def __init__(self, workers, interval_s: float = 1.0, timeout_s: float = 0.5, failure_threshold: int = 3) -> None:
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError(f"health interval and timeout must be > 0 seconds, got {interval_s} and {timeout_s}")
        if failure_threshold < 1:
            raise ValueError(f"health failure threshold must be >= 1, got {failure_threshold}")
        self.workers = workers
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.failure_threshold = failure_threshold
        self._state: dict[str, WorkerHealth] = {}
        self.generation = 0  # bumped whenever healthy() changes for some worker (WorkerSet caches on it)
        self._task: asyncio.Task | None = None  # strong reference
        self._soon: dict[str, asyncio.Task] = {}  # probe_soon's probes in flight (strong references)
        self.rounds = 0
        # Called with (instance id, reason) when a worker turns unhealthy: the router takes its
        # open calls away (router/inflight.py) instead of waiting on a worker that may never answer,
        # when another decode worker can take them (router/service.py `worker_unhealthy`).
        self.on_unhealthy: Callable[[str, str], None] | None = None
        # Called with the instance id when a worker turns healthy again: calls that stayed on an
        # unhealthy worker for want of another may move now (router/service.py `move_stranded`).
        self.on_healthy: Callable[[str], None] | None = None

    # -- queries ---------------------------------------------------------------------------------

    def healthy(self, instance_id: str, address: str | None = None) -> bool:
        """With `address` (the instance's address in discovery now): a record made at another
        address — an earlier process under the same id, e.g. restarted with --instance-id —
        says nothing of this one, which counts as healthy until its own probes say otherwise."""
        st = self._state.get(instance_id)
        return st is None or st.healthy or (address is not None and st.address not in ("", address))

    def stats(self, instance_id: str) -> WorkerHealth | None:
        return self._state.get(instance_id)

    def snapshot(self) -> dict[str, WorkerHealth]:
        return dict(self._state)

    # -- recording -------------------------------------------------------------------------------

    def _entry(self, instance_id: str) -> WorkerHealth:
        st = self._state.get(instance_id)
        if st is None:
            st = self._state[instance_id] = WorkerHealth(instance_id, since=time.monotonic())
        return st

    def record_success(self, instance_id: str) -> None:
        st = self._entry(instance_id)
        st.consecutive_failures = 0
        if not st.healthy:
            st.healthy = True
            self.generation += 1
            st.state_changes += 1
            down = time.monotonic() - st.since
            st.since = time.monotonic()
            log.info("worker %s at %s is healthy again (unhealthy for %.1f s)", instance_id, st.address, down)
            if self.on_healthy is not None:
                self.on_healthy(instance_id)

    def record_failure(self, instance_id: str, reason: str, conclusive: bool = False) -> None:
        """One failure; `conclusive` (nothing could connect) counts as `failure_threshold` of them."""
        st = self._entry(instance_id)
        st.consecutive_failures = (max(st.consecutive_failures + 1, self.failure_threshold) if conclusive
                                   else st.consecutive_failures + 1)
        st.last_error = reason
        if st.healthy and st.consecutive_failures >= self.failure_threshold:
            st.healthy = False
            self.generation += 1
            st.state_changes += 1
            st.since = time.monotonic()
            why = "nothing could connect" if conclusive else f"{st.consecutive_failures} consecutive failures"
            log.warning("worker %s at %s is unhealthy after %s (last: %s): no new requests until it recovers",
                        instance_id, st.address, why, reason)
            if self.on_unhealthy is not None:
                self.on_unhealthy(instance_id, f"unhealthy ({reason})")

    def record_transport_failure(self, instance_id: str, reason: str = "transport failure") -> None:
        """A call to the worker failed in transport (refused, reset, unavailable)."""
        self._entry(instance_id).transport_failures += 1
        self.record_failure(instance_id, reason)

    # -- probing ---------------------------------------------------------------------------------

    async def probe(self, inst: discovery_pb2.Instance) -> None:
        """One Health/Check of `inst`, recorded."""
        try:
            channel = self.workers.channel(inst)
        except LookupError:  # it left discovery since the probe was asked for: nothing to probe
            return
        st = self._entry(inst.instance_id)
        if st.address not in ("", inst.address):  # another process under this id: a record of its own
            if not st.healthy:
                self.generation += 1
            self._state[inst.instance_id] = st = WorkerHealth(inst.instance_id, since=time.monotonic())
        st.address = inst.address
        st.probes += 1
        stub = health_pb2_grpc.HealthStub(channel)
        conclusive = False
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
            conclusive = refused_connection(exc)
        except asyncio.CancelledError:
            if _being_cancelled():
                raise  # the tracker is stopping
            # its channel was closed under the call (the worker left discovery, WorkerSet.prune):
            # a failed probe, not the end of the tracker (it ended every later round unseen)
            reason = "channel closed during the probe"
        except Exception as exc:  # noqa: BLE001 - a probe never kills the tracker
            reason = f"{type(exc).__name__}: {exc}"
        else:
            reason = ""
        now = self.workers.instance(inst.instance_id)
        if now is not None and now.address != inst.address:
            return  # the answer of a process no longer under this id (it moved while we asked)
        if not reason:
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                self.record_success(inst.instance_id)
                return
            reason = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        st.probe_failures += 1
        self.record_failure(inst.instance_id, reason, conclusive)

    def probe_soon(self, instance_id: str) -> None:
        """Probe this worker now, in a task of its own (at most one at a time per worker): a
        stream to it broke, and if its process is gone the probe cannot connect (conclusive).
        A worker not in the view, or with a probe already on the way, is left alone."""
        inst = self._current().get(instance_id)
        if inst is None or instance_id in self._soon:
            return
        task = asyncio.get_running_loop().create_task(self.probe(inst), name=f"probe-soon-{instance_id}")
        self._soon[instance_id] = task
        task.add_done_callback(lambda _t, wid=instance_id: self._soon.pop(wid, None))

    def _current(self) -> dict[str, discovery_pb2.Instance]:
        return {i.instance_id: i for role in ROLES for i in self.workers.candidates(role, serving_only=False)}

    async def probe_all(self) -> None:
        """Forget departed workers, then probe every current one concurrently."""
        current = self._current()
        for wid in list(self._state):
            if wid not in current:
                self.generation += not self._state.pop(wid).healthy
        await asyncio.gather(*(self.probe(i) for i in current.values()))
        self.rounds += 1

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.probe_all()
            except asyncio.CancelledError:
                if _being_cancelled():
                    raise
                log.warning("health probe round cut short by a closed channel; probing on")
            except Exception:  # noqa: BLE001 - keep probing whatever one round did
                log.exception("health probe round failed")
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="health-probes")

    async def stop(self) -> None:
        task, self._task = self._task, None
        soon = list(self._soon.values())
        for t in soon:
            t.cancel()
        if task is not None:
            task.cancel()
        if task is not None or soon:
            # not `await task`: a cancellation of stop() itself still propagates
            await asyncio.wait([*([task] if task is not None else []), *soon])


def _being_cancelled() -> bool:
    """Whether the running task was asked to stop (Task.cancel), as against a CancelledError
    that grpc.aio raises in a call whose channel was closed under it."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
