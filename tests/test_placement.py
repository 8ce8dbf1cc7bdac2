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
    p.load.prefill_tokens["p1"] = 19 * BS  # queued work just under the 20-block saving
    assert p.route(prompt)[0].prefill.instance_id == "p1"
    p.load.prefill_tokens["p1"] = 21 * BS  # now past it
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
    p.load.active_blocks["d0"] = 7
    d, _ = p.route(prompt)
    assert d.decode.overlap_blocks == 4 and d.decode.cost == 2.0 * (10 - 4) + 7
    assert d.prefill.cost == 2.0 * 10 and "d0" in d.explain()


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
    from router.decision import Candidate
    cands = [Candidate("a", "", "decode", 0, 0, 0.0), Candidate("b", "", "decode", 0, 0, 10.0)]
    picks = [pol.pick(cands).instance_id for _ in range(400)]
    assert picks.count("a") > picks.count("b") > 0
    with pytest.raises(ValueError, match="--router-mode"):
        make_policy("fastest")
