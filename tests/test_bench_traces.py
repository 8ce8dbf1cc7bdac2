"""bench/traces.py: the workloads `tandem bench` replays, and the oracle."""

from __future__ import annotations

from pathlib import Path

import json
import pytest

from bench import traces
from bench.metrics import summarize, table
from bench.client import RequestResult

DATASETS = Path(__file__).resolve().parents[2] / "shared" / "datasets"


def test_mooncake_hash_ids_map_to_equal_token_prefixes():
    reqs = traces.load_mooncake(traces.DEFAULT_TRACE, vocab=151646, limit=300)
    a, b = next((x, y) for i, x in enumerate(reqs) for y in reqs[i + 1:]
                if len(x.hash_ids) > 2 and y.hash_ids[:2] == x.hash_ids[:2])
    ta, tb = a.prompt_tokens(), b.prompt_tokens()
    assert len(ta) == a.input_len and max(ta) < 151646
    assert ta[:1024] == tb[:1024]  # two shared hash ids = 1,024 equal tokens
    assert traces.block_tokens(5, 100).tolist() == traces.block_tokens(5, 100).tolist()
    assert traces.block_tokens(5, 100).tolist() != traces.block_tokens(6, 100).tolist()
    # the conversation trace's 3-second steps are spread, in order
    times = [r.arrival_s for r in reqs]
    assert times == sorted(times) and len(set(times)) == len(times)


def test_spread_steps_and_oracle():
    assert traces.spread_steps([0, 0, 0, 3000, 3000]) == [0, 1000, 2000, 3000, 4500]
    reqs = [traces.BenchRequest(0, 0, 1, hash_ids=(1, 2, 3), input_len=1536),
            traces.BenchRequest(1, 0, 1, hash_ids=(1, 2, 4), input_len=1400),
            traces.BenchRequest(2, 0, 1, hash_ids=(5,), input_len=10)]
    o = traces.oracle_hit_rate(reqs)
    assert o["block"] == pytest.approx(2 / 7)
    assert o["engine_block"] == pytest.approx(2 / 7)  # blocks 1, 2 are full in request 0


