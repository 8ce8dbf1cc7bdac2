"""Which peers a worker may act for: the discovery view of the other kind of worker.

A prefill worker writes KV only into the pool of a decode worker in discovery, and a decode
worker dials only prefill workers in discovery (docs/security.md). Both look the peer up in a
`PeerDirectory`, a view over an `InstanceWatcher` of one component that keeps only records of
this worker's model (name and weights fingerprint).

A record may reach the peer's watcher a little after the router's (each has its own etcd
watch), so an unknown peer is waited for briefly (`wait_s`) before it is refused.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable

from common.pb.tandem.v1 import discovery_pb2
from discovery.watcher import InstanceEvent, InstanceWatcher

DISCOVERY_WAIT_S = 2.0  # longest wait for a peer's record to reach this worker's watch
RECENTLY_GONE_S = 30.0  # a peer that left this long ago or less is "gone", not "unknown"


class PermissionDenied(Exception):
    """A request asks for something its caller may not have; str(exc) starts with the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def metadata_digest(metadata: bytes) -> bytes:
    """SHA-256 of transfer agent metadata: published in the discovery record
    (Instance.transfer_metadata_sha256) and compared with the metadata a request carries."""
    return hashlib.sha256(metadata).digest()


def transfer_agents(inst: discovery_pb2.Instance) -> dict[str, tuple[bytes, int]]:
    """A worker's transfer agents: name -> (metadata digest, blocks of its pool). One, or on an
    expert-parallel decode worker one per rank (Instance.rank_transfer_agents; rank 0's is the
    record's own). A record without an agent name gives none."""
    out = {a.name: (a.metadata_sha256, a.capacity_blocks) for a in inst.rank_transfer_agents if a.name}
    if inst.transfer_agent_name:
        # rank 0's pool is the first of the advertised blocks (the whole pool without EP ranks)
        rank0 = inst.kv_capacity_blocks - sum(c for _, c in out.values())
        out[inst.transfer_agent_name] = (inst.transfer_metadata_sha256, rank0)
    return out


class PeerDirectory:
    """Records of one component ("decode" or "prefill") of this worker's model.

    Args:
        model: this worker's model name. fingerprint: its weights fingerprint ("" = not compared).
        watcher: a watcher of that component, set here or later (`watcher` attribute; it may
            take `on_change` as its callback); None without --etcd: nothing is found.
    """

    def __init__(self, model: str, fingerprint: str, watcher: InstanceWatcher | None = None) -> None:
        self.watcher = watcher
        self._model = model
        self._fingerprint = fingerprint
        self._gone: dict[str, float] = {}  # address / "agent:" name -> monotonic time its record left discovery

    def on_change(self, event: InstanceEvent) -> None:
        """Feed the watcher's events here: remembers addresses that left (see `recently_gone`)."""
        now = time.monotonic()
        keys = [event.instance.address] + ["agent:" + name for name in transfer_agents(event.instance)]
        for key in keys:
            if event.kind == "removed":
                self._gone[key] = now
            else:
                self._gone.pop(key, None)
        for key in [k for k, t in self._gone.items() if now - t > RECENTLY_GONE_S]:
            del self._gone[key]

    def recently_gone(self, address: str) -> bool:
        """Whether a record with this address left discovery within RECENTLY_GONE_S."""
        t = self._gone.get(address)
        return t is not None and time.monotonic() - t <= RECENTLY_GONE_S

    def recently_gone_agent(self, agent_name: str) -> bool:
        """Whether a record with this transfer agent left discovery within RECENTLY_GONE_S (its
        worker is not new, so there is no record on its way to wait for: refuse at once, and
        the decode worker prefills locally without waiting; an etcd outage that expired its
        lease must not add DISCOVERY_WAIT_S to every request until it registers again)."""
        return self.recently_gone("agent:" + agent_name)

    def _same_model(self, inst: discovery_pb2.Instance) -> bool:
        return inst.model == self._model and (not self._fingerprint or not inst.weights_fingerprint
                                              or inst.weights_fingerprint == self._fingerprint)

    async def find(self, match: Callable[[discovery_pb2.Instance], bool], field: str, what: str,
                   wait_s: float = DISCOVERY_WAIT_S) -> discovery_pb2.Instance:
        """The record `match` picks, waiting up to wait_s seconds for it to appear.

        Raises:
            PermissionDenied: naming `field`, when no record matches (`what` describes the
                value sought), or the only match is another model's.
        """
        if self.watcher is None:
            raise PermissionDenied(field, f"{what} cannot be checked: this worker has no discovery (--etcd)")

        def pick(view: dict[str, discovery_pb2.Instance]) -> discovery_pb2.Instance | None:
            return next((i for i in view.values() if match(i)), None)

        found = pick(self.watcher.instances())
        # no record can arrive while the watch is down (an etcd outage): waiting would only delay;
        # before its first listing it is only starting (a worker serves while it comes): the
        # record may be in it, so that is waited for
        if found is None and wait_s > 0 and (self.watcher.in_sync or not self.watcher.listed):
            try:
                found = pick(await self.watcher.wait_for(lambda v: pick(v) is not None, wait_s))
            except (TimeoutError, asyncio.TimeoutError):
                found = None
        if found is None:
            raise PermissionDenied(field, f"{what} is not in discovery")
        if not self._same_model(found):
            raise PermissionDenied(field, f"{what} serves model {found.model!r} (fingerprint "
                                          f"{found.weights_fingerprint[:12] or '-'}), not this worker's "
                                          f"{self._model!r} ({self._fingerprint[:12] or '-'})")
        return found
