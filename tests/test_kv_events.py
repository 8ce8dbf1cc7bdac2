from engine.block_pool import BlockPool, Stored
from engine.kv_events import KvEventLog


def test_ring_ids_snapshot_and_gaps():
    pool = BlockPool(8)
    log = KvEventLog(pool, capacity=2)
    assert log.since(0) == [] and log.snapshot().event_id == 0
    b = pool.allocate(1)
    pool.cache(b, [11], None)
    log.publish()
    log.publish()  # nothing pending: no batch
    assert log.last_event_id == 1 and [x.event_id for x in log.since(0)] == [1]
    for h in (12, 13):
        pool.cache(pool.allocate(1), [h], 11)
        log.publish()
    assert log.last_event_id == 3
    assert log.since(0) is None  # batch 1 left the ring: the subscriber needs a snapshot
    assert [x.event_id for x in log.since(1)] == [2, 3]
    assert log.since(7) is None  # ids from an earlier incarnation
    snap = log.snapshot()
    assert snap.snapshot and snap.event_id == 3
    assert sorted(h for e in snap.events for h in e.stored.block_hashes) == [11, 12, 13]
    assert log.since(3) == [] and isinstance(log.since(2)[0].events[0], Stored)


def test_incarnation_on_every_batch_and_other_incarnations_need_a_snapshot():
    pool = BlockPool(4)
    log = KvEventLog(pool, incarnation=41)
    assert log.snapshot().incarnation == 41
    assert not log.other_incarnation(0) and not log.other_incarnation(41)  # 0: a subscriber that knows none
    assert log.other_incarnation(40) and log.other_incarnation_subscribers == 1
