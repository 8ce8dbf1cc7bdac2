"""Runs the model over a KvPool: chunked prefill and batched decode steps.

Calls must come from one thread at a time (the workers use a single-thread executor for
all model work); the pool's block accounting stays on the event-loop thread.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from engine.block_pool import BlockId
from engine.kv_pool import KvPool, PagedKvCache
from engine.mtp import pool_has_mtp, prefill_mtp_rows
from engine.spec_decode import SpecInput, SpecOutput, spec_forward


@dataclass(frozen=True)
class DecodeInput:
    """One running request in a decode step."""

    block_ids: list[BlockId]  # its block table (must have room for num_computed + 1 tokens)
    num_computed: int  # tokens whose KV is already in the pool
    input_token: int  # the token at position num_computed


class ModelRunner:
    """Owns nothing but references: the model and the pool it reads and writes."""

    def __init__(self, model: torch.nn.Module, pool: KvPool) -> None:
        self.model = model
        self.pool = pool

    @torch.inference_mode()
    def prefill_chunk(self, block_ids: list[BlockId], token_ids: list[int], start: int, end: int,
                      mtp: bool = False) -> torch.Tensor:
        """Compute KV for prompt tokens [start, end) (tokens before start are in the pool), and
        with `mtp` the MTP module's KV rows of the chunk too (engine/mtp.py).

        Returns:
            hidden state of the chunk's last token, [hidden].
        """
        device = self.pool.kv.device
        ids = torch.tensor(token_ids[start:end], dtype=torch.long, device=device)
        positions = torch.arange(start, end, dtype=torch.long, device=device)
        kv = PagedKvCache(self.pool, [(block_ids, start, end - start)])
        hidden = self.model.forward(ids, positions, [end - start], kv)  # [chunk, hidden]
        if mtp and pool_has_mtp(self.pool, self.model):  # MTP rows of the chunk (engine/mtp.py)
            prefill_mtp_rows(self.model, self.pool, block_ids, token_ids, start, end, hidden)
        return hidden[-1]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] or [hidden] -> float32 logits [N, vocab] or [vocab]."""
        return self.model.logits(hidden)

    @torch.inference_mode()
    def decode(self, batch: list[DecodeInput]) -> torch.Tensor:
        """One decode step for every request in batch; returns float32 logits [batch, vocab]."""
        device = self.pool.kv.device
        ids = torch.tensor([b.input_token for b in batch], dtype=torch.long, device=device)
        positions = torch.tensor([b.num_computed for b in batch], dtype=torch.long, device=device)
        kv = PagedKvCache(self.pool, [(b.block_ids, b.num_computed, 1) for b in batch])
        hidden = self.model.forward(ids, positions, [1] * len(batch), kv)  # [batch, hidden]
        return self.model.logits(hidden)

    def spec_decode(self, batch: list[SpecInput]) -> list[SpecOutput]:
        """One MTP speculative step (draft, then verify) for every request; see engine/spec_decode.py."""
        return spec_forward(self.model, self.pool, batch)
