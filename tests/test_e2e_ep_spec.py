"""MTP speculative decoding on a Wide-EP decode worker (`--ep-size 2 --speculative-num-steps k`):
real etcd, gRPC on loopback, NIXL, and a second EP rank as a real child process over gloo.
Every speculative step runs in lock-step on both ranks (engine/spec_decode.py `rounds`), a
rank with no rows joining the MoE all-to-alls with no tokens. Greedy tokens must equal
`reference_generate`; the trained checkpoint makes drafts get accepted (several tokens/step)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.pb.tandem.v1 import frontend_pb2, frontend_pb2_grpc, sampling_pb2
from engine.model_source import load_model
from engine.reference import reference_generate
from harness import InProcessCluster, decode_locally

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_torch_thread")]
TEXTS = ["ROMEO:\nBut soft, what light through yonder window breaks?\n",
         "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\n",
         "KING RICHARD III:\nNow is the winter of our discontent\n",
         "HAMLET:\nTo be, or not to be, that is the question:\n"]


@pytest.fixture(scope="module")
def shakespeare():
    return load_model("tandem-shakespeare")


@pytest.fixture(scope="module", params=[2, 1, 3], ids=["k2", "k1", "k3"])
def cluster(request, etcd_server, shakespeare):
    c = InProcessCluster(etcd_server.endpoint, shakespeare, namespace=f"e2e-ep-spec-k{request.param}")
    c.router = c.start("router")
    c.prefill = c.start("prefill")
    # 16-token chunks: a 33-token local prefill ends with a chunk of the last token alone, whose
    # MTP row is not computable yet (engine/mtp.py), so the owning rank joins the MTP MoE idle
    c.decode = c.start("decode", ep_size=2, speculative_num_steps=request.param, chunk_size=16,
                       enable_dynamic_chunking=False)
    c.wait_roles(c.router, 1, 1)
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(cluster):
    ch = grpc.insecure_channel(cluster.router.address)
    yield frontend_pb2_grpc.FrontendServiceStub(ch)
    ch.close()


def reference(m, prompt, n):
    return reference_generate(m.model, prompt, n, m.config.eos_token_ids)


def generate(stub, prompt, n):
    req = frontend_pb2.GenerateRequest(token_ids=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=n))
    msgs = list(stub.Generate(req, timeout=120))
    return [t for m in msgs for t in m.token_ids], msgs


def wait_all_free(cluster, timeout=10.0):
    pools = [cluster.prefill.runtime.pool, cluster.decode.runtime.pool]
    deadline = time.time() + timeout
    while [cluster.on_loop(lambda p=p: p.blocks.num_free) for p in pools] != [p.config.num_blocks for p in pools]:
        assert time.time() < deadline, "blocks still referenced"
        time.sleep(0.02)


def test_single_request_with_an_idle_rank(cluster, stub, shakespeare):
    engine = cluster.decode.runtime.engine
    idle, transfers = engine.stats.idle_rank_steps, cluster.prefill.runtime.stats.transfers
    prompt = shakespeare.tokenizer().encode(TEXTS[0])
    got, msgs = generate(stub, prompt, 20)
    assert got == reference(shakespeare, prompt, 20)
    assert any(len(m.token_ids) > 1 for m in msgs[1:])  # drafts accepted: several tokens per step
    assert cluster.prefill.runtime.stats.transfers == transfers + 1  # disaggregated
    assert engine.stats.idle_rank_steps > idle  # the other rank joined the speculative steps idle
    wait_all_free(cluster)


def test_concurrent_requests_land_on_both_ranks(cluster, stub, shakespeare):
    tok = shakespeare.tokenizer()
    prompts = [tok.encode(t) for t in TEXTS]
    prompts[1] = prompts[1][:32]  # a whole number of blocks: MTP row P-1 lies in a full block
    lengths = [18, 7, 15, 11]  # different ends: draft counts differ between requests and ranks
    pool = cluster.decode.runtime.pool
    before, busy = list(pool.assigned), cluster.decode.runtime.engine.stats.all_busy_steps
    stats = cluster.decode.runtime.stats
    verify, emitted = stats.spec_verify_steps, stats.spec_emitted_tokens
    with ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(lambda p, n: generate(stub, p, n)[0], prompts, lengths))
    for prompt, n, tokens in zip(prompts, lengths, got):
        assert tokens == reference(shakespeare, prompt, n)
    placed = [a - b for a, b in zip(pool.assigned, before)]
    assert sum(placed) == len(prompts) and min(placed) >= 1, placed
    assert cluster.decode.runtime.engine.stats.all_busy_steps > busy  # both ranks verified in one step
    assert stats.spec_emitted_tokens - emitted > stats.spec_verify_steps - verify > 0
    wait_all_free(cluster)


def test_local_prefill_writes_mtp_rows_on_owning_rank(cluster, shakespeare):
    """No prefill worker named: the decode worker prefills (main and MTP rows) on the owning rank."""
    tok = shakespeare.tokenizer()
    prompts = [tok.encode(TEXTS[2] * 2)[:33], tok.encode(TEXTS[3])]
    local = cluster.decode.runtime.stats.local_prefills
    got = decode_locally(cluster.decode.address, prompts, 12)
    assert got == [reference(shakespeare, p, 12) for p in prompts]
    assert cluster.decode.runtime.stats.local_prefills == local + 2
    wait_all_free(cluster)


def test_seeded_sampling_is_reproducible(cluster, stub, shakespeare):
    """Temperature > 0: drafts are sampled on the owning rank, rejection sampling runs on rank 0."""
    if cluster.decode.runtime.opts.speculative_num_steps != 2:
        pytest.skip("one k is enough")
    prompt = shakespeare.tokenizer().encode(TEXTS[1])
    s = sampling_pb2.SamplingParams(max_tokens=16, temperature=0.7, top_p=0.95, seed=11)
    runs = [[t for m in stub.Generate(frontend_pb2.GenerateRequest(token_ids=prompt, sampling=s), timeout=120)
             for t in m.token_ids] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 16
    wait_all_free(cluster)
