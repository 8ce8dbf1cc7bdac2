"""The router's health tracking (router/health.py): probes of grpc.health.v1 on real in-process
grpc.aio servers, the state machine (threshold, recovery, counters), the WorkerSet filter, and
end to end: a decode worker reporting NOT_SERVING stops being chosen while its etcd registration
stays, and is chosen again once it reports SERVING.

pytest-asyncio is not used: each unit test runs its own loop with asyncio.run().
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.pb.tandem.v1 import discovery_pb2, frontend_pb2, frontend_pb2_grpc, sampling_pb2
from router.health import HealthTracker, counts_against_worker, refused_connection
from router.workers import WorkerSet

DECODE, PREFILL = discovery_pb2.ROLE_DECODE, discovery_pb2.ROLE_PREFILL
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def run(test: Callable[[], Awaitable[Any]], timeout: float = 15.0) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(test(), timeout)

    return asyncio.run(bounded())


class StaticWatcher:
    """Stands in for discovery: the instances the router knows (no etcd needed here)."""

    def __init__(self) -> None:
        self.known: dict[str, discovery_pb2.Instance] = {}

    def instances(self) -> dict[str, discovery_pb2.Instance]:
        return dict(self.known)

    def add(self, instance_id: str, address: str, role: int = DECODE) -> discovery_pb2.Instance:
        inst = discovery_pb2.Instance(instance_id=instance_id, role=role, address=address, model="m", block_size=16,
                                      hash_seed=7, state=discovery_pb2.INSTANCE_STATE_SERVING)
        self.known[instance_id] = inst
        return inst


class SlowHealth(health.aio.HealthServicer):
    """A real health service that answers Check after `delay_s` (a worker too slow to answer)."""

    delay_s = 0.0

    async def Check(self, request, context):  # noqa: N802 - gRPC method name
        await asyncio.sleep(self.delay_s)
        return await super().Check(request, context)


async def health_server() -> tuple[grpc.aio.Server, SlowHealth, str]:
    server = grpc.aio.server()
    servicer = SlowHealth()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await servicer.set("", SERVING)
    return server, servicer, f"127.0.0.1:{port}"


def tracker_for(*addresses: str, threshold: int = 3, timeout_s: float = 0.5,
                interval_s: float = 1.0) -> tuple[WorkerSet, HealthTracker, StaticWatcher]:
    watcher = StaticWatcher()
    for n, address in enumerate(addresses):
        watcher.add(f"w{n}", address)
    workers = WorkerSet(watcher, "m", 16, 7)
    workers.health = HealthTracker(workers, interval_s=interval_s, timeout_s=timeout_s, failure_threshold=threshold)
    return workers, workers.health, watcher


def ids(instances) -> list[str]:
    return sorted(i.instance_id for i in instances)


def test_not_serving_after_threshold_then_one_success_recovers(caplog):
    async def body() -> None:
        server, servicer, address = await health_server()
        workers, tracker, _ = tracker_for(address, threshold=3)
        try:
            await tracker.probe_all()
            assert tracker.healthy("w0") and ids(workers.candidates(DECODE)) == ["w0"]
            await servicer.set("", NOT_SERVING)
            for _ in range(2):  # below the threshold: still a candidate
                await tracker.probe_all()
                assert tracker.healthy("w0")
            with caplog.at_level(logging.INFO, logger="router.health"):
                await tracker.probe_all()
                assert not tracker.healthy("w0")
                assert workers.candidates(DECODE) == []
                assert ids(workers.candidates(DECODE, serving_only=False)) == ["w0"]  # still in discovery
                await tracker.probe_all()  # stays unhealthy, no second state change
                await servicer.set("", SERVING)
                await tracker.probe_all()  # one success is enough
            assert tracker.healthy("w0") and ids(workers.candidates(DECODE)) == ["w0"]
            st = tracker.stats("w0")
            assert (st.probes, st.probe_failures, st.state_changes, st.consecutive_failures) == (6, 4, 2, 0)
            assert st.last_error == "NOT_SERVING"
            changes = [r.getMessage() for r in caplog.records if r.name == "router.health"]
            assert len(changes) == 2
            assert "w0" in changes[0] and "unhealthy after 3 consecutive failures" in changes[0]
            assert "healthy again" in changes[1]
        finally:
            await workers.close()
            await server.stop(None)

    run(body)


def test_a_success_resets_the_consecutive_count():
    async def body() -> None:
        server, servicer, address = await health_server()
        workers, tracker, _ = tracker_for(address, threshold=2)
        try:
            for status in (NOT_SERVING, SERVING, NOT_SERVING, SERVING):  # never two failures in a row
                await servicer.set("", status)
                await tracker.probe_all()
                assert tracker.healthy("w0")
            assert tracker.stats("w0").probe_failures == 2 and tracker.stats("w0").state_changes == 0
        finally:
            await workers.close()
            await server.stop(None)

    run(body)


def test_stopped_server_and_timeouts_are_failures():
    async def body() -> None:
        gone, _, gone_address = await health_server()
        slow, slow_servicer, slow_address = await health_server()
        workers, tracker, _ = tracker_for(gone_address, slow_address, threshold=2, timeout_s=0.2)
        try:
            await tracker.probe_all()
            assert tracker.healthy("w0") and tracker.healthy("w1")
            await gone.stop(None)  # the process is gone: connection refused
            slow_servicer.delay_s = 1.0  # answers, but after the probe's timeout
            start = time.monotonic()
            await tracker.probe_all()
            await tracker.probe_all()
            assert time.monotonic() - start < 1.9  # bounded by the 0.2 s timeout, not the 1 s answers
            assert not tracker.healthy("w0") and not tracker.healthy("w1")
            assert tracker.stats("w0").last_error.startswith("UNAVAILABLE")
            assert tracker.stats("w1").last_error.startswith("DEADLINE_EXCEEDED")
            assert workers.candidates(DECODE) == []
            slow_servicer.delay_s = 0.0
            await tracker.probe_all()
            assert tracker.healthy("w1") and not tracker.healthy("w0")
            assert ids(workers.candidates(DECODE)) == ["w1"]
        finally:
            await workers.close()
            await slow.stop(None)

    run(body)


def test_a_refused_connection_is_conclusive_a_timeout_is_not():
    async def body() -> None:
        gone, _, gone_address = await health_server()
        slow, slow_servicer, slow_address = await health_server()
        workers, tracker, _ = tracker_for(gone_address, slow_address, threshold=3, timeout_s=0.2)
        try:
            await tracker.probe_all()
            await gone.stop(None)  # nothing listens there any more
            slow_servicer.delay_s = 1.0
            await tracker.probe_all()
            assert not tracker.healthy("w0")  # one round: nothing could connect
            assert tracker.healthy("w1") and tracker.stats("w1").consecutive_failures == 1  # a timeout: 1 of 3
            assert "failed to connect" in tracker.stats("w0").last_error.lower()
        finally:
            await workers.close()
            await slow.stop(None)

    run(body)


def _rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def test_refused_connection_reads_grpc_cores_connect_failure():
    assert refused_connection(_rpc_error(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last "
                                         "error: UNKNOWN: ipv4:127.0.0.1:1: Connection refused"))
    assert not refused_connection(_rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
    assert not refused_connection(_rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "failed to connect"))


def test_a_broken_stream_probes_the_worker_at_once():
    async def body() -> None:
        gone, _, gone_address = await health_server()
        live, _, live_address = await health_server()
        workers, tracker, _ = tracker_for(gone_address, live_address, threshold=3)
        try:  # the tracker's rounds are not running: only stream_broke probes
            await gone.stop(None)
            workers.stream_broke("w1", _rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
            workers.stream_broke("w0", _rpc_error(grpc.StatusCode.CANCELLED, "cancelled"))  # not a transport failure
            await asyncio.sleep(0.3)
            assert tracker.healthy("w0") and tracker.stats("w0") is None  # not probed
            assert tracker.healthy("w1") and tracker.stats("w1").probes == 1  # probed, answered
            start = time.monotonic()
            workers.stream_broke("w0", _rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"))
            workers.stream_broke("w0", _rpc_error(grpc.StatusCode.UNAVAILABLE, "Socket closed"))  # one probe at a time
            while tracker.healthy("w0"):
                assert time.monotonic() - start < 2.0, "a dead worker's broken stream did not make it unhealthy"
                await asyncio.sleep(0.01)
            assert tracker.stats("w0").probes == 1
            assert ids(workers.candidates(DECODE)) == ["w1"]
        finally:
            await tracker.stop()
            await workers.close()
            await live.stop(None)

    run(body)


def test_transport_failures_count_and_client_errors_never_do():
    async def body() -> None:
        server, _, address = await health_server()
        workers, tracker, _ = tracker_for(address, threshold=3)
        try:
            assert tracker.healthy("never-seen")  # unknown workers are healthy
            workers.set_aside_s = 0.0  # only health keeps it out below
            tracker.record_transport_failure("w0")
            workers.set_aside("w0")  # a refused call counts as a transport failure too
            assert tracker.healthy("w0")
            tracker.record_transport_failure("w0", "connection reset")
            assert not tracker.healthy("w0") and workers.candidates(DECODE) == []
            assert tracker.stats("w0").transport_failures == 3
            await tracker.probe_all()  # the worker answers SERVING: back at once
            assert tracker.healthy("w0") and ids(workers.candidates(DECODE)) == ["w0"]
        finally:
            await workers.close()
            await server.stop(None)
        for code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.CANCELLED,
                     grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.FAILED_PRECONDITION):
            assert not counts_against_worker(code), code
        for code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL,
                     grpc.StatusCode.UNKNOWN):
            assert counts_against_worker(code), code

    run(body)


def test_running_tracker_follows_membership_and_stops_cleanly():
    async def body() -> None:
        server, servicer, address = await health_server()
        workers, tracker, watcher = tracker_for(address, threshold=2, interval_s=0.05, timeout_s=0.5)
        try:
            tracker.start()
            watcher.add("p0", address, role=PREFILL)  # joins while the tracker runs: probed too
            await servicer.set("", NOT_SERVING)
            deadline = time.monotonic() + 5
            while tracker.healthy("w0") or tracker.healthy("p0"):
                assert time.monotonic() < deadline, "never turned unhealthy"
                await asyncio.sleep(0.02)
            assert workers.candidates(PREFILL) == [] and workers.candidates(DECODE) == []
            del watcher.known["w0"]  # left discovery: forgotten (and healthy if it ever returns)
            while tracker.stats("w0") is not None:
                assert time.monotonic() < deadline, "departed worker not forgotten"
                await asyncio.sleep(0.02)
            assert tracker.healthy("w0")
            await servicer.set("", SERVING)
            while not tracker.healthy("p0"):
                assert time.monotonic() < deadline, "never recovered"
                await asyncio.sleep(0.02)
            task = tracker._task
            await tracker.stop()
            assert task.done() and tracker._task is None
            rounds = tracker.rounds
            await asyncio.sleep(0.2)
            assert tracker.rounds == rounds  # nothing probes after stop
            await tracker.stop()  # idempotent
        finally:
            await tracker.stop()
            await workers.close()
            await server.stop(None)

    run(body)


@pytest.mark.e2e
def test_not_serving_decode_worker_stops_being_chosen_while_registered(etcd_server, tiny_model):
    from harness import InProcessCluster

    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-health")
    ch = None
    try:
        router = c.start("router", router_mode="round-robin", health_interval_s=0.2, health_timeout_s=0.5,
                         health_failure_threshold=2)
        a, b = c.start("decode"), c.start("decode")
        c.wait_roles(router, 0, 2)
        a_id, b_id = a.runtime.instance_id, b.runtime.instance_id
        ch = grpc.insecure_channel(router.address)
        stub = frontend_pb2_grpc.FrontendServiceStub(ch)

        def send(n: int) -> None:
            for i in range(n):
                req = frontend_pb2.GenerateRequest(token_ids=[9, 8, 7, i + 1],
                                                   sampling=sampling_pb2.SamplingParams(max_tokens=2))
                assert list(stub.Generate(req, timeout=30))

        def decode_ids(serving_only: bool = True) -> list[str]:
            return c.on_loop(lambda: ids(router.workers.candidates(DECODE, serving_only=serving_only)))

        def wait_for(expected: list[str], bound_s: float) -> float:
            start = time.monotonic()
            while decode_ids() != expected:
                assert time.monotonic() - start < bound_s, f"router still chooses {decode_ids()}"
                time.sleep(0.05)
            return time.monotonic() - start

        c.call(a.server.set_serving(False))
        took = wait_for([b_id], bound_s=3.0)
        assert took < 3.0
        # still registered in etcd (the router's discovery view, SERVING there): health alone keeps it out
        registered = c.on_loop(lambda: {i.instance_id: i.state for i in
                                        router.workers.candidates(DECODE, serving_only=False)})
        assert registered == {a_id: discovery_pb2.INSTANCE_STATE_SERVING, b_id: discovery_pb2.INSTANCE_STATE_SERVING}
        a_before, b_before = a.runtime.stats.local_prefills, b.runtime.stats.local_prefills
        send(4)
        assert a.runtime.stats.local_prefills == a_before and b.runtime.stats.local_prefills == b_before + 4

        c.call(a.server.set_serving(True))
        wait_for(sorted([a_id, b_id]), bound_s=3.0)
        a_before = a.runtime.stats.local_prefills
        send(4)  # round-robin: the recovered worker gets its share again
        assert a.runtime.stats.local_prefills > a_before
        st = c.on_loop(lambda: router.workers.health.stats(a_id))
        assert st.state_changes == 2 and st.probe_failures >= 2
    finally:
        if ch is not None:
            ch.close()
        c.close()


def test_set_aside_keeps_only_running_set_asides():
    """A set-aside that has expired is dropped when the next one is made: the map does not grow
    with every worker ever set aside."""
    workers = WorkerSet(StaticWatcher(), "m", 16, 7)
    for n in range(50):
        workers.set_aside(f"gone-{n}", seconds=0.0)
    workers.set_aside("w-now", seconds=60.0)
    assert list(workers._aside) == ["w-now"]


def test_a_new_process_under_the_same_id_is_not_held_to_the_old_ones_record():
    """A worker found dead at one address (nothing listens: unhealthy at once) and back under
    the same instance id at another address (a restart with --instance-id) is a candidate again
    as soon as discovery shows the new address, and gets a health record of its own."""
    async def body() -> None:
        with socket_bound_nowhere() as dead:
            workers, tracker, watcher = tracker_for(dead, threshold=3)
            await tracker.probe_all()
        assert not tracker.healthy("w0") and workers.candidates(DECODE) == []
        server, _, address = await health_server()
        try:
            watcher.add("w0", address)  # the new process, same id
            assert ids(workers.candidates(DECODE)) == ["w0"]
            await tracker.probe_all()
            st = tracker.stats("w0")
            assert st.healthy and st.address == address and (st.probes, st.probe_failures) == (1, 0)
        finally:
            await server.stop(None)
    asyncio.run(body())


class socket_bound_nowhere:
    """An address where nothing listens (a port bound, not listening, for the block's time)."""

    def __enter__(self) -> str:
        import socket
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{self.sock.getsockname()[1]}"

    def __exit__(self, *exc) -> None:
        self.sock.close()


def test_a_probe_whose_channel_closes_under_it_is_a_failure_and_the_tracker_probes_on():
    # a worker leaving discovery has its channel closed (WorkerSet.prune) while a Check may be
    # on it: grpc.aio raises CancelledError in that call, which ended the tracker's task for good
    async def body() -> None:
        server, servicer, address = await health_server()
        workers, tracker, watcher = tracker_for(address, threshold=1, interval_s=0.05, timeout_s=2.0)
        try:
            servicer.delay_s = 0.5
            tracker.start()
            await asyncio.sleep(0.1)  # a Check is on its way
            await workers._channels["w0"][1].close()  # the channel the probe is on
            deadline = time.monotonic() + 5
            while tracker.healthy("w0"):
                assert time.monotonic() < deadline, "the cut probe did not count"
                await asyncio.sleep(0.02)
            assert not tracker._task.done()  # (it ended here, and nothing probed again)
            del workers._channels["w0"]  # a fresh channel, as after the worker registers again
            servicer.delay_s = 0.0
            while not tracker.healthy("w0"):
                assert time.monotonic() < deadline, "never probed again"
                await asyncio.sleep(0.02)
        finally:
            await tracker.stop()
            await workers.close()
            await server.stop(None)

    run(body)
