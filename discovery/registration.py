"""Lease-backed registration of one instance in etcd.

The record lives under `/tandem/v1/{namespace}/instances/{component}/{instance_id}`, attached to
a lease of `ttl_seconds`. A background task refreshes the lease a third of the way into each
lease period (TTL/3), scheduled against the lease's expiry, which counts from when the last
successful refresh was SENT, not from when its reply arrived. Errors are retried with
exponential back-off and jitter, faster as expiry nears. If etcd says the lease is gone (refresh
answers TTL <= 0), a new lease is granted and the same record put again: the engine is never
told, let alone restarted; only a log line says so.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence

import aetcd
import grpc
from aetcd import rpc

from common.tls import TlsCredentials
from discovery.client_holder import ClientHolder
from common.pb.tandem.v1 import discovery_pb2
from discovery.backoff import Backoff
from discovery.endpoints import ETCD_ERRORS, connect_first, describe_error, parse_endpoints
from discovery.keys import instance_key

logger = logging.getLogger(__name__)

ClientFactory = Callable[[], Awaitable[aetcd.Client]]


class LeaseLostError(ConnectionError):
    """etcd no longer knows the lease (raised internally, handled by re-registering)."""


class Registration:
    """Keeps `instance` registered in etcd while started.

    Args:
        endpoints: etcd endpoints, "host:port[,host:port...]" (the `--etcd` flag); may be None
            when `client_factory` is given.
        namespace: discovery namespace (one key segment).
        instance: the record to publish; its role and instance_id fix the key.
        ttl_seconds: lease time to live in seconds (default 10, `--lease-ttl`). etcd leases
            have whole seconds, so it is rounded up; etcd raises values below its minimum (2 s
            with default settings) and the granted TTL is what the keep-alive uses.
        client_factory: async callable returning a connected aetcd client (used for tests and to
            share connection settings); default `connect_first(endpoints)`.
        rpc_timeout: deadline in seconds of each etcd call.
        tls: credentials for https:// endpoints (default: this process's, common/tls.py).

    Raises:
        ValueError: bad namespace/instance (see keys.instance_key), ttl_seconds <= 0, a
            malformed endpoint list (names `--etcd`), or neither endpoints nor client_factory.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str] | None,
        namespace: str,
        instance: discovery_pb2.Instance,
        ttl_seconds: float = 10.0,
        *,
        client_factory: ClientFactory | None = None,
        rpc_timeout: float = 5.0,
        tls: TlsCredentials | None = None,
    ) -> None:
        if ttl_seconds <= 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")
        if client_factory is None:
            if not endpoints:
                raise ValueError("Registration needs etcd endpoints (--etcd) or a client_factory")

            parsed = parse_endpoints(endpoints)  # a bad --etcd fails here, not in a retry loop

            async def client_factory() -> aetcd.Client:
                return await connect_first(parsed, rpc_timeout=rpc_timeout, tls=tls)

        self._factory = client_factory
        self._namespace = namespace
        self._key = instance_key(namespace, instance)
        self._instance = _copy(instance)
        self._requested_ttl = max(1, math.ceil(ttl_seconds))
        self._rpc_timeout = rpc_timeout
        self._clients = ClientHolder(self._factory, self._rpc_timeout)
        self._lease_id: int | None = None
        self._granted_ttl = self._requested_ttl
        # Monotonic time of the lease's expiry: send time of the last successful grant/refresh
        # plus the TTL etcd answered. etcd started its clock later (on receipt), so this never
        # overestimates the time left.
        self._expiry = 0.0
        self._dirty = False  # the latest record may not be in etcd yet (failed update())
        # One etcd operation at a time: a re-registration must not race an update().
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None  # strong reference (asyncio keeps weak ones)

    # -- properties -------------------------------------------------------------------------

    @property
    def key(self) -> str:
        """The etcd key of the record."""
        return self._key

    @property
    def lease_id(self) -> int | None:
        """The current lease id (None before start())."""
        return self._lease_id

    @property
    def ttl_seconds(self) -> int:
        """The TTL etcd granted to the current lease, in seconds."""
        return self._granted_ttl

    @property
    def instance(self) -> discovery_pb2.Instance:
        """A copy of the latest record (as given to the constructor or update())."""
        return _copy(self._instance)

    @property
    def started(self) -> bool:
        """True between start() and stop()/abandon()."""
        return self._task is not None

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Grant a lease, put the record under it, and start the keep-alive task.

        Raises:
            RuntimeError: already started.
            discovery.endpoints.EtcdUnavailableError, aetcd.ClientError, grpc.RpcError,
            TimeoutError: the first registration failed (nothing is left running).
        """
        if self._task is not None:
            raise RuntimeError(f"registration of {self._key} already started")
        try:
            async with self._lock:
                await self._register_locked()
        except BaseException:
            await self._drop_client()
            raise
        self._task = asyncio.create_task(self._keep_alive_loop(), name=f"keepalive {self._key}")
        logger.info(
            "registered %s (lease %x, ttl %d s)", self._key, self._lease_id, self._granted_ttl
        )

    async def update(self, instance: discovery_pb2.Instance) -> None:
        """Publish a new version of the record (e.g. state DRAINING) under the current lease.

        The record is kept even if the put fails: the keep-alive task puts it again after its
        next successful refresh, and any re-registration uses it.

        Raises:
            ValueError: the new record has another key (instance_id or role changed).
            RuntimeError: not started.
            aetcd.ClientError, grpc.RpcError, TimeoutError, ...: the put failed (will be retried
            in the background).
        """
        if instance_key(self._namespace, instance) != self._key:
            raise ValueError(f"update() cannot move the record away from {self._key}")
        if self._task is None:
            raise RuntimeError(f"registration of {self._key} is not started")
        self._instance = _copy(instance)
        self._dirty = True
        async with self._lock:
            await self._put_locked()

    async def stop(self, timeout: float = 2.0) -> None:
        """Stop the keep-alive and remove the record, spending at most `timeout` seconds on etcd.

        Revoking the lease deletes the key (watchers see a DELETE) and exactly the keys attached
        to that lease, atomically, so a newer registration of the same instance_id under another
        lease is never deleted by mistake. Failures are logged, not raised: the record then
        disappears when its lease expires.
        """
        await self._cancel_task()
        lease_id = self._lease_id
        try:
            if lease_id is not None:
                async with asyncio.timeout(timeout):
                    await self._remove(lease_id)
                logger.info("deregistered %s (lease %x revoked)", self._key, lease_id)
        except (*ETCD_ERRORS, TimeoutError) as exc:
            logger.warning(
                "could not deregister %s (%s); it expires with its lease within %d s",
                self._key,
                describe_error(exc),
                self._granted_ttl,
            )
        finally:
            self._lease_id = None
            await self._drop_client()

    async def abandon(self) -> None:
        """Stop the keep-alive and close the connection WITHOUT removing the record.

        Models a crashed process: the record disappears when its lease expires. For tests.
        """
        await self._cancel_task()
        await self._drop_client()

    async def __aenter__(self) -> Registration:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # -- keep-alive -------------------------------------------------------------------------

    async def _keep_alive_loop(self) -> None:
        backoff = Backoff(initial=0.1, maximum=max(0.5, self._granted_ttl / 3))
        while True:
            # Refresh one third into the lease period, i.e. 2/3 TTL before expiry.
            due = self._expiry - 2 * self._granted_ttl / 3
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            try:
                async with self._lock:
                    await self._refresh_locked()
                backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the keep-alive must survive anything
                delay = backoff.next()
                remaining = self._expiry - time.monotonic()
                if remaining > 0:
                    # Leave room for several more tries before the lease would expire.
                    delay = min(delay, max(0.05, remaining / 3))
                logger.warning(
                    "lease keep-alive of %s failed (%s); lease %s, retrying in %.2f s",
                    self._key,
                    describe_error(exc),
                    f"expires in {remaining:.1f} s" if remaining > 0 else "may have expired",
                    delay,
                )
                # A new connection next time: the endpoint may have gone away for good.
                await self._drop_client()
                await asyncio.sleep(delay)

    async def _refresh_locked(self) -> None:
        assert self._lease_id is not None
        client = await self._ensure_client()
        sent = time.monotonic()
        ttl = await self._keep_alive_once(client, self._lease_id)
        if ttl <= 0:
            # Expired (we were cut off longer than the TTL) or revoked behind our back.
            logger.warning("lease %x of %s is lost; registering again", self._lease_id, self._key)
            await self._register_locked()
            logger.info("re-registered %s under lease %x", self._key, self._lease_id)
            return
        self._granted_ttl = ttl
        self._expiry = sent + ttl
        if self._dirty:
            await self._put_locked()

    async def _keep_alive_once(self, client: aetcd.Client, lease_id: int) -> int:
        # aetcd's refresh_lease() returns from inside `async for` over the stream and leaves
        # the call open until garbage collection; here the stream is cancelled explicitly.
        call = client.leasestub.LeaseKeepAlive(
            iter([rpc.LeaseKeepAliveRequest(ID=lease_id)]),
            timeout=self._rpc_timeout,
            metadata=client.metadata,
        )
        try:
            reply = await call.read()
        finally:
            call.cancel()
        if reply is grpc.aio.EOF:
            raise ConnectionError("etcd closed the keep-alive stream without a reply")
        return int(reply.TTL)

    # -- etcd operations (caller holds self._lock) ------------------------------------------

    async def _register_locked(self) -> None:
        client = await self._ensure_client()
        sent = time.monotonic()
        lease = await client.lease(self._requested_ttl)
        self._lease_id = lease.id
        self._granted_ttl = int(lease.ttl)
        self._expiry = sent + lease.ttl
        # Same key, latest record: putting it again is idempotent for watchers.
        await self._put_locked()

    async def _put_locked(self) -> None:
        client = await self._ensure_client()
        value = self._instance.SerializeToString()
        await client.put(self._key.encode(), value, lease=self._lease_id)
        self._dirty = False

    async def _remove(self, lease_id: int) -> None:
        async with self._lock:
            client = await self._ensure_client()
            try:
                await client.revoke_lease(lease_id)
            except aetcd.ClientError as exc:
                # "requested lease not found": etcd already deleted the keys attached to it,
                # and a put under an unknown lease fails, so there is nothing left to delete.
                if "lease not found" not in str(exc):
                    raise

    # -- connection -------------------------------------------------------------------------

    async def _ensure_client(self) -> aetcd.Client:
        return await self._clients.get()

    async def _drop_client(self) -> None:
        await self._clients.drop()

    async def _cancel_task(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # wait() neither raises the task's CancelledError nor swallows our own.
            await asyncio.wait({task})


def _copy(instance: discovery_pb2.Instance) -> discovery_pb2.Instance:
    copied = discovery_pb2.Instance()
    copied.CopyFrom(instance)
    return copied
