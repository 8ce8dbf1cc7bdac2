"""Validated sampling parameters, as every process sees them after common/validation.py."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MAX_TOKENS = 64
MAX_TOP_LOGPROBS = 20  # alternatives reported per generated token (OpenAI's own limit of top_logprobs)
MAX_LOGIT_BIAS = 1024  # logit_bias entries per request (each is applied to every step's logits)
LOGIT_BIAS_RANGE = 100.0  # a bias lies in [-100, 100], as in OpenAI's API


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
