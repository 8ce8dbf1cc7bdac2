"""IncrementalDetokenizer (common/tokenizer.py): the streamed deltas always add up to decoding
every id, whatever the ids and however they are split into pushes, for both shipped tokenizers
(byte-level BPE: Qwen2's and tandem-shakespeare's)."""

from __future__ import annotations

import functools

from hypothesis import given, settings
from hypothesis import strategies as st

from common.tokenizer import IncrementalDetokenizer, load_tokenizer
from engine.model_source import SHIPPED, SHAKESPEARE


@functools.cache
def _tokenizers():
    return [load_tokenizer(), load_tokenizer(SHIPPED[SHAKESPEARE])]


def _check(tok, ids: list[int], cuts: list[int]) -> None:
    detok = IncrementalDetokenizer(tok)
    out, start = "", 0
    for cut in sorted(set(c for c in cuts if 0 < c < len(ids))) + [len(ids)]:
        final = cut == len(ids)
        out += detok.push(ids[start:cut], final=final)
        start = cut
        if not final:  # what was sent is never taken back
            assert tok.decode(ids[:cut]).startswith(out) or "\ufffd" in tok.decode(ids[:cut])
    assert out == tok.decode(ids)


@settings(max_examples=150, deadline=None)
@given(which=st.integers(0, 1), data=st.data())
def test_deltas_add_up_to_the_full_decode(which: int, data) -> None:
    tok = _tokenizers()[which]
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=60))
    cuts = data.draw(st.lists(st.integers(0, len(ids)), max_size=len(ids)))
    _check(tok, ids, cuts)


def test_multibyte_text_streamed_token_by_token() -> None:
    for tok in _tokenizers():
        ids = tok.encode("naïve café — 東京 🎭 ok")
        _check(tok, ids, list(range(len(ids))))
        detok = IncrementalDetokenizer(tok)
        parts = [detok.push([i]) for i in ids]
        assert "".join(parts) == tok.decode(ids)
        assert all("\ufffd" not in p for p in parts)  # split characters were held back, not sent broken


@settings(max_examples=100, deadline=None)
@given(which=st.integers(0, 1), data=st.data())
def test_router_feed_without_stop_strings_sends_every_id_and_the_full_decode(which: int, data) -> None:
    # router/stop_strings.py feed_tokens: without stop strings a response's ids go to the
    # detokenizer at once; the streamed text is still exactly the decode of all ids
    from router.stop_strings import StopMatcher, feed_tokens
    tok = _tokenizers()[which]
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=40))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(ids)), max_size=8))) | {len(ids)})
    detok, stops, out, start = IncrementalDetokenizer(tok), StopMatcher(()), "", 0
    for cut in cuts:
        text, stopped, used = feed_tokens(stops, detok, ids[start:cut], final=cut == len(ids))
        assert not stopped and used == cut - start
        out, start = out + text, cut
    assert out + stops.flush() == tok.decode(ids)


@settings(max_examples=100, deadline=None)
@given(which=st.integers(0, 1), stop=st.sampled_from([(), ("zz",), ("\n\n", "qq")]), data=st.data())
def test_router_feed_flushes_held_bytes_when_the_finish_carries_no_ids(which: int, stop: tuple, data) -> None:
    # the decode worker's last message may carry only the finish reason: whatever the
    # detokenizer held back (a character's first bytes) still goes out, with or without stop
    # strings (with one, the tail was dropped: a lone first byte of a character streamed as "")
    from router.stop_strings import StopMatcher, feed_tokens
    tok = _tokenizers()[which]
    ids = data.draw(st.lists(st.integers(0, tok.vocab_size - 1), min_size=1, max_size=20))
    detok, stops, out = IncrementalDetokenizer(tok), StopMatcher(stop), ""
    for token in ids:
        text, stopped, used = feed_tokens(stops, detok, [token], final=False)
        if stopped:
            return  # a stop string in the ids themselves: nothing to flush
        out += text
    text, stopped, used = feed_tokens(stops, detok, [], final=True)
    assert used == 0
    out += text if stopped else text + stops.flush()
    full = tok.decode(ids)
    assert out == (full[: min(i for i in (full.find(s) for s in stop) if i >= 0)] if stopped else full)


def test_router_feed_a_lone_first_byte_then_a_finish() -> None:
    from router.stop_strings import StopMatcher, feed_tokens
    tok = load_tokenizer(SHIPPED[SHAKESPEARE])
    lone = next(i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd")  # a character's first byte
    detok, stops = IncrementalDetokenizer(tok), StopMatcher(("zz",))
    assert feed_tokens(stops, detok, [lone], final=False) == ("", False, 1)  # held back
    text, stopped, used = feed_tokens(stops, detok, [], final=True)
    assert (text + stops.flush(), stopped, used) == ("\ufffd", False, 0)


def test_token_bytes_are_a_tokens_own_bytes():
    from common.tokenizer import load_tokenizer
    tok = load_tokenizer()
    assert tok.token_bytes(128) == b"\xc4" and tok.token_shown(128) == "bytes:\\xc4"  # part of a character
    word = tok.encode(" Hawaii")[0]
    assert tok.token_bytes(word).decode() == tok.token_shown(word) == tok.tokenizer.decode([word])
    euro = tok.encode("€")
    assert b"".join(tok.token_bytes(i) for i in euro) == "€".encode()  # whatever the split, the bytes add up
    assert tok.token_shown(151643) == "<|endoftext|>"  # a special token: its text


def test_a_special_token_is_listed_by_name_and_adds_no_text():
    # logprobs list <|endoftext|> by name; its text_offset share is what it adds to the reply's
    # text (decode skips special tokens): nothing (it counted 13 characters)
    for tok in _tokenizers():
        eos = tok.encode("<|endoftext|>")
        if len(eos) != 1:
            continue
        shown, raw, in_text = tok.token_listing(eos[0])
        assert (shown, raw, in_text) == ("<|endoftext|>", b"<|endoftext|>", "") and tok.decode(eos) == ""
        word = tok.encode("hello")[0]
        assert tok.token_listing(word)[2] == tok.decode([word]) != ""
