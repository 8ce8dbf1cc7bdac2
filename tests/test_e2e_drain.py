"""SIGTERM drain (docs/deploy.md, "What a stop does"): a stopping worker is marked DRAINING,
gets no new requests, finishes what it has, then leaves discovery."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from common.pb.tandem.v1 import discovery_pb2, frontend_pb2, frontend_pb2_grpc, sampling_pb2
from engine.reference import reference_generate
from harness import InProcessCluster

pytestmark = pytest.mark.e2e


def test_decode_worker_finishes_in_flight_streams_while_draining(etcd_server, tiny_model):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-drain")
    try:
        router = c.start("router")
        c.start("prefill")
        decodes = [c.start("decode"), c.start("decode")]
        c.wait_roles(router, 1, 2)
        ch = grpc.insecure_channel(router.address)
        stub = frontend_pb2_grpc.FrontendServiceStub(ch)
        prompt = [101, 102, 103, 104]
        long_req = frontend_pb2.GenerateRequest(token_ids=prompt, sampling=sampling_pb2.SamplingParams(
            max_tokens=120, ignore_eos=True))
        call = stub.Generate(long_req, timeout=120)
        tokens = list(next(call).token_ids)
        busy = next(d for d in decodes if d.runtime.in_flight > 0)
        other = next(d for d in decodes if d is not busy)
        stopper = threading.Thread(target=c.stop, args=(busy,))
        stopper.start()
        deadline = time.time() + 10
        while not busy.runtime.draining and time.time() < deadline:
            time.sleep(0.01)
        assert busy.runtime.draining
        # The router learns DRAINING from etcd and sends new work to the other worker.
        deadline = time.time() + 10
        while any(i.instance_id == busy.runtime.instance_id for i in router.workers.candidates(discovery_pb2.ROLE_DECODE)):
            assert time.time() < deadline
            time.sleep(0.02)
        served_before = other.runtime.stats.remote_prefills
        for i in range(3):
            short = frontend_pb2.GenerateRequest(token_ids=[7, 8, i + 1], sampling=sampling_pb2.SamplingParams(max_tokens=2))
            assert list(stub.Generate(short, timeout=30))
        assert other.runtime.stats.remote_prefills == served_before + 3
        for msg in call:  # the in-flight stream runs to the end
            tokens += list(msg.token_ids)
        stopper.join(60)
        assert not stopper.is_alive()
        greedy = reference_generate(tiny_model.model, prompt, 120)
        assert tokens == greedy
        assert busy.runtime.in_flight == 0
        deadline = time.time() + 10  # gone from discovery once its lease is revoked
        while busy.runtime.instance_id in router.workers.instance_ids():
            assert time.time() < deadline
            time.sleep(0.02)
        ch.close()
    finally:
        c.close()


PROMPT = [101, 102, 103, 104]


def _only_decode_worker_draining(c: InProcessCluster, max_tokens: int):
    """A router probing every 50 ms, a prefill worker and one decode worker, a greedy stream of
    max_tokens started on it, then its drain (in a thread), until the probes find it unhealthy.
    Returns (router, decode worker, the call, its tokens so far, the stopping thread, channel)."""
    router = c.start("router", health_interval_s=0.05, health_failure_threshold=1)
    c.start("prefill")
    decode = c.start("decode")
    c.wait_roles(router, 1, 1)
    ch = grpc.insecure_channel(router.address)
    call = frontend_pb2_grpc.FrontendServiceStub(ch).Generate(frontend_pb2.GenerateRequest(
        token_ids=PROMPT, sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)), timeout=120)
    tokens = list(next(call).token_ids)
    stopper = threading.Thread(target=c.stop, args=(decode,))
    stopper.start()
    deadline = time.time() + 10
    while router.workers.health.healthy(decode.runtime.instance_id) and time.time() < deadline:
        time.sleep(0.005)  # the probes see the drain's NOT_SERVING
    assert not router.workers.health.healthy(decode.runtime.instance_id)
    assert decode.runtime.in_flight == 1 and router.servicer.migrations == 0  # kept while it still runs
    return router, decode, call, tokens, stopper, ch


def test_the_only_decode_worker_draining_keeps_its_streams(etcd_server, tiny_model):
    """Its NOT_SERVING makes it unhealthy to the router's probes, but with no other decode
    worker to move them to, taking its streams would fail them: they stay and run to the end."""
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-drain-one")
    try:
        router, _, call, tokens, stopper, ch = _only_decode_worker_draining(c, 300)
        for msg in call:
            tokens += list(msg.token_ids)
        assert tokens == reference_generate(tiny_model.model, PROMPT, 300)
        assert router.servicer.migrations == 0
        stopper.join(60)
        assert not stopper.is_alive()
        ch.close()
    finally:
        c.close()


def test_streams_kept_on_a_draining_worker_move_once_another_decode_worker_is_up(etcd_server, tiny_model):
    """The only decode worker drains and keeps its stream (above); a second decode worker then
    registers: the stream moves to it at once (not at the drain's end), with the same tokens."""
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-drain-move")
    try:
        router, _, call, tokens, stopper, ch = _only_decode_worker_draining(c, 600)
        c.start("decode")
        deadline = time.time() + 10
        while router.servicer.migrations == 0 and time.time() < deadline:  # well before the 30 s drain ends
            time.sleep(0.01)
        assert router.servicer.migrations == 1
        for msg in call:
            tokens += list(msg.token_ids)
        assert tokens == reference_generate(tiny_model.model, PROMPT, 600)
        stopper.join(60)
        assert not stopper.is_alive()
        ch.close()
    finally:
        c.close()
