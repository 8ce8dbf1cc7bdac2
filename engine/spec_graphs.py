"""CUDA graphs of whole speculative steps (engine/spec_batch.py's `step_body`), per batch-size bucket.

A step of B requests with k drafts is, on the fast path, a fixed sequence of kernels: gather
the rows' slots, the MTP extend over B × (k+1) rows, k draft samplings with k - 1 chain
forwards between them, the verify over B × (k+1) rows, the target sampling, the accept and the
slot writes. None of it reads the host, so the whole step is captured as one graph per bucket
bs of `engine.graph_runner.batch_sizes` (the decode graphs' buckets) and per sampling mode:
greedy (no noise or sort kernels), general (temperature, top-p and seeds as tensors; a greedy
row there still takes the argmax of its logits, so a row's tokens are the same in either graph
and in the eager step), and biased: the general graph with the batch's logit-bias pairs added
to its draft and verify logits (a fixed-size pair buffer, bs × MAX_LOGIT_BIAS pairs; the pairs
past the batch's own add 0 to distinct logits of row 0, so a replay adds exactly the batch's).
A replay costs the host one graph launch and three small copies instead of about a hundred
eager launches: on a small model the eager step was bound by those launches, not by the GPU
(docs/benchmarks.md, issue 14 run 6: a k = 2 step took 2.6 × a plain step).

Static inputs, sized for the largest bucket: ints [3, n] int64 (slot, sampling-step shift,
seed), floats [2, n] float32 (temperature, top-p), tables [n, width] int32, bias pairs
[2, n × MAX_LOGIT_BIAS] int64 (row, token id) with their values float32 and count [1] int64.
Rows past a batch's are padding rows: they read and write a slot reserved here (its position reset to a
one-token context inside the graph after every replay) and a table of the scratch block only,
so their garbage never reaches a live request's slot or block. The slots' tensors' addresses
are baked into the graphs: the graphs own the `SpecSlots` the loop uses
(engine/overlap_runner.py takes them from here).

Errors: ValueError when the pool's blocks are too small for the padding rows' positions
(block_size < k + 2).
"""

from __future__ import annotations

import logging
import time

import torch

from common.sampling_params import MAX_LOGIT_BIAS
from engine.graph_runner import PriorityReplay, batch_sizes
from engine.kernels import pdl
from engine.kv_pool import KvPool
from engine.model import shared_experts_beside
from engine.sampling import SamplingRows, bias_rows, seed_int64, top_logprobs_batch
from engine.spec_batch import FastForwards, SpecResult, SpecRow, SpecSlots, step_body

log = logging.getLogger(__name__)

_PAD_N = 1  # the padding slot's pending position: its rows touch positions 0 .. k + 1
GREEDY, SAMPLED, BIASED = 0, 1, 2  # the graphs' sampling modes (each a graph per bucket)


