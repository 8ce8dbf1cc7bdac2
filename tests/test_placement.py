"""Placement and policies as units: a fixed worker view, a real KvIndex, real LoadTracker."""

from __future__ import annotations

import pytest

from common.block_hash import block_hashes, hash_seed
from common.pb.tandem.v1 import discovery_pb2
from router.kv_index import KvIndex
from router.load import LoadTracker
from router.placement import NoWorker, Placement, PlacementOptions
from router.policy import make_policy
from router.workers import WorkerSet

BS = 16
SEED = hash_seed("tandem-tiny")


class FixedView:
    """Stands in for the discovery watcher (unit test of Placement alone)."""

    def __init__(self, instances):
        self._instances = {i.instance_id: i for i in instances}

    def instances(self):
        return dict(self._instances)


def inst(iid, role, **kw):
    fields = dict(instance_id=iid, role=role, address=f"{iid}:1", model="tandem-tiny", block_size=BS,
                  hash_seed=SEED, state=discovery_pb2.INSTANCE_STATE_SERVING)
    fields.update(kw)
    return discovery_pb2.Instance(**fields)


def placement(n_prefill=2, n_decode=2, mode="kv", extra=(), **opts):
    view = FixedView([inst(f"p{i}", discovery_pb2.ROLE_PREFILL) for i in range(n_prefill)]
                     + [inst(f"d{i}", discovery_pb2.ROLE_DECODE) for i in range(n_decode)] + list(extra))
    workers = WorkerSet(view, "tandem-tiny", BS, SEED)
    index = KvIndex()
    return Placement(workers, LoadTracker(BS), index, PlacementOptions(mode=mode, **opts)), index


def doc(n, salt=0):
    return [(salt * 7919 + i * 31) % 150000 for i in range(n)]


def test_repeated_prefix_goes_to_the_worker_holding_it():
    p, index = placement()
    prompt = doc(2048, salt=1)
    index.apply_stored("p1", None, block_hashes(prompt, BS, SEED))
    decision, _ = p.route(prompt + [5, 6, 7])
    assert decision.prefill.instance_id == "p1" and decision.prefill.overlap_blocks == 128


def test_overloaded_holder_loses_past_the_cost_balance():
    p, index = placement()
    prompt = doc(320, salt=2)  # 20 blocks
    index.apply_stored("p1", None, block_hashes(prompt, BS, SEED))
    p.load.add("p1", tokens=19 * BS)  # queued work just under the 20-block saving
    assert p.route(prompt)[0].prefill.instance_id == "p1"
    p.load.add("p1", tokens=2 * BS)  # now past it (21 blocks)
    assert p.route(prompt)[0].prefill.instance_id == "p0"


def test_idle_fleet_spreads_new_prefixes():
    p, _ = placement(n_prefill=4, n_decode=4)
    chosen_p, chosen_d = set(), set()
    for salt in range(8):
        d, _ = p.route(doc(64, salt=100 + salt))
        load = p.load.start(d.decode.instance_id, d.prefill.instance_id, 64, 64)
        chosen_p.add(d.prefill.instance_id)
        chosen_d.add(d.decode.instance_id)
        assert load.decode_blocks == 4
    assert len(chosen_p) == 4 and len(chosen_d) == 4


def test_costs_follow_the_formula():
    p, index = placement(n_prefill=1, n_decode=1, prefill_weight=2.0)
    prompt = doc(160, salt=3)  # 10 blocks
    index.apply_stored("d0", None, block_hashes(prompt, BS, SEED)[:4])
    p.load.add("d0", blocks=7)
    d, _ = p.route(prompt)
    # decode (a prefill worker computes the prompt): its uncached blocks are transferred into it,
    # at one active block each, + active + the blocks it adds; prefill: W × uncached (nothing queued)
    assert d.decode.overlap_blocks == 4 and d.decode.cost == 1.0 * (10 - 4) + 7 + 10
    assert d.prefill.cost == 2.0 * 10 and "d0" in d.explain() and d.prefill_weight == 2.0
    alone, index = placement(n_prefill=0, n_decode=1, prefill_weight=2.0)  # the decode worker computes them
    index.apply_stored("d0", None, block_hashes(prompt, BS, SEED)[:4])
    alone.load.add("d0", blocks=7)
    assert alone.route(prompt)[0].decode.cost == 2.0 * (10 - 4) + 7 + 10


