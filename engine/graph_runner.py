"""CUDA graphs of the decode forward, one per batch-size bucket (SGLang's `cuda_graph_bs`).

At start-up the decode forward (embed → layers with `AbsorbedDecodeKv` → final norm → lm_head)
is captured for each batch size in `batch_sizes(max_batch)`, largest first, all graphs sharing
one memory pool and one set of static input buffers sized for the largest batch and the widest
block table the pool allows. A step of B requests replays the smallest graph with room for B:
the host's plan (engine/decode_batch.py: input ids, positions, lengths, block-table rows, padded
to the bucket) is copied from pinned host memory straight into the bucket's static inputs, one
copy; padding rows are a one-token context in the scratch block (so they write their garbage
latent there, never into a live request's block). Inside the graph: the future-token map resolves placeholder input ids
(engine/future_map.py) and the rows' block tables are gathered from the device-resident
`BlockTables` store. Each graph also ends with the greedy head (engine/sampling.py
`greedy_batch`: argmax and its log-probability, written into the future map at the step's
slots and packed for the one device-to-host copy), so an all-greedy step launches nothing but
its input copies, the replay and that copy; a step with sampled rows samples from the graph's
logits after the replay (and its tokens overwrite the greedy ones in the map).

The attention kernel's work depends on each row's length, not on the table width, so one width
serves every context; `bucket` is None only for a batch larger than the largest bucket.

Graphs replay on a stream of the highest priority (`PriorityReplay`), ordered after the
caller's stream and before its next work: a decode worker's local prefill runs on a stream of
its own (worker/model_lane.py), and the GPU's block scheduler then starts a decode step's
kernels ahead of the prefill's waiting blocks, so running streams keep their step time.
"""

from __future__ import annotations

import logging
import time

import torch

from engine.decode_batch import AbsorbedDecodeKv, BlockTables, DecodePlan
from engine.future_map import FutureTokenMap
from engine.kernels import pdl
from engine.kv_pool import KvPool
from engine.model import shared_experts_beside
from engine.sampling import greedy_batch, pack_step

log = logging.getLogger(__name__)


