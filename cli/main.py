"""The `tandem` command: one subcommand per process, plus `up`, `generate` and `demo`."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

# The commands that are clients of a cluster (not its servers)
CLIENTS = ("generate", "explain", "bench", "top", "health", "config", "certs", "plan", "tokenize")
# gRPC's C core logs at INFO, e.g. a failed TLS handshake as an "I1206 ... ssl_transport_security"
# line before a client's own one-line error: a client logs its errors only, unless asked for more
# (servers keep gRPC's warnings: keepalive, GOAWAY). Read at gRPC's import, which is below.
_RUN_AS_TANDEM = __name__ == "__main__" or os.path.basename(sys.argv[0] if sys.argv else "") == "tandem"
if _RUN_AS_TANDEM and len(sys.argv) > 1 and sys.argv[1] in CLIENTS:  # (not a test importing this module)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from cli import certs, config, config_show, health  # noqa: E402 (after GRPC_VERBOSITY: they import grpc)
from cli.flags import (OTHER_ROLE_ONLY, add_flags, add_option, build, construct, name_sources, options_of,
                       refuse_other_role, where_from)
from cli.top import add_parser as add_top_parser
from common.gc_pauses import own_process
from common.version import VERSION

ROOT = Path(__file__).resolve().parent.parent  # the repository root: every process of `tandem up` runs there


def _router(args: argparse.Namespace) -> int:
    from common import tracing
    from common.tls import set_tls
    from router.main import RouterOptions, run
    tracing.setup("router")
    opts = build(RouterOptions, args)
    set_tls(opts.tls)
    own_process()  # the router's heap is frozen once it serves (--gc-freeze)
    asyncio.run(run(opts))
    return 0


def _worker(args: argparse.Namespace) -> int:
    from common import tracing
    from common.tls import set_tls
    from worker.host import WorkerOptions
    tracing.setup(args.command)
    opts = build(WorkerOptions, args)
    set_tls(opts.tls)
    # The model thread and the event loop hand the GIL to each other several times per decode
    # step (a torch call that lets it go must take it back); at Python's default 5 ms switch
    # interval a thread that wants it back (a finished CUDA event, a stream to write) can wait
    # that long behind the other, longer than a whole step on a GPU (--gil-switch-interval-us).
    sys.setswitchinterval(opts.gil_switch_interval_us / 1e6)
    own_process()  # the worker's heap is frozen once it serves (--gc-freeze)
    if args.command == "prefill":
        from prefill_worker.main import run
    else:
        from decode_worker.main import run
    asyncio.run(run(opts))
    return 0


# Options naming files: tandem up's processes run in the repository root, not where it was started
PATH_OPTIONS = ("tls_cert", "tls_key", "tls_ca", "http_tls_cert", "http_tls_key", "api_keys", "ep_placement", "profile_dir")


def _absolute_paths(args: argparse.Namespace, overridden: set[str]) -> None:
    """A relative file path a process of `tandem up` would read from a TANDEM_* variable is made
    absolute in this environment (which the processes inherit), as --config and --model are; one
    from the config file is refused (the file is shared, and rewritten by no one). `overridden`:
    options `tandem up` passes a flag of its own for, which the process never reads from there.

    Raises:
        ValueError: a relative path set in the config file, named.
    """
    for name in PATH_OPTIONS:
        if name in overridden:
            continue
        value = getattr(args, name, "")
        flag = "--" + name.replace("_", "-")
        source = getattr(args, "set_by", {}).get(flag, "")
        if not value or os.path.isabs(value) or not source:
            continue
        if source.startswith("env "):
            os.environ[source.removeprefix("env ")] = os.path.abspath(value)
            setattr(args, name, os.path.abspath(value))
        else:
            raise ValueError(f"{flag} {value} is a relative path, and the processes tandem up starts run in "
                             f"{ROOT}: give it as an absolute path (it came from {where_from(source)})")


def _elsewhere_hint(command: str, rest: list[str]) -> str:
    """For `tandem up`: the first unknown flag that is an option of the processes it starts, and
    how to give it to them (`tandem up --http-host` was a bare usage error)."""
    if command != "up":
        return ""
    for arg in rest:
        name = arg.split("=", 1)[0]
        if name in UP_GIVES:
            return f" ({name}: tandem up gives the processes it starts one of its own)"
        tables, found = [], None
        subs = config.subparsers(_every_option_parser())
        for role in ("router", "prefill", "decode"):
            sub = subs.get(role)
            opt = next((o for o in (options_of(sub) if sub is not None else []) if o.flag == name), None)
            if opt is not None:
                found = found or opt
                table = "worker" if role in ("prefill", "decode") else role
                tables += [] if table in tables else [table]
        if found is not None:
            return (f" ({name} is an option of the processes tandem up starts: give it as {found.env}=VALUE, or "
                    f"as {found.name} under {' or '.join(f'[{t}]' for t in tables)} in a --config file)")
    return ""


# what LocalCluster.spawn always passes (and --tls-* with TLS on, --metrics-port with --metrics)
UP_GIVES = ("--etcd", "--namespace", "--model", "--port", "--tls-cert", "--tls-key", "--tls-ca", "--metrics-port")


@functools.cache
def _every_option_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand with all its options, built once (tandem up's checks of its
    processes' values and variables each need it; building it imports every subcommand)."""
    return build_parser(full=True)


