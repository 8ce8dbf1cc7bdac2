"""One decode step's inputs as device tensors, and the KV cache that runs its attention on GPUs.

`DecodePlan` is what the host prepares once per step (FlashInfer's plan/run split): input ids,
positions, the padded block tables and context lengths, copied to the device without a sync.
`AbsorbedDecodeKv` is the model's KvCache for such a step on CUDA: it writes each layer's new
latents (engine/kernels/latent_store.py, one kernel with the queries' rope and W_UK) and runs paged MLA
decode attention on the latent pool with MLA's weight absorption (engine/kernels/mla_decode.py),
so a step never expands the cached latents per head and never loops over sequences. It reads
and writes FP8 pools (saturating cast on write, scale on read).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.kernels import small_gemv
from engine.kernels.latent_store import rope_latent_store, rope_latent_store_reference, triton
from engine.kernels.mla_decode import mla_decode
from engine.kv_pool import KvPool
from engine.upload import PinnedRing


class BlockTables:
    """The running requests' block tables, kept on the device between decode steps.

    A decode step reads each row's table; rebuilding a [B, W] tensor from Python lists every
    step costs more host time than the step's GPU work at B = 64 (measured on an H200), and a
    table changes only when a request joins or grows by a block (every block_size steps). So each
    request keeps a row of `store` [rows, width] int32, keyed by its block list's identity, and a
    step uploads only rows whose content changed (one host-to-device copy, none on most steps).
    A row is right whenever its cached copy equals the list's first `need` entries: that
    comparison runs every step (in C, for all rows), so a list mutated in place or a recycled
    list identity is caught. Entries past a row's length are left from earlier use: valid block
    ids, never read (masked by the row's length).

    Args:
        rows: rows of the store (at least the largest batch; a full store evicts rows of
            requests absent from the current step).
        width: blocks per row (the longest context's blocks).
        fixed: True once graphs captured `store`'s address: it may not be reallocated.
    """

    def __init__(self, rows: int, width: int, device: torch.device, fixed: bool = False) -> None:
        self.store = torch.zeros((rows, width), dtype=torch.int32, device=device)
        # this store's row uploads and the steps' plans (DecodePlan.build): two a step at most, and
        # two launches of up to MAX_STEPS_PER_LAUNCH steps in flight, so a buffer comes round
        # again only once its copy has run
        from engine.overlap_runner import MAX_STEPS_PER_LAUNCH
        self.staging = PinnedRing(device, depth=4 * MAX_STEPS_PER_LAUNCH + 2)
        self.fixed = fixed
        self._row: dict[int, int] = {}  # id(block list) -> row
        self._cached: list[list[int] | None] = [None] * rows
        self._free = list(range(rows - 1, -1, -1))

    @property
    def width(self) -> int:
        return self.store.shape[1]

    def reserve_row(self, block: int) -> int:
        """A row owned by no request whose first entry is `block` (graphs' padding rows)."""
        r = self._free.pop()
        self.store[r, 0] = block
        return r

    def rows_for(self, lists: list[list[int]], need: list[int]) -> list[int]:
        """The row of each block list (its first need[i] entries uploaded if changed).

        Raises ValueError when a row needs more than `width` blocks or the batch more rows than
        the store has and the store is fixed."""
        if not lists:  # an EP rank's share of a step can be empty (all its rows padding)
            return []
        w = max(need)
        if w > self.width or len(lists) > self.store.shape[0]:
            if self.fixed:
                raise ValueError(f"decode batch of {len(lists)} rows × {w} blocks exceeds the captured "
                                 f"block tables ({self.store.shape[0]} × {self.width})")
            self._grow(max(len(lists), self.store.shape[0]), max(w, self.width))
        rows, changed = [], []
        for lst, n in zip(lists, need):
            r = self._row.get(id(lst))
            if r is None:
                r = self._take(lists)
                self._row[id(lst)] = r
            head = lst[:n]
            if self._cached[r] != head:
                self._cached[r] = head
                changed.append((r, head))
            rows.append(r)
        if changed:
            wc = max(len(h) for _, h in changed)
            up = self.staging.upload([[r, *h, *([h[0]] * (wc - len(h)))] for r, h in changed], torch.int32)
            self.store[up[:, 0].long(), :wc] = up[:, 1:]
        return rows

    def _take(self, lists: list[list[int]]) -> int:
        if not self._free:  # evict the rows of requests that are not in this step
            present = {id(lst) for lst in lists}
            for key in [k for k in self._row if k not in present]:
                r = self._row.pop(key)
                self._cached[r] = None
                self._free.append(r)
        return self._free.pop()

    def _grow(self, rows: int, width: int) -> None:
        old = self.store
        self.store = torch.zeros((rows, width), dtype=torch.int32, device=old.device)
        self.store[: old.shape[0], : old.shape[1]] = old
        self._cached += [None] * (rows - len(self._cached))
        self._free = list(range(rows - 1, old.shape[0] - 1, -1)) + self._free


@dataclass
class DecodePlan:
    """One step's inputs on the device: `ints` [5, B] int64 = (input ids, positions, context
    lengths including the new token, block-table rows, future-map slots), built on the host and
    copied in one non-blocking host-to-device copy; `store` is BlockTables.store. B may exceed
    `batch` by padding rows (graphs' buckets); width = blocks of the longest row."""

    ints: torch.Tensor
    store: torch.Tensor
    batch: int
    width: int

    @property
    def ids(self) -> torch.Tensor:
        return self.ints[0, : self.batch]

    @property
    def positions(self) -> torch.Tensor:
        return self.ints[1, : self.batch]

    @property
    def lens(self) -> torch.Tensor:
        return self.ints[2, : self.batch].int()

    @property
    def slots(self) -> torch.Tensor:
        return self.ints[4, : self.batch]

    @property
    def tables(self) -> torch.Tensor:
        """[batch, width] int32 block tables (a gather from the store)."""
        return self.store.index_select(0, self.ints[3, : self.batch])[:, : self.width]

    @staticmethod
    def build(batch, block_size: int, device: torch.device, tables: BlockTables | None = None,
              slots: list[int] | None = None, pad_to: int = 0, pad_row: int = 0,
              out: torch.Tensor | None = None) -> DecodePlan:
        """batch: engine.runner.DecodeInput rows (block_ids, num_computed, input_token).

        tables: the runner's BlockTables (None: a throw-away one, for tests); slots: future-map
        slots the step's tokens go to (default: none, -1); pad_to: total rows including padding
        rows (a one-token context in `pad_row`, writing to no slot); out: a [5, rows] int64
        device tensor the plan is copied into (DecodeGraphs' static input: the replay then
        needs no copy of its own), else a new one."""
        if tables is None:
            tables = BlockTables(max(1, len(batch)), 1, device)
        need = [-(-(b.num_computed + 1) // block_size) for b in batch]
        rows = tables.rows_for([b.block_ids for b in batch], need)
        pad = max(0, pad_to - len(batch))
        ints = tables.staging.upload([[b.input_token for b in batch] + [0] * pad,
                                      [b.num_computed for b in batch] + [0] * pad,
                                      [b.num_computed + 1 for b in batch] + [1] * pad,
                                      rows + [pad_row] * pad,
                                      (slots if slots is not None else [-1] * len(batch)) + [-1] * pad], torch.long,
                                     out)
        return DecodePlan(ints, tables.store, len(batch), max(need, default=1))


AttentionFn = Callable[..., torch.Tensor]


class AbsorbedDecodeKv:
    """KvCache + attention for B sequences with one new token each (tensors on the pool's device).

    Args:
        pool: the KV pool (model dtype or FP8).
        tables: [B, W] int32 block tables (past a row's blocks: any valid block, masked by lens).
        lens: [B] int32 context lengths including the new token (written at lens - 1).
        attention: the decode attention kernel, `mla_decode` (Triton) on GPUs;
            tests pass `engine.kernels.mla_decode.mla_decode_reference` to check the rest on CPU.
    The latent write, the query's rope and the absorbed query run as `rope_latent_store` (one
    Triton launch) on a CUDA pool, as its plain twin `rope_latent_store_reference` elsewhere
    (tests on a CPU).
    """

    attends = True  # engine/model.py MLAttention: this cache ropes, stores and attends itself

    def __init__(self, pool: KvPool, tables: torch.Tensor, lens: torch.Tensor,
                 attention: AttentionFn = mla_decode) -> None:
        self.kv = pool.kv  # [blocks, layers, block_size, kv_dim]
        self.scale = pool.config.scale
        self.tables, self.lens, self.attention = tables, lens, attention
        self.rope_store = (rope_latent_store if self.kv.is_cuda and triton is not None
                           else rope_latent_store_reference)
        bs = pool.config.block_size
        pos = (lens - 1).long()
        self.w_blk = tables.long().gather(1, (pos // bs)[:, None])[:, 0]  # [B]
        self.w_off = pos % bs  # [B]

    def update(self, layer: int, latent: torch.Tensor) -> list[torch.Tensor]:
        raise NotImplementedError("AbsorbedDecodeKv runs attention itself (see attend)")

    def attend(self, layer: int, kv_a: torch.Tensor, q_nope: torch.Tensor, q_pe: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor], attn: torch.nn.Module) -> torch.Tensor:
        """Store the tokens' latents; return the attention output [B, H, v_head_dim] (contiguous).

        kv_a [B, kv_dim] (kv_a_proj_with_mqa's output), q_nope [B, H, nope], q_pe [B, H, rope]
        (before rope), rope = (cos, sin) [B, rope]; attn is the MLAttention module.
        """
        c = attn.c
        norm = attn.kv_a_layernorm
        h = c.num_attention_heads
        w = attn.kv_b_proj.weight.view(h, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
        w_uk, w_uv = w.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)  # [H, nope|v, R]
        # the latent's write, the queries' rope and the absorbed query q_nope · W_UK [B, H, R] in
        # one launch (on a CPU the plain functions and an einsum)
        q_pe, q_lat = self.rope_store(q_pe, kv_a, rope[0], rope[1], norm.weight, norm.eps, c.kv_lora_rank,
                                      c.rope_interleave, self.kv, layer, self.w_blk, self.w_off, self.scale,
                                      q_nope=q_nope, w_uk=w_uk)
        # q_lat and q_pe go to the kernel apart: no [B, H, R + rope] concatenation per layer
        o_lat = self.attention(q_lat, self.kv, layer, self.tables, self.lens, c.kv_lora_rank,
                               attn.softmax_scale, self.scale, q_pe=q_pe)  # [B, H, R]
        # W_UV per head as one batched GEMM over heads, written straight into a [B, H, v] tensor:
        # einsum's result would be [H, B, v] in memory, and o_proj's reshape to [B, H * v] then
        # copied it (a kernel a layer at B > 1)
        out = torch.empty(q_nope.shape[0], h, c.v_head_dim, dtype=q_nope.dtype, device=q_nope.device)
        o_lat = o_lat.to(q_nope.dtype)
        if small_gemv.takes(o_lat, w_uv):  # 1 or 2 rows: one GEMV a head, weights loaded early
            return small_gemv.gemv(o_lat, w_uv, out=out)
        torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2), out=out.transpose(0, 1))
        return out
