"""The OpenAI-compatible HTTP API end to end: the official `openai` client (and curl) against a
router with --http-port, over a real etcd, real gRPC to real workers and real KV transfers;
every answer is checked against the gRPC API's answer to the same request."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time

import grpc
import httpx
import openai
import pytest
import torch

from common.pb.tandem.v1 import frontend_pb2, frontend_pb2_grpc, sampling_pb2
from worker.host import WorkerOptions
from harness import InProcessCluster
from router.chat_template import load_chat_template

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(etcd_server, tiny_model, one_torch_thread):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-http")
    c.router = c.start("router", http_port=0)
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


@pytest.fixture(scope="module")
def client(cluster):
    with openai.OpenAI(base_url=f"http://{cluster.router.http_address}/v1", api_key="none", max_retries=0,
                       timeout=60) as c:
        yield c


def grpc_run(stub, **kw) -> tuple[str, list[float], frontend_pb2.Usage, int]:
    """(text, logprobs, usage, finish reason) of one gRPC Generate."""
    msgs = list(stub.Generate(frontend_pb2.GenerateRequest(**kw), timeout=60))
    return ("".join(m.text for m in msgs), [lp for m in msgs for lp in m.logprobs], msgs[-1].usage,
            msgs[-1].finish_reason)


def prompt_ids(n: int, offset: int = 0) -> list[int]:
    return [(1000 + 7 * i + offset) % 150000 for i in range(n)]


def usage_of(u: frontend_pb2.Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens, "cached_tokens": u.cached_tokens}


def http_usage(u) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "cached_tokens": u.prompt_tokens_details.cached_tokens}


def wait_all_free(cluster, timeout=10.0) -> bool:
    total = cluster.worker_opts.num_blocks

    def counts():
        return (cluster.on_loop(lambda: cluster.prefill.runtime.pool.blocks.num_free),
                cluster.on_loop(lambda: cluster.decode.runtime.pool.blocks.num_free))
    deadline = time.time() + timeout
    while counts() != (total, total):
        if time.time() > deadline:
            return False
        time.sleep(0.02)
    return True


def assert_offsets(tokens: list[str], offsets: list[int], text: str | None = None) -> None:
    """text_offset: each token's offset in its choice's token texts, one per token; with the
    choice's text, each token up to the first one that decodes alone to a partial character is
    found in the text at its offset (a partial one reads `bytes:\\xNN`)."""
    chars = [1 if t.startswith("bytes:") else len(t) for t in tokens]  # part of a character: one, decoded alone
    assert offsets == [sum(chars[:i]) for i in range(len(tokens))] and len(tokens) > 1
    if text is not None:
        whole = [t for t in tokens[:next((i for i, t in enumerate(tokens) if t.startswith("bytes:")), len(tokens))]]
        assert len(whole) >= 3, tokens  # (the prompts below were picked so that this checks something)
        assert all(text[o:o + len(t)] == t for t, o in zip(whole, offsets)), (text, tokens, offsets)


@pytest.mark.parametrize("stream", [False, True])
def test_text_offsets_with_a_stop_string_that_holds_text_back(client, stream):
    # the stop-string matcher holds the last len(stop) - 1 characters back, so a message's text
    # does not start at its first token: the offsets count the tokens' texts, not the messages'
    kw = dict(model="tandem-tiny", prompt=prompt_ids(30, offset=7), max_tokens=20, logprobs=0, stop="qqqqqqqqqq")
    if stream:
        lps = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw) if c.choices[0].logprobs]
        assert_offsets([t for lp in lps for t in lp.tokens], [o for lp in lps for o in lp.text_offset])
    else:
        lp = client.completions.create(**kw).choices[0].logprobs
        assert_offsets(lp.tokens, lp.text_offset)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_equal_grpc(client, stub, stream):
    ids = prompt_ids(40, offset=3 + stream)
    text, logprobs, usage, _ = grpc_run(stub, token_ids=ids, sampling=sampling_pb2.SamplingParams(max_tokens=12))
    if stream:
        chunks = list(client.completions.create(model="tandem-tiny", prompt=ids, max_tokens=12, logprobs=0,
                                                stream=True, stream_options={"include_usage": True}))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        got_lps = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.token_logprobs]
        lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        assert_offsets([t for lp in lps for t in lp.tokens], [o for lp in lps for o in lp.text_offset], got)
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
        got_usage = chunks[-1].usage
    else:
        r = client.completions.create(model="tandem-tiny", prompt=ids, max_tokens=12, logprobs=0)
        got, got_lps, got_usage = r.choices[0].text, r.choices[0].logprobs.token_logprobs, r.usage
        assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
        assert len(r.choices[0].logprobs.tokens) == 12
        assert_offsets(r.choices[0].logprobs.tokens, r.choices[0].logprobs.text_offset, r.choices[0].text)
    assert got == text
    assert got_lps == pytest.approx(logprobs, abs=1e-6) and len(got_lps) == 12
    # The same prompt again: the prefix cache answers part of it, on both paths alike.
    assert http_usage(got_usage) == {**usage_of(usage), "cached_tokens": http_usage(got_usage)["cached_tokens"]}
    assert usage.completion_tokens == 12 and got_usage.prompt_tokens == 40


def test_text_prompt_and_usage_equal_grpc(client, stub):
    prompt = "To be, or not to be, that is the question"
    text, _, usage, _ = grpc_run(stub, text=prompt, sampling=sampling_pb2.SamplingParams(max_tokens=8))
    r = client.completions.create(model="tandem-tiny", prompt=prompt, max_tokens=8)
    assert r.choices[0].text == text
    assert http_usage(r.usage) == usage_of(usage) | {"cached_tokens": r.usage.prompt_tokens_details.cached_tokens}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_equals_grpc_on_the_templated_prompt(client, stub, stream):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about Hawaii"}]
    template = load_chat_template(None)  # tandem-tiny has no template: the default, whose turn ends at a blank line
    prompt = template.render(messages)
    text, logprobs, usage, _ = grpc_run(stub, text=prompt, sampling=sampling_pb2.SamplingParams(
        max_tokens=10, stop=list(template.turn_end)))
    if stream:
        chunks = list(client.chat.completions.create(model="tandem-tiny", messages=messages, max_completion_tokens=10,
                                                     stream=True, stream_options={"include_usage": True}))
        assert chunks[0].choices[0].delta.role == "assistant"
        got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens == usage.completion_tokens
        assert chunks[-1].usage.prompt_tokens == usage.prompt_tokens
    else:
        r = client.chat.completions.create(model="tandem-tiny", messages=messages, max_completion_tokens=10,
                                           logprobs=True)
        got = r.choices[0].message.content
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
        assert [c.logprob for c in r.choices[0].logprobs.content] == pytest.approx(logprobs, abs=1e-6)
        assert len(r.choices[0].logprobs.content) == usage.completion_tokens
        assert r.usage.prompt_tokens == usage.prompt_tokens and r.usage.completion_tokens == usage.completion_tokens
    assert got == text


def test_stop_string_cuts_like_grpc(client, stub):
    ids = prompt_ids(20, offset=11)
    full, _, _, _ = grpc_run(stub, token_ids=ids, sampling=sampling_pb2.SamplingParams(max_tokens=16))
    stop = next(full[i:i + 2] for i in range(len(full) // 2, len(full) - 1) if full[i:i + 2].strip())
    want, _, usage, reason = grpc_run(stub, token_ids=ids, sampling=sampling_pb2.SamplingParams(max_tokens=16,
                                                                                                  stop=[stop]))
    assert reason == sampling_pb2.FINISH_REASON_STOP and stop not in want
    r = client.completions.create(model="tandem-tiny", prompt=ids, max_tokens=16, stop=stop)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want, "stop")
    assert r.usage.completion_tokens == usage.completion_tokens
    chunks = list(client.completions.create(model="tandem-tiny", prompt=ids, max_tokens=16, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_reproducible_and_equal_grpc(client, stub):
    ids = prompt_ids(30, offset=5)
    kw = dict(model="tandem-tiny", prompt=ids, max_tokens=12, temperature=1.0, top_p=0.9)
    a = client.completions.create(seed=7, **kw).choices[0].text
    assert a == client.completions.create(seed=7, **kw).choices[0].text
    assert a != client.completions.create(seed=8, **kw).choices[0].text
    text, _, _, _ = grpc_run(stub, token_ids=ids, sampling=sampling_pb2.SamplingParams(
        max_tokens=12, temperature=1.0, top_p=0.9, seed=7))
    assert a == text


@pytest.mark.parametrize("kw, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"stop": [""]}, "stop"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"prompt": [[1, 2]] * 65, "n": 2}, "n"),  # 130 choices
    ({"prompt": [[1, 2]] * 129}, "prompt"),
    ({"prompt": [[1, 2], [1, 999999]]}, "prompt[1][1]"),  # the router's vocabulary check, named in the batch
    ({"prompt": [[1, 999999]]}, "prompt[0][1]"),  # a batch of one too
    ({"prompt": [[1, 2], [1, 2 ** 40]]}, "prompt[1][1]"),
    ({"prompt": ["a", ""]}, "prompt[1]"),
    ({"best_of": 3, "n": 2}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt": [1, 999999]}, "prompt[1]"),
    ({"prompt": ""}, "prompt"),
    ({"extra_body": {"max_tokens": "many"}}, "max_tokens"),
    ({"seed": -3}, "seed"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logprobs": False}, "logprobs"),  # a count, not a switch: false is no 0 (it turned logprobs on)
    ({"max_tokens": True}, "max_tokens"),  # (was 1 token)
    ({"n": "2"}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias[999999]"),  # the router's vocabulary check
    ({"logit_bias": {"5": 101}}, "logit_bias[5]"),
    ({"logit_bias": {"99999999999": 1}}, "logit_bias[99999999999]"),
    ({"logit_bias": {"9" * 4301: 1}}, "logit_bias[999999999999… (4301 characters)]"),  # (int() raised: a 500)
    ({"logit_bias": {"1" + "0" * 30: 1}}, "logit_bias[100000000000… (31 characters)]"),
    ({"logit_bias": {" 5": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),  # counted before each key is checked
    ({"logit_bias": {"05": 1}}, "logit_bias"),  # (with "5" it named one id twice)
    ({"logit_bias": {"1_99": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 100.000004}}, "logit_bias[5]"),  # (float32 made it 100, "must be in [-100, 100], got 100")
    ({"logit_bias": {"5": True}}, "logit_bias[5]"),
    ({"logit_bias": {"5": "1e2"}}, "logit_bias[5]"),
    ({"frequency_penalty": 2.0000001}, "frequency_penalty"),
    ({"temperature": 1e-46}, "temperature"),  # (float32 made it 0: greedy, answered 200)
    ({"temperature": 1e39}, "temperature"),  # (float32 made it inf: the worker's "got inf")
    ({"top_p": 1e-46}, "top_p"),  # (float32 made it 0: the worker's "got 0.0")
    ({"top_p": 1.00000001}, "top_p"),
])
def test_completions_bad_parameter_is_400_naming_it(client, kw, param):
    args = {"model": "tandem-tiny", "prompt": [1, 2, 3], "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**args)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"].startswith(param), err


@pytest.mark.parametrize("kw, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages[0].role"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": 100000}, "max_completion_tokens"),
    ({"max_completion_tokens": 5, "max_tokens": 2}, "max_completion_tokens"),
    ({"temperature": 0.0001}, "temperature"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"messages": [{"role": "user", "content": []}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": "hi", "name": "ROMEO\n\nJULIET"}]}, "messages[0].name"),
    ({"max_completion_tokens": True}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": None, "text": "b"}]}]},
     "messages[0].content[1].type"),
    ({"messages": [{"role": "user", "content": [{"text": "a"}]}]}, "messages[0].content[0].type"),
])
def test_chat_bad_parameter_is_400_naming_it(client, kw, param):
    args = {"model": "tandem-tiny", "messages": [{"role": "user", "content": "hi"}], **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    message = e.value.body["message"]
    assert "max_tokens (" not in message and "e-05" not in message, message  # the client's words; no float32 tail
    if kw.get("max_completion_tokens", 0) > 10:
        assert "+ max_completion_tokens (100000) exceeds" in message, message
    if "max_tokens" in kw:  # our own message, not rewritten
        assert message == "max_completion_tokens: set max_completion_tokens or max_tokens, not both", message
    if "temperature" in kw:
        assert message.endswith("got 0.0001"), message


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_models_health_metrics(client, cluster):
    models = client.models.list().data
    assert [m.id for m in models] == ["tandem-tiny"] and models[0].max_model_len == 4096
    assert client.models.retrieve("tandem-tiny").id == "tandem-tiny"
    base = f"http://{cluster.router.http_address}"
    h = httpx.get(f"{base}/health")
    assert h.status_code == 200 and h.json()["decode_workers"] == 1

    before = router_requests(cluster, "OK", "length")
    client.completions.create(model="tandem-tiny", prompt=[5, 6, 7], max_tokens=2)
    assert router_requests(cluster, "OK", "length") == before + 1  # the same Generate metrics as gRPC's


def test_malformed_json_and_unknown_route(cluster):
    base = f"http://{cluster.router.http_address}"
    r = httpx.post(f"{base}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{base}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_n_choices_each_equal_grpc_with_its_seed(client, stub):
    """n = 3 sampled choices of one prompt: choice j is the gRPC answer with seed + j; the prompt
    counts once in usage, every choice's tokens do."""
    ids = prompt_ids(30, offset=31)
    kw = dict(model="tandem-tiny", prompt=ids, max_tokens=10, temperature=1.0, seed=41)
    want = [grpc_run(stub, token_ids=ids, sampling=sampling_pb2.SamplingParams(
        max_tokens=10, temperature=1.0, seed=41 + j)) for j in range(3)]
    r = client.completions.create(n=3, logprobs=0, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [w[0] for w in want]
    assert len({c.text for c in r.choices}) == 3  # distinct seeds, distinct answers
    for c, w in zip(r.choices, want):
        assert c.logprobs.token_logprobs == pytest.approx(w[1], abs=1e-6) and c.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (30, 30, 60)
    chunks = list(client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    got = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == j) for j in range(3)]
    assert got == [w[0] for w in want]
    finishes = [(c.choices[0].index, c.choices[0].finish_reason) for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [(0, "length"), (1, "length"), (2, "length")]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    chat = client.chat.completions.create(model="tandem-tiny", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=6, n=2, temperature=1.0, seed=3)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 12
    assert all(c.message.role == "assistant" for c in chat.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_answers_each_as_grpc(client, stub, stream, cluster):
    """A list of prompts with n = 2 (greedy): choice i × 2 + j answers prompt i, as gRPC does."""
    prompts = [prompt_ids(12 + 5 * i, offset=40 + i + 4 * stream) for i in range(3)]
    want = [grpc_run(stub, token_ids=p, sampling=sampling_pb2.SamplingParams(max_tokens=7)) for p in prompts]
    kw = dict(model="tandem-tiny", prompt=prompts, max_tokens=7, n=2)
    if stream:
        chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        got = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == k) for k in range(6)]
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and all(len(c.choices) == 1 for c in chunks[:-1])
    else:
        r = client.completions.create(**kw)
        assert [c.index for c in r.choices] == list(range(6))
        got, usage = [c.text for c in r.choices], r.usage
    assert got == [w[0] for w in want for _ in range(2)]
    assert usage.prompt_tokens == sum(len(p) for p in prompts) and usage.completion_tokens == 6 * 7
    assert wait_all_free(cluster)