class SpecGraphs:
    """Captured whole speculative steps for k drafts and batches up to `max_batch`.

    Args:
        model: the model (on CUDA, fast mode: MoE layers grouped), with an MTP module.
        pool: the KV pool (its tensor's address is baked in).
        slots: the requests' device state (capacity ≥ the loop's + 1: one slot is reserved for
            padding rows); its tensors' addresses are baked in.
        max_batch: the largest batch (--max-running).
        width: block-table width (blocks of the longest context).
        scratch_block: a block no request owns (padding rows write there).
    """

    def __init__(self, model: torch.nn.Module, pool: KvPool, slots: SpecSlots, max_batch: int, width: int,
                 scratch_block: int, sizes: list[int] | None = None) -> None:
        dev = pool.kv.device
        if pool.config.block_size < slots.k + 2:
            raise ValueError(f"MTP graphs need blocks of at least k + 2 = {slots.k + 2} tokens "
                             f"(the pool's are {pool.config.block_size})")
        t0 = time.perf_counter()
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_reserved(dev)
        self._inputs(model, pool, slots, max_batch, width, scratch_block, sizes)
        handle = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        # the warm-up runs rewrite the padding slot's state only (every row is a padding row)
        for bs in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            for mode in (GREEDY, SAMPLED, BIASED):
                stream.wait_stream(torch.cuda.current_stream(dev))
                with shared_experts_beside():  # as the decode graphs (engine/graph_runner.py)
                    with torch.cuda.stream(stream), torch.inference_mode():
                        # warm-up outside the graph (allocator, autotune): plain launches once
                        # (an eager step's kernel variants), then twice as the graph launches them
                        self._forward(bs, mode)
                        with pdl.dependent_launches(dev):
                            for _ in range(2):
                                self._forward(bs, mode)
                    torch.cuda.current_stream(dev).wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with pdl.dependent_launches(dev), torch.inference_mode(), torch.cuda.graph(graph, pool=handle):
                        out = self._forward(bs, mode)
                self.graphs[bs, mode] = (graph, out)
        torch.cuda.synchronize(dev)
        self.memory_bytes = torch.cuda.memory_reserved(dev) - before
        self.capture_seconds = time.perf_counter() - t0
        log.info("cuda graphs of whole MTP steps (k = %d): %d batch sizes × greedy/sampled/biased, captured in %.1f s, "
                 "%.0f MiB", self.k, len(self.sizes), self.capture_seconds, self.memory_bytes / 2**20)

    def _inputs(self, model: torch.nn.Module, pool: KvPool, slots: SpecSlots, max_batch: int, width: int,
                scratch_block: int, sizes: list[int] | None) -> None:
        """The static inputs and buffers (module docstring), the padding slot reserved; no graph
        yet (tests run `_forward` eagerly in a replay's place on a CPU)."""
        dev = pool.kv.device
        self.model, self.pool, self.slots, self.k = model, pool, slots, slots.k
        self.width, self.scratch = width, scratch_block
        self.sizes = sorted(sizes or batch_sizes(max_batch))
        n = self.sizes[-1]
        self.pad = slots.reserve_last()  # never handed out
        slots.n[self.pad] = _PAD_N
        slots.count[self.pad] = 1
        self.ints = torch.zeros(3, n, dtype=torch.long, device=dev)
        self.ints[0] = self.pad
        self.floats = torch.zeros(2, n, dtype=torch.float32, device=dev)
        self.floats[1] = 1.0
        self.tables = torch.full((n, width), scratch_block, dtype=torch.int32, device=dev)
        self._zeros = torch.zeros(n, device=dev)
        # the biased mode's pairs: rows and token ids, values, and how many are the batch's
        self.bias_pairs = torch.zeros(2, n * MAX_LOGIT_BIAS, dtype=torch.long, device=dev)
        self.bias_values = torch.zeros(n * MAX_LOGIT_BIAS, dtype=torch.float32, device=dev)
        self.bias_count = torch.zeros(1, dtype=torch.long, device=dev)
        self._pair_index = torch.arange(n * MAX_LOGIT_BIAS, device=dev)
        vocab = model.lm_head.weight.shape[0]
        self._pad_ids = self._pair_index % vocab  # the no-op pairs' token ids: distinct (up to the vocabulary)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, SpecResult]] = {}
        self.replay = PriorityReplay(dev)  # as the decode graphs (engine/graph_runner.py)
        # the verify's logits of every bucket and mode in one buffer that outlives a replay
        # (top log-probabilities are computed from it after one, `run`): a graph output of its
        # own per bucket and mode would keep each alive in the graph pool
        self.logits = torch.empty(n * (self.k + 1), vocab, dtype=torch.float32, device=dev)

    def _forward(self, bs: int, mode: int) -> SpecResult:
        ints, floats, z = self.ints[:, :bs], self.floats[:, :bs], self._zeros[:bs]
        bias = None
        if mode == BIASED:
            # the batch's pairs, then no-op pairs: 0 added to distinct logits of row 0 (one
            # address for all of them would serialise their atomic adds)
            at = self._pair_index[:bs * MAX_LOGIT_BIAS]
            live = at < self.bias_count
            rows, ids = self.bias_pairs[0, :at.shape[0]], self.bias_pairs[1, :at.shape[0]]
            bias = (torch.where(live, rows, 0), torch.where(live, ids, self._pad_ids[:at.shape[0]]),
                    torch.where(live, self.bias_values[:at.shape[0]], 0.0))
        one = (SamplingRows(floats[0], floats[1], ints[2], ints[2], True, True, 0, bias) if mode != GREEDY
               else SamplingRows(z, z, z, z, False, False))
        tables = self.tables[:bs]
        k1 = self.k + 1

        def forwards(n, c):
            return FastForwards(self.model, self.pool, tables, k1)
        out = step_body(self.model, self.slots, ints[0], ints[1], one, forwards, logits_out=self.logits)
        # padding rows advanced the padding slot: back to a one-token context
        self.slots.n[self.pad:self.pad + 1].fill_(_PAD_N)
        self.slots.count[self.pad:self.pad + 1].fill_(1)
        return out

    def can_run(self, rows: list[SpecRow]) -> bool:
        """Whether the graphs take this batch: within the largest bucket and the tables' width."""
        return len(rows) <= self.sizes[-1] and max(len(r.block_ids) for r in rows) <= self.width

    def run(self, rows: list[SpecRow]) -> SpecResult:
        """Replay the step for rows (within `can_run`, slots of `self.slots`): the result's
        tensors are views of the graph's outputs, valid until its next replay."""
        from engine.upload import upload
        b = len(rows)
        bs = next(s for s in self.sizes if s >= b)
        pad = bs - b
        biased = any(r.params.logit_bias for r in rows)
        mode = BIASED if biased else SAMPLED if any(not r.params.greedy for r in rows) else GREEDY
        sampled = mode != GREEDY  # (the biased graph is the general one: its rows' floats and seeds)
        ints = [[r.slot for r in rows] + [self.pad] * pad, [r.step_shift for r in rows] + [0] * pad]
        ints.append([seed_int64(r.params.seed) for r in rows] + [0] * pad if sampled else [0] * bs)
        self.ints[:, :bs].copy_(upload(ints, torch.long, self.ints.device))
        if biased:  # every row's pairs (at most MAX_LOGIT_BIAS each, so within the bucket's buffer),
            # from each request's arrays built once (SamplingParams.bias_arrays), as the eager step's
            at, ids, values = bias_rows([r.params for r in rows], self.ints.device)
            n = at.shape[0]
            self.bias_pairs[0, :n].copy_(at)
            self.bias_pairs[1, :n].copy_(ids)
            self.bias_values[:n].copy_(values)
            self.bias_count.fill_(n)
        if sampled:
            floats = [[r.params.temperature for r in rows] + [0.0] * pad, [r.params.top_p for r in rows] + [1.0] * pad]
            self.floats[:, :bs].copy_(upload(floats, torch.float32, self.floats.device))
        w = max(len(r.block_ids) for r in rows)
        # padding rows: the scratch block in every column they could read (their positions are
        # below k + 2 <= block_size, column 0); a live row's columns past its own are never read
        table = [r.block_ids + [r.block_ids[0]] * (w - len(r.block_ids)) for r in rows] + [[self.scratch] * w] * pad
        self.tables[:bs, :w].copy_(upload(table, torch.int32, self.tables.device))
        graph, out = self.graphs[bs, mode]
        self.replay(graph)
        top = None
        asked = [i for i, r in enumerate(rows) if r.params.top_logprobs]
        if asked:
            # after the replay, from its verify logits (`self.logits`): the distribution each
            # target token was drawn from does not depend on its sampling step, so these are the
            # numbers the eager step's `sample_step` gives (the graphs themselves compute none);
            # for the rows that asked only (a top-p row's sort is [rows, vocab]); the others' stay 0
            k1 = self.k + 1
            dev = self.ints.device
            per = SamplingRows.build([(rows[i].params, 0) for i in asked], dev).repeat(k1)
            logits = self.logits[: b * k1].view(b, k1, -1)  # row i's k + 1 verify rows, in order
            which = upload(asked, torch.long, dev) if len(asked) < b else None
            if which is not None:
                logits = logits[which]
            top = top_logprobs_batch(logits.reshape(len(asked) * k1, -1), per).view(len(asked), k1, -1)
            if which is not None:
                top = torch.zeros(b, k1, top.shape[2], dtype=top.dtype, device=dev).index_copy_(0, which, top)
        return SpecResult(out.tokens[:b], out.logprobs[:b], out.count[:b], top)
