"""`tandem router`: the client-facing gRPC server, watching etcd for workers."""

from __future__ import annotations

import asyncio
import importlib
import logging
import math
import signal
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from common import metrics as metrics_http
from common.block_hash import hash_seed
from common.gc_pauses import freeze_startup_heap
from common.lifecycle import install_stop_signals
from common.grpc_server import (WILDCARDS, Keepalive, RunningServer, add_lenient_service, advertised_host,
                                record_address, set_keepalive, start_server, validate_listen_port)
from common.pb.tandem.v1 import discovery_pb2
from common.tls import TlsFiles
from common.pb.tandem.v1 import frontend_pb2 as pb
from common.tokenizer import load_tokenizer
from discovery.endpoints import check_etcd_tls
from discovery.registration import Registration
from discovery.watcher import InstanceWatcher
from engine.model_source import DEFAULT_MODEL, load_config
from common.version import VERSION
from router.api_keys import ApiKeyCheck, KeyRing
from router.approx_index import ApproxIndex, KvWithRecent
from router.health import HealthTracker
from router.http_port import HTTP_OFF
from router.http_port import validate_https
from router.http_port import validate_port as validate_http_port
from router.kv_index import KvIndex
from router.kv_subscriber import KvEventSubscriber
from router.load_watcher import LoadWatcher
from router.load import LoadTracker
from router.metrics import RouterMetrics
from router.placement import NoOverlap, Placement, PlacementOptions
from router.policy import MODES
from router.service import FrontendServicer
from router.stall import StallRule
from router.status import ClusterView
from router.workers import WorkerSet

log = logging.getLogger(__name__)
SERVICE = "tandem.v1.FrontendService"


