"""`tandem router`: the client-facing gRPC server, watching etcd for workers."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from common.block_hash import hash_seed
from common.lifecycle import install_stop_signals
from common.grpc_server import RunningServer, add_lenient_service, start_server
from common.pb.tandem.v1 import discovery_pb2
from common.pb.tandem.v1 import frontend_pb2 as pb
from common.tokenizer import load_tokenizer
from discovery.registration import Registration
from discovery.watcher import InstanceWatcher
from engine.model_source import TINY, load_config
from engine.worker_host import VERSION
from router.service import FrontendServicer
from router.workers import WorkerSet

log = logging.getLogger(__name__)
SERVICE = "tandem.v1.FrontendService"


@dataclass(frozen=True)
class RouterOptions:
    """Flags of `tandem router` (each has a TANDEM_* variable)."""

    etcd: str  # etcd endpoints host:port[,host:port] (required)
    model: str = TINY  # served model: TINY or a checkpoint folder (its tokenizer is used)
    block_size: int = 16  # must match the workers'
    host: str = "127.0.0.1"
    port: int = 0
    namespace: str = "default"
    lease_ttl_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.etcd:
            raise ValueError("--etcd is required for the router (host:port of an etcd server)")
        if self.block_size < 1:
            raise ValueError(f"--block-size must be >= 1, got {self.block_size}")


async def run(opts: RouterOptions, ready: Callable[[RunningServer, WorkerSet], None] | None = None,
              stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT or `stop`; `ready(server, workers)` is called once serving."""
    name, config, ckpt = load_config(opts.model)
    watcher = InstanceWatcher(opts.etcd, opts.namespace)
    await watcher.start()
    workers = WorkerSet(watcher, name, opts.block_size, hash_seed(name))
    servicer = FrontendServicer(workers, load_tokenizer(ckpt), config.vocab_size, config.max_position_embeddings)
    methods = {"Generate": ("stream", pb.GenerateRequest, pb.GenerateResponse),
               "ListModels": ("unary", pb.ListModelsRequest, pb.ListModelsResponse)}
    server = await start_server(f"{opts.host}:{opts.port}", [lambda s: add_lenient_service(s, SERVICE, servicer, methods)],
                                [SERVICE])
    address = f"{opts.host}:{server.port}"
    instance = discovery_pb2.Instance(
        instance_id=f"router-{uuid.uuid4().hex[:12]}", role=discovery_pb2.ROLE_ROUTER, address=address, model=name,
        block_size=opts.block_size, hash_seed=hash_seed(name), state=discovery_pb2.INSTANCE_STATE_SERVING,
        start_time_unix=time.time(), version=VERSION)
    registration = Registration(opts.etcd, opts.namespace, instance, ttl_seconds=opts.lease_ttl_s)
    await registration.start()
    stop = stop or asyncio.Event()
    restore_signals = install_stop_signals(stop)
    log.info("router serving %s on %s", name, address)
    if ready:
        ready(server, workers)
    try:
        await stop.wait()
    finally:
        restore_signals()
        await server.set_serving(False)
        await asyncio.shield(registration.stop())
        await server.stop(2.0)
        await workers.close()
        await watcher.stop()
