"""`tandem mocker`: many simulated workers in one process.

Each simulated worker is a separate instance to the rest of the system: its own MockEngine
(block pool, prefix cache, KV event log), its own gRPC server and port (DecodeService or
PrefillService, KvEventService, grpc.health.v1), and its own lease-backed record in etcd.
They share one asyncio loop, which is what makes 100+ workers fit on 2 cores.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from common import tls
from common.block_hash import hash_seed
from common.grpc_server import RunningServer, add_lenient_service, start_server, validate_listen_port
from common.lifecycle import install_stop_signals
from common.tls import TlsFiles
from discovery.endpoints import check_etcd_tls
from common.pb.tandem.v1 import discovery_pb2, kv_events_pb2, kv_events_pb2_grpc, prefill_pb2
from worker.kv_event_service import KvEventServicer
from engine.model_source import MOCK, load_config
from worker.host import VERSION
from mocker.driver import RealTimeDriver
from mocker.engine import MockEngine
from mocker.service import MockDecodeServicer, MockPrefillServicer
from mocker.timing import TimingModel
from worker.session import DECODE_METHODS

log = logging.getLogger(__name__)
DECODE, PREFILL = "tandem.v1.DecodeService", "tandem.v1.PrefillService"


@dataclass(frozen=True)
class MockerOptions:
    """Flags of `tandem mocker` (each has a TANDEM_* variable)."""

    num_workers: int = 1  # simulated decode workers (they prefill locally when no prefill worker is used)
    num_prefill: int = 0  # simulated prefill workers
    model: str = MOCK  # the model's name and limits (a config is enough: no weights are loaded)
    block_size: int = 16  # tokens per KV block (must match the router's)
    num_blocks: int = 4096  # KV capacity of each simulated worker, in blocks
    chunk_size: int = 8192  # prefill chunk in tokens
    max_running: int = 256  # decode: most requests in one batch
    speedup: float = 1.0  # simulated seconds per real second
    timing: str = ""  # JSON timing model (mocker/timing.py fields, e.g. from mocker.calibrate); empty = defaults
    tick_s: float = 0.05  # real seconds of engine iterations per wake-up (token streaming granularity)
    host: str = "127.0.0.1"
    port: int = 0  # first port (worker i gets port + i); 0 = any free port
    etcd: str = ""  # etcd endpoints host:port[,host:port]; empty = no registration
    namespace: str = "default"
    lease_ttl_s: float = 10.0
    tls_cert: str = ""  # PEM certificate naming roles "decode" and "prefill" (common/tls.py); with --tls-key, --tls-ca
    tls_key: str = ""  # its private key
    tls_ca: str = ""  # the cluster CA

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)

    def __post_init__(self) -> None:
        TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)  # fails naming the flags when only some are set
        check_etcd_tls(self.etcd, self.tls_cert)
        for name in ("num_workers", "block_size", "num_blocks", "chunk_size", "max_running"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.num_prefill < 0:
            raise ValueError(f"--num-prefill must be >= 0, got {self.num_prefill}")
        if self.speedup <= 0 or self.tick_s <= 0:
            raise ValueError("--speedup and --tick must be > 0")
        validate_listen_port(self.port)
        last = self.port + self.num_workers + self.num_prefill - 1  # worker i listens on port + i
        if self.port and last > 65535:
            raise ValueError(f"--port {self.port} with {self.num_workers + self.num_prefill} simulated workers "
                             f"(one port each, from --port up) would need port {last}, past 65535: give a lower "
                             f"--port, or 0 for any free ports")

    def timing_model(self) -> TimingModel:
        """The timing model with this run's speedup. Raises ValueError for a bad --timing file."""
        if self.timing:
            return TimingModel.load(self.timing, speedup=self.speedup)
        return TimingModel(speedup=self.speedup)


@dataclass
class SimWorker:
    """One simulated worker: engine, driver, servicer, server, registration."""

    role: int
    instance_id: str
    engine: MockEngine
    driver: RealTimeDriver
    servicer: MockDecodeServicer | MockPrefillServicer
    server: RunningServer | None = None
    registration: object = None
    tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}" if self.server else ""


def _build(opts: MockerOptions, role: int, index: int, model: str, vocab: int, context: int,
           timing: TimingModel) -> SimWorker:
    kind = "decode" if role == discovery_pb2.ROLE_DECODE else "prefill"
    iid = f"{kind}-mock{index:03d}-{uuid.uuid4().hex[:6]}"
    if tls.TLS is not None and tls.TLS.instance:  # SIM.NAME: covered by the certificate's *.NAME name
        iid = f"{iid}.{tls.TLS.instance}"
    engine = MockEngine(opts.num_blocks, opts.block_size, hash_seed(model), timing, opts.chunk_size, opts.max_running)
    driver = RealTimeDriver(engine, timing.speedup, opts.tick_s)
    if role == discovery_pb2.ROLE_DECODE:
        servicer = MockDecodeServicer(driver, vocab, context, agent_name=iid)
    else:
        servicer = MockPrefillServicer(driver, vocab, context)
    return SimWorker(role, iid, engine, driver, servicer)


