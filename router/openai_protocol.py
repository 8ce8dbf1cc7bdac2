"""OpenAI's request and response objects, and their mapping onto `tandem.v1.GenerateRequest`.

Requests are pydantic models (`_Body`: unknown fields are accepted and ignored, as OpenAI's own
server-side clients expect; known ones are checked strictly, so `true` is no integer and `"5"`
no number; a null stands for the field's default); `to_generate` turns one into a gRPC request per choice, so that the HTTP
API shares the gRPC API's validation (common/validation.py). Fields the engine cannot honour
are refused by name when set to anything but their no-op value (`best_of` other than `n`, `echo`,
`suffix`, `tools`, `functions`, `tool_choice` and `function_call` but "none" or "auto",
`response_format`).

`logit_bias` ({token id as a string: bias in [-100, 100]}) becomes the gRPC request's
`sampling.logit_bias`; the router checks the ids against the model's vocabulary.
`presence_penalty` and `frequency_penalty` (each in [-2, 2]) become the gRPC request's own.

Log-probabilities: chat's `logprobs: true` and the completions API's `logprobs: 0` give each
generated token's; chat's `top_logprobs: k` and the completions API's `logprobs: k` (k in
1..20) also its k most likely tokens. All are natural logs under the distribution the token was
drawn from (greedy: the model's softmax; sampled: tempered, within the top-p nucleus, where
tokens outside the nucleus are left out of the top list).

A request of several choices — `n` > 1, or a completions `prompt` that is a list of prompts —
becomes one GenerateRequest per choice (`Choice`), choice index = prompt index × n + j as in
OpenAI's API; with a `seed`, choice j of a prompt samples with seed + j (mod 2^64), so the
choices differ and each stays reproducible on its own.

The gRPC path names fields as `text`, `token_ids[i]` and `sampling.<name>`; `param_name` maps
those onto the OpenAI parameter the client sent, so a 400's `param` is what the client wrote.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from common.pb.tandem.v1 import frontend_pb2 as pb
from common.pb.tandem.v1 import sampling_pb2
from common.sampling_params import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, PENALTY_RANGE
from common.validation import (FLOAT32_MAX, FLOAT32_TINY, MAX_REQUEST_ID_CHARS, MAX_STOP_STRINGS, MIN_TEMPERATURE,
                               InvalidArgument)

INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1  # the gRPC request's int32 fields
TOKEN_KEY = re.compile(r"0|[1-9][0-9]*", re.ASCII)  # a logit_bias key: a token id as written, one way only
MAX_CHOICES = 128  # choices per request (n × prompts), each a Generate of its own; OpenAI's own limit of n

FINISH_REASONS = {sampling_pb2.FINISH_REASON_LENGTH: "length", sampling_pb2.FINISH_REASON_STOP: "stop",
                  sampling_pb2.FINISH_REASON_EOS: "stop"}


def _shown(key: str, quote: bool = True) -> str:
    """A client's logit_bias key as an error message names it: whole up to 24 characters, else
    its start and its length (a key may be thousands of characters long)."""
    if len(key) > 24:
        return f"{key[:12]}… ({len(key)} characters)"
    return repr(key) if quote else key


@dataclass(frozen=True)
class Choice:
    """One choice of a request: its `index` in the response, the prompt it continues
    (`prompt_index` into a batch of prompts; None where `prompt` is not a batch, so that errors
    name `prompt`, not `prompt[0]`) and its gRPC request."""

    index: int
    prompt_index: int | None
    request: pb.GenerateRequest


def choice_request_id(request_id: str, index: int, choices: int, tag: str) -> str:
    """The gRPC request id of choice `index` of `choices`: the request's own id for one choice, else
    id-tag-index, `tag` drawn once per request (the id cut so that the whole stays within
    MAX_REQUEST_ID_CHARS): a client's id "abc-1" must not name choice 1 of another request "abc"
    (a worker's abandoned-request list is kept by id)."""
    if choices == 1:
        return request_id
    suffix = f"-{tag}-{index}"
    return request_id[:MAX_REQUEST_ID_CHARS - len(suffix)] + suffix


def choice_tag() -> str:
    """A request's tag in its choices' ids (choice_request_id)."""
    return uuid.uuid4().hex[:8]


class _Body(BaseModel):
    """An object of a request body: unknown fields accepted and ignored; known ones of their
    declared type, strictly (`"max_tokens": true` or `"n": "2"` is a 400 naming the field, not 1
    or 2), where an int also passes for a float; a null given for a field that has a default
    stands for that default (`"n": null` is n = 1), as in OpenAI's API. Required fields stay
    required."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if v is not None or k not in cls.model_fields or cls.model_fields[k].is_required()}
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class _Common(_Body):
    """Fields both endpoints take. Defaults are the gRPC API's: greedy (temperature 0), top_p 1,
    max_tokens min(64, context left)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    ignore_eos: bool = False  # not OpenAI's: keep generating after the end-of-sequence token (as vLLM)
    _shared: sampling_pb2.SamplingParams | None = PrivateAttr(default=None)  # `_shared_sampling`'s

    def _refuse_unsupported(self) -> None:
        if not 1 <= self.n <= MAX_CHOICES:
            raise InvalidArgument("n", f"must be in [1, {MAX_CHOICES}], got {self.n}")
        if self.stream_options is not None and not self.stream:
            raise InvalidArgument("stream_options", "only allowed with stream: true")

    def _shared_sampling(self) -> sampling_pb2.SamplingParams:
        """The sampling parameters every choice of the request shares, checked and built once
        (a logit_bias of MAX_LOGIT_BIAS entries is not walked again for each of 128 choices)."""
        if self._shared is not None:
            return self._shared
        s = sampling_pb2.SamplingParams(ignore_eos=self.ignore_eos)
        if len(self.logit_bias or ()) > MAX_LOGIT_BIAS:  # before the walk below: its cost grows with the keys
            raise InvalidArgument("logit_bias", f"{len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
        if self.top_count:
            s.top_logprobs = self.top_count
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -PENALTY_RANGE <= value <= PENALTY_RANGE:  # before the proto's float32 rounds it
                raise InvalidArgument(name, f"must be in [-2, 2], got {value!r}")
            if value:
                setattr(s, name, value)
        for key, bias in (self.logit_bias or {}).items():
            if not TOKEN_KEY.fullmatch(key):  # (int() takes " 5", "+5", "1_0", "٥", "05": one id, several keys)
                raise InvalidArgument("logit_bias", f"keys are token ids written in decimal digits, got {_shown(key)}")
            # the length first: int() refuses more than 4,300 digits (a ValueError, a 500), and
            # more than INT32_MAX's 10 digits is no token id anyway
            if len(key) > len(str(INT32_MAX)) or int(key) > INT32_MAX:  # the proto's int32 would raise
                raise InvalidArgument(f"logit_bias[{_shown(key, quote=False)}]", "not a token id")
            token = int(key)
            if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:  # checked before the proto's float32 rounds it
                raise InvalidArgument(f"logit_bias[{key}]", f"must be in [-100, 100], got {bias!r}")
            s.logit_bias[token] = bias
        self._shared = s
        return s

    def _sampling(self, max_tokens: int | None, j: int = 0, turn_end: Sequence[str] = ()
                  ) -> sampling_pb2.SamplingParams:
        """The sampling parameters of choice j of a prompt (its seed: seed + j); turn_end: stop
        strings added to the request's own (a chat reply's end of turn)."""
        s = sampling_pb2.SamplingParams()
        s.CopyFrom(self._shared_sampling())
        if max_tokens is not None:
            if not INT32_MIN <= max_tokens <= INT32_MAX:  # the proto's int32 would raise (a 500)
                raise InvalidArgument("sampling.max_tokens", f"must be at most {INT32_MAX}, got {max_tokens}")
            s.max_tokens = max_tokens
        # checked as sent, before the proto's float32 rounds them (1e-46 became 0: greedy; a top_p
        # of 1.00000001 became 1); the workers check the float32 values again
        if self.temperature is not None:
            if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= FLOAT32_MAX):
                # (above FLOAT32_MAX the proto's float32 is inf, which the worker refused as "got inf")
                raise InvalidArgument("temperature", f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE} "
                                                     f"(at most {FLOAT32_MAX!r}, a float32's largest), got {self.temperature!r}")
            s.temperature = self.temperature
        if self.top_p is not None:
            if not FLOAT32_TINY < self.top_p <= 1:  # (at or below FLOAT32_TINY the float32 is 0: "got 0.0")
                raise InvalidArgument("top_p", f"must be in (0, 1] and no float32 0 (> {FLOAT32_TINY:.3g}), "
                                               f"got {self.top_p!r}")
            s.top_p = self.top_p
        if self.seed is not None:
            if not 0 <= self.seed < 2 ** 64:
                raise InvalidArgument("seed", f"must be in [0, 2^64), got {self.seed}")
            s.seed = (self.seed + j) % 2 ** 64
        stops = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)
        extra = [t for t in turn_end if t not in stops]
        if extra and len(stops) + len(extra) > MAX_STOP_STRINGS:
            raise InvalidArgument("stop", f"{len(stops)} stop strings; at most {MAX_STOP_STRINGS - len(extra)} "
                                  f"here (a chat reply also stops at the model's end of turn, {extra!r})")
        s.stop.extend(stops + extra)
        return s

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def top_count(self) -> int:
        """How many most likely tokens to report beside each generated one (0 = none)."""
        return 0