@dataclass(frozen=True)
class RouterOptions:
    """Flags of `tandem router` (each has a TANDEM_* variable)."""

    etcd: str  # etcd endpoints host:port[,host:port] (required)
    model: str = DEFAULT_MODEL  # served model: tandem-shakespeare, tandem-tiny or a checkpoint folder (its tokenizer is used)
    block_size: int = 16  # must match the workers'
    host: str = "127.0.0.1"
    port: int = 0
    advertise_host: str = ""  # host workers and clients reach this router at (etcd record); "" = host
    namespace: str = "default"
    lease_ttl_s: float = 10.0
    gc_freeze: bool = True  # gc.freeze() the start-up heap once serving (common/gc_pauses.py)
    router_mode: str = "kv"  # kv | approx | round-robin | random | least-loaded
    prefill_weight: float = 0.0  # cost of one uncached block relative to one active decode block; 0 = derived
    router_temperature: float = 0.0  # 0 = lowest cost always wins
    local_prefill_threshold: int = 0  # tokens: prefill on the decode worker below this (0 = off)
    approx_ttl_s: float = 120.0  # approx mode: how long a routed block is assumed cached
    kv_recent_s: float = 0.0  # kv mode: also count prefixes routed in the last this many seconds (0 = off)
    load_reports: bool = True  # kv/approx: score workers on the load they report (WatchLoad), shared by replicas
    load_report_interval_s: float = 0.1  # how often each worker reports (a fleet of 1,000 workers: 1 s)
    migration_limit: int = 3  # decode-worker failures one request may survive (retries and migrations)
    health_interval_s: float = 1.0  # seconds between grpc.health.v1 probes of each worker
    health_timeout_s: float = 0.5  # seconds one probe may take
    health_failure_threshold: int = 3  # consecutive failures (probes or transport) that make a worker unhealthy
    metrics_port: int = -1  # Prometheus /metrics: -1 = off, 0 = any free port
    default_deadline_s: float = 600.0  # seconds: deadline of router → worker calls when the client sets none
    # A running stream silent for max(token_stall_timeout_s, token_stall_itl_factor × its worker's
    # observed ITL) → its worker failed (router/stall.py); token_stall_timeout_s 0 = off.
    token_stall_timeout_s: float = 30.0  # the floor, seconds (covers a retracted request's wait)
    token_stall_itl_factor: float = 50.0  # N of "no token for N × the expected ITL"; 0 = the floor alone
    keepalive_time_s: float = 10.0  # seconds between HTTP/2 keepalive PINGs on every channel to a worker
    keepalive_timeout_s: float = 5.0  # seconds a PING may go unanswered before the channel's calls fail
    http_port: int = -1  # OpenAI-compatible HTTP API (router/http_api.py): -1 = off, 0 = any free port
    http_host: str = ""  # address the HTTP API listens on; "" = --host
    http_tls_cert: str = ""  # PEM certificate (chain) the HTTP API serves HTTPS with; "" = plain HTTP
    http_tls_key: str = ""  # its private key
    reuse_port: bool = False  # share --port and --http-port with other routers of this host (SO_REUSEPORT)
    drain_timeout_s: float = 30.0  # on SIGTERM: let in-flight streams finish for at most this long
    tls_cert: str = ""  # PEM certificate naming role "router" (common/tls.py); with --tls-key and --tls-ca
    tls_key: str = ""  # its private key
    tls_ca: str = ""  # the cluster CA: workers' certificates must chain to it
    api_keys: str = ""  # TOML/JSON key file (router/api_keys.py): key -> tenant; "" = an open front

    @property
    def tls(self) -> TlsFiles:
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)

    def __post_init__(self) -> None:
        metrics_http.validate_port(self.metrics_port)
        check_etcd_tls(self.etcd, self.tls_cert)
        validate_http_port(self.http_port)
        if self.http_host.startswith("[") and self.http_host.endswith("]"):  # an IPv6 address as URLs write it
            object.__setattr__(self, "http_host", self.http_host[1:-1])
        validate_https(self.http_port, self.http_tls_cert, self.http_tls_key, self.http_host)
        validate_listen_port(self.port)
        if self.reuse_port and (self.port == 0 or self.http_port == 0):
            raise ValueError("--reuse-port shares a port with other routers: give a fixed --port and "
                             f"--http-port (or --http-port -1), got --port {self.port} --http-port {self.http_port}")
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if self.router_mode not in MODES:
            raise ValueError(f"--router-mode must be one of {', '.join(MODES)}; got {self.router_mode!r}")
        if not (math.isfinite(self.prefill_weight) and math.isfinite(self.router_temperature)):
            raise ValueError(f"--prefill-weight and --router-temperature must be finite numbers, got "
                             f"{self.prefill_weight} and {self.router_temperature}")
        if self.prefill_weight < 0 or self.router_temperature < 0 or self.local_prefill_threshold < 0:
            raise ValueError("--prefill-weight, --router-temperature and --local-prefill-threshold must be >= 0")
        if self.kv_recent_s < 0:
            raise ValueError(f"--kv-recent must be >= 0 seconds, got {self.kv_recent_s}")
        if not 0.01 <= self.load_report_interval_s <= 3600:
            raise ValueError(f"--load-report-interval must be between 0.01 and 3600 seconds, got "
                             f"{self.load_report_interval_s}")
        if self.approx_ttl_s <= 0:
            raise ValueError(f"--approx-ttl must be > 0 seconds, got {self.approx_ttl_s}")
        if self.health_interval_s <= 0 or self.health_timeout_s <= 0:
            raise ValueError(f"--health-interval and --health-timeout must be > 0 seconds, got "
                             f"{self.health_interval_s} and {self.health_timeout_s}")
        if self.health_failure_threshold < 1:
            raise ValueError(f"--health-failure-threshold must be >= 1, got {self.health_failure_threshold}")
        if self.default_deadline_s <= 0:
            raise ValueError(f"--default-deadline must be > 0 seconds, got {self.default_deadline_s}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"--drain-timeout must be >= 0 seconds, got {self.drain_timeout_s}")
        StallRule(self.token_stall_timeout_s, self.token_stall_itl_factor)  # fails naming the flag
        Keepalive(self.keepalive_time_s, self.keepalive_timeout_s)  # fails naming the flags
        if not self.etcd:
            raise ValueError("--etcd is required for the router (host:port of an etcd server)")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")
        advertised_host(self.host, self.advertise_host)  # fails early, naming the flag
        TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)  # fails naming the flags when only some are set


