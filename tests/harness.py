"""An in-process cluster for end-to-end tests: a real etcd process, and the router and
workers as real gRPC servers on loopback, each on one event loop in a background thread,
with real KV transfers between the workers' pools (`--transfer-backend auto` picks `shm` in
one process; pass transfer_backend="nixl" for NIXL). Tests can inspect the workers' pools.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Coroutine

from common.pb.tandem.v1 import discovery_pb2
from engine.model_source import LoadedModel
from worker.host import WorkerOptions, WorkerRuntime


@dataclass
class Handle:
    """A running server: its address, gRPC server (health), runtime (workers), stop event and task."""

    role: str
    address: str = ""
    server: Any = None  # common.grpc_server.RunningServer
    runtime: WorkerRuntime | None = None
    workers: Any = None  # the router's WorkerSet
    servicer: Any = None  # the router's FrontendServicer
    http_address: str = ""  # the router's HTTP API (started with http_port=0), from its discovery record
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None


class InProcessCluster:
    def __init__(self, etcd: str, loaded: LoadedModel, namespace: str, worker_opts: WorkerOptions | None = None) -> None:
        self.etcd = etcd
        self.loaded = loaded
        self.namespace = namespace
        self.worker_opts = replace(worker_opts or WorkerOptions(num_blocks=512), etcd=etcd, namespace=namespace,
                                   model=loaded.name)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.handles: list[Handle] = []

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        fut: Future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return fut.result(timeout)

    def on_loop(self, fn, *args: Any) -> Any:
        """Run a plain function on the cluster's loop thread (pool accounting lives there)."""
        async def run() -> Any:
            return fn(*args)
        return self.call(run())

    async def _start(self, role: str, **overrides: Any) -> Handle:
        h = Handle(role)
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        if role == "router":
            from router.main import RouterOptions, run
            opts = RouterOptions(etcd=self.etcd, namespace=self.namespace, block_size=self.worker_opts.block_size,
                                 model=self.loaded.name,
                                 **overrides)
            h.task = asyncio.create_task(run(opts, ready=lambda s, w: ready.set_result((s, w)), stop=h.stop))
        else:
            run = __import__(f"{role}_worker.main", fromlist=["run"]).run
            opts = replace(self.worker_opts, **overrides)
            h.task = asyncio.create_task(run(opts, ready=lambda s, rt: ready.set_result((s, rt)), stop=h.stop,
                                             loaded=self.loaded))
        done, _ = await asyncio.wait([ready, h.task], return_when=asyncio.FIRST_COMPLETED)
        if h.task in done:
            h.task.result()  # raises the start-up error
        server, extra = ready.result()
        if role == "router":
            h.servicer, h.workers = extra, extra.workers
            h.http_address = await self._http_address(server.port)
        else:
            h.runtime = extra
        h.server = server
        h.address = f"127.0.0.1:{server.port}"
        self.handles.append(h)
        return h

    async def _http_address(self, grpc_port: int) -> str:
        """The HTTP address in the discovery record of the router serving gRPC on grpc_port."""
        from discovery.watcher import InstanceWatcher

        def mine(view: dict) -> list:
            return [i for i in view.values() if i.role == discovery_pb2.ROLE_ROUTER
                    and i.address.endswith(f":{grpc_port}")]

        async with InstanceWatcher(self.etcd, self.namespace) as watcher:
            view = await watcher.wait_for(lambda v: bool(mine(v)), timeout=10)
        return mine(view)[0].http_address

    def start(self, role: str, **overrides: Any) -> Handle:
        return self.call(self._start(role, **overrides))

    async def _stop(self, h: Handle) -> None:
        h.stop.set()
        await h.task

    def stop(self, h: Handle) -> None:
        self.call(self._stop(h))
        self.handles.remove(h)

    async def _wait_roles(self, router: Handle, prefill: int, decode: int, timeout: float) -> None:
        deadline = self.loop.time() + timeout
        while (len(router.workers.candidates(discovery_pb2.ROLE_PREFILL)) != prefill
               or len(router.workers.candidates(discovery_pb2.ROLE_DECODE)) != decode):
            if self.loop.time() > deadline:
                raise TimeoutError(f"router does not see {prefill} prefill and {decode} decode workers")
            await asyncio.sleep(0.05)

    def wait_roles(self, router: Handle, prefill: int, decode: int, timeout: float = 15.0) -> None:
        """Wait until the router's view holds exactly this many prefill and decode workers."""
        self.call(self._wait_roles(router, prefill, decode, timeout))

    def close(self) -> None:
        for h in list(reversed(self.handles)):
            self.stop(h)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def decode_locally(address: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Send prompts straight to a decode worker (no prefill worker named: it prefills them
    itself), concurrently, and return the greedy tokens of each."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from common.pb.tandem.v1 import decode_pb2, decode_pb2_grpc, sampling_pb2

    with grpc.insecure_channel(address) as ch:
        stub = decode_pb2_grpc.DecodeServiceStub(ch)

        def one(p: list[int]) -> list[int]:
            req = decode_pb2.DecodeRequest(request_id=f"local-{len(p)}", token_ids=p,
                                           sampling=sampling_pb2.SamplingParams(max_tokens=max_tokens))
            return [t for m in stub.Generate(req, timeout=120) for t in m.token_ids]

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(one, prompts))


