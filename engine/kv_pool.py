"""The paged KV pool: one tensor holding every block, plus its block accounting.

Layout `[num_blocks, num_layers, block_size, kv_dim]` (block-major): all of one block's
bytes, over every layer, are contiguous, so a block is one transfer descriptor and a run of
consecutive blocks merges into one (transfers want few, large descriptors).
kv_dim = kv_lora_rank + qk_rope_head_dim: MLA caches one compressed latent per token per
layer, so bytes per token = kv_dim × num_layers × element size.

FP8 (`--kv-cache-dtype fp8_e4m3`): the pool holds `float8_e4m3fn` values latent / scale with
one per-pool scale (as vLLM's per-tensor FP8 KV scales; default 1.0: the latents are RMS-normed
or rope'd projections, well inside e4m3's range of ±448 down to 2^-9), dequantized on read.
A per-pool scale keeps a block's bytes exactly its values, so the transfer and the bytes-per-token
formula are unchanged; both workers must agree on dtype and scale (checked per request).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.block_hash import BlockHash, block_hashes
from engine.block_pool import BlockId, BlockPool, PoolExhausted
from engine.upload import upload

__all__ = ["KV_CACHE_DTYPES", "KvPoolConfig", "KvPool", "PromptBlocks", "PagedKvCache", "PackedContexts", "PoolExhausted",
           "kv_cache_torch_dtype"]

FP8 = torch.float8_e4m3fn
KV_CACHE_DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp8_e4m3": FP8}
"""--kv-cache-dtype choices; auto = the model's dtype."""


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool dtype for a --kv-cache-dtype value. Raises ValueError naming the flag."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype {name!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
    return KV_CACHE_DTYPES[name] or model_dtype


@dataclass(frozen=True)
class KvPoolConfig:
    num_blocks: int  # blocks in the pool
    block_size: int  # tokens per block (the page size; one value per model)
    num_layers: int  # layers whose latent KV is cached
    kv_dim: int  # cached values per token per layer
    dtype: torch.dtype = torch.float32  # storage dtype (float8_e4m3fn = FP8 KV cache)
    scale: float = 1.0  # FP8 only: stored value = latent / scale (per pool)

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "num_layers", "kv_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.scale > 0:
            raise ValueError(f"--kv-cache-scale must be > 0, got {self.scale}")

    @property
    def quantized(self) -> bool:
        return self.dtype == FP8

    @property
    def dtype_name(self) -> str:
        """Storage dtype as torch names it ("float32", "bfloat16", "float8_e4m3fn"); sent in
        KvDestination.kv_cache_dtype so both workers can check they agree."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def bytes_per_token(self) -> int:
        return self.kv_dim * self.num_layers * torch.empty((), dtype=self.dtype).element_size()

    @property
    def block_bytes(self) -> int:
        return self.bytes_per_token * self.block_size


@dataclass
class PromptBlocks:
    """A prompt's blocks in one pool. block_ids[:num_cached_blocks] came from the prefix cache."""

    block_ids: list[BlockId]
    hashes: list[BlockHash]  # hashes of the prompt's full blocks
    num_cached_blocks: int


