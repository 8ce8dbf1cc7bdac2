"""Top log-probabilities (sampling.top_logprobs): each decoded token's most likely alternatives,
under the distribution it was drawn from, equal the reference model's, on the decode loop's
both paths (the overlap loop and the plain one); and the batched function's own contract."""

from __future__ import annotations

import asyncio

import pytest
import torch

from common.sampling_params import SamplingParams
from decode_helpers import generate
from engine.reference import reference_generate
from engine.sampling import (SamplingRows, for_row, pack_step, sample, sample_batch, sample_one, sample_step,
                             sampling_logprobs, top_logprobs_batch, unpack_step)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def want_top(row: torch.Tensor, params: SamplingParams) -> list[tuple[int, float]]:
    """The reference: the distribution `sample` draws from, its k likeliest entries, those
    outside the top-p nucleus (-inf) left out."""
    values, ids = sampling_logprobs(row, params).topk(params.top_logprobs)
    return [(int(i), float(v)) for i, v in zip(ids, values) if not torch.isinf(v)]


def assert_top(got, want) -> None:
    assert [i for i, _ in got] == [i for i, _ in want]
    assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-5)


def test_a_batch_reports_each_row_its_own_count_under_its_own_distribution():
    torch.manual_seed(0)
    logits = torch.randn(4, 300) * 3
    params = [SamplingParams(top_logprobs=2), SamplingParams(),
              SamplingParams(temperature=0.7, top_p=0.05, seed=9, top_logprobs=6),  # a nucleus of few tokens
              SamplingParams(temperature=1.3, seed=1, top_logprobs=20)]
    rows = SamplingRows.build([(p, 3) for p in params], "cpu")
    assert rows.top_logprobs == 20
    step = unpack_step(pack_step(*sample_batch(logits, rows), top_logprobs_batch(logits, rows)))
    for i, p in enumerate(params):
        got = for_row(step.tops[i], p)
        assert_top(got, want_top(logits[i], p) if p.top_logprobs else [])
        assert got == sample_one(logits[i], p, 3)[2]  # the one-row form: the same numbers
        if p.greedy and got:  # greedy: the token is the likeliest, with the same log-probability
            assert got[0][0] == step.tokens[i] and got[0][1] == pytest.approx(step.logprobs[i], abs=1e-6)
        elif got and step.tokens[i] in dict(got):  # sampled: its logprob is its entry's
            assert dict(got)[step.tokens[i]] == pytest.approx(step.logprobs[i], abs=1e-6)
    assert 0 < len(step.tops[2]) < 6  # outside the nucleus: left out, not reported as -inf
    assert step.tokens[2] in dict(step.tops[2])


def test_a_step_without_top_logprobs_stays_two_columns():
    logits = torch.randn(3, 50)
    rows = SamplingRows.build([(SamplingParams(), 0)] * 3, "cpu")
    assert rows.top_logprobs == 0
    packed = pack_step(*sample_batch(logits, rows))
    assert packed.shape == (3, 2) and unpack_step(packed).tops == [(), (), ()]
    assert sample_one(logits[0], SamplingParams(), 0)[2] == ()


@pytest.mark.parametrize("overlap", [False, True])
def test_decoded_tokens_top_logprobs_equal_the_reference(tiny_model, overlap):
    prompts = [[(50 + 13 * i + 7 * j) % 1000 for i in range(12 + 3 * j)] for j in range(3)]
    params = [SamplingParams(max_tokens=8, top_logprobs=5, ignore_eos=True),
              SamplingParams(max_tokens=8, ignore_eos=True),  # beside them, asks for none
              SamplingParams(max_tokens=8, temperature=0.8, top_p=0.6, seed=3, top_logprobs=3, ignore_eos=True)]
    tops = [[] for _ in prompts]
    got, _ = asyncio.run(generate(tiny_model, 0, prompts, params, overlap=overlap,
                                  disable_overlap_schedule=not overlap, tops=tops))
    for prompt, p, tokens, top in zip(prompts, params, got, tops):
        rows = []

        def keep(row, step, p=p):
            rows.append(row)
            return sample(row, p, step)[0]
        assert tokens == reference_generate(tiny_model.model, prompt, p.max_tokens, sample_fn=keep)
        assert len(top) == p.max_tokens - 1  # every decoded token (the helper samples the first)
        for row, t in zip(rows[1:], top):
            assert_top(t, want_top(row, p) if p.top_logprobs else [])


def dense_bias(params: SamplingParams, vocab: int) -> torch.Tensor:
    bias = torch.zeros(vocab)
    for t, b in params.logit_bias:
        bias[t] += b
    return bias


