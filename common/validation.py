"""Request validation shared by the router and the workers (docs/architecture.md, step 1).

Every failure raises InvalidArgument naming the offending field; servers turn it into
gRPC INVALID_ARGUMENT with that message, and never count it against a worker's health.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from common.pb.tandem.v1 import sampling_pb2
from common.sampling_params import (DEFAULT_MAX_TOKENS, LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS,
                                    PENALTY_RANGE, SamplingParams)


class InvalidArgument(ValueError):
    """A request field is invalid; str(exc) starts with the field name."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.reason = field, message


def validate_token_ids(token_ids: list[int], vocab_size: int, field: str = "token_ids") -> None:
    if not token_ids:
        raise InvalidArgument(field, "prompt is empty")
    if min(token_ids) >= 0 and max(token_ids) < vocab_size:
        return  # two C-level passes; the loop below only runs to name the bad index
    for i, t in enumerate(token_ids):
        if not 0 <= t < vocab_size:
            raise InvalidArgument(f"{field}[{i}]", f"token id {t} outside the vocabulary [0, {vocab_size})")


MAX_STOP_STRINGS = 16  # stop strings per request (OpenAI allows 4; every one is checked per token)
MAX_STOP_CHARS = 256  # characters per stop string
MAX_REQUEST_ID_CHARS = 128  # client request ids: they travel in every internal call and KV notification
INTERNAL_ID_SUFFIX_CHARS = 16  # room workers leave for the router's ".<attempt>" suffix of a migrated call


def validate_request_id(request_id: str, internal: bool = False) -> None:
    """Raises InvalidArgument naming request_id for an id longer than MAX_REQUEST_ID_CHARS
    (internal = a worker's check of a router's call: plus INTERNAL_ID_SUFFIX_CHARS), or with a
    character that is no printable ASCII: ids go into every process's log lines, where a line
    break would let a client write a line of its own. Empty is allowed here: the server assigns
    one."""
    limit = MAX_REQUEST_ID_CHARS + (INTERNAL_ID_SUFFIX_CHARS if internal else 0)
    if len(request_id) > limit:
        raise InvalidArgument("request_id", f"{len(request_id)} characters; at most {limit}")
    if not request_id.isascii() or not request_id.isprintable():
        raise InvalidArgument("request_id", "only printable ASCII characters")


MAX_CACHE_SALT_CHARS = 256  # a tenant's cache salt ("tenant:<name>" or "group:<name>", router/api_keys.py)


def validate_cache_salt(cache_salt: str) -> None:
    """Raises InvalidArgument naming cache_salt when it is longer than MAX_CACHE_SALT_CHARS."""
    if len(cache_salt) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgument("cache_salt", f"{len(cache_salt)} characters; at most {MAX_CACHE_SALT_CHARS}")


MIN_TEMPERATURE = 1e-3  # below this, logits / T overflows float32; use 0 for greedy
FLOAT32_MAX = 3.4028234663852886e38  # the largest float32: sampling values travel as float32 fields
FLOAT32_TINY = 7.006492321624085e-46  # half the smallest float32: positive values below it travel as 0


def validate_prompt_length(prompt_tokens: int, context_length: int, field: str) -> None:
    """Raises InvalidArgument naming `field` when no token could be generated after the prompt."""
    if prompt_tokens >= context_length:
        raise InvalidArgument(field, f"prompt has {prompt_tokens} tokens; the model's context length is "
                                     f"{context_length}, so at most {context_length - 1} fit")


def _f32(value: float) -> str:
    """A float32 field's value as the shortest text that reads back as it (2.0000002, not the 2
    that 7 digits gave for a penalty just over 2)."""
    return repr(float(str(np.float32(value))))  # (numpy's shortest digits, Python's notation: 0.0001, not 1e-04)