def test_conditional_disaggregation_and_no_prefill_worker():
    p, index = placement(local_prefill_threshold=100)
    prompt = doc(160, salt=4)
    index.apply_stored("d1", None, block_hashes(prompt, BS, SEED)[:5])  # 80 tokens cached on d1
    d, _ = p.route(prompt)
    assert d.decode.instance_id == "d1" and d.prefill is None and "threshold" in d.local_prefill_reason
    p2, _ = placement(n_prefill=0)
    d2, _ = p2.route(prompt)
    assert d2.prefill is None and d2.local_prefill_reason == "no prefill worker"


def test_no_decode_worker_raises():
    p, _ = placement(n_decode=0)
    with pytest.raises(NoWorker):
        p.route(doc(10))


def test_incompatible_workers_are_refused_not_scored(caplog):
    odd = [inst("p-bs", discovery_pb2.ROLE_PREFILL, block_size=32),
           inst("p-salt", discovery_pb2.ROLE_PREFILL, hash_seed=SEED + 1)]
    p, _ = placement(n_prefill=0, extra=odd)
    with caplog.at_level("WARNING"):
        d, _ = p.route(doc(40))
    assert d.prefill is None and {c.instance_id for c in d.candidates} == {"d0", "d1"}
    assert "refusing worker p-bs" in caplog.text and "refusing worker p-salt" in caplog.text
    p.route(doc(40))
    assert p.workers.refused_workers == 2  # counted once per worker


@pytest.mark.parametrize("mode", ["round-robin", "random", "least-loaded", "approx"])
def test_other_modes_route(mode):
    p, _ = placement(mode=mode)
    seen = {p.route(doc(40, salt=s))[0].decode.instance_id for s in range(20)}
    assert seen <= {"d0", "d1"} and (len(seen) == 2 or mode == "random")


def test_temperature_samples_by_cost():
    pol = make_policy("kv", temperature=1.0)
    from router.decision import Candidate, Scores
    cands = [Candidate("a", "", "decode", 0, 0, 0.0), Candidate("b", "", "decode", 0, 0, 10.0)]
    picks = [pol.pick(Scores.of("decode", cands)).instance_id for _ in range(400)]
    assert picks.count("a") > picks.count("b") > 0
    with pytest.raises(ValueError, match="--router-mode"):
        make_policy("fastest")


def test_shared_prompt_blocks_count_once_and_release_exactly():
    load = LoadTracker(BS)
    a = block_hashes(doc(64, salt=5), BS, SEED)  # 4 full blocks
    b = a[:3] + block_hashes(doc(64, salt=6), BS, SEED)[3:]  # not chained to a's 3rd: only a[:3] shared
    la = load.start("d0", None, 64 + 5, 0, a)  # 4 full blocks + a partial one
    assert load.active_blocks["d0"] == 5
    lb = load.start("d0", None, 64, 0, b)
    assert load.active_blocks["d0"] == 5 + 1  # b adds its 4th block only
    assert load.inflight_prefix("d0", a) == 4 and load.inflight_prefix("d0", b) == 4
    assert load.inflight_prefix("d1", a) == 0
    load.grow(la, 0, BS)  # a generated block of its own
    assert load.active_blocks["d0"] == 7
    load.finish(la)
    assert load.active_blocks["d0"] == 4 and load.inflight_prefix("d0", a) == 3
    load.finish(lb)
    load.finish(lb)  # a second release changes nothing
    assert load.active_blocks["d0"] == 0 and load.in_flight["d0"] == 0 and load.inflight_prefix("d0", b) == 0


def test_prefix_in_flight_but_not_stored_draws_the_next_request():
    p, _ = placement(n_prefill=0, n_decode=2, prefill_weight=8.0)
    prompt = doc(2048, salt=7)  # 128 blocks, stored nowhere yet
    first, hashes = p.route(prompt)
    load = p.load.start(first.decode.instance_id, None, len(prompt), len(prompt), hashes, local_prefill=True)
    p.load.prefill_finished(load)  # prefilled and decoding; its KV events have not reached the index
    second, _ = p.route(prompt + [9, 9])
    assert second.decode.instance_id == first.decode.instance_id
    chosen = next(c for c in second.candidates if c.instance_id == first.decode.instance_id)
    assert chosen.overlap_blocks == 128 and chosen.shared_blocks == 128 and chosen.queued_blocks == 0