def free_port() -> int:
    """A free loopback TCP port below the kernel's ephemeral range, for a server a test must
    start on a port it names: a port the kernel handed out for bind(0) and that was closed again
    can be handed to the next process that binds port 0 (a worker, etcd) before the test's
    server takes it."""
    import random
    import socket
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.sample(range(20000, max(20001, low)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port below the ephemeral range")


def wait_until(cond, what: str, timeout: float = 15.0) -> None:
    """Poll `cond()` every 20 ms until it is true; fail with `what` after `timeout` seconds."""
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.02)


def scrape_metrics(address: str) -> dict[str, float]:
    """The unlabelled samples of a worker's /metrics at `address` (host:port), by name."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples if not s.labels}


def serve_at_once(prompts: list[list[int]], max_tokens: int, **cluster_args: Any
                  ) -> tuple[list[Any], dict[int, dict[str, float]], dict[int, Any], dict[str, int | None]]:
    """Send every prompt at once through a local cluster of separate processes (`tandem up`'s
    `cli.cluster.LocalCluster(model=TINY, metrics=True, **cluster_args)`), greedy, max_tokens
    each. Returns the results, per worker role the /metrics samples (`scrape_metrics`) and the
    discovery record, and each process's exit code after the cluster stopped."""
    from cli.client import frontend_stub, generate
    from cli.cluster import LocalCluster
    from engine.model_source import TINY

    async def main():
        cluster = LocalCluster(model=TINY, metrics=True, **cluster_args)
        async with cluster:
            ch, stub = frontend_stub(cluster.router_address, cluster.client_tls)
            try:
                results = await asyncio.gather(*(generate(stub, token_ids=p, max_tokens=max_tokens, timeout_s=120)
                                                 for p in prompts))
            finally:
                await ch.close()
            records = {i.role: i for i in cluster.instances.values() if i.metrics_address}
            metrics = {role: await asyncio.to_thread(scrape_metrics, i.metrics_address) for role, i in records.items()}
        return results, metrics, records, {name: proc.returncode for name, proc in cluster.procs.items()}

    return asyncio.run(main())


def tandem_up(args: list[str], env: dict[str, str], **popen: Any) -> tuple[Any, str]:
    """Start `tandem up ARGS` (stdout and stderr together, text) and read its output until it says
    it is ready to serve, or exits. Returns (the process, what it printed so far)."""
    import subprocess
    import sys
    from pathlib import Path
    up = subprocess.Popen([sys.executable, "-m", "cli.main", "up", *args], cwd=Path(__file__).resolve().parent.parent,
                          env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, **popen)
    lines = []
    for line in up.stdout:
        lines.append(line)
        if "ready to serve" in line:
            break
    return up, "".join(lines)