def _unknown_variables(names: list[str]) -> dict[str, str]:
    """The names among `names` (TANDEM_* variables) that no option of any subcommand reads ->
    the name, with the closest known one as a suggestion."""
    import difflib

    from common.env import TEST_INSTANCE_ID_VAR, TEST_STOP_AFTER_WRITES_VAR
    from common.lifecycle import LAUNCHER_ENV
    schema = config.Schema.of(_every_option_parser())
    known = {o.env for opts in (schema.top, *schema.commands.values()) for o in opts.values()}
    known |= {"TANDEM_CONFIG", LAUNCHER_ENV, TEST_INSTANCE_ID_VAR, TEST_STOP_AFTER_WRITES_VAR}
    out = {}
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
            out[name] = f"{name} (did you mean {close[0]}?)" if close else name
    return out


def _router_args(up: argparse.Namespace) -> list[str]:
    """The router flags of `tandem up`'s own options (LocalCluster's router_args)."""
    return ["--router-mode", up.router_mode] if up.router_mode else []


def _names_loopback(host: str) -> bool:
    """Whether host is one of the loopback names every cluster certificate carries
    (common.certs.LOOPBACK: localhost, 127.0.0.1, ::1), bracketed or not."""
    from common.certs import LOOPBACK
    return host.strip("[]") in LOOPBACK


class ProcessValues(NamedTuple):
    """What `_check_process_values` learns of the router's resolved options."""

    https: bool  # its HTTP API serves HTTPS
    hosts: tuple[str, ...]  # where it is reached beyond loopback: what `--https` certificates must name
    # an --https API on every interface whose certificate names loopback only (said once ready)
    loopback_names_only: bool = False


def _check_process_values(up: argparse.Namespace) -> ProcessValues:
    """Refuse a router or worker value `tandem up`'s processes would refuse (from a TANDEM_*
    variable or the config file), before etcd and the router start rather than when that process
    does, seconds later. Each role's options are resolved as its process will resolve them: the
    flags `tandem up` gives it (cluster.LocalCluster.spawn), then the variables, the file, the
    defaults. Returns ProcessValues: whether the routers' HTTP API will serve HTTPS, the hosts it
    is reached at beyond loopback (its bind and advertised addresses: what `--https` certificates
    must name), and whether such an API listens on every interface with loopback names only.

    Raises:
        ValueError: the flag named, where its value came from, and which processes.
    """
    from cli.cluster import metrics_flags, role_flags
    from common.grpc_server import WILDCARDS, advertised_host, unreachable_record
    from router.main import RouterOptions
    # etcd and certificates are `tandem up`'s, given to each process once they exist; so is the
    # router's --api-keys file (read when the cluster starts)
    outside = dict(etcd="127.0.0.1:2379", tls_cert="", tls_key="", tls_ca="")
    # replicas share a port LocalCluster picks when given 0 (1 stands for it: any fixed port)
    replicas = up.routers > 1
    roles = [("router", RouterOptions, role_flags("router", up.port or int(replicas), up.http_port or int(replicas),
                                                  replicas, extra=_router_args(up)))]
    if not up.mocker:
        from worker.host import WorkerOptions
        roles += [(role, WorkerOptions, role_flags(role)) for role, n in (("prefill", up.prefill),
                                                                          ("decode", up.decode)) if n > 0]
    roles = [(role, options, [*metrics_flags(role, up.metrics), *flags]) for role, options, flags in roles]
    https, hosts, loopback_only = up.https, (), False
    parser = _every_option_parser()
    # options tandem up passes a flag of its own for: never read from a variable or the file
    overridden = ({"tls_cert", "tls_key", "tls_ca"} if not up.insecure else set()) | (
        {"api_keys"} if up.api_keys else set()) | ({"http_tls_cert", "http_tls_key"} if up.https else set())
    for role, options, flags in roles:
        args = parser.parse_args([role, "--model", up.model, *flags])
        config.apply(parser, args)
        _absolute_paths(args, overridden)
        if role == "router" and up.https:  # --https gives each router its certificate
            args.http_tls_cert = args.http_tls_key = ""
        who = ("the routers" if up.routers > 1 else "the router") if role == "router" else f"the {role} workers"
        try:
            opts = construct(options, args, **outside)
        except ValueError as exc:
            raise ValueError(f"{who} would refuse it: {exc}") from None
        if unreachable_record(opts.host, opts.advertise_host):  # tandem up dials each at its record
            table = "router" if role == "router" else "worker"
            raise ValueError(f"{who} would not be reached: " + name_sources(
                f"--advertise-host {opts.advertise_host} with --host {opts.host}: it would listen on loopback only and "
                f"register {opts.advertise_host}, where this cluster's processes dial it and nothing answers; set its "
                f"host too (TANDEM_HOST=0.0.0.0, or host = \"0.0.0.0\" in the config file's [{table}]) or leave "
                "--advertise-host out", getattr(args, "set_by", {})))
        if role == "router":
            https = https or bool(opts.http_tls_cert)
            # the hosts it binds and records: a router on every interface records --advertise-host,
            # or the hostname's address (common.grpc_server.advertised_host), and so does its HTTP API
            recorded = advertised_host(opts.host, opts.advertise_host)
            hosts = tuple(dict.fromkeys(h.strip("[]") for h in (opts.http_host, opts.host, opts.advertise_host, recorded)
                                        if h and h not in WILDCARDS and not _names_loopback(h)))
            loopback_only = up.https and (opts.http_host or opts.host) in WILDCARDS and not hosts
    return ProcessValues(https, hosts, loopback_only)