class KvPool:
    """KV storage plus allocation for requests (single-threaded: call from one thread/loop)."""

    def __init__(self, config: KvPoolConfig, hash_seed: int, device: str | torch.device = "cpu",
                 kv: torch.Tensor | None = None) -> None:
        """`kv`, when given, is the storage to use (an EP rank's share of a shared-memory pool,
        shape [num_blocks, num_layers, block_size, kv_dim]); otherwise a zeroed tensor is made."""
        self.config = config
        self.hash_seed = hash_seed
        shape = (config.num_blocks, config.num_layers, config.block_size, config.kv_dim)
        if kv is not None and tuple(kv.shape) != shape:
            raise ValueError(f"kv storage of shape {tuple(kv.shape)} for a pool of shape {shape}")
        self.kv = kv if kv is not None else torch.zeros(shape, dtype=config.dtype, device=device)
        self.blocks = BlockPool(config.num_blocks)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.config.block_size)

    def allocate_beside(self, like: list[BlockId], n: int) -> list[BlockId]:
        """n fresh blocks in the pool that holds `like` (here: this one; an EP worker's pool
        picks the rank of `like`). Raises PoolExhausted: nothing is taken then."""
        return self.blocks.allocate(n)

    def allocate_prompt(self, token_ids: list[int], seed: int | None = None) -> PromptBlocks:
        """Blocks for a whole prompt, reusing the longest cached prefix.

        At least one prompt token is always left to compute (its logits give the first
        token), and a cached block is never written: when every full block is cached, the
        last one is recomputed into a fresh block. `seed`: the request's block-hash seed (a
        tenant's cache salt gives another one, so tenants share no prefix); None = hash_seed.
        Raises:
            PoolExhausted: not enough free blocks (nothing is held then).
        """
        bs = self.config.block_size
        hashes = block_hashes(token_ids, bs, self.hash_seed if seed is None else seed)
        cached = self.blocks.match_prefix(hashes)[: (len(token_ids) - 1) // bs]
        self.blocks.acquire(cached)
        try:
            fresh = self.blocks.allocate(self.blocks_for(len(token_ids)) - len(cached))
        except PoolExhausted:
            self.blocks.free(cached)
            raise
        return PromptBlocks(list(cached) + fresh, hashes, len(cached))

    def commit_prompt(self, prompt: PromptBlocks) -> None:
        """Enter the prompt's full blocks into the prefix cache once their KV is written."""
        n = len(prompt.hashes)
        start = prompt.num_cached_blocks
        parent = prompt.hashes[start - 1] if start > 0 else None
        self.blocks.cache(prompt.block_ids[start:n], prompt.hashes[start:n], parent)

    def grow(self, block_ids: list[BlockId], num_tokens: int) -> None:
        """Append blocks to a request's list so it can hold num_tokens tokens.

        Raises:
            PoolExhausted: not enough free blocks.
        """
        need = self.blocks_for(num_tokens) - len(block_ids)
        if need > 0:
            block_ids.extend(self.blocks.allocate(need))

    def free(self, block_ids: list[BlockId]) -> None:
        self.blocks.free(block_ids)


def write_rows(kv: torch.Tensor, blk: torch.Tensor, layer: int, off: torch.Tensor, latent: torch.Tensor,
               quantized: bool, scale: float) -> None:
    """Write latent [T, kv_dim] to the pool kv [blocks, layers, block_size, kv_dim] at rows
    (blk[t], layer, off[t]) (blk, off: [T] int64 on kv's device). FP8 pools (`quantized`) store
    latent × `reciprocal32(scale)`, saturated first: a cast of a value beyond e4m3's range gives
    NaN (a NaN stays NaN). Indexing goes through byte views there: index_put / gather kernels
    cover uint8 on every device."""
    if not quantized:
        kv[blk, layer, off] = latent.to(kv.device, kv.dtype)
        return
    q = (latent.float() * reciprocal32(scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    kv.view(torch.uint8)[blk, layer, off] = q.view(torch.uint8).to(kv.device)


FP8_MAX = float(torch.finfo(FP8).max)  # 448: e4m3's largest finite value


@functools.lru_cache(maxsize=64)
def reciprocal32(scale: float) -> float:
    """1 / scale as the float32 division of float32(scale), the one multiplier every FP8 pool
    write uses (the prefill's `write_rows` on any device, the decode step's Triton kernel), so
    the two write the same bytes for the same latent. A division by the Python number would not
    be one rule: torch's CUDA kernel multiplies by a reciprocal it computes (in float32 before
    torch 2.10, from a double since), its CPU kernel divides."""
    return float(np.float32(1.0) / np.float32(scale))


class PagedKvCache:
    """The engine's KvCache over a KvPool for one forward pass (see engine/model.py contract).

    seqs[i] = (block_ids, start, q_len): sequence i's block table, the number of its tokens
    already in the pool (its new tokens take positions start..start+q_len-1), and q_len.
    pack: the attention may read the contexts of several sequences at once (`packed`; a prefill
    batch on CUDA, engine/model.py `packed_mla_attention`); on a CPU it reads them one by one.
    """

    def __init__(self, pool: KvPool, seqs: list[tuple[list[BlockId], int, int]], pack: bool = False) -> None:
        bs = pool.config.block_size
        self.kv = pool.kv
        self._quantized = pool.config.quantized
        self._scale = pool.config.scale
        self._bs = bs
        device = pool.kv.device
        self.pack = pack and device.type == "cuda"
        w_blk: list[np.ndarray] = []
        w_off: list[np.ndarray] = []
        tables: list[int] = []  # every sequence's block table, one after the other
        self._spans: list[tuple[int, int, int, int]] = []  # (table start, table length, context tokens, q_len)
        for block_ids, start, q_len in seqs:
            ctx = start + q_len
            n = -(-ctx // bs)
            pos = np.arange(start, ctx)
            w_blk.append(np.asarray(block_ids[:n], dtype=np.int64)[pos // bs])
            w_off.append(pos % bs)
            self._spans.append((len(tables), n, ctx, q_len))
            tables.extend(block_ids[:n])
        self._tables = tables
        # one upload for the write slots and every table (engine/upload.py: no stream sync)
        t = sum(len(x) for x in w_blk)
        ints = upload(np.concatenate(w_blk + w_off + [np.asarray(tables, dtype=np.int64)]), torch.long, device)
        self._w_blk, self._w_off = ints[:t], ints[t:2 * t]
        self._reads: list[tuple[torch.Tensor, int]] = [(ints[2 * t + lo: 2 * t + lo + n], ctx)
                                                       for lo, n, ctx, _ in self._spans]
        self._packs: dict[tuple[int, ...], PackedContexts] = {}

    def write(self, layer: int, latent: torch.Tensor) -> None:
        """Write latent [T, kv_dim] (the batch's new tokens in order) to their (block, layer, offset) slots."""
        write_rows(self.kv, self._w_blk, layer, self._w_off, latent, self._quantized, self._scale)

    def _gather(self, layer: int, table: torch.Tensor, dev: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """Rows of the blocks `table` at `layer`, [len(table) * block_size, kv_dim], dequantized."""
        kv_dim = self.kv.shape[-1]
        if not self._quantized:
            return self.kv[table, layer].reshape(-1, kv_dim).to(dev, dtype)
        raw = self.kv.view(torch.uint8)[table, layer].reshape(-1, kv_dim).to(dev)
        return (raw.view(FP8).float() * self._scale).to(dtype)

    def context(self, layer: int, i: int, like: torch.Tensor) -> torch.Tensor:
        """Sequence i's context latents [ctx, kv_dim] at layer (written ones included), on
        `like`'s device and dtype (the device move is a no-op unless a pipeline stage on another
        GPU shares the pool)."""
        table, ctx = self._reads[i]
        return self._gather(layer, table, like.device, like.dtype)[:ctx]

    def update(self, layer: int, latent: torch.Tensor) -> list[torch.Tensor]:
        # latent: [T, kv_dim] -> written; returns every sequence's context [ctx_i, kv_dim]
        self.write(layer, latent)
        return [self.context(layer, i, latent) for i in range(len(self._reads))]

    def context_rows(self, i: int) -> int:
        """Rows `packed` gathers for sequence i: its context in whole blocks."""
        return self._spans[i][1] * self._bs

    def packed(self, layer: int, which: Sequence[int], like: torch.Tensor) -> PackedContexts:
        """The contexts of sequences `which` (strictly ascending) at layer as one tensor of whole
        blocks (`PackedContexts`); the offsets are uploaded once per forward, not per layer.

        Raises:
            ValueError: `which` empty, not strictly ascending, or out of range.
        """
        key = tuple(which)
        if not key or any(b <= a for a, b in zip(key, key[1:])) or key[0] < 0 or key[-1] >= len(self._spans):
            raise ValueError(f"packed: which must be strictly ascending sequence indices < {len(self._spans)}, "
                             f"got {list(key)}")
        meta = self._packs.get(key)
        if meta is None:
            meta = self._packs[key] = self._pack_meta(key, like.device)
        return dataclasses.replace(meta, rows=self._gather(layer, meta.table, like.device, like.dtype))

    def _pack_meta(self, which: tuple[int, ...], device: torch.device) -> PackedContexts:
        table: list[int] = []
        cu_q, cu_k, used, q_rows = [0], [0], [], []
        q_start = [0]
        for _, _, _, q_len in self._spans:
            q_start.append(q_start[-1] + q_len)
        for i in which:
            lo, n, ctx, q_len = self._spans[i]
            table.extend(self._tables[lo:lo + n])
            cu_q.append(cu_q[-1] + q_len)
            cu_k.append(cu_k[-1] + n * self._bs)
            used.append(ctx)
            q_rows.append(np.arange(q_start[i], q_start[i] + q_len))
        every = which == tuple(range(len(self._spans)))
        ints = upload(table + ([] if every else np.concatenate(q_rows).tolist()), torch.long, device)
        offsets = upload(cu_q + cu_k + used, torch.int32, device)
        m = len(which)
        return PackedContexts(rows=torch.empty(0), table=ints[:len(table)], q_index=None if every else ints[len(table):],
                              cu_q=offsets[:m + 1], cu_k=offsets[m + 1:2 * m + 2], used_k=offsets[2 * m + 2:],
                              max_q=max(cu_q[j + 1] - cu_q[j] for j in range(m)), max_k=max(used),
                              q_offsets=cu_q)


@dataclass(frozen=True)
class PackedContexts:
    """Several sequences' contexts in one tensor, for one varlen attention call
    (engine/kernels/prefill_attention.py `varlen_causal_attention`).

    rows: [R, kv_dim] the sequences' blocks one after the other; sequence j's context is rows
    cu_k[j] .. cu_k[j] + used_k[j] (the rest of its last block is padding). cu_q / cu_k: [m + 1]
    int32 device offsets of its queries and rows; used_k [m] int32; max_q / max_k the longest;
    q_index: int64 device rows of the batch's queries that belong to these sequences (None: all
    of them, in order); q_offsets: cu_q on the host; table: the blocks read (int64, device).
    """

    rows: torch.Tensor
    table: torch.Tensor
    q_index: torch.Tensor | None
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    used_k: torch.Tensor
    max_q: int
    max_k: int
    q_offsets: list[int]
