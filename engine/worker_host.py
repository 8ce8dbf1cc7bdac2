"""What a prefill and a decode worker process share: model, KV pool, transfer agent,
gRPC server with health and reflection, etcd registration, and the staged lifecycle
startup → serve → drain → shutdown (STYLE.md, "A staged lifecycle").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Sequence, TypeVar

import grpc
import torch

from common.block_hash import hash_seed
from common.lifecycle import install_stop_signals
from common.grpc_server import RunningServer, start_server
from common.pb.tandem.v1 import discovery_pb2, kv_events_pb2_grpc
from engine.kv_event_service import KvEventServicer
from engine.kv_events import KvEventLog
from engine.chunking import ChunkPlanner, make_planner, profile_lengths
from engine.kv_pool import KV_CACHE_DTYPES, KvPool, KvPoolConfig, PoolExhausted, PromptBlocks, kv_cache_torch_dtype
from engine.model_source import DEFAULT_MODEL, LoadedModel, load_model
from engine.runner import ModelRunner

log = logging.getLogger(__name__)
T = TypeVar("T")
VERSION = "0.1.0"


@dataclass(frozen=True)
class WorkerOptions:
    """Flags shared by `tandem prefill` and `tandem decode` (each has a TANDEM_* variable)."""

    model: str = DEFAULT_MODEL  # tandem-shakespeare, tandem-tiny or a Hugging Face checkpoint folder
    seed: int = 0  # weight seed for TINY
    block_size: int = 16  # tokens per KV block (must match the router's)
    num_blocks: int = 4096  # KV pool capacity in blocks
    chunked_prefill_size: int = 256  # prefill chunk in tokens (dynamic chunking: the base chunk); was chunk_size
    enable_dynamic_chunking: bool = False  # chunks shrink as the prefix grows (DESIGN.md section 7)
    dynamic_chunk_smoothing: float = 0.75  # σ: chunk = base + σ·(x − base)
    pp_size: int = 1  # prefill: pipeline stages (processes); 1 = no pipeline
    pp_layer_partition: str = ""  # prefill: layers per stage "3,1"; empty = as even as possible
    kv_cache_dtype: str = "auto"  # auto (model dtype) | bf16 | fp8_e4m3
    kv_cache_scale: float = 1.0  # fp8_e4m3: per-pool scale (stored = latent / scale)
    device: str = "auto"  # auto = cuda (bf16 weights) when present, else cpu (float32)
    max_running: int = 64  # decode: concurrent requests in the batch
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    etcd: str = ""  # etcd endpoints host:port[,host:port]; empty = no registration
    namespace: str = "default"
    lease_ttl_s: float = 10.0
    transfer_backend: str = "nixl"
    transfer_timeout_s: float = 30.0
    prefill_timeout_s: float = 30.0  # decode: wait this long (at most half the deadline) for a prefill worker
    drain_timeout_s: float = 30.0  # on SIGTERM: finish in-flight requests for at most this long
    stall_timeout_s: float = 60.0  # a model call running longer than this means the engine is wedged
    torch_threads: int = 1  # intra-op threads for the model (small model: 1 is fastest)

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "chunked_prefill_size", "max_running", "torch_threads",
                     "pp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.lease_ttl_s < 1:
            raise ValueError(f"--lease-ttl must be >= 1 second, got {self.lease_ttl_s}")
        if not 0.0 <= self.dynamic_chunk_smoothing <= 1.0:
            raise ValueError(f"--dynamic-chunk-smoothing must be in [0, 1], got {self.dynamic_chunk_smoothing}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
        if not self.kv_cache_scale > 0:
            raise ValueError(f"--kv-cache-scale must be > 0, got {self.kv_cache_scale}")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"--device {self.device!r}: use auto, cpu, cuda or cuda:N")

    @property
    def chunk_size(self) -> int:
        """The old name of chunked_prefill_size (kept for callers of the earlier option)."""
        return self.chunked_prefill_size

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


@dataclass
class WorkerStats:
    """Counters of one worker (exported as metrics by the observability issue)."""

    remote_prefills: int = 0  # decode: prompts whose KV came from a prefill worker
    local_prefills: int = 0  # decode: prompts prefilled here
    prefill_cached_tokens: int = 0  # prefill: prompt tokens taken from this worker's prefix cache
    transfers: int = 0  # prefill: KV transfers completed
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0


class WorkerRuntime:
    """Model, pool, runner, KV event log and transfer agent of one worker process."""

    def __init__(self, role: int, opts: WorkerOptions, loaded: LoadedModel | None = None) -> None:
        torch.set_num_threads(opts.torch_threads)
        self.role = role
        self.opts = opts
        self.instance_id = f"{discovery_pb2.Role.Name(role).removeprefix('ROLE_').lower()}-{uuid.uuid4().hex[:12]}"
        if loaded is None:  # a given model keeps its own device and dtype (tests share one)
            device = opts.torch_device()
            # bf16 weights on a GPU (the gate bias stays float32: see engine/model.py)
            loaded = load_model(opts.model, seed=opts.seed,
                                dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
            loaded.model.to(device)
        self.loaded = loaded
        cfg = self.loaded.config
        model_dtype = self.loaded.model.dtype
        self.device = self.loaded.model.model.embed_tokens.weight.device
        self.pool = KvPool(KvPoolConfig(num_blocks=opts.num_blocks, block_size=opts.block_size,
                                        num_layers=cfg.num_hidden_layers, kv_dim=cfg.kv_dim,
                                        dtype=kv_cache_torch_dtype(opts.kv_cache_dtype, model_dtype),
                                        scale=opts.kv_cache_scale),
                           hash_seed(self.loaded.name), device=self.device)
        self.runner = ModelRunner(self.loaded.model, self.pool)
        self.planner = self._chunk_planner()
        self.pipeline = None
        if opts.pp_size > 1:
            if role != discovery_pb2.ROLE_PREFILL:
                raise ValueError("--pp-size applies to prefill workers only")
            from engine.pipeline import Pipeline, partition_layers
            ranges = partition_layers(cfg.num_hidden_layers, opts.pp_size, opts.pp_layer_partition)
            if self.device.type == "cpu":
                self.pool.kv.share_memory_()  # every stage writes its own layers here (before registering)
            self.pipeline = Pipeline(self.loaded.model, self.pool.kv, self.pool.config, ranges, self.device,
                                     opts.torch_threads)
        self.events = KvEventLog(self.pool.blocks)
        self.stats = WorkerStats()
        self.start_time = time.time()
        self.busy_since: float | None = None  # monotonic start of the model call now running
        self.draining = False  # set on SIGTERM: new requests are refused with UNAVAILABLE
        self.in_flight = 0  # requests being served (prefill: including their transfers)
        self._idle = asyncio.Event()
        self._idle.set()
        # One thread for all model work: forwards never run concurrently, the event loop
        # keeps serving RPCs, and the pool's accounting stays on the loop thread.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        from kv_transfer import create_agent
        self.agent = create_agent(opts.transfer_backend, self.instance_id)
        self.pool_desc = self.agent.register_pool(self.pool.kv)

    @property
    def vocab_size(self) -> int:
        return self.loaded.config.vocab_size

    @property
    def context_length(self) -> int:
        return self.loaded.config.max_position_embeddings

    async def run_model(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on the model thread. If the caller is cancelled, wait for fn to finish
        before re-raising, so the caller never frees blocks a forward is still writing."""
        fut = asyncio.get_running_loop().run_in_executor(self._executor, self._timed, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            await asyncio.wait([fut])
            raise

    def _chunk_planner(self) -> ChunkPlanner:
        """Static chunks, or dynamic ones fitted to start-up timings of the whole model
        (the fit's shape is what matters: stages of equal layer counts scale it alike)."""
        o = self.opts
        lengths, seconds = [], []
        if o.enable_dynamic_chunking:
            lengths = profile_lengths(o.chunked_prefill_size, o.block_size,
                                      min(self.context_length, 4 * o.chunked_prefill_size))
            seconds = self.runner.time_prefill(lengths)
            log.info("prefill timings for dynamic chunking: %s",
                     ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in zip(lengths, seconds)))
        return make_planner(o.chunked_prefill_size, o.block_size, o.enable_dynamic_chunking,
                            o.dynamic_chunk_smoothing, lengths, seconds)

    async def prefill(self, block_ids: list, token_ids: list[int], start: int,
                      on_chunk_done: Callable[[int], Awaitable[None]] | None = None) -> torch.Tensor:
        """Chunked prefill of token_ids[start:] (tokens before start are in the pool), with
        chunks from `self.planner`, one model-thread call per chunk so a cancelled request
        stops between chunks; through the stage processes when --pp-size > 1.

        on_chunk_done(n) is awaited after each chunk, once it has finished on every stage,
        with n = the prompt tokens whose KV (all layers) is now complete in the pool.

        Returns:
            float32 logits [vocab] of the last prompt token.
        Raises:
            ValueError: nothing to compute (start >= len(token_ids)).
            engine.pipeline.PipelineError: a pipeline stage process died.
        """
        chunks = self.planner.chunks(start, len(token_ids))
        if not chunks:
            raise ValueError(f"prefill needs at least one token to compute (start {start}, {len(token_ids)} tokens)")
        if self.pipeline is not None:
            return await self.pipeline.prefill(self, block_ids, token_ids, chunks, on_chunk_done)
        hidden = None
        for s, e in chunks:
            hidden = await self.run_model(self.runner.prefill_chunk, block_ids, token_ids, s, e)
            if on_chunk_done is not None:
                await on_chunk_done(e)
        return await self.run_model(self.runner.logits, hidden)

    async def allocate_prompt(self, token_ids: list[int], context: grpc.aio.ServicerContext) -> PromptBlocks:
        """The prompt's blocks in this worker's pool, or RESOURCE_EXHAUSTED when it is full."""
        try:
            return self.pool.allocate_prompt(token_ids)
        except PoolExhausted as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            raise

    def _timed(self, fn: Callable[..., T], *args: Any) -> T:
        # On the model thread: the watchdog reads busy_since to spot a wedged engine.
        self.busy_since = time.monotonic()
        try:
            return fn(*args)
        finally:
            self.busy_since = None

    def stalled(self) -> bool:
        """True while one model call has run longer than --stall-timeout, or for good once a
        pipeline stage process has died (the worker then reports NOT_SERVING)."""
        if self.pipeline is not None and self.pipeline.dead_stages():
            return True
        since = self.busy_since
        return since is not None and time.monotonic() - since > self.opts.stall_timeout_s

    @contextlib.contextmanager
    def serving(self):
        """Count one request in flight for the drain (use around a whole RPC)."""
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; False if timeout_s passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except (TimeoutError, asyncio.TimeoutError):
            return False

    def instance(self, address: str) -> discovery_pb2.Instance:
        return discovery_pb2.Instance(
            instance_id=self.instance_id, role=self.role, address=address, model=self.loaded.name,
            block_size=self.opts.block_size, hash_seed=self.pool.hash_seed,
            kv_capacity_blocks=self.opts.num_blocks, transfer_agent_name=self.agent.name,
            state=discovery_pb2.INSTANCE_STATE_SERVING, start_time_unix=self.start_time, version=VERSION)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.pipeline is not None:
            self.pipeline.close()
        self.agent.close()