def _pass_sighup(cluster) -> None:
    routers = [name for name, proc in cluster.procs.items() if name.startswith("router") and proc.poll() is None]
    for name in routers:
        cluster.procs[name].send_signal(signal.SIGHUP)
    if not routers:
        print("tandem up: SIGHUP: no router runs to pass it to", file=sys.stderr, flush=True)
        return
    print(f"tandem up: SIGHUP passed to {', '.join(routers)} (they load their API keys and HTTPS certificate "
          "again)", file=sys.stderr, flush=True)


async def _say_exits(cluster, every_s: float = 1.0) -> None:
    """While `tandem up` serves: say once of each process of the cluster that exits (killed, or
    failed), with its status and log, since its clients would only see fewer workers (or, for
    the router, none)."""
    said: set[str] = set()
    while True:
        await asyncio.sleep(every_s)
        for name, proc in list(cluster.procs.items()):
            if name not in said and proc.poll() is not None:
                said.add(name)
                print(f"tandem up: {name} exited (status {proc.returncode}); its log: "
                      f"{cluster.log_dir / (name + '.log')}; the others run on (Ctrl-C stops them). To run "
                      f"another in its place, start this by hand (Ctrl-C here will not stop it): "
                      f"{_command_of(proc, cluster.router_address)}", file=sys.stderr, flush=True)


def _command_of(proc, router_address: str = "") -> str:
    """The `tandem ROLE ...` command line a cluster process was started with (`python -m
    cli.main ROLE ...`, LocalCluster.spawn): its etcd, namespace, model and TLS files, so a
    process started from it joins the same cluster; a router's `--port 0` as the port the
    cluster's router serves (its clients' address), not another free one."""
    import shlex
    args = list(proc.args)
    if "cli.main" not in args:
        return shlex.join(args)
    args = args[args.index("cli.main") + 1:]
    if args[:1] == ["router"] and router_address and "--port" in args:
        at = args.index("--port") + 1
        if at < len(args) and args[at] == "0":
            args[at] = router_address.rsplit(":", 1)[1]
    return shlex.join(["tandem", *args])