def test_a_choice_refused_by_the_router_refuses_the_request_and_frees_the_others(client, cluster):
    """The second prompt is too long for the context: a 400 naming it; the first prompt's call,
    started beside it, is cancelled and leaves no block behind."""
    long = prompt_ids(cluster.router.servicer.context_length + 1, offset=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tandem-tiny", prompt=[prompt_ids(50, offset=2), long], max_tokens=8)
    assert e.value.body["param"] == "prompt[1]", e.value.body
    assert wait_all_free(cluster)


def test_a_refused_choice_answers_at_once_while_the_others_would_queue(client, cluster):
    """Three long choices (the worker admits two at a time) and a prompt too long for the context:
    the 400 comes at once, not after the admitted choices generated their 3,000 tokens."""
    assert wait_all_free(cluster)
    long = prompt_ids(cluster.router.servicer.context_length + 1, offset=1)
    started = time.time()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tandem-tiny", prompt=[prompt_ids(100, offset=50 + i) for i in range(3)] + [long],
                                  max_tokens=3000, extra_body={"ignore_eos": True})
    assert e.value.body["param"] == "prompt[3]" and time.time() - started < 20, e.value.body
    assert wait_all_free(cluster)


def test_disconnect_mid_stream_of_several_choices_frees_every_block(cluster):
    assert wait_all_free(cluster)
    total = cluster.worker_opts.num_blocks
    # three choices that fit the pool together (the worker admits by prompt + max_tokens; a choice it
    # queued would hold back the response's start, which waits for every choice's first token)
    body = {"model": "tandem-tiny", "prompt": prompt_ids(100, offset=19), "max_tokens": 1500, "stream": True,
            "ignore_eos": True, "n": 3, "temperature": 1.0}
    cancelled = router_requests(cluster, "CANCELLED", "cancelled")
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"http://{cluster.router.http_address}/v1/completions", json=body) as r:
            assert r.status_code == 200
            seen = set()
            for line in r.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    seen.add(json.loads(line[5:])["choices"][0]["index"])
                    if seen == {0, 1, 2}:  # checked here: leaving the loop may close the stream at once
                        assert cluster.on_loop(lambda: cluster.router.servicer.running) == 3
                        assert cluster.on_loop(lambda: cluster.decode.runtime.pool.blocks.num_free) < total
                        break
            assert seen == {0, 1, 2}
    assert wait_all_free(cluster), "blocks still held after the client went away"
    deadline = time.time() + 10
    while router_requests(cluster, "CANCELLED", "cancelled") != cancelled + 3 and time.time() < deadline:
        time.sleep(0.05)
    assert router_requests(cluster, "CANCELLED", "cancelled") == cancelled + 3  # all three, none finished


