"""The MTP module's KV in the paged pool (docs/architecture.md, "Decode runtime").

Convention (as `DeepseekV3ForCausalLM.mtp_forward` and tools/mtp_accept.py): MTP KV row p
holds the pair (main final-normed hidden at p, token at p + 1); its output predicts the token
at p + 2. The pool keeps the MTP layer(s) after the main layers (`config.num_kv_layers`
layers per block), so one block carries every layer's latents and a KV transfer moves the MTP
rows with the main ones.

A prompt of P tokens gets MTP rows 0..P-2 during prefill (each needs only prompt tokens); row
P-1 needs the first generated token, so the decode side writes it in its first speculative
step from the prompt's last hidden state (which the prefill worker returns for that).
Only MTP module 0 is used, chained for k drafts, as DeepSeek-V3 and SGLang do.

The MTP rows cost a prefill one more layer, so they are computed only for prompts that a
speculative decode worker will decode (the prefill worker sees `return_last_hidden`). Blocks
that entered the prefix cache from a prompt prefilled without them hold stale MTP rows; a
speculative request reusing such blocks drafts worse at those positions, and its output is
unchanged (every emitted token is the target's own choice).
"""

from __future__ import annotations

import torch

from engine.block_pool import BlockId
from engine.kv_pool import KvPool, PagedKvCache
from engine.upload import upload

MTP_MODULE = 0  # the module chained for every draft step


def pool_has_mtp(pool: KvPool, model: torch.nn.Module) -> bool:
    """True when the pool has room for MTP module 0's KV and the model has the module."""
    c = model.config
    return c.num_nextn_predict_layers > 0 and pool.config.num_layers > c.num_hidden_layers


def prefill_mtp_rows(model: torch.nn.Module, pool: KvPool, block_ids: list[BlockId],
                     token_ids: list[int], start: int, end: int, hidden: torch.Tensor) -> bool:
    """Write MTP rows start..min(end, P-1)-1 of a prompt chunk [start, end) (P = len(token_ids)).

    Args:
        hidden: [end - start, hidden] the main model's final-normed output for the chunk.
    Row p pairs hidden[p - start] with token_ids[p + 1]; the chunk's rows are computed in one
    MTP forward that attends to rows 0..p (earlier chunks or the prefix cache wrote the rest).
    Returns whether the MTP forward ran (False for a chunk ending at the prompt's last token alone).
    """
    stop = min(end, len(token_ids) - 1)
    if stop <= start:
        return False
    n = stop - start
    device = hidden.device
    next_ids = upload(token_ids[start + 1:stop + 1], torch.long, device)
    positions = torch.arange(start, stop, dtype=torch.long, device=device)
    kv = PagedKvCache(pool, [(block_ids, start, n)])
    model.mtp_forward(MTP_MODULE, hidden[:n], next_ids, positions, [n], kv)
    return True


def hidden_to_bytes(hidden: torch.Tensor) -> bytes:
    """[hidden] tensor -> float32 little-endian bytes (PrefillResponse.last_hidden)."""
    return hidden.detach().float().cpu().contiguous().numpy().astype("<f4").tobytes()


def hidden_from_bytes(data: bytes, hidden_size: int, dtype: torch.dtype,
                      device: torch.device | str) -> torch.Tensor:
    """Inverse of hidden_to_bytes -> [hidden_size] in dtype (exact for float32/bf16/fp16 sources).

    Raises ValueError when the length is not 4 × hidden_size bytes."""
    if len(data) != 4 * hidden_size:
        raise ValueError(f"last_hidden: {len(data)} bytes, expected {4 * hidden_size} "
                         f"(float32 × hidden_size {hidden_size})")
    t = torch.frombuffer(bytearray(data), dtype=torch.float32)
    return t.to(dtype=dtype, device=device)