def _up(args: argparse.Namespace) -> int:
    from cli.cluster import LocalCluster

    # SIGTERM during start-up stops what has started, as Ctrl-C does (its children run in
    # sessions of their own: killed with the launcher they would keep running); once the cluster
    # is ready the stop signals below drain it instead
    # and SIGINT too where it came ignored: a shell script's `tandem up &` starts with SIGINT
    # ignored (the shell's rule for background jobs), and `kill -INT` then did nothing until ready.
    # A signal while a clean-up runs (the first signal's, or a failed start's) kills what started,
    # as a second one does once serving: raised there, it cut the clean-up short and left etcd's
    # data and the CA key behind.
    starting: dict = {}

    def start_up_signal(signum: int, frame: object) -> None:
        cluster = starting.get("cluster")
        if not starting.get("stopping") and not (cluster is not None and cluster.stopping):
            starting["stopping"] = True
            task = starting.get("task")
            if task is None:  # before the event loop: nothing has started
                raise KeyboardInterrupt
            # cancelled at its next await, as asyncio.run's own Ctrl-C does, rather than raised
            # mid-statement: a KeyboardInterrupt inside a logging call can leave the handler's lock
            # held, and the clean-up's next log line then waits forever
            task.cancel()
            task.get_loop().call_soon_threadsafe(lambda: None)  # wakes the loop
            return
        if cluster is not None:
            cluster.forget_ca_key()
            cluster.kill()
            print(f"tandem up: killed during start-up; logs in {cluster.log_dir}", file=sys.stderr, flush=True)
        os._exit(130)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, start_up_signal)

    # the children read the same file; they run in the repository root, so a relative path
    # (--config or TANDEM_CONFIG) is made absolute here, where it was given
    config_file = getattr(args, "config", None) or os.environ.get("TANDEM_CONFIG")
    if config_file:
        os.environ["TANDEM_CONFIG"] = os.path.abspath(config_file)
    # what would stop every worker seconds after start: said now, before anything starts
    from common.grpc_server import validate_listen_port
    from router.http_port import validate_port as validate_http_port
    validate_listen_port(args.port)
    validate_http_port(args.http_port)
    if args.port and args.port == args.http_port:
        raise ValueError(f"--port and --http-port are both {args.port}: give the HTTP API another port (or -1: off)")
    from engine.model_source import MOCK, SHIPPED, TINY, missing_model
    if args.model not in ("", TINY, *SHIPPED) and not Path(args.model).is_absolute():
        # the processes run in the repository root: a folder relative to here is made absolute
        # (one relative to the repository root, which worked from anywhere before, still does)
        here = Path(args.model).resolve()
        args.model = str(here if here.exists() or not (ROOT / args.model).exists() else ROOT / args.model)
    if not args.mocker and (missing := missing_model(args.model)) is not None:
        raise missing
    if not args.mocker and args.model == MOCK:  # its workers would fail loading weights it has not got
        raise ValueError(f"--model {MOCK} has a config but no weights: it is served by simulated workers "
                         f"(add --mocker N)")

    if args.mocker and {"--prefill", "--decode"} & getattr(args, "given", set()):  # dropped without a word before
        raise ValueError(f"--mocker {args.mocker} starts simulated workers that each prefill and decode; "
                         "--prefill and --decode count real workers: leave them out (or --mocker)")
    values = _check_process_values(args)

    log_parent = Path(args.log_dir).expanduser() if args.log_dir else None
    if log_parent is not None:
        if log_parent.exists() and not log_parent.is_dir():
            raise ValueError(f"--log-dir {args.log_dir}: not a folder")
        log_parent.mkdir(parents=True, exist_ok=True)  # (an OSError names the path)

    async def main() -> None:
        starting["task"] = asyncio.current_task()
        # Children inherit the log settings through their TANDEM_* variables.
        os.environ.update(TANDEM_LOG_LEVEL=args.log_level, TANDEM_LOG_FORMAT=args.log_format)
        log_dir = tempfile.mkdtemp(prefix="tandem-up-", dir=log_parent) if log_parent is not None else None
        try:
            cluster = LocalCluster(model=args.model, num_prefill=args.prefill, num_decode=args.decode,
                                   etcd=args.etcd, log_dir=log_dir, router_port=args.port,
                                   router_args=_router_args(args),
                                   metrics=args.metrics, num_mocker=args.mocker, http_port=args.http_port,
                                   tls=not args.insecure, https=args.https, router_hosts=values.hosts,
                                   api_keys=args.api_keys, num_routers=args.routers,
                                   mocker_processes=args.mocker_processes, ready_timeout_s=args.ready_timeout,
                                   mps=args.mps, mps_prefill_percent=args.mps_prefill_percent,
                                   mps_prefill_priority=args.mps_prefill_priority, stop_with_launcher=True)
        except BaseException:  # its arguments refused: nothing started, nothing logged
            if log_dir is not None:
                os.rmdir(log_dir)
            raise
        starting["cluster"] = cluster
        cluster.http_scheme = "https" if values.https else "http"  # also by the router's own settings
        # settings a shell exported earlier (the README's mocker example) reach every process:
        # said here, since only a worker's log would show them otherwise
        from common.lifecycle import LAUNCHER_ENV
        inherited = sorted(k for k in os.environ if k.startswith("TANDEM_")
                           and k not in ("TANDEM_LOG_LEVEL", "TANDEM_LOG_FORMAT", "TANDEM_CONFIG", "TANDEM_LOG_DIR",
                                         LAUNCHER_ENV)
                           # (--insecure: spawn drops those; else every process takes this cluster's own
                           # --tls-* flags: a stale TANDEM_TLS_CA misleads only this shell's clients, below)
                           and not k.startswith("TANDEM_TLS_"))
        unknown = _unknown_variables(inherited)
        inherited = [k for k in inherited if k not in unknown]
        if inherited:  # names only: a value may be a secret
            print(f"tandem up: TANDEM_* variables of this shell apply to every process it starts (where it passes "
                  f"no flag of its own): {', '.join(inherited)}", file=sys.stderr, flush=True)
        if unknown:  # a misspelt one was listed above as if it applied
            print(f"tandem up: WARNING: no option reads {', '.join(unknown.values())}: ignored", file=sys.stderr,
                  flush=True)
        if args.insecure:
            print("tandem up: WARNING: --insecure: every gRPC port of this cluster serves plaintext with no "
                  "authentication; any local process can call the workers directly", file=sys.stderr, flush=True)
        try:
            await cluster.start()
        except BaseException as exc:  # a failed or interrupted start: its log folder is kept only with logs in it
            cluster.forget_ca_key()  # no process will need a certificate of this CA again
            if not any(p.suffix == ".log" for p in cluster.log_dir.rglob("*")):  # tls/ and mps/ alone: no logs
                shutil.rmtree(cluster.log_dir, ignore_errors=True)
            elif str(cluster.log_dir) not in str(exc):
                print(f"tandem up: stopped during start-up; logs in {cluster.log_dir}", file=sys.stderr, flush=True)
            raise
        local_ca, watch = None, None
        # from here on whatever happens (an error, a signal before the handlers below) stops the
        # cluster in order: its children, in sessions of their own, would otherwise stop only by
        # themselves (common.lifecycle.stop_with_launcher) once this process is gone
        try:
            routers = f"{args.routers} routers" if args.routers > 1 else "router"
            print(f"tandem up: {routers} at {cluster.router_address}, etcd at {cluster.etcd_endpoint}, "
                  f"logs in {cluster.log_dir}; Ctrl-C stops everything", flush=True)
            if args.routers > 1:
                print(f"  the {args.routers} routers share the port; the kernel spreads connections over them, so a "
                      "client uses them all when it opens several (tandem bench --connections N)", flush=True)

            from cli.client import LocalCaFile, local_ca_file
            router_port = int(cluster.router_address.rsplit(":", 1)[1])
            local_ca_file(router_port).unlink(missing_ok=True)  # a plaintext cluster, or one killed
            if cluster.ca is not None:
                # clients on this machine (generate, explain, bench) find it there for this port
                local_ca = LocalCaFile(router_port, Path(cluster.ca.ca_path).read_bytes())
                cluster.forget_ca_key()  # every certificate is issued
                print(f"  mutual TLS: CA and certificates in {cluster.ca.folder} (the CA's key is deleted); local "
                      f"clients of port {router_port} use it by themselves, others: export "
                      f"TANDEM_TLS_CA={cluster.ca.ca_path}", flush=True)
                exported = os.environ.get("TANDEM_TLS_CA", "")
                try:  # (a copy of this cluster's CA is this CA)
                    same = Path(exported).read_bytes() == Path(cluster.ca.ca_path).read_bytes()
                except OSError:
                    same = False
                if exported and not same:
                    # (an earlier run's export: clients read it before the local CA file)
                    print(f"tandem up: WARNING: this shell's TANDEM_TLS_CA ({exported}) is not this cluster's CA: "
                          f"clients started from it (tandem generate, bench, top) will fail the TLS handshake; "
                          f"export TANDEM_TLS_CA={cluster.ca.ca_path} or unset it", file=sys.stderr, flush=True)
            if cluster.http_address:
                trust = f" (trust {cluster.ca.ca_path}: curl --cacert FILE)" if args.https else ""
                print(f"  OpenAI-compatible HTTP API at {cluster.http_url}/v1{trust}", flush=True)
                if values.loopback_names_only:
                    print("  note: the HTTP API listens on every interface, but its certificate names loopback only "
                          "(localhost, 127.0.0.1, ::1): clients on other machines will fail to verify it. Give the "
                          "router the address they use (docs/security.md, \"HTTPS for the HTTP API\")", flush=True)
            for name, addr in cluster.metrics_addresses().items():
                print(f"  metrics: {name} at http://{addr}/metrics", flush=True)
            workers = (f"{args.mocker} simulated decode workers" if args.mocker else
                       f"{args.prefill} prefill and {args.decode} decode worker{'s' if args.decode != 1 else ''}")
            stop = asyncio.Event()  # before the ready line: a stop sent on seeing it drains, as later ones do
            from common.lifecycle import install_stop_signals
            install_stop_signals(stop, on_second=cluster.kill)
            # SIGHUP reloads the routers' API keys and HTTPS certificate: passed on to them (by
            # default it would end this process, and the cluster with it, without a word)
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, _pass_sighup, cluster)
            print(f"tandem up: ready to serve {cluster.model} ({workers})", flush=True)
            watch = asyncio.create_task(_say_exits(cluster), name="child-exits")
            await stop.wait()
        finally:
            if watch is not None:
                watch.cancel()
            print("stopping ...", flush=True)
            await cluster.stop()
            if local_ca is not None:
                local_ca.close()

    from cli.client import PortBusy, PortLock
    try:  # a fixed port: claimed before anything starts (--port 0 gets a port no one else has)
        port_lock = PortLock(args.port) if args.port else None
    except (PortBusy, PermissionError) as exc:
        print(f"tandem up: {exc}", file=sys.stderr)
        return 1
    try:
        asyncio.run(main())
    except asyncio.CancelledError:
        if not starting.get("stopping"):
            raise
        raise KeyboardInterrupt from None  # a stop signal during start-up: status 130
    finally:
        if port_lock is not None:
            port_lock.close()
    return 0


