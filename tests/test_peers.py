"""PeerDirectory (worker/peers.py): peers that left discovery lately are refused without the
discovery wait, by address (decode → prefill dials) and by transfer agent (prefill → decode
writes); a peer that comes back is waited for again."""

from __future__ import annotations

from common.pb.tandem.v1 import discovery_pb2
from discovery.watcher import InstanceEvent
from worker.peers import PeerDirectory


def test_recently_gone_by_address_and_by_agent() -> None:
    peers = PeerDirectory("m", "")
    inst = discovery_pb2.Instance(instance_id="d1", address="127.0.0.1:7", transfer_agent_name="d1")
    assert not peers.recently_gone("127.0.0.1:7") and not peers.recently_gone_agent("d1")
    peers.on_change(InstanceEvent("added", inst))
    assert not peers.recently_gone_agent("d1")
    peers.on_change(InstanceEvent("removed", inst))
    assert peers.recently_gone("127.0.0.1:7") and peers.recently_gone_agent("d1")
    assert not peers.recently_gone_agent("someone-else")
    peers.on_change(InstanceEvent("added", inst))  # back (re-registered after an etcd outage)
    assert not peers.recently_gone("127.0.0.1:7") and not peers.recently_gone_agent("d1")
