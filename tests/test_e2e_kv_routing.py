"""KV-aware routing end to end: two prefill and two decode workers, real etcd, real gRPC,
real NIXL, the router following every worker's KV events."""

from __future__ import annotations

import time

import grpc
import pytest

from common.pb.tandem.v1 import frontend_pb2, frontend_pb2_grpc, kv_events_pb2, kv_events_pb2_grpc, sampling_pb2
from engine.reference import reference_generate
from harness import InProcessCluster

pytestmark = pytest.mark.e2e


def doc(n, salt):
    return [(salt * 7919 + i * 31) % 150000 for i in range(n)]


def wait(predicate, timeout=10.0):
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture(scope="module")
def fleet(etcd_server, tiny_model):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-kv")
    c.router = c.start("router")
    c.router2 = c.start("router")  # a replica: follows the same events, routes independently
    c.prefills = [c.start("prefill"), c.start("prefill")]
    c.decodes = [c.start("decode"), c.start("decode")]
    c.wait_roles(c.router, 2, 2)
    c.wait_roles(c.router2, 2, 2)
    yield c
    c.close()


def generate(address, tokens, n=4):
    with grpc.insecure_channel(address) as ch:
        stub = frontend_pb2_grpc.FrontendServiceStub(ch)
        msgs = list(stub.Generate(frontend_pb2.GenerateRequest(token_ids=tokens,
                                                                sampling=sampling_pb2.SamplingParams(max_tokens=n)),
                                  timeout=120))
    return [t for m in msgs for t in m.token_ids]


def explain(address, tokens):
    with grpc.insecure_channel(address) as ch:
        return frontend_pb2_grpc.FrontendServiceStub(ch).ExplainRoute(frontend_pb2.GenerateRequest(token_ids=tokens))


def test_shared_2k_prefix_lands_on_the_same_prefill_worker(fleet, tiny_model):
    prefix = doc(2048, salt=1)
    first = prefix + doc(40, salt=2)
    second = prefix + doc(50, salt=3)
    generate(fleet.router.address, first)
    holder = [p for p in fleet.prefills if p.runtime.stats.transfers == 1]
    assert len(holder) == 1
    holder = holder[0]
    # The router learns the prefill worker's new blocks from its KV events.
    assert wait(lambda: explain(fleet.router.address, second).prefill_instance_id == holder.runtime.instance_id)
    cached_before = holder.runtime.stats.prefill_cached_tokens
    got = generate(fleet.router.address, second, n=6)
    assert holder.runtime.stats.transfers == 2
    assert holder.runtime.stats.prefill_cached_tokens - cached_before == 2048
    assert got == reference_generate(tiny_model.model, second, 6, tiny_model.config.eos_token_ids)


def test_explain_shows_every_candidate_with_overlap_and_cost(fleet):
    prompt = doc(1024, salt=7)
    generate(fleet.router.address, prompt)
    assert wait(lambda: max(c.overlap_blocks for c in explain(fleet.router.address, prompt).candidates) == 64)
    resp = explain(fleet.router.address, prompt)
    assert resp.mode == "kv" and resp.prompt_blocks == 64
    assert {c.role for c in resp.candidates} == {"prefill", "decode"} and len(resp.candidates) == 4
    chosen = [c for c in resp.candidates if c.chosen]
    assert len(chosen) == 2 and all(c.cost == min(x.cost for x in resp.candidates if x.role == c.role) for c in chosen)
    assert "overlap" in resp.text and "cost in active decode blocks (docs/routing.md)" in resp.text


def test_two_router_replicas_converge(fleet):
    prompt = doc(512, salt=11)
    generate(fleet.router.address, prompt)  # only the first replica routed it

    def overlaps(address):
        return sorted((c.instance_id, c.overlap_blocks) for c in explain(address, prompt).candidates)

    assert wait(lambda: overlaps(fleet.router.address) == overlaps(fleet.router2.address)
                and max(o for _, o in overlaps(fleet.router2.address)) > 0)


def test_future_event_id_gets_a_snapshot_and_is_counted(fleet):
    worker = fleet.decodes[0]
    before = worker.runtime.events.future_subscribers
    with grpc.insecure_channel(worker.address) as ch:
        stream = kv_events_pb2_grpc.KvEventServiceStub(ch).Subscribe(
            kv_events_pb2.SubscribeRequest(from_event_id=10**12), timeout=10)
        first = next(stream)
        stream.cancel()
    assert first.snapshot and worker.runtime.events.future_subscribers == before + 1


def test_worker_leaving_discovery_leaves_the_index(fleet):
    router = fleet.router.servicer
    index = router.placement.overlap
    extra = fleet.start("decode")
    fleet.wait_roles(fleet.router, 2, 3)
    prompt = doc(256, salt=21)
    wid = extra.runtime.instance_id
    try:
        # Route until the new worker holds something (on a loaded machine the first few requests
        # may all go elsewhere), and stop it whatever happens: the next tests expect two workers.
        for salt in range(30):
            generate(fleet.router.address, doc(256, salt=30 + salt))
            if index.num_blocks(wid) > 0:
                break
        assert wait(lambda: index.num_blocks(wid) > 0)
    finally:
        fleet.stop(extra)
    fleet.wait_roles(fleet.router, 2, 2)
    assert wait(lambda: wid not in index.workers())
    assert generate(fleet.router.address, prompt)


def test_approx_mode_assumes_routed_blocks(fleet):
    approx = fleet.start("router", router_mode="approx")
    fleet.wait_roles(approx, 2, 2)
    prompt = doc(640, salt=41)  # 40 blocks
    generate(approx.address, prompt)
    resp = explain(approx.address, prompt + doc(30, salt=42))
    assert resp.mode == "approx"
    held = {c.instance_id: c.overlap_blocks for c in resp.candidates}
    assert held[resp.decode_instance_id] == 40 and held[resp.prefill_instance_id] == 40
    assert sorted(held.values()) == [0, 0, 40, 40]  # only the workers it routed to
    fleet.stop(approx)