def _sampling_seed(seed: int | None) -> int | None:
    """--seed as the request's uint64 (protobuf's own refusal named no flag). Raises ValueError."""
    if seed is not None and not 0 <= seed < 2 ** 64:
        raise ValueError(f"--seed must be in 0..2^64-1, got {seed}")
    return seed


def _generate(args: argparse.Namespace) -> int:
    import grpc

    from cli.client import client_credentials, flag_named, frontend_stub, generate, no_router_hint
    from common import tracing

    tracing.setup("client")  # with OTEL_EXPORTER_OTLP_ENDPOINT set, the request's trace starts here
    creds = client_credentials(args)
    if args.temperature == 0:  # greedy: a seed or a nucleus changes nothing; say so rather than ignore it
        # (a top_p out of range is the router's error to name, not this note's)
        unused = [flag for flag, used in (("--seed (TANDEM_SAMPLING_SEED)", args.sampling_seed is not None),
                                          ("--top-p", 0 < args.top_p < 1)) if used]
        if unused:
            print(f"tandem generate: {' and '.join(unused)} without --temperature > 0: greedy decoding, "
                  f"{'they change' if len(unused) > 1 else 'it changes'} nothing", file=sys.stderr)

    async def main() -> int:
        ch, stub = frontend_stub(args.router, creds, args.api_key)
        try:
            with tracing.span("tandem.client.generate"):
                trace_id = tracing.trace_id_hex()
                c = await generate(stub, text=args.prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                                   top_p=args.top_p, seed=_sampling_seed(args.sampling_seed), stop=args.stop,
                                   on_text=lambda t: print(t, end="", flush=True))
        except grpc.aio.AioRpcError as exc:
            hint = no_router_hint(exc, args.router, creds is not None)
            print(f"tandem generate: {exc.code().name}: {flag_named(exc.details() or '')}{hint}",
                  file=sys.stderr)
            return 1
        finally:
            await ch.close()
        print(flush=True)
        print(f"[{len(c.token_ids)} tokens, finish={c.finish_reason}, ttft={c.ttft_s * 1000:.0f} ms"
              + (f", trace {trace_id}]" if trace_id else "]"), file=sys.stderr)
        return 0

    return asyncio.run(main())


