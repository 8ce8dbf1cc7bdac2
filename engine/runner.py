"""Runs the model over a KvPool: batched chunked prefill and batched decode steps.

One runner, two modes, chosen once at construction (the log line says which):
- CPU (the exactness contract): every forward is the plain model path (per-sequence attention
  over the expanded latents, the per-expert MoE loop), so greedy tokens equal
  `reference_generate` in float32.
- CUDA with bf16/fp16 weights: the MoE layers run Triton fused MoE kernels
  (engine/kernels/fused_moe.py), a decode step is
  one batched forward with paged MLA decode attention on the latent pool
  (engine/decode_batch.py, engine/kernels/mla_decode.py), replayed from a CUDA graph when the
  runner captured them (engine/graph_runner.py; off with --disable-cuda-graph). An MTP step
  (`spec_step`, engine/spec_batch.py) runs its draft and verify forwards the same way, every
  verify query one row of the decode kernel, the whole step one CUDA graph replay
  (engine/spec_graphs.py).
`decode_step` samples on the device (engine/sampling.py) and returns one device tensor of
tokens and log-probabilities, so a step needs no host sync and one device-to-host copy
(engine/overlap_runner.py); an all-greedy step replayed from a graph samples inside it.
`decode_tokens` is `decode_step` with that copy, for the plain loop. Input ids below 0
are placeholders of the runner's FutureTokenMap (the overlap scheduler's tokens still on the
device), resolved on the device in every mode; a step given future-map slots writes its tokens
there.

Calls must come from one thread at a time (the workers use a single-thread executor for
all model work); the pool's block accounting stays on the event-loop thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.block_pool import BlockId
from engine.future_map import FutureTokenMap
from engine.kv_cache_contiguous import ContiguousKvCache
from engine.kv_pool import KvPool, PagedKvCache
from engine.mtp import pool_has_mtp, prefill_mtp_rows
from engine.sampling import (SamplingParams, SamplingRows, StepTokens, pack_step, sample_step, top_logprobs_batch,
                             unpack_step)
from engine.spec_batch import SpecResult, SpecRow, SpecSlots, spec_step
from engine.spec_decode import SpecInput, SpecOutput, spec_forward
from engine.upload import upload

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeInput:
    """One running request in a decode step."""

    block_ids: list[BlockId]  # its block table (must have room for num_computed + 1 tokens)
    num_computed: int  # tokens whose KV is already in the pool
    input_token: int  # the token at position num_computed


@dataclass(frozen=True)
class PrefillInput:
    """One request's prefill chunk in a (batched) prefill forward."""

    block_ids: list[BlockId]  # its block table (room for `end` tokens)
    token_ids: list[int]  # the whole prompt
    start: int  # tokens before start are in the pool; the chunk is token_ids[start:end]
    end: int
    mtp: bool = False  # also write the chunk's MTP KV rows (engine/mtp.py)
    logits: bool = False  # also return float32 logits of the chunk's last token (a final chunk)


