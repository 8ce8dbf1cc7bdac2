"""The prefill runtime end to end: disaggregated requests through prefill workers with 1, 2 and
3 pipeline stages (real gloo stage processes), static and dynamic chunks, prefix reuse, and an
FP8 KV pair; greedy tokens equal `reference_generate` in float32.

The decode worker is called directly with the prefill worker's address, so each test picks
the pipeline it exercises; the KV still travels over NIXL between the pools.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from common.pb.tandem.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, sampling_pb2
from engine.chunking import ChunkPlanner, QuadraticFit
from engine.reference import reference_generate
from harness import InProcessCluster

pytestmark = pytest.mark.e2e
BS = 16


@pytest.fixture(scope="module")
def cluster(etcd_server, tiny_model):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-prefill-pp")
    c.decode = c.start("decode")
    c.pp = {1: c.start("prefill", chunk_size=32),
            2: c.start("prefill", chunk_size=48, pp_size=2),
            3: c.start("prefill", chunk_size=40, pp_size=3, pp_layer_partition="1,2,1")}
    # dynamic chunks on the 3-stage worker from a fixed fit (the start-up fit of the tiny model
    # on a busy machine is noise): with a = 1e-4, b = 1e-3 and base 40 the chunks go
    # 32 (40 aligned down to blocks), 16, 16, ... tokens
    c.pp[3].runtime.planner = ChunkPlanner(40, BS, QuadraticFit(1e-4, 1e-3, 0.0), 0.75)
    c.fp8_decode = c.start("decode", kv_cache_dtype="fp8_e4m3")
    c.fp8_prefill = c.start("prefill", chunk_size=32, pp_size=2, kv_cache_dtype="fp8_e4m3")
    yield c
    c.close()


def tokens_of(n, offset=0):
    return [(1000 + 7 * i + offset) % 150000 for i in range(n)]


def generate(decode, prefill, prompt, max_tokens=8) -> list[int]:
    req = decode_pb2.DecodeRequest(request_id=f"r{len(prompt)}-{prompt[0]}-{prompt[-1]}", token_ids=prompt,
                                   sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens),
                                   prefill_address=prefill.address)
    with grpc.insecure_channel(decode.address) as ch:
        msgs = list(decode_pb2_grpc.DecodeServiceStub(ch).Generate(req, timeout=120))
    return [t for m in msgs for t in m.token_ids]


def all_free(c, h) -> bool:
    return c.on_loop(lambda: h.runtime.pool.blocks.num_free) == c.worker_opts.num_blocks


@pytest.mark.parametrize("pp", [1, 2, 3])
@pytest.mark.parametrize("n", [17, 96, 100])  # one chunk; dividing 32 and 48; dividing none
def test_pipeline_greedy_equals_reference(cluster, tiny_model, pp, n):
    prefill = cluster.pp[pp]
    prompt = tokens_of(n, offset=13 * pp + n)
    transfers = prefill.runtime.stats.transfers
    local = cluster.decode.runtime.stats.local_prefills
    got = generate(cluster.decode, prefill, prompt)
    assert got == reference_generate(tiny_model.model, prompt, 8, tiny_model.config.eos_token_ids)
    assert prefill.runtime.stats.transfers == transfers + 1  # the KV came from this worker
    assert cluster.decode.runtime.stats.local_prefills == local
    assert all_free(cluster, prefill)


def test_chunks_of_one_request_overlap_across_stages(cluster):
    # after the parametrized runs above: chunk k+1 was dispatched before chunk k left the pipeline
    assert cluster.pp[3].runtime.pipeline.max_in_flight >= 2
    assert cluster.pp[2].runtime.pipeline.max_in_flight >= 2


def test_chunk_plans_differ(cluster):
    assert [e - s for s, e in cluster.pp[3].runtime.planner.chunks(0, 100)] == [32, 16, 16, 16, 16, 4]
    assert [e - s for s, e in cluster.pp[2].runtime.planner.chunks(0, 100)] == [48, 48, 4]


@pytest.mark.parametrize("pp", [2, 3])
def test_prefix_reuse_with_pipeline(cluster, tiny_model, pp):
    prefill = cluster.pp[pp]
    base = tokens_of(200, offset=101 * pp)  # 12 full blocks cached after this request
    generate(cluster.decode, prefill, base, 2)
    for cached_blocks, tail in ((0, 30), (1, 33), (12, 45)):
        prompt = (base[:cached_blocks * BS] + tokens_of(tail, offset=7 * cached_blocks + pp)
                  if cached_blocks else tokens_of(tail + 50, offset=999 + pp))
        before = prefill.runtime.stats.prefill_cached_tokens
        got = generate(cluster.decode, prefill, prompt)
        assert got == reference_generate(tiny_model.model, prompt, 8, tiny_model.config.eos_token_ids)
        assert prefill.runtime.stats.prefill_cached_tokens - before == cached_blocks * BS
    assert all_free(cluster, prefill)


def test_on_chunk_done_reports_kv_complete_on_every_stage(cluster):
    """The hook for overlapping transfers: awaited per chunk, in order, when every stage's
    layers of that chunk are in the pool (checked on the last stage's layer)."""
    h = cluster.pp[3]
    rt = h.runtime
    prompt = tokens_of(90, offset=4242)
    seen: list[tuple[int, bool]] = []

    async def run():
        blocks = rt.pool.blocks.allocate(rt.pool.blocks_for(len(prompt)))
        rt.pool.kv[blocks] = 0
        last_layer = cluster.loaded.config.num_hidden_layers - 1  # the last main layer (the MTP layer follows)

        async def done(n: int) -> None:
            rows = rt.pool.kv[blocks, last_layer].reshape(-1, rt.pool.config.kv_dim)
            seen.append((n, bool((rows[:n].abs().sum(-1) > 0).all())))
        try:
            return await rt.prefill(blocks, prompt, 0, on_chunk_done=done)
        finally:
            rt.pool.free(blocks)

    logits = cluster.call(run())
    assert seen == [(e, True) for _, e in rt.planner.chunks(0, len(prompt))]
    assert len(seen) > 1 and logits.shape == (cluster.loaded.config.vocab_size,)


def test_fp8_pair_transfers_half_the_bytes(cluster, tiny_model):
    c = tiny_model.config
    stride = cluster.fp8_prefill.runtime.pool_desc.block_stride_bytes
    # every KV layer of the pool: the main layers and the MTP module's (engine/mtp.py)
    assert stride == BS * (c.kv_lora_rank + c.qk_rope_head_dim) * c.num_kv_layers * 1
    assert cluster.fp8_decode.runtime.pool.kv.dtype == torch.float8_e4m3fn
    prompt = tokens_of(100, offset=77)
    before = cluster.fp8_prefill.runtime.stats.transfer_bytes
    got = generate(cluster.fp8_decode, cluster.fp8_prefill, prompt, 4)
    assert len(got) == 4 and cluster.fp8_decode.runtime.stats.local_prefills == 0
    assert cluster.fp8_prefill.runtime.stats.transfer_bytes - before == 7 * stride  # 100 tokens = 7 blocks
    # prefix reuse from the FP8 pool: 4 cached blocks
    cached = cluster.fp8_prefill.runtime.stats.prefill_cached_tokens
    again = generate(cluster.fp8_decode, cluster.fp8_prefill, prompt[:64] + tokens_of(30, offset=78), 4)
    assert cluster.fp8_prefill.runtime.stats.prefill_cached_tokens - cached == 64 and len(again) == 4
    assert all_free(cluster, cluster.fp8_prefill)


def test_kv_dtype_mismatch_is_refused_naming_the_field(cluster):
    rt = cluster.decode.runtime  # float32 pool
    d = prefill_pb2.KvDestination(backend="nixl", agent_name=rt.agent.name, agent_metadata=rt.agent.metadata(),
                                  base_address=rt.pool_desc.base_address,
                                  block_stride_bytes=rt.pool_desc.block_stride_bytes, device_id=-1,
                                  first_block_index=0, block_ids=[3], kv_cache_dtype=rt.pool.config.dtype_name)
    req = prefill_pb2.PrefillRequest(request_id="mismatch", token_ids=[1, 2, 3], destination=d)
    with grpc.insecure_channel(cluster.fp8_prefill.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            prefill_pb2_grpc.PrefillServiceStub(ch).Prefill(req, timeout=20)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith("destination.kv_cache_dtype"), e.value.details()
    assert all_free(cluster, cluster.fp8_prefill)
    # through the decode worker: refused by the FP8 prefill worker, so it prefills locally
    local = cluster.decode.runtime.stats.local_prefills
    prompt = tokens_of(40, offset=3)
    assert generate(cluster.decode, cluster.fp8_prefill, prompt, 3) == reference_generate(
        cluster.loaded.model, prompt, 3, cluster.loaded.config.eos_token_ids)
    assert cluster.decode.runtime.stats.local_prefills == local + 1


def test_dynamic_chunking_profiles_at_start_up(cluster):
    """--enable-dynamic-chunking times prefills at start-up and fits them, or falls back."""
    h = cluster.start("prefill", chunk_size=64, enable_dynamic_chunking=True)
    try:
        planner = h.runtime.planner
        assert planner.base == 64
        if planner.dynamic:  # the fit is a > 0: chunks shrink with the prefix
            sizes = [e - s for s, e in planner.chunks(0, 4096)]
            assert sizes[0] <= 64 and sizes[-2] <= sizes[0]
        prompt = tokens_of(150, offset=31)
        assert generate(cluster.decode, h, prompt, 4) == reference_generate(cluster.loaded.model, prompt, 4,
                                                                           cluster.loaded.config.eos_token_ids)
    finally:
        cluster.stop(h)



def test_dead_stage_fails_over_to_local_prefill_and_reports_not_serving(cluster, tiny_model):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    h = cluster.start("prefill", chunk_size=32, pp_size=2, stall_timeout_s=1.0)
    try:
        proc = h.runtime.pipeline.procs[0]
        proc.kill()  # our own child, by its handle
        proc.join(10)
        local = cluster.decode.runtime.stats.local_prefills
        prompt = tokens_of(70, offset=555)
        assert generate(cluster.decode, h, prompt, 3) == reference_generate(tiny_model.model, prompt, 3,
                                                                           tiny_model.config.eos_token_ids)
        assert cluster.decode.runtime.stats.local_prefills == local + 1
        assert all_free(cluster, h)
        with grpc.insecure_channel(h.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            deadline = time.time() + 10
            while stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status != health_pb2.HealthCheckResponse.NOT_SERVING:
                assert time.time() < deadline, "a prefill worker without its pipeline still reports SERVING"
                time.sleep(0.1)
    finally:
        cluster.stop(h)


def test_pipeline_records_a_span_per_chunk_and_per_stage(cluster):
    """Tracing on: each chunk of a pp 2 prefill is a `tandem.prefill.chunk` span under
    `tandem.prefill`, with one `tandem.prefill.stage` child per stage, in time order."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from common import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    rt = cluster.pp[2].runtime
    prompt = tokens_of(100, offset=999)

    async def run():
        blocks = rt.pool.blocks.allocate(rt.pool.blocks_for(len(prompt)))
        try:
            return await rt.prefill(blocks, prompt, 0)
        finally:
            rt.pool.free(blocks)

    previous = tracing.use_provider(provider)
    try:
        cluster.call(run())
    finally:
        tracing.use_provider(previous)
    spans = exporter.get_finished_spans()
    prefill = [s for s in spans if s.name == "tandem.prefill"]
    chunks = [s for s in spans if s.name == "tandem.prefill.chunk"]
    stages = [s for s in spans if s.name == "tandem.prefill.stage"]
    n = len(rt.planner.chunks(0, len(prompt)))
    assert len(prefill) == 1 and len(chunks) == n > 1 and len(stages) == 2 * n
    assert all(c.parent.span_id == prefill[0].context.span_id for c in chunks)
    by_id = {c.context.span_id: c for c in chunks}
    for st in stages:
        chunk = by_id[st.parent.span_id]
        assert chunk.start_time <= st.start_time <= st.end_time <= chunk.end_time
    for c in chunks:
        mine = sorted((s for s in stages if s.parent.span_id == c.context.span_id),
                      key=lambda s: s.attributes["tandem.pp.stage"])
        assert [s.attributes["tandem.pp.stage"] for s in mine] == [0, 1]
        assert mine[0].end_time <= mine[1].start_time  # stage 1 runs on what stage 0 sent
