"""router/policy.py KvPolicy scores every candidate with array operations; this is the cost of
its docstring written out per worker in plain Python (the reference twin), compared on random
fleets, loads, overlaps and in-flight prefixes, for both roles and both prefill placements."""

from __future__ import annotations

import random

import pytest

from common.pb.tandem.v1 import discovery_pb2
from router.load import LoadTracker
from router.policy import TRANSFER_WEIGHT, KvPolicy

BS = 16


def reference_costs(role, candidates, overlaps, blocks, load, hashes, weight, prefills_here, request_blocks):
    """[(overlap, load, cost, queued, shared)] per candidate, one worker at a time."""
    decode = role == discovery_pb2.ROLE_DECODE
    output_blocks = load.mean_output_tokens / load.block_size
    b = sum(load.requests(i.instance_id) for i in candidates) / max(1, len(candidates))
    queue_share = 1.0 / (1.0 + b)
    uncached_weight = weight if (prefills_here or not decode) else TRANSFER_WEIGHT
    out = []
    for inst in candidates:
        wid = inst.instance_id
        queued = load.queued_tokens(wid) / load.block_size
        inflight = load.inflight_prefix(wid, hashes)
        overlap = max(overlaps.get(wid, 0), inflight)
        prefill_cost = uncached_weight * (blocks - overlap) + weight * queue_share * queued
        if not decode:
            out.append((overlap, queued, prefill_cost, queued, inflight))
            continue
        active = load.active(wid)
        room = inst.kv_capacity_blocks
        overflow = max(0.0, active + blocks - inflight + output_blocks - room) if room > 0 else 0.0
        cost = prefill_cost + active + request_blocks * load.requests(wid) + (blocks - inflight) + weight * overflow
        out.append((overlap, active, cost, queued, inflight))
    return out, queue_share


@pytest.mark.parametrize("seed", range(8))
def test_array_costs_equal_the_per_worker_formula(seed):
    rng = random.Random(seed)
    role = rng.choice([discovery_pb2.ROLE_DECODE, discovery_pb2.ROLE_PREFILL])
    n = rng.randrange(1, 150)
    candidates = [discovery_pb2.Instance(instance_id=f"w{i:03d}", address=f"127.0.0.1:{1000 + i}", role=role,
                                         kv_capacity_blocks=rng.choice([0, 40, 400])) for i in range(n)]
    load = LoadTracker(BS)
    prompt = [rng.randrange(1 << 60) for _ in range(12)]
    for _ in range(rng.randrange(300)):
        w = rng.choice(candidates).instance_id
        r = load.start(w, None, BS * 12, rng.randrange(300), prompt[: rng.randrange(13)],
                       local_prefill=rng.random() < 0.5)
        if rng.random() < 0.3:
            load.prefill_finished(r)
        if rng.random() < 0.2:
            load.finish(r)
    for inst in rng.sample(candidates, n // 3):
        load.report(inst.instance_id, rng.randrange(9), rng.randrange(90), rng.randrange(900))
    load.request_finished(rng.randrange(1, 800))
    overlaps = {i.instance_id: rng.randrange(13) for i in rng.sample(candidates, n // 2)}
    overlaps["not-a-candidate"] = 5
    weight, request_blocks, prefills_here = rng.uniform(1, 64), rng.uniform(0, 20), rng.random() < 0.5
    policy = KvPolicy()
    for hashes in (prompt, prompt[:3], []):
        got = policy.score(role, candidates, overlaps, 12, load, hashes, weight, prefills_here, request_blocks)
        want, share = reference_costs(role, candidates, overlaps, 12, load, hashes, weight, prefills_here,
                                      request_blocks)
        assert policy.queue_share == pytest.approx(share, rel=1e-12)
        rows = [x for row in zip(got.overlap, got.load, got.cost, got.queued, got.shared) for x in row]
        assert rows == pytest.approx([x for row in want for x in row], rel=1e-12, abs=1e-9)
        chosen = policy.pick(got)
        assert chosen.cost == min(c for _, _, c, _, _ in want)
