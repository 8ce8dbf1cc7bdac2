"""Sampling: greedy, temperature and top-p, reproducible across processes.

The random stream for generated token `step` (0 = first token) is seeded from
(seed, step) alone, so the prefill worker (which samples token 0), the decode worker and a
migrated request all draw the same numbers without sharing generator state.
"""

from __future__ import annotations

import torch
import xxhash

from common.sampling_params import SamplingParams

__all__ = ["SamplingParams", "sample", "sampling_logprobs"]

def _generator(seed: int, step: int, stream: int = 0) -> torch.Generator:
    # stream 0 draws the token itself; speculative decoding (engine/spec_decode.py) uses other
    # streams for its draft, accept and resample draws of the same step
    key = step.to_bytes(8, "little") + (stream.to_bytes(4, "little") if stream else b"")
    g = torch.Generator()
    g.manual_seed(xxhash.xxh3_64_intdigest(key, seed=seed) & ((1 << 63) - 1))
    return g


def sampling_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution `sample` draws from, as log-probabilities [vocab] (float32): softmax of
    logits [vocab] / temperature, restricted to the top-p nucleus and renormalised (for greedy:
    plain log_softmax of the logits)."""
    logits = logits.float()
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    logp = torch.log_softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_logp, order = torch.sort(logp, descending=True)
        cum = torch.cumsum(sorted_logp.exp(), dim=-1)
        drop = cum - sorted_logp.exp() >= params.top_p  # keep the smallest set with mass >= top_p
        sorted_logp = sorted_logp.masked_fill(drop, float("-inf"))
        logp = torch.full_like(logp, float("-inf")).scatter(0, order, sorted_logp)
        logp = torch.log_softmax(logp, dim=-1)
    return logp


def sample(logits: torch.Tensor, params: SamplingParams, step: int) -> tuple[int, float]:
    """Pick the next token from one row of logits.

    Args:
        logits: [vocab] float32 logits of the last position.
        params: sampling parameters.
        step: index of the token being generated (0 = first generated token).
    Returns:
        (token id, log-probability of that token under softmax(logits / T) after top-p
        filtering; under softmax(logits) for greedy).
    """
    logits = logits.float().cpu()  # the generator is a CPU one: same draws on every device
    if params.greedy:
        token = int(torch.argmax(logits))
        return token, float(torch.log_softmax(logits, dim=-1)[token])
    logp = sampling_logprobs(logits.cpu(), params)  # the seeded generators are CPU generators
    token = int(torch.multinomial(logp.exp(), 1, generator=_generator(params.seed, step)))
    return token, float(logp[token])
