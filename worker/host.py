"""What a prefill and a decode worker process share: model, KV pool, transfer agent,
gRPC server with health and reflection, etcd registration, and the staged lifecycle
startup → serve → drain → shutdown (STYLE.md, "A staged lifecycle").
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, NamedTuple, Sequence, TypeVar

import grpc
import torch

from common import metrics as metrics_http
from common import tls, tracing
from common.block_hash import hash_seed
from common.env import TEST_INSTANCE_ID_VAR, read_env
from common.gc_pauses import freeze_startup_heap
from common.lifecycle import install_stop_signals
from common.grpc_server import RunningServer, advertised_host, record_address, start_server, validate_listen_port
from common.pb.tandem.v1 import discovery_pb2, kv_events_pb2, kv_events_pb2_grpc
from common.tls import TlsFiles
from common.validation import SPECULATIVE_SAMPLING
from discovery.endpoints import check_etcd_tls
from worker.kv_event_service import KvEventServicer
from engine.capacity import (device_memory_bytes, format_bytes, graph_reserve_bytes, module_bytes,
                             pool_blocks_from_memory, spec_bias_reserve_bytes)
from engine.device_clock import ForwardClock
from engine.kv_events import KvEventLog
from engine.chunking import ChunkPlanner, make_planner, profile_lengths
from engine.kv_pool import KV_CACHE_DTYPES, KvPool, KvPoolConfig, PoolExhausted, PromptBlocks, kv_cache_torch_dtype
from engine.model_source import DEFAULT_MODEL, LoadedModel, load_model
from engine.weight_layout import to_device
from engine.mtp import pool_has_mtp
from engine.prefill_batch import ChunkResult, PrefillBatcher
from engine.runner import ModelRunner, PrefillInput
from worker.metrics import WorkerMetrics
from worker.model_lane import ModelLane, StreamForward
from worker.peers import metadata_digest

log = logging.getLogger(__name__)
T = TypeVar("T")
from common.version import VERSION  # noqa: F401  (re-exported: workers report it)
DEFAULT_NUM_BLOCKS = 4096  # the pool without --num-blocks or --mem-fraction-static


@dataclass(frozen=True)
class WorkerOptions:
    """Flags shared by `tandem prefill` and `tandem decode` (each has a TANDEM_* variable)."""

    model: str = DEFAULT_MODEL  # tandem-shakespeare, tandem-tiny or a Hugging Face checkpoint folder
    seed: int = 0  # weight seed for TINY
    block_size: int = 16  # tokens per KV block (must match the router's)
    num_blocks: int = 0  # KV pool capacity in blocks; 0 = from --mem-fraction-static, else DEFAULT_NUM_BLOCKS
    mem_fraction_static: float = 0.0  # weights + KV pool as a share of device memory; 0 = use --num-blocks
    device_memory_bytes: int = 0  # memory --mem-fraction-static applies to; 0 = the GPU's total (CPU: physical RAM)
    practical_fraction: float = 0.9  # decode admission: admitted requests' projected KV <= this share of the pool
    max_queued: int = 256  # decode: requests waiting for admission; one more gets RESOURCE_EXHAUSTED
    solo_wait_s: float = 5.0  # decode: seconds a request that fits only alone may wait for admission
    stream_interval: int = 1  # decode: generated tokens per stream message (SGLang's --stream-interval)
    gil_switch_interval_us: int = 200  # sys.setswitchinterval of the worker process, in microseconds
    gc_freeze: bool = True  # gc.freeze() the start-up heap once serving (common/gc_pauses.py)
    chunk_size: int = 0  # prefill chunk in tokens (dynamic chunking: the base chunk); 0 = auto (resolved_chunk_size); alias --chunked-prefill-size
    max_prefill_tokens: int = 16384  # token budget of one prefill forward (chunks of concurrent prompts packed)
    prefill_tokens_per_decode_step: int = 1024  # decode: local prefill tokens between two decode steps while requests decode; 0 = off
    prefill_sm_count: int = 0  # decode on CUDA: SMs of the local prefill's green context; 0 = all, shared
    enable_dynamic_chunking: bool = False  # chunks shrink as the prefix grows, so each one takes about the same time
    dynamic_chunk_smoothing: float = 0.75  # σ: chunk = base + σ·(x − base)
    pp_size: int = 1  # prefill: pipeline stages (processes); 1 = no pipeline
    pp_layer_partition: str = ""  # prefill: layers per stage "3,1"; empty = as even as possible
    kv_cache_dtype: str = "auto"  # auto (model dtype) | bf16 | fp8_e4m3
    kv_cache_scale: float = 1.0  # fp8_e4m3: per-pool scale (stored = latent / scale)
    device: str = "auto"  # auto = cuda (bf16 weights) when present, else cpu (float32)
    max_running: int = 64  # decode: concurrent requests in the batch
    host: str = "127.0.0.1"
    port: int = 0  # 0 = pick a free port
    advertise_host: str = ""  # host peers reach this worker at (etcd record); "" = host
    etcd: str = ""  # etcd endpoints host:port[,host:port]; empty = no registration
    namespace: str = "default"
    lease_ttl_s: float = 10.0
    transfer_backend: str = "auto"  # auto | nixl | shm | cuda-ipc (kv_transfer/select.py)
    transfer_timeout_s: float = 30.0
    prefill_timeout_s: float = 30.0  # decode: wait this long (at most half the deadline) for a prefill worker
    drain_timeout_s: float = 30.0  # on SIGTERM: finish in-flight requests for at most this long
    stall_timeout_s: float = 60.0  # a model call running longer than this means the engine is wedged
    torch_threads: int = 1  # intra-op threads for the model (small model: 1 is fastest)
    speculative_num_steps: int = 0  # decode: MTP draft tokens per verify step (0 = off)
    disable_overlap_schedule: bool = False  # decode: run schedule/run/postprocess strictly in turn
    decode_steps_per_launch: int = 4  # decode, overlap loop without MTP: steps queued per model-thread call
    disable_cuda_graph: bool = False  # decode on CUDA: run each step eagerly instead of replaying a graph
    metrics_port: int = -1  # Prometheus /metrics: -1 = off, 0 = any free port
    ep_size: int = 1  # decode: expert-parallel ranks (processes) forming this worker; 1 = no EP
    ep_backend: str = "auto"  # decode: all-to-all backend of the EP ranks: auto | torch | deepep
    ep_placement: str = ""  # decode: JSON expert placement (engine/ep_placement.py); empty = contiguous
    profile_dir: str = ""  # torch.profiler trace of a window of model calls written here (worker/lane_profile.py); "" = off
    profile_calls: str = "50:20"  # with --profile-dir: SKIP:COUNT, model calls to skip once serving, then to record
    tls_cert: str = ""  # PEM certificate naming this worker's role (common/tls.py); with --tls-key and --tls-ca
    tls_key: str = ""  # its private key
    tls_ca: str = ""  # the cluster CA: clients' and peers' certificates must chain to it

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)

    def __post_init__(self) -> None:
        metrics_http.validate_port(self.metrics_port)
        check_etcd_tls(self.etcd, self.tls_cert)
        validate_listen_port(self.port)
        for name in ("block_size", "max_prefill_tokens", "max_running", "torch_threads", "ep_size", "pp_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("chunk_size", "prefill_tokens_per_decode_step", "num_blocks", "device_memory_bytes", "max_queued",
                     "prefill_sm_count"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        from worker.lane_profile import parse_calls
        parse_calls(self.profile_calls)
        if not 1 <= self.gil_switch_interval_us <= 5000:
            raise ValueError(f"--gil-switch-interval-us must be in [1, 5000] (Python's default is 5000), "
                             f"got {self.gil_switch_interval_us}")
        from engine.overlap_runner import MAX_STEPS_PER_LAUNCH
        if not 1 <= self.decode_steps_per_launch <= MAX_STEPS_PER_LAUNCH:
            raise ValueError(f"--decode-steps-per-launch must be in 1..{MAX_STEPS_PER_LAUNCH}, "
                             f"got {self.decode_steps_per_launch}")
        if self.stream_interval < 1:
            raise ValueError(f"--stream-interval must be >= 1 token, got {self.stream_interval}")
        if self.solo_wait_s < 0:
            raise ValueError(f"--solo-wait must be >= 0 seconds, got {self.solo_wait_s}")
        if not 0 <= self.mem_fraction_static <= 1:
            raise ValueError(f"--mem-fraction-static must be in [0, 1] (0 = off), got {self.mem_fraction_static}")
        # > 1 overcommits: a bet that requests stop (EOS) before max_tokens; retraction covers a lost bet.
        if not 0 < self.practical_fraction <= 4:
            raise ValueError(f"--practical-fraction must be in (0, 4], got {self.practical_fraction}")
        if not 0 <= self.speculative_num_steps <= 8:
            raise ValueError(f"--speculative-num-steps must be in 0..8, got {self.speculative_num_steps}")
        from kv_transfer.select import CHOICES
        if self.transfer_backend not in CHOICES:
            raise ValueError(f"--transfer-backend must be one of {', '.join(CHOICES)}, got {self.transfer_backend!r}")
        if self.lease_ttl_s < 1:
            raise ValueError(f"--lease-ttl must be >= 1 second, got {self.lease_ttl_s}")
        advertised_host(self.host, self.advertise_host)  # fails early, naming the flag
        if not 0.0 <= self.dynamic_chunk_smoothing <= 1.0:
            raise ValueError(f"--dynamic-chunk-smoothing must be in [0, 1], got {self.dynamic_chunk_smoothing}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype!r}: choose one of {', '.join(KV_CACHE_DTYPES)}")
        if not self.kv_cache_scale > 0:
            raise ValueError(f"--kv-cache-scale must be > 0, got {self.kv_cache_scale}")
        if self.device != "auto" and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"--device {self.device!r}: use auto, cpu, cuda or cuda:N")
        TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)  # fails naming the flags when only some are set

    def torch_device(self) -> torch.device:
        """The device `--device` names (auto: cuda when present)."""
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda":  # said here, naming the flag, not as torch's assertion deep in the load
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if not count:
                raise ValueError(f"--device {self.device}: this machine has no CUDA device torch can use "
                                 f"(torch {torch.__version__}, CUDA {torch.version.cuda or 'not built in'}): use cpu or auto")
            if device.index is not None and device.index >= count:
                raise ValueError(f"--device {self.device}: this machine has {count} CUDA device"
                                 f"{'s' if count > 1 else ''} (cuda:0{f' to cuda:{count - 1}' if count > 1 else ''})")
        return device


# --chunk-size 0 (the default) by device: on a GPU a forward needs thousands of tokens to reach
# the compute limit (docs/benchmarks.md: 8K-token chunks of a 16B MoE at 42 % of an H200's bf16
# peak; SGLang picks 8192 for GPUs of this size too); on a CPU a forward is compute-bound at any
# size, and short chunks keep a decode worker's local prefill from stalling its streams long.
CPU_CHUNK_SIZE = 256
CUDA_CHUNK_SIZE = 8192


def auto_chunk_size(device: torch.device) -> int:
    """The prefill chunk (tokens) `--chunk-size 0` means on this device."""
    return CUDA_CHUNK_SIZE if device.type == "cuda" else CPU_CHUNK_SIZE


@dataclass
class BackendTransferStats:
    """Prefill side: KV transfers through one backend (a metric label: backend)."""

    transfers: int = 0  # requests whose KV arrived completely (notification sent)
    writes: int = 0  # write_blocks calls (one per finished chunk with overlap, plus the last)
    failures: int = 0  # requests whose transfer failed (the decode worker prefills locally)
    bytes: int = 0
    seconds: float = 0.0  # sum over writes of submission to completion (writes may overlap)
    exposed_seconds: float = 0.0  # sum over requests of last chunk's end to notification sent


@dataclass
class WorkerStats:
    """Counters of one worker, exported at scrape time (worker/metrics.py WORKER_COUNTERS:
    a new field needs one line there)."""

    remote_prefills: int = 0  # decode: prompts whose KV came from a prefill worker
    local_prefills: int = 0  # decode: prompts prefilled here
    prefill_cached_tokens: int = 0  # prefill: prompt tokens taken from this worker's prefix cache
    transfers: int = 0  # prefill: KV transfers completed (all backends)
    transfer_bytes: int = 0
    transfer_seconds: float = 0.0
    spec_verify_steps: int = 0  # decode: MTP verify steps, summed over requests
    spec_emitted_tokens: int = 0  # decode: tokens those steps emitted (accept length = emitted / steps)
    spec_draft_tokens: int = 0  # decode: draft tokens proposed
    prefix_query_tokens: int = 0  # prompt tokens looked up in this worker's prefix cache
    prefix_hit_tokens: int = 0  # of those, tokens found there
    generated_tokens: int = 0  # decode: tokens streamed (first tokens included)
    solo_yields: int = 0  # decode: requests running alone retracted after their turn so that waiting ones could run
    retractions: int = 0  # decode: running requests retracted for lack of KV blocks (re-prefilled later)
    fenced_prefills: int = 0  # decode: prefill calls unanswered: their blocks held until the prefill worker is done
    fences_released_by_peer: int = 0  # decode: of those, released on the prefill worker's Abandon answer
    fences_released_peer_gone: int = 0  # decode: of those, released once nothing listened at its address
    fences_expired: int = 0  # decode: of those, released at the fence's bound, without an answer
    prefill_channels_closed: int = 0  # decode: channels to prefill workers closed as their records left discovery
    late_writes_refused: int = 0  # prefill: KV writes not posted: the decode worker's call had ended or abandoned them
    prefill_forwards: int = 0  # prefill forwards run by the batcher (engine/prefill_batch.py)
    prefill_chunks: int = 0  # prompt chunks those forwards computed (chunks / forwards = mean batch)
    prefill_inflight_waits: int = 0  # prefill: prompts that waited for a shared prefix another one computed (inflight.py)
    prefill_paced_pieces: int = 0  # decode: local prefill pieces let in between two decode steps (prefill_pacing.py)
    prefill_pace_timeouts: int = 0  # decode: of those, pieces that ran after waiting 0.25 s for a decode step
    decode_steps: int = 0  # decode: steps launched
    decode_launches: int = 0  # decode (overlap): model-thread calls that launched steps (--decode-steps-per-launch)
    decode_step_rows: int = 0  # decode: requests in those steps (rows / steps = the mean batch)
    decode_busy_steps: int = 0  # decode: steps whose launch the next launch followed with no idle wait in between
    decode_busy_step_rows: int = 0  # decode: requests in those steps (row seconds / busy step rows = time per token)
    decode_step_seconds: float = 0.0  # decode: wall time from each busy launch to the next (/ busy steps = the cadence)
    decode_device_wait_seconds: float = 0.0  # decode (overlap): host time spent waiting for a step's result
    decode_device_busy_seconds: float = 0.0  # decode (overlap, CUDA): device time the steps ran (CUDA events)
    decode_device_idle_seconds: float = 0.0  # decode (overlap, CUDA): device time between a step's end and the next's start
    decode_row_seconds: float = 0.0  # decode: sum over busy steps of rows × their share of the time to the next launch
    transfer_by_backend: dict[str, BackendTransferStats] = field(default_factory=dict)

    def backend(self, name: str) -> BackendTransferStats:
        """The counters of one backend ("nixl", "shm", "cuda-ipc"), created on first use."""
        return self.transfer_by_backend.setdefault(name, BackendTransferStats())


def pool_blocks(opts: WorkerOptions, loaded: LoadedModel, pool_config: KvPoolConfig,
                reserve_bytes: int = 0) -> int:
    """KV pool size in blocks: --num-blocks when given; else from --mem-fraction-static
    ((device memory × fraction − weight bytes − reserve_bytes) / block bytes; reserve_bytes is
    the decode graphs' memory, `engine.capacity.graph_reserve_bytes`); else DEFAULT_NUM_BLOCKS.
    Logs the resulting capacity.

    Raises:
        ValueError: --mem-fraction-static leaves no room for one block (the message says why).
    """
    if opts.num_blocks:
        blocks, why = opts.num_blocks, "--num-blocks"
    elif opts.mem_fraction_static:
        device = next(loaded.model.parameters()).device
        memory = device_memory_bytes(device, opts.device_memory_bytes)
        weights = module_bytes(loaded.model)
        blocks = pool_blocks_from_memory(memory, opts.mem_fraction_static, weights + reserve_bytes,
                                         pool_config.block_bytes)
        why = (f"--mem-fraction-static {opts.mem_fraction_static} of {format_bytes(memory)} ({device.type}) "
               f"minus {format_bytes(weights)} of weights"
               + (f" and {format_bytes(reserve_bytes)} for CUDA graphs" if reserve_bytes else ""))
    else:
        blocks, why = DEFAULT_NUM_BLOCKS, "default"
    log.info("KV pool: %d blocks × %d B = %s, %d tokens at %d B per token (%s)", blocks,
             pool_config.block_bytes, format_bytes(blocks * pool_config.block_bytes), blocks * pool_config.block_size,
             pool_config.bytes_per_token, why)
    return blocks


class TransferEndpoint(NamedTuple):
    """A transfer agent of this worker, the pool it registered and its metadata: one per EP rank
    (rank 0's is the worker's own)."""

    agent: Any  # kv_transfer.KvTransferAgent
    desc: Any  # kv_transfer.PoolDescriptor
    metadata: bytes


class WorkerRuntime:
    """Model, pool, runner, KV event log and transfer agent of one worker process."""

    def __init__(self, role: int, opts: WorkerOptions, loaded: LoadedModel | None = None,
                 engine: Callable[[WorkerOptions, LoadedModel, KvPoolConfig, int], Any] | None = None) -> None:
        """`engine`, when given, builds the pool and runner instead of a local KvPool and
        ModelRunner: it returns an object with `pool`, the runner calls and `close()` (the EP
        ranks of decode_worker/ep_ranks.py)."""
        torch.set_num_threads(opts.torch_threads)
        self.role = role
        self.opts = opts
        # Over mTLS the instance id is the certificate's instance name, so that a peer can check
        # that the process it talks to is the one of the record (prefill_worker/service.py).
        self.instance_id = (read_env(TEST_INSTANCE_ID_VAR, str) or (tls.TLS.instance if tls.TLS else None)
                            or f"{discovery_pb2.Role.Name(role).removeprefix('ROLE_').lower()}-{uuid.uuid4().hex[:12]}")
        # New at every start, so a restart under the same instance id is told apart (records, KV events).
        self.incarnation = secrets.randbits(64) | 1
        if loaded is None:  # a given model keeps its own device and dtype (tests share one)
            device = opts.torch_device()
            # bf16 weights on a GPU (the gate bias stays float32: see engine/model.py)
            loaded = load_model(opts.model, seed=opts.seed,
                                dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
            if engine is None:  # in the fast mode's layout, a layer at a time (engine/weight_layout.py)
                to_device(loaded.model, device)
            else:  # expert-parallel ranks place their layers themselves (decode_worker/ep_ranks.py)
                loaded.model.to(device)
        self.loaded = loaded
        cfg = self.loaded.config
        model_dtype = self.loaded.model.dtype
        self.device = self.loaded.model.model.embed_tokens.weight.device
        if opts.chunk_size == 0:
            opts = self.opts = dataclasses.replace(opts, chunk_size=auto_chunk_size(self.device))
        # num_kv_layers: the MTP module's KV rides in the same blocks (engine/mtp.py), so
        # prefill and decode workers of one model agree on the block layout whatever their flags
        pool_config = KvPoolConfig(num_blocks=1, block_size=opts.block_size, num_layers=cfg.num_kv_layers,
                                   kv_dim=cfg.kv_dim, dtype=kv_cache_torch_dtype(opts.kv_cache_dtype, model_dtype),
                                   scale=opts.kv_cache_scale)
        # decode graphs; not on EP ranks with MTP, whose steps all run eagerly
        graphs = (role == discovery_pb2.ROLE_DECODE and self.device.type == "cuda" and not opts.disable_cuda_graph
                  and not (engine is not None and opts.speculative_num_steps))
        k = opts.speculative_num_steps if engine is None else 0  # MTP steps' graphs: (k + 1) rows per request
        # an EP rank's MoE layers run on the rows every rank sent it (ep_size × its bucket)
        reserve = (graph_reserve_bytes(cfg, opts.max_running * max(1, opts.ep_size))
                   + (graph_reserve_bytes(cfg, opts.max_running * (k + 1))
                      + spec_bias_reserve_bytes(cfg, opts.max_running, k) if k else 0)) if graphs else 0
        pool_config = dataclasses.replace(pool_config, num_blocks=pool_blocks(opts, self.loaded, pool_config, reserve))
        self.engine = None
        if engine is None:
            self.pool = KvPool(pool_config, hash_seed(self.loaded.name, weights=self.loaded.fingerprint), device=self.device)
            # two launches of the overlap loop hold placeholders at once (engine/overlap_runner.py)
            self.runner = ModelRunner(self.loaded.model, self.pool,
                                      future_capacity=4 * opts.decode_steps_per_launch * opts.max_running + 16)
            if self.runner.fast:  # compile the prefill forward's fused functions now, not in a request
                log.info("start-up warm-up (fused MoE kernels, torch.compile of the fused functions): %.1f s",
                         self.runner.warm_up_prefill())
            if graphs and self.runner.fast:  # before any request: graph memory comes out of the reserve above
                spec_k = k if pool_has_mtp(self.pool, self.loaded.model) else 0
                self.runner.capture_graphs(opts.max_running, self.context_length, spec_k=spec_k)
                used = self.runner.graphs.memory_bytes + (self.runner.spec_graphs.memory_bytes if spec_k else 0)
                if used > reserve:
                    log.warning("CUDA graphs took %s, more than the %s reserved from --mem-fraction-static",
                                format_bytes(used), format_bytes(reserve))
            elif role == discovery_pb2.ROLE_DECODE and self.device.type == "cuda" and opts.disable_cuda_graph:
                log.info("decode on CUDA without graphs: --disable-cuda-graph")
        else:  # --- EP hook: the ranks' pools (num_blocks each) and lock-step runner (decode_worker/ep_ranks.py)
            self.engine = engine(opts, self.loaded, pool_config, hash_seed(self.loaded.name, weights=self.loaded.fingerprint))
            self.pool, self.runner = self.engine.pool, self.engine
            # every rank captures its graphs, MoE all-to-alls included, before any request
            if graphs and self.engine.fast:
                used = self.engine.capture_graphs(opts.max_running, self.context_length)
                if used > reserve:
                    log.warning("CUDA graphs took %s on one EP rank, more than the %s reserved from "
                                "--mem-fraction-static", format_bytes(used), format_bytes(reserve))
            elif self.device.type == "cuda":
                log.info("decode on CUDA without graphs (expert-parallel ranks step eagerly): %s",
                         "--disable-cuda-graph" if opts.disable_cuda_graph else
                         "MTP steps" if opts.speculative_num_steps else "the plain path")
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
        self.events = KvEventLog(self.pool.blocks, incarnation=self.incarnation)
        self.stats = WorkerStats()
        self.scheduler: Any = None  # decode: its DecodeScheduler (admission and retraction state)
        self.prefill_pacer: Any = None  # decode: local prefill in pieces between decode steps (prefill_pacing.py)
        self.start_time = time.time()
        self.metrics_address = ""  # host:port of /metrics once served
        self.draining = False  # set on SIGTERM: new requests are refused with UNAVAILABLE
        self.in_flight = 0  # requests being served (prefill: including their transfers)
        self.prefill_queued_tokens = 0  # prompt tokens submitted for prefill here and not yet computed
        self.metrics = WorkerMetrics(self)
        # One thread for all model work: forwards never run concurrently, the event loop
        # keeps serving RPCs, and the pool's accounting stays on the loop thread. A decode
        # worker on CUDA runs its local prefill on a second thread and stream, beside its
        # decode steps (worker/model_lane.py).
        self._model_lane = ModelLane("model", self.device)
        self._prefill_lane: ModelLane | None = None
        # the prefill forwards' device time (tandem_worker_prefill_device_seconds_total), timed
        # on the stream each runs on
        self.prefill_clock = ForwardClock(self.device)
        run_prefill, forward = self.run_model, self.prefill_clock.wrap(self._prefill_forward)
        if role == discovery_pb2.ROLE_DECODE and self.device.type == "cuda" and engine is None:
            self._prefill_lane = ModelLane("prefill", self.device)
            run_prefill, forward = self._prefill_lane.run, StreamForward(forward, self.device, opts.prefill_sm_count)
        # Every single-process prefill (remote RPCs, local and re-prefills) goes through one
        # batcher, so concurrent prompts share forwards. The EP engine has no batched call:
        # its chunks run one per forward, through the same queue.
        self.batcher = PrefillBatcher(run_prefill, forward, opts.max_prefill_tokens,
                                      cfg.vocab_size, opts.block_size, self._observe_prefill_batch)
        self._idle = asyncio.Event()
        self._idle.set()
        from kv_transfer import create_agent, prepare_pool
        from kv_transfer.ucx_bind import confine_ucx
        confine_ucx(opts.host)  # NIXL's UCX listeners on --host's interface only (before UCX starts)
        # An EP worker registers each rank's pool with an agent of its own: a rank's pool lives
        # on its own device (rank 0's agent is the worker's, named after the instance)
        rank_pools = self.pool.ranks if self.engine is not None else [self.pool]
        agents: list[Any] = []
        try:
            for p in rank_pools:
                prepare_pool(p.kv, opts.transfer_backend)  # host pools into shared memory for shm
            for r in range(len(rank_pools)):
                agents.append(create_agent(opts.transfer_backend, f"{self.instance_id}-ep{r}" if r else self.instance_id))
        except BaseException:
            for a in agents:
                a.close()
            if self.engine is not None:  # do not leave EP rank processes behind
                self.engine.close()
            raise
        # The metadata is read once: its digest goes into the discovery record, and a decode
        # worker sends these very bytes to prefill workers, which compare them with the digest
        # (worker/peers.py).
        self.endpoints: list[TransferEndpoint] = []
        for a, p in zip(agents, rank_pools):
            desc = a.register_pool(p.kv)  # before the metadata, which describes the registered memory
            self.endpoints.append(TransferEndpoint(a, desc, a.metadata()))

    @property
    def agent(self) -> Any:
        """The worker's transfer agent (rank 0's on an EP worker)."""
        return self.endpoints[0].agent

    @property
    def pool_desc(self) -> Any:
        return self.endpoints[0].desc

    @property
    def transfer_metadata(self) -> bytes:
        return self.endpoints[0].metadata

    def transfer_target(self, block_ids: list[int]) -> tuple[TransferEndpoint, list[int]]:
        """Where a prefill worker writes these blocks of this worker's pool: the endpoint (agent,
        PoolDescriptor, metadata) of the pool that holds them, and their ids in it. On an EP
        worker the owning rank's, with local ids (block_ids: one request's, global, non-empty)."""
        if self.engine is None:
            return self.endpoints[0], list(block_ids)
        rank, local = self.pool.split(block_ids)
        return self.endpoints[rank], local

    def load(self) -> kv_events_pb2.WorkerLoad:
        """The load this worker reports to routers (KvEventService.WatchLoad): requests served,
        KV blocks they hold, prompt tokens not yet prefilled."""
        held = self.pool.config.num_blocks - self.pool.blocks.num_free
        return kv_events_pb2.WorkerLoad(requests=self.in_flight, active_blocks=held,
                                        queued_prefill_tokens=max(0, self.prefill_queued_tokens))

    @property
    def model_waiting(self) -> int:
        """Model calls waiting for the model thread (and the local prefill's, where it has one)."""
        return self._model_lane.waiting + (self._prefill_lane.waiting if self._prefill_lane else 0)

    @property
    def vocab_size(self) -> int:
        return self.loaded.config.vocab_size

    @property
    def context_length(self) -> int:
        return self.loaded.config.max_position_embeddings

    def profile_from_now(self) -> None:
        """With --profile-dir: the model thread's calls from now on (serving, start-up's warm-up
        and captures done) count for --profile-calls (worker/lane_profile.py). One torch.profiler
        runs at a time in a process: a decode worker's local prefill lane's host calls are not
        traced (its stream's device activity is)."""
        if self.opts.profile_dir and self._model_lane.profile is None:
            from worker.lane_profile import LaneProfile
            role = discovery_pb2.Role.Name(self.role).removeprefix("ROLE_").lower()
            profile = LaneProfile(self.opts.profile_dir, self.opts.profile_calls, role, "model")
            profile.check_directory()  # now, not when the window closes: a start-up error
            self._model_lane.profile = profile
            log.info("--profile-dir %s: model calls %d..%d from now on will be recorded (--profile-calls %s)",
                     profile.directory, profile.skip + 1, profile.skip + profile.count, self.opts.profile_calls)

    async def run_model(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn on the model thread. If the caller is cancelled, wait for fn to finish
        before re-raising, so the caller never frees blocks a forward is still writing."""
        return await self._model_lane.run(fn, *args)

    def _chunk_planner(self) -> ChunkPlanner:
        """Static chunks, or dynamic ones fitted to start-up timings of the whole model
        (the fit's shape is what matters: stages of equal layer counts scale it alike)."""
        o = self.opts
        lengths, seconds = [], []
        if o.enable_dynamic_chunking:
            lengths = profile_lengths(o.chunk_size, o.block_size, min(self.context_length, 4 * o.chunk_size))
            seconds = self.runner.time_prefill(lengths)
            log.info("prefill timings for dynamic chunking: %s",
                     ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in zip(lengths, seconds)))
        return make_planner(o.chunk_size, o.block_size, o.enable_dynamic_chunking, o.dynamic_chunk_smoothing,
                            lengths, seconds)

    async def prefill(self, block_ids: list, token_ids: list[int], start: int,
                      on_chunk_done: Callable[[int], Awaitable[None]] | None = None) -> torch.Tensor:
        """Chunked prefill of token_ids[start:] (tokens before start are in the pool), with
        chunks from `self.planner`; through the stage processes when --pp-size > 1, else each
        chunk in a forward shared with other prompts' chunks (`prefill_outputs`).

        Traced as a `tandem.prefill` span with one `tandem.prefill.chunk` child per chunk
        (with --pp-size > 1 one `tandem.prefill` span: the chunks run in the stage processes).

        Args:
            on_chunk_done: awaited after each chunk, once it has finished on every stage, with
                the number of prompt tokens whose KV (all layers) is now complete in the pool
                (the chunk's end, counting the cached prefix); the prefill worker starts sending
                those blocks while the next chunk computes. An exception it raises ends the prefill.

        Returns:
            float32 logits [vocab] of the last prompt token.
        Raises:
            ValueError: nothing to compute (start >= len(token_ids)).
            engine.pipeline.PipelineError: a pipeline stage process died.
        """
        if self.pipeline is None:
            out = await self.prefill_outputs(block_ids, token_ids, start, on_chunk_done=on_chunk_done)
            assert out.logits is not None
            return out.logits
        chunks = self._chunks(token_ids, start)
        began = time.perf_counter()
        queued = len(token_ids) - start
        self.prefill_queued_tokens += queued
        try:
            with tracing.span("tandem.prefill", {"tandem.prefill.where": "remote",
                                                 "tandem.prompt_tokens": len(token_ids),
                                                 "tandem.prefill.cached_tokens": start,
                                                 "tandem.prefill.chunks": len(chunks),
                                                 "tandem.prefill.pp_size": self.opts.pp_size}):
                logits = await self.pipeline.prefill(self, block_ids, token_ids, chunks, on_chunk_done)
        finally:
            self.prefill_queued_tokens -= queued
        self.metrics.prefill_duration.labels("remote").observe(time.perf_counter() - began)
        return logits

    def _chunks(self, token_ids: list[int], start: int) -> list[tuple[int, int]]:
        chunks = self.planner.chunks(start, len(token_ids))
        if not chunks:
            raise ValueError(f"prefill needs at least one token to compute (start {start}, {len(token_ids)} tokens)")
        return chunks

    async def prefill_hidden(self, block_ids: list, token_ids: list[int], start: int, mtp: bool = False,
                             on_chunk_done: Callable[[int], Awaitable[None]] | None = None) -> torch.Tensor:
        """As `prefill` in one process, but returns the last prompt token's final-normed hidden
        state [hidden] (what the first MTP draft step needs); with `mtp` it also writes the
        prompt's MTP KV rows (engine/mtp.py).

        Raises:
            ValueError: nothing to compute, or a pipeline-parallel worker (its hidden states
                stay in the last stage).
        """
        return (await self.prefill_outputs(block_ids, token_ids, start, mtp, on_chunk_done, logits=False)).hidden

    async def prefill_outputs(self, block_ids: list, token_ids: list[int], start: int, mtp: bool = False,
                              on_chunk_done: Callable[[int], Awaitable[None]] | None = None,
                              logits: bool = True) -> ChunkResult:
        """The single-process chunked prefill: each chunk of `self.planner` is submitted to
        `self.batcher` after the previous one finished (and `on_chunk_done` ran), so it shares
        a forward with other prompts' chunks of at most --max-prefill-tokens tokens in all;
        a cancelled request stops between chunks (engine/prefill_batch.py). Each
        `tandem.prefill.chunk` span carries the batch size and tokens of its forward.

        Returns:
            the last chunk's ChunkResult: hidden [hidden] of the last prompt token and, with
            `logits`, its float32 logits [vocab] (computed in the forward's one lm_head call).
        Raises:
            ValueError: nothing to compute, a chunk the batcher refuses (it names why), or a
                pipeline-parallel worker (its hidden states stay in the last stage).
        """
        if self.pipeline is not None:
            raise ValueError("the last hidden state (MTP) is not served with --pp-size > 1")
        chunks = self._chunks(token_ids, start)
        out: ChunkResult | None = None
        where = "remote" if self.role == discovery_pb2.ROLE_PREFILL else "local"
        began = time.perf_counter()
        left = len(token_ids) - start  # in the load routers see (WatchLoad) until computed
        self.prefill_queued_tokens += left
        try:
            with tracing.span("tandem.prefill", {"tandem.prefill.where": where, "tandem.prompt_tokens": len(token_ids),
                                                 "tandem.prefill.cached_tokens": start,
                                                 "tandem.prefill.chunk_size": self.opts.chunk_size,
                                                 "tandem.prefill.max_prefill_tokens": self.opts.max_prefill_tokens,
                                                 "tandem.prefill.chunks": len(chunks)}):
                for i, (s, e) in enumerate(chunks):
                    last = logits and i == len(chunks) - 1
                    with tracing.span("tandem.prefill.chunk", {"tandem.chunk.index": i, "tandem.chunk.start": s,
                                                               "tandem.chunk.tokens": e - s}) as span:
                        pos, pieces = s, 0
                        while pos < e:  # one piece: the whole chunk unless decode steps pace it
                            async with self._prefill_turn() as paced:
                                end = self.prefill_pacer.piece_end(pos, e) if paced else e
                                out = await self.batcher.run_chunk(
                                    PrefillInput(block_ids, token_ids, pos, end, mtp, last and end == e))
                            self.prefill_queued_tokens -= end - pos
                            left -= end - pos
                            pos, pieces = end, pieces + 1
                        span.set_attributes({"tandem.prefill.batch_size": out.batch_size,
                                             "tandem.prefill.batch_tokens": out.batch_tokens,
                                             "tandem.prefill.pieces": pieces})
                    if on_chunk_done is not None:
                        await on_chunk_done(e)
        finally:
            self.prefill_queued_tokens -= left  # what a failure or cancellation left uncomputed
        self.metrics.prefill_duration.labels(where).observe(time.perf_counter() - began)
        assert out is not None
        return out

    def _prefill_turn(self) -> contextlib.AbstractAsyncContextManager[bool]:
        """The decode worker's pacing of local prefill against its decode steps
        (decode_worker/prefill_pacing.py); elsewhere every chunk runs whole at once."""
        if self.prefill_pacer is None:
            return contextlib.nullcontext(False)
        return self.prefill_pacer.turn()

    def _prefill_forward(self, batch: list[PrefillInput]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """The batcher's model-thread call: one forward (ModelRunner), or one chunk per forward
        where the runner has no batched call (the EP engine)."""
        batched = getattr(self.runner, "prefill_batch", None)
        if batched is not None:
            return batched(batch)
        out = []
        for w in batch:
            hidden = self.runner.prefill_chunk(w.block_ids, w.token_ids, w.start, w.end, w.mtp)
            out.append((hidden, self.runner.logits(hidden) if w.logits else None))
        return out

    def _observe_prefill_batch(self, chunks: int, tokens: int) -> None:
        self.stats.prefill_forwards += 1
        self.stats.prefill_chunks += chunks
        self.metrics.prefill_batch_tokens.observe(tokens)
        self.metrics.prefill_batch_chunks.observe(chunks)

    def seed_for(self, cache_salt: str) -> int:
        """The block-hash seed of a request with this cache salt (a tenant's, set by the router
        from its API key; "" = the pool's own seed). Must match router/workers.py seed_for."""
        if not cache_salt:
            return self.pool.hash_seed
        return hash_seed(self.loaded.name, cache_salt=cache_salt, weights=self.loaded.fingerprint)

    async def allocate_prompt(self, token_ids: list[int], context: grpc.aio.ServicerContext,
                              seed: int | None = None, count: bool = True) -> PromptBlocks:
        """The prompt's blocks in this worker's pool (hashed with `seed`, default the pool's),
        or RESOURCE_EXHAUSTED when it is full; `count`: into the prefix-cache counters."""
        try:
            prompt = self.pool.allocate_prompt(token_ids, seed)
        except PoolExhausted as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
            raise
        if count:
            self.count_prefix_lookup(len(token_ids), prompt)
        return prompt

    def count_prefix_lookup(self, num_tokens: int, prompt: PromptBlocks) -> None:
        """Prefix cache hit-rate counters for one allocated prompt of num_tokens tokens (every
        allocation path calls this)."""
        self.stats.prefix_query_tokens += num_tokens
        self.stats.prefix_hit_tokens += prompt.num_cached_blocks * self.pool.block_size

    def stalled(self) -> bool:
        """True while one model call has run longer than --stall-timeout, or for good once a
        pipeline stage process has died (the worker then reports NOT_SERVING)."""
        if self.pipeline is not None and self.pipeline.dead_stages():
            return True
        now = time.monotonic()
        lanes = [self._model_lane] + ([self._prefill_lane] if self._prefill_lane else [])
        return any(lane.busy_for(now) > self.opts.stall_timeout_s for lane in lanes)

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
        from common.lifecycle import wait_set
        return await wait_set(self._idle, timeout_s)

    def instance(self, address: str) -> discovery_pb2.Instance:
        spec_k = self.opts.speculative_num_steps if self.role == discovery_pb2.ROLE_DECODE else 0
        return discovery_pb2.Instance(
            instance_id=self.instance_id, role=self.role, address=address, model=self.loaded.name,
            block_size=self.opts.block_size, hash_seed=self.pool.hash_seed,
            kv_capacity_blocks=self.pool.config.num_blocks, transfer_agent_name=self.agent.name,
            state=discovery_pb2.INSTANCE_STATE_SERVING, start_time_unix=self.start_time, version=VERSION,
            metrics_address=self.metrics_address, incarnation=self.incarnation,
            weights_fingerprint=self.loaded.fingerprint,
            speculative_num_steps=spec_k,
            speculative_sampling=SPECULATIVE_SAMPLING if spec_k else (),
            transfer_metadata_sha256=metadata_digest(self.transfer_metadata),
            rank_transfer_agents=[discovery_pb2.RankTransferAgent(
                name=e.agent.name, metadata_sha256=metadata_digest(e.metadata), capacity_blocks=e.desc.num_blocks)
                for e in self.endpoints[1:]])

    def close(self) -> None:
        if self.engine is not None:  # stop the EP ranks from the model thread, between steps
            try:
                self._model_lane.submit(self.engine.close).result(timeout=45)
            except Exception:  # noqa: BLE001 - a wedged or failed engine must not block shutdown
                log.exception("%s: closing the EP ranks failed", self.instance_id)
        self._model_lane.shutdown()
        if self._prefill_lane is not None:
            self._prefill_lane.shutdown()
        if self.pipeline is not None:
            self.pipeline.close()
        for e in self.endpoints:
            e.agent.close()


async def _unless_stopped(coro, stop: asyncio.Event) -> bool:
    """Await `coro`; True when it finished, False (it is cancelled) when `stop` is set first.

    Raises:
        whatever `coro` raises.
    """
    task, stopped = asyncio.ensure_future(coro), asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()
            return True
        return False
    finally:
        for t in (task, stopped):
            if not t.done():
                t.cancel()


async def serve_worker(runtime: WorkerRuntime, add_services: Sequence[Callable[[grpc.aio.Server], None]],
                       service_names: Sequence[str], ready: Callable[[RunningServer], None] | None = None,
                       stop: asyncio.Event | None = None, before_stop: Callable[[], None] | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or `stop`), registered in etcd when --etcd is set.

    A second signal exits at once. `before_stop` runs after the drain, just before the server
    stops with its grace period (a decode worker ends its idle sessions there).
    """
    from discovery.registration import Registration

    opts = runtime.opts
    if opts.gc_freeze:  # the model, graphs and warm-up are built, nothing is served or registered yet:
        freeze_startup_heap()  # its one collection delays no request, and no request's objects are frozen
    runtime.profile_from_now()
    events = KvEventServicer(runtime.events, runtime.load)
    server = await start_server(
        f"{opts.host}:{opts.port}",
        [*add_services, lambda s: kv_events_pb2_grpc.add_KvEventServiceServicer_to_server(events, s)],
        [*service_names, "tandem.v1.KvEventService"])
    address = record_address(opts.host, opts.advertise_host, server.port)
    runtime.metrics.bind_loop(asyncio.get_running_loop())
    try:
        metrics_server = metrics_http.serve(runtime.metrics.registry, opts.host, opts.metrics_port,
                                            runtime.instance_id)
    except OSError:
        await server.stop(0)  # nothing was served yet; leave no server behind
        raise
    runtime.metrics_address = metrics_server.address if metrics_server else ""
    stop = stop or asyncio.Event()
    restore_signals = install_stop_signals(stop)
    registration = None
    if opts.etcd:
        registration = Registration(opts.etcd, opts.namespace, runtime.instance(address), ttl_seconds=opts.lease_ttl_s)
        registered = False
        try:  # a signal while etcd does not answer yet stops the start-up (its handler only sets `stop`)
            registered = await _unless_stopped(registration.start(), stop)
        finally:
            if not registered:  # stopped or failed: nothing was served yet; leave nothing behind
                restore_signals()
                await server.stop(0)
                if metrics_server is not None:
                    await asyncio.to_thread(metrics_server.close)
                runtime.close()
        if not registered:
            log.info("%s stopped before it was registered in etcd", runtime.instance_id)
            return
    log.info("%s serving on %s (model %s)", runtime.instance_id, address, runtime.loaded.name)
    o = runtime.opts
    log.info("prefill batching: --chunk-size %d, --max-prefill-tokens %d, dynamic chunking %s%s", o.chunk_size,
             o.max_prefill_tokens, "on" if o.enable_dynamic_chunking else "off",
             f", --prefill-tokens-per-decode-step {o.prefill_tokens_per_decode_step} (local prefill)"
             if runtime.role == discovery_pb2.ROLE_DECODE else "")
    log.info("GIL switch interval %.0f us (--gil-switch-interval-us)", sys.getswitchinterval() * 1e6)
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
        if before_stop is not None:
            before_stop()
        await server.stop(2.0)
        if metrics_server is not None:
            await asyncio.to_thread(metrics_server.close)
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
    """The drain stage (docs/deploy.md, "What a stop does"): report NOT_SERVING, mark the etcd record
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
