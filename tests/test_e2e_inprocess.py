"""End to end through a real etcd, real gRPC on loopback and real NIXL transfers; the
router and workers run in this process so the tests can look into the KV pools."""

from __future__ import annotations

import time

import grpc
import pytest

from common.pb.tandem.v1 import frontend_pb2, frontend_pb2_grpc, sampling_pb2
from engine.reference import reference_generate
from harness import InProcessCluster

pytestmark = pytest.mark.e2e
VOCAB = 151646


@pytest.fixture(scope="module")
def cluster(etcd_server, tiny_model):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-inproc")
    c.router = c.start("router")
    c.prefill = c.start("prefill")
    c.decode = c.start("decode")
    c.wait_roles(c.router, 1, 1)
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(cluster):
    ch = grpc.insecure_channel(cluster.router.address)
    yield frontend_pb2_grpc.FrontendServiceStub(ch)
    ch.close()


def run(stub, timeout=60, **kw) -> tuple[list[int], list[frontend_pb2.GenerateResponse]]:
    req = frontend_pb2.GenerateRequest(**kw)
    msgs = list(stub.Generate(req, timeout=timeout))
    return [t for m in msgs for t in m.token_ids], msgs


def greedy(n):
    return sampling_pb2.SamplingParams(max_tokens=n)


def free_counts(cluster):
    return (cluster.on_loop(lambda: cluster.prefill.runtime.pool.blocks.num_free),
            cluster.on_loop(lambda: cluster.decode.runtime.pool.blocks.num_free))


def wait_all_free(cluster, timeout=10.0) -> bool:
    """True once no block is referenced on either worker (cached blocks count as free)."""
    total = cluster.worker_opts.num_blocks
    deadline = time.time() + timeout
    while free_counts(cluster) != (total, total):
        if time.time() > deadline:
            return False
        time.sleep(0.02)
    return True


def tokens_of(n, offset=0):
    return [(1000 + 7 * i + offset) % 150000 for i in range(n)]


@pytest.mark.parametrize("n", [1, 15, 16, 17, 300])
def test_disaggregated_greedy_equals_reference(cluster, stub, tiny_model, n):
    prompt = tokens_of(n, offset=n)
    transfers = cluster.prefill.runtime.stats.transfers
    local = cluster.decode.runtime.stats.local_prefills
    got, msgs = run(stub, token_ids=prompt, sampling=greedy(12))
    ref = reference_generate(tiny_model.model, prompt, 12, tiny_model.config.eos_token_ids)
    assert got == ref
    assert msgs[-1].finish_reason in (sampling_pb2.FINISH_REASON_LENGTH, sampling_pb2.FINISH_REASON_EOS)
    assert msgs[-1].usage.prompt_tokens == n and msgs[-1].usage.completion_tokens == len(ref)
    # The prompt's KV really came from the prefill worker over NIXL.
    assert cluster.prefill.runtime.stats.transfers == transfers + 1
    assert cluster.decode.runtime.stats.local_prefills == local


def test_text_prompt_equals_reference(stub, tiny_model):
    text = "Compose an engaging travel blog post about a recent trip to Hawaii."
    got, msgs = run(stub, text=text, sampling=greedy(10))
    prompt = tiny_model.tokenizer().encode(text)
    assert got == reference_generate(tiny_model.model, prompt, 10, tiny_model.config.eos_token_ids)
    assert "".join(m.text for m in msgs) == tiny_model.tokenizer().decode(got)


def test_prefix_cached_on_prefill_side_only(cluster, stub, tiny_model):
    base = tokens_of(64, offset=5)
    run(stub, token_ids=base, sampling=greedy(2))
    cluster.on_loop(cluster.decode.runtime.pool.blocks.clear_cache)  # only the prefill worker keeps it
    prompt = base + tokens_of(20, offset=9)
    got, msgs = run(stub, token_ids=prompt, sampling=greedy(8))
    assert msgs[-1].usage.cached_tokens == 0
    assert got == reference_generate(tiny_model.model, prompt, 8, tiny_model.config.eos_token_ids)


def test_prefix_cached_on_decode_side(cluster, stub, tiny_model):
    base = tokens_of(80, offset=11)
    run(stub, token_ids=base, sampling=greedy(2))
    cluster.on_loop(cluster.prefill.runtime.pool.blocks.clear_cache)  # only the decode worker keeps it
    prompt = base + tokens_of(7, offset=3)
    got, msgs = run(stub, token_ids=prompt, sampling=greedy(8))
    assert msgs[-1].usage.cached_tokens == 80  # 5 full blocks of 16 from the decode worker's cache
    assert got == reference_generate(tiny_model.model, prompt, 8, tiny_model.config.eos_token_ids)


def test_seeded_sampling_is_reproducible(stub):
    s = sampling_pb2.SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7)
    a, _ = run(stub, token_ids=tokens_of(20), sampling=s)
    b, _ = run(stub, token_ids=tokens_of(20), sampling=s)
    assert a == b and len(a) >= 1