def router_requests(cluster, code: str, outcome: str) -> float:
    text = httpx.get(f"http://{cluster.router.http_address}/metrics").text
    m = re.search(rf'^tandem_router_requests_total\{{code="{code}",outcome="{outcome}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_disconnect_mid_stream_frees_every_block(cluster):
    assert wait_all_free(cluster)
    total = cluster.worker_opts.num_blocks
    cancelled = router_requests(cluster, "CANCELLED", "cancelled")
    body = {"model": "tandem-tiny", "prompt": prompt_ids(100, offset=9), "max_tokens": 3900, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"http://{cluster.router.http_address}/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    if len(events) == 3:
                        break
            assert cluster.on_loop(lambda: cluster.decode.runtime.pool.blocks.num_free) < total
    assert wait_all_free(cluster), "blocks still held after the client went away"
    assert router_requests(cluster, "CANCELLED", "cancelled") == cancelled + 1  # cancelled, not finished


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_curl_streams_server_sent_events(cluster):
    body = json.dumps({"model": "tandem-tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5,
                       "stream": True})
    out = subprocess.run(["curl", "-sN", f"http://{cluster.router.http_address}/v1/chat/completions",
                          "-H", "Content-Type: application/json", "-d", body],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    events = [line.removeprefix("data: ") for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and all(line == "" or line.startswith("data: ") for line in out.splitlines())
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_no_decode_worker_is_503_and_overload_is_429(etcd_server, tiny_model, one_torch_thread):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="e2e-http-empty",
                         worker_opts=WorkerOptions(num_blocks=4))
    try:
        router = c.start("router", http_port=0)
        with openai.OpenAI(base_url=f"http://{router.http_address}/v1", api_key="none", max_retries=0) as client:
            with pytest.raises(openai.InternalServerError) as e:
                client.completions.create(model="tandem-tiny", prompt=[1, 2, 3], max_tokens=2)
            assert e.value.status_code == 503 and e.value.body["type"] == "service_unavailable_error"
            assert httpx.get(f"http://{router.http_address}/health").status_code == 503
            c.start("decode")
            c.wait_roles(router, 0, 1)
            # 4 blocks of 16 tokens: a 100-token prompt can never fit this worker's pool.
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(model="tandem-tiny", prompt=prompt_ids(100), max_tokens=2)
            assert e.value.status_code == 429 and e.value.body["code"] == "resource_exhausted"
    finally:
        c.close()


def test_disconnect_while_waiting_for_a_whole_response_frees_every_block(cluster):
    assert wait_all_free(cluster)
    cancelled = router_requests(cluster, "CANCELLED", "cancelled")
    body = {"model": "tandem-tiny", "prompt": prompt_ids(60, offset=13), "max_tokens": 3900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"http://{cluster.router.http_address}/v1/completions", json=body, timeout=1.0)
    assert wait_all_free(cluster), "blocks still held after the client went away"
    assert router_requests(cluster, "CANCELLED", "cancelled") == cancelled + 1


def test_bench_backend_openai_equals_grpc(cluster):
    """`tandem bench --backend openai`'s client: every request completes with the gRPC client's
    token counts, each streamed event timed with its tokens."""
    import asyncio

    from bench.client import run_load
    from bench.traces import BenchRequest

    reqs = [BenchRequest(index=i, arrival_s=0.0, output_len=6, token_ids=tuple(prompt_ids(20 + i, offset=17)))
            for i in range(4)]
    grpc_results, _ = asyncio.run(run_load(cluster.router.address, reqs, concurrency=2, progress=False))
    http_results, _ = asyncio.run(run_load(cluster.router.address, reqs, concurrency=2, progress=False,
                                           http_url=f"http://{cluster.router.http_address}", model="tandem-tiny"))
    for g, h in zip(grpc_results, http_results):
        assert g.ok and h.ok, (g.error, h.error)
        assert (h.prompt_tokens, h.completion_tokens) == (g.prompt_tokens, g.completion_tokens) == (g.prompt_tokens, 6)
        assert sum(n for _, n in h.chunks) == 6 and h.ttft_s is not None and h.ttft_s <= h.end_s - h.start_s


def test_bench_samples_and_asks_for_top_logprobs_on_both_apis(cluster):
    """`tandem bench --temperature 0.7 --top-logprobs 3`: request i is seeded bench_seed + i on both
    APIs, and both servers accept and serve what it asks for."""
    import asyncio

    from bench.client import BenchSampling, run_load
    from bench.openai_client import completion_body
    from bench.traces import BenchRequest

    sampling = BenchSampling(temperature=0.7, top_logprobs=3, seed=40)
    reqs = [BenchRequest(index=i, arrival_s=0.0, output_len=5, token_ids=tuple(prompt_ids(12 + i, offset=5)))
            for i in range(3)]
    params = sampling.proto(reqs[2])
    assert (params.temperature, params.top_logprobs, params.seed, params.max_tokens) == (
        pytest.approx(0.7), 3, 42, 5)
    body = completion_body(reqs[2], "tandem-tiny", sampling)
    assert (body["temperature"], body["logprobs"], body["seed"]) == (0.7, 3, 42)
    assert not BenchSampling().proto(reqs[2]).HasField("seed") and "seed" not in completion_body(reqs[2], "m")
    for http_url in ("", f"http://{cluster.router.http_address}"):
        results, _ = asyncio.run(run_load(cluster.router.address, reqs, concurrency=3, progress=False,
                                          http_url=http_url, model="tandem-tiny", sampling=sampling))
        assert all(r.ok and r.completion_tokens == 5 and sum(n for _, n in r.chunks) == 5 for r in results), \
            [(r.error, r.completion_tokens) for r in results]


def test_bench_backend_openai_finds_the_routers_http_api_by_itself(cluster, stub, capsys):
    # before, the bench dialled http://127.0.0.1:8000 unless told --http-url
    from bench.main import BenchOptions, run

    model = stub.ListModels(frontend_pb2.ListModelsRequest(), timeout=10).models[0]
    assert model.http_url == f"http://{cluster.router.http_address}"
    summary = run(BenchOptions(router=cluster.router.address, backend="openai", dataset="mt-bench", num_requests=2,
                               output_tokens=2, arrival="concurrency", router_wait_s=10))
    assert summary["completed"] == 2 and summary["failed"] == 0, summary
    assert f"to {model.http_url}/v1/completions" in capsys.readouterr().err


def test_bench_says_how_far_it_is_when_stderr_is_no_terminal(cluster, monkeypatch, capsys):
    """Without a terminal tqdm stays silent; a line every PROGRESS_EVERY_S says how far the run is."""
    import asyncio

    from bench import client
    from bench.traces import BenchRequest

    monkeypatch.setattr(client, "PROGRESS_EVERY_S", 0.2)
    reqs = [BenchRequest(index=i, arrival_s=0.3 * i, output_len=4, token_ids=tuple(prompt_ids(20, offset=60 + i)))
            for i in range(4)]
    results, _ = asyncio.run(client.run_load(cluster.router.address, reqs, progress=True))
    assert all(r.ok for r in results)
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("tandem bench: ")]
    assert lines and all(re.match(r"tandem bench: \d/4 requests done, \d+ s$", x) for x in lines), lines


def test_disconnect_before_the_first_token_frees_every_block(cluster):
    """The client goes away while its long prompt is still being prefilled."""
    import socket

    assert wait_all_free(cluster)
    cancelled = router_requests(cluster, "CANCELLED", "cancelled")
    body = json.dumps({"model": "tandem-tiny", "prompt": prompt_ids(3000, offset=21), "max_tokens": 500,
                       "ignore_eos": True}).encode()
    host, port = cluster.router.http_address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.time() + 10
        while cluster.on_loop(lambda: cluster.router.servicer.running) == 0 and time.time() < deadline:
            time.sleep(0.005)
        assert cluster.on_loop(lambda: cluster.router.servicer.running) == 1
    assert wait_all_free(cluster, timeout=30), "blocks still held after the client went away"
    deadline = time.time() + 10
    while router_requests(cluster, "CANCELLED", "cancelled") != cancelled + 1 and time.time() < deadline:
        time.sleep(0.05)
    assert router_requests(cluster, "CANCELLED", "cancelled") == cancelled + 1


def test_grpc_top_logprobs_equal_the_reference_through_prefill_and_decode_workers(stub, tiny_model):
    # token 0 comes from the prefill worker's answer, the rest from the decode loop
    from engine.reference import reference_generate
    from engine.sampling import sample, sampling_logprobs
    from common.sampling_params import SamplingParams
    ids = prompt_ids(26, offset=13)
    for p in (SamplingParams(max_tokens=6, top_logprobs=4, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.9, top_p=0.7, seed=5, top_logprobs=20, ignore_eos=True)):
        rows = []

        def keep(row, step, p=p):
            rows.append(row)
            return sample(row, p, step)[0]
        want = reference_generate(tiny_model.model, ids, p.max_tokens, sample_fn=keep)
        msgs = list(stub.Generate(frontend_pb2.GenerateRequest(token_ids=ids, sampling=sampling_pb2.SamplingParams(
            max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, seed=p.seed,
            top_logprobs=p.top_logprobs, ignore_eos=True)), timeout=60))
        assert [t for m in msgs for t in m.token_ids] == want
        tops = [t for m in msgs for t in m.top_logprobs]
        assert len(tops) == len(want)
        for row, top in zip(rows, tops):
            values, order = sampling_logprobs(row, p).topk(p.top_logprobs)
            keep_ = ~torch.isinf(values)
            assert list(top.token_ids) == order[keep_].tolist()
            assert list(top.logprobs) == pytest.approx(values[keep_].tolist(), abs=1e-5)


@pytest.mark.parametrize("stream", [False, True])
def test_http_top_logprobs_are_the_grpc_ones_as_text(client, stub, tiny_model, stream):
    ids = prompt_ids(22, offset=17 + stream)
    msgs = list(stub.Generate(frontend_pb2.GenerateRequest(token_ids=ids, sampling=sampling_pb2.SamplingParams(
        max_tokens=7, top_logprobs=3, ignore_eos=True)), timeout=60))
    tok = tiny_model.tokenizer()
    grpc_tops = [t for m in msgs for t in m.top_logprobs]
    kw = dict(model="tandem-tiny", prompt=ids, max_tokens=7, logprobs=3, extra_body={"ignore_eos": True})
    if stream:
        lps = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kw)
               if c.choices and c.choices[0].logprobs]
        tops = [t for lp in lps for t in lp.top_logprobs]
        tokens = [t for lp in lps for t in lp.tokens]
    else:
        lp = client.completions.create(**kw).choices[0].logprobs
        tops, tokens = lp.top_logprobs, lp.tokens
    assert len(tops) == len(grpc_tops) == 7
    for got, want, token in zip(tops, grpc_tops, tokens):
        first = {}
        for i, lp in zip(want.token_ids, want.logprobs):
            first.setdefault(tok.token_shown(i), lp)
        assert list(got.values()) == pytest.approx(list(first.values()), abs=1e-6)
        assert token in got  # greedy: the token is the likeliest
        texts = [tok.token_shown(i) for i in want.token_ids]
        assert list(got) == list(dict.fromkeys(texts))  # each text once, the likelier first
    chat = client.chat.completions.create(model="tandem-tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=5, logprobs=True, top_logprobs=4)
    for c in chat.choices[0].logprobs.content:
        assert len(c.top_logprobs) == 4 and c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6)
        assert [a.logprob for a in c.top_logprobs] == sorted((a.logprob for a in c.top_logprobs), reverse=True)
        for a in [c, *c.top_logprobs]:  # a token's own bytes; part of a character reads bytes:\\xNN
            shown = "bytes:" + "".join(f"\\x{b:02x}" for b in a.bytes)
            assert a.bytes == list(a.token.encode()) if not a.token.startswith("bytes:") else a.token == shown


