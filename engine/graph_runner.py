"""CUDA graphs of the decode forward, one per batch-size bucket (SGLang's `cuda_graph_bs`).

At start-up the decode forward (embed → layers with `AbsorbedDecodeKv` → final norm → lm_head)
is captured for each batch size in `batch_sizes(max_batch)`, largest first, all graphs sharing
one memory pool and one set of static input buffers sized for the largest batch and the widest
block table the pool allows. A step of B requests replays the smallest graph with room for B:
its inputs are copied into the buffers' first B rows, and the padding rows are reset to a
one-token context in the scratch block (so they write their garbage latent there, never into a
live request's block). Sampling runs after the replay (engine/sampling.py), outside the graph.

The attention kernel's work depends on each row's length, not on the table width, so one width
serves every context; `can_run` is false only for a batch larger than the largest bucket.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.decode_batch import AbsorbedDecodeKv, DecodePlan
from engine.kv_pool import KvPool

log = logging.getLogger(__name__)


def batch_sizes(max_batch: int) -> list[int]:
    """Buckets 1, 2, 4, 8, then every 8 to 256, then every 32, up to and including max_batch."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    s = 8
    while s < max_batch:
        sizes.append(s)
        s += 8 if s < 256 else 32
    return sizes + [max_batch]


class DecodeGraphs:
    """Captured decode forwards for batch sizes up to `max_batch`, block tables up to `width`.

    Args:
        model: the model (on CUDA; MoE layers in their grouped form).
        pool: the KV pool the graphs read and write (its tensor's address is baked in).
        max_batch: the largest batch (the worker's --max-running).
        width: block-table width (blocks of the longest context).
        scratch_block: a block no request ever owns (the worker reserves one).
    """

    def __init__(self, model: torch.nn.Module, pool: KvPool, max_batch: int, width: int,
                 scratch_block: int, sizes: list[int] | None = None) -> None:
        dev = pool.kv.device
        self.model, self.pool, self.width, self.scratch = model, pool, width, scratch_block
        self.sizes = sorted(sizes or batch_sizes(max_batch))
        n = self.sizes[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.tables = torch.full((n, width), scratch_block, dtype=torch.int32, device=dev)
        self.lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        t0 = time.perf_counter()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()  # (graph capture empties the cache too: measure from an empty one)
        before = torch.cuda.memory_reserved(dev)
        pool_handle = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        for bs in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):  # warm-up outside the graph (allocator, lazy inits, autotune)
                    self._forward(bs)
            torch.cuda.current_stream(dev).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=pool_handle):
                out = self._forward(bs)
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize(dev)
        self.memory_bytes = torch.cuda.memory_reserved(dev) - before
        self.capture_seconds = time.perf_counter() - t0
        log.info("cuda graphs: %d batch sizes (%s), table width %d blocks, captured in %.1f s, "
                 "%.0f MiB", len(self.sizes), ",".join(map(str, self.sizes)), width,
                 self.capture_seconds, self.memory_bytes / 2**20)

    def _forward(self, bs: int) -> torch.Tensor:
        kv = AbsorbedDecodeKv(self.pool, self.tables[:bs], self.lens[:bs])
        hidden = self.model(self.ids[:bs], self.positions[:bs], [1] * bs, kv)
        return self.model.logits(hidden)  # [bs, vocab] float32

    def can_run(self, batch: int, width: int) -> bool:
        return batch <= self.sizes[-1] and width <= self.width

    def run(self, plan: DecodePlan, ids: torch.Tensor) -> torch.Tensor:
        """Replay for plan's batch (ids: its resolved input ids [B]); returns logits [B, vocab]
        float32, a view of the graph's output (valid until the next replay)."""
        b, w = plan.batch, plan.width
        bs = next(s for s in self.sizes if s >= b)
        self.ids[:b].copy_(ids)
        self.positions[:b].copy_(plan.positions)
        self.tables[:b, :w].copy_(plan.tables)
        self.lens[:b].copy_(plan.lens)
        if bs > b:  # padding rows: a one-token context in the scratch block
            self.tables[b:bs, 0] = self.scratch
            self.lens[b:bs] = 1
            self.positions[b:bs] = 0
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:b]
