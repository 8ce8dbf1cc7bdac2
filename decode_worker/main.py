"""`tandem decode`: a decode worker process (continuous batching, local prefill fallback)."""

from __future__ import annotations

import asyncio
from typing import Callable

from common.grpc_server import RunningServer, add_lenient_service
from common.pb.tandem.v1 import discovery_pb2
from decode_worker.scheduler import DecodeScheduler
from decode_worker.service import DecodeServicer
from discovery.watcher import InstanceEvent, InstanceWatcher
from engine.model_source import LoadedModel
from worker.host import WorkerOptions, WorkerRuntime, serve_worker
from worker.peers import PeerDirectory
from worker.session import DECODE_METHODS

SERVICE = "tandem.v1.DecodeService"


async def run(opts: WorkerOptions, ready: Callable[[RunningServer, WorkerRuntime], None] | None = None,
              stop: asyncio.Event | None = None, loaded: LoadedModel | None = None) -> None:
    """Serve a decode worker until SIGTERM/SIGINT or `stop`; `ready` is called once serving;
    `loaded` shares an already loaded model (tests run several workers in one process)."""
    engine = None
    if opts.ep_size > 1:  # --- EP hook: N rank processes form this worker (decode_worker/ep_ranks.py)
        from decode_worker.ep_ranks import ep_engine_factory
        engine = ep_engine_factory(own_model=loaded is None)
    runtime = WorkerRuntime(discovery_pb2.ROLE_DECODE, opts, loaded, engine=engine)
    scheduler = DecodeScheduler(runtime)
    runtime.metrics.running_fn = lambda: min(len(scheduler.running), opts.max_running)
    runtime.scheduler = scheduler  # capacity: admission and retraction state, for tests and metrics
    # The prefill workers in discovery are the only ones it dials (worker/peers.py); without
    # --etcd there are none, and a request naming one is refused.
    prefills = PeerDirectory(runtime.loaded.name, runtime.loaded.fingerprint)
    watcher = None
    if opts.etcd:
        def on_change(event: InstanceEvent) -> None:
            prefills.on_change(event)  # remembers who left (no discovery wait for them)
            if event.kind == "removed":  # no channel outlives its worker's record
                servicer.forget_prefill(event.instance.address)

        watcher = prefills.watcher = InstanceWatcher(opts.etcd, opts.namespace, on_change, component="prefill")
    servicer = DecodeServicer(runtime, scheduler, prefills)
    runtime.metrics.prefill_channels_fn = servicer.channel_count
    loop_task = asyncio.create_task(scheduler.run(), name="decode-loop")  # strong reference
    servers = []

    async def not_serving() -> None:
        for srv in servers:
            await srv.set_serving(False)

    scheduler.on_failure = not_serving

    def on_ready(srv: RunningServer) -> None:
        servers.append(srv)
        if ready:
            ready(srv, runtime)

    try:
        if watcher is not None:
            await watcher.start(timeout=None)
        await serve_worker(runtime, [lambda s: add_lenient_service(s, SERVICE, servicer, DECODE_METHODS)], [SERVICE],
                           ready=on_ready, stop=stop, before_stop=servicer.close_sessions)
    finally:
        loop_task.cancel()
        if watcher is not None:
            await watcher.stop()
        await servicer.close()