def test_logit_bias_moves_only_its_own_rows_draws():
    from dataclasses import replace
    torch.manual_seed(1)
    logits = torch.randn(4, 200) * 2
    top = int(logits[0].argmax())
    params = [SamplingParams(logit_bias=((top, -100.0), (7, 0.5))),  # the argmax all but banned
              SamplingParams(),
              SamplingParams(temperature=0.9, seed=4, logit_bias=((11, 100.0),), top_logprobs=2),  # forced
              SamplingParams(temperature=0.9, seed=4)]
    rows = SamplingRows.build([(p, 2) for p in params], "cpu")
    tokens, logprobs = sample_batch(logits, rows)
    alone_tokens, alone_logprobs = sample_batch(logits, SamplingRows.build([(replace(p, logit_bias=()), 2)
                                                                           for p in params], "cpu"))
    for i in (1, 3):  # rows without a bias: the same bits as in a batch without any
        assert tokens[i] == alone_tokens[i] and logprobs[i] == alone_logprobs[i]
    for i in (0, 2):  # a biased row: the plain draw from its biased logits
        want = sample(logits[i] + dense_bias(params[i], 200), replace(params[i], logit_bias=()), 2)
        assert (int(tokens[i]), float(logprobs[i])) == pytest.approx(want, abs=1e-6)
    assert int(tokens[0]) != top and int(tokens[2]) == 11
    assert sample_one(logits[2], params[2], 2)[2][0][0] == 11  # the alternatives are of the biased distribution


@pytest.mark.parametrize("overlap", [False, True])
def test_decoded_tokens_with_a_logit_bias_equal_the_reference(tiny_model, overlap):
    from dataclasses import replace
    vocab = tiny_model.config.vocab_size
    prompts = [[(70 + 11 * i + 5 * j) % 1000 for i in range(10 + 4 * j)] for j in range(3)]
    first = reference_generate(tiny_model.model, prompts[0], 4)
    params = [SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=tuple((t, -100.0) for t in sorted(set(first)))),
              SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.1, seed=8, ignore_eos=True, logit_bias=((42, 6.0),))]
    got, _ = asyncio.run(generate(tiny_model, 0, prompts, params, overlap=overlap,
                                  disable_overlap_schedule=not overlap))
    for prompt, p, tokens in zip(prompts, params, got):
        plain = replace(p, logit_bias=())
        want = reference_generate(tiny_model.model, prompt, p.max_tokens,
                                  sample_fn=lambda row, step, p=p, plain=plain: sample(row + dense_bias(p, vocab),
                                                                                       plain, step)[0])
        assert tokens == want
    assert not set(got[0]) & set(first)  # the banned tokens never came


@pytest.mark.parametrize("overlap", [False, True])
def test_penalized_tokens_equal_the_reference_on_both_loops(tiny_model, overlap):
    from decode_helpers import reference_draws
    prompts = [[(90 + 17 * i + 3 * j) % 1000 for i in range(9 + 5 * j)] for j in range(4)]
    params = [SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=2.0, logit_bias=((5, 1.0),)),
              SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=2, presence_penalty=1.5,
                             frequency_penalty=-0.5, top_logprobs=3),
              SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=-2.0, frequency_penalty=-2.0)]
    tops = [[] for _ in prompts]
    got, _ = asyncio.run(generate(tiny_model, 0, prompts, params, overlap=overlap,
                                  disable_overlap_schedule=not overlap, decode_steps_per_launch=3, tops=tops))
    for prompt, p, tokens, top in zip(prompts, params, got, tops):
        rows = []
        assert tokens == reference_draws(tiny_model.model, prompt, p.max_tokens, p, rows=rows)
        if p.top_logprobs:  # of the penalized distribution
            from dataclasses import replace
            plain = replace(p, presence_penalty=0.0, frequency_penalty=0.0)
            for row, t in zip(rows[1:], top):
                assert_top(t, want_top(row, plain))
    plain, _ = asyncio.run(generate(tiny_model, 0, prompts[3:], [params[1]]))
    assert len(set(plain[0])) == len(plain[0]) and len(set(got[3])) < len(got[3])  # negative penalties: repeats


def test_a_penalty_counts_the_history_the_row_brings_and_resolves_placeholders():
    from engine.future_map import FutureTokenMap
    fmap = FutureTokenMap(8, "cpu")
    slots = fmap.reserve(2)
    fmap.store(torch.tensor(slots), torch.tensor([3, 4]))
    logits = torch.zeros(2, 10)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=1.0)
    rows = SamplingRows.build([(p, 4, [3, fmap.placeholder(slots[0]), 7, fmap.placeholder(slots[1])]),
                               (SamplingParams(), 0)], "cpu", fmap.resolve)
    from engine.sampling import adjusted
    out = adjusted(logits, rows)
    want = torch.zeros(10)
    want[3], want[4], want[7] = -(2 * 1.0 + 0.5), -1.5, -1.5  # 3 came twice (once through its placeholder)
    assert torch.equal(out[0], want) and torch.equal(out[1], torch.zeros(10))


