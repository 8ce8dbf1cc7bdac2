"""Offline trace replay: the router's own placement code over simulated workers, in simulated time.

A discrete-event replay with no gRPC and no sleeping, so it is exact, deterministic for a
seed, and fast enough for 128 workers and thousands of requests on one core. What runs is the
real thing where it matters for routing: router/placement.py `Placement` with the mode's
policy (router/policy.py), `KvIndex` (kv) or `ApproxIndex` (approx) and `LoadTracker`; each
worker a mocker/engine.py `MockEngine` (real block pool, prefix cache, LRU, KV events) with its
timing model. Workers are aggregated (decode workers that prefill locally), like NVIDIA
Dynamo's offline replay.

Order of time: at each arrival (trace time / load), every worker first finishes the engine
iterations that end by then; their KV events reach the index and their tokens and finishes
reach the load tracker as each iteration ends (no event lag). An iteration in progress at an
arrival is not seen yet. Then the request is routed and queued on its worker.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from bench.client import RequestResult
from bench.traces import BenchRequest
from common.block_hash import hash_seed
from common.pb.tandem.v1 import discovery_pb2
from engine.block_pool import Cleared, Removed, Stored
from engine.model_source import MOCK
from mocker.engine import Kind, MockEngine, RequestTooLarge, SimRequest, State
from mocker.timing import TimingModel
from router.approx_index import ApproxIndex, KvWithRecent
from router.kv_index import KvIndex
from router.load import LoadTracker, RequestLoad
from router.placement import NoOverlap, Placement, PlacementOptions


@dataclass(frozen=True)
class SimConfig:
    mode: str = "kv"  # router mode
    num_workers: int = 16
    num_blocks: int = 1024  # per worker
    block_size: int = 512
    chunk_size: int = 8192
    max_running: int = 256
    prefill_weight: float = 0.0  # 0 = derived (router/cost_weight.py)
    approx_ttl_s: float = 120.0
    kv_recent_s: float = 0.0  # kv mode: also count prefixes routed in the last this many seconds
    replicas: int = 1  # kv mode: routers sharing the traffic (request i to replica i % replicas), each with
    # its own load accounting (router/load.py) over one KV index (every replica sees every KV event)
    load_report_s: float = 0.1  # workers report their load (WatchLoad) every this many simulated seconds,
    # seen at the next arrival after it is due (< 0: no reports, each router counts only its own placements)
    seed: int = 0
    timing: TimingModel = TimingModel()


@dataclass
class SimResult:
    config: SimConfig
    results: list[RequestResult]
    decisions: list[str]  # decode worker chosen for each request, in arrival order
    duration_s: float  # simulated seconds from the first arrival to the last finish
    wall_s: float  # real seconds the replay took
    per_worker_requests: dict[str, int] = field(default_factory=dict)
    # real time of each decision (router/placement.py route()): whole, and of it hashing the prompt
    decision_s: list[tuple[float, float]] = field(default_factory=list)


class _Workers:
    """Stands in for router/workers.py WorkerSet: the simulated instances, all SERVING."""

    def __init__(self, instances: list[discovery_pb2.Instance], block_size: int, seed: int) -> None:
        self._instances = instances
        self.block_size = block_size
        self.hash_seed = seed
        self.model = MOCK
        self._by_role: dict[int, list[discovery_pb2.Instance]] = {}

    def candidates(self, role: int, serving_only: bool = True) -> list[discovery_pb2.Instance]:
        # one list object per role, as WorkerSet hands out while nothing changes
        if role not in self._by_role:
            self._by_role[role] = [i for i in self._instances if i.role == role]
        return self._by_role[role]

    def hash_seed_for(self, cache_salt: str) -> int:
        return self.hash_seed  # one simulated tenant

    def instance_ids(self) -> list[str]:
        return [i.instance_id for i in self._instances]


@dataclass
class _Pending:
    end: float
    event_id: int
    changed: list[SimRequest]


@dataclass
class _Track:
    req: BenchRequest
    sim: SimRequest
    load: RequestLoad | None
    result: RequestResult
    tracker: LoadTracker | None = None  # the replica's LoadTracker that counted it
    sent: int = 0


class _Approx:
    def __init__(self, ttl_s: float) -> None:
        self.index = ApproxIndex(ttl_s=ttl_s)
        self.now = 0.0

    def overlaps(self, hashes):
        return self.index.overlaps(hashes, self.now)


def replay(reqs: list[BenchRequest], cfg: SimConfig) -> SimResult:
    """Replay `reqs` (token-id prompts, arrival times in seconds) through cfg.num_workers workers."""
    started = time.perf_counter()
    seed = hash_seed(MOCK)
    instances = [discovery_pb2.Instance(instance_id=f"decode-sim{i:03d}", role=discovery_pb2.ROLE_DECODE,
                                        address=f"sim:{i}", model=MOCK, block_size=cfg.block_size, hash_seed=seed,
                                        kv_capacity_blocks=cfg.num_blocks,
                                        prefill_seconds_per_token=cfg.timing.prefill_per_token,
                                        decode_seconds_per_kv_token=cfg.timing.decode_per_kv_token,
                                        decode_seconds_per_request=cfg.timing.decode_per_request)
                 for i in range(cfg.num_workers)]
    engines = {i.instance_id: MockEngine(cfg.num_blocks, cfg.block_size, seed, cfg.timing, cfg.chunk_size,
                                         cfg.max_running) for i in instances}
    pending: dict[str, _Pending | None] = dict.fromkeys(engines)
    applied: dict[str, int] = dict.fromkeys(engines, 0)
    if cfg.replicas < 1 or (cfg.replicas > 1 and (cfg.mode != "kv" or cfg.kv_recent_s > 0)):
        raise ValueError(f"replicas must be 1, or > 1 in kv mode without kv_recent_s; got {cfg.replicas}")
    loads = [LoadTracker(cfg.block_size) for _ in range(cfg.replicas)]
    index = KvIndex() if cfg.mode == "kv" else None
    approx = _Approx(cfg.approx_ttl_s) if cfg.mode == "approx" else None
    recent, clock = None, 0.0
    if index is not None and cfg.kv_recent_s > 0:
        recent = KvWithRecent(index, cfg.kv_recent_s, clock=lambda: clock)
    if index is not None:
        for wid in engines:
            index.add_worker(wid)
    overlap = next((o for o in (recent, index, approx) if o is not None), NoOverlap())
    placements = [Placement(_Workers(instances, cfg.block_size, seed), load, overlap,
                            PlacementOptions(cfg.mode, cfg.prefill_weight, seed=cfg.seed + k))
                  for k, load in enumerate(loads)]
    tracks: dict[str, _Track] = {}
    decisions: list[str] = []
    decision_s: list[tuple[float, float]] = []

    def deliver(wid: str, p: _Pending) -> None:
        eng = engines[wid]
        if index is not None and p.event_id > applied[wid]:
            for batch in eng.events.since(applied[wid]) or ():
                if batch.event_id > p.event_id:
                    break
                for ev in batch.events:
                    if isinstance(ev, Stored):
                        index.apply_stored(wid, ev.parent, list(ev.hashes))
                    elif isinstance(ev, Removed):
                        index.apply_removed(wid, list(ev.hashes))
                    elif isinstance(ev, Cleared):
                        index.clear_worker(wid)
            applied[wid] = p.event_id
        for sim in p.changed:
            tr = tracks[sim.request_id]
            res = tr.result
            new = sim.generated - tr.sent
            if new > 0:
                if tr.sent == 0:
                    res.ttft_s = p.end - res.start_s
                    tr.tracker.prefill_finished(tr.load)
                res.chunks.append((p.end, new))
                tr.tracker.grow(tr.load, tr.sent, sim.generated)
                tr.sent = sim.generated
            if sim.state is State.DONE:
                res.end_s = p.end
                res.prompt_tokens = len(sim.token_ids)
                res.completion_tokens = sim.generated
                res.cached_tokens = sim.cached_tokens
                tr.tracker.finish(tr.load)
                tr.tracker.request_finished(sim.generated)
                sim.token_ids, sim.prompt = [], None  # a full trace's prompts would not fit in memory

    def advance(wid: str, t: float) -> None:
        eng = engines[wid]
        while True:
            p = pending[wid]
            if p is not None:
                if p.end > t:
                    return
                pending[wid] = None
                deliver(wid, p)
            if not eng.has_work():
                return
            eng.step(horizon=t)
            pending[wid] = _Pending(eng.now, eng.events.last_event_id, eng.take_changed())

    ordered = sorted(reqs, key=lambda r: (r.arrival_s, r.index))
    reported_at = dict.fromkeys(engines, -math.inf)
    for r in ordered:
        t = r.arrival_s
        for wid in engines:
            advance(wid, t)
            if cfg.load_report_s >= 0 and t - reported_at[wid] >= cfg.load_report_s:
                reported_at[wid] = t
                requests, held, queued = engines[wid].load()
                for ld in loads:
                    ld.report(wid, requests, held, queued)
        clock = t
        if approx is not None:
            approx.now = t
        tokens = r.prompt_tokens()
        placement = placements[r.index % cfg.replicas]
        load = placement.load
        decision, hashes = placement.route(tokens)
        decision_s.append((decision.seconds, decision.hash_seconds))
        wid = decision.decode.instance_id
        decisions.append(wid)
        if approx is not None and hashes:
            approx.index.record(wid, hashes, t)
        if recent is not None and hashes:
            recent.record(wid, hashes)
        res = RequestResult(r.index, start_s=t)
        sim = SimRequest(str(r.index), tokens, r.output_len, Kind.LOCAL)
        eng = engines[wid]
        if pending[wid] is None:
            eng.now = max(eng.now, t)  # an idle worker starts when the request arrives
        try:
            eng.submit(sim)
        except RequestTooLarge as exc:
            res.error = f"RESOURCE_EXHAUSTED: {exc}"
            res.end_s = t
            tracks[sim.request_id] = _Track(r, sim, None, res)
            continue
        tracks[sim.request_id] = _Track(r, sim, load.start(wid, None, len(tokens), decision.uncached_tokens(cfg.block_size),
                                                           hashes, local_prefill=True), res, load)
    for wid in engines:
        advance(wid, math.inf)
    results = [tracks[str(r.index)].result for r in reqs]
    first = min((r.arrival_s for r in reqs), default=0.0)
    last = max((res.end_s for res in results), default=first)
    counts: dict[str, int] = {}
    for wid in decisions:
        counts[wid] = counts.get(wid, 0) + 1
    return SimResult(cfg, results, decisions, last - first, time.perf_counter() - started, counts, decision_s)
