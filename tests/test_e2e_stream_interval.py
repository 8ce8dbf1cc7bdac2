"""--stream-interval: a decode worker streams a running request's tokens in messages of N
(the first token alone, the last message at the finish), through a real router, etcd and gRPC
on loopback; tokens and stop-string cuts are those of N = 1."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from common.pb.tandem.v1 import frontend_pb2, frontend_pb2_grpc, sampling_pb2
from common.sampling_params import SamplingParams
from decode_helpers import generate
from engine.reference import reference_generate
from harness import InProcessCluster
from worker.host import WorkerOptions

pytestmark = pytest.mark.e2e
N = 4


@pytest.fixture(scope="module")
def stub(etcd_server, tiny_model):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-stream-interval",
                         worker_opts=WorkerOptions(num_blocks=512, stream_interval=N))
    c.router = c.start("router")
    c.prefill = c.start("prefill")
    c.decode = c.start("decode")
    c.wait_roles(c.router, 1, 1)
    ch = grpc.insecure_channel(c.router.address)
    yield frontend_pb2_grpc.FrontendServiceStub(ch)
    ch.close()
    c.close()


def run(stub, prompt, **sampling) -> list[frontend_pb2.GenerateResponse]:
    req = frontend_pb2.GenerateRequest(token_ids=prompt, sampling=sampling_pb2.SamplingParams(**sampling))
    return list(stub.Generate(req, timeout=60))


def test_tokens_come_in_messages_of_the_interval_and_equal_reference(stub, tiny_model):
    prompt = [(7 * i + 3) % 5000 for i in range(23)]
    msgs = run(stub, prompt, max_tokens=14, ignore_eos=True)
    assert [len(m.token_ids) for m in msgs] == [1, 4, 4, 4, 1]  # 1 from prefill + 13 decoded
    assert msgs[-1].finish_reason == sampling_pb2.FINISH_REASON_LENGTH
    got = [t for m in msgs for t in m.token_ids]
    assert got == reference_generate(tiny_model.model, prompt, 14)
    assert msgs[-1].usage.completion_tokens == 14


def test_stop_string_inside_a_message_cuts_text_and_tokens(stub):
    from common.tokenizer import load_tokenizer
    prompt = [(11 * i + 5) % 5000 for i in range(30)]
    msgs = run(stub, prompt, max_tokens=20, ignore_eos=True)
    all_ids = [t for m in msgs for t in m.token_ids]
    full = "".join(m.text for m in msgs)
    stop = full[6:9]
    msgs = run(stub, prompt, max_tokens=20, ignore_eos=True, stop=[stop])
    assert msgs[-1].finish_reason == sampling_pb2.FINISH_REASON_STOP
    assert "".join(m.text for m in msgs) == full[: full.find(stop)]
    tok = load_tokenizer()
    completes = next(k for k in range(1, len(all_ids) + 1) if stop in tok.decode(all_ids[:k]))
    assert [t for m in msgs for t in m.token_ids] == all_ids[:completes]
    assert msgs[-1].usage.completion_tokens == completes


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_loops_hold_tokens_to_the_interval(tiny_model, overlap):
    # The plain loop and the overlap loop (its CPU code path) hand tokens over N at a time and
    # the tokens are those of the reference; an eos mid-way flushes what is held.
    prompts = [[(13 * i + j) % 9000 for i in range(n)] for j, n in enumerate([5, 16, 9])]
    lens = [12, 3, 20]
    params = [SamplingParams(max_tokens=n) for n in lens]
    got, rt = asyncio.run(generate(tiny_model, 0, prompts, params, overlap=overlap, stream_interval=3))
    eos = set(tiny_model.config.eos_token_ids)
    for i, (prompt, n) in enumerate(zip(prompts, lens)):
        assert got[i] == reference_generate(tiny_model.model, prompt, n, eos)
    assert rt.pool.blocks.num_free == rt.opts.num_blocks
