"""Unit and property tests of router/kv_index.py and router/approx_index.py."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.block_hash import block_hashes, hash_seed
from router.approx_index import ApproxIndex
from router.kv_index import KvIndex, WorkerId

W0, W1, W2 = WorkerId("w0"), WorkerId("w1"), WorkerId("w2")
SEED = hash_seed("test-model")


def chain(doc: int, n: int, block_size: int = 4) -> list[int]:
    """n chained block hashes of a deterministic document `doc`."""
    tokens = [(doc * 7919 + i) % 50_000 for i in range(n * block_size)]
    return block_hashes(tokens, block_size, SEED)


A = chain(1, 12)
B = chain(2, 12)


def brute_overlaps(held: dict[str, set[int]], hashes) -> dict[str, int]:
    out = {}
    for w, blocks in held.items():
        k = 0
        while k < len(hashes) and hashes[k] in blocks:
            k += 1
        if k:
            out[w] = k
    return out


def test_empty_index_and_query():
    idx = KvIndex()
    assert idx.overlaps(A) == {}
    assert idx.overlaps([]) == {}
    idx.apply_stored(W0, None, A)
    assert idx.overlaps([]) == {}
    assert idx.unique_blocks == len(A) and idx.total_entries == len(A)


@pytest.mark.parametrize("k", [1, 2, 5, 11, 12])
def test_partial_prefix(k):
    idx = KvIndex()
    idx.apply_stored(W0, None, A[:k])
    idx.apply_stored(W1, None, A)
    assert idx.overlaps(A) == {W0: k, W1: len(A)}
    assert idx.overlaps(A[:k]) == {W0: k, W1: k}
    assert idx.overlaps(B) == {}
    assert idx.num_blocks(W0) == k
    assert idx.unique_blocks == len(A)
    assert idx.total_entries == len(A) + k


def test_stored_in_several_events_with_parent():
    idx = KvIndex()
    idx.apply_stored(W0, None, A[:4])
    idx.apply_stored(W0, A[3], A[4:8])
    idx.apply_stored(W0, A[7], A[8:])
    assert idx.overlaps(A) == {W0: 12}
    assert idx.counters.unknown_parent == 0
    assert idx.counters.stored_events == 3 and idx.counters.stored_blocks == 12


@pytest.mark.parametrize("gap", [0, 3, 6, 11])
def test_overlap_stops_at_first_miss(gap):
    idx = KvIndex()
    idx.apply_stored(W0, None, A)
    idx.apply_removed(W0, [A[gap]])
    # later blocks are still held, but useless without the missing one
    assert all(idx.holds(W0, h) for h in A[gap + 1:])
    assert idx.overlaps(A) == ({W0: gap} if gap else {})


def test_removal():
    idx = KvIndex()
    idx.apply_stored(W0, None, A)
    idx.apply_stored(W1, None, A[:6])
    assert idx.apply_removed(W0, A[8:]) == 4
    assert idx.overlaps(A) == {W0: 8, W1: 6}
    assert idx.apply_removed(W1, A[:6]) == 6
    assert idx.overlaps(A) == {W0: 8}
    assert idx.unique_blocks == 8 and idx.total_entries == 8
    assert idx.holders(A[0]) == [W0]
    assert idx.holders(A[9]) == []
    assert idx.counters.removed_blocks == 10 and idx.counters.removed_unknown == 0


@pytest.mark.parametrize("unknown", [[123], [A[7]], B[:3], [A[5], A[5]]])
def test_removal_of_unknown_blocks_is_counted_noop(unknown):
    idx = KvIndex()
    idx.apply_stored(W0, None, A[:5])
    idx.apply_stored(W1, None, A)
    before = idx.overlaps(A)
    assert idx.apply_removed(W0, unknown) == 0
    assert idx.counters.removed_unknown == len(unknown)
    assert idx.overlaps(A) == before
    assert idx.total_entries == 5 + 12


def test_unknown_parent_is_counted_but_applied():
    idx = KvIndex()
    idx.apply_stored(W0, A[3], A[4:8])
    assert idx.counters.unknown_parent == 1
    assert idx.num_blocks(W0) == 4
    assert idx.overlaps(A) == {}            # the prefix is missing
    idx.apply_stored(W0, None, A[:4])
    assert idx.overlaps(A) == {W0: 8}
    idx.apply_stored(W1, A[0], A[1:3])      # parent held by W0, not by W1
    assert idx.counters.unknown_parent == 2


@pytest.mark.parametrize("repeat", [2, 3])
def test_duplicate_stored_batches_are_idempotent(repeat):
    idx = KvIndex()
    for _ in range(repeat):
        idx.apply_stored(W0, None, A[:6])
        idx.apply_stored(W1, None, A[:3])
    assert idx.overlaps(A) == {W0: 6, W1: 3}
    assert idx.total_entries == 9 and idx.unique_blocks == 6
    assert idx.counters.stored_blocks == 9
    assert idx.counters.stored_duplicates == 9 * (repeat - 1)
    # one removal takes it out (a block counts once per worker)
    idx.apply_removed(W0, A[:6])
    assert idx.overlaps(A) == {W1: 3}


def test_remove_worker():
    idx = KvIndex()
    idx.apply_stored(W0, None, A)
    idx.apply_stored(W1, None, A[:4])
    idx.apply_stored(W1, None, B)
    assert idx.remove_worker(W1) == 4 + len(B)
    assert W1 not in idx and idx.workers() == [W0]
    assert idx.overlaps(A) == {W0: 12} and idx.overlaps(B) == {}
    assert idx.unique_blocks == 12 and idx.total_entries == 12
    assert idx.num_blocks(W1) == 0
    assert idx.remove_worker(W1) == 0          # unknown: no-op
    assert idx.counters.workers_removed == 1


def test_clear_worker_keeps_worker():
    idx = KvIndex()
    idx.apply_stored(W0, None, A)
    idx.apply_stored(W1, None, A)
    assert idx.clear_worker(W0) == 12
    assert W0 in idx and idx.num_blocks(W0) == 0
    assert idx.overlaps(A) == {W1: 12}
    assert idx.counters.cleared == 1
    idx.apply_stored(W0, None, A[:2])
    assert idx.overlaps(A) == {W0: 2, W1: 12}


@pytest.mark.parametrize("snapshot", [[], A[:3], A + B, B[:5]])
def test_replace_worker_snapshot(snapshot):
    idx = KvIndex()
    idx.apply_stored(W0, None, A[:8])
    idx.apply_stored(W1, None, A[:2])
    idx.replace_worker(W0, snapshot)
    assert idx.blocks(W0) == frozenset(snapshot)
    assert idx.num_blocks(W0) == len(snapshot)
    assert idx.overlaps(A) == brute_overlaps({"w0": set(snapshot), "w1": set(A[:2])}, A)
    assert idx.overlaps(B) == brute_overlaps({"w0": set(snapshot), "w1": set(A[:2])}, B)
    assert idx.unique_blocks == len(set(snapshot) | set(A[:2]))
    assert idx.total_entries == len(snapshot) + 2
    assert idx.counters.snapshots == 1
    idx.replace_worker(W2, A[:1])               # snapshot of a new worker adds it
    assert idx.overlaps(A)[W2] == 1


def test_add_worker_idempotent_and_events_add_implicitly():
    idx = KvIndex()
    idx.add_worker(W0)
    idx.add_worker(W0)
    assert idx.workers() == [W0] and idx.num_blocks(W0) == 0
    idx.apply_removed(W1, [1])
    assert idx.workers() == [W0, W1]
    assert idx.counters.workers_added == 2


@pytest.mark.parametrize("n_workers", [65, 130, 300])
def test_many_workers(n_workers):
    idx = KvIndex()
    ws = [WorkerId(f"w{i}") for i in range(n_workers)]
    for i, w in enumerate(ws):
        idx.apply_stored(w, None, A[: 1 + i % len(A)])
    assert idx.overlaps(A) == {w: 1 + i % len(A) for i, w in enumerate(ws)}
    # remove every other worker, the rest still answer correctly
    for w in ws[::2]:
        idx.remove_worker(w)
    assert idx.overlaps(A) == {w: 1 + i % len(A) for i, w in enumerate(ws) if i % 2}
    assert idx.total_entries == sum(1 + i % len(A) for i in range(n_workers) if i % 2)


@pytest.mark.parametrize("via", ["remove_worker", "remove_then_many"])
def test_bit_reuse_does_not_leak_blocks(via):
    idx = KvIndex()
    idx.apply_stored(W0, None, A)
    idx.apply_stored(W1, None, B)
    idx.remove_worker(W0)
    if via == "remove_then_many":
        for i in range(5):
            idx.add_worker(WorkerId(f"x{i}"))
    idx.add_worker(W2)                       # reuses W0's freed bit (or a later one)
    assert idx.overlaps(A) == {}
    assert idx.num_blocks(W2) == 0
    assert idx.holders(A[0]) == []
    assert idx.overlaps(B) == {W1: 12}
    idx.apply_stored(W2, None, A[:3])
    assert idx.overlaps(A) == {W2: 3}
    # and re-adding the removed worker starts empty
    idx.add_worker(W0)
    assert idx.num_blocks(W0) == 0 and W0 not in idx.overlaps(A)


def test_hashes_from_block_hash_module_share_prefix():
    """Real prompts: two prompts sharing 2 full blocks overlap by exactly 2."""
    p1 = list(range(40))
    p2 = list(range(8)) + [9999] * 32
    h1, h2 = block_hashes(p1, 4, SEED), block_hashes(p2, 4, SEED)
    idx = KvIndex()
    idx.apply_stored(W0, None, h1)
    assert idx.overlaps(h2) == {W0: 2}


# ---------------------------------------------------------------- property test

# event sequences over a small universe: 3 documents x 6 chained blocks, 5 workers
_UNIVERSE = [chain(d, 6) for d in range(3)]
_WORKERS = [f"w{i}" for i in range(5)]

_event = st.one_of(
    st.tuples(st.just("stored"), st.sampled_from(_WORKERS), st.integers(0, 2),
              st.integers(0, 5), st.integers(1, 6)),
    st.tuples(st.just("removed"), st.sampled_from(_WORKERS),
              st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), max_size=6)),
    st.tuples(st.just("clear"), st.sampled_from(_WORKERS)),
    st.tuples(st.just("remove_worker"), st.sampled_from(_WORKERS)),
    st.tuples(st.just("snapshot"), st.sampled_from(_WORKERS),
              st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), max_size=10)),
)
_query = st.tuples(st.integers(0, 2), st.integers(0, 6), st.lists(st.integers(0, 3), max_size=3))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=st.lists(_event, max_size=40), queries=st.lists(_query, min_size=1, max_size=5))
def test_property_matches_brute_force(events, queries):
    idx = KvIndex()
    held: dict[str, set[int]] = {}
    unknown_parent = removed_unknown = 0
    for ev in events:
        kind, w = ev[0], ev[1]
        if kind == "stored":
            _, _, d, start, n = ev
            hashes = _UNIVERSE[d][start:start + n]
            parent = _UNIVERSE[d][start - 1] if start else None
            blocks = held.setdefault(w, set())
            if parent is not None and parent not in blocks:
                unknown_parent += 1
            blocks.update(hashes)
            idx.apply_stored(WorkerId(w), parent, hashes)
        elif kind == "removed":
            hashes = [_UNIVERSE[d][i] for d, i in ev[2]]
            blocks = held.setdefault(w, set())
            for h in hashes:
                if h in blocks:
                    blocks.discard(h)
                else:
                    removed_unknown += 1
            idx.apply_removed(WorkerId(w), hashes)
        elif kind == "clear":
            held[w] = set()
            idx.clear_worker(WorkerId(w))
        elif kind == "remove_worker":
            n = len(held.pop(w, ()))
            assert idx.remove_worker(WorkerId(w)) == n
        else:
            snap = [_UNIVERSE[d][i] for d, i in ev[2]]
            held[w] = set(snap)
            idx.replace_worker(WorkerId(w), snap)
    assert sorted(idx.workers()) == sorted(held)
    for w, blocks in held.items():
        assert idx.num_blocks(WorkerId(w)) == len(blocks)
        assert idx.blocks(WorkerId(w)) == blocks
    assert idx.total_entries == sum(map(len, held.values()))
    assert idx.unique_blocks == len(set().union(*held.values()))
    assert idx.counters.unknown_parent == unknown_parent
    assert idx.counters.removed_unknown == removed_unknown
    for d, n, noise in queries:
        q = _UNIVERSE[d][:n] + [_UNIVERSE[(d + 1) % 3][j] for j in noise]
        assert idx.overlaps(q) == brute_overlaps(held, q)


# ---------------------------------------------------------------- ApproxIndex

def test_approx_record_and_overlap():
    ax = ApproxIndex(ttl_s=10)
    ax.record(W0, A[:5], now=0.0)
    ax.record(W1, A, now=1.0)
    assert ax.overlaps(A, now=2.0) == {W0: 5, W1: 12}
    assert ax.overlaps(B, now=2.0) == {}


@pytest.mark.parametrize("now,expected", [(9.99, {W0: 5, W1: 12}), (10.0, {W1: 12}),
                                          (10.5, {W1: 12}), (11.0, {}), (1e9, {})])
def test_approx_ttl_expiry(now, expected):
    ax = ApproxIndex(ttl_s=10)
    ax.record(W0, A[:5], now=0.0)
    ax.record(W1, A, now=1.0)
    assert ax.overlaps(A, now=now) == expected
    assert ax.index.total_entries == sum(expected.values())


def test_approx_refresh_extends_ttl():
    ax = ApproxIndex(ttl_s=10)
    ax.record(W0, A[:8], now=0.0)
    ax.record(W0, A[:3], now=5.0)           # a later request reuses the first 3 blocks
    assert ax.overlaps(A, now=12.0) == {W0: 3}
    assert ax.num_blocks(W0) == 3
    assert ax.expired_blocks == 5
    assert ax.overlaps(A, now=15.0) == {}
    assert ax.expired_blocks == 8


@pytest.mark.parametrize("cap", [1, 4, 12, 20])
def test_approx_size_bound_drops_oldest_leaf_first(cap):
    ax = ApproxIndex(ttl_s=100, max_blocks_per_worker=cap)
    ax.record(W0, B, now=0.0)
    ax.record(W0, A, now=1.0)
    assert ax.num_blocks(W0) == min(cap, 24)
    # B (older) goes first, from its last block; then A from its last block: what stays of
    # each is a prefix
    assert ax.overlaps(A, now=2.0).get(W0, 0) == min(cap, 12)
    assert ax.overlaps(B, now=2.0).get(W0, 0) == max(0, cap - 12)
    assert ax.evicted_blocks == max(0, 24 - cap)


def test_approx_size_bound_keeps_recently_refreshed():
    ax = ApproxIndex(ttl_s=100, max_blocks_per_worker=12)
    ax.record(W0, A[:6], now=0.0)
    ax.record(W0, B[:6], now=1.0)
    ax.record(W0, A[:6], now=2.0)           # refresh A: B's blocks are now the oldest
    ax.record(W0, B[6:9], now=3.0)          # 3 over: B[5], B[4], B[3] go
    assert ax.overlaps(A, now=4.0) == {W0: 6}
    assert ax.overlaps(B, now=4.0) == {W0: 3}
    assert ax.num_blocks(W0) == 12
    assert ax.evicted_blocks == 3


def test_approx_remove_worker_and_readd():
    ax = ApproxIndex(ttl_s=10)
    ax.record(W0, A, now=0.0)
    assert ax.remove_worker(W0) == 12
    assert ax.overlaps(A, now=1.0) == {}
    ax.record(W0, A[:2], now=5.0)           # the stale FIFO entry of the first record is harmless
    assert ax.overlaps(A, now=10.5) == {W0: 2}
    assert ax.overlaps(A, now=15.0) == {}


def test_approx_expiry_is_lazy_and_proportional():
    """Each lookup pops only what came due: many live entries cost nothing to skip."""
    ax = ApproxIndex(ttl_s=1000)
    for i in range(200):
        ax.record(WorkerId(f"w{i % 8}"), chain(100 + i, 4), now=float(i))
    assert ax.expire(999.0) == 0
    assert len(ax._due) == 200
    assert ax.expire(1005.0) == 6 * 4       # records at t=0..5
    assert len(ax._due) == 194


@pytest.mark.parametrize("bad", [dict(ttl_s=0), dict(max_blocks_per_worker=0)])
def test_approx_rejects_bad_config(bad):
    with pytest.raises(ValueError):
        ApproxIndex(**bad)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["w0", "w1", "w2", "-w1"]), st.integers(0, 2),
                              st.integers(0, 5), st.integers(1, 6), st.floats(0, 4)), max_size=30),
       cap=st.integers(1, 10))
def test_approx_property(ops, cap):
    """ApproxIndex against a model: entry -> (record seq, position from the leaf, expiry);
    expired entries (expiry <= now) vanish; over the bound the smallest (seq, position) goes."""
    ttl = 5.0
    ax = ApproxIndex(ttl_s=ttl, max_blocks_per_worker=cap)
    model: dict[str, dict[int, tuple[int, int, float]]] = {}
    now = 0.0
    for seq, (w, d, start, n, dt) in enumerate(ops):
        now += dt
        for mm in model.values():
            for h in [h for h, v in mm.items() if v[2] <= now]:
                del mm[h]
        if w.startswith("-"):
            model.pop(w[1:], None)
            ax.remove_worker(WorkerId(w[1:]))
            continue
        hashes = _UNIVERSE[d][start:start + n]
        ax.record(WorkerId(w), hashes, now)
        m = model.setdefault(w, {})
        for rank, h in enumerate(reversed(hashes)):
            m[h] = (seq, rank, now + ttl)
        while len(m) > cap:
            del m[min(m, key=lambda h: m[h][:2])]
        for ww, mm in model.items():
            assert ax.num_blocks(WorkerId(ww)) == len(mm)
        for d2 in range(3):
            live = {ww: set(mm) for ww, mm in model.items()}
            assert ax.overlaps(_UNIVERSE[d2], now) == brute_overlaps(live, _UNIVERSE[d2])
