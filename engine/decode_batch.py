"""One decode step's inputs as device tensors, and the KV cache that runs its attention on GPUs.

`DecodePlan` is what the host prepares once per step (FlashInfer's plan/run split): input ids,
positions, the padded block tables and context lengths, copied to the device without a sync.
`AbsorbedDecodeKv` is the model's KvCache for such a step on CUDA: it stores each layer's new
latents and runs paged MLA decode attention on the latent pool with MLA's weight absorption
(engine/kernels/mla_decode.py), so a step never expands the cached latents per head and never
loops over sequences. It reads and writes FP8 pools (saturating cast on write, scale on read).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kernels.mla_decode import mla_decode
from engine.kv_pool import FP8, KvPool


@dataclass
class DecodePlan:
    """ids [B] int64, positions [B] int64, tables [B, W] int32 (padded with each row's first
    block), lens [B] int32 (context length including the new token), on the pool's device."""

    ids: torch.Tensor
    positions: torch.Tensor
    tables: torch.Tensor
    lens: torch.Tensor

    @property
    def batch(self) -> int:
        return self.ids.shape[0]

    @property
    def width(self) -> int:
        return self.tables.shape[1]

    @staticmethod
    def build(batch, block_size: int, device: torch.device) -> DecodePlan:
        """batch: engine.runner.DecodeInput rows (block_ids, num_computed, input_token)."""
        pin = device.type == "cuda"
        need = [-(-(b.num_computed + 1) // block_size) for b in batch]
        width = max(need)
        rows = [b.block_ids[:n] + [b.block_ids[0]] * (width - n) for b, n in zip(batch, need)]

        # two host-to-device copies: [ids; positions; lens] and the tables
        rows3 = torch.tensor([[b.input_token for b in batch], [b.num_computed for b in batch],
                              [b.num_computed + 1 for b in batch]], dtype=torch.long,
                             pin_memory=pin).to(device, non_blocking=True)
        tables = torch.tensor(rows, dtype=torch.int32, pin_memory=pin).to(device, non_blocking=True)
        return DecodePlan(rows3[0], rows3[1], tables, rows3[2].int())


AttentionFn = Callable[..., torch.Tensor]


class AbsorbedDecodeKv:
    """KvCache + attention for B sequences with one new token each (tensors on the pool's device).

    Args:
        pool: the KV pool (model dtype or FP8).
        tables: [B, W] int32 block tables (past a row's blocks: any valid block, masked by lens).
        lens: [B] int32 context lengths including the new token (written at lens - 1).
        attention: the decode attention kernel, `mla_decode` (Triton) on GPUs;
            tests pass `engine.kernels.mla_decode.mla_decode_reference` to check the rest on CPU.
    """

    attends = True  # engine/model.py MLAttention: this cache runs the attention itself

    def __init__(self, pool: KvPool, tables: torch.Tensor, lens: torch.Tensor,
                 attention: AttentionFn = mla_decode) -> None:
        self.kv = pool.kv  # [blocks, layers, block_size, kv_dim]
        self.quantized = pool.config.quantized
        self.scale = pool.config.scale
        self.tables, self.lens, self.attention = tables, lens, attention
        bs = pool.config.block_size
        pos = (lens - 1).long()
        self.w_blk = tables.long().gather(1, (pos // bs)[:, None])[:, 0]  # [B]
        self.w_off = pos % bs  # [B]

    def update(self, layer: int, latent: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError("AbsorbedDecodeKv runs attention itself (see attend)")

    def _store(self, layer: int, latent: torch.Tensor) -> None:
        if not self.quantized:
            self.kv[self.w_blk, layer, self.w_off] = latent.to(self.kv.dtype)
            return
        fmax = torch.finfo(FP8).max  # a cast beyond e4m3's range gives NaN: saturate first
        q = (latent.float() / self.scale).clamp(-fmax, fmax).to(FP8)
        self.kv.view(torch.uint8)[self.w_blk, layer, self.w_off] = q.view(torch.uint8)

    def attend(self, layer: int, latent: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
               attn: torch.nn.Module) -> torch.Tensor:
        """Store latent [B, kv_dim]; return attention output [B, H, v_head_dim].

        q_nope [B, H, nope], q_pe [B, H, rope] (rope applied); attn is the MLAttention module.
        """
        c = attn.c
        self._store(layer, latent)
        h = c.num_attention_heads
        w = attn.kv_b_proj.weight.view(h, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_uk, w_uv = w.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)  # [H, nope|v, R]
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)  # absorbed query [B, H, R]
        q = torch.cat((q_lat, q_pe), dim=-1).contiguous()  # [B, H, R + rope]
        o_lat = self.attention(q, self.kv, layer, self.tables, self.lens, c.kv_lora_rank,
                               attn.softmax_scale, self.scale)  # [B, H, R]
        return torch.einsum("bhr,hvr->bhv", o_lat.to(q_nope.dtype), w_uv)  # [B, H, v]