@pytest.mark.parametrize("stream", [False, True])
def test_logit_bias_forces_and_bans_tokens(client, stub, stream):
    ids = prompt_ids(18, offset=23 + stream)
    msgs = list(stub.Generate(frontend_pb2.GenerateRequest(token_ids=ids, sampling=sampling_pb2.SamplingParams(
        max_tokens=5, ignore_eos=True)), timeout=60))
    plain, first = "".join(m.text for m in msgs), msgs[0].token_ids[0]
    kw = dict(model="tandem-tiny", prompt=ids, max_tokens=5, extra_body={"ignore_eos": True})
    forced = client.completions.create(logit_bias={"4242": 100}, logprobs=1, **kw)
    lp = forced.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(set(lp.tokens)) == 1  # the one forced token, every time
    assert all(v > -1e-3 for v in lp.token_logprobs)  # of the biased distribution: all but certain
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, logit_bias={
            str(first): -100}, **kw) if c.choices)
    else:
        text = client.completions.create(logit_bias={str(first): -100}, **kw).choices[0].text
    banned = list(stub.Generate(frontend_pb2.GenerateRequest(token_ids=ids, sampling=sampling_pb2.SamplingParams(
        max_tokens=5, ignore_eos=True, logit_bias={first: -100.0})), timeout=60))
    assert first not in [t for m in banned for t in m.token_ids]
    assert text == "".join(m.text for m in banned) != plain


