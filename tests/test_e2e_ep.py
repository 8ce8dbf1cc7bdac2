"""Wide-EP decode worker (`--ep-size`, decode_worker/ep_ranks.py) end to end: real etcd, real
gRPC on loopback, real transfers into each rank's own pool through that rank's transfer agent,
and a second EP rank as a real child process joined over gloo. Greedy tokens must equal `reference_generate`."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.pb.tandem.v1 import decode_pb2, decode_pb2_grpc, frontend_pb2, frontend_pb2_grpc, sampling_pb2
from engine.reference import reference_generate
from harness import InProcessCluster, decode_locally

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=[1, 2], ids=["ep1", "ep2"])
def cluster(request, etcd_server, tiny_model):
    ep = request.param
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace=f"e2e-ep{ep}")
    c.ep = ep
    c.router = c.start("router")
    c.prefill = c.start("prefill")
    c.decode = c.start("decode", ep_size=ep)
    c.wait_roles(c.router, 1, 1)
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(cluster):
    ch = grpc.insecure_channel(cluster.router.address)
    yield frontend_pb2_grpc.FrontendServiceStub(ch)
    ch.close()


def tokens_of(n, offset):
    return [(2000 + 13 * i + 31 * offset) % 150000 for i in range(n)]


def generate(stub, prompt, n):
    req = frontend_pb2.GenerateRequest(token_ids=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=n))
    return [t for m in stub.Generate(req, timeout=120) for t in m.token_ids]


def reference(tiny_model, prompt, n):
    return reference_generate(tiny_model.model, prompt, n, tiny_model.config.eos_token_ids)


def assigned(cluster):
    pool = cluster.decode.runtime.pool
    return list(getattr(pool, "assigned", [0]))


def wait_all_free(cluster, timeout=10.0):
    pool = cluster.decode.runtime.pool
    deadline = time.time() + timeout
    while cluster.on_loop(lambda: pool.blocks.num_free) != pool.config.num_blocks:
        assert time.time() < deadline, "decode worker blocks still referenced"
        time.sleep(0.02)


def test_single_request_with_an_idle_rank(cluster, stub, tiny_model):
    before, transfers = assigned(cluster), cluster.prefill.runtime.stats.transfers
    prompt = tokens_of(40, 1)
    assert generate(stub, prompt, 10) == reference(tiny_model, prompt, 10)
    assert cluster.prefill.runtime.stats.transfers == transfers + 1  # disaggregated: KV came over NIXL
    wait_all_free(cluster)
    if cluster.ep == 2:
        after = assigned(cluster)
        assert sum(after) - sum(before) == 1
        engine = cluster.decode.runtime.engine
        assert engine.stats.idle_rank_steps >= 9  # the other rank joined every step with no tokens
        rt = cluster.decode.runtime
        assert rt.pool.kv.shape[0] == cluster.worker_opts.num_blocks  # rank 0's own pool; rank 1 has its own
        assert rt.pool.ranks[1].kv.data_ptr() != rt.pool.ranks[0].kv.data_ptr()
        # the record names rank 1's agent: the prefill worker checks a destination against it
        record = rt.instance("127.0.0.1:1")
        assert [(a.name, a.capacity_blocks) for a in record.rank_transfer_agents] == [
            (rt.endpoints[1].agent.name, cluster.worker_opts.num_blocks)]
        assert record.kv_capacity_blocks == 2 * cluster.worker_opts.num_blocks


def test_concurrent_requests_land_on_both_ranks(cluster, stub, tiny_model):
    prompts = [tokens_of(17 + 9 * i, 10 + i) for i in range(5)]
    lengths = [12, 7, 15, 9, 11]
    before, transfers = assigned(cluster), cluster.prefill.runtime.stats.transfers
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p, n: generate(stub, p, n), prompts, lengths))
    for prompt, n, tokens in zip(prompts, lengths, got):
        assert tokens == reference(tiny_model, prompt, n)
    # every prompt's KV was written by the prefill worker into the owning rank's pool, through
    # that rank's transfer agent
    assert cluster.prefill.runtime.stats.transfers == transfers + len(prompts)
    wait_all_free(cluster)
    if cluster.ep == 2:
        placed = [a - b for a, b in zip(assigned(cluster), before)]
        assert sum(placed) == len(prompts) and min(placed) >= 1, placed
        assert cluster.decode.runtime.engine.stats.all_busy_steps >= 1  # both ranks decoded in one step


def test_local_prefill_on_owning_rank(cluster, tiny_model):
    """No prefill worker named: the decode worker prefills on the rank that owns the request."""
    local = cluster.decode.runtime.stats.local_prefills
    prompts = [tokens_of(21, 40), tokens_of(33, 41)]
    got = decode_locally(cluster.decode.address, prompts, 8)
    assert got == [reference(tiny_model, p, 8) for p in prompts]
    assert cluster.decode.runtime.stats.local_prefills == local + 2
    wait_all_free(cluster)


def test_a_rank_agents_destination_is_checked_against_its_own_record(cluster):
    """A KvDestination naming rank 1's agent is held to that agent's digest and pool size (the
    record's rank_transfer_agents), not to rank 0's or the worker's whole advertised pool."""
    if cluster.ep == 1:
        pytest.skip("needs a second rank")
    from common.pb.tandem.v1 import prefill_pb2, prefill_pb2_grpc
    rt = cluster.decode.runtime
    (agent, desc, metadata), nb = rt.endpoints[1], cluster.worker_opts.num_blocks

    def refusal(block_ids, metadata):
        req = prefill_pb2.PrefillRequest(request_id="evil-ep", token_ids=[21, 22, 23], destination=prefill_pb2.KvDestination(
            backend="auto", agent_name=agent.name, agent_metadata=metadata, base_address=desc.base_address,
            block_stride_bytes=desc.block_stride_bytes, device_id=-1, first_block_index=0, block_ids=block_ids))
        before = rt.pool.ranks[1].kv.clone()
        with grpc.insecure_channel(cluster.prefill.address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                prefill_pb2_grpc.PrefillServiceStub(ch).Prefill(req, timeout=30)
        assert bool((rt.pool.ranks[1].kv == before).all())  # nothing written
        return e.value

    err = refusal([nb], metadata)  # in the worker's 2 × nb blocks, past rank 1's nb
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("destination.block_ids")
    assert f"{nb} blocks" in err.details(), err.details()
    err = refusal([0], rt.transfer_metadata)  # rank 0's metadata sent under rank 1's name
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert err.details().startswith("destination.agent_metadata"), err.details()


def reference_tops(tiny_model, prompt, n, k):
    """(greedy tokens, each token's k likeliest (id, logprob)) of the reference model."""
    import torch
    rows = []
    tokens = reference_generate(tiny_model.model, prompt, n, sample_fn=lambda row, step: rows.append(row)
                                or int(torch.argmax(row)))
    tops = []
    for row in rows:
        values, ids = torch.log_softmax(row, -1).topk(k)
        tops.append((ids.tolist(), values.tolist()))
    return tokens, tops


def test_top_logprobs_from_each_rank_and_a_local_prefill(cluster, tiny_model):
    """Each rank reports the top log-probabilities of its own rows; a local prefill's first
    token carries them too (no prefill worker named)."""
    prompts = [tokens_of(19 + 6 * i, 50 + i) for i in range(3)]
    ks = [2, 0, 5]

    def one(p, k):
        with grpc.insecure_channel(cluster.decode.address) as ch:
            req = decode_pb2.DecodeRequest(request_id=f"top-{len(p)}", token_ids=p, sampling=sampling_pb2.SamplingParams(
                max_tokens=6, top_logprobs=k, ignore_eos=True))
            return list(decode_pb2_grpc.DecodeServiceStub(ch).Generate(req, timeout=120))
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, prompts, ks))
    for prompt, k, msgs in zip(prompts, ks, got):
        tokens, tops = reference_tops(tiny_model, prompt, 6, max(k, 1))
        assert [t for m in msgs for t in m.token_ids] == tokens
        top = [t for m in msgs for t in m.top_logprobs]
        if not k:
            assert top == []
            continue
        assert [list(t.token_ids) for t in top] == [ids for ids, _ in tops]
        for t, (_, values) in zip(top, tops):
            assert list(t.logprobs) == pytest.approx(values, abs=1e-5)
    wait_all_free(cluster)


def test_dead_rank_fails_the_loop_not_hangs(cluster):
    """Last in this module (it kills the worker): an EP rank that dies mid-stream fails the
    decode loop (INTERNAL to running requests, NOT_SERVING to health probes), no hang."""
    if cluster.ep == 1:
        pytest.skip("needs a second rank")
    decode = cluster.decode
    ch = grpc.insecure_channel(decode.address)
    stub = decode_pb2_grpc.DecodeServiceStub(ch)
    req = decode_pb2.DecodeRequest(token_ids=list(range(100, 130)),
                                   sampling=sampling_pb2.SamplingParams(max_tokens=3000, ignore_eos=True))
    stream = stub.Generate(req, timeout=120)
    next(stream)  # the request runs
    decode.runtime.engine._procs[0].kill()  # rank 1 dies
    t0 = time.time()
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            pass
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert time.time() - t0 < 60  # seen as a broken pipe/connection, not a gloo timeout
    health = health_pb2_grpc.HealthStub(ch)
    deadline = time.time() + 10
    while health.Check(health_pb2.HealthCheckRequest(service="")).status != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.time() < deadline
        time.sleep(0.05)
    ch.close()

