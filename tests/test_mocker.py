"""The mocker: its KV accounting against a real decode worker's block pool, its timing model,
and deterministic offline replay (bench/sim.py) of the shipped Mooncake slice."""

from __future__ import annotations

import grpc
import pytest

from common.block_hash import hash_seed
from common.pb.tandem.v1 import decode_pb2, decode_pb2_grpc, sampling_pb2
from engine.block_pool import Removed, Stored
from mocker.engine import Kind, MockEngine, RequestTooLarge, SimRequest, State
from mocker.timing import TimingModel


def doc(n, salt):
    return [(salt * 7919 + i * 31) % 150000 for i in range(n)]


# Three documents, prefixes of each, repeats and fresh prompts: with 40 blocks of 4 tokens the
# pool must evict, and later requests hit what is left.
SEQUENCE = [(doc(30, 1), 3), (doc(30, 1) + doc(9, 2), 4), (doc(45, 3), 2), (doc(22, 1), 5), (doc(61, 4), 3),
            (doc(30, 1) + doc(9, 2) + doc(5, 5), 2), (doc(45, 3)[:40], 6), (doc(16, 6), 1), (doc(61, 4), 3),
            (doc(30, 1), 2), (doc(80, 7), 2), (doc(45, 3), 3)]


def flatten(batches):
    out = []
    for batch in batches:
        for ev in batch.events:
            if isinstance(ev, Stored):
                out.append(("stored", ev.parent, ev.hashes))
            elif isinstance(ev, Removed):
                out.extend(("removed", h) for h in ev.hashes)
            else:
                out.append(("cleared",))
    return out


def run_mock(num_blocks, block_size, seed):
    engine = MockEngine(num_blocks, block_size, seed, TimingModel(), chunk_size=16)
    hits = []
    for i, (tokens, max_tokens) in enumerate(SEQUENCE):
        req = SimRequest(f"r{i}", tokens, max_tokens, Kind.LOCAL)
        engine.submit(req)
        while req.state is not State.DONE:
            assert engine.has_work()
            engine.step()
        hits.append(req.cached_tokens)
    return hits, flatten(engine.events.since(0) or []), engine


@pytest.fixture(scope="module")
def real_decode(etcd_server, tiny_model, one_torch_thread):
    from worker.host import WorkerOptions
    from harness import InProcessCluster

    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="mocker-acct",
                         worker_opts=WorkerOptions(num_blocks=40, block_size=4, chunk_size=16))
    h = c.start("decode")
    yield c, h
    c.close()


def test_kv_accounting_matches_the_real_decode_worker(real_decode, tiny_model):
    cluster, h = real_decode
    hits = []
    with grpc.insecure_channel(h.address) as ch:
        stub = decode_pb2_grpc.DecodeServiceStub(ch)
        for i, (tokens, max_tokens) in enumerate(SEQUENCE):
            msgs = list(stub.Generate(decode_pb2.DecodeRequest(
                request_id=f"r{i}", token_ids=tokens,
                sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)), timeout=60))
            assert sum(len(m.token_ids) for m in msgs) == max_tokens
            hits.append(msgs[0].cached_tokens)
    real_events = cluster.on_loop(lambda: flatten(h.runtime.events.since(0) or []))
    real_free = cluster.on_loop(lambda: (h.runtime.pool.blocks.num_free, h.runtime.pool.blocks.num_cached))

    mock_hits, mock_events, engine = run_mock(40, 4, hash_seed(tiny_model.name, weights=tiny_model.fingerprint))
    assert hits == mock_hits
    assert any(hits) and any(e[0] == "removed" for e in real_events)  # the sequence does hit and evict
    assert real_events == mock_events
    assert real_free == (engine.pool.blocks.num_free, engine.pool.blocks.num_cached)


def test_admission_waits_for_blocks_and_refuses_what_never_fits():
    engine = MockEngine(num_blocks=10, block_size=4, hash_seed=1, timing=TimingModel())
    with pytest.raises(RequestTooLarge):
        engine.submit(SimRequest("big", doc(40, 1), 1))  # 40 + 1 tokens need 11 blocks
    a, b = SimRequest("a", doc(20, 2), 8), SimRequest("b", doc(12, 3), 4)
    engine.submit(a)
    engine.submit(b)  # a reserves 7 of 10 blocks; b needs 4: it waits
    engine.step()
    assert a.state is State.RUNNING and b.state is State.WAITING
    while a.state is not State.DONE:
        engine.step()
    assert engine.has_work() and b.state is State.PREFILL
    while b.state is not State.DONE:
        engine.step()
    assert engine.pool.blocks.num_free == 10  # nothing leaks