def overlap_source(opts: RouterOptions, workers: WorkerSet):
    """(overlap source, after-routing hook, membership hook, KV event subscriber) for the mode.

    The membership hook runs on every discovery change: kv mode subscribes to new workers'
    KV events and drops departed workers' blocks; approx mode forgets departed workers' guesses.
    """
    if opts.router_mode == "kv":
        index = KvIndex()
        subscriber = KvEventSubscriber(index, workers)
        if opts.kv_recent_s <= 0:
            return index, None, subscriber.sync, subscriber
        merged = KvWithRecent(index, opts.kv_recent_s)

        def record_routed(decision, hashes) -> None:
            for c in (decision.decode, decision.prefill):
                if c is not None and hashes:
                    merged.record(c.instance_id, hashes)

        def sync_and_forget() -> None:
            subscriber.sync()
            present = set(workers.instance_ids())
            for wid in list(merged.recent.workers()):
                if wid not in present:
                    merged.remove_worker(wid)

        return merged, record_routed, sync_and_forget, subscriber
    if opts.router_mode == "approx":
        approx = ApproxIndex(ttl_s=opts.approx_ttl_s)

        class Approx:
            def overlaps(self, hashes):
                return approx.overlaps(hashes, time.monotonic())

        def on_routed(decision, hashes) -> None:
            for c in (decision.decode, decision.prefill):
                if c is not None and hashes:
                    approx.record(c.instance_id, hashes, time.monotonic())

        def forget_departed() -> None:
            present = set(workers.instance_ids())
            for wid in list(approx.workers()):
                if wid not in present:
                    approx.remove_worker(wid)

        return Approx(), on_routed, forget_departed, None
    return NoOverlap(), None, None, None


async def _follow_membership(watcher: InstanceWatcher, on_change) -> None:
    """Call on_change() now and after every discovery change."""
    if on_change is None:
        return
    on_change()
    async for _ in watcher.events(replay=False):
        on_change()


def front_ready(servicer: FrontendServicer) -> bool:
    """Whether this router can serve a Generate now: a decode worker is a candidate (in
    discovery, healthy, not set aside; the HTTP API's /health answers 503 without one) and the
    router is not draining. `tandem.v1.FrontendService`'s grpc.health.v1 status is gated on it at
    every Check (common/grpc_server.py GatedHealth), while the whole server's ("") stays the
    process's, SERVING until the drain: a readiness probe checks the service (`tandem health ADDR
    --service tandem.v1.FrontendService`), a liveness probe the server, so a router whose decode
    workers are all down leaves a load balancer and is not restarted."""
    return not servicer.draining and bool(servicer.workers.candidates(discovery_pb2.ROLE_DECODE))


async def drain(servicer: FrontendServicer, server: RunningServer, registration: Registration,
                instance: discovery_pb2.Instance, timeout_s: float) -> None:
    """The drain stage, as a worker's (worker/host.py `drain`): refuse new Generate calls with
    UNAVAILABLE, report NOT_SERVING, mark the etcd record DRAINING, and let the streams in
    flight finish for at most `timeout_s`. Health probes, discovery and migration keep running
    meanwhile, so a stream whose decode worker fails during the drain still migrates. The
    signal handlers stay installed: a second SIGTERM exits at once (common/lifecycle.py)."""
    servicer.draining = True
    await server.set_serving(False)
    draining = discovery_pb2.Instance()
    draining.CopyFrom(instance)
    draining.state = discovery_pb2.INSTANCE_STATE_DRAINING
    try:
        await registration.update(draining)
    except Exception as exc:  # noqa: BLE001 - etcd down: the health status and the refusals still hold
        log.warning("could not mark router %s DRAINING in etcd: %s", instance.instance_id, exc)
    log.info("router %s draining: %d streams in flight", instance.instance_id, servicer.running)
    if not await servicer.wait_idle(timeout_s):
        log.warning("router %s: drain timeout (%.0f s) with %d streams still in flight; cutting them",
                    instance.instance_id, timeout_s, servicer.running)


def _reload(keys: KeyRing | None, https: Any) -> None:
    """SIGHUP: load the API key file (`keys`) and the HTTP API's certificate and key (`https`,
    router.http_api.HttpServer) again; what fails to load is logged and the old one stays."""
    if keys is not None:
        keys.reload()
    if https is not None:
        try:
            https.reload_certificate()
            log.info("SIGHUP: HTTPS certificate loaded again from %s", https.tls_cert)
        except ValueError as exc:
            log.error("SIGHUP: HTTPS certificate kept: %s", exc)
    if keys is None and https is None:
        log.info("SIGHUP: nothing to reload (no --api-keys, no --http-tls-cert)")


