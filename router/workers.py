"""The router's view of the workers: discovery's instances, filtered to those it may use,
with one gRPC channel per worker instance.

Channel lifecycle: a channel is opened on first use for an instance in discovery, replaced
when the instance's record moves to another address, and closed when the instance leaves
discovery (`prune`, on every membership change), so the router never keeps dialling an
address whose record is gone and the pool is bounded by the instances in discovery."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common import block_hash, tls
from common.grpc_server import channel
from common.pb.tandem.v1 import discovery_pb2

log = logging.getLogger(__name__)


class WorkerSet:
    """Which workers can serve this router's model: same name, block size and weights.

    Weights (model identity): workers publish a fingerprint of their weights
    (`Instance.weights_fingerprint`, which also enters their hash seed). The router has no
    weights of its own to compare with, so it accepts the fingerprint most workers of its model
    name and block size in discovery have, ties going to the earliest started, and refuses the
    others with one log line each: a worker started with another --seed or another checkpoint
    folder under the same name is never mixed in. The accepted fingerprint follows discovery
    (a rolling replacement of every worker moves it once the new weights are the majority).
    """

    def __init__(self, watcher, model: str, block_size: int, hash_seed: int) -> None:
        self._watcher = watcher
        self.model = model
        self.block_size = block_size
        self._base_seed = hash_seed  # the seed of workers that publish no fingerprint (the mocker)
        self._channels: dict[str, tuple[str, grpc.aio.Channel]] = {}  # instance id -> (address, channel)
        self._closing: set[asyncio.Task] = set()  # strong references to channel closes
        self.channels_closed = 0  # counter: channels closed because their instance left or moved
        self._refused: dict[str, str] = {}  # instance id -> why, logged once per instance and reason
        self.refused_workers = 0  # counter: workers refused for model, block size, weights or hash seed
        self._aside: dict[str, float] = {}  # instance id -> monotonic time it may be used again
        self._aside_generation = 0
        self.set_aside_s = 5.0
        self.health = None  # router.health.HealthTracker, when probing: unhealthy workers are not candidates
        # What a route reads on every request, kept until discovery, health or a set-aside
        # changes: copying 1,000 discovery records per request cost milliseconds (tools/bench_fleet.py).
        self._snap: tuple[object, dict[str, discovery_pb2.Instance], str] | None = None  # (key, view, accepted)
        self._cands: dict[tuple[int, bool], tuple[object, float, list[discovery_pb2.Instance]]] = {}

    def seed_for(self, fingerprint: str) -> int:
        """The hash seed of a worker of this model with these weights (must match worker/host.py)."""
        return block_hash.hash_seed(self.model, weights=fingerprint) if fingerprint else self._base_seed

    def _view(self) -> tuple[dict[str, discovery_pb2.Instance], str]:
        """Discovery's view (shared copies: do not modify them) and the accepted fingerprint,
        derived again only when the watcher's generation moves (every call, for a watcher
        without one)."""
        gen = getattr(self._watcher, "generation", None)
        snap = self._snap
        if gen is None or snap is None or snap[0] != gen:
            view = self._watcher.instances()
            snap = self._snap = (gen, view, self._accepted(view))
        return snap[1], snap[2]

    @property
    def fingerprint(self) -> str:
        """The weights fingerprint accepted now (see the class docstring)."""
        return self._view()[1]

    @property
    def hash_seed(self) -> int:
        """The seed of the accepted workers' block hashes (the router's lookups use it)."""
        return self.seed_for(self.fingerprint)

    def hash_seed_for(self, cache_salt: str) -> int:
        """The seed of a request's block hashes with this tenant cache salt ("" = hash_seed).
        Must match worker/host.py WorkerRuntime.seed_for."""
        if not cache_salt:
            return self.hash_seed
        return block_hash.hash_seed(self.model, cache_salt=cache_salt, weights=self.fingerprint)

    def _accepted(self, view: dict[str, discovery_pb2.Instance]) -> str:
        votes: dict[str, tuple[int, float]] = {}  # fingerprint -> (-workers, earliest start)
        for i in view.values():
            if i.role != discovery_pb2.ROLE_ROUTER and i.model == self.model and i.block_size == self.block_size:
                n, first = votes.get(i.weights_fingerprint, (0, float("inf")))
                votes[i.weights_fingerprint] = (n - 1, min(first, i.start_time_unix))
        return min(votes, key=lambda fp: (votes[fp], fp)) if votes else ""

    def refusal(self, inst: discovery_pb2.Instance, accepted: str) -> str:
        """Why this worker is not used ("" when it is)."""
        if inst.model != self.model:
            return f"model {inst.model!r}, router serves {self.model!r}"
        if inst.block_size != self.block_size:
            return f"block_size {inst.block_size}, router has {self.block_size}"
        if inst.weights_fingerprint != accepted:
            return (f"weights fingerprint {inst.weights_fingerprint or '(none)'} differs from {accepted or '(none)'}, "
                    f"the one most {self.model} workers have (other weights under the same model name)")
        if inst.hash_seed != self.seed_for(accepted):
            return f"hash_seed {inst.hash_seed}, router expects {self.seed_for(accepted)}"
        return ""

    def _compatible(self, inst: discovery_pb2.Instance, accepted: str) -> bool:
        why = self.refusal(inst, accepted)
        if not why:
            return True
        if self._refused.get(inst.instance_id) != why:  # say it once, never score it silently
            self._refused[inst.instance_id] = why
            self.refused_workers += 1
            log.warning("refusing worker %s at %s: %s", inst.instance_id, inst.address, why)
        return False

    def candidates(self, role: int, serving_only: bool = True) -> list[discovery_pb2.Instance]:
        """Compatible instances of `role` in discovery now: by default only SERVING ones that
        are neither set aside nor unhealthy.

        The same list object is returned while nothing it depends on changed (discovery,
        health, set-asides, an expiring set-aside): callers must not modify it, and may key
        what they derive from it on its identity (router/placement.py)."""
        now = time.monotonic()
        key = (getattr(self._watcher, "generation", None),
               0 if self.health is None else getattr(self.health, "generation", None), self._aside_generation)
        hit = self._cands.get((role, serving_only))
        if hit is not None and None not in key and hit[0] == key and now < hit[1]:
            return hit[2]
        view, accepted = self._view()
        out = [i for i in view.values()
               if i.role == role and self._compatible(i, accepted)
               and (not serving_only or (i.state == discovery_pb2.INSTANCE_STATE_SERVING
                                         and self._aside.get(i.instance_id, 0.0) <= now
                                         and (self.health is None or self.health.healthy(i.instance_id, i.address))))]
        # valid until the first set-aside still running expires (that worker comes back)
        until = min((t for t in self._aside.values() if t > now), default=float("inf")) if serving_only else float("inf")
        self._cands[(role, serving_only)] = (key, until, out)
        return out

    def refused(self, role: int) -> list[tuple[discovery_pb2.Instance, str]]:
        """Instances of `role` in discovery that this router does not use, with the reason."""
        view, accepted = self._view()
        return [(i, why) for i in view.values() if i.role == role and (why := self.refusal(i, accepted))]

    def routers(self) -> list[discovery_pb2.Instance]:
        """The routers of this model in discovery now (this one included), by instance id."""
        view, _ = self._view()
        return sorted((i for i in view.values() if i.role == discovery_pb2.ROLE_ROUTER and i.model == self.model),
                      key=lambda i: i.instance_id)

    def instance_ids(self) -> list[str]:
        """Every instance in discovery now (any role, state or compatibility)."""
        return list(self._view()[0])

    def set_aside(self, instance_id: str, seconds: float | None = None) -> None:
        """Route nothing new to a worker that refused a connection, for `seconds` (default
        set_aside_s): long enough for its lease to expire if it died. Counts as a transport
        failure for health."""
        now = time.monotonic()
        # drop the expired ones (workers that came back, or left for good) so the map stays small
        self._aside = {k: t for k, t in self._aside.items() if t > now}
        self._aside[instance_id] = now + (self.set_aside_s if seconds is None else seconds)
        self._aside_generation += 1
        if self.health is not None:
            self.health.record_transport_failure(instance_id, "refused a call")

    def stream_broke(self, instance_id: str, exc: grpc.aio.AioRpcError) -> None:
        """A stream from this worker (KV events, load reports) ended with `exc`: when the
        transport failed (UNAVAILABLE), health probes the worker now (router/health.py
        probe_soon), so a worker whose process died leaves routing at once."""
        if self.health is not None and exc.code() == grpc.StatusCode.UNAVAILABLE:
            self.health.probe_soon(instance_id)

    def instance(self, instance_id: str) -> discovery_pb2.Instance | None:
        """The instance's record in discovery now, or None once it left."""
        return self._view()[0].get(instance_id)

    def channel(self, inst: discovery_pb2.Instance) -> grpc.aio.Channel:
        return self.channel_to(inst.instance_id, inst.address)

    def channel_to(self, instance_id: str, address: str) -> grpc.aio.Channel:
        """The channel to this instance at `address` (opened now if needed; a record that moved
        to another address gets a new one, the old one is closed).

        Raises:
            LookupError: the instance is not in discovery at that address (never dial a
                departed address).
        """
        inst = self.instance(instance_id)
        if inst is None or inst.address != address:
            raise LookupError(f"worker {instance_id} at {address} is no longer in discovery")
        entry = self._channels.get(instance_id)
        if entry is not None and entry[0] == address:
            return entry[1]
        if entry is not None:
            log.info("worker %s moved from %s to %s: new channel", instance_id, entry[0], address)
            self._close(entry[1])
        # over mTLS only the process holding this instance's certificate passes the handshake
        ch = channel(address, server_name=tls.instance_server_name(instance_id))
        self._channels[instance_id] = (address, ch)
        return ch

    def prune(self) -> list[str]:
        """Close the channels of instances no longer in discovery, or whose record moved to
        another address; returns the instance ids whose channel was closed. (Their open calls
        end CANCELLED: call after migrating them.)"""
        present = self._view()[0]
        gone = [wid for wid, (addr, _) in self._channels.items()
                if wid not in present or present[wid].address != addr]
        for wid in gone:
            self._close(self._channels.pop(wid)[1])
        return gone

    def channel_count(self) -> int:
        return len(self._channels)

    def _close(self, ch: grpc.aio.Channel) -> None:
        self.channels_closed += 1
        task = asyncio.get_running_loop().create_task(ch.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        for _, ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        await asyncio.gather(*self._closing, return_exceptions=True)