def test_stop_string_cuts_text(stub, tiny_model):
    # The documented rule (docs/http-api.md, sampling.proto): the text ends before the stop
    # string; token_ids (and usage.completion_tokens) end with the token whose text completed it
    from common.tokenizer import load_tokenizer
    all_ids, msgs = run(stub, token_ids=tokens_of(30), sampling=greedy(20))
    full = "".join(m.text for m in msgs)
    stop = full[5:8]
    got, msgs = run(stub, token_ids=tokens_of(30), sampling=sampling_pb2.SamplingParams(max_tokens=20, stop=[stop]))
    text = "".join(m.text for m in msgs)
    assert msgs[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP
    assert text == full[: full.find(stop)]
    tok = load_tokenizer()
    completes = next(k for k in range(1, len(all_ids) + 1) if stop in tok.decode(all_ids[:k]))
    assert got == all_ids[:completes]
    assert msgs[-1].usage.completion_tokens == len(got)


BAD = [
    (dict(text=""), "text"),
    (dict(token_ids=[1, 2], text="hi"), "text"),
    (dict(token_ids=[1, VOCAB]), "token_ids[1]"),
    (dict(token_ids=[-5]), "token_ids[0]"),
    (dict(token_ids=[1], sampling=sampling_pb2.SamplingParams(max_tokens=0)), "sampling.max_tokens"),
    (dict(token_ids=[1], sampling=sampling_pb2.SamplingParams(max_tokens=-1)), "sampling.max_tokens"),
    (dict(token_ids=[1] * 4000, sampling=sampling_pb2.SamplingParams(max_tokens=100)), "sampling.max_tokens"),
    (dict(token_ids=[1], sampling=sampling_pb2.SamplingParams(temperature=-1)), "sampling.temperature"),
    (dict(token_ids=[1], sampling=sampling_pb2.SamplingParams(top_p=0)), "sampling.top_p"),
    (dict(token_ids=[1], sampling=sampling_pb2.SamplingParams(top_p=1.01)), "sampling.top_p"),
    (dict(token_ids=[1], request_id="r" * (1 << 20)), "request_id"),  # 1 MiB id: refused, not forwarded
    (dict(token_ids=[1], sampling=sampling_pb2.SamplingParams(stop=["x"] * 10_000)), "sampling.stop"),
]


@pytest.mark.parametrize("fields, field", BAD)
def test_bad_input_is_invalid_argument_and_server_keeps_serving(stub, cluster, fields, field):
    assert wait_all_free(cluster)  # earlier tests' streams have been released
    with pytest.raises(grpc.RpcError) as e:
        run(stub, **fields)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(field + ":"), e.value.details()
    got, _ = run(stub, token_ids=[1, 2, 3], sampling=greedy(2))
    assert len(got) >= 1
    assert wait_all_free(cluster)


def test_invalid_utf8_names_the_field(cluster, stub):
    ch = grpc.insecure_channel(cluster.router.address)
    raw = frontend_pb2.GenerateRequest(text="hi").SerializeToString().replace(b"hi", b"h\xff")
    call = ch.unary_stream("/tandem.v1.FrontendService/Generate", request_serializer=lambda b: b,
                           response_deserializer=frontend_pb2.GenerateResponse.FromString)
    with pytest.raises(grpc.RpcError) as e:
        list(call(raw, timeout=10))
    ch.close()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("text:")


def test_unknown_model_is_not_found(stub):
    with pytest.raises(grpc.RpcError) as e:
        run(stub, model="nope", token_ids=[1])
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and e.value.details().startswith("model:")


def test_list_models(stub):
    models = stub.ListModels(frontend_pb2.ListModelsRequest()).models
    assert [m.name for m in models] == ["tandem-tiny"] and models[0].block_size == 16


def test_cancel_mid_stream_frees_every_block(cluster, stub):
    assert wait_all_free(cluster)
    total = cluster.worker_opts.num_blocks
    req = frontend_pb2.GenerateRequest(token_ids=tokens_of(100, offset=2),
                                       sampling=sampling_pb2.SamplingParams(max_tokens=500, ignore_eos=True))
    call = stub.Generate(req, timeout=60)
    for i, _ in enumerate(call):
        if i == 2:
            break
    # Blocks are held on the decode worker while the stream runs.
    assert free_counts(cluster)[1] < total
    call.cancel()
    assert wait_all_free(cluster), free_counts(cluster)


def test_every_server_serves_health_and_reflection(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    expected = {cluster.router.address: "tandem.v1.FrontendService",
                cluster.prefill.address: "tandem.v1.PrefillService",
                cluster.decode.address: "tandem.v1.DecodeService"}
    for address, service in expected.items():
        with grpc.insecure_channel(address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for name in ("", service):
                resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            (resp,) = list(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                    timeout=5))
            names = {s.name for s in resp.list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= names
            if service != "tandem.v1.FrontendService":
                assert "tandem.v1.KvEventService" in names


def test_kv_events_stream_snapshot_then_stored(cluster, stub):
    from common.pb.tandem.v1 import kv_events_pb2, kv_events_pb2_grpc

    with grpc.insecure_channel(cluster.decode.address) as ch:
        events = kv_events_pb2_grpc.KvEventServiceStub(ch).Subscribe(kv_events_pb2.SubscribeRequest(from_event_id=0),
                                                                      timeout=20)
        first = next(events)
        assert first.snapshot
        prompt = tokens_of(48, offset=77)  # 3 full blocks, new to every cache
        run(stub, token_ids=prompt, sampling=greedy(2))
        stored = []
        for batch in events:
            assert not batch.snapshot and batch.event_id > first.event_id
            stored += [h for e in batch.events if e.HasField("stored") for h in e.stored.block_hashes]
            if len(stored) >= 2:
                break
        events.cancel()
    from common.block_hash import block_hashes, hash_seed
    expected = block_hashes(prompt, 16, hash_seed("tandem-tiny", weights=cluster.loaded.fingerprint))
    # The decode worker caches the prompt's full blocks except the last one it recomputes.
    assert set(stored) <= set(expected) and stored[:2] == expected[:2]