def _top_count(value: int | None, name: str) -> int:
    """A top-log-probabilities count as the client sent it (`name`) -> 0..MAX_TOP_LOGPROBS.
    Raises InvalidArgument naming `name`."""
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise InvalidArgument(name, f"must be in [0, {MAX_TOP_LOGPROBS}], got {value}")
    return value or 0


class CompletionRequest(_Common):
    """POST /v1/completions: `prompt` is a string or a list of token ids, or a batch: a list of
    strings or of token-id lists."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @property
    def want_logprobs(self) -> bool:
        return self.logprobs is not None

    @property
    def top_count(self) -> int:
        return _top_count(self.logprobs, "logprobs")

    @property
    def batch(self) -> bool:
        """Whether `prompt` is a batch: a list of strings or of token lists (of one, too)."""
        p = self.prompt
        return isinstance(p, list) and bool(p) and isinstance(p[0], (str, list))

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or each of a batch."""
        return list(self.prompt) if self.batch else [self.prompt]

    def to_generate(self, request_id: str) -> list[Choice]:
        """One Choice per (prompt, j < n), in index order. Raises InvalidArgument naming the parameter."""
        self._refuse_unsupported()
        if self.echo:
            raise InvalidArgument("echo", "echo is not supported")
        if self.suffix:
            raise InvalidArgument("suffix", "suffix is not supported")
        if self.best_of not in (None, self.n):
            raise InvalidArgument("best_of", f"only best_of = n ({self.n}) is supported, got {self.best_of}")
        prompts = self.prompts()
        total = len(prompts) * self.n
        if total > MAX_CHOICES:
            raise InvalidArgument("n" if self.n > 1 else "prompt", f"{len(prompts)} prompts × n = {self.n} "
                                  f"is {total} choices; at most {MAX_CHOICES} per request")
        batch = self.batch  # a batch's prompts are named prompt[i], a batch of one's too
        tag = choice_tag()
        out = []
        for i, prompt in enumerate(prompts):
            where = f"prompt[{i}]" if batch else "prompt"
            if not prompt:  # "" or []: said in this API's terms (the router's check names text / token_ids)
                raise InvalidArgument(where, "is empty")
            if not isinstance(prompt, str):
                bad = next((k for k, t in enumerate(prompt) if not INT32_MIN <= t <= INT32_MAX), None)
                if bad is not None:  # the proto's int32 would raise (a 500); in range, the router checks the vocabulary
                    raise InvalidArgument(f"{where}[{bad}]", f"not a token id: {prompt[bad]}")
            for j in range(self.n):
                index = i * self.n + j
                req = pb.GenerateRequest(request_id=choice_request_id(request_id, index, total, tag),
                                         model=self.model or "", sampling=self._sampling(self.max_tokens, j))
                if isinstance(prompt, str):
                    req.text = prompt
                else:
                    req.token_ids.extend(prompt)
                out.append(Choice(index, i if batch else None, req))
        return out