class PriorityReplay:
    """Replays CUDA graphs on one high-priority stream of `device`, in the caller's order.

    A replay waits for what the caller's current stream queued before it (the input copies)
    and the current stream waits for the replay (what reads the outputs next): two event
    records and waits, a few microseconds, through two events made once (a wait takes the
    event's state when it is called, so recording the event again for the next replay is
    safe). A replayed graph's kernels take the launch stream's priority (cudaGraphInstantiate
    without UseNodePriority)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # clamped to the highest priority the device has; none off CUDA (tests' eager stand-ins)
        self.stream = torch.cuda.Stream(device, priority=-100) if device.type == "cuda" else None
        if self.stream is not None:
            self._inputs_ready, self._outputs_ready = torch.cuda.Event(), torch.cuda.Event()

    def __call__(self, graph: torch.cuda.CUDAGraph) -> None:
        if self.stream is None:
            graph.replay()
            return
        cur = torch.cuda.current_stream(self.device)
        self._inputs_ready.record(cur)
        self.stream.wait_event(self._inputs_ready)
        with torch.cuda.stream(self.stream):
            graph.replay()
        self._outputs_ready.record(self.stream)
        cur.wait_event(self._outputs_ready)


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
        tables: the runner's BlockTables (fixed from here on: its store's address is baked in).
        future: the runner's FutureTokenMap (placeholder ids are resolved inside the graph).
        max_batch: the largest batch (the worker's --max-running).
        scratch_block: a block no request ever owns (the worker reserves one).
    """

    def __init__(self, model: torch.nn.Module, pool: KvPool, tables: BlockTables, future: FutureTokenMap,
                 max_batch: int, scratch_block: int, sizes: list[int] | None = None) -> None:
        dev = pool.kv.device
        self.model, self.pool, self.tables, self.future = model, pool, tables, future
        self.scratch = scratch_block  # also where the MTP loop writes positions past a request's end
        self.width = tables.width
        self.sizes = sorted(sizes or batch_sizes(max_batch))
        n = self.sizes[-1]
        tables.fixed = True
        self.pad_row = tables.reserve_row(scratch_block)
        # the static inputs (ids, positions, lens, rows, slots): bucket bs reads `inputs(bs)`, the
        # first 5 × bs entries of one buffer as a contiguous [5, bs] (so the plan's host-to-device
        # copy lands there directly; a [5, n] buffer's [:, :bs] slice is strided, and a copy from
        # the host into a strided tensor goes through a temporary and a second copy)
        self._inputs = torch.zeros(5 * n, dtype=torch.long, device=dev)
        self._padding = torch.tensor([[0] * n, [0] * n, [1] * n, [self.pad_row] * n, [-1] * n], dtype=torch.long,
                                     device=dev)  # padding rows' values (a one-token context, no slot)
        # batch size -> (graph, its outputs: logits [bs, vocab] float32, greedy pack [bs, 2] float64)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.replay = PriorityReplay(dev)
        self._capture(dev)

    def _capture(self, dev: torch.device) -> None:
        t0 = time.perf_counter()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()  # (graph capture empties the cache too: measure from an empty one)
        before = torch.cuda.memory_reserved(dev)
        pool_handle = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(dev)
        for bs in reversed(self.sizes):  # largest first: the smaller ones reuse its memory
            self.pad_inputs(bs)
            stream.wait_stream(torch.cuda.current_stream(dev))
            # a one-token MoE layer's shared experts on a second stream: a branch of the graph; our
            # Triton kernels launched each while the one before it runs (engine/kernels/pdl.py)
            with shared_experts_beside():
                with torch.cuda.stream(stream), torch.inference_mode():
                    # warm-up outside the graph (allocator, lazy inits, autotune): once with plain
                    # launches (the kernel variants an eager step and the sampling after a replay
                    # use), twice as the graph launches them
                    self._forward(bs)
                    with pdl.dependent_launches(dev):
                        for _ in range(2):
                            self._forward(bs)
                torch.cuda.current_stream(dev).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with pdl.dependent_launches(dev), torch.inference_mode(), torch.cuda.graph(graph, pool=pool_handle):
                    out = self._forward(bs)
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize(dev)
        self.memory_bytes = torch.cuda.memory_reserved(dev) - before
        self.capture_seconds = time.perf_counter() - t0
        log.info("cuda graphs: %d batch sizes (%s), table width %d blocks, captured in %.1f s, "
                 "%.0f MiB; programmatic dependent launch %s", len(self.sizes), ",".join(map(str, self.sizes)),
                 self.width, self.capture_seconds, self.memory_bytes / 2**20,
                 "on" if pdl.supported(dev) else "off (TANDEM_PDL=0, a GPU before Hopper or a Triton before 3.4)")

    def inputs(self, bs: int) -> torch.Tensor:
        """Bucket bs's static inputs: [5, bs] int64 (ids, positions, lens, block-table rows,
        future-map slots), contiguous; the buckets' views overlap (each step writes all of its own)."""
        return self._inputs[: 5 * bs].view(5, bs)

    def pad_inputs(self, bs: int) -> None:
        """Fill bucket bs's inputs with padding rows (before its warm-up and capture)."""
        self.inputs(bs).copy_(self._padding[:, :bs])

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured step: (logits [bs, vocab] float32, greedy pack [bs, 2] float64 =
        `pack_step(*greedy_batch(logits))`, whose tokens are stored at the slots ints[4])."""
        ints = self.inputs(bs)
        ids = self.future.resolve(ints[0])
        kv = AbsorbedDecodeKv(self.pool, self.tables.store.index_select(0, ints[3]), ints[2].int())
        ep = getattr(self.model, "ep_rank", None)  # an expert-parallel rank (engine/moe_ep.py)
        if ep is not None:  # its padding rows (a one-token context; a request's has 2 or more) go to no expert
            ep.real_rows = ints[2] > 1
        try:
            hidden = self.model(ids, ints[1], [1] * bs, kv)
        finally:
            if ep is not None:
                ep.real_rows = None
        logits = self.model.logits(hidden)
        tokens, logprobs = greedy_batch(logits)
        self.future.store(ints[4], tokens)  # padding rows' slot is -1: the map's sink
        return logits, pack_step(tokens, logprobs)

    def bucket(self, batch: int) -> int | None:
        """The graph batch size a step of `batch` rows replays (None: larger than every bucket)."""
        return next((s for s in self.sizes if s >= batch), None)

    def run(self, plan: DecodePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay for plan (built padded to its bucket, rows from `tables`); returns (logits
        [plan.batch, vocab] float32, greedy pack [plan.batch, 2] float64, its tokens already in
        the future map at the plan's slots): views of the graph's outputs, valid until the
        next replay."""
        bs = plan.ints.shape[1]
        static = self.inputs(bs)
        if not _same_tensor(plan.ints, static):  # (a plan built into `inputs(bs)` itself: nothing to copy)
            static.copy_(plan.ints)
        graph, (logits, pack) = self.graphs[bs]
        self.replay(graph)
        return logits[: plan.batch], pack[: plan.batch]


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a and b are the same memory with the same layout."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