def test_timing_model_terms_and_fit():
    t = TimingModel(speedup=10)
    # attention makes the same 1,000 tokens slower after a long prefix
    assert t.prefill_s(64_000, 1000) > t.prefill_s(0, 1000) > 0
    assert t.decode_s(32, 32 * 4096) > t.decode_s(1, 4096) > 0
    samples = [(p, c, TimingModel(prefill_per_token=2e-5, prefill_attention=3e-9, prefill_overhead=1e-3)
                .prefill_s(p, c)) for p in (0, 1000, 8000) for c in (256, 1024, 4096)]
    fit = t.fit_prefill(samples)
    assert fit.prefill_per_token == pytest.approx(2e-5, rel=1e-6)
    assert fit.prefill_attention == pytest.approx(3e-9, rel=1e-6)
    assert fit.speedup == 10


def test_fused_decode_steps_equal_single_steps():
    """The offline replay's fused decode steps give the same tokens, time and blocks."""
    def run(horizon):
        e = MockEngine(num_blocks=64, block_size=4, hash_seed=1, timing=TimingModel())
        reqs = [SimRequest(str(i), doc(10 + 3 * i, i), 9 + 4 * i) for i in range(3)]
        for r in reqs:
            e.submit(r)
        while e.has_work():
            e.step(horizon)
        return [(r.first_token_at, r.finished_at) for r in reqs], e.pool.blocks.num_cached

    single, fused = run(None), run(float("inf"))
    assert fused[1] == single[1]
    for (f1, e1), (f2, e2) in zip(single[0], fused[0]):
        assert f1 == pytest.approx(f2) and e1 == pytest.approx(e2)


def test_offline_replay_is_deterministic():
    from bench import traces
    from bench.sim import SimConfig, replay

    reqs = traces.load_mooncake(traces.DEFAULT_TRACE, 151646, limit=500)
    for mode in ("kv", "random"):
        cfg = SimConfig(mode=mode, num_workers=8, num_blocks=512, seed=7)
        a, b = replay(reqs, cfg), replay(reqs, cfg)
        assert a.decisions == b.decisions
        assert [r.ttft_s for r in a.results] == [r.ttft_s for r in b.results]
        assert len(set(a.decisions)) == 8
    other = replay(reqs, SimConfig(mode="random", num_workers=8, num_blocks=512, seed=8))
    assert other.decisions != a.decisions  # the seed is what fixes them


def test_offline_replay_with_router_replicas():
    from bench import traces
    from bench.sim import SimConfig, replay

    reqs = traces.load_mooncake(traces.DEFAULT_TRACE, 151646, limit=300)
    one = replay(reqs, SimConfig(mode="kv", num_workers=8, num_blocks=512))
    two = replay(reqs, SimConfig(mode="kv", num_workers=8, num_blocks=512, replicas=2))
    assert all(not r.error and r.completion_tokens == q.output_len for r, q in zip(two.results, reqs))
    assert two.decisions != one.decisions  # each replica balances only the load it placed
    assert sum(r.cached_tokens for r in two.results) > 0
    with pytest.raises(ValueError, match="replicas"):
        replay(reqs, SimConfig(mode="approx", replicas=2))


def test_kv_recent_counts_a_routed_prefix_until_its_events_arrive():
    from router.approx_index import KvWithRecent
    from router.kv_index import KvIndex

    now = [0.0]
    index = KvIndex()
    for w in ("a", "b"):
        index.add_worker(w)
    index.apply_stored("b", None, [1, 2])
    kv = KvWithRecent(index, recent_s=10.0, clock=lambda: now[0])
    kv.record("a", [1, 2, 3])  # routed to a; its prefill has not stored anything yet
    assert kv.overlaps([1, 2, 3, 4]) == {"a": 3, "b": 2}
    now[0] = 11.0
    assert kv.overlaps([1, 2, 3, 4]) == {"b": 2}  # only what the events say, after recent_s