def _http_record(http_server, opts: RouterOptions, address: str) -> str:
    """host:port of the HTTP API for the router's discovery record ("" when off): where clients
    reach it, not what it bound. A specific --http-host is its own address; an API listening on
    every interface (--http-host, or --host, 0.0.0.0 or ::) is reached at the gRPC record's host
    (`address`: --advertise-host, or the hostname's address), which a bound "0.0.0.0" is not, and
    which is the name an HTTPS certificate for this router carries; an IPv4-only API (0.0.0.0)
    beside an IPv6 record takes the hostname's address, or 127.0.0.1."""
    if http_server is None:
        return ""
    bound = opts.http_host or opts.host
    host = advertised_host(bound) if bound not in WILDCARDS else address.rpartition(":")[0]
    if bound == "0.0.0.0" and host.startswith("["):  # an IPv4 socket is not reached at an IPv6 record
        try:
            host = advertised_host(bound)  # the hostname's (IPv4) address
        except ValueError:
            host = "127.0.0.1"
    return f"{host}:{http_server.address.rpartition(':')[2]}"


def _on_sighup(callback: Callable[[], object]) -> bool:
    """Call `callback` on SIGHUP; False where that cannot be (not the main thread, e.g. a router
    inside a test process, or no signals on this platform)."""
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, callback)
    except (ValueError, RuntimeError, NotImplementedError, AttributeError):
        return False
    return True


