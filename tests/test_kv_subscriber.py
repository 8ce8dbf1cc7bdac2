"""The router's handling of one worker's KV event batches: order, gaps, snapshots."""

from __future__ import annotations

from common.pb.tandem.v1 import kv_events_pb2 as pb
from router.kv_index import KvIndex
from router.kv_subscriber import KvEventSubscriber


def stored(event_id, hashes, parent=None, snapshot=False):
    ev = pb.BlockStored(block_hashes=hashes)
    if parent is not None:
        ev.parent_hash = parent
    return pb.KvEventBatch(event_id=event_id, snapshot=snapshot, events=[pb.KvEvent(stored=ev)])


def removed(event_id, hashes):
    return pb.KvEventBatch(event_id=event_id, events=[pb.KvEvent(removed=pb.BlockRemoved(block_hashes=hashes))])


def subscriber():
    index = KvIndex()
    index.add_worker("w")
    return KvEventSubscriber(index, workers=None), index


def test_in_order_batches_apply():
    s, index = subscriber()
    assert s._apply("w", stored(1, [1, 2]))
    assert s._apply("w", stored(2, [3], parent=2))
    assert s._apply("w", removed(3, [3]))
    assert index.overlaps([1, 2, 3]) == {"w": 2}
    assert s.last_event_id["w"] == 3


def test_duplicate_and_old_batches_are_dropped():
    s, index = subscriber()
    s._apply("w", stored(1, [1]))
    s._apply("w", stored(2, [2], parent=1))
    assert s._apply("w", removed(1, [1]))  # a replayed old batch must not remove block 1
    assert s.counters.duplicates == 1 and index.overlaps([1, 2]) == {"w": 2}


def test_gap_forces_snapshot_resync():
    s, index = subscriber()
    s._apply("w", stored(1, [1]))
    assert not s._apply("w", stored(3, [9]))  # event 2 is missing
    assert s.counters.gaps == 1 and s.last_event_id["w"] == 0  # resubscribe from 0
    assert s._apply("w", stored(3, [1, 2, 9], snapshot=True))
    assert index.overlaps([1, 2]) == {"w": 2} and s.last_event_id["w"] == 3
    assert s._apply("w", stored(4, [5], parent=9))


def test_cleared_removes_everything_for_that_worker():
    s, index = subscriber()
    index.add_worker("other")
    index.apply_stored("other", None, [1])
    s._apply("w", stored(1, [1, 2]))
    s._apply("w", pb.KvEventBatch(event_id=2, events=[pb.KvEvent(cleared=pb.AllBlocksCleared())]))
    assert index.overlaps([1, 2]) == {"other": 1}


def test_unknown_parent_is_applied_and_counted():
    s, index = subscriber()
    s._apply("w", stored(1, [7], parent=12345))
    assert index.overlaps([7]) == {"w": 1} and index.counters.unknown_parent == 1


def test_batch_of_a_new_incarnation_resets_the_worker_and_asks_for_a_snapshot():
    s, index = subscriber()
    first = stored(1, [1, 2])
    first.incarnation = 7
    assert s._apply("w", first) and s.incarnation["w"] == 7
    # The same instance id restarted and issued ids past ours: nothing it says may be merged.
    later = stored(2, [8], parent=None)
    later.incarnation = 9
    assert not s._apply("w", later)
    assert index.overlaps([1, 2]) == {} and s.last_event_id["w"] == 0 and s.incarnation["w"] == 9
    assert s.counters.incarnations == 1
    snap = stored(5, [8], snapshot=True)
    snap.incarnation = 9
    assert s._apply("w", snap) and index.overlaps([8]) == {"w": 1} and s.last_event_id["w"] == 5


def test_snapshot_of_a_new_incarnation_replaces_without_a_second_round_trip():
    s, index = subscriber()
    a = stored(1, [1])
    a.incarnation = 3
    s._apply("w", a)
    snap = stored(1, [4], snapshot=True)
    snap.incarnation = 4
    assert s._apply("w", snap) and index.overlaps([1]) == {} and index.overlaps([4]) == {"w": 1}
    assert s.incarnation["w"] == 4 and s.counters.incarnations == 0
