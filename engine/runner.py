"""Runs the model over a KvPool: chunked prefill and batched decode steps.

One runner, two modes, chosen once at construction (the log line says which):
- CPU (the exactness contract): every forward is the plain model path (per-sequence attention
  over the expanded latents, the per-expert MoE loop), so greedy tokens equal
  `reference_generate` in float32.
- CUDA with bf16/fp16 weights: the MoE layers run grouped GEMMs (engine/kernels/grouped_experts.py), a decode step is
  one batched forward with paged MLA decode attention on the latent pool
  (engine/decode_batch.py, engine/kernels/mla_decode.py), replayed from a CUDA graph when the
  runner captured them (engine/graph_runner.py; off with --disable-cuda-graph). An MTP step
  (`spec_step`, engine/spec_batch.py) runs its draft and verify forwards the same way, every
  verify query one row of the decode kernel (engine/spec_graphs.py for its graphs).
`decode_step` samples on the device (engine/sampling.py) and returns device tensors, so a step
needs no host sync; `decode_tokens` adds the step's one device-to-host copy.

Calls must come from one thread at a time (the workers use a single-thread executor for
all model work); the pool's block accounting stays on the event-loop thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.block_pool import BlockId
from engine.kv_cache_contiguous import ContiguousKvCache
from engine.kv_pool import KvPool, PagedKvCache
from engine.mtp import pool_has_mtp, prefill_mtp_rows
from engine.sampling import SamplingParams, SamplingRows, sample_batch
from engine.spec_batch import SpecResult, SpecRow, SpecSlots, spec_step
from engine.spec_decode import SpecInput, SpecOutput, spec_forward

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeInput:
    """One running request in a decode step."""

    block_ids: list[BlockId]  # its block table (must have room for num_computed + 1 tokens)
    num_computed: int  # tokens whose KV is already in the pool
    input_token: int  # the token at position num_computed


class ModelRunner:
    """The model and the pool it reads and writes, plus (on CUDA) the decode graphs.

    Args:
        model: the model, on its device.
        pool: its KV pool.
        fast: None = the device's mode: fast on CUDA with bf16/fp16 weights and triton; plain on
            a CPU and for a float32 model on CUDA (the GPU's reference run); False forces plain.
    """

    def __init__(self, model: torch.nn.Module, pool: KvPool, fast: bool | None = None) -> None:
        self.model = model
        self.pool = pool
        self.device = model.model.embed_tokens.weight.device
        if fast is None:
            from engine.kernels.mla_decode import triton
            fast = (self.device.type == "cuda" and model.dtype in (torch.bfloat16, torch.float16)
                    and triton is not None)
        self.fast = fast
        self.graphs = None  # engine.graph_runner.DecodeGraphs once capture_graphs ran
        self.spec_graphs = None  # engine.spec_graphs.SpecGraphs, when it captured MTP steps too
        if self.fast:
            from engine.kernels.grouped_experts import use_grouped_experts
            from engine.kernels.fused import use_fused_hot_path
            n = use_grouped_experts(model)
            use_fused_hot_path()
            log.info("model runner on %s: batched decode with paged MLA decode attention (triton), "
                     "grouped-GEMM experts in %d MoE layers", self.device, n)

    def capture_graphs(self, max_batch: int, max_context: int, sizes: list[int] | None = None,
                       spec_k: int = 0) -> None:
        """Capture decode graphs for batches up to max_batch (buckets `sizes`, default
        engine.graph_runner.batch_sizes) and contexts up to max_context tokens (CUDA, fast mode
        only), and with spec_k > 0 the MTP steps' forwards for k = spec_k drafts
        (engine/spec_graphs.py). Reserves one pool block as the padding rows' scratch block."""
        from engine.graph_runner import DecodeGraphs
        width = min(self.pool.blocks_for(max_context), self.pool.config.num_blocks)
        scratch = self.pool.blocks.allocate(1)[0]  # never freed: padding rows write here
        self.graphs = DecodeGraphs(self.model, self.pool, max_batch, width, scratch, sizes)
        if spec_k:
            from engine.spec_graphs import SpecGraphs
            self.spec_graphs = SpecGraphs(self.model, self.pool, spec_k, max_batch, width, scratch, sizes)

    @torch.inference_mode()
    def prefill_chunk(self, block_ids: list[BlockId], token_ids: list[int], start: int, end: int,
                      mtp: bool = False) -> torch.Tensor:
        """Compute KV for prompt tokens [start, end) (tokens before start are in the pool), and
        with `mtp` the MTP module's KV rows of the chunk too (engine/mtp.py).

        Returns:
            hidden state of the chunk's last token, [hidden].
        """
        ids = torch.tensor(token_ids[start:end], dtype=torch.long, device=self.device)
        positions = torch.arange(start, end, dtype=torch.long, device=self.device)
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
    def decode(self, batch: list[DecodeInput],
               resolve: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """One decode step for every request in batch; returns float32 logits [batch, vocab].

        resolve maps the step's input ids [B] on the device before the forward (the overlap
        scheduler's future-token map swaps placeholders for the previous step's tokens).
        """
        if not self.fast:
            ids = torch.tensor([b.input_token for b in batch], dtype=torch.long, device=self.device)
            if resolve is not None:
                ids = resolve(ids)
            positions = torch.tensor([b.num_computed for b in batch], dtype=torch.long, device=self.device)
            kv = PagedKvCache(self.pool, [(b.block_ids, b.num_computed, 1) for b in batch])
            hidden = self.model.forward(ids, positions, [1] * len(batch), kv)  # [batch, hidden]
            return self.model.logits(hidden)
        from engine.decode_batch import AbsorbedDecodeKv, DecodePlan
        plan = DecodePlan.build(batch, self.pool.config.block_size, self.device)
        ids = plan.ids if resolve is None else resolve(plan.ids)
        if self.graphs is not None and self.graphs.can_run(plan.batch, plan.width):
            return self.graphs.run(plan, ids)
        kv = AbsorbedDecodeKv(self.pool, plan.tables, plan.lens)
        return self.model.logits(self.model.forward(ids, plan.positions, [1] * plan.batch, kv))

    @torch.inference_mode()
    def decode_step(self, batch: list[DecodeInput], sampling: list[tuple[SamplingParams, int]],
                    resolve: Callable[[torch.Tensor], torch.Tensor] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`decode` then `sample_batch`: (tokens [B] int64, logprobs [B] float32) on the device.

        sampling[i] = (params, step index) of the token batch[i] generates."""
        logits = self.decode(batch, resolve)
        return sample_batch(logits, SamplingRows.build(sampling, self.device))

    def decode_tokens(self, batch: list[DecodeInput], sampling: list[tuple[SamplingParams, int]]
                      ) -> tuple[list[int], list[float]]:
        """`decode_step` with its one device-to-host copy: (tokens, logprobs) as lists."""
        return sample_to_host(self.decode(batch), sampling)

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
        fit (DESIGN.md section 7). Token ids are arbitrary (time does not depend on them)."""
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


@torch.inference_mode()
def sample_to_host(logits: torch.Tensor, sampling: list[tuple[SamplingParams, int]]
                   ) -> tuple[list[int], list[float]]:
    """Sample logits [B, vocab] on their device and copy (tokens, logprobs) to the host once."""
    return to_host(*sample_batch(logits, SamplingRows.build(sampling, logits.device)))


def to_host(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """A step's tokens [B] and logprobs [B] in one device-to-host copy (stacked as float64, which
    holds every token id exactly: integers up to 2^53)."""
    both = torch.stack((tokens.double(), logprobs.double())).cpu()
    return [int(t) for t in both[0].tolist()], both[1].tolist()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