def test_local_prefill_queue_counts_on_the_decode_worker():
    p, _ = placement(n_prefill=0, n_decode=2, prefill_weight=4.0)
    load = p.load.start("d0", None, 40 * BS, 40 * BS, (), local_prefill=True)
    assert p.load.prefill_tokens["d0"] == 40 * BS and p.load.in_flight["d0"] == 1
    d, _ = p.route(doc(64, salt=8))
    assert d.decode.instance_id == "d1"  # d0's 40 queued blocks weigh W / (1 + 0.5) each
    queued = next(c for c in d.candidates if c.instance_id == "d0")
    r = d.request_blocks  # one request, in active blocks (router/cost_weight.py)
    assert r == pytest.approx(1e-4 / (BS * 9e-9))
    assert queued.queued_blocks == 40 and queued.cost == pytest.approx(4.0 * (4 + 40 / 1.5) + 40 + r * 1 + 4)
    p.load.prefill_finished(load)
    assert p.load.prefill_tokens["d0"] == 0 and p.load.in_flight["d0"] == 1
    p.load.finish(load)
    assert p.load.in_flight["d0"] == 0 and p.load.active_blocks["d0"] == 0


def test_default_weight_comes_from_announced_timings_and_output_length():
    from router import cost_weight

    timed = [inst(f"d{i}", discovery_pb2.ROLE_DECODE, prefill_seconds_per_token=4e-5,
                  decode_seconds_per_kv_token=1e-8) for i in range(2)]
    p, _ = placement(n_prefill=0, n_decode=0, extra=timed)
    d, _ = p.route(doc(64))
    assert d.prefill_weight == pytest.approx(4e-5 / (1e-8 * 256))  # the output-length prior
    for n in range(400):  # requests of 50 output tokens finish: the mean moves toward 50
        load = p.load.start("d0", None, 16, 0)
        p.load.grow(load, 0, 50)
        p.load.finish(load)
        p.load.request_finished(50)
    assert 50 <= p.load.mean_output_tokens < 52
    cancelled = p.load.start("d0", None, 16, 0)
    p.load.grow(cancelled, 0, 3000)
    p.load.finish(cancelled)  # released without a finish reason: not a sample
    assert 50 <= p.load.mean_output_tokens < 52
    assert p.route(doc(64))[0].prefill_weight == pytest.approx(4e-5 / (1e-8 * p.load.mean_output_tokens))
    unannounced, _ = placement(n_prefill=0)
    assert unannounced.route(doc(64))[0].prefill_weight == pytest.approx(
        cost_weight.DEFAULT_PREFILL_S_PER_TOKEN / (cost_weight.DEFAULT_DECODE_S_PER_KV_TOKEN * 256))
    assert cost_weight.prefill_weight(1.0, 1.0, 1e9) == cost_weight.MIN_WEIGHT
    assert cost_weight.prefill_weight(1.0, 1e-12, 1.0) == cost_weight.MAX_WEIGHT
    fixed, _ = placement(n_prefill=0, n_decode=0, extra=timed, prefill_weight=3.0)
    assert fixed.route(doc(64))[0].prefill_weight == 3.0


def test_reported_load_plus_what_this_router_placed_since():
    load = LoadTracker(BS)
    assert load.requests("d0") == 0 and load.active("d0") == 0 and load.queued_tokens("d0") == 0
    mine = load.start("d0", None, 4 * BS, 4 * BS, (), local_prefill=True)
    assert (load.requests("d0"), load.active("d0"), load.queued_tokens("d0")) == (1, 4, 4 * BS)  # own counts
    load.report("d0", 3, 40, 100)  # the worker: 3 requests (mine and two of another router), 40 blocks
    assert (load.requests("d0"), load.active("d0"), load.queued_tokens("d0")) == (3, 40, 100)
    load.start("d0", None, 2 * BS, BS, (), local_prefill=True)  # placed after the report: added to it
    assert (load.requests("d0"), load.active("d0"), load.queued_tokens("d0")) == (4, 42, 100 + BS)
    load.prefill_finished(mine)  # the report counted its queued tokens: they leave at once
    assert load.queued_tokens("d0") == 100 - 4 * BS + BS
    load.finish(mine)  # so does a finish: a worker that just served this router's request is not busy
    assert (load.requests("d0"), load.active("d0")) == (3, 38)
    load.report("d0", 1, 2, 0)  # it says nothing queued: this router's own queued request is the floor
    assert (load.requests("d0"), load.active("d0"), load.queued_tokens("d0")) == (1, 2, BS)
    load.forget("d0")  # stopped reporting: own counts again
    assert (load.requests("d0"), load.active("d0"), load.queued_tokens("d0")) == (1, 2, BS)
    fresh = LoadTracker(BS)
    early = fresh.start("d0", None, BS, 0)
    fresh.report("d0", 0, 0, 0)  # built before the request reached the worker
    assert fresh.requests("d0") == 1  # not hidden: this router's own count is the floor
    fresh.finish(early)
    assert fresh.requests("d0") == 0 and fresh.active("d0") == 0  # and never below zero


