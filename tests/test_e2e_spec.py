"""MTP speculative decoding under disaggregation: router → decode (k drafts) ← prefill over
real gRPC, etcd and NIXL. The prefill worker writes the prompt's MTP KV rows with the main
ones and returns the last hidden state; greedy output must equal reference_generate."""

from __future__ import annotations

import time

import grpc
import pytest

from common.pb.tandem.v1 import frontend_pb2, frontend_pb2_grpc, sampling_pb2
from engine.model_source import load_model
from engine.reference import reference_generate
from harness import InProcessCluster

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_torch_thread")]
TEXTS = ["ROMEO:\nBut soft, what light through yonder window breaks?\n",
         "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\n"]


@pytest.fixture(scope="module")
def shakespeare():
    return load_model("tandem-shakespeare")


@pytest.fixture(scope="module")
def cluster(etcd_server, shakespeare):
    c = InProcessCluster(etcd_server.endpoint, shakespeare, namespace="e2e-spec")
    c.router = c.start("router")
    c.prefill = c.start("prefill")
    c.decode = None
    yield c
    c.close()


@pytest.fixture(scope="module")
def stub(cluster):
    ch = grpc.insecure_channel(cluster.router.address)
    yield frontend_pb2_grpc.FrontendServiceStub(ch)
    ch.close()


def use_decode(cluster, k: int):
    """One decode worker with --speculative-num-steps k (replacing the previous one)."""
    if cluster.decode is not None and cluster.decode.runtime.opts.speculative_num_steps == k:
        return cluster.decode
    if cluster.decode is not None:
        cluster.stop(cluster.decode)
    cluster.decode = cluster.start("decode", speculative_num_steps=k)
    cluster.wait_roles(cluster.router, 1, 1)
    return cluster.decode


def stays_while_unhealthy(cluster, stub, worker, prompt: list[int], sampling) -> list[int]:
    """Stream one request; once its first token is out, mark `worker` (the one serving it)
    unhealthy in the router: the call must stay on it (no other healthy decode worker serves
    it). Returns the stream's tokens."""
    import threading
    got: list = []
    first = threading.Event()

    def stream():
        out = []
        for m in stub.Generate(frontend_pb2.GenerateRequest(token_ids=prompt, sampling=sampling), timeout=60):
            out += m.token_ids
            first.set()
        got.append(out)
    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(30)
    servicer = cluster.router.servicer
    evicted = servicer.open_calls.evicted
    cluster.on_loop(lambda: servicer.worker_unhealthy(worker.runtime.instance_id, "unhealthy (test)"))
    t.join(60)
    assert servicer.open_calls.evicted == evicted  # it stayed
    assert got, "the stream failed"
    return got[0]


def run(stub, **kw) -> tuple[list[int], list[frontend_pb2.GenerateResponse]]:
    msgs = list(stub.Generate(frontend_pb2.GenerateRequest(**kw), timeout=60))
    return [t for m in msgs for t in m.token_ids], msgs


def wait_all_free(cluster, timeout: float = 10.0) -> bool:
    total = cluster.worker_opts.num_blocks
    pools = [cluster.prefill.runtime.pool, cluster.decode.runtime.pool]
    deadline = time.time() + timeout
    while [cluster.on_loop(lambda p=p: p.blocks.num_free) for p in pools] != [total, total]:
        if time.time() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("k", [1, 2, 3])
def test_disaggregated_greedy_equals_reference(cluster, stub, shakespeare, k) -> None:
    decode = use_decode(cluster, k)
    tok = shakespeare.tokenizer()
    transfers = cluster.prefill.runtime.stats.transfers
    for i, text in enumerate(TEXTS):
        prompt = tok.encode(text)
        if i == 1:
            prompt = prompt[:32]  # a whole number of blocks: row P-1 of MTP lies in a full block
        got, msgs = run(stub, token_ids=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=20))
        assert got == reference_generate(shakespeare.model, prompt, 20, shakespeare.config.eos_token_ids)
        assert any(len(m.token_ids) > 1 for m in msgs[1:]) or k == 1  # several tokens per step
    stats = decode.runtime.stats
    assert cluster.prefill.runtime.stats.transfers == transfers + len(TEXTS)
    assert decode.runtime.stats.local_prefills == 0
    assert stats.spec_emitted_tokens > stats.spec_verify_steps > 0
    assert wait_all_free(cluster)


