"""Discovery against a real etcd: registration, leases, watch, outages.

pytest-asyncio is not used: each test runs its own event loop with asyncio.run(), and creates
its etcd clients inside it (a grpc.aio channel belongs to the loop that created it).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aetcd
import pytest

from common.pb.tandem.v1 import discovery_pb2 as pb
from discovery import keys
from discovery.endpoints import Endpoint, EtcdUnavailableError, connect_first, parse_endpoints
from discovery.etcd_server import EtcdNotFoundError, EtcdServer
from discovery.registration import Registration
from discovery.watcher import InstanceEvent, InstanceWatcher


def run(test: Callable[[], Awaitable[Any]], timeout: float = 30.0) -> Any:
    """Run one async test body in a fresh event loop, bounded by `timeout` seconds."""

    async def bounded() -> Any:
        return await asyncio.wait_for(test(), timeout)

    return asyncio.run(bounded())


@pytest.fixture(scope="module")
def etcd() -> EtcdServer:
    with EtcdServer() as server:
        yield server


@pytest.fixture
def ns() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


def make_instance(instance_id: str, role: int = pb.ROLE_PREFILL) -> pb.Instance:
    return pb.Instance(
        instance_id=instance_id,
        role=role,
        address="127.0.0.1:50051",
        model="tiny",
        block_size=16,
        kv_capacity_blocks=1024,
        state=pb.INSTANCE_STATE_SERVING,
        start_time_unix=1.0,
        version="0.1.0",
    )


async def until(condition: Callable[[], bool], timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


def kinds(events: list[InstanceEvent]) -> list[tuple[str, str]]:
    return [(e.kind, e.instance.instance_id) for e in events]


# -- pure helpers -----------------------------------------------------------------------------


def test_keys_round_trip() -> None:
    inst = make_instance("d-1", pb.ROLE_DECODE)
    key = keys.instance_key("prod", inst)
    assert key == "/tandem/v1/prod/instances/decode/d-1"
    assert keys.parse_key(key.encode()) == keys.ParsedKey("prod", "decode", "d-1")
    assert key.startswith(keys.namespace_prefix("prod"))
    assert key.startswith(keys.component_prefix("prod", "decode"))
    assert not key.startswith(keys.namespace_prefix("pro"))


@pytest.mark.parametrize(
    "bad",
    [
        "/tandem/v1/ns/instances/worker/x",
        "/tandem/v1/ns/instances/decode/",
        "/tandem/v2/ns/instances/decode/x",
        "/tandem/v1/ns/instances/decode/x/y",
    ],
)
def test_parse_key_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        keys.parse_key(bad)


def test_instance_key_rejects_bad_fields() -> None:
    with pytest.raises(ValueError, match="role"):
        keys.instance_key("ns", make_instance("x", pb.ROLE_UNSPECIFIED))
    with pytest.raises(ValueError, match="instance_id"):
        keys.instance_key("ns", make_instance("a/b"))
    with pytest.raises(ValueError, match="namespace"):
        keys.instance_key("", make_instance("x"))


def test_parse_endpoints() -> None:
    assert parse_endpoints("127.0.0.1:2379, http://etcd-1:2380,[::1]:2381,https://etcd-2:2379") == [
        Endpoint("127.0.0.1", 2379),
        Endpoint("etcd-1", 2380),
        Endpoint("::1", 2381),
        Endpoint("etcd-2", 2379, tls=True),
    ]
    assert str(Endpoint("etcd-2", 2379, tls=True)) == "https://etcd-2:2379"
    from discovery.endpoints import check_etcd_tls
    check_etcd_tls("127.0.0.1:2379", "")  # plaintext needs no certificate
    check_etcd_tls("https://127.0.0.1:2379", "router.pem")
    with pytest.raises(ValueError, match="--etcd https.*--tls-cert"):
        check_etcd_tls("127.0.0.1:2379,https://10.0.0.5:2379", "")
    for bad in ["", "host", "host:x", "host:0", "unix://h:1", "a:1,:2"]:
        with pytest.raises(ValueError, match="--etcd"):
            parse_endpoints(bad)
    with pytest.raises(ValueError, match="--etcd"):
        InstanceWatcher("nohost", "ns")
    with pytest.raises(ValueError, match="--etcd"):
        Registration("", "ns", make_instance("p1"))


def test_missing_etcd_binary_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(EtcdNotFoundError, match="etcd-server"):
        EtcdServer().start()


def test_connect_first_skips_dead_endpoints(etcd: EtcdServer) -> None:
    async def body() -> None:
        dead = "127.0.0.1:1"
        client = await connect_first(f"{dead},{etcd.endpoint}", rpc_timeout=2.0)
        await client.close()
        with pytest.raises(EtcdUnavailableError, match="127.0.0.1:1"):
            await connect_first(dead, rpc_timeout=1.0)

    run(body)


# -- registration and watch -------------------------------------------------------------------


def test_registration_seen_by_watchers_before_and_after(etcd: EtcdServer, ns: str) -> None:
    async def body() -> None:
        before_events: list[InstanceEvent] = []
        before = InstanceWatcher(etcd.endpoint, ns, before_events.append)
        await before.start()
        assert before.instances() == {}
        reg = Registration(etcd.endpoint, ns, make_instance("p1"), ttl_seconds=5)
        await reg.start()
        try:
            await before.wait_for(lambda v: "p1" in v, timeout=5)
            after = InstanceWatcher(etcd.endpoint, ns, component="prefill")
            await after.start()
            assert after.instances()["p1"] == make_instance("p1")
            # The component filter really filters.
            decode_only = InstanceWatcher(etcd.endpoint, ns, component="decode")
            await decode_only.start()
            assert decode_only.instances() == {}
            await decode_only.stop()
            await after.stop()
        finally:
            await reg.stop()
        await before.wait_for(lambda v: not v, timeout=5)
        await before.stop()
        assert kinds(before_events) == [("added", "p1"), ("removed", "p1")]

    run(body)


def test_update_to_draining_is_an_update_event(etcd: EtcdServer, ns: str) -> None:
    async def body() -> None:
        async with InstanceWatcher(etcd.endpoint, ns) as watcher:
            stream = watcher.events()
            inst = make_instance("d1", pb.ROLE_DECODE)
            async with Registration(etcd.endpoint, ns, inst) as reg:
                assert kinds([await stream.get(5)]) == [("added", "d1")]
                inst.state = pb.INSTANCE_STATE_DRAINING
                await reg.update(inst)
                event = await stream.get(5)
                assert event.kind == "updated"
                assert event.instance.state == pb.INSTANCE_STATE_DRAINING
                with pytest.raises(ValueError):
                    await reg.update(make_instance("other", pb.ROLE_DECODE))
            assert kinds([await stream.get(5)]) == [("removed", "d1")]
            # A late subscriber is replayed the current view first.
            async with Registration(etcd.endpoint, ns, make_instance("d2", pb.ROLE_DECODE)):
                await watcher.wait_for(lambda v: "d2" in v, timeout=5)
                late = watcher.events()
                assert kinds([await late.get(1)]) == [("added", "d2")]
                late.close()
        # Stopping the watcher ends its iterators.
        with pytest.raises(StopAsyncIteration):
            while True:
                await stream.get(5)

    run(body)


def test_crashed_instance_disappears_when_lease_expires(etcd: EtcdServer, ns: str) -> None:
    async def body() -> None:
        async with InstanceWatcher(etcd.endpoint, ns) as watcher:
            reg = Registration(etcd.endpoint, ns, make_instance("p1"), ttl_seconds=2)
            await reg.start()
            await watcher.wait_for(lambda v: "p1" in v, timeout=5)
            await reg.abandon()  # keep-alive cancelled, connection closed, key left behind
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            await watcher.wait_for(lambda v: "p1" not in v, timeout=8)
            assert loop.time() - t0 > 0.5  # gone through expiry, not a delete

    run(body)


def test_keep_alive_outlives_the_ttl(etcd: EtcdServer, ns: str) -> None:
    async def body() -> None:
        events: list[InstanceEvent] = []
        async with InstanceWatcher(etcd.endpoint, ns, events.append) as watcher:
            async with Registration(etcd.endpoint, ns, make_instance("p1"), ttl_seconds=2) as reg:
                assert reg.ttl_seconds == 2
                await asyncio.sleep(3.5)
                assert "p1" in watcher.instances()
                async with await connect_first(etcd.endpoint) as admin:
                    assert await reg_lease_ttl(admin, reg) > 0
            await watcher.wait_for(lambda v: not v, timeout=5)
        assert kinds(events) == [("added", "p1"), ("removed", "p1")]

    run(body)


async def reg_lease_ttl(admin: aetcd.Client, reg: Registration) -> int:
    assert reg.lease_id is not None
    return int((await admin.get_lease_info(reg.lease_id, keys=False)).TTL)


def test_lost_lease_is_registered_again(etcd: EtcdServer, ns: str) -> None:
    async def body() -> None:
        events: list[InstanceEvent] = []
        async with InstanceWatcher(etcd.endpoint, ns, events.append) as watcher:
            async with Registration(etcd.endpoint, ns, make_instance("p1"), ttl_seconds=2) as reg:
                await watcher.wait_for(lambda v: "p1" in v, timeout=5)
                old_lease = reg.lease_id
                async with await connect_first(etcd.endpoint) as admin:
                    await admin.revoke_lease(old_lease)  # behind the registration's back
                    await watcher.wait_for(lambda v: "p1" not in v, timeout=5)
                    await watcher.wait_for(lambda v: "p1" in v, timeout=5)
                    assert reg.lease_id != old_lease
                    assert await reg_lease_ttl(admin, reg) > 0
            await watcher.wait_for(lambda v: not v, timeout=5)
        assert kinds(events) == [("added", "p1"), ("removed", "p1")] * 2

    run(body)


def test_malformed_records_are_skipped(
    etcd: EtcdServer, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        prefix = keys.namespace_prefix(ns)
        async with await connect_first(etcd.endpoint) as admin:
            await admin.put(f"{prefix}prefill/garbage".encode(), b"\xff\xff\xff")
            # Valid protobuf, but its id does not match its key.
            d8 = make_instance("d8", pb.ROLE_DECODE).SerializeToString()
            await admin.put(f"{prefix}decode/d9".encode(), d8)
            await admin.put(f"{prefix}unknown/x".encode(), b"")
            async with InstanceWatcher(etcd.endpoint, ns) as watcher:
                assert watcher.instances() == {}
                await admin.put(f"{prefix}prefill/garbage2".encode(), b"\x0a")
                async with Registration(etcd.endpoint, ns, make_instance("p1")):
                    await watcher.wait_for(lambda v: "p1" in v, timeout=5)
                await until(lambda: watcher.in_sync, timeout=5)
                # A valid record overwritten by garbage leaves the view.
                d9 = make_instance("d9", pb.ROLE_DECODE).SerializeToString()
                await admin.put(f"{prefix}decode/d9".encode(), d9)
                await watcher.wait_for(lambda v: "d9" in v, timeout=5)
                await admin.put(f"{prefix}decode/d9".encode(), b"\xff")
                await watcher.wait_for(lambda v: "d9" not in v, timeout=5)
        assert "skipping" in caplog.text

    with caplog.at_level(logging.WARNING, logger="discovery.watcher"):
        run(body)


def test_watch_on_compacted_revision_lists_again(
    etcd: EtcdServer, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        async with await connect_first(etcd.endpoint) as admin:
            watcher = InstanceWatcher(etcd.endpoint, ns)
            real_watch = watcher._watch
            calls = 0

            async def watch_after_compaction(client: aetcd.Client, start: int, bo: Any) -> None:
                # Between the listing and the watch: a change, then compaction past it.
                nonlocal calls
                calls += 1
                if calls == 1:
                    inst = make_instance("p1")
                    await admin.put(keys.instance_key(ns, inst).encode(), inst.SerializeToString())
                    # Compacting at revision N keeps N, so go one revision further.
                    bump = await admin.put(f"/tandem-test/{ns}".encode(), b"")
                    await admin.compact(bump.header.revision)
                await real_watch(client, start, bo)

            watcher._watch = watch_after_compaction  # type: ignore[method-assign]
            await watcher.start()
            await watcher.wait_for(lambda v: "p1" in v, timeout=5)
            await watcher.stop()
            await admin.delete(keys.instance_key(ns, make_instance("p1")).encode())
            await admin.delete(f"/tandem-test/{ns}".encode())
        assert calls >= 2
        assert "compacted" in caplog.text

    with caplog.at_level(logging.WARNING, logger="discovery.watcher"):
        run(body)


def test_watcher_survives_etcd_restart_and_reconciles(etcd: EtcdServer, ns: str) -> None:
    async def body() -> None:
        # The gated watcher cannot reconnect until the test says so, so the changes made
        # while it was away can only reach it through the re-list and reconcile.
        gate = asyncio.Event()
        gate.set()

        async def gated_client() -> aetcd.Client:
            await gate.wait()
            return await connect_first(etcd.endpoint)

        gated_events: list[InstanceEvent] = []
        gated = InstanceWatcher(None, ns, gated_events.append, client_factory=gated_client)
        plain = InstanceWatcher(etcd.endpoint, ns)
        reg_a = Registration(etcd.endpoint, ns, make_instance("a"), ttl_seconds=10)
        reg_b = Registration(etcd.endpoint, ns, make_instance("b"), ttl_seconds=10)
        reg_c = Registration(etcd.endpoint, ns, make_instance("c"), ttl_seconds=10)
        await gated.start()
        await plain.start()
        await reg_a.start()
        await reg_b.start()
        try:
            both = lambda v: set(v) == {"a", "b"}  # noqa: E731
            await gated.wait_for(both, timeout=5)
            await plain.wait_for(both, timeout=5)
            lease_b = reg_b.lease_id
            await reg_b.abandon()  # b "crashes"; its lease would outlive the outage

            gate.clear()
            await asyncio.to_thread(etcd.stop_process)
            await asyncio.sleep(1.0)
            # Outage: both watchers keep their last view.
            assert not gated.in_sync and not plain.in_sync
            assert set(gated.instances()) == {"a", "b"}
            assert set(plain.instances()) == {"a", "b"}

            await asyncio.to_thread(etcd.start)  # same port, same data
            async with await connect_first(etcd.endpoint) as admin:
                await admin.revoke_lease(lease_b)
            await reg_c.start()
            await plain.wait_for(lambda v: set(v) == {"a", "c"}, timeout=10)
            assert set(gated.instances()) == {"a", "b"}  # still cut off, still its old view

            gate.set()
            await gated.wait_for(lambda v: set(v) == {"a", "c"}, timeout=10)
            await until(lambda: gated.in_sync, timeout=5)  # the watch is created after the list
            assert kinds(gated_events) == [
                ("added", "a"),
                ("added", "b"),
                ("removed", "b"),  # reconciled from the new listing
                ("added", "c"),
            ]
            # a's lease survived the restart and is kept alive by the same registration.
            lease_a = reg_a.lease_id
            await asyncio.sleep(0.5)
            assert reg_a.lease_id == lease_a and "a" in plain.instances()
        finally:
            gate.set()
            for closer in (reg_a.stop, reg_c.stop, gated.stop, plain.stop):
                await closer()

    run(body, timeout=45)


def test_a_peer_looked_up_before_the_first_listing_is_waited_for(etcd, ns):
    # a decode worker serves while its watcher's first listing is still on its way: a request
    # naming a prefill worker registered before it was refused "not in discovery" (a start-up
    # race seen in CI), where the wait meant for records that come late applies too
    from worker.peers import PeerDirectory

    async def body() -> None:
        async with Registration(etcd.endpoint, ns, make_instance("p1")):
            watcher = InstanceWatcher(etcd.endpoint, ns, component="prefill")
            peers = PeerDirectory("tiny", "", watcher)
            await watcher.start(timeout=None)  # as decode_worker/main.py starts it: no wait for the listing
            try:
                assert not watcher.listed
                found = await peers.find(lambda i: i.address == "127.0.0.1:50051", "prefill_address",
                                         "prefill worker '127.0.0.1:50051'", wait_s=5.0)
                assert found.instance_id == "p1" and watcher.listed
            finally:
                await watcher.stop()

    run(body)