def test_disaggregated_requests_sharing_a_prefix_spread_over_decode_workers():
    p, index = placement(n_prefill=1, n_decode=3)  # the derived weight (about 22)
    prompt = doc(320, salt=9)  # 20 blocks
    index.apply_stored("d0", None, block_hashes(prompt, BS, SEED)[:10])
    placed = []
    for i in range(30):
        d, hashes = p.route(prompt + [i, i + 1])
        p.load.start(d.decode.instance_id, d.prefill.instance_id, len(prompt) + 2, len(prompt) + 2, hashes)
        placed.append(d.decode.instance_id)
    assert min(placed.count(w) for w in ("d0", "d1", "d2")) >= 5, placed


def test_prefill_worker_counts_prompts_it_is_prefilling_and_threshold_uses_held_blocks():
    p, _ = placement(n_prefill=2, n_decode=2, prefill_weight=4.0, local_prefill_threshold=BS * 4)
    prompt = doc(1024, salt=10)  # 64 blocks, stored nowhere
    first, hashes = p.route(prompt)
    load = p.load.start(first.decode.instance_id, first.prefill.instance_id, 1024, 1024, hashes)
    second, _ = p.route(prompt + [1])
    assert second.prefill is not None, second.local_prefill_reason  # the decode worker holds nothing yet
    assert second.prefill.instance_id == first.prefill.instance_id and second.prefill.overlap_blocks == 64
    p.load.prefill_finished(load)  # prefilled: its refs leave the prefill worker
    assert p.load.inflight_prefix(first.prefill.instance_id, hashes) == 0
    p.load.finish(load)
    assert p.load.in_flight == {} and p.load.active_blocks == {} and p.load.prefill_tokens == {}


def test_derived_weight_ignores_a_minority_of_odd_announcements():
    from router import cost_weight

    good = [inst(f"d{i}", discovery_pb2.ROLE_DECODE, prefill_seconds_per_token=4e-5,
                 decode_seconds_per_kv_token=1e-8) for i in range(2)]
    odd = [inst("dx", discovery_pb2.ROLE_DECODE, prefill_seconds_per_token=0.5, decode_seconds_per_kv_token=1e-8),
           inst("dy", discovery_pb2.ROLE_DECODE, prefill_seconds_per_token=1e-14, decode_seconds_per_kv_token=1e-8)]
    w = cost_weight.derived_weight(good + odd, 256)  # one clipped high, one clipped low: the median holds
    assert w == pytest.approx(4e-5 / (1e-8 * 256))
    tiny = inst("dt", discovery_pb2.ROLE_DECODE, decode_seconds_per_kv_token=1e-320, decode_seconds_per_request=1e308)
    assert cost_weight.request_blocks([tiny], BS) == pytest.approx(1e-4 / (BS * 9e-9))  # not timings: defaults
    p, _ = placement(n_prefill=0, n_decode=0, extra=[tiny, inst("d9", discovery_pb2.ROLE_DECODE)])
    assert p.route(doc(64))[0].decode.instance_id in ("dt", "d9")  # routes, whatever was announced
    nan = inst("dz", discovery_pb2.ROLE_DECODE, prefill_seconds_per_token=float("nan"))
    assert cost_weight.derived_weight([nan], 256) == pytest.approx(
        cost_weight.DEFAULT_PREFILL_S_PER_TOKEN / (cost_weight.DEFAULT_DECODE_S_PER_KV_TOKEN * 256))


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_router_refuses_a_weight_that_is_not_finite(bad):
    from router.main import RouterOptions

    with pytest.raises(ValueError, match="--prefill-weight"):
        RouterOptions(etcd="127.0.0.1:2379", prefill_weight=bad)


def test_a_worker_without_room_loses_by_the_blocks_that_would_wait():
    small = [inst("d0", discovery_pb2.ROLE_DECODE, kv_capacity_blocks=10),
             inst("d1", discovery_pb2.ROLE_DECODE, kv_capacity_blocks=1000)]
    p, index = placement(n_prefill=0, n_decode=0, extra=small, prefill_weight=2.0)
    prompt = doc(160, salt=11)  # 10 blocks, all cached on the small worker
    index.apply_stored("d0", None, block_hashes(prompt, BS, SEED))
    d, _ = p.route(prompt)
    assert d.decode.instance_id == "d1"  # 10 + 16 expected output blocks do not fit d0's 10
    by_id = {c.instance_id: c for c in d.candidates}
    over = 0 + 10 + 256 / BS - 10  # active + the blocks it adds + its expected output - capacity
    assert by_id["d0"].cost == pytest.approx(0 + 10 + 2.0 * over)  # nothing uncached or queued, no request there