class ContentPart(_Body):
    type: str | None = None  # (a missing or null one is refused by template_messages, naming the part's type)
    text: str | None = None


CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})  # OpenAI's message roles
# a participant's name, as OpenAI's API takes it: it goes into the chat template as it is, so a
# newline in it could write a turn of its own
NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions: `messages` rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None  # "none" and "auto" (with no tools: nothing to call) are no-ops
    functions: list[Any] | None = None  # the API's older form of tools
    function_call: Any = None  # the older tool_choice
    response_format: dict[str, Any] | None = None

    @property
    def want_logprobs(self) -> bool:
        return self.logprobs

    @property
    def top_count(self) -> int:
        k = _top_count(self.top_logprobs, "top_logprobs")
        if k and not self.logprobs:
            raise InvalidArgument("top_logprobs", "needs logprobs: true")
        return k

    def template_messages(self) -> list[dict]:
        """The messages as the chat template sees them: role, content (text), name when given."""
        out = []
        for i, m in enumerate(self.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidArgument(f"messages[{i}].role", f"must be one of {', '.join(sorted(CHAT_ROLES))}, "
                                      f"got {m.role!r}")
            if m.content is None and m.role != "assistant":  # (an assistant's turn of tool calls has none)
                raise InvalidArgument(f"messages[{i}].content", f"a {m.role} message needs content")
            content = m.content if m.content is not None else ""
            if isinstance(content, list):
                if not content:
                    raise InvalidArgument(f"messages[{i}].content", "an empty list of content parts")
                other = next((j for j, p in enumerate(content) if p.type != "text"), None)
                if other is not None:  # (the part's own field named, a null type too)
                    raise InvalidArgument(f"messages[{i}].content[{other}].type",
                                          f"only text content parts are supported, got {content[other].type!r}")
                missing = next((j for j, p in enumerate(content) if p.text is None), None)
                if missing is not None:
                    raise InvalidArgument(f"messages[{i}].content[{missing}].text", "a text part needs its text")
                content = "".join(p.text for p in content)
            msg = {"role": m.role, "content": content}
            if m.name is not None:
                if not NAME_PATTERN.fullmatch(m.name):
                    raise InvalidArgument(f"messages[{i}].name", "1 to 64 letters, digits, underscores or hyphens")
                msg["name"] = m.name
            out.append(msg)
        return out

    def to_generate(self, request_id: str, prompt: str, turn_end: Sequence[str] = ()) -> list[Choice]:
        """n Choices of the rendered `prompt`, each also stopping at `turn_end` (the model's end of
        a chat turn: router/chat_template.py). Raises InvalidArgument naming the parameter."""
        self._refuse_unsupported()
        if self.tools:
            raise InvalidArgument("tools", "tool calls are not supported")
        if self.functions:
            raise InvalidArgument("functions", "function calls are not supported")
        for name in ("tool_choice", "function_call"):  # "required" or a named tool: a promise not kept
            if getattr(self, name) not in (None, "none", "auto"):
                raise InvalidArgument(name, "tool calls are not supported: only \"none\" or \"auto\"")
        if self.response_format and (self.response_format.get("type") or "text") != "text":  # (null: the default)
            raise InvalidArgument("response_format", "only {\"type\": \"text\"} is supported")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise InvalidArgument("max_completion_tokens", "set max_completion_tokens or max_tokens, not both")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        tag = choice_tag()
        return [Choice(j, None, pb.GenerateRequest(request_id=choice_request_id(request_id, j, self.n, tag),
                                                   model=self.model or "", text=prompt,
                                                   sampling=self._sampling(max_tokens, j, turn_end)))
                for j in range(self.n)]


def param_name(field: str, request: _Common, prompt_index: int | None = None) -> str:
    """The OpenAI parameter behind a gRPC-side field name ("sampling.top_p" → "top_p"); a
    batch's prompt is named with its index (prompt_index 2: "token_ids[5]" → "prompt[2][5]")."""
    chat = isinstance(request, ChatCompletionRequest)
    prompt = "prompt" if prompt_index is None else f"prompt[{prompt_index}]"
    if field == "text":
        return "messages" if chat else prompt
    if field.startswith("token_ids"):
        return prompt + field.removeprefix("token_ids")
    if field == "sampling.max_tokens":
        return "max_completion_tokens" if chat and request.max_completion_tokens is not None else "max_tokens"
    if field == "sampling.top_logprobs" and not chat:
        return "logprobs"
    return field.removeprefix("sampling.")


def in_own_words(message: str, param: str) -> str:
    """A router message about `param` in the words the client used: the gRPC side says max_tokens
    where a chat request set max_completion_tokens (for the router's messages only: this
    module's own already say what they mean)."""
    return re.sub(r"\bmax_tokens\b", "max_completion_tokens", message) if param == "max_completion_tokens" else message


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(parts: Sequence[pb.Usage], n: int = 1) -> dict:
    """The `usage` of a response whose choices, in index order (n per prompt), ended with these
    usages: each prompt counted once (its first choice's prompt and cached tokens, as OpenAI
    counts a prompt of n choices once), every choice's completion tokens."""
    prompt = sum(u.prompt_tokens for u in parts[::n])
    completion = sum(u.completion_tokens for u in parts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u.cached_tokens for u in parts[::n])}}


