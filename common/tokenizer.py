"""The model's tokenizer, built with the `tokenizers` library.

A checkpoint directory with a `tokenizer.json` uses that file; otherwise the Qwen2
byte-level BPE shipped in common/assets/tokenizer (vocab.json + merges.txt, Apache-2.0)
is built here: Qwen2's pre-tokenizer regex, byte-level mapping, and its three special
tokens appended after the 151,643 base tokens.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

ASSETS = Path(__file__).resolve().parent / "assets" / "tokenizer"
# Qwen2's split pattern (the `pat_str` of Qwen2TokenizerFast).
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 151643..151645


def _build_qwen2(directory: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE.from_file(str(directory / "vocab.json"), str(directory / "merges.txt")))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN2_SPECIAL_TOKENS])
    return tok


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table, which the `tokenizers`
    ByteLevel pre-tokenizer uses), inverted: character -> byte. Printable Latin-1 bytes stand
    for themselves; the other 68 bytes take the code points from 256 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {chr(b): b for b in kept}, 0
    for b in range(256):
        if b not in kept:
            out[chr(256 + extra)] = b
            extra += 1
    return out


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte-fallback tokens


@dataclass
class TextTokenizer:
    """Encodes prompts and decodes generated ids (Args are token ids, ints)."""

    tokenizer: Tokenizer

    @property
    def max_token_bytes(self) -> int:
        """Longest text (UTF-8 bytes) one token can stand for: bounds tokens from below by bytes."""
        if not hasattr(self, "_max_token_bytes"):
            ids = range(self.vocab_size)
            self._max_token_bytes = max(len(self.tokenizer.decode([i], skip_special_tokens=False).encode())
                                        for i in ids)
        return self._max_token_bytes

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (special-token strings such as <|im_end|> map to their ids)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, which may be part of a character (OpenAI's logprobs
        `bytes`): a byte-level BPE token's own bytes, a byte-fallback token's (<0xNN>) byte,
        else the UTF-8 of its text decoded alone (special tokens included)."""
        piece = self.tokenizer.id_to_token(token_id) or ""
        alphabet = _byte_level_alphabet()
        if isinstance(self.tokenizer.decoder, decoders.ByteLevel) and piece and all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def token_shown(self, token_id: int) -> str:
        """A token as logprobs list it: its text decoded alone, or where its bytes are no whole
        UTF-8 text (part of a character) `bytes:` and the bytes as \\xNN escapes, as OpenAI's
        API writes them, so that two such tokens do not both read "\ufffd"."""
        return self.token_listing(token_id)[0]

    def token_listing(self, token_id: int) -> tuple[str, bytes, str]:
        """(`token_shown`, `token_bytes`, its text decoded alone as a reply's text has it) of one
        token, each worked out once. The last is what the token adds to streamed text
        (`decode`: a special token such as <|endoftext|> adds nothing, though listed by name)."""
        raw = self.token_bytes(token_id)
        alone = self.tokenizer.decode([token_id], skip_special_tokens=False)
        in_text = self.decode([token_id])
        try:
            raw.decode()
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw, in_text
        return alone, raw, in_text


def load_tokenizer(checkpoint_dir: Path | None = None) -> TextTokenizer:
    """Load `checkpoint_dir/tokenizer.json` if present, else the shipped Qwen2 tokenizer."""
    if checkpoint_dir is not None and (Path(checkpoint_dir) / "tokenizer.json").exists():
        return TextTokenizer(Tokenizer.from_file(str(Path(checkpoint_dir) / "tokenizer.json")))
    return TextTokenizer(_build_qwen2(ASSETS))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas for streaming, in O(1) per token.

    Decodes a window of the last few ids, not the whole list: the window starts at the previous
    delta's first token (`_prefix`), and the new text is what decoding the window gives past
    what decoding its old part (`_prefix:_read`) gave (vLLM's incremental detokenizer does the
    same). Byte-level BPE decoding is concatenation of the tokens' bytes, so the window's old
    part decodes to the same characters whatever came before; a delta is held back while it ends
    in U+FFFD, because a multi-byte UTF-8 character may be split over tokens. Should a window's
    text ever not extend its old part (a tokenizer whose decoding is not concatenative), the
    delta comes from decoding all ids instead, so the streamed text always equals decoding all.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start
        self._read = 0  # ids before this are in the emitted text
        self._emitted = ""  # all text emitted so far (for the fallback and `text`)

    @property
    def text(self) -> str:
        """Decoding of every id pushed so far."""
        return self._tokenizer.decode(self._ids)

    def push(self, ids: list[int], final: bool = False) -> str:
        """Add ids; return the text that became complete (everything left when final)."""
        self._ids.extend(ids)
        old = self._tokenizer.decode(self._ids[self._prefix:self._read])
        new = self._tokenizer.decode(self._ids[self._prefix:])
        if not new.startswith(old):
            full = self.text
            if not full.startswith(self._emitted):  # cannot happen for a concatenative decoder
                raise RuntimeError("detokenized text changed behind the stream")
            new, old = full, self._emitted
        if not final and new.endswith("\ufffd"):
            return ""
        delta = new[len(old):]
        self._prefix, self._read = self._read, len(self._ids)
        self._emitted += delta
        return delta
