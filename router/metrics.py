"""The router's Prometheus metrics (docs/observability.md, "Router metrics").

Request-path latencies are client-library histograms (TTFT, inter-token latency, request
duration, decision time) and one counter of finished requests by outcome and status code.
Everything the router already counts (migrations, retries, KV event ingestion, health,
its own load accounting, discovery) is read at scrape time by one collector.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from common.metrics import DECISION_BUCKETS, LATENCY_BUCKETS, FunctionCollector, counter, gauge
from common.pb.tandem.v1 import discovery_pb2
from router.decision import RouteDecision

# SubscriberCounters field -> (metric name without _total, help). One line per counter.
KV_SUBSCRIBER_COUNTERS = {
    "batches": ("tandem_router_kv_event_batches", "KV event batches received from workers"),
    "events": ("tandem_router_kv_events_applied", "KV events (stored, removed, cleared) applied to the index"),
    "snapshots": ("tandem_router_kv_snapshots", "snapshot batches applied (a new subscription or a resync)"),
    "gaps": ("tandem_router_kv_resyncs", "resyncs from a snapshot after a gap in a worker's event ids"),
    "duplicates": ("tandem_router_kv_duplicate_batches", "batches dropped as repeated or out of order"),
    "stream_errors": ("tandem_router_kv_stream_errors", "KV event streams that ended with an error"),
    "incarnations": ("tandem_router_kv_worker_restarts", "known workers seen under a new incarnation (record or "
                     "batch): their blocks were dropped and resubscribed from a snapshot"),
    "moves": ("tandem_router_kv_subscription_moves", "KV event subscriptions moved to a record's new address"),
}


class RouteCounts:
    """Per worker: requests routed to it, and the prompt blocks and cached (overlap) blocks of
    those requests, as the router predicted them; overlap / prompt is its predicted hit rate."""

    def __init__(self) -> None:
        self.requests: defaultdict[str, int] = defaultdict(int)
        self.prompt_blocks: defaultdict[str, int] = defaultdict(int)
        self.overlap_blocks: defaultdict[str, int] = defaultdict(int)

    def record(self, decision: RouteDecision) -> None:
        for c in (decision.decode, decision.prefill):
            if c is not None:
                self.requests[c.instance_id] += 1
                self.prompt_blocks[c.instance_id] += decision.prompt_blocks
                self.overlap_blocks[c.instance_id] += c.overlap_blocks

    def hit_rate(self, instance_id: str) -> float:
        blocks = self.prompt_blocks.get(instance_id, 0)
        return self.overlap_blocks.get(instance_id, 0) / blocks if blocks else 0.0


class RouterMetrics:
    """Owns the router's registry. `bind(...)` attaches the state the collector reads."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("tandem_router_ttft_seconds", "time to first token: request arrival to the first "
                              "token sent to the client", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tandem_router_inter_token_latency_seconds", "time between consecutive tokens sent to "
                             "the client (a response of k tokens after a gap g counts k times g/k)",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.duration = Histogram("tandem_router_request_duration_seconds", "request arrival to its last response",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.decision = Histogram("tandem_router_decision_seconds", "routing decision time: block hashing, KV "
                                  "index lookup and scoring", buckets=DECISION_BUCKETS, registry=r)
        self.requests = Counter("tandem_router_requests", "finished Generate requests by outcome (length, stop, eos, "
                                "error, cancelled) and gRPC status code", ["outcome", "code"], registry=r)
        self.routes = RouteCounts()
        self._state: dict[str, Any] = {}
        self.collector = FunctionCollector(self._collect)  # router/main.py sets its loop
        r.register(self.collector)

    def bind(self, servicer: Any, workers: Any, load: Any, health: Any, subscriber: Any, index: Any) -> None:
        """The router's parts the collector reads (subscriber and index may be None: not kv mode)."""
        self._state = dict(servicer=servicer, workers=workers, load=load, health=health, subscriber=subscriber,
                           index=index)

    def observe_decision(self, decision: RouteDecision) -> None:
        self.decision.observe(decision.seconds)
        self.routes.record(decision)

    def request_timer(self) -> RequestTimer:
        return RequestTimer(self)

    # -- scrape-time collection ------------------------------------------------------------------

    def _collect(self) -> Iterator[Any]:
        s = self._state
        if not s:
            return
        servicer = s["servicer"]
        yield gauge("tandem_router_running_requests", "Generate requests in progress", servicer.running)
        yield counter("tandem_router_migrations", "requests continued on another decode worker mid-stream",
                      servicer.migrations)
        yield counter("tandem_router_retries", "decode calls retried on another worker before any token",
                      servicer.retries)
        sub = s["subscriber"]
        if sub is not None:
            for field, (name, doc) in KV_SUBSCRIBER_COUNTERS.items():
                if hasattr(sub.counters, field):
                    yield counter(name, doc, getattr(sub.counters, field))
        yield from self._workers(s)

    def _workers(self, s: dict[str, Any]) -> Iterator[Any]:
        workers, load, health, index = s["workers"], s["load"], s["health"], s["index"]
        insts = [i for role in (discovery_pb2.ROLE_PREFILL, discovery_pb2.ROLE_DECODE)
                 for i in workers.candidates(role, serving_only=False)]
        labels = ["instance_id", "role"]
        fams = {
            "healthy": GaugeMetricFamily("tandem_router_worker_healthy", "1 when the router's health probes find the "
                                         "worker healthy, else 0", labels=labels),
            "serving": GaugeMetricFamily("tandem_router_worker_serving", "1 when the worker's discovery record says "
                                         "SERVING, 0 when DRAINING", labels=labels),
            "in_flight": GaugeMetricFamily("tandem_router_worker_in_flight_requests", "requests this router has in "
                                           "flight on the worker", labels=labels),
            "active": GaugeMetricFamily("tandem_router_worker_active_blocks", "decode: KV blocks of this router's "
                                        "requests on the worker (a block shared by several counted once)",
                                        labels=labels),
            "queued": GaugeMetricFamily("tandem_router_worker_queued_prefill_tokens", "uncached prompt tokens this "
                                        "router sent the worker to prefill (a prefill worker, or a decode worker "
                                        "prefilling locally) and not yet answered", labels=labels),
            "reported_active": GaugeMetricFamily("tandem_router_worker_reported_active_blocks", "KV blocks the "
                                                 "worker last reported holding (WatchLoad); absent when it reports "
                                                 "none", labels=labels),
            "reported_queued": GaugeMetricFamily("tandem_router_worker_reported_queued_prefill_tokens", "prompt "
                                                 "tokens the worker last reported not yet prefilled", labels=labels),
            "indexed": GaugeMetricFamily("tandem_router_worker_indexed_blocks", "blocks the KV index holds for the "
                                         "worker (kv mode)", labels=labels),
            "capacity": GaugeMetricFamily("tandem_router_worker_kv_capacity_blocks", "KV pool capacity announced "
                                          "in discovery", labels=labels),
            "probe_failures": CounterMetricFamily("tandem_router_worker_probe_failures", "failed health probes",
                                                  labels=labels),
            "transport_failures": CounterMetricFamily("tandem_router_worker_transport_failures", "calls the worker "
                                                      "refused or failed in transport", labels=labels),
            "routed": CounterMetricFamily("tandem_router_worker_routed_requests", "requests routed to the worker",
                                          labels=labels),
            "prompt_blocks": CounterMetricFamily("tandem_router_worker_routed_prompt_blocks", "full prompt blocks of "
                                                 "the requests routed to the worker", labels=labels),
            "overlap_blocks": CounterMetricFamily("tandem_router_worker_routed_cached_blocks", "of those, blocks the "
                                                  "router predicted the worker holds (its overlap)", labels=labels),
        }
        in_flight, active, queued = dict(load.in_flight), dict(load.active_blocks), dict(load.prefill_tokens)
        routes = self.routes
        for inst in insts:
            wid = inst.instance_id
            lv = [wid, discovery_pb2.Role.Name(inst.role).removeprefix("ROLE_").lower()]
            st = health.stats(wid) if health is not None else None
            fams["healthy"].add_metric(lv, 1.0 if health is None or health.healthy(wid) else 0.0)
            fams["serving"].add_metric(lv, 1.0 if inst.state == discovery_pb2.INSTANCE_STATE_SERVING else 0.0)
            fams["in_flight"].add_metric(lv, in_flight.get(wid, 0))
            fams["active"].add_metric(lv, active.get(wid, 0))
            fams["queued"].add_metric(lv, queued.get(wid, 0))
            rep = load.reported.get(wid)
            if rep is not None:
                fams["reported_active"].add_metric(lv, rep[1])
                fams["reported_queued"].add_metric(lv, rep[2])
            if index is not None:
                fams["indexed"].add_metric(lv, index.num_blocks(wid) if wid in index else 0)
            fams["capacity"].add_metric(lv, inst.kv_capacity_blocks)
            fams["probe_failures"].add_metric(lv, st.probe_failures if st else 0)
            fams["transport_failures"].add_metric(lv, st.transport_failures if st else 0)
            fams["routed"].add_metric(lv, routes.requests.get(wid, 0))
            fams["prompt_blocks"].add_metric(lv, routes.prompt_blocks.get(wid, 0))
            fams["overlap_blocks"].add_metric(lv, routes.overlap_blocks.get(wid, 0))
        yield from fams.values()
        yield GaugeMetricFamily("tandem_router_prefill_weight", "kv/approx: the prefill weight W of the last "
                                "decision (--prefill-weight, or derived; docs/routing.md)",
                                value=getattr(getattr(s["servicer"], "placement", None), "last_weight", 0.0))
        yield counter("tandem_router_refused_workers", "workers refused for another model, block size, weights or hash seed",
                      workers.refused_workers)


class RequestTimer:
    """TTFT, inter-token latency and duration of one Generate call (seconds, perf_counter)."""

    __slots__ = ("m", "start", "last")

    def __init__(self, m: RouterMetrics) -> None:
        self.m = m
        self.start = time.perf_counter()
        self.last = 0.0  # time of the last response with tokens; 0 = none yet

    def tokens(self, n: int) -> None:
        """n tokens are being sent to the client now."""
        if n <= 0:
            return
        now = time.perf_counter()
        if not self.last:
            self.m.ttft.observe(now - self.start)
            n -= 1
        if n:
            gap = (now - (self.last or now)) / n
            for _ in range(n):
                self.m.itl.observe(gap)
        self.last = now

    def done(self, outcome: str, code: str) -> None:
        self.m.duration.observe(time.perf_counter() - self.start)
        self.m.requests.labels(outcome, code).inc()