def sampling_from_proto(msg: sampling_pb2.SamplingParams, prompt_tokens: int, context_length: int,
                        vocab_size: int, default_seed: int = 0) -> SamplingParams:
    """Validate sampling fields against the prompt length, the model's context length and its
    vocabulary (logit_bias's token ids).

    Raises:
        InvalidArgument: naming sampling.max_tokens, sampling.temperature, sampling.top_p,
            sampling.stop, sampling.top_logprobs, sampling.logit_bias[id], sampling.presence_penalty
            or sampling.frequency_penalty (call validate_prompt_length first: an over-long prompt is the
            prompt's fault, not max_tokens').
    """
    max_tokens = msg.max_tokens if msg.HasField("max_tokens") else min(
        DEFAULT_MAX_TOKENS, context_length - prompt_tokens)
    if max_tokens < 1:
        raise InvalidArgument("sampling.max_tokens", f"must be >= 1, got {max_tokens}")
    if prompt_tokens + max_tokens > context_length:
        raise InvalidArgument("sampling.max_tokens",
                              f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds "
                              f"the context length {context_length}")
    temperature = msg.temperature if msg.HasField("temperature") else 0.0
    if not (math.isfinite(temperature) and (temperature == 0.0 or temperature >= MIN_TEMPERATURE)):
        raise InvalidArgument("sampling.temperature",
                              f"must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {_f32(temperature)}")
    top_p = msg.top_p if msg.HasField("top_p") else 1.0
    if not (0.0 < top_p <= 1.0):
        raise InvalidArgument("sampling.top_p", f"must be in (0, 1], got {_f32(top_p)}")
    if any(s == "" for s in msg.stop):
        raise InvalidArgument("sampling.stop", "stop strings must be non-empty")
    if len(msg.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument("sampling.stop", f"{len(msg.stop)} stop strings; at most {MAX_STOP_STRINGS}")
    for i, stop in enumerate(msg.stop):
        if len(stop) > MAX_STOP_CHARS:
            raise InvalidArgument(f"sampling.stop[{i}]", f"{len(stop)} characters; at most {MAX_STOP_CHARS}")
    top_logprobs = msg.top_logprobs if msg.HasField("top_logprobs") else 0
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidArgument("sampling.top_logprobs", f"must be in 0..{MAX_TOP_LOGPROBS}, got {top_logprobs}")
    if len(msg.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidArgument("sampling.logit_bias", f"{len(msg.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
    for token, bias in sorted(msg.logit_bias.items()):
        if not 0 <= token < vocab_size:
            raise InvalidArgument(f"sampling.logit_bias[{token}]", f"not a token id of the model's vocabulary "
                                  f"[0, {vocab_size})")
        if not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:  # (NaN too)
            raise InvalidArgument(f"sampling.logit_bias[{token}]", f"must be in [-100, 100], got {_f32(bias)}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(msg, name)
        if not -PENALTY_RANGE <= value <= PENALTY_RANGE:  # (NaN too)
            raise InvalidArgument(f"sampling.{name}", f"must be in [-2, 2], got {_f32(value)}")
    return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                          seed=msg.seed if msg.HasField("seed") else default_seed,
                          stop=tuple(msg.stop), ignore_eos=msg.ignore_eos, top_logprobs=top_logprobs,
                          logit_bias=tuple(sorted(msg.logit_bias.items())),
                          presence_penalty=float(msg.presence_penalty), frequency_penalty=float(msg.frequency_penalty))


def validate_step_offset(step_offset: int, prompt_tokens: int) -> None:
    """Raises InvalidArgument naming sampling_step_offset when it counts as generated more
    tokens than the prompt leaves after its first (a migrated request's token_ids are its
    prompt, at least one token, then the tokens generated so far)."""
    if step_offset >= max(prompt_tokens, 1):
        raise InvalidArgument("sampling_step_offset", f"{step_offset} generated tokens in a prompt of {prompt_tokens}; "
                              "at least the first token must be the request's own prompt")


def generated_before(token_ids: Sequence[int], step_offset: int, params: SamplingParams) -> list[int]:
    """The tokens a request generated before this call, as a penalized draw counts them: a
    migrated request's token_ids end with them (its sampling_step_offset of them); [] for a
    request without penalties (nothing reads them)."""
    if not params.penalized or step_offset <= 0:
        return []
    return list(token_ids[max(0, len(token_ids) - step_offset):])


# The gated sampling fields (common/sampling_params.py SPECULATION_GATED) this release's decode
# workers serve while running MTP, announced in their discovery records: each emitted token's top
# log-probabilities come from its verify row, and a logit bias applies to the draft and verify
# logits alike. Penalties are not served: a verify row's would count the drafts before it.
SPECULATIVE_SAMPLING = ("top_logprobs", "logit_bias")
# What an MTP worker whose record lists none (discovery Instance.speculative_sampling empty: the
# release before the list) is taken to serve: that release served both. A release before it
# refused them itself, by name, as its router never sent them there.
UNLISTED_SPECULATIVE_SAMPLING = ("top_logprobs", "logit_bias")

_UNSERVED = {
    "presence_penalty": "which applies no penalties: use 0",
    "frequency_penalty": "which applies no penalties: use 0",
    # only an MTP worker that announces it does not serve them
    "top_logprobs": "which reports no top log-probabilities: use 0",
    "logit_bias": "which applies no logit bias: leave it out",
}


def refuse_under_speculation(params: SamplingParams, who: str,
                             served: Sequence[str] = SPECULATIVE_SAMPLING) -> None:
    """Raises InvalidArgument naming the first field params sets that a decode worker running
    MTP speculative decoding and serving `served` does not serve (this release's workers:
    SPECULATIVE_SAMPLING, so penalties). who: the message's subject ("this decode worker
    runs", "every decode worker here runs")."""
    for name in params.speculation_needs:  # (in SPECULATION_GATED's order)
        if name not in served:
            raise InvalidArgument(f"sampling.{name}", f"{who} speculative decoding (MTP), {_UNSERVED[name]}")


def top_to_proto(top: tuple[tuple[int, float], ...]) -> sampling_pb2.TopLogprobs:
    """A token's most likely alternatives, (id, logprob) pairs, as TopLogprobs."""
    return sampling_pb2.TopLogprobs(token_ids=[i for i, _ in top], logprobs=[lp for _, lp in top])


def top_from_proto(msg: sampling_pb2.TopLogprobs, vocab_size: int, limit: int) -> tuple[tuple[int, float], ...]:
    """TopLogprobs from a peer -> at most `limit` (id, logprob) pairs, ids outside the vocabulary
    left out (the router turns each id into text)."""
    pairs = ((i, lp) for i, lp in zip(msg.token_ids, msg.logprobs) if 0 <= i < vocab_size)
    return tuple(pairs)[:limit]


def sampling_to_proto(p: SamplingParams) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                                       seed=p.seed, stop=list(p.stop), ignore_eos=p.ignore_eos,
                                       top_logprobs=p.top_logprobs or None, logit_bias=dict(p.logit_bias),
                                       presence_penalty=p.presence_penalty or None,
                                       frequency_penalty=p.frequency_penalty or None)