async def run(opts: RouterOptions, ready: Callable[[RunningServer, FrontendServicer], None] | None = None,
              stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT or `stop`; `ready(server, servicer)` is called once serving."""
    name, config, ckpt = load_config(opts.model)
    keys = KeyRing(opts.api_keys) if opts.api_keys else None  # a bad file fails here, naming --api-keys
    set_keepalive(Keepalive(opts.keepalive_time_s, opts.keepalive_timeout_s))
    watcher = InstanceWatcher(opts.etcd, opts.namespace)
    await watcher.start()
    workers = WorkerSet(watcher, name, opts.block_size, hash_seed(name))
    health = workers.health = HealthTracker(workers, opts.health_interval_s, opts.health_timeout_s,
                                            opts.health_failure_threshold)
    load = LoadTracker(opts.block_size)
    overlap, on_routed, on_membership, subscriber = overlap_source(opts, workers)
    load_watcher = LoadWatcher(load, workers, interval_ms=round(opts.load_report_interval_s * 1000)) \
        if opts.load_reports and opts.router_mode in ("kv", "approx") else None
    placement = Placement(workers, load, overlap, PlacementOptions(
        opts.router_mode, opts.prefill_weight, opts.router_temperature, opts.local_prefill_threshold))
    metrics = RouterMetrics()
    servicer = FrontendServicer(workers, placement, load, load_tokenizer(ckpt), config.vocab_size,
                                config.max_position_embeddings, on_routed=on_routed, metrics=metrics)
    servicer.migration_limit = opts.migration_limit
    servicer.default_deadline_s = opts.default_deadline_s
    servicer.stall = StallRule(opts.token_stall_timeout_s, opts.token_stall_itl_factor)
    health.on_unhealthy = servicer.worker_unhealthy
    health.on_healthy = servicer.move_stranded

    def on_change() -> None:
        if on_membership is not None:
            on_membership()  # KV subscriptions first: a departed worker's stream ends before its channel closes
        if load_watcher is not None:
            load_watcher.sync()
        servicer.on_membership()

    membership = asyncio.create_task(_follow_membership(watcher, on_change), name="membership")  # strong ref
    methods = {"Generate": ("stream", pb.GenerateRequest, pb.GenerateResponse),
               "ListModels": ("unary", pb.ListModelsRequest, pb.ListModelsResponse),
               "ExplainRoute": ("unary", pb.GenerateRequest, pb.ExplainRouteResponse),
               "ClusterStatus": ("unary", pb.ClusterStatusRequest, pb.ClusterStatusResponse)}
    if opts.gc_freeze:  # the tokenizer, tables and imports, before any server takes a request
        if opts.http_port != HTTP_OFF:
            importlib.import_module("router.http_api")  # the HTTP stack's imports are start-up state too
        freeze_startup_heap()
    server = await start_server(f"{opts.host}:{opts.port}", [lambda s: add_lenient_service(s, SERVICE, servicer, methods)],
                                [SERVICE], internal=False,  # clients are not cluster processes: certificates optional
                                interceptors=[ApiKeyCheck(keys)] if keys else (), reuse_port=opts.reuse_port,
                                health_gates={SERVICE: lambda: front_ready(servicer)})
    address = record_address(opts.host, opts.advertise_host, server.port)
    instance_id = f"router-{uuid.uuid4().hex[:12]}"
    index = overlap if isinstance(overlap, KvIndex) else None
    metrics.bind(servicer, workers, load, health, subscriber, index)
    metrics.collector.loop = asyncio.get_running_loop()
    try:
        metrics_server = metrics_http.serve(metrics.registry, opts.host, opts.metrics_port, instance_id)
    except OSError:
        await server.stop(0)  # nothing was served yet; leave no server behind
        raise
    metrics_address = metrics_server.address if metrics_server else ""
    http_server = frontend = None
    if opts.http_port != HTTP_OFF:
        from router.chat_template import load_chat_template  # the HTTP stack only when it is on
        from router.http_api import HttpServer, OpenAIFrontend, create_app
        try:
            frontend = OpenAIFrontend(servicer, load_chat_template(ckpt), metrics.registry, keys)
            http_server = HttpServer(create_app(frontend), opts.http_host or opts.host, opts.http_port,
                                     reuse_port=opts.reuse_port, tls_cert=opts.http_tls_cert, tls_key=opts.http_tls_key,
                                     host_flag="--http-host" if opts.http_host else "--host")
            await http_server.start()
        except (OSError, ValueError):
            await server.stop(0)  # as for --metrics-port: leave no server behind
            if metrics_server is not None:
                metrics_server.close()
            raise
        log.info("router OpenAI-compatible HTTP API at %s/v1", http_server.url)
    servicer.cluster_status = ClusterView(instance_id, opts.router_mode, servicer, workers, load, health, index,
                                          metrics_address)
    http_address = _http_record(http_server, opts, address)
    if http_server is not None:
        servicer.http_url = f"{http_server.scheme}://{http_address}"
    instance = discovery_pb2.Instance(
        instance_id=instance_id, role=discovery_pb2.ROLE_ROUTER, address=address, model=name,
        block_size=opts.block_size, hash_seed=hash_seed(name), state=discovery_pb2.INSTANCE_STATE_SERVING,
        start_time_unix=time.time(), version=VERSION, metrics_address=metrics_address, http_address=http_address)
    registration = Registration(opts.etcd, opts.namespace, instance, ttl_seconds=opts.lease_ttl_s)
    await registration.start()
    stop = stop or asyncio.Event()
    restore_signals = install_stop_signals(stop)
    # SIGHUP reloads what can be reloaded (the API keys, the HTTPS certificate); with neither it
    # is logged and ignored (by default it would kill the router, as a stray HUP from a closed
    # terminal or a `systemctl reload` did)
    reload_on_hup = _on_sighup(lambda: _reload(keys, http_server if opts.http_tls_cert else None))
    if keys is not None:
        log.info("router front needs API keys: %d loaded from %s%s", len(keys), opts.api_keys,
                 " (SIGHUP reloads them)" if reload_on_hup else "")
    health.start()  # here, so that the finally below always stops it
    log.info("router serving %s on %s", name, address)
    if ready:
        ready(server, servicer)
    try:
        await stop.wait()
        await drain(servicer, server, registration, instance, opts.drain_timeout_s)
    finally:
        restore_signals()
        if reload_on_hup:  # a SIGHUP while draining is ignored, not the default (an exit)
            asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP)
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
        log.info("%s", servicer.overhead_summary())
        if frontend is not None:
            log.info("%s", frontend.timings.summary())
        await server.set_serving(False)
        await asyncio.shield(registration.stop())
        if http_server is not None:
            await http_server.stop()
        await server.stop(2.0)
        if metrics_server is not None:
            await asyncio.to_thread(metrics_server.close)
        membership.cancel()
        await health.stop()
        if subscriber is not None:
            await subscriber.close()
        if load_watcher is not None:
            await load_watcher.close()
        servicer.sessions.close()
        await workers.close()
        await watcher.stop()
