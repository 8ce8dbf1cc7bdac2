import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
import torch

from common.pb.tandem.v1 import sampling_pb2
from common.sampling_params import SamplingParams
from common.validation import InvalidArgument, sampling_from_proto, validate_token_ids
from engine.sampling import sample
from router.stop_strings import StopMatcher


@pytest.mark.parametrize("fields, field", [
    (dict(max_tokens=0), "sampling.max_tokens"),
    (dict(max_tokens=-3), "sampling.max_tokens"),
    (dict(max_tokens=100), "sampling.max_tokens"),  # 10 prompt + 100 > context 64
    (dict(temperature=-0.1), "sampling.temperature"),
    (dict(temperature=math.nan), "sampling.temperature"),
    (dict(top_p=0.0), "sampling.top_p"),
    (dict(top_p=1.5), "sampling.top_p"),
    (dict(stop=[""]), "sampling.stop"),
    (dict(stop=[f"s{i}" for i in range(17)]), "sampling.stop"),  # more than MAX_STOP_STRINGS
    (dict(stop=["ok", "x" * 257]), "sampling.stop[1]"),  # longer than MAX_STOP_CHARS
    (dict(top_logprobs=21), "sampling.top_logprobs"),
    (dict(top_logprobs=-1), "sampling.top_logprobs"),
    (dict(logit_bias={100: 1.0}), "sampling.logit_bias[100]"),  # outside the vocabulary of 100
    (dict(logit_bias={-1: 1.0}), "sampling.logit_bias[-1]"),
    (dict(logit_bias={3: 100.5}), "sampling.logit_bias[3]"),
    (dict(logit_bias={3: math.nan}), "sampling.logit_bias[3]"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "sampling.logit_bias"),
])
def test_bad_sampling_names_field(fields, field):
    with pytest.raises(InvalidArgument) as e:
        sampling_from_proto(sampling_pb2.SamplingParams(**fields), prompt_tokens=10, context_length=64, vocab_size=100)
    assert e.value.field == field and str(e.value).startswith(field)


def test_request_id_length():
    from common.validation import MAX_REQUEST_ID_CHARS, validate_request_id
    validate_request_id("")
    validate_request_id("r" * MAX_REQUEST_ID_CHARS)
    validate_request_id("r" * MAX_REQUEST_ID_CHARS + ".3", internal=True)  # a router's migrated call
    validate_request_id("job 7/a-b_c.d:e")  # printable ASCII, a space too
    for rid, internal in (("r" * (MAX_REQUEST_ID_CHARS + 1), False), ("r" * (1 << 20), True),
                          ("inj\n2026-12-07 ERROR forged line", False), ("a\rb", True), ("\u00fc", False),
                          ("tab\there", False), ("nul\x00", False)):
        with pytest.raises(InvalidArgument) as e:  # a line break would forge a log line in every process
            validate_request_id(rid, internal)
        assert e.value.field == "request_id"


def test_logit_bias_is_kept_in_id_order_and_goes_back_to_proto_unchanged():
    from common.validation import sampling_to_proto
    msg = sampling_pb2.SamplingParams(logit_bias={9: -100.0, 2: 100.0, 5: 0.5}, top_logprobs=3)
    p = sampling_from_proto(msg, prompt_tokens=10, context_length=64, vocab_size=1000)
    assert p.logit_bias == ((2, 100.0), (5, 0.5), (9, -100.0)) and p.top_logprobs == 3
    assert sampling_from_proto(sampling_to_proto(p), prompt_tokens=10, context_length=64, vocab_size=1000) == p


def test_a_float32_value_just_outside_its_range_is_said_as_it_reads_back():
    # 7 digits said "must be in [-2, 2], got 2" of a float32 2.0000002
    with pytest.raises(InvalidArgument, match=r"got 2\.0000002$"):
        sampling_from_proto(sampling_pb2.SamplingParams(presence_penalty=2.0000002), prompt_tokens=10,
                            context_length=64, vocab_size=100)
    with pytest.raises(InvalidArgument, match=r"got 0\.0001$"):  # float32's 9.99999975e-05, said short
        sampling_from_proto(sampling_pb2.SamplingParams(temperature=0.0001), prompt_tokens=10, context_length=64,
                            vocab_size=100)