@pytest.mark.skipif(not DATASETS.exists(), reason="../shared/datasets not present")
def test_other_datasets_load():
    az = traces.load_azure(DATASETS / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv", 1000, limit=20)
    assert len(az) == 20 and az[0].arrival_s == 0 and az[-1].arrival_s > 0 and az[0].prompt_len > 0
    sg = traces.load_sharegpt(DATASETS / "prompts" / "sharegpt_mlenergy" / "ShareGPT_V3_filtered_1000.json", 64,
                              limit=10)
    assert len(sg) == 10 and all(r.text for r in sg)
    mt = traces.load_mt_bench(traces.MT_BENCH, 32)
    assert len(mt) == 160 and mt[80].text.startswith(mt[0].text)
    syn = traces.synthetic_prefix(30, groups=3, prefix_len=64, suffix_len=8, output_len=4, vocab=1000)
    assert len({r.token_ids[:64] for r in syn}) == 3
    assert traces.oracle_hit_rate(syn, block=16)["token"] > 0.5


def test_summary_metrics():
    reqs = [traces.BenchRequest(0, 0.0, 3, hash_ids=(1,), input_len=512),
            traces.BenchRequest(1, 0.0, 3, hash_ids=(1, 2), input_len=1024)]
    res = [RequestResult(0, 0.0, 0.1, 0.3, [(0.1, 1), (0.3, 2)], 512, 3, 0),
           RequestResult(1, 0.0, 0.2, 0.4, [(0.2, 1), (0.4, 2)], 1024, 3, 512),
           RequestResult(2, error="UNAVAILABLE: no worker")]
    s = summarize(reqs + [traces.BenchRequest(2, 0.0, 3)], res, wall_s=0.5, speedup=10)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == {"UNAVAILABLE": 2 - 1}
    assert s["mean_ttft_ms"] == pytest.approx(1500)  # 0.15 s real x speedup 10
    assert s["mean_itl_ms"] == pytest.approx(1000)  # 0.2 s over 2 tokens, x10
    assert s["block_hit_rate"] == pytest.approx(1 / 3)
    assert "Mean TTFT" in table(s)
    assert s["error_examples"] == {"UNAVAILABLE": "UNAVAILABLE: no worker"} and "e.g. UNAVAILABLE: no worker" in table(s)


def test_a_run_where_every_request_failed_says_so_and_why():
    reqs = [traces.BenchRequest(i, 0.0, 3) for i in range(2)]
    why = "HTTP 400: prompt has 3002 tokens; the model's context length is 2048, so at most 2047 fit"
    s = summarize(reqs, [RequestResult(i, error=why) for i in range(2)], wall_s=0.5)
    out = table(s)
    assert "no request succeeded" in out and "Mean TTFT" not in out and why in out


def test_bad_or_empty_dataset_fails_naming_it(tmp_path):
    from bench.main import BenchOptions, load_requests

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": "x"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"--dataset mooncake:.*bad.jsonl: malformed row"):
        load_requests(BenchOptions(dataset=f"mooncake:{bad}"), 1000)
    with pytest.raises(ValueError, match=r"--dataset mooncake:.*empty.jsonl: no requests"):
        load_requests(BenchOptions(dataset=f"mooncake:{empty}"), 1000)


def test_oracle_summary_cuts_token_prompts_into_the_model_blocks():
    """Synthetic prompts share 256 tokens: a hit in 16-token blocks, none in the trace's 512."""
    syn = traces.synthetic_prefix(32, groups=8, prefix_len=256, suffix_len=256, output_len=4, vocab=1000)
    got = traces.oracle_summary(syn, 16)["oracle_token_hit_rate"]
    assert got > 0.3 and "oracle_block_hit_rate" not in traces.oracle_summary(syn, 16)
    assert traces.oracle_hit_rate(syn)["token"] == 0.0  # what the bench printed before


def test_ttft_lower_bound_prefills_only_what_no_earlier_request_stored():
    from mocker.timing import TimingModel
    t = TimingModel(prefill_per_token=1.0, prefill_attention=0.0, prefill_overhead=0.0)
    reqs = [traces.BenchRequest(0, 0.0, 1, hash_ids=(1, 2), input_len=1024),
            traces.BenchRequest(1, 1.0, 1, hash_ids=(1, 2, 3), input_len=1300),  # blocks 1, 2 stored: 276 left
            traces.BenchRequest(2, 2.0, 1, hash_ids=(1, 2), input_len=1024)]  # computes >= 1 token: block 2 again
    assert traces.ttft_lower_bounds(reqs, t) == {0: 1024, 1: 276, 2: 512}
    # arrival order, not list order, says which request came first (the simulator replays so)
    assert traces.ttft_lower_bounds(reqs[::-1], t) == {0: 1024, 1: 276, 2: 512}
    # the attention term charges each new token its context: cached tokens count
    t2 = TimingModel(prefill_per_token=0.0, prefill_attention=1.0, prefill_overhead=0.0)
    assert traces.ttft_lower_bounds(reqs[:2], t2)[1] == pytest.approx(276 * 1024 + 276 * 276 / 2)
    assert traces.ttft_lower_bounds([], t) == {}


def test_the_offline_replay_never_beats_the_ttft_bound():
    """Every request's simulated TTFT (mocker timing, KV router, 512-token blocks) is at least
    its bound: prompts sharing prefixes, a burst that queues, and a repeat after a pause."""
    from bench.sim import SimConfig, replay
    from mocker.timing import TimingModel
    timing = TimingModel(prefill_per_token=1e-5)
    reqs = [traces.BenchRequest(i, 0.01 * i, 4, hash_ids=(1, 2, 3 + i % 3, 10 + i), input_len=1800 + 37 * i, vocab=1000)
            for i in range(12)]
    reqs.append(traces.BenchRequest(12, 5.0, 4, hash_ids=(1, 2, 3, 10), input_len=1800, vocab=1000))
    bounds = traces.ttft_lower_bounds(reqs, timing)
    res = replay(reqs, SimConfig(mode="kv", num_workers=2, num_blocks=64, block_size=512, timing=timing))
    assert all(r.ok for r in res.results) and len(res.results) == len(reqs)
    for r in res.results:
        assert r.ttft_s >= bounds[r.index] - 1e-9, (r.index, r.ttft_s, bounds[r.index])


def test_skip_starts_every_file_dataset_at_its_row_and_the_header_says_how_they_arrive(tmp_path):
    from bench.main import BenchOptions, _arrival, _loaded, load_requests

    every = load_requests(BenchOptions(dataset="mt-bench", arrival="concurrency"), 1000)
    later = load_requests(BenchOptions(dataset="mt-bench", arrival="concurrency", skip=90, num_requests=5), 1000)
    assert [r.text for r in later] == [r.text for r in every[90:95]] and [r.index for r in later] == list(range(5))
    share = tmp_path / "share.json"
    share.write_text(json.dumps([{"conversations": [{"value": f"q{i}"}]} for i in range(6)]))
    assert [r.text for r in load_requests(BenchOptions(dataset=f"sharegpt:{share}", skip=4), 1000)] == ["q4", "q5"]
    with pytest.raises(ValueError, match="--skip starts at a row of a trace or prompt file"):
        load_requests(BenchOptions(dataset="synthetic-prefix", skip=3), 1000)
    with pytest.raises(ValueError, match=r"--dataset azure needs a path: azure:PATH, an Azure LLM inference trace"):
        load_requests(BenchOptions(dataset="azure"), 1000)
    # mt-bench has no timestamps (all 0): under --arrival trace it arrives as a Poisson process,
    # and says so; the header says what the load decided (one rule, `_load`'s)
    for dataset, said in (("mt-bench", "poisson at 1 requests/s (the requests' timestamps are all 0)"),
                          ("mooncake", "trace")):
        poisson = _loaded(BenchOptions(dataset=dataset, num_requests=4), 1000).poisson
        assert _arrival(BenchOptions(dataset=dataset), poisson) == said, dataset
    assert _arrival(BenchOptions(arrival="concurrency", concurrency=4), True) == "concurrency 4"


@pytest.mark.parametrize("field,value,words", [
    ("temperature", 0.0005, "--temperature must be 0 (greedy) or in [0.001"),  # the servers' MIN_TEMPERATURE
    ("temperature", 1e39, "--temperature"), ("temperature", float("nan"), "--temperature"),
    ("top_logprobs", 21, "--top-logprobs must be in [0, 20]"), ("top_logprobs", -1, "--top-logprobs"),
    ("bench_seed", -3, "--bench-seed must be in [0, 2^64)"), ("bench_seed", 2 ** 64, "--bench-seed")])
def test_bench_refuses_sampling_the_servers_would_refuse(field, value, words) -> None:
    from bench.main import BenchOptions
    with pytest.raises(ValueError) as err:
        BenchOptions(**{field: value})
    assert words in str(err.value)


def test_bench_seeds_wrap_around_the_seed_range() -> None:
    from bench.client import BenchSampling
    from bench.main import BenchOptions
    from bench.openai_client import completion_body
    from bench.traces import BenchRequest

    req = BenchRequest(index=2, arrival_s=0.0, output_len=4, token_ids=(1, 2))
    top = BenchSampling(temperature=1.0, seed=2 ** 64 - 1)
    assert top.seed_of(req) == 1 and top.proto(req).seed == 1 and completion_body(req, "m", top)["seed"] == 1
    assert BenchOptions(temperature=0.001, top_logprobs=20, bench_seed=2 ** 64 - 1).top_logprobs == 20


def test_progress_line_says_why_requests_fail_while_the_run_goes_on() -> None:
    from bench.client import RequestResult, progress_line
    ok = RequestResult(0, end_s=1.0)
    late = RequestResult(1, end_s=3.0, error="UNAVAILABLE: no decode worker")
    first = RequestResult(2, end_s=2.0, error="INVALID_ARGUMENT: token_ids: prompt has 9000 tokens" + "x" * 500)
    assert progress_line([ok, None, None], 15.2) == "tandem bench: 1/3 requests done, 15 s"
    line = progress_line([ok, late, first, None], 30)
    assert line.startswith("tandem bench: 3/4 requests done (2 failed; the first: INVALID_ARGUMENT: token_ids: "
                           "prompt has 9000 tokens") and line.endswith(", 30 s") and len(line) < 300, line


def test_requests_left_out_for_the_context_leave_the_others_arrivals_as_if_alone() -> None:
    from bench.main import BenchOptions, _loaded
    # mooncake rows 0..19 against a 2,048-token context, outputs capped at 8 (the cap first: it
    # makes rows fit): the kept rows' arrivals start at 0, as after --skip
    opts = BenchOptions(num_requests=20, max_output_len=8)
    every = _loaded(opts, 1000).reqs
    fit = [r for r in every if r.prompt_len + r.output_len <= 2048]
    got = _loaded(opts, 1000, context_length=2048)
    assert got.left_out == 20 - len(fit) > 0 and [r.index for r in got.reqs] == [r.index for r in fit]
    assert got.reqs[0].arrival_s == 0 and [b.arrival_s - a.arrival_s for a, b in zip(got.reqs, got.reqs[1:])] == \
        pytest.approx([b.arrival_s - a.arrival_s for a, b in zip(fit, fit[1:])])
    # Poisson arrivals are drawn for the kept requests alone: the rate asked for, not a thinned one
    pois = _loaded(BenchOptions(num_requests=400, max_output_len=8, arrival="poisson", rate=2.0), 1000, 2048).reqs
    assert len(pois) / pois[-1].arrival_s == pytest.approx(2.0, rel=0.25)
    # a text prompt's output alone can be too long: it counts as one token
    with pytest.raises(ValueError, match="every request of --dataset mt-bench"):
        _loaded(BenchOptions(dataset="mt-bench", num_requests=3, output_tokens=5000), 1000, 2048)
    assert _loaded(BenchOptions(dataset="mt-bench", num_requests=3, output_tokens=2047), 1000, 2048).left_out == 0
    assert _loaded(BenchOptions(num_requests=20, over_context="send"), 1000, 2048).left_out == 0