class Token(NamedTuple):
    """A token as logprobs list it: its text (common.tokenizer.TextTokenizer.token_shown: a
    token that is part of a character reads `bytes:\\xNN`), the bytes it stands for, and the
    characters it adds to the choice's text as `text_offset` counts them (its text decoded
    alone: 1 for part of a character, whose label is longer; 0 for a special token such as
    <|endoftext|>, listed by name but absent from the text)."""

    text: str
    raw: bytes
    chars: int


def token_logprobs(chat: bool, tokens: list[Token], logprobs: list[float], offsets: list[int] | None = None,
                   tops: list[list[tuple[Token, float]]] | None = None) -> dict:
    """The `logprobs` of one choice (or one chunk's delta): chat's `content` list, or the
    completions API's parallel arrays, whose `text_offset` is `offsets` (each token's character
    offset in the choice's tokens' texts: `text_offsets`). tops: per token, its most likely
    tokens as (token, logprob), most likely first; None where the request asked for none (the
    completions API's `top_logprobs` is then null). The completions API gives each token's as a
    {text: logprob} object, as OpenAI's does: two tokens of one text keep the likelier's."""
    if chat:
        return {"content": [{"token": t.text, "logprob": lp, "bytes": list(t.raw),
                             "top_logprobs": [{"token": a.text, "logprob": alp, "bytes": list(a.raw)}
                                              for a, alp in (tops[i] if tops else ())]}
                            for i, (t, lp) in enumerate(zip(tokens, logprobs))]}
    top = None if tops is None else [_first_of_each(t) for t in tops]
    return {"tokens": [t.text for t in tokens], "token_logprobs": logprobs, "top_logprobs": top,
            "text_offset": offsets or []}