class ModelRunner:
    """The model and the pool it reads and writes, plus (on CUDA) the decode graphs.

    Args:
        model: the model, on its device.
        pool: its KV pool.
        fast: None = the device's mode: fast on CUDA with bf16/fp16 weights and triton; plain on
            a CPU and for a float32 model on CUDA (the GPU's reference run); False forces plain.
        future_capacity: slots of the future-token map (at least 2 × the largest batch when the
            overlap scheduler drives the runner).
    """

    def __init__(self, model: torch.nn.Module, pool: KvPool, fast: bool | None = None,
                 future_capacity: int = 4096) -> None:
        self.model = model
        self.pool = pool
        self.device = model.model.embed_tokens.weight.device
        self.future = FutureTokenMap(future_capacity, self.device)
        self.tables = None  # engine.decode_batch.BlockTables of the fast mode (made on first use)
        if fast is None:
            from engine.weight_layout import fast_mode
            fast = fast_mode(self.device, model.dtype)
        self.fast = fast
        self.graphs = None  # engine.graph_runner.DecodeGraphs once capture_graphs ran
        self.spec_graphs = None  # engine.spec_graphs.SpecGraphs, when it captured MTP steps too
        if self.fast:
            from engine.kernels.grouped_experts import use_grouped_experts
            from engine.kernels.fused import use_fused_hot_path, use_fused_projections
            use_grouped_experts(model)  # (engine.weight_layout.to_device has made the stacks already)
            use_fused_projections(model)
            from engine.model import MoE
            n = sum(1 for m in model.modules() if isinstance(m, MoE) and m.grouped is not None)
            use_fused_hot_path()
            log.info("model runner on %s: batched decode with paged MLA decode attention (triton), "
                     "fused MoE experts (triton) in %d MoE layers", self.device, n)

    def capture_graphs(self, max_batch: int, max_context: int, sizes: list[int] | None = None,
                       spec_k: int = 0, scratch: int | None = None) -> None:
        """Capture decode graphs for batches up to max_batch (buckets `sizes`, default
        engine.graph_runner.batch_sizes) and contexts up to max_context tokens (CUDA, fast mode
        only), and with spec_k > 0 the MTP steps' forwards for k = spec_k drafts
        (engine/spec_graphs.py). Reserves one pool block as the padding rows' scratch block
        (`scratch`: one the caller reserved, where another object keeps the pool's accounting:
        an EP rank's, decode_worker/ep_ranks.py)."""
        from engine.decode_batch import BlockTables
        from engine.graph_runner import DecodeGraphs
        width = min(self.pool.blocks_for(max_context), self.pool.config.num_blocks)
        if scratch is None:
            scratch = self.pool.blocks.allocate(1)[0]  # never freed: padding rows write here
        # rows: a step's requests plus those absent from it for a while (overlap, retraction)
        self.tables = BlockTables(2 * max_batch + 1, width, self.device)
        self.graphs = DecodeGraphs(self.model, self.pool, self.tables, self.future, max_batch, scratch, sizes)
        if spec_k:
            from engine.spec_graphs import SpecGraphs
            # the loop's slots (engine/overlap_runner.py: 2 × max_batch) plus the padding rows' one
            slots = SpecSlots(2 * max_batch + 1, spec_k, self.model.config.hidden_size, self.model.dtype,
                              self.device)
            self.spec_graphs = SpecGraphs(self.model, self.pool, slots, max_batch, width, scratch, sizes)

    def prefill_chunk(self, block_ids: list[BlockId], token_ids: list[int], start: int, end: int,
                      mtp: bool = False) -> torch.Tensor:
        """Compute KV for prompt tokens [start, end) (tokens before start are in the pool), and
        with `mtp` the MTP module's KV rows of the chunk too (engine/mtp.py).

        Returns:
            hidden state of the chunk's last token, [hidden].
        """
        return self.prefill_batch([PrefillInput(block_ids, token_ids, start, end, mtp)])[0][0]

    def warm_up_prefill(self) -> float:
        """Run the fused MoE kernels at every tile size, then two small batched prefill forwards
        (fast mode): Triton and torch.compile compile on a kernel's first call of each shape
        class, several seconds on a GPU, which would otherwise land on the first requests'
        TTFT. Blocks are borrowed and freed. Returns seconds."""
        t0 = time.perf_counter()
        from engine.kernels.grouped_experts import warm_up_fused_experts
        warm_up_fused_experts(self.model)  # the fused MoE kernels of every tile size
        bs = self.pool.config.block_size
        for lens in ((2 * bs + 3, 5), (bs + 1, 2, 7)):  # two totals: static, then dynamic shapes
            tables = [self.pool.blocks.allocate(self.pool.blocks_for(n)) for n in lens]
            try:
                self.prefill_batch([PrefillInput(t, [1 + i % 7 for i in range(n)], 0, n, logits=True)
                                    for t, n in zip(tables, lens)])
            finally:
                for t in tables:
                    self.pool.blocks.free(t)
        _sync(self.device)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def prefill_batch(self, batch: Sequence[PrefillInput]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """One forward over the chunks of several requests (engine/prefill_batch.py packs them):
        each chunk attends to its own cached prefix plus its new tokens (`PagedKvCache`), the
        linear layers run on all T = sum of chunk lengths rows at once, and on CUDA the chunks
        under 2,048 queries attend in one varlen call (`packed_mla_attention`). Logits of the chunks
        that ask for them come from one lm_head call; MTP rows run per chunk (one MTP forward
        each, after the main forward: batching them is not needed for correctness).

        Returns:
            per chunk, in order: (final-normed hidden of its last token [hidden],
            float32 logits [vocab] when `logits` was set, else None).
        Raises:
            ValueError: an empty batch or a chunk with end <= start.
        """
        if not batch or any(b.end <= b.start for b in batch):
            raise ValueError(f"prefill_batch needs chunks with end > start, got "
                             f"{[(b.start, b.end) for b in batch]}")
        q_lens = [b.end - b.start for b in batch]
        t = sum(q_lens)
        # ids and positions in one upload (engine/upload.py: the host does not wait for the device)
        ints = upload([x for b in batch for x in b.token_ids[b.start:b.end]]
                      + [p for b in batch for p in range(b.start, b.end)], torch.long, self.device)
        ids, positions = ints[:t], ints[t:]
        kv = PagedKvCache(self.pool, [(b.block_ids, b.start, n) for b, n in zip(batch, q_lens)], pack=True)
        hidden = self.model.forward(ids, positions, q_lens, kv)  # [T, hidden]
        offsets = [0]
        for n in q_lens:
            offsets.append(offsets[-1] + n)
        last = hidden[upload([o - 1 for o in offsets[1:]], torch.long, self.device)]  # [B, hidden]
        if any(b.mtp for b in batch) and pool_has_mtp(self.pool, self.model):
            for b, lo, hi in zip(batch, offsets, offsets[1:]):
                if b.mtp:  # MTP rows of the chunk (engine/mtp.py)
                    prefill_mtp_rows(self.model, self.pool, b.block_ids, b.token_ids, b.start, b.end, hidden[lo:hi])
        want = [i for i, b in enumerate(batch) if b.logits]
        rows: list[torch.Tensor | None] = [None] * len(batch)
        if want:
            logits = self.model.logits(last[want])  # [len(want), vocab] float32, one lm_head call
            for j, i in enumerate(want):
                rows[i] = logits[j]
        return [(last[i], rows[i]) for i in range(len(batch))]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] or [hidden] -> float32 logits [N, vocab] or [vocab]."""
        return self.model.logits(hidden)

    @torch.inference_mode()
    def decode(self, batch: list[DecodeInput]) -> torch.Tensor:
        """One decode step for every request in batch; returns float32 logits [batch, vocab].
        Placeholder input ids (< 0) are resolved from `self.future` on the device."""
        return self._forward_step(batch, None)[0]

    @torch.inference_mode()
    def decode_step(self, batch: list[DecodeInput], sampling: list[tuple[SamplingParams, int]],
                    slots: list[int] | None = None, began: torch.cuda.Event | None = None,
                    bucket: int | None = None) -> torch.Tensor:
        """`decode` then `sample_batch`: [B, 2] float64 on the device, row i = (token id,
        log-probability) of batch[i] (`pack_step`), [B, 2 + 2K] where a row asks for its K
        most likely tokens (`top_logprobs_batch`); with `slots` the tokens are also written
        into the future map there. An all-greedy batch (no logit bias, no penalty) replayed from a graph takes the graph's
        own greedy head (the same `greedy_batch`, the same bits), with no kernel after the replay:
        the result is then a view of the graph's output, valid until the next step (callers
        copy it to the host first, as OverlapRunner.launch and decode_tokens do).

        sampling[i] = (params, step index) of the token batch[i] generates, with a third item
        for a penalized request: the tokens it generated so far (placeholders of tokens still in
        flight are resolved from the future map; engine.sampling.SamplingRows.build). began: an event
        recorded on the current stream just before the step's forward is queued (after the
        host's planning), so that began → a later event times the step's device work without
        the host's share (OverlapRunner's device-busy figure).

        bucket: None = the smallest graph that fits (or an eager step); an EP rank's step, where
        every rank must do the same (their MoE all-to-alls are captured in the graphs), says which:
        0 = eager even where a graph fits, N = replay bucket N (>= len(batch); batch may then be
        empty). Raises ValueError when bucket N cannot run the batch (no graphs, or a context
        wider than the captured tables): an eager step then would leave the other ranks'
        collectives unmatched."""
        rows = SamplingRows.build(sampling, self.device, self.future.resolve)
        logits, slot_t, greedy = self._forward_step(batch, slots, began, bucket)
        if greedy is not None and not rows.any_sampled and not rows.adjusts:
            if not rows.top_logprobs:
                return greedy
            return torch.cat((greedy, top_logprobs_batch(logits, rows)), dim=1)  # (before the next replay)
        tokens, logprobs, top = sample_step(logits, rows)
        if slot_t is not None:
            self.future.store(slot_t, tokens)
        return pack_step(tokens, logprobs, top)

    def _forward_step(self, batch: list[DecodeInput], slots: list[int] | None,
                      began: torch.cuda.Event | None = None, forced: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(logits [B, vocab] float32, the slots as a device tensor or None, and after a graph
        replay its greedy pack [B, 2] float64 with its tokens already at the slots, else None);
        `began` is recorded just before the forward is queued."""
        if forced and (self.graphs is None or forced not in self.graphs.graphs or forced < len(batch)):
            raise ValueError(f"decode step of {len(batch)} rows cannot replay graph bucket {forced}")
        if not self.fast:
            ids = self.future.resolve(torch.tensor([b.input_token for b in batch], dtype=torch.long,
                                                   device=self.device))
            positions = torch.tensor([b.num_computed for b in batch], dtype=torch.long, device=self.device)
            kv = PagedKvCache(self.pool, [(b.block_ids, b.num_computed, 1) for b in batch])
            if began is not None:
                began.record()
            hidden = self.model.forward(ids, positions, [1] * len(batch), kv)  # [batch, hidden]
            slot_t = None if slots is None else torch.tensor(slots, dtype=torch.long, device=self.device)
            return self.model.logits(hidden), slot_t, None
        from engine.decode_batch import AbsorbedDecodeKv, BlockTables, DecodePlan
        bs = self.pool.config.block_size
        if forced is None:
            bucket = self.graphs.bucket(len(batch)) if self.graphs is not None else None
        else:
            bucket = forced or None  # 0: eager
        if self.tables is None:  # eager fast mode: tables that grow with the batches seen
            self.tables = BlockTables(2 * len(batch) + 1, 1, self.device)
        try:
            plan = DecodePlan.build(batch, bs, self.device, self.tables, slots, pad_to=bucket or 0,
                                    pad_row=self.graphs.pad_row if bucket else 0,
                                    out=self.graphs.inputs(bucket) if bucket else None)
        except ValueError:  # a context wider than the captured tables: one eager step, own tables
            if forced:
                raise
            bucket, plan = None, DecodePlan.build(batch, bs, self.device, None, slots)
        slot_t = None if slots is None else plan.slots
        if began is not None:
            began.record()
        if bucket is not None:
            logits, greedy = self.graphs.run(plan)
            return logits, slot_t, greedy
        kv = AbsorbedDecodeKv(self.pool, plan.tables, plan.lens)
        hidden = self.model.forward(self.future.resolve(plan.ids), plan.positions, [1] * plan.batch, kv)
        return self.model.logits(hidden), slot_t, None

    def decode_tokens(self, batch: list[DecodeInput], sampling: list[tuple[SamplingParams, int]],
                      bucket: int | None = None) -> StepTokens:
        """`decode_step` with its one device-to-host copy: (tokens, logprobs, tops) as lists."""
        return unpack_step(self.decode_step(batch, sampling, bucket=bucket).cpu())

    def spec_decode(self, batch: list[SpecInput]) -> list[SpecOutput]:
        """One MTP speculative step (draft, then verify) for every request; see engine/spec_decode.py."""
        return spec_forward(self.model, self.pool, batch)

    def spec_step(self, slots: SpecSlots, rows: list[SpecRow]) -> SpecResult:
        """One MTP speculative step with the requests' state on the device (engine/spec_batch.py):
        the fast path's paged decode kernel on CUDA (graph replays when captured), the plain
        path elsewhere."""
        return spec_step(self.model, self.pool, slots, rows, self.fast, graphs=self.spec_graphs)

    @torch.inference_mode()
    def time_prefill(self, lengths: Sequence[int], repeats: int = 2) -> list[float]:
        """Seconds to prefill `lengths` tokens from scratch (one chunk, unpaged cache), the
        fastest of `repeats` runs each, after one warm-up: the samples of dynamic chunking's
        fit (engine/chunking.py). Token ids are arbitrary (time does not depend on them)."""
        cfg = self.model.config
        out = []
        for i, n in enumerate(lengths):
            ids = torch.arange(n, device=self.device) % cfg.vocab_size
            positions = torch.arange(n, device=self.device)
            best = float("inf")
            for _ in range(repeats + (1 if i == 0 else 0)):
                kv = ContiguousKvCache(cfg.num_hidden_layers)
                _sync(self.device)
                t0 = time.perf_counter()
                self.model.forward(ids, positions, [n], kv)
                _sync(self.device)
                best = min(best, time.perf_counter() - t0)
            out.append(best)
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
