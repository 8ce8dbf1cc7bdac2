"""Pipeline-parallel chunked prefill: the layers split over stage processes.

The prefill worker process is stage 0: it owns scheduling, embeds each chunk, runs its own
layers and sends the hidden states on; stages 1..N-1 are processes it spawns, each running its
layer range on whatever arrives, in arrival order, so every stage sees the same micro-batch order
that stage 0 chose. The last stage computes the logits of a prompt's final chunk and returns
them to stage 0, and acknowledges every chunk, so stage 0 knows when a chunk's KV is complete in
all layers. Sends are asynchronous: stage 0 embeds and runs chunk k+1 while chunk k runs on
stage 1, so the chunks of one request fill the pipeline.

Transport: torch.distributed process groups built directly over a TCPStore (gloo on CPU, NCCL
on CUDA), not the global default group, so several pipelines may live in one process (tests).
Messages from stage k to k+1 (the forward group), one tag each (gloo matches p2p messages per
pair and tag in order): a header int64[5] = (op, start, end, num_blocks, final), the block table
int64[num_blocks] and the hidden states [end - start, hidden] in the model dtype. The last stage
sends stage 0 an ack int64[2] = (start, end) per chunk and, for a final chunk, float32 logits
[vocab], on a group of their own: NCCL runs a pair's operations in order on one stream, so a
receive of an ack posted on the forward pair would hold back the next chunk's send. At start
every pair is opened in a fixed order (`_handshake`: NCCL sets a pair up at its first operation).
On CUDA stage 0's collector thread polls the works instead of waiting on them (a wait would make
the default stream, on which stage 0 computes, wait for the ack), and stages time their compute
by their own stream, not the whole device (whose NCCL streams hold later chunks' receives).

KV: every stage writes its own layers of the one KV pool. On CPU the pool tensor lives in shared
memory (`share_memory_`), handed to the stages by torch.multiprocessing, so the pool that stage 0
registered for transfer holds all layers and the block export is unchanged. On CUDA the same
hand-over shares the pool through CUDA IPC (it stays on stage 0's GPU; a stage on GPU i + s
writes and reads its layers across the GPUs' link through `PagedKvCache`'s device moves: at a
128K-token prompt about 1.5 % of a chunk's attention time by arithmetic). Each stage moves its
layers to its GPU and makes their fast forms again there (`_stage_layers_to`: the stacked MoE
experts, the fused projections, the compiled functions). That multi-GPU path is written but has
not been run. A pool per stage in its own HBM, `[blocks, stage_layers, block_size, kv_dim]`,
with one transfer per stage into the decode worker's layers, would also free stage 0's GPU of
the other stages' KV.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from common import tracing
from common.lifecycle import exit_with_parent
from engine.kv_pool import KvPoolConfig, PagedKvCache
from engine.rank_devices import collective_backend, rank_devices

if TYPE_CHECKING:
    from worker.host import WorkerRuntime

log = logging.getLogger(__name__)

OP_CHUNK, OP_STOP = 1, 2
TAG_HEADER, TAG_BLOCKS, TAG_HIDDEN, TAG_ACK, TAG_LOGITS = 0, 1, 2, 3, 4
HEADER_LEN = 5  # op, start, end, blocks, final; then (start_ns, end_ns) of each stage's compute


def header_len(size: int) -> int:
    """Header and ack carry every stage's compute interval (wall-clock ns, one host) for the
    `tandem.prefill.stage` spans stage 0 records."""
    return HEADER_LEN + 2 * size
OnChunkDone = Callable[[int], Awaitable[None]]


class PipelineError(RuntimeError):
    """A stage process died or the pipeline is closed: this worker cannot prefill any more."""


def partition_layers(num_layers: int, pp_size: int, spec: str = "") -> list[tuple[int, int]]:
    """[start, stop) layer ranges of the stages.

    spec: comma-separated layer counts per stage ("3,1"), or "" for counts as even as
    possible (earlier stages take the remainder). Raises ValueError naming the flag when the
    counts do not sum to num_layers, a stage gets no layer, or pp_size > num_layers.
    """
    if pp_size < 1:
        raise ValueError(f"--pp-size must be >= 1, got {pp_size}")
    if spec:
        try:
            counts = [int(c) for c in spec.split(",")]
        except ValueError:
            raise ValueError(f"--pp-layer-partition {spec!r}: not comma-separated integers") from None
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
            raise ValueError(f"--pp-layer-partition {spec!r}: need {pp_size} counts >= 1 summing to "
                             f"{num_layers} layers")
    else:
        if pp_size > num_layers:
            raise ValueError(f"--pp-size {pp_size} exceeds the model's {num_layers} layers")
        counts = [num_layers // pp_size + (1 if i < num_layers % pp_size else 0) for i in range(pp_size)]
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


@dataclass
class _SharedPool:
    """What PagedKvCache needs of a pool, in a stage process (the tensor is shared memory)."""

    config: KvPoolConfig
    kv: torch.Tensor


def _make_group(backend: str, store: dist.Store, rank: int, size: int,
                timeout: datetime.timedelta) -> Any:
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _make_groups(backend: str, store: dist.Store, rank: int, size: int,
                 timeout: datetime.timedelta) -> tuple[Any, Any]:
    """(forward group: headers, block tables and hidden states from stage k to k + 1; return
    group: the last stage's acks and logits to stage 0). Two groups because NCCL runs one
    pair's sends and receives on one stream in order: stage 0's posted receive of an ack would
    hold back its next chunk's send to stage 1 on a shared pair."""
    return (_make_group(backend, dist.PrefixStore("fwd", store), rank, size, timeout),
            _make_group(backend, dist.PrefixStore("ret", store), rank, size, timeout))


def _handshake(pg: Any, pg_ret: Any, rank: int, size: int, dev: torch.device) -> None:
    """Open every pair the pipeline uses, in an order with no wait cycle: NCCL sets a pair's
    communicator up at its first operation, and both sides must join it (stage 0's first
    operation with the last stage would otherwise be the wait for an ack that needs a chunk)."""
    t = torch.zeros(1, dtype=torch.long, device=dev)
    if rank > 0:
        pg.recv([t], rank - 1, TAG_HEADER).wait()
    if rank < size - 1:
        pg.send([t], rank + 1, TAG_HEADER).wait()
    if rank == size - 1:
        pg_ret.send([t], 0, TAG_ACK).wait()
    if rank == 0:
        pg_ret.recv([t], size - 1, TAG_ACK).wait()
    _sync_stream(dev)


def _sync_stream(dev: torch.device) -> None:
    """Wait for this thread's current stream (CUDA): not the whole device, whose NCCL streams
    hold receives posted for later chunks."""
    if dev.type == "cuda":
        torch.cuda.current_stream(dev).synchronize()


def _stage_layers_to(model: torch.nn.Module, layers: tuple[int, int], dev: torch.device, last: bool) -> None:
    """A stage process on its own GPU: its layers (and on the last stage the final norm and
    lm_head) moved there, in the fast forms stage 0's runner gave the model: the fused MoE
    experts stacked again on this GPU (a layer's stacks are plain tensors, which `.to()` leaves
    behind), the attentions' fused input projection, the compiled hot functions."""
    from engine.kernels.fused import use_fused_hot_path, use_fused_projections
    from engine.kernels.grouped_experts import use_grouped_experts
    from engine.model import MoE

    stage = torch.nn.ModuleList(model.model.layers[i] for i in range(*layers))
    fast = any(isinstance(m, MoE) and m.grouped is not None for m in stage.modules())
    for m in stage.modules():
        if isinstance(m, MoE):
            m.grouped = None
    stage.to(dev)
    if last:
        model.model.norm.to(dev)
        model.lm_head.to(dev)
    if fast:
        use_grouped_experts(stage)
        use_fused_projections(stage)
        use_fused_hot_path()


def _stage_main(rank: int, size: int, port: int, backend: str, model: torch.nn.Module, kv: torch.Tensor,
                kv_config: KvPoolConfig, layers: tuple[int, int], device: str, threads: int,
                timeout_s: float, parent_pid: int) -> None:
    """Body of stage process `rank` >= 1: receive, run layers [start, stop), pass on; until STOP
    (or until the worker process parent_pid is gone)."""
    exit_with_parent(parent_pid)
    torch.set_num_threads(threads)
    dev = torch.device(device)
    last = rank == size - 1
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        _stage_layers_to(model, layers, dev, last)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    pg, pg_ret = _make_groups(backend, store, rank, size, datetime.timedelta(seconds=timeout_s))
    _handshake(pg, pg_ret, rank, size, dev)
    pool = _SharedPool(kv_config, kv)
    hidden_size = model.config.hidden_size
    dtype = model.dtype
    pending: deque[tuple[Any, Any]] = deque()  # (work, tensor kept alive until sent)
    header = torch.empty(header_len(size), dtype=torch.long, device=dev)
    try:
        with torch.inference_mode():
            while True:
                pg.recv([header], rank - 1, TAG_HEADER).wait()
                op, start, end, num_blocks, final = header[:HEADER_LEN].tolist()
                if op == OP_STOP:
                    if not last:
                        pg.send([header], rank + 1, TAG_HEADER).wait()
                    break
                blocks = torch.empty(num_blocks, dtype=torch.long, device=dev)
                pg.recv([blocks], rank - 1, TAG_BLOCKS).wait()
                x = torch.empty(end - start, hidden_size, dtype=dtype, device=dev)
                pg.recv([x], rank - 1, TAG_HIDDEN).wait()
                positions = torch.arange(start, end, dtype=torch.long, device=dev)
                cache = PagedKvCache(pool, [(blocks.tolist(), start, end - start)])
                began = time.time_ns()
                x = model.run_layers(x, positions, [end - start], cache, *layers)
                _sync_stream(dev)  # the interval is the compute's, not its launch's
                header[HEADER_LEN + 2 * rank:HEADER_LEN + 2 * rank + 2] = torch.tensor([began, time.time_ns()])
                if last:
                    if final:
                        logits = model.logits(model.model.norm(x[-1:]))[0].contiguous()  # [vocab] float32
                        pending.append((pg_ret.send([logits], 0, TAG_LOGITS), logits))
                    ack = torch.cat([torch.tensor([start, end], dtype=torch.long, device=dev), header[HEADER_LEN:]])
                    pending.append((pg_ret.send([ack], 0, TAG_ACK), ack))
                else:
                    out_header = header.clone()
                    x = x.contiguous()
                    for t, tag in ((out_header, TAG_HEADER), (blocks, TAG_BLOCKS), (x, TAG_HIDDEN)):
                        pending.append((pg.send([t], rank + 1, tag), t))
                while len(pending) > 16:  # bound what is in flight; sends complete in order
                    pending.popleft()[0].wait()
        while pending:
            pending.popleft()[0].wait()
        if dev.type == "cuda":  # a CUDA work's wait() orders streams only: let the last sends (STOP) finish
            torch.cuda.synchronize(dev)
    finally:
        del pg, pg_ret
    # Skip the interpreter's teardown (seconds of finalizers for torch and the shared model
    # on a busy machine): everything this process owned is released by the kernel.
    logging.shutdown()
    os._exit(0)


@dataclass
class _Chunk:
    """A chunk dispatched by stage 0: its sends, and the last stage's ack (and logits)."""

    end: int
    final: bool
    keep: list[Any]  # works and tensors that must outlive the sends
    ack: Any
    ack_tensor: torch.Tensor | None = None  # [2 + 2 × stages]: start, end, each stage's (start_ns, end_ns)
    logits_work: Any = None
    logits: torch.Tensor | None = None
    done: asyncio.Future | None = field(default=None, repr=False)


class Pipeline:
    """Stage 0's side of the pipeline: spawns stages 1..N-1 and drives them.

    Threading: `dispatch` runs on the worker's model thread; acks are awaited by one collector
    thread (gloo's p2p works cannot be polled), in dispatch order, which resolves each chunk's
    asyncio future on the worker's event loop.
    """

    def __init__(self, model: torch.nn.Module, pool_kv: torch.Tensor, pool_config: KvPoolConfig,
                 ranges: Sequence[tuple[int, int]], device: torch.device, threads: int,
                 timeout_s: float = 300.0) -> None:
        self.model = model
        self.ranges = list(ranges)
        self.size = len(ranges)
        self.device = device
        backend = collective_backend(device)
        devices = rank_devices(device, self.size, "--pp-size")  # stage s on GPU i + s
        if device.type == "cpu":
            # the stages read the same weights through shared memory: no copy, no reload
            model.share_memory()
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, wait_for_workers=False,
                                    timeout=timeout)
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs = []
        for rank in range(1, self.size):
            p = ctx.Process(target=_stage_main, name=f"prefill-stage-{rank}", daemon=True,
                            args=(rank, self.size, self._store.port, backend, model, pool_kv, pool_config,
                                  self.ranges[rank], str(devices[rank]), threads, timeout_s, os.getpid()))
            p.start()
            self.procs.append(p)
        self.pg, self.pg_ret = _make_groups(backend, self._store, 0, self.size, timeout)
        _handshake(self.pg, self.pg_ret, 0, self.size, device)
        self._wait_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._acks: queue.Queue[tuple[_Chunk, asyncio.AbstractEventLoop] | None] = queue.Queue()
        self._collector = threading.Thread(target=self._collect, name="pipeline-acks", daemon=True)
        self.closed = False
        self._collector.start()
        self.max_in_flight = 0  # most chunks of one request in the pipeline at once (overlap > 1)
        log.info("prefill pipeline: %d stages over layers %s (%s)", self.size, self.ranges, backend)

    # --- model thread --------------------------------------------------------------------------

    @torch.inference_mode()
    def dispatch(self, pool: Any, block_ids: list[int], token_ids: list[int], start: int, end: int,
                 final: bool, loop: asyncio.AbstractEventLoop) -> _Chunk:
        """Embed tokens [start, end), run stage 0's layers, send the hidden states to stage 1.

        Returns at once after the sends are posted; the chunk's `done` future resolves when the
        last stage has finished it."""
        if self.closed or self.dead_stages():
            raise PipelineError(f"the prefill pipeline is closed or lost stages {self.dead_stages()}")
        dev = self.device
        ids = torch.tensor(token_ids[start:end], dtype=torch.long, device=dev)
        positions = torch.arange(start, end, dtype=torch.long, device=dev)
        nb = -(-end // pool.config.block_size)
        cache = PagedKvCache(pool, [(block_ids, start, end - start)])
        began = time.time_ns()
        x = self.model.model.embed_tokens(ids)  # [chunk, hidden]
        x = self.model.run_layers(x, positions, [end - start], cache, *self.ranges[0]).contiguous()
        _sync_stream(dev)
        times = [began, time.time_ns()] + [0] * (2 * (self.size - 1))
        header = torch.tensor([OP_CHUNK, start, end, nb, int(final), *times], dtype=torch.long, device=dev)
        blocks = torch.tensor(block_ids[:nb], dtype=torch.long, device=dev)
        chunk = _Chunk(end, final, [header, blocks, x], None, done=loop.create_future())
        last = self.size - 1
        # post the receives before the sends: the last stage may answer at once
        if final:
            chunk.logits = torch.empty(self.model.config.vocab_size, dtype=torch.float32, device=dev)
            chunk.logits_work = self.pg_ret.recv([chunk.logits], last, TAG_LOGITS)
        ack = torch.empty(2 + 2 * self.size, dtype=torch.long, device=dev)
        chunk.ack = self.pg_ret.recv([ack], last, TAG_ACK)
        chunk.ack_tensor = ack
        for t, tag in ((header, TAG_HEADER), (blocks, TAG_BLOCKS), (x, TAG_HIDDEN)):
            chunk.keep.append(self.pg.send([t], 1, tag))
        self._acks.put((chunk, loop))
        return chunk

    # --- collector thread ----------------------------------------------------------------------

    def _collect(self) -> None:
        while True:
            item = self._acks.get()
            if item is None:
                return
            chunk, loop = item
            error: BaseException | None = None
            works = [w for w in (chunk.logits_work, chunk.ack, *chunk.keep) if hasattr(w, "wait")]
            try:
                self._complete(works)
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting request
                error = exc if isinstance(exc, PipelineError) else PipelineError(
                    f"prefill pipeline transport failed: {exc}")
            loop.call_soon_threadsafe(_resolve, chunk.done, error)

    def _complete(self, works: list[Any]) -> None:
        """Return once every work has completed (PipelineError when a stage dies first). On CUDA
        a work's wait() only makes the current stream wait, which on this thread would be the
        device's default stream, the one stage 0 computes on: its next chunk would queue behind
        this chunk's ack. So there the works are polled, and waited on (for their errors) on a
        stream of this thread's own once complete. Gloo's waits block, as wanted."""
        if self._wait_stream is None:  # gloo: wait() blocks this thread (its p2p works complete only in wait())
            for w in works:
                w.wait()
            return
        last_check = time.monotonic()
        for w in works:
            pause = 0.0002
            while not w.is_completed():
                time.sleep(pause)
                pause = min(0.005, pause * 2)  # short for a short chunk, cheap for a long one
                if time.monotonic() - last_check > 0.5:
                    last_check = time.monotonic()
                    dead = self.dead_stages()
                    if dead or self.closed:
                        raise PipelineError(f"prefill pipeline stage process(es) {dead} died" if dead
                                            else "prefill pipeline closed")
            with torch.cuda.stream(self._wait_stream):
                w.wait()

    # --- event loop ----------------------------------------------------------------------------

    async def prefill(self, rt: WorkerRuntime, block_ids: list[int], token_ids: list[int],
                      chunks: Sequence[tuple[int, int]], on_chunk_done: OnChunkDone | None) -> torch.Tensor:
        """Run `chunks` through the pipeline; returns float32 logits [vocab] of the last token.

        `on_chunk_done(end)` is awaited, in order, once chunk [.., end) is finished on every
        stage. On error or cancellation it still waits for the chunks already dispatched, so
        no stage writes into blocks the caller frees afterwards. Raises PipelineError when a
        stage process died.
        """
        loop = asyncio.get_running_loop()
        inflight: deque[_Chunk] = deque()
        logits: torch.Tensor | None = None
        try:
            for i, (s, e) in enumerate(chunks):
                inflight.append(await rt.run_model(self.dispatch, rt.pool, block_ids, token_ids, s, e,
                                                   i == len(chunks) - 1, loop))
                self.max_in_flight = max(self.max_in_flight, len(inflight))
                while inflight and inflight[0].done.done():  # type: ignore[union-attr]
                    logits = await self._finish(inflight.popleft(), on_chunk_done, logits)
            while inflight:
                await self._wait(inflight[0])
                logits = await self._finish(inflight.popleft(), on_chunk_done, logits)
        finally:
            if inflight:
                await asyncio.shield(self._drain(list(inflight)))
        assert logits is not None, "the final chunk brings the logits"
        return logits

    def dead_stages(self) -> list[str]:
        """Names of stage processes that have exited (the pipeline cannot run any more)."""
        return [p.name for p in self.procs if not p.is_alive()]

    async def _wait(self, chunk: _Chunk) -> None:
        assert chunk.done is not None
        while True:
            done, _ = await asyncio.wait([chunk.done], timeout=0.5)
            if done:
                return
            dead = self.dead_stages()
            if dead:
                raise PipelineError(f"prefill pipeline stage process(es) {dead} died")

    async def _finish(self, chunk: _Chunk, on_chunk_done: OnChunkDone | None,
                      logits: torch.Tensor | None) -> torch.Tensor | None:
        assert chunk.done is not None
        chunk.done.result()  # raises a transport error
        self._trace(chunk)
        if on_chunk_done is not None:
            await on_chunk_done(chunk.end)
        return chunk.logits if chunk.final else logits

    def _trace(self, chunk: _Chunk) -> None:
        """One `tandem.prefill.chunk` span (first stage's start to last stage's end) with a
        `tandem.prefill.stage` child per stage, from the intervals the stages reported."""
        if not tracing.enabled() or chunk.ack_tensor is None:
            return
        start, end, *times = chunk.ack_tensor.tolist()
        stages = [(times[2 * k], times[2 * k + 1]) for k in range(self.size)]
        parent = tracing.record_span("tandem.prefill.chunk", stages[0][0], stages[-1][1],
                                     {"tandem.chunk.start": start, "tandem.chunk.tokens": end - start})
        for k, (t0, t1) in enumerate(stages):
            tracing.record_span("tandem.prefill.stage", t0, t1,
                                {"tandem.pp.stage": k, "tandem.pp.layers": f"{self.ranges[k][0]}-{self.ranges[k][1]}"},
                                parent=parent)

    async def _drain(self, chunks: list[_Chunk]) -> None:
        for c in chunks:
            try:
                await self._wait(c)
            except PipelineError:
                return  # a stage died: nothing more will be written

    def close(self) -> None:
        """Stop the stages (STOP travels down the pipeline) and join them; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            if all(p.is_alive() for p in self.procs):
                stop = torch.zeros(header_len(self.size), dtype=torch.long, device=self.device)
                stop[0] = OP_STOP
                self.pg.send([stop], 1, TAG_HEADER).wait()
        except Exception as exc:  # noqa: BLE001 - shutting down anyway
            log.warning("prefill pipeline: stop message failed: %s", exc)
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                log.warning("prefill pipeline: %s did not stop; terminating it", p.name)
                p.terminate()
                p.join(5)
        self._acks.put(None)
        self._collector.join(5)


def _resolve(fut: asyncio.Future, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