def test_defaults():
    p = sampling_from_proto(sampling_pb2.SamplingParams(), prompt_tokens=10, context_length=64, vocab_size=100, default_seed=5)
    assert p == SamplingParams(max_tokens=54, temperature=0.0, top_p=1.0, seed=5)


def test_token_ids():
    with pytest.raises(InvalidArgument, match="prompt is empty"):
        validate_token_ids([], 10)
    with pytest.raises(InvalidArgument, match=r"token_ids\[1\]: token id 10 outside"):
        validate_token_ids([1, 10], 10)
    with pytest.raises(InvalidArgument, match=r"token_ids\[0\]"):
        validate_token_ids([-1], 10)


def test_greedy_and_seeded_sampling():
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert sample(logits, SamplingParams(), 0)[0] == 1
    p = SamplingParams(temperature=1.0, seed=42)
    draws = [sample(logits, p, step)[0] for step in range(50)]
    assert draws == [sample(logits, p, step)[0] for step in range(50)]  # reproducible per (seed, step)
    assert len(set(draws)) > 1
    # top_p keeps the smallest set with mass >= top_p: here only the two top tokens.
    q = SamplingParams(temperature=1.0, top_p=0.6, seed=1)
    assert {sample(logits, q, s)[0] for s in range(100)} <= {1, 2}
    tok, lp = sample(logits, q, 0)
    assert lp <= 0.0


@pytest.mark.parametrize("deltas, stop, sent, stopped", [
    (["hel", "lo wor", "ld"], ("o w",), "hell", True),
    (["abc", "def"], ("xyz",), "abcdef", False),
    (["a", "b", "c"], ("bc", "c"), "a", True),
])
def test_stop_matcher(deltas, stop, sent, stopped):
    m = StopMatcher(stop)
    out, hit = "", False
    for d in deltas:
        text, hit = m.feed(d)
        out += text
        if hit:
            break
    if not hit:
        out += m.flush()
    assert (out, hit) == (sent, stopped)


def test_stop_matcher_stops_at_the_first_delta_that_completes_a_match():
    m = StopMatcher(("abc", "b"))
    assert m.feed("ab") == ("a", True)  # "b" is complete; "abc" might have become one later


def test_stop_matcher_holds_back_only_what_could_begin_a_stop():
    chat = StopMatcher(("\n\n",))  # a chat reply's end of turn: words go out whole, at once
    assert [chat.feed(d) for d in ("Hello", " world", "\n", "Next")] == [
        ("Hello", False), (" world", False), ("", False), ("\nNext", False)]
    long = StopMatcher(("Z" * 200,))
    assert long.feed("ROMEO: ") == ("ROMEO: ", False)  # (all of it waited for the 200th character)
    assert long.feed("ZZ") == ("", False) and long.feed("a") == ("ZZa", False)
    both = StopMatcher(("abcd", "cx"))
    assert both.feed("zabc") == ("z", False)  # "abc" may become "abcd"; "c" may become "cx"
    assert both.feed("x") == ("ab", True)  # "cx" came first


@given(text=st.text(alphabet="abc\n", max_size=40), cuts=st.lists(st.integers(0, 40), max_size=8),
       stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=5), min_size=1, max_size=3))
def test_stop_matcher_sends_the_text_before_the_first_stop_and_holds_nothing_it_need_not(text, cuts, stops):
    m = StopMatcher(tuple(stops))
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    out, hit = "", False
    for a, b in zip(bounds, bounds[1:]):
        sent, hit = m.feed(text[a:b])
        out += sent
        if hit:
            break
        held = text[len(out):b]  # what it keeps back may still begin a stop string, and nothing shorter would do
        assert held == "" or any(s.startswith(held) for s in stops)
    if not hit:
        out += m.flush()
    # a stream stops at the first delta that completes a stop string, before the earliest match
    # in the text up to that delta's end (a later delta's earlier-starting match comes too late)
    end = next((b for b in bounds[1:] if any(s in text[:b] for s in stops)), None)
    want = (text, False) if end is None else (text[:min(i for i in (text[:end].find(s) for s in stops) if i >= 0)],
                                              True)
    assert (out, hit) == want