async def serve_worker(runtime: WorkerRuntime, add_services: Sequence[Callable[[grpc.aio.Server], None]],
                       service_names: Sequence[str], ready: Callable[[RunningServer], None] | None = None,
                       stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop`), registered in etcd when --etcd is set.

    A second signal exits at once.
    """
    from discovery.registration import Registration

    opts = runtime.opts
    events = KvEventServicer(runtime.events)
    server = await start_server(
        f"{opts.host}:{opts.port}",
        [*add_services, lambda s: kv_events_pb2_grpc.add_KvEventServiceServicer_to_server(events, s)],
        [*service_names, "tandem.v1.KvEventService"])
    address = f"{opts.host}:{server.port}"
    stop = stop or asyncio.Event()
    restore_signals = install_stop_signals(stop)
    registration = None
    if opts.etcd:
        registration = Registration(opts.etcd, opts.namespace, runtime.instance(address), ttl_seconds=opts.lease_ttl_s)
        await registration.start()
    log.info("%s serving on %s (model %s)", runtime.instance_id, address, runtime.loaded.name)
    if ready:
        ready(server)
    watchdog = asyncio.create_task(_watch_engine(runtime, server), name="engine-watchdog")  # strong ref
    try:
        await stop.wait()
        watchdog.cancel()
        await drain(runtime, server, registration, address)
    finally:
        watchdog.cancel()
        restore_signals()
        log.info("%s stopping", runtime.instance_id)
        await server.set_serving(False)
        if registration is not None:
            await asyncio.shield(registration.stop())
        await server.stop(2.0)
        runtime.close()


async def _watch_engine(runtime: WorkerRuntime, server: RunningServer) -> None:
    """Report NOT_SERVING while the engine is wedged (one model call over --stall-timeout), so
    health probes take the worker out of routing even though its gRPC server still answers;
    SERVING again once it makes progress."""
    period = min(0.5, runtime.opts.stall_timeout_s / 4)
    wedged = False
    while True:
        await asyncio.sleep(period)
        now = runtime.stalled()
        if now != wedged and not runtime.draining:
            wedged = now
            if wedged:
                log.error("%s: engine wedged (a model call has run over %.1f s); reporting NOT_SERVING",
                          runtime.instance_id, runtime.opts.stall_timeout_s)
            else:
                log.info("%s: engine making progress again; reporting SERVING", runtime.instance_id)
            await server.set_serving(not wedged)


async def drain(runtime: WorkerRuntime, server: RunningServer, registration, address: str) -> None:
    """The drain stage (DESIGN.md section 3): report NOT_SERVING, mark the etcd record
    DRAINING so routers send nothing new, refuse new requests, and let in-flight ones finish
    (a prefill worker's include their KV transfers, so the decode worker gets its blocks) for
    at most --drain-timeout seconds. Handing unfinished decode requests back for migration
    comes with request migration."""
    runtime.draining = True
    await server.set_serving(False)
    if registration is not None:
        inst = runtime.instance(address)
        inst.state = discovery_pb2.INSTANCE_STATE_DRAINING
        try:
            await registration.update(inst)
        except Exception as exc:  # noqa: BLE001 - etcd down: health probes still stop new work
            log.warning("could not mark %s DRAINING in etcd: %s", runtime.instance_id, exc)
    log.info("%s draining: %d requests in flight", runtime.instance_id, runtime.in_flight)
    if not await runtime.wait_idle(runtime.opts.drain_timeout_s):
        log.warning("%s: drain timeout (%.0f s) with %d requests still in flight", runtime.instance_id,
                    runtime.opts.drain_timeout_s, runtime.in_flight)