def _first_of_each(pairs: list[tuple[Token, float]]) -> dict[str, float]:
    """(token, logprob) pairs, most likely first -> {text: logprob}, each text's first (likeliest)."""
    out: dict[str, float] = {}
    for token, lp in pairs:
        out.setdefault(token.text, lp)
    return out


def text_offsets(start: int, chars: list[int]) -> tuple[list[int], int]:
    """(`text_offset` of tokens whose texts follow `start` characters of the choice's earlier
    tokens' texts, where the next token's text starts): each token's offset in the concatenation
    of its choice's token texts, each token decoded alone (`Token.chars` characters each: one
    for part of a character, listed as `bytes:\\xNN`). That concatenation is the choice's text
    except where a stop string cut it or a character's bytes span two tokens."""
    out, at = [], start
    for n in chars:
        out.append(at)
        at += n
    return out, at


class ResponseShape:
    """Builds the JSON objects of one response: the final one, or stream chunks."""

    def __init__(self, chat: bool, request_id: str, model: str) -> None:
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.model = model
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def final(self, choices: Sequence[tuple[str, str, dict | None]], usage_: dict) -> dict:
        """The whole response: choices[i] = (text, finish reason, logprobs) of choice i."""
        if self.chat:
            return {**self._head("chat.completion"), "choices": [
                {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                 "finish_reason": finish} for i, (text, finish, lp) in enumerate(choices)], "usage": usage_}
        return {**self._head("text_completion"), "choices": [
            {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
            for i, (text, finish, lp) in enumerate(choices)], "usage": usage_}

    def chunk(self, text: str, finish: str | None, logprobs: dict | None, first: bool = False,
              index: int = 0) -> dict:
        """A stream chunk of choice `index` (first: its first chunk, which names the role in chat)."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice], "usage": None}
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice], "usage": None}

    def usage_chunk(self, usage_: dict) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage_}