def _explain(args: argparse.Namespace) -> int:
    import grpc

    from cli.client import client_credentials, frontend_stub, no_router_hint
    from common.pb.tandem.v1 import frontend_pb2
    creds = client_credentials(args)

    async def main() -> int:
        ch, stub = frontend_stub(args.router, creds, args.api_key)
        try:
            resp = await stub.ExplainRoute(frontend_pb2.GenerateRequest(text=args.prompt), timeout=10)
        except grpc.aio.AioRpcError as exc:
            hint = no_router_hint(exc, args.router, creds is not None)
            print(f"tandem explain: {exc.code().name}: {exc.details()}{hint}",
                  file=sys.stderr)
            return 1
        finally:
            await ch.close()
        print(resp.text)
        return 0

    return asyncio.run(main())


def _arg(p: argparse.ArgumentParser, flag: str, default, help: str, kind=None, env: bool | str = True,
         **kw) -> None:
    """One option with a TANDEM_* variable and a config file key (cli/flags.py add_option);
    env names the variable when it is not TANDEM_<FLAG> (every option has one)."""
    add_option(p, flag, default, help, kind=kind, env=env if isinstance(env, str) else None, **kw)


def _client_tls_args(p: argparse.ArgumentParser) -> None:
    """--tls-ca, --tls-cert, --tls-key of a client of the router (cli/client.py client_credentials),
    and its --api-key (TANDEM_API_KEY)."""
    from cli.client import CLIENT_TLS_HELP
    for flag, text in CLIENT_TLS_HELP.items():
        _arg(p, flag, "", text)
    _arg(p, "--api-key", "", "API key sent as `authorization: Bearer <key>` (a router started with --api-keys)")


# Subcommands whose options come from modules that import torch or FastAPI: only the one being
# run gets them (so `tandem --help` and the light subcommands start in a fraction of a second).
HEAVY = {"router": "the client-facing router: gRPC, and the OpenAI-compatible HTTP API with --http-port",
         "prefill": "a prefill worker", "decode": "a decode worker",
         "mocker": "simulated workers (real block pool, KV events, timing model; no model)",
         "bench": "replay a trace or prompts against a router; report like sglang.bench_serving",
         "plan": "KV capacity table: pool, per-request KV, requests per GPU (docs/bench/capacity.md)"}
GLOBAL_WITH_VALUE = ("--log-level", "--log-format", "--config")


