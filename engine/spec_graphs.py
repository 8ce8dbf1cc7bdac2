"""CUDA graphs of a speculative step's forwards (engine/spec_batch.py), per batch-size bucket.

A step of B requests with k drafts runs three kinds of forward, each captured per bucket bs of
`engine.graph_runner.batch_sizes` (the decode graphs' buckets):
- extend: the MTP module over bs × (k+1) rows (each row one query of the paged decode kernel);
- chain: the MTP module over bs rows (k - 1 replays per step; none for k = 1);
- verify: the main model over bs × (k+1) rows.
The MTP head and lm_head, the samplers and the accept run eagerly between replays (they are a
few kernels each, and the sampler's code path depends on the batch's sampling parameters).

Buffers are static and shared by the kinds (extend and verify take turns within a step; the
graphs' outputs are consumed before the next replay); rows past a batch's are padding rows
with a one-token context in the scratch block, as in engine/graph_runner.py. Block tables are
as wide as the longest context the pool allows: `can_run` is false only for a batch larger
than the largest bucket or a table wider than that.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.decode_batch import AbsorbedDecodeKv
from engine.graph_runner import PriorityReplay, batch_sizes
from engine.kv_pool import KvPool
from engine.mtp import MTP_MODULE

log = logging.getLogger(__name__)


class SpecGraphs:
    """Captured extend, chain and verify forwards for k drafts and batches up to `max_batch`.

    Args:
        model: the model (on CUDA, fast mode: MoE layers grouped), with an MTP module.
        pool: the KV pool (its tensor's address is baked in).
        k: draft tokens per step (>= 1).
        max_batch: the largest batch (--max-running).
        width: block-table width (blocks of the longest context).
        scratch_block: a block no request owns (padding rows write there).
    """

    def __init__(self, model: torch.nn.Module, pool: KvPool, k: int, max_batch: int, width: int,
                 scratch_block: int, sizes: list[int] | None = None) -> None:
        dev = pool.kv.device
        self.model, self.pool, self.k, self.width, self.scratch = model, pool, k, width, scratch_block
        self.sizes = sorted(sizes or batch_sizes(max_batch))
        k1, hidden = k + 1, model.config.hidden_size
        rows = self.sizes[-1] * k1
        # rows of extend / verify ([bs * (k+1)]); the chain uses their first bs rows' own buffers
        self.hid = torch.zeros(rows, hidden, dtype=model.dtype, device=dev)
        self.ids = torch.zeros(rows, dtype=torch.long, device=dev)
        self.pos = torch.zeros(rows, dtype=torch.long, device=dev)
        self.tables = torch.full((rows, width), scratch_block, dtype=torch.int32, device=dev)
        self.c_hid = torch.zeros(self.sizes[-1], hidden, dtype=model.dtype, device=dev)
        self.c_ids = torch.zeros(self.sizes[-1], dtype=torch.long, device=dev)
        self.c_pos = torch.zeros(self.sizes[-1], dtype=torch.long, device=dev)
        self.c_tables = torch.full((self.sizes[-1], width), scratch_block, dtype=torch.int32, device=dev)
        self.graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replay = PriorityReplay(dev)  # as the decode graphs (engine/graph_runner.py)
        kinds = ["extend", "verify"] + (["chain"] if k > 1 else [])
        t0 = time.perf_counter()
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_reserved(dev)
        handle = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        for bs in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            for kind in kinds:
                stream.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(stream), torch.inference_mode():
                    for _ in range(2):  # warm-up outside the graph (allocator, autotune)
                        self._forward(kind, bs)
                torch.cuda.current_stream(dev).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.inference_mode(), torch.cuda.graph(graph, pool=handle):
                    out = self._forward(kind, bs)
                self.graphs[kind, bs] = (graph, out)
        torch.cuda.synchronize(dev)
        self.memory_bytes = torch.cuda.memory_reserved(dev) - before
        self.capture_seconds = time.perf_counter() - t0
        log.info("cuda graphs of MTP steps (k = %d): %d batch sizes × %s, captured in %.1f s, %.0f MiB",
                 k, len(self.sizes), "/".join(kinds), self.capture_seconds, self.memory_bytes / 2**20)

    def _forward(self, kind: str, bs: int) -> torch.Tensor:
        m = self.model
        if kind == "chain":
            kv = AbsorbedDecodeKv(self.pool, self.c_tables[:bs], (self.c_pos[:bs] + 1).int())
            return m.mtp_forward(MTP_MODULE, self.c_hid[:bs], self.c_ids[:bs], self.c_pos[:bs], [1] * bs, kv)
        r = bs * (self.k + 1)
        kv = AbsorbedDecodeKv(self.pool, self.tables[:r], (self.pos[:r] + 1).int())
        if kind == "extend":
            return m.mtp_forward(MTP_MODULE, self.hid[:r], self.ids[:r], self.pos[:r], [1] * r, kv)
        return m(self.ids[:r], self.pos[:r], [1] * r, kv)

    def can_run(self, batch: int, width: int) -> bool:
        return batch <= self.sizes[-1] and width <= self.width

    def bind(self, tables: torch.Tensor) -> _BoundStep:
        """The forwards of one step over block tables [B, W] int32 (B, W within `can_run`)."""
        return _BoundStep(self, tables)


class _BoundStep:
    """`engine.spec_batch.FastForwards`' interface, by graph replay for one step's batch."""

    def __init__(self, g: SpecGraphs, tables: torch.Tensor) -> None:
        b, w = tables.shape
        k1 = g.k + 1
        self.g, self.b, self.rows = g, b, b * k1
        self.bs = next(s for s in g.sizes if s >= b)
        g.tables[:self.rows, :w].copy_(tables.repeat_interleave(k1, 0))
        g.c_tables[:b, :w].copy_(tables)
        if self.bs > b:  # padding rows: a one-token context in the scratch block
            g.tables[self.rows:self.bs * k1, 0] = g.scratch
            g.pos[self.rows:self.bs * k1] = 0
            g.c_tables[b:self.bs, 0] = g.scratch
            g.c_pos[b:self.bs] = 0

    def _replay(self, kind: str, n: int) -> torch.Tensor:
        graph, out = self.g.graphs[kind, self.bs]
        self.g.replay(graph)
        return out[:n]  # a view of the graph's output, valid until its next replay

    def extend(self, hid: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        g = self.g
        g.hid[:self.rows].copy_(hid)
        g.ids[:self.rows].copy_(ids)
        g.pos[:self.rows].copy_(pos)
        return self._replay("extend", self.rows)

    def chain(self, prev: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, j: int) -> torch.Tensor:
        g = self.g
        g.c_hid[:self.b].copy_(prev)
        g.c_ids[:self.b].copy_(ids)
        g.c_pos[:self.b].copy_(pos)
        return self._replay("chain", self.b)

    def verify(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        g = self.g
        g.ids[:self.rows].copy_(ids)
        g.pos[:self.rows].copy_(pos)
        return self._replay("verify", self.rows)