def test_local_prefill_and_decode_prefix_cache(cluster, stub, shakespeare) -> None:
    decode = use_decode(cluster, 2)
    prompt = shakespeare.tokenizer().encode(TEXTS[0] * 3)
    run(stub, token_ids=prompt[:48], sampling=sampling_pb2.SamplingParams(max_tokens=2))
    cluster.on_loop(cluster.prefill.runtime.pool.blocks.clear_cache)  # only the decode side keeps it
    local = decode.runtime.stats.local_prefills
    got, msgs = run(stub, token_ids=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=16))
    assert msgs[-1].usage.cached_tokens == 32  # the decode worker's cached blocks
    assert got == reference_generate(shakespeare.model, prompt, 16, shakespeare.config.eos_token_ids)
    assert decode.runtime.stats.local_prefills >= local  # whichever side prefilled, output is exact
    assert wait_all_free(cluster)


def test_stop_string_emits_nothing_past_the_stop(cluster, stub, shakespeare) -> None:
    use_decode(cluster, 3)
    prompt = shakespeare.tokenizer().encode(TEXTS[0])
    full_ids, msgs = run(stub, token_ids=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=30))
    full = "".join(m.text for m in msgs)
    stop = full[12:15]
    ids, msgs = run(stub, token_ids=prompt,
                    sampling=sampling_pb2.SamplingParams(max_tokens=30, stop=[stop]))
    assert msgs[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP
    assert "".join(m.text for m in msgs) == full[:full.find(stop)]
    # the ids end with the token whose text completed the stop string: no token after it
    tok = shakespeare.tokenizer()
    assert ids == full_ids[:len(ids)] and stop in tok.decode(ids) and stop not in tok.decode(ids[:-1])
    assert wait_all_free(cluster)


def test_disaggregated_seeded_sampling_is_reproducible(cluster, stub, shakespeare) -> None:
    use_decode(cluster, 2)
    prompt = shakespeare.tokenizer().encode(TEXTS[1])
    s = sampling_pb2.SamplingParams(max_tokens=16, temperature=0.7, top_p=0.95, seed=11)
    a, _ = run(stub, token_ids=prompt, sampling=s)
    b, _ = run(stub, token_ids=prompt, sampling=s)
    assert a == b and len(a) == 16
    assert wait_all_free(cluster)


def test_what_mtp_decode_workers_refuse_goes_to_the_others(cluster, stub) -> None:
    """Penalties: an MTP decode worker refuses them by name; the router places such requests on
    plain decode workers, and refuses them by name when every decode worker runs MTP. Top
    log-probabilities and logit biases it serves itself."""
    from common.pb.tandem.v1 import decode_pb2, decode_pb2_grpc
    use_decode(cluster, 1)
    got, msgs = run(stub, token_ids=[5, 6, 7], sampling=sampling_pb2.SamplingParams(max_tokens=6, top_logprobs=2))
    tops = [t for m in msgs for t in m.top_logprobs]
    assert len(got) == 6 and len(tops) == 6 and all(len(t.token_ids) == 2 for t in tops)
    banned, _ = run(stub, token_ids=[5, 6, 7], sampling=sampling_pb2.SamplingParams(max_tokens=6))
    got, _ = run(stub, token_ids=[5, 6, 7], sampling=sampling_pb2.SamplingParams(
        max_tokens=6, logit_bias={t: -100.0 for t in set(banned)}))
    assert len(got) == 6 and not set(got) & set(banned)
    asks = [dict(presence_penalty=0.5), dict(frequency_penalty=-0.5)]
    fields = ["presence_penalty", "frequency_penalty"]
    for ask, field in zip(asks, fields):
        with pytest.raises(grpc.RpcError) as e:
            run(stub, token_ids=[5, 6, 7], sampling=sampling_pb2.SamplingParams(max_tokens=3, **ask))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith(f"sampling.{field}: every decode worker here runs speculative decoding")
    with grpc.insecure_channel(cluster.decode.address) as ch:  # the worker's own check, sent to it directly
        with pytest.raises(grpc.RpcError) as e:
            list(decode_pb2_grpc.DecodeServiceStub(ch).Generate(decode_pb2.DecodeRequest(
                token_ids=[5, 6, 7], sampling=sampling_pb2.SamplingParams(max_tokens=3, presence_penalty=1.0)),
                timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("sampling.presence_penalty: this decode worker runs speculative decoding")
    plain = cluster.start("decode")  # a plain decode worker beside the MTP one
    try:
        cluster.wait_roles(cluster.router, 1, 2)
        served = plain.runtime.stats.generated_tokens
        placed = asks * 2
        for i, ask in enumerate(placed):
            got, msgs = run(stub, token_ids=[5, 6, 7 + i], sampling=sampling_pb2.SamplingParams(max_tokens=3, **ask))
            assert len(got) == 3
        assert plain.runtime.stats.generated_tokens == served + 3 * len(placed)  # every one of them there
    finally:
        cluster.stop(plain)
        cluster.wait_roles(cluster.router, 1, 1)
    got, _ = run(stub, token_ids=[5, 6, 7], sampling=sampling_pb2.SamplingParams(max_tokens=3))  # still serving
    assert len(got) == 3
    assert wait_all_free(cluster)


def test_requests_go_only_where_the_announced_sampling_is_served(cluster, stub, shakespeare, monkeypatch) -> None:
    """The router reads what each MTP decode worker announces it serves (its record's
    speculative_sampling): a current one lists top log-probabilities and logit biases; one that
    lists only the bias gets no top request: refused by name while it is the only decode worker,
    placed on a plain worker beside it, and a top request's stream stays on that plain worker
    while it is unhealthy, since the MTP worker could not take it."""
    import worker.host
    current = use_decode(cluster, 1)
    records = cluster.router.servicer.workers
    assert list(records.instance(current.runtime.instance_id).speculative_sampling) == ["top_logprobs", "logit_bias"]
    cluster.stop(current)
    monkeypatch.setattr(worker.host, "SPECULATIVE_SAMPLING", ("logit_bias",))  # a worker without the tops
    cluster.decode = partial = cluster.start("decode", speculative_num_steps=1)
    try:
        cluster.wait_roles(cluster.router, 1, 1)
        assert list(records.instance(partial.runtime.instance_id).speculative_sampling) == ["logit_bias"]
        shown = [w for w in stub.ClusterStatus(frontend_pb2.ClusterStatusRequest(), timeout=10).workers
                 if w.role == "decode"]  # what `tandem top` lists
        assert [(w.speculative_num_steps, list(w.speculative_sampling)) for w in shown] == [(1, ["logit_bias"])]
        from io import StringIO

        from rich.console import Console

        from cli.top import render
        screen = Console(file=StringIO(), width=300)
        screen.print(render(stub.ClusterStatus(frontend_pb2.ClusterStatusRequest(), timeout=10)))
        assert "decode (MTP k=1)" in screen.file.getvalue()
        with pytest.raises(grpc.RpcError) as e:
            run(stub, token_ids=[5, 6, 7], sampling=sampling_pb2.SamplingParams(max_tokens=3, top_logprobs=2))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details().startswith("sampling.top_logprobs: every decode worker here runs speculative "
                                            "decoding (MTP), which reports no top log-probabilities")
        for ask in [dict(logit_bias={9: 2.0}), {}]:  # these it serves
            got, _ = run(stub, token_ids=[5, 6, 7], sampling=sampling_pb2.SamplingParams(max_tokens=3, **ask))
            assert len(got) == 3
        plain = cluster.start("decode")
        try:
            cluster.wait_roles(cluster.router, 1, 2)
            served = plain.runtime.stats.generated_tokens
            for i in range(3):
                got, msgs = run(stub, token_ids=[5, 6, 7 + i], sampling=sampling_pb2.SamplingParams(
                    max_tokens=3, top_logprobs=2))
                assert len(got) == 3 and all(len(t.token_ids) == 2 for m in msgs for t in m.top_logprobs)
            assert plain.runtime.stats.generated_tokens == served + 9  # every one of them there
            prompt = shakespeare.tokenizer().encode(TEXTS[1])[:24]
            ask = sampling_pb2.SamplingParams(max_tokens=40, ignore_eos=True, top_logprobs=1)
            want, _ = run(stub, token_ids=prompt, sampling=ask)
            assert stays_while_unhealthy(cluster, stub, plain, prompt, ask) == want
        finally:
            cluster.stop(plain)
            cluster.wait_roles(cluster.router, 1, 1)
        assert wait_all_free(cluster)
    finally:
        cluster.stop(partial)
        cluster.decode = None  # the next test starts a current worker
        cluster.wait_roles(cluster.router, 1, 0)


def test_calls_only_a_plain_worker_can_take_stay_on_it_while_it_is_unhealthy(cluster, stub, shakespeare) -> None:
    """A plain decode worker turns unhealthy beside an MTP one: its plain requests move to the
    MTP worker, those asking for penalties stay and finish where they are (they had failed with
    the MTP refusal's 400), as all calls do when no other decode worker is healthy."""
    from common.sampling_params import SamplingParams
    from decode_helpers import reference_draws
    use_decode(cluster, 1)
    plain = cluster.start("decode")
    try:
        cluster.wait_roles(cluster.router, 1, 2)
        prompt = shakespeare.tokenizer().encode(TEXTS[1])[:24]
        penalized = SamplingParams(max_tokens=40, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.5)
        got = stays_while_unhealthy(cluster, stub, plain, prompt, sampling_pb2.SamplingParams(
            max_tokens=40, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.5))
        assert got == reference_draws(shakespeare.model, prompt, 40, penalized)
    finally:
        cluster.stop(plain)
        cluster.wait_roles(cluster.router, 1, 1)
    assert wait_all_free(cluster)