def test_sample_step_gives_what_its_two_parts_give_apart():
    # the step adjusts the logits and computes the distribution once for the draw and the top list
    torch.manual_seed(3)
    logits = torch.randn(3, 120) * 2
    params = [SamplingParams(top_logprobs=4, logit_bias=((9, 3.0),)),
              SamplingParams(temperature=0.9, top_p=0.7, seed=5, top_logprobs=2, presence_penalty=1.0),
              SamplingParams()]
    rows = SamplingRows.build([(p, 1, [9, 9, 4]) for p in params], "cpu")
    tokens, logprobs, top = sample_step(logits, rows)
    want_tokens, want_logprobs = sample_batch(logits, rows)
    assert torch.equal(tokens, want_tokens) and torch.equal(logprobs, want_logprobs)
    assert torch.equal(top, top_logprobs_batch(logits, rows))


MTP_TEXTS = ("ROMEO:\nBut soft, what light through yonder window breaks?\n",
             "First Citizen:\nBefore we proceed any further, hear me speak.\n",
             "KING HENRY:\nOnce more unto the breach, dear friends, once more;\n")


@pytest.fixture(scope="module")
def shakespeare():
    from engine.model_source import load_model
    return load_model("tandem-shakespeare")


def mtp_against_plain(shakespeare, params, overlap):
    """The MTP_TEXTS decoded with params at k = 2 (`overlap`: generate's loop choice) and at
    k = 0 on the plain loop: (MTP tokens, MTP tops, plain tokens, plain tops), after checking
    that drafts were accepted and the tokens are the same."""
    prompts = [shakespeare.tokenizer().encode(t) for t in MTP_TEXTS]
    want_tops = [[] for _ in prompts]
    want, _ = asyncio.run(generate(shakespeare, 0, prompts, params, disable_overlap_schedule=True, tops=want_tops))
    tops = [[] for _ in prompts]
    got, rt = asyncio.run(generate(shakespeare, 2, prompts, params, overlap=overlap, tops=tops))
    assert rt.stats.spec_emitted_tokens > rt.stats.spec_verify_steps > 0  # drafts were accepted
    assert got == want
    return got, tops, want, want_tops


def assert_close_tops(got, want) -> None:
    """Each token's alternatives: the same ids, log-probabilities within float noise (verify
    rows against decode rows)."""
    for a, b in zip(got, want):
        assert [i for i, _ in a] == [i for i, _ in b]
        assert [lp for _, lp in a] == pytest.approx([lp for _, lp in b], abs=1e-4)


@pytest.mark.parametrize("overlap", [False, True, "in turn"])
def test_mtp_decoding_reports_the_plain_decodings_top_logprobs(shakespeare, overlap):
    """A decode worker with MTP speculative decoding (k = 2) reports each emitted token's top
    log-probabilities as the plain loop does (k = 0), drafted tokens included: on the host-side
    MTP step (decode_worker/spec_step.py) and on the device-resident one
    (decode_worker/spec_overlap.py, overlapped and in turn). float32 on a CPU: the same tokens,
    the same alternatives, log-probabilities within float noise."""
    params = [SamplingParams(max_tokens=12, top_logprobs=5, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True),  # beside them, asks for none
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.6, seed=3, top_logprobs=3, ignore_eos=True)]
    _, tops, _, want_tops = mtp_against_plain(shakespeare, params, overlap)
    for p, t, w in zip(params, tops, want_tops):
        assert len(t) == len(w) == p.max_tokens - 1
        assert all((len(a) > 0) == (p.top_logprobs > 0) for a in t)
        assert_close_tops(t, w)


@pytest.mark.parametrize("overlap", [False, True, "in turn"])
def test_mtp_decoding_with_a_logit_bias_emits_the_plain_decodings_tokens(shakespeare, overlap):
    """MTP speculative decoding (k = 2) with logit biases: the bias on the draft and verify
    logits alike, so the emitted tokens (and their top log-probabilities) are the plain loop's
    (k = 0) with the same bias, on the host-side MTP step and the device-resident one; float32
    on a CPU. The banned tokens never come, and the bias changed the output."""
    tok = shakespeare.tokenizer()
    unbiased = reference_generate(shakespeare.model, tok.encode(MTP_TEXTS[0]), 8)
    banned = tuple((t, -100.0) for t in sorted(set(unbiased[1:])))
    params = [SamplingParams(max_tokens=12, ignore_eos=True, logit_bias=banned, top_logprobs=2),
              SamplingParams(max_tokens=12, ignore_eos=True),  # beside them, none
              SamplingParams(max_tokens=12, temperature=0.9, seed=4, ignore_eos=True,
                             logit_bias=((tok.encode(" the")[0], 4.0),))]
    got, tops, _, want_tops = mtp_against_plain(shakespeare, params, overlap)
    assert not set(got[0][1:]) & {t for t, _ in banned} and got[0][:8] != unbiased
    assert len(tops[0]) == 11 and all(tops[0])
    assert_close_tops(tops[0], want_tops[0])