async def _start(w: SimWorker, opts: MockerOptions, model: str, port: int) -> None:
    if w.role == discovery_pb2.ROLE_DECODE:
        name, methods = DECODE, DECODE_METHODS
    else:
        name, methods = PREFILL, {"Prefill": ("unary", prefill_pb2.PrefillRequest, prefill_pb2.PrefillResponse)}
    def load() -> kv_events_pb2.WorkerLoad:
        requests, held, queued = w.engine.load()
        return kv_events_pb2.WorkerLoad(requests=requests, active_blocks=held, queued_prefill_tokens=queued)

    events = KvEventServicer(w.engine.events, load)
    w.server = await start_server(
        f"{opts.host}:{port}",
        [lambda s: add_lenient_service(s, name, w.servicer, methods),
         lambda s: kv_events_pb2_grpc.add_KvEventServiceServicer_to_server(events, s)],
        [name, "tandem.v1.KvEventService"])
    w.tasks.append(asyncio.create_task(w.driver.run(), name=f"engine {w.instance_id}"))  # strong ref
    if opts.etcd:
        from discovery.registration import Registration
        inst = discovery_pb2.Instance(
            instance_id=w.instance_id, role=w.role, address=f"{opts.host}:{w.server.port}", model=model,
            block_size=opts.block_size, hash_seed=hash_seed(model), kv_capacity_blocks=opts.num_blocks,
            transfer_agent_name=w.instance_id, state=discovery_pb2.INSTANCE_STATE_SERVING,
            start_time_unix=time.time(), version=VERSION,
            prefill_seconds_per_token=w.engine.timing.prefill_per_token,
            decode_seconds_per_kv_token=w.engine.timing.decode_per_kv_token,
            decode_seconds_per_request=w.engine.timing.decode_per_request)
        w.registration = Registration(opts.etcd, opts.namespace, inst, ttl_seconds=opts.lease_ttl_s)
        await w.registration.start()


async def _stop(w: SimWorker) -> None:
    w.servicer.draining = True
    if w.server is not None:
        await w.server.set_serving(False)
    if w.registration is not None:
        await asyncio.shield(w.registration.stop())
    if w.server is not None:
        await w.server.stop(1.0)
    for t in w.tasks:
        t.cancel()
    await asyncio.gather(*w.tasks, return_exceptions=True)
    if isinstance(w.servicer, MockDecodeServicer):
        await w.servicer.close()


async def run(opts: MockerOptions, ready: Callable[[list[SimWorker]], None] | None = None,
              stop: asyncio.Event | None = None) -> None:
    """Serve every simulated worker until SIGTERM/SIGINT or `stop`; `ready(workers)` once serving.

    Raises:
        FileNotFoundError / ValueError: a bad --model or --timing.
    """
    model, config, _ = load_config(opts.model)
    timing = opts.timing_model()
    workers = [_build(opts, discovery_pb2.ROLE_DECODE, i, model, config.vocab_size, config.max_position_embeddings,
                      timing) for i in range(opts.num_workers)]
    workers += [_build(opts, discovery_pb2.ROLE_PREFILL, i, model, config.vocab_size,
                       config.max_position_embeddings, timing) for i in range(opts.num_prefill)]
    stop = stop or asyncio.Event()
    restore_signals = install_stop_signals(stop)
    try:
        for start in range(0, len(workers), 16):  # a few at a time: etcd and the loop stay responsive
            group = workers[start:start + 16]
            await asyncio.gather(*(_start(w, opts, model, opts.port + start + i if opts.port else 0)
                                   for i, w in enumerate(group)))
        log.info("mocker: %d decode + %d prefill simulated workers of %s (%d blocks of %d tokens each, "
                 "speedup %.1f) on ports %s", opts.num_workers, opts.num_prefill, model, opts.num_blocks,
                 opts.block_size, timing.speedup, ",".join(str(w.server.port) for w in workers[:4])
                 + (",..." if len(workers) > 4 else ""))
        if ready:
            ready(workers)
        await stop.wait()
    finally:
        restore_signals()
        await asyncio.gather(*(_stop(w) for w in workers), return_exceptions=True)
        log.info("mocker stopped")
