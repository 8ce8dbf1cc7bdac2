"""The single-process reference generator.

Every runtime path (chunked, pipelined, expert-parallel, speculative, disaggregated, migrated)
is checked against this function: one un-chunked forward over the whole prompt with an unpaged
`ContiguousKvCache`, then one token per forward.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

from engine.kv_cache_contiguous import ContiguousKvCache
from engine.model import DeepseekV3ForCausalLM

SampleFn = Callable[[torch.Tensor, int], int]
"""sample_fn(logits_row [vocab] float32, step) -> token id; step 0 is the first new token."""


def reference_generate(model: DeepseekV3ForCausalLM, token_ids: list[int], max_tokens: int,
                       eos_token_ids: Collection[int] = frozenset(),
                       sample_fn: SampleFn | None = None) -> list[int]:
    """Generate up to `max_tokens` tokens after the prompt `token_ids`.

    Greedy (argmax; ties go to the lowest id) unless `sample_fn` is given. Stops after
    `max_tokens` tokens or right after a token in `eos_token_ids` (that token is included).
    Returns the generated ids only (not the prompt).

    Raises ValueError for an empty prompt, max_tokens < 0, or a token id outside the vocabulary.
    """
    vocab = model.config.vocab_size
    if not token_ids:
        raise ValueError("token_ids: the prompt must not be empty")
    if max_tokens < 0:
        raise ValueError(f"max_tokens={max_tokens}: must be >= 0")
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token_ids: {bad[:5]} outside the vocabulary [0, {vocab})")
    device = model.model.embed_tokens.weight.device
    out: list[int] = []
    with torch.inference_mode():
        kv = ContiguousKvCache(model.config.num_hidden_layers)
        ids = torch.tensor(token_ids, dtype=torch.long, device=device)
        positions = torch.arange(len(token_ids), device=device)
        while len(out) < max_tokens:
            hidden = model(ids, positions, [ids.shape[0]], kv)  # [T, hidden]
            row = model.logits(hidden[-1:])[0]  # [vocab] float32
            if sample_fn is None:
                token = int(torch.argmax(row).item())
            else:
                token = int(sample_fn(row, len(out)))
            out.append(token)
            if token in eos_token_ids:
                break
            ids = torch.tensor([token], dtype=torch.long, device=device)
            positions = positions[-1:] + 1
    return out
