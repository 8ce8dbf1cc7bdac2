"""FrontendService.ClusterStatus: the router's view of its workers (what `tandem top` shows).

Everything comes from state the router already keeps: discovery (role, address, state, KV
capacity, metrics address; the model's other routers), health probes, its own load accounting, the KV index (kv mode)
and the per-worker routing counts (router/metrics.py RouteCounts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.pb.tandem.v1 import discovery_pb2
from common.pb.tandem.v1 import frontend_pb2 as pb
from router.speculation import speculative_sampling


@dataclass
class ClusterView:
    """The parts of one router that ClusterStatus reads (index is None outside kv mode)."""

    instance_id: str
    mode: str
    servicer: Any  # router.service.FrontendServicer
    workers: Any  # router.workers.WorkerSet
    load: Any  # router.load.LoadTracker
    health: Any  # router.health.HealthTracker
    index: Any = None  # router.kv_index.KvIndex
    metrics_address: str = ""

    def status(self) -> pb.ClusterStatusResponse:
        servicer, load, health, routes = self.servicer, self.load, self.health, self.servicer.metrics.routes
        out = pb.ClusterStatusResponse(router_instance_id=self.instance_id, model=self.workers.model, mode=self.mode,
                                       running_requests=servicer.running, migrations=servicer.migrations,
                                       metrics_address=self.metrics_address,
                                       weights_fingerprint=self.workers.fingerprint)
        for r in self.workers.routers():
            out.routers.append(pb.RouterStatus(instance_id=r.instance_id, address=r.address,
                                               metrics_address=r.metrics_address, start_time_unix=r.start_time_unix))
        for role in (discovery_pb2.ROLE_PREFILL, discovery_pb2.ROLE_DECODE):
            for inst in sorted(self.workers.candidates(role, serving_only=False), key=lambda i: i.instance_id):
                wid = inst.instance_id
                st = health.stats(wid) if health is not None else None
                out.workers.append(pb.WorkerStatus(
                    instance_id=wid, role=discovery_pb2.Role.Name(role).removeprefix("ROLE_").lower(),
                    address=inst.address,
                    state="serving" if inst.state == discovery_pb2.INSTANCE_STATE_SERVING else "draining",
                    healthy=health is None or health.healthy(wid),
                    consecutive_failures=st.consecutive_failures if st else 0,
                    in_flight_requests=max(0, load.in_flight.get(wid, 0)),
                    active_blocks=max(0, load.active_blocks.get(wid, 0)),
                    queued_prefill_tokens=max(0, load.prefill_tokens.get(wid, 0)),
                    kv_capacity_blocks=inst.kv_capacity_blocks,
                    indexed_blocks=self.index.num_blocks(wid) if self.index is not None and wid in self.index else 0,
                    routed_requests=routes.requests.get(wid, 0), hit_rate=routes.hit_rate(wid),
                    metrics_address=inst.metrics_address, weights_fingerprint=inst.weights_fingerprint,
                    speculative_num_steps=inst.speculative_num_steps,
                    speculative_sampling=speculative_sampling(inst) if inst.speculative_num_steps else ()))
            for inst, why in sorted(self.workers.refused(role), key=lambda r: r[0].instance_id):
                out.workers.append(pb.WorkerStatus(
                    instance_id=inst.instance_id, role=discovery_pb2.Role.Name(role).removeprefix("ROLE_").lower(),
                    address=inst.address, state="refused", healthy=False, kv_capacity_blocks=inst.kv_capacity_blocks,
                    metrics_address=inst.metrics_address, weights_fingerprint=inst.weights_fingerprint, refused=why))
        return out

    async def __call__(self, request: pb.ClusterStatusRequest, context: Any) -> pb.ClusterStatusResponse:
        return self.status()
