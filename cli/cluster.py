"""`tandem up`: a whole local cluster on loopback — etcd (a child process, data in a
temporary folder, unless --etcd is given), the router, prefill and decode workers — each
worker its own process, all stopped cleanly together."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from cli.mps import CLIENT_VARS, MpsDaemon
from common.lifecycle import LAUNCHER_ENV
from common.pb.tandem.v1 import discovery_pb2
from discovery.etcd_server import EtcdServer
from discovery.watcher import InstanceWatcher
from engine.model_source import DEFAULT_MODEL

log = logging.getLogger(__name__)


def check_port_free(port: int, flag: str = "--port") -> None:
    """Raises OSError naming `flag` when a socket listens on loopback `port` (a fixed one) now.

    Said before anything starts: a router that cannot listen stops only seconds later."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # SO_REUSEADDR: connections of a stopped router left in TIME_WAIT do not count (the
    # routers bind with it too); without SO_REUSEPORT: fails while a socket listens there.
    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        probe.bind(("127.0.0.1", port))
    except OverflowError:  # out of 0-65535: the flag's own check says so
        raise ValueError(f"{flag} must be a TCP port 0-65535, got {port}") from None
    except OSError as exc:
        off = " (--http-port -1 turns the HTTP API off)" if flag == "--http-port" else ""
        raise OSError(f"{flag} {port} is in use ({exc.strerror}): another tandem up or router "
                      f"may be serving there; stop it or choose another port{off}") from None
    finally:
        probe.close()


def _hold_port(held: list[socket.socket], port: int = 0, flag: str = "--port") -> int:
    """A loopback port (0: a free one), held by a bound (not listening) SO_REUSEPORT socket
    appended to `held` until the caller closes it: router replicas bind it with SO_REUSEPORT
    meanwhile, and no other program can take it in between.

    Raises:
        OSError: naming `flag`, when something already uses a fixed `port`: replicas bind with
            SO_REUSEPORT, so they would otherwise join the listener there (another `tandem
            up --routers N`, say) and share its clients instead of failing.
    """
    if port:
        check_port_free(port, flag)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    if port:  # a fixed port may still have a stopped router's connections in TIME_WAIT
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    held.append(sock)
    return sock.getsockname()[1]


# The prefill workers' share of the GPU's SMs under `--mps` unless given: on one H200 (config S,
# 64 streams of 1K-token prompts, docs/benchmarks.md run 16) a cap of 50 % gave every one of
# four runs a lower TPOT, TTFT and higher throughput than the same call's runs without MPS,
# where no cap (100) had traded a slower TPOT for TTFT (run 13)
MPS_PREFILL_PERCENT = 50


def metrics_flags(role: str, metrics: bool) -> list[str]:
    """The metrics flag `LocalCluster` gives a process of `role` (simulated workers serve no /metrics)."""
    return ["--metrics-port", "0"] if metrics and role != "mocker" else []


def role_flags(role: str, port: int = 0, http_port: int = -1, replicas: bool = False, api_keys: str = "",
               extra: Sequence[str] = ()) -> list[str]:
    """The flags `LocalCluster` gives a process of `role` beyond --etcd, --namespace, --model, the
    metrics flag (`metrics_flags`) and its TLS files: a router its ports (port, http_port; with
    replicas --reuse-port) and --api-keys; a worker or mocker a free port. Then `extra`. `tandem
    up` resolves each process's options with these before starting anything
    (cli.main._check_process_values), so what it checks is what the spawn passes."""
    if role == "router":
        return ["--port", str(port), "--http-port", str(http_port), *(["--reuse-port"] if replicas else []),
                *(["--api-keys", api_keys] if api_keys else []), *extra]
    return ["--port", "0", *extra]