def command_of(argv: list[str]) -> str | None:
    """The subcommand named in argv (None for none, e.g. `tandem --help`)."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in GLOBAL_WITH_VALUE:
            skip = True
        elif not arg.startswith("-"):
            return arg
    return None


def build_parser(command: str | None = None, full: bool = True) -> argparse.ArgumentParser:
    """Every subcommand with its options; their values are filled in by cli/config.py apply().

    With full=False only `command` (of HEAVY) gets its options; the others are listed with
    their help line alone, and nothing heavy is imported for them."""
    def heavy(name: str) -> bool:
        """Whether to build `name`'s options; else add a stub subparser with its help."""
        if full or name == command:
            return True
        sub.add_parser(name, help=HEAVY[name])
        return False

    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving.")
    _arg(parser, "--log-level", "info", "level, and per component: 'info,router=debug,discovery=warning'")
    _arg(parser, "--log-format", "text", "text or json (one JSON object per line)")
    parser.add_argument("--config", default=argparse.SUPPRESS,
                        help="TOML config file (env TANDEM_CONFIG; precedence flag > env > file > default)")
    parser.add_argument("--version", action="version", version=f"tandem {VERSION}",
                        help="print the version every Tandem process reports, and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser = sub.add_parser

    def add_with_description(name: str, **kw) -> argparse.ArgumentParser:
        """sub.add_parser, whose help line (`tandem --help`) also opens the subcommand's own --help."""
        if kw.get("help") and kw.get("description") is None:
            kw["description"] = kw["help"][:1].upper() + kw["help"][1:] + "."
        return add_parser(name, **kw)
    sub.add_parser = add_with_description  # also for the modules that add their own (mocker, bench, ...)
    if heavy("router"):
        from router.main import RouterOptions
        p = sub.add_parser("router", help=HEAVY["router"])
        add_flags(p, RouterOptions)
        p.set_defaults(func=_router)
    for role in ("prefill", "decode"):
        if heavy(role):
            from worker.host import WorkerOptions
            p = sub.add_parser(role, help=HEAVY[role])
            add_flags(p, WorkerOptions, skip=OTHER_ROLE_ONLY[role])
            refuse_other_role(p, role)
            p.set_defaults(func=_worker)
    if heavy("mocker"):
        from mocker.main import add_parser as add_mocker
        add_mocker(sub)
    if heavy("bench"):
        from bench.main import add_parser as add_bench
        add_bench(sub)
    p = sub.add_parser("up", help="a local cluster: etcd, router, prefill and decode workers")
    _arg(p, "--model", "tandem-shakespeare", "served model: 'tandem-shakespeare' (shipped, trained), 'tandem-tiny' (seeded) or a checkpoint folder")
    _arg(p, "--etcd", "", "use this etcd (host:port) instead of starting one")
    _arg(p, "--port", 50051, "router port")
    _arg(p, "--http-port", 8000, "router's OpenAI-compatible HTTP API port (-1 = off, 0 = any free port)")
    _arg(p, "--prefill", 1, "prefill workers")
    _arg(p, "--decode", 1, "decode workers")
    _arg(p, "--routers", 1, "router processes sharing --port and --http-port (router --reuse-port): clients' "
         "connections are spread over them; each places on the load the workers report")
    _arg(p, "--router-mode", "", "kv | approx | round-robin | random | least-loaded (empty: the router's own "
         "setting, from [router] in the config file or its default kv)")
    _arg(p, "--metrics", True, "serve /metrics from every process on a free port (--no-metrics: none)", kind=bool)
    _arg(p, "--mocker", 0, "simulated workers instead of real ones (tandem mocker; model tandem-mock)")
    _arg(p, "--mocker-processes", 1, "tandem mocker processes that host the --mocker workers between them "
         "(a fleet of hundreds needs several)")
    _arg(p, "--api-keys", "", "TOML or JSON file of API keys for the router (docs/security.md; it needs one "
         "admin key, which tandem up uses to see the router ready); empty = an open front")
    _arg(p, "--insecure", False, "no TLS: every process serves and dials gRPC in plaintext, unauthenticated "
         "(default: mutual TLS with a throw-away CA made at start-up)", kind=bool)
    _arg(p, "--https", False, "the HTTP API serves HTTPS with the router's certificate from that CA (clients "
         "trust its ca.pem, e.g. curl --cacert); default: plain HTTP", kind=bool)
    _arg(p, "--log-dir", "", "folder in which each run makes its own tandem-up-XXXX folder (every process's log, "
         "the cluster's etcd data and TLS files; kept after the run); empty = the system's temporary folder")
    _arg(p, "--ready-timeout", 120.0, "seconds to wait for every process to be ready before giving up (a "
         "16B-class checkpoint on a GPU loads, captures its graphs and compiles its kernels in a few minutes)")
    _arg(p, "--mps", False, "NVIDIA GPUs only: start a CUDA MPS (Multi-Process Service) control daemon for the "
         "workers, stopped with the cluster (needs nvidia-cuda-mps-control from the driver). The workers all use "
         "one GPU unless the config file gives each role a device; sharing it, they then run their kernels side by "
         "side instead of taking turns: under load (64 streams on one H200) lower TTFT and TPOT and more "
         "tokens/s; a lone stream's steps slower; off by default (docs/operations.md, 'Sharing one GPU between "
         "workers', has the measured trade-off)", kind=bool)
    _arg(p, "--mps-prefill-percent", None, "with --mps: the share (1-100) of the GPU's multiprocessors each "
         "prefill worker may occupy, leaving the rest to the decode steps, which stay uncapped "
         "(CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; 100 = no cap; unset = 50 with --mps)", kind=int)
    _arg(p, "--mps-prefill-priority", "below", "with --mps: 'below' gives the prefill workers' kernels a lower "
         "priority than the decode steps' where both wait for the GPU (CUDA_MPS_CLIENT_PRIORITY=1); 'normal' "
         "lets them compete as equals")
    p.set_defaults(func=_up)
    p = sub.add_parser("generate", help="send one prompt to a router and stream the answer")
    p.add_argument("prompt", help="prompt text")
    _arg(p, "--router", "127.0.0.1:50051", "router address host:port")
    _arg(p, "--max-tokens", 64, "tokens to generate")
    _arg(p, "--temperature", 0.0, "0 = greedy")
    _arg(p, "--top-p", 1.0, "nucleus sampling mass in (0, 1] (with --temperature > 0)")
    # Not `seed` / TANDEM_SEED: that is the workers' weight seed.
    _arg(p, "--seed", None, "sampling seed (with --temperature > 0)", kind=int, env="TANDEM_SAMPLING_SEED",
         name="sampling_seed")
    _arg(p, "--stop", None, "stop string", kind=list)
    _client_tls_args(p)
    p.set_defaults(func=_generate)
    p = sub.add_parser("explain", help="show where the router would place a prompt, and why")
    p.add_argument("prompt", help="prompt text")
    _arg(p, "--router", "127.0.0.1:50051", "router address host:port")
    _client_tls_args(p)
    p.set_defaults(func=_explain)
    health.add_parser(sub)
    certs.add_parser(sub)
    _client_tls_args(__import__("cli.tokens").tokens.register(sub))  # `tandem tokenize` (cli/tokens.py)
    _client_tls_args(add_top_parser(sub))
    p = sub.add_parser("config", help="print the effective configuration and where each value came from")
    p.add_argument("action", choices=["show"])
    p.add_argument("target", nargs="?", default=None, help="subcommand (default: every one)")
    if heavy("plan"):
        __import__("cli.plan").plan.register(sub)  # `tandem plan` (cli/plan.py)
    p = sub.add_parser("demo", help="the README demo: MT-Bench through a local cluster, checked against the reference",
                       add_help=False)
    p.set_defaults(func=None)
    for name, p in sub.choices.items():
        if name != "demo":  # demo forwards its flags to cli/demo.py
            p.add_argument("--config", default=argparse.SUPPRESS, help="TOML config file (env TANDEM_CONFIG)")
    return parser


def start_up_error(args: argparse.Namespace, exc: BaseException) -> str:
    """What `tandem COMMAND` prints when it fails to start: the error's text; for a worker that
    ran out of GPU memory, also a last line saying what to change (torch's message names sizes
    and its allocator's settings, not this worker's flags). The last line is the one `tandem up`
    quotes when a worker it started exits."""
    text = f"tandem {args.command}: {name_sources(str(exc), getattr(args, 'set_by', {}))}"
    if type(exc).__name__ != "OutOfMemoryError" or args.command not in ("prefill", "decode"):
        return text
    fraction = getattr(args, "mem_fraction_static", 0) or 0
    share = (f"--mem-fraction-static {fraction} of the GPU holds its weights and KV pool" if fraction
             else "its weights and KV pool (--num-blocks) come first")
    return (f"{text}\ntandem {args.command}: out of GPU memory while starting: {share}; activations, graphs "
            "and other processes share the rest. Lower --mem-fraction-static (workers sharing a GPU each need "
            "room beside it), or give each worker its own GPU")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command = command_of(argv)
    if command == "up" or (command in CLIENTS and signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
        # up: before its imports (a second), see _up. A client: a shell script's `tandem bench &`
        # starts with SIGINT ignored (the shell's rule for background jobs), so `kill -INT` and
        # the script's Ctrl-C did nothing. Servers keep the shell's rule.
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # `config show` and a config file (checked whole against every subcommand) need every option.
    uses_file = bool(os.environ.get("TANDEM_CONFIG")) or any(a == "--config" or a.startswith("--config=")
                                                             for a in argv)
    parser = build_parser(command, full=command == "config" or uses_file)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        try:
            from cli.demo import main as demo_main  # torch's import takes seconds: Ctrl-C may come now
        except KeyboardInterrupt:
            return 130
        return demo_main(rest)
    try:
        if args.command == "config":  # before apply: it reports given flags as flags
            return config_show.show(parser, args, rest)
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}{_elsewhere_hint(args.command, rest)}")
        config.apply(parser, args)
    except config.ConfigError as exc:
        print(f"tandem: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `tandem config show | head`
        return _stdout_gone()
    try:
        from common import logs
        logs.setup(args.log_level, args.log_format)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        if args.command not in CLIENTS:  # a server's broken pipe is an error like any other
            raise
        return _stdout_gone()
    except (OSError, RuntimeError, TimeoutError, ValueError) as exc:  # start-up failures: one line, no traceback
        logging.getLogger("tandem").debug("start-up failed", exc_info=True)
        print(start_up_error(args, exc), file=sys.stderr)
        return 1


def _stdout_gone() -> int:
    """A client whose stdout reader left (`tandem explain ... | head`): exit 1 with nothing more
    said (the exit's flush of stdout would raise again: it goes to /dev/null)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 1


if __name__ == "__main__":
    from common.lifecycle import stop_with_launcher
    stop_with_launcher()  # a process `tandem up` started stops when it is gone
    sys.exit(main())
