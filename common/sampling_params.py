"""Validated sampling parameters, as every process sees them after common/validation.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

DEFAULT_MAX_TOKENS = 64
MAX_TOP_LOGPROBS = 20  # alternatives reported per generated token (OpenAI's own limit of top_logprobs)
# logit_bias entries per request: every step of a batch uploads its rows' entries, so a
# request's count bounds what it adds to everyone's step
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = 100.0  # a bias lies in [-100, 100], as in OpenAI's API
PENALTY_RANGE = 2.0  # presence and frequency penalties lie in [-2, 2], as in OpenAI's API
# The fields a decode worker running MTP may not serve: each such worker announces which of them
# it does (common/validation.py SPECULATIVE_SAMPLING); the router places requests accordingly.
SPECULATION_GATED = ("top_logprobs", "logit_bias", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters (see common/validation.py for the checks)."""

    max_tokens: int = DEFAULT_MAX_TOKENS  # tokens to generate, >= 1
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # in (0, 1]
    seed: int = 0  # used when temperature > 0
    stop: tuple[str, ...] = field(default=())
    ignore_eos: bool = False
    top_logprobs: int = 0  # most likely tokens reported beside each generated one, 0..MAX_TOP_LOGPROBS
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits, ids ascending
    presence_penalty: float = 0.0  # subtracted once from the logit of each token generated so far
    frequency_penalty: float = 0.0  # subtracted from a token's logit per time it was generated so far

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a draw depends on the tokens generated before it (its history)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @cached_property
    def speculation_needs(self) -> tuple[str, ...]:
        """The fields it sets whose service a decode worker running MTP announces
        (discovery Instance.speculative_sampling; common.validation.SPECULATIVE_SAMPLING), in
        this order: top_logprobs, logit_bias, presence_penalty, frequency_penalty. () = any
        decode worker serves it."""
        return tuple(name for name in SPECULATION_GATED if getattr(self, name))

    @cached_property
    def plain(self) -> bool:
        """Greedy, with no logit bias, penalty or top log-probabilities: a decode step of such
        rows only takes each row's argmax (looked up once per request: every step asks)."""
        return self.greedy and not (self.top_logprobs or self.logit_bias or self.penalized)

    @cached_property
    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """logit_bias as (token ids int64 [N], biases float32 [N]), built once per request (a
        decode step gathers its rows' arrays every step)."""
        return (np.array([t for t, _ in self.logit_bias], dtype=np.int64),
                np.array([b for _, b in self.logit_bias], dtype=np.float32))