def test_a_null_stands_for_the_default(cluster):
    # OpenAI's API takes null for any optional field; clients built on it send them
    base = f"http://{cluster.router.http_address}/v1"
    nulls = {k: None for k in ("n", "stream", "echo", "presence_penalty", "frequency_penalty", "ignore_eos",
                               "logprobs", "stream_options", "best_of", "seed", "stop", "temperature")}
    r = httpx.post(f"{base}/completions", json={"prompt": [1, 2, 3], "max_tokens": 2, **nulls}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    chat = {"messages": [{"role": "user", "content": "hi", "name": None}], "max_completion_tokens": 2, **nulls,
            "logprobs": None, "top_logprobs": None, "tools": None}
    r = httpx.post(f"{base}/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None, r.text
    r = httpx.post(f"{base}/chat/completions", json={**chat, "response_format": {"type": None}}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{base}/chat/completions", json={"messages": None}, timeout=60)  # required: null is no default
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


@pytest.mark.parametrize("via_prefill", [False, True])
def test_penalties_count_the_tokens_generated_before_a_migration(cluster, tiny_model, via_prefill):
    # a migrated request arrives with its generated tokens at the end of token_ids
    # (sampling_step_offset of them): the first token (prefilled here or by the prefill worker)
    # and every later one count them. Negative penalties pull the draws towards those tokens,
    # and each step's top log-probabilities show every one of them raised, on every step
    from decode_helpers import reference_draws
    from common.pb.tandem.v1 import decode_pb2, decode_pb2_grpc
    from common.sampling_params import SamplingParams
    prompt = prompt_ids(15, offset=41 + via_prefill)
    before = reference_draws(tiny_model.model, prompt, 5, SamplingParams(max_tokens=5))
    p = SamplingParams(max_tokens=6, ignore_eos=True, presence_penalty=-2.0, frequency_penalty=-2.0, top_logprobs=5)
    rows = []
    want = reference_draws(tiny_model.model, prompt + before, 6, p, generated=before, rows=rows)
    alone = reference_draws(tiny_model.model, prompt + before, 6, p, generated=before, history=[])
    assert want != alone  # (so the test can tell: the first token)
    req = decode_pb2.DecodeRequest(request_id=f"pen-{via_prefill}", token_ids=prompt + before,
                                   sampling_step_offset=len(before),
                                   prefill_address=cluster.prefill.address if via_prefill else "",
                                   sampling=sampling_pb2.SamplingParams(
                                       max_tokens=6, ignore_eos=True, presence_penalty=-2.0, frequency_penalty=-2.0,
                                       top_logprobs=5))
    with grpc.insecure_channel(cluster.decode.address) as ch:
        msgs = list(decode_pb2_grpc.DecodeServiceStub(ch).Generate(req, timeout=60))
    assert [t for m in msgs for t in m.token_ids] == want
    tops = [t for m in msgs for t in m.top_logprobs]
    for row, top in zip(rows, tops):  # every step's (the later ones: the decode loop's history)
        values, ids = torch.log_softmax(row, -1).topk(5)
        assert list(top.token_ids) == ids.tolist()
        assert list(top.logprobs) == pytest.approx(values.tolist(), abs=1e-4)
    assert set(before) <= set(tops[-1].token_ids)  # (every earlier token raised into the top five)

def test_tokens_that_are_part_of_a_character_read_as_their_bytes(client):
    # byte-level BPE tokens 128, 103 and 159 are single bytes of multi-byte characters: decoded
    # alone each read "\ufffd", and three alternatives were indistinguishable (and collapsed to
    # one key in the completions API's object)
    bias = {"128": 30, "103": 30, "159": 29}
    chat = client.chat.completions.create(model="tandem-tiny", messages=[{"role": "user", "content": "x"}],
                                          max_completion_tokens=1, logprobs=True, top_logprobs=3, logit_bias=bias)
    top = chat.choices[0].logprobs.content[0].top_logprobs
    assert sorted((a.token, tuple(a.bytes)) for a in top) == [
        ("bytes:\\xaa", (0xAA,)), ("bytes:\\xc4", (0xC4,)), ("bytes:\\xe3", (0xE3,))]
    done = client.completions.create(model="tandem-tiny", prompt="ROMEO:\n", max_tokens=1, logprobs=3, logit_bias=bias)
    assert sorted(done.choices[0].logprobs.top_logprobs[0]) == ["bytes:\\xaa", "bytes:\\xc4", "bytes:\\xe3"]


def test_a_step_offset_beyond_the_prompt_is_refused_by_name(cluster):
    # it counts the generated tokens at the end of token_ids: more than the prompt holds would
    # have made a penalized request's history wrap around
    from common.pb.tandem.v1 import decode_pb2, decode_pb2_grpc
    with grpc.insecure_channel(cluster.decode.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(decode_pb2_grpc.DecodeServiceStub(ch).Generate(decode_pb2.DecodeRequest(
                token_ids=[5, 6, 7], sampling_step_offset=3, sampling=sampling_pb2.SamplingParams(
                    max_tokens=2, frequency_penalty=1.0)), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("sampling_step_offset")


def test_offsets_count_a_partial_characters_token_as_one_character(client):
    # a token that is part of a character is listed as bytes:\\xNN, but it adds one character
    # (U+FFFD) to the text as text_offset counts it, not the label's ten
    done = client.completions.create(model="tandem-tiny", prompt="ROMEO:\n", max_tokens=4, logprobs=0,
                                     logit_bias={"65": 100, "159": 99}, frequency_penalty=2.0)
    lp = done.choices[0].logprobs
    assert any(t.startswith("bytes:") for t in lp.tokens), lp.tokens
    assert_offsets(lp.tokens, lp.text_offset)


def http_responses(cluster, route: str, code: int) -> float:
    text = httpx.get(f"http://{cluster.router.http_address}/metrics").text
    m = re.search(rf'^tandem_router_http_responses_total\{{code="{code}",route="{route}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_every_http_response_is_counted_refusals_before_generate_too(cluster):
    """A body that is no JSON, a wrong type and an empty message list never reach Generate
    (tandem_router_requests_total does not see them): tandem_router_http_responses_total counts
    them by route and status, as it counts the answered ones and unknown paths."""
    url = f"http://{cluster.router.http_address}"
    chat, comp = "/v1/chat/completions", "/v1/completions"
    before = {key: http_responses(cluster, *key) for key in [(chat, 400), (comp, 400), (comp, 200), ("other", 404)]}
    with httpx.Client(timeout=60) as http:
        assert http.post(url + comp, content=b"nojson").status_code == 400
        assert http.post(url + comp, json={"model": "tandem-tiny", "prompt": "a", "max_tokens": "x"}).status_code == 400
        assert http.post(url + chat, json={"model": "tandem-tiny", "messages": []}).status_code == 400
        assert http.post(url + comp, json={"model": "tandem-tiny", "prompt": "a", "max_tokens": 1}).status_code == 200
        assert http.get(url + "/v1/nothing-here").status_code == 404
    assert http_responses(cluster, comp, 400) == before[comp, 400] + 2
    assert http_responses(cluster, chat, 400) == before[chat, 400] + 1
    assert http_responses(cluster, comp, 200) == before[comp, 200] + 1
    assert http_responses(cluster, "other", 404) == before["other", 404] + 1
