"""The GPU decode hot path (DESIGN.md section 8, "Where decode time goes on a GPU").

Three pieces, each sync-free so a whole decode step can be captured in a CUDA graph:

- `BatchedDecodeKv`: a KvCache for a step of B sequences with one new token each that also
  runs their attention, batched over the sequences, straight on the paged latent pool, with
  MLA's weight absorption (DeepSeek-V2 report section 2.1.2 / V3 section 2.1.1): W_UK is
  folded into the query (scores = (q_nope W_UK) · c_kv + q_pe · k_pe) and W_UV into the output
  (out = (P c_kv) W_UV), so the cached latent is never expanded per head.
- `use_dense_experts`: the routed experts of a MoE layer as three batched matmuls over every
  expert (weights stacked [E, ...]) with a dense [T, E] routing-weight matrix, for small T
  (decode). No `torch.where`/`.item()` host sync; it reads every expert's weights once, which a
  batch that touches most experts reads anyway.
- `DecodeGraph`: one decode step (embed → layers → lm_head → argmax) captured in a CUDA graph
  for a fixed batch size and block-table width, replayed with new inputs copied into its
  static buffers.

Results equal the plain path up to float summation order (float32 CPU tests compare them);
the plain path stays the default on CPU, where float32 greedy identity with
reference_generate is the contract.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from engine.kv_pool import KvPool

DENSE_EXPERTS_MAX_TOKENS = 1024  # above this (prefill chunks) the per-expert loop is cheaper


class BatchedDecodeKv:
    """KvCache + attention for B sequences, one new token each (tensors on the pool's device).

    Args:
        tables: [B, max_blocks] int64 block tables (entries past a sequence's blocks: any
            valid block id, masked out by lens).
        lens: [B] int64 context length including the new token (new token at lens - 1).
    """

    attends = True  # engine/model.py MLAttention: this cache runs the attention itself

    def __init__(self, pool: KvPool, tables: torch.Tensor, lens: torch.Tensor) -> None:
        self.kv = pool.kv  # [blocks, layers, bs, kv_dim]
        bs = pool.config.block_size
        self.tables, self.lens = tables, lens
        pos = lens - 1
        self.w_blk = tables.gather(1, (pos // bs)[:, None])[:, 0]  # [B]
        self.w_off = pos % bs  # [B]
        self.span = torch.arange(tables.shape[1] * bs, device=tables.device)  # [S_max]

    def update(self, layer: int, latent: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError("BatchedDecodeKv runs attention itself (see attend)")

    def attend(self, layer: int, latent: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
               attn: torch.nn.Module) -> torch.Tensor:
        """Store latent [B, kv_dim]; return attention output [B, H, v_head_dim].

        q_nope [B, H, nope], q_pe [B, H, rope] (rope applied); attn is the MLAttention module.
        """
        c = attn.c
        self.kv[self.w_blk, layer, self.w_off] = latent.to(self.kv.dtype)
        b = latent.shape[0]
        ctx = self.kv[self.tables, layer].reshape(b, -1, c.kv_dim).to(q_nope.dtype)  # [B, S, D]
        h = c.num_attention_heads
        w = attn.kv_b_proj.weight.view(h, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_uk, w_uv = w.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)  # [H, nope|v, R]
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)  # absorbed query [B, H, R]
        # one matmul against the whole latent row [c_kv; k_pe]: q_lat·c_kv + q_pe·k_pe
        q = torch.cat((q_lat, q_pe), dim=-1)  # [B, H, D]
        scores = torch.bmm(q, ctx.transpose(1, 2)).float() * attn.softmax_scale  # [B, H, S]
        future = self.span[None, :] >= self.lens[:, None]  # [B, S]
        probs = scores.masked_fill(future[:, None, :], float("-inf")).softmax(-1).to(ctx.dtype)
        o_lat = torch.bmm(probs, ctx[..., :c.kv_lora_rank])  # [B, H, R] (P · c_kv)
        return torch.einsum("bhr,hvr->bhv", o_lat, w_uv)  # [B, H, v]


def tables_tensor(block_tables: list[list[int]], width: int, device: torch.device) -> torch.Tensor:
    """Pad block tables to [B, width] (with each table's first block) as an int64 tensor."""
    rows = [t + [t[0]] * (width - len(t)) for t in block_tables]
    return torch.tensor(rows, dtype=torch.long, device=device)


def _dense_experts_forward(self, x: torch.Tensor, ids: torch.Tensor,
                           weights: torch.Tensor) -> torch.Tensor:
    # x [T, hidden], ids/weights [T, k] -> [T, hidden]; same contract as MoE.experts_forward
    if x.shape[0] > DENSE_EXPERTS_MAX_TOKENS:
        return type(self).experts_forward(self, x, ids, weights)
    gate = torch.einsum("th,eih->eti", x, self.w_gate)  # [E, T, I]
    up = torch.einsum("th,eih->eti", x, self.w_up)
    y = torch.einsum("eti,ehi->eth", F.silu(gate) * up, self.w_down)  # [E, T, hidden]
    dense = torch.zeros(x.shape[0], self.w_gate.shape[0], dtype=torch.float32, device=x.device)
    dense.scatter_(1, ids, weights.float())  # [T, E] routing weights, 0 for unchosen experts
    return torch.einsum("te,eth->th", dense, y.float()).to(x.dtype)


def use_dense_experts(model: torch.nn.Module) -> int:
    """Switch every MoE layer of model to the batched all-experts forward for T <= 1024.

    The expert weights are moved into stacked [E, ...] tensors and each expert's parameters
    become views of them (no second copy). Returns the number of MoE layers switched.
    """
    from engine.model import MoE

    n = 0
    for moe in model.modules():
        if not isinstance(moe, MoE):
            continue
        for name, attr in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
            stacked = torch.stack([getattr(e, name).weight.detach() for e in moe.experts])
            setattr(moe, attr, stacked)
            for i, e in enumerate(moe.experts):
                getattr(e, name).weight.data = stacked[i]
        moe.experts_forward = types.MethodType(_dense_experts_forward, moe)
        n += 1
    return n


class DecodeGraph:
    """One greedy decode step for a fixed batch size B and table width, as a CUDA graph.

    `step(ids, positions, tables, lens)` copies the inputs into static buffers, replays, and
    returns the static [B] argmax token tensor (valid until the next replay).
    """

    def __init__(self, model: torch.nn.Module, pool: KvPool, batch: int, width: int,
                 scratch_block: int = 0) -> None:
        # warm-up and capture write (garbage) KV into row 0 of scratch_block
        dev = pool.kv.device
        self.model, self.pool = model, pool
        self.ids = torch.zeros(batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch, dtype=torch.long, device=dev)
        self.tables = torch.full((batch, width), scratch_block, dtype=torch.long, device=dev)
        self.lens = torch.ones(batch, dtype=torch.long, device=dev)
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(2):  # warm-up outside the graph (allocator, lazy inits)
                self._run()
        torch.cuda.current_stream(dev).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph):
            self.out = self._run()

    def _run(self) -> torch.Tensor:
        kv = BatchedDecodeKv(self.pool, self.tables, self.lens)
        hidden = self.model(self.ids, self.positions, [1] * self.ids.shape[0], kv)
        return torch.argmax(self.model.logits(hidden), dim=-1)

    def step(self, ids: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor,
             lens: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.positions.copy_(positions)
        self.tables.copy_(tables)
        self.lens.copy_(lens)
        self.graph.replay()
        return self.out