class LocalCluster:
    """Start with `await cluster.start()`, stop with `await cluster.stop()` (or `async with`).

    Args:
        worker_args: extra flags for every worker (e.g. ["--num-blocks", "512"]).
        router_args: extra flags for the router (e.g. ["--router-mode", "round-robin"]).
        router_port: 0 picks a free port; the chosen address is `router_address`.
        log_dir: where each process's log goes (a temporary folder by default).
        metrics: every process serves Prometheus /metrics on a free port (`metrics_addresses()`).
        http_port: the router's OpenAI-compatible HTTP API (-1 = off, 0 = a free port); its
            address is `http_address` once started.
        num_mocker: simulated decode workers (`tandem mocker`) instead of real workers; the
            model becomes tandem-mock unless another was given, and `mocker_args` go to every
            mocker process (e.g. ["--num-blocks", "256", "--speedup", "10"]).
        mocker_processes: how many `tandem mocker` processes host the num_mocker workers
            (split as evenly as possible; processes "mocker", "mocker-1", ...): a fleet of
            1,000 simulated workers needs several, and killing one is a host failure.
        tls: mutual TLS between every process (common/tls.py): a throw-away CA and one
            certificate per process in log_dir/tls; `ca` issues more (tests), `client_tls`
            is a frontend client's (`cli.client.frontend_stub(address, cluster.client_tls)`;
            it also reads etcd). The cluster's own etcd then serves TLS and takes only clients
            with a certificate of that CA (`etcd_endpoint` is https://...). False: plaintext.
        https: the routers' HTTP API serves HTTPS with each router's own certificate (needs tls;
            clients trust the cluster CA, log_dir/tls/ca.pem).
        router_hosts: addresses the routers are reached at beyond loopback (their --host,
            --http-host, --advertise-host from variables or the config file), which the routers'
            certificates name too.
        api_keys: the router's --api-keys file; it must hold an admin key (`admin_key`), which
            the readiness check uses. "" = an open front.
        num_routers: router processes (replicas) on the one router port and HTTP port
            (`--reuse-port`: the kernel spreads clients' connections over them; a client that
            opens several connections uses them all). Ready once every one of them can place a
            request on every worker. Processes "router", "router-1", ...
        mps: start a CUDA MPS control daemon for the workers (cli/mps.py; pipe and logs in
            log_dir/mps), so that workers sharing a GPU run their kernels side by side instead
            of taking turns; stopped after the workers. Raises cli.mps.MpsError from start()
            when the daemon cannot start.
        mps_prefill_percent: with mps, the share (1..100) of the GPU's multiprocessors each
            prefill worker's kernels may occupy (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE); 100 = no cap;
            None = MPS_PREFILL_PERCENT (50) with mps, nothing without.
        mps_prefill_priority: with mps, "below" (CUDA_MPS_CLIENT_PRIORITY=1: where both are ready
            the decode worker's kernels go first) or "normal" for the prefill workers.
        stop_with_launcher: the processes stop when this process is gone without stopping them
            (SIGKILL, the OOM killer): each router and worker drains and exits on its own
            (common.lifecycle.stop_with_launcher), the cluster's etcd takes SIGTERM from the
            kernel (Linux; PR_SET_PDEATHSIG). For `tandem up` and `tandem demo`, whose
            children run in sessions of their own; call start() from the main thread then.
    """

    def __init__(self, model: str = DEFAULT_MODEL, num_prefill: int = 1, num_decode: int = 1,
                 etcd: str = "", router_port: int = 0, namespace: str = "local",
                 worker_args: list[str] | None = None, router_args: list[str] | None = None,
                 log_dir: str | None = None,
                 ready_timeout_s: float = 120.0, metrics: bool = False, num_mocker: int = 0,
                 mocker_args: list[str] | None = None, http_port: int = -1, tls: bool = True, https: bool = False,
                 router_hosts: tuple[str, ...] = (),
                 api_keys: str = "", num_routers: int = 1, mocker_processes: int = 1, mps: bool = False,
                 mps_prefill_percent: int | None = None, mps_prefill_priority: str = "below",
                 stop_with_launcher: bool = False) -> None:
        if num_routers < 1:
            raise ValueError(f"--routers must be at least 1, got {num_routers}")
        if https and (not tls or http_port < 0):
            raise ValueError("--https serves the HTTP API with the routers' cluster certificates: it needs TLS "
                             "(not --insecure) and the HTTP API (not --http-port -1)")
        for flag, n in (("--prefill", num_prefill), ("--decode", num_decode), ("--mocker", num_mocker)):
            if n < 0:
                raise ValueError(f"{flag} must be >= 0, got {n}")
        if num_decode + num_mocker < 1:
            raise ValueError("--decode 0 leaves no decode worker: give --decode 1 or more (or --mocker N)")
        from common.grpc_server import validate_listen_port
        validate_listen_port(router_port)
        if not ready_timeout_s > 0:
            raise ValueError(f"--ready-timeout must be > 0 seconds, got {ready_timeout_s}")
        if mps_prefill_percent is not None and not mps:
            raise ValueError("--mps-prefill-percent caps the prefill worker under MPS: give --mps too")
        mps_prefill_percent = MPS_PREFILL_PERCENT if mps_prefill_percent is None else mps_prefill_percent
        if not 1 <= mps_prefill_percent <= 100:
            raise ValueError(f"--mps-prefill-percent must be between 1 and 100, got {mps_prefill_percent}")
        if mps_prefill_priority not in ("below", "normal"):
            raise ValueError(f"--mps-prefill-priority must be 'below' or 'normal', got {mps_prefill_priority!r}")
        if mps_prefill_priority != "below" and not mps:
            raise ValueError("--mps-prefill-priority sets the prefill worker's priority under MPS: give --mps too")
        if mps and num_mocker:
            raise ValueError("--mps is for workers on a GPU; --mocker runs simulated workers, which use none")
        if num_mocker and not 1 <= mocker_processes <= num_mocker:
            raise ValueError(f"--mocker-processes must be between 1 and --mocker ({num_mocker}), got "
                             f"{mocker_processes}")
        if num_mocker:
            from engine.model_source import MOCK
            model = MOCK if model in (DEFAULT_MODEL, "") else model
            num_prefill = num_decode = 0
        self.num_mocker = num_mocker
        self.mocker_processes = mocker_processes
        self.num_routers = num_routers
        self.mocker_args = mocker_args or []
        self.model = model
        self.num_prefill = num_prefill
        self.num_decode = num_decode
        self.namespace = namespace
        self.router_port = router_port
        self.worker_args = worker_args or []
        self.router_args = router_args or []
        # absolute: the children run in the repository root (and MPS clients find the daemon's pipe by it)
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="tandem-up-")).resolve()
        self.ready_timeout_s = ready_timeout_s
        self.metrics = metrics
        self.instances: dict[str, discovery_pb2.Instance] = {}  # discovery's view once ready
        self._etcd_endpoint = etcd
        self._etcd: EtcdServer | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.router_address = ""
        self.http_port = http_port
        self.http_address = ""  # host:port of the router's HTTP API; "" when off
        self.http_url = ""  # http(s)://host:port of it; "" when off
        self.http_scheme = "https" if https else "http"  # what the routers serve (their own settings may say https)
        self.tls = tls
        self.https = https
        self.stopping = False  # stop() has begun (tandem up: a signal then kills instead of interrupting it)
        self.router_hosts = router_hosts
        self.ca = None  # common.certs.LocalCa once started with tls
        self.client_tls = None  # common.tls.TlsCredentials of a frontend client (role "client")
        self.api_keys = str(Path(api_keys).resolve()) if api_keys else ""  # the children run in the repo root
        self.admin_key = ""  # an admin key of api_keys, once started
        self.mps = MpsDaemon(self.log_dir / "mps") if mps else None
        self.mps_prefill_percent = mps_prefill_percent
        self.mps_prefill_below_normal = mps_prefill_priority == "below"
        self.stop_with_launcher = stop_with_launcher

    def forget_ca_key(self) -> None:
        """Delete the throw-away CA's key file once every process has its certificate: it would only
        let whoever reads the log folder mint certificates this cluster trusts (`ca` keeps the key
        in memory, for tests that issue more)."""
        if self.ca is not None:
            (Path(self.ca.folder) / "ca-key.pem").unlink(missing_ok=True)

    @property
    def etcd_endpoint(self) -> str:
        return self._etcd_endpoint

    def spawn(self, name: str, role: str, *args: str) -> subprocess.Popen:
        """Start `tandem <role>` as a child process logging to log_dir/<name>.log."""
        # Explicit flags win over TANDEM_* variables the children inherit (TANDEM_PORT is the router's).
        cmd = [sys.executable, "-m", "cli.main", role, "--etcd", self._etcd_endpoint,
               "--namespace", self.namespace, "--model", self.model,
               *metrics_flags(role, self.metrics), *self._tls_args(name, role), *args]
        out = open(self.log_dir / f"{name}.log", "ab")
        # Without TLS no TANDEM_TLS_* of the caller's shell half-configures the children.
        env = {k: v for k, v in os.environ.items() if self.tls or not k.startswith("TANDEM_TLS_")}
        env["PYTHONUNBUFFERED"] = "1"
        env.pop(LAUNCHER_ENV, None)
        if self.stop_with_launcher:
            env[LAUNCHER_ENV] = str(os.getpid())
        if self.mps is not None and role in ("prefill", "decode"):
            for var in CLIENT_VARS:  # the caller's own cap or priority is not this cluster's
                env.pop(var, None)
            prefill = role == "prefill"
            env.update(self.mps.env(self.mps_prefill_percent if prefill else None,
                                    below_normal=prefill and self.mps_prefill_below_normal))
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=Path(__file__).resolve().parent.parent, start_new_session=True)
        out.close()
        self.procs[name] = proc
        return proc

    def _tls_args(self, name: str, role: str) -> list[str]:
        """--tls-cert/--tls-key/--tls-ca of a new certificate for this process (none without tls), and
        for a router with https the same certificate for its HTTP API."""
        if self.ca is None:
            return []
        roles = ("decode", "prefill") if role == "mocker" else (role,)  # simulated workers of both kinds
        from common.certs import LOOPBACK
        files = self.ca.issue(name, roles, hosts=LOOPBACK + (self.router_hosts if role == "router" else ()))
        https = ["--http-tls-cert", files.cert, "--http-tls-key", files.key] if self.https and role == "router" else []
        return ["--tls-cert", files.cert, "--tls-key", files.key, "--tls-ca", files.ca, *https]

    async def start(self) -> None:
        if self.num_routers == 1:  # one router: a fixed port in use fails here, before the CA or any process
            for port, flag in ((self.router_port, "--port"), (self.http_port, "--http-port")):
                if port > 0:
                    check_port_free(port, flag)
        if self.tls and self.ca is None:
            from common.certs import LocalCa
            self.ca = LocalCa(self.log_dir / "tls")
            self.client_tls = self.ca.issue("client", ("client",)).load()
        if self.api_keys:
            from router.api_keys import admin_key
            self.admin_key = admin_key(self.api_keys)  # a bad file fails before anything starts
        held: list[socket.socket] = []  # replicas: their ports are held (SO_REUSEPORT, not listening) until they bind
        router_port, http_port = self.router_port, self.http_port
        try:
            if self.num_routers > 1:  # before anything starts: a port in use fails here
                router_port = _hold_port(held, router_port, "--port")
                if http_port >= 0:
                    http_port = _hold_port(held, http_port, "--http-port")
            if self.mps is not None:
                await asyncio.to_thread(self.mps.start)  # up to seconds: Ctrl-C stays answered
            if not self._etcd_endpoint:
                # with TLS, etcd takes only clients with a certificate of the cluster CA (every
                # process here has one; --etcd is then https://...)
                self._etcd = EtcdServer(tls=self.ca.issue("etcd", ("etcd",)) if self.ca is not None else None,
                                        parent_dir=str(self.log_dir), stop_with_parent=self.stop_with_launcher)
                self._etcd.start()
                self._etcd_endpoint = self._etcd.endpoint
            for i in range(self.num_routers):
                self.spawn("router" if i == 0 else f"router-{i}", "router",
                           *role_flags("router", router_port, http_port, self.num_routers > 1, self.api_keys,
                                       self.router_args))
            self._spawn_workers()
            await self._wait_ready()
        except BaseException:
            # whatever started (etcd and its data folder, the processes, the MPS daemon) stops,
            # also when the failure or Ctrl-C came while etcd was starting or before a spawn
            await self.stop()  # idempotent
            raise
        finally:
            for sock in held:
                sock.close()

    def _spawn_workers(self) -> None:
        for i in range(self.num_prefill):
            self.spawn(f"prefill-{i}", "prefill", *role_flags("prefill", extra=self.worker_args))
        for i in range(self.num_decode):
            self.spawn(f"decode-{i}", "decode", *role_flags("decode", extra=self.worker_args))
        if self.num_mocker:
            per, extra = divmod(self.num_mocker, self.mocker_processes)
            for i in range(self.mocker_processes):
                self.spawn("mocker" if i == 0 else f"mocker-{i}", "mocker",
                           *role_flags("mocker", extra=["--num-workers", str(per + (i < extra)), *self.mocker_args]))

    def _last_line(self, name: str) -> str:
        """The last line a process wrote to its log (its one-line start-up error, if it had one)."""
        try:
            lines = (self.log_dir / f"{name}.log").read_text(errors="replace").strip().splitlines()
        except OSError:
            return "no log"
        if not lines:
            return "no output"
        # whole: a cut at a fixed length took the flag and path off the front of a long error
        return lines[-1] if len(lines[-1]) <= 1000 else "..." + lines[-1][-1000:]

    async def _wait_ready(self) -> None:
        want = {discovery_pb2.ROLE_ROUTER: self.num_routers, discovery_pb2.ROLE_PREFILL: self.num_prefill,
                discovery_pb2.ROLE_DECODE: self.num_decode + self.num_mocker}

        def ready(view: dict[str, discovery_pb2.Instance]) -> bool:
            return all(sum(1 for i in view.values() if i.role == r) >= n for r, n in want.items())

        async with InstanceWatcher(self._etcd_endpoint, self.namespace, tls=self.client_tls) as watcher:
            deadline = time.monotonic() + self.ready_timeout_s
            while True:
                dead = [n for n, p in self.procs.items() if p.poll() is not None]
                if dead:
                    why = "; ".join(f"{n}: {self._last_line(n)}" for n in dead)
                    raise RuntimeError(f"{', '.join(dead)} exited during start-up ({why}); see logs in {self.log_dir}")
                try:
                    view = await watcher.wait_for(ready, timeout=1.0)
                    break
                except (TimeoutError, asyncio.TimeoutError):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"cluster not ready in {self.ready_timeout_s} s; logs in {self.log_dir}")
        self.instances = dict(view)
        routers = [i for i in view.values() if i.role == discovery_pb2.ROLE_ROUTER]
        self.router_address, self.http_address = routers[0].address, routers[0].http_address
        if self.http_address:
            from router.http_port import url
            self.http_url = url(self.http_scheme, self.http_address)
        await self._wait_routers_see_workers({i.instance_id for i in routers}, deadline)

    async def _wait_routers_see_workers(self, routers: set[str], deadline: float) -> None:
        """Ready means every router itself can place a request on every worker (its own etcd
        watch may lag the one above). Each attempt opens a connection of its own, so that
        replicas on one port (SO_REUSEPORT) are reached in turn; a connection's router is the
        one its ClusterStatus names."""
        import grpc

        from cli.client import frontend_stub
        from common.pb.tandem.v1 import frontend_pb2

        want = self.num_prefill + self.num_decode + self.num_mocker
        seen: set[str] = set()
        while True:
            ch, stub = frontend_stub(self.router_address, self.client_tls, self.admin_key,
                                     own_connection=len(routers) > 1)
            async with ch:
                try:
                    status = await stub.ClusterStatus(frontend_pb2.ClusterStatusRequest(), timeout=5)
                    resp = await stub.ExplainRoute(frontend_pb2.GenerateRequest(token_ids=[1]), timeout=5)
                    if len(resp.candidates) >= want:
                        seen.add(status.router_instance_id)
                except grpc.aio.AioRpcError:
                    pass  # no decode worker in its view yet
            if routers <= seen:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(routers - seen)} of {len(routers)} routers do not see all {want} "
                                   f"workers; logs in {self.log_dir}")
            await asyncio.sleep(0.05 if not seen else 0.0)

    def metrics_addresses(self) -> dict[str, str]:
        """instance id -> host:port of its /metrics (the processes that serve one), router first."""
        insts = sorted(self.instances.values(), key=lambda i: (i.role != discovery_pb2.ROLE_ROUTER, i.role,
                                                                i.instance_id))
        return {i.instance_id: i.metrics_address for i in insts if i.metrics_address}

    def stop_process(self, name: str, sig: int | None = signal.SIGTERM, timeout_s: float = 15.0) -> int:
        """Signal one process (once; sig=None only waits) and wait for it, killing it after
        timeout_s; returns its exit code. A second SIGTERM would make a worker skip its drain."""
        proc = self.procs[name]
        if proc.poll() is None:
            if sig is not None:
                proc.send_signal(sig)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL every process and stop etcd now (a second Ctrl-C: no drain, nothing left over)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        if self._etcd is not None:
            self._etcd.stop()
            self._etcd = None
        if self.mps is not None:
            self.mps.stop()

    async def stop(self) -> None:
        """SIGTERM every process (workers first, then the router), then stop etcd."""
        self.stopping = True
        names = sorted(self.procs, key=lambda n: n.startswith("router"))
        for name in names:
            if self.procs[name].poll() is None:
                self.procs[name].send_signal(signal.SIGTERM)
        for name in names:
            await asyncio.to_thread(self.stop_process, name, None)
        if self._etcd is not None:
            self._etcd.stop()
            self._etcd = None
        if self.mps is not None:
            await asyncio.to_thread(self.mps.stop)  # after its clients, the workers, have exited

    async def __aenter__(self) -> LocalCluster:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
