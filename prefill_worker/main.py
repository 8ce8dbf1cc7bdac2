"""`tandem prefill`: a prefill worker process."""

from __future__ import annotations

import asyncio
from typing import Callable

from common.grpc_server import RunningServer, add_lenient_service
from common.pb.tandem.v1 import discovery_pb2
from common.pb.tandem.v1 import prefill_pb2 as pb
from discovery.watcher import InstanceEvent, InstanceWatcher
from engine.model_source import LoadedModel
from worker.host import WorkerOptions, WorkerRuntime, serve_worker
from worker.peers import PeerDirectory, transfer_agents
from prefill_worker.service import PrefillServicer

SERVICE = "tandem.v1.PrefillService"


async def run(opts: WorkerOptions, ready: Callable[[RunningServer, WorkerRuntime], None] | None = None,
              stop: asyncio.Event | None = None, loaded: LoadedModel | None = None) -> None:
    """Serve a prefill worker until SIGTERM/SIGINT or `stop`; `ready` is called once serving;
    `loaded` shares an already loaded model (tests run several workers in one process)."""
    # expert parallelism is a decode-worker runtime (docs/architecture.md, "Wide-EP decode")
    if opts.ep_size != 1:
        raise ValueError(f"--ep-size {opts.ep_size}: expert parallelism applies to decode workers only")
    runtime = WorkerRuntime(discovery_pb2.ROLE_PREFILL, opts, loaded)
    methods = {"Prefill": ("unary", pb.PrefillRequest, pb.PrefillResponse),
               "Abandon": ("unary", pb.AbandonRequest, pb.AbandonResponse)}
    watcher = None
    # The decode workers in discovery are the only destinations it writes into (worker/peers.py);
    # without --etcd there are none, and every Prefill call is refused.
    if opts.etcd:  # decode workers leaving discovery: drop their cached transfer metadata
        def on_change(event: InstanceEvent) -> None:
            servicer.decoders.on_change(event)  # remembers who left (no discovery wait for them)
            if event.kind == "removed":
                for name in transfer_agents(event.instance):  # one per EP rank on an EP decode worker
                    servicer.forget_peer(name)

        watcher = InstanceWatcher(opts.etcd, opts.namespace, on_change, component="decode")
    servicer = PrefillServicer(runtime, PeerDirectory(runtime.loaded.name, runtime.loaded.fingerprint, watcher))
    if watcher is not None:
        await watcher.start(timeout=None)
    try:
        await serve_worker(runtime, [lambda s: add_lenient_service(s, SERVICE, servicer, methods)], [SERVICE],
                           ready=(lambda srv: ready(srv, runtime)) if ready else None, stop=stop)
    finally:
        if watcher is not None:
            await watcher.stop()
