"""A live view of the registered instances of a namespace.

The watcher lists the prefix at revision R (the revision in the response header), then watches
from R + 1, applying each watch response as a whole. When the watch breaks, is compacted, or
etcd is unreachable, it keeps its last view (a brief etcd outage must not make the router drop
every worker), retries with back-off, lists again and reconciles: the differences between the
old view and the new listing are emitted as added/updated/removed events, so no change is ever
silently missed. Records that do not parse are skipped with a log line.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import aetcd
import grpc
from aetcd import rpc
from aetcd.utils import prefix_range_end
from google.protobuf.message import DecodeError

from common.tls import TlsCredentials
from discovery.client_holder import ClientHolder
from common.pb.tandem.v1 import discovery_pb2
from discovery.backoff import Backoff
from discovery.endpoints import ETCD_ERRORS, connect_first, describe_error, parse_endpoints
from discovery.keys import ROLE_BY_COMPONENT, component_prefix, namespace_prefix, parse_key

logger = logging.getLogger(__name__)

EventKind = Literal["added", "updated", "removed"]
ClientFactory = Callable[[], Awaitable[aetcd.Client]]


@dataclass(frozen=True)
class InstanceEvent:
    """One change of the view. For "removed", `instance` is the last record seen."""

    kind: EventKind
    instance: discovery_pb2.Instance


OnChange = Callable[[InstanceEvent], "Awaitable[None] | None"]


class _WatchEnded(Exception):
    """The watch stream ended or etcd cancelled it; list again."""


class InstanceWatcher:
    """Watches `/tandem/v1/{namespace}/instances/[component/]`.

    Args:
        endpoints: etcd endpoints, "host:port[,host:port...]" (the `--etcd` flag); may be None
            when `client_factory` is given.
        namespace: discovery namespace.
        on_change: called (and awaited, if it returns an awaitable) with each InstanceEvent, in
            order; exceptions it raises are logged and ignored.
        component: only this component ("router", "prefill", "decode"); default all.
        client_factory: async callable returning an aetcd client; default
            `connect_first(endpoints)`.
        rpc_timeout: deadline in seconds of each unary etcd call.
        tls: credentials for https:// endpoints (default: this process's, common/tls.py).
        max_backoff: longest wait in seconds between reconnection attempts.

    Raises:
        ValueError: bad namespace/component, a malformed endpoint list (names `--etcd`), or
            neither endpoints nor client_factory.
    """

    def __init__(
        self,
        endpoints: str | Sequence[str] | None,
        namespace: str,
        on_change: OnChange | None = None,
        *,
        component: str | None = None,
        client_factory: ClientFactory | None = None,
        rpc_timeout: float = 5.0,
        tls: TlsCredentials | None = None,
        max_backoff: float = 2.0,
    ) -> None:
        if client_factory is None:
            if not endpoints:
                raise ValueError(
                    "InstanceWatcher needs etcd endpoints (--etcd) or a client_factory"
                )

            parsed = parse_endpoints(endpoints)  # a bad --etcd fails here, not in a retry loop

            async def client_factory() -> aetcd.Client:
                return await connect_first(parsed, rpc_timeout=rpc_timeout, tls=tls)

        self._factory = client_factory
        self._namespace = namespace
        self._component = component
        self._prefix = (
            component_prefix(namespace, component) if component else namespace_prefix(namespace)
        ).encode()
        self._on_change = on_change
        self._rpc_timeout = rpc_timeout
        self._max_backoff = max_backoff
        self._view: dict[bytes, discovery_pb2.Instance] = {}  # etcd key -> record
        self._revision = 0
        # Bumped whenever the view changes: a reader may keep what it derived from instances()
        # until this moves (the router's candidate lists at 1,000 workers).
        self.generation = 0
        self._in_sync = False
        self._synced = asyncio.Event()  # set after the first full listing
        self._changed = asyncio.Condition()
        self._subscribers: set[asyncio.Queue[InstanceEvent | None]] = set()
        self._clients = ClientHolder(self._factory, self._rpc_timeout)
        self._task: asyncio.Task[None] | None = None  # strong reference (asyncio keeps weak ones)

    # -- view -------------------------------------------------------------------------------

    def instances(self) -> dict[str, discovery_pb2.Instance]:
        """The current view, keyed by instance_id (copies; the last view while etcd is down)."""
        return {inst.instance_id: _copy(inst) for inst in self._view.values()}

    @property
    def revision(self) -> int:
        """The etcd revision the view reflects (0 before the first listing)."""
        return self._revision

    @property
    def in_sync(self) -> bool:
        """True while a watch is live; False before the first sync and while reconnecting."""
        return self._in_sync

    @property
    def listed(self) -> bool:
        """Whether the first full listing has come (the view holds what etcd had then)."""
        return self._synced.is_set()

    async def wait_for(
        self,
        predicate: Callable[[dict[str, discovery_pb2.Instance]], bool],
        timeout: float,
    ) -> dict[str, discovery_pb2.Instance]:
        """Wait until `predicate(instances())` is true; return that view.

        Raises:
            TimeoutError: not true within `timeout` seconds.
        """
        async with self._changed:
            await asyncio.wait_for(
                self._changed.wait_for(lambda: predicate(self.instances())), timeout
            )
        return self.instances()

    def events(self, replay: bool = True) -> _EventStream:
        """An async iterator of InstanceEvents from now on, ending when the watcher stops.

        With `replay`, it starts with an "added" event for each instance already in the view.
        Call its `close()` (or leave the `async for`) to unsubscribe.
        """
        queue: asyncio.Queue[InstanceEvent | None] = asyncio.Queue()
        if replay:
            for inst in self._view.values():
                queue.put_nowait(InstanceEvent("added", _copy(inst)))
        self._subscribers.add(queue)
        return _EventStream(queue, self._subscribers)

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self, timeout: float | None = 10.0) -> None:
        """Start watching; wait up to `timeout` seconds (None: don't wait) for the first listing.

        Raises:
            RuntimeError: already started.
            TimeoutError: no listing within `timeout`; the watcher is stopped again.
        """
        if self._task is not None:
            raise RuntimeError("InstanceWatcher already started")
        self._task = asyncio.create_task(self._run(), name=f"watch {self._prefix.decode()}")
        if timeout is None:
            return
        try:
            await asyncio.wait_for(self._synced.wait(), timeout)
        except TimeoutError:
            await self.stop()
            raise TimeoutError(
                f"etcd did not list {self._prefix.decode()} within {timeout} s"
            ) from None

    async def stop(self) -> None:
        """Stop watching, close the connection and end every events() iterator. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # wait() neither raises the task's CancelledError nor swallows our own.
            await asyncio.wait({task})
        self._in_sync = False
        await self._drop_client()
        for queue in self._subscribers:
            queue.put_nowait(None)

    async def __aenter__(self) -> InstanceWatcher:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # -- list, watch, retry -----------------------------------------------------------------

    async def _run(self) -> None:
        backoff = Backoff(initial=0.1, maximum=self._max_backoff)
        while True:
            try:
                client = await self._ensure_client()
                await self._list(client)
                await self._watch(client, self._revision + 1, backoff)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the watcher must survive anything
                self._in_sync = False
                delay = backoff.next()
                log = logger.warning if _is_etcd_error(exc) else logger.exception
                log(
                    "watch of %s interrupted (%s); keeping %d instances, retrying in %.2f s",
                    self._prefix.decode(),
                    describe_error(exc),
                    len(self._view),
                    delay,
                )
                await self._drop_client()
                await asyncio.sleep(delay)

    async def _list(self, client: aetcd.Client) -> None:
        listing = await client.get_prefix(self._prefix)
        fresh: dict[bytes, discovery_pb2.Instance] = {}
        for kv in listing.kvs:
            inst = self._decode(kv.key, kv.value)
            if inst is not None:
                fresh[kv.key] = inst
        # Keys we know that the listing lacks were deleted while we were not watching.
        changes: dict[bytes, discovery_pb2.Instance | None] = dict.fromkeys(self._view)
        changes.update(fresh)
        emitted = await self._commit(changes, listing.header.revision)
        if self._synced.is_set() and emitted:
            logger.info("resynced %s: %d changes reconciled", self._prefix.decode(), emitted)
        self._synced.set()

    async def _watch(self, client: aetcd.Client, start_revision: int, backoff: Backoff) -> None:
        # The raw stream, not aetcd's watch API: aetcd hands out single events, dropping the
        # response they came in (needed to apply a response as a whole) and its header.
        # "hasleader" makes etcd cancel the watch if its member loses the leader (like
        # clientv3.WithRequireLeader) instead of serving a stale stream.
        metadata = (("hasleader", "true"), *(client.metadata or ()))
        call = rpc.WatchStub(client.channel).Watch(metadata=metadata)
        try:
            create = rpc.WatchCreateRequest(
                key=self._prefix,
                range_end=prefix_range_end(self._prefix),
                start_revision=start_revision,
                progress_notify=True,
            )
            await call.write(rpc.WatchRequest(create_request=create))
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    raise _WatchEnded("etcd closed the watch stream")
                if resp.compact_revision:
                    raise _WatchEnded(
                        f"revision {start_revision} compacted (now {resp.compact_revision})"
                    )
                if resp.canceled:
                    raise _WatchEnded(f"etcd cancelled the watch: {resp.cancel_reason or '?'}")
                if resp.created:
                    self._in_sync = True
                    backoff.reset()
                await self._apply(resp)
        finally:
            call.cancel()

    async def _apply(self, resp: rpc.WatchResponse) -> None:
        # All events of one response (one transaction, or several) are applied together, so a
        # key put and deleted in the same response yields no event.
        changes: dict[bytes, discovery_pb2.Instance | None] = {}
        for event in resp.events:
            if event.type == rpc.Event.PUT:
                changes[event.kv.key] = self._decode(event.kv.key, event.kv.value)
            else:
                changes[event.kv.key] = None
        await self._commit(changes, max(self._revision, resp.header.revision))

    async def _commit(
        self, changes: Mapping[bytes, discovery_pb2.Instance | None], revision: int
    ) -> int:
        """Apply key -> record (None: absent) changes, emit the events; return how many."""
        events: list[InstanceEvent] = []
        for key, new in changes.items():
            old = self._view.get(key)
            if new is None:
                if old is not None:
                    del self._view[key]
                    events.append(InstanceEvent("removed", _copy(old)))
            elif old is None:
                self._view[key] = new
                events.append(InstanceEvent("added", _copy(new)))
            elif old != new:
                self._view[key] = new
                events.append(InstanceEvent("updated", _copy(new)))
            # else: the same record put again (e.g. a re-registration): nothing to tell.
        self._revision = revision
        if events:
            self.generation += 1
        for event in events:
            await self._emit(event)
        async with self._changed:
            self._changed.notify_all()
        return len(events)

    async def _emit(self, event: InstanceEvent) -> None:
        for queue in self._subscribers:
            queue.put_nowait(event)
        if self._on_change is None:
            return
        try:
            result = self._on_change(event)
            if inspect.isawaitable(result):
                await result
        except Exception:  # noqa: BLE001 - a bad callback must not stop discovery
            logger.exception("on_change callback failed for %s event", event.kind)

    def _decode(self, key: bytes, value: bytes) -> discovery_pb2.Instance | None:
        """Parse one record; None (with a log line) if key or value is malformed."""
        try:
            parsed = parse_key(key)
            inst = discovery_pb2.Instance.FromString(value)
        except (ValueError, DecodeError) as exc:
            logger.warning("skipping malformed discovery record %r: %s", key, exc)
            return None
        expected_role = ROLE_BY_COMPONENT[parsed.component]
        if inst.instance_id != parsed.instance_id or inst.role != expected_role:
            logger.warning(
                "skipping discovery record %r: its instance_id %r / role %d do not match the key",
                key,
                inst.instance_id,
                inst.role,
            )
            return None
        return inst

    # -- connection -------------------------------------------------------------------------

    async def _ensure_client(self) -> aetcd.Client:
        return await self._clients.get()

    async def _drop_client(self) -> None:
        await self._clients.drop()


class _EventStream:
    """Async iterator over one subscription of InstanceWatcher.events()."""

    def __init__(
        self,
        queue: asyncio.Queue[InstanceEvent | None],
        subscribers: set[asyncio.Queue[InstanceEvent | None]],
    ) -> None:
        self._queue = queue
        self._subscribers = subscribers

    def __aiter__(self) -> AsyncIterator[InstanceEvent]:
        return self

    async def __anext__(self) -> InstanceEvent:
        item = await self._queue.get()
        if item is None:
            self.close()
            raise StopAsyncIteration
        return item

    async def get(self, timeout: float) -> InstanceEvent:
        """The next event, waiting at most `timeout` seconds.

        Raises:
            TimeoutError: none in time. StopAsyncIteration: the watcher stopped.
        """
        return await asyncio.wait_for(self.__anext__(), timeout)

    def close(self) -> None:
        """Unsubscribe."""
        self._subscribers.discard(self._queue)


def _is_etcd_error(exc: Exception) -> bool:
    # Expected while etcd is away (EtcdUnavailableError is an OSError); anything else is a bug
    # and is logged with its traceback.
    return isinstance(exc, (*ETCD_ERRORS, _WatchEnded))


def _copy(instance: discovery_pb2.Instance) -> discovery_pb2.Instance:
    copied = discovery_pb2.Instance()
    copied.CopyFrom(instance)
    return copied
