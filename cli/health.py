"""`tandem health [ADDRESS]`: one grpc.health.v1 Check, for container health checks and scripts.

Exit status 0 when the server answers SERVING, 1 otherwise (NOT_SERVING while draining or with
a wedged engine, unreachable, timed out, unknown service), with one line saying which. ADDRESS
defaults to --router, and without it to 127.0.0.1:PORT, PORT being this process's --port /
TANDEM_PORT, so inside a container that sets TANDEM_PORT the bare `tandem health` probes the
server next to it. TANDEM_ROUTER, which the router's clients read, is not read here: a shell or
container that exports it for them would otherwise send every check to the router.

A router's whole-server status says its process serves; whether it can serve a request now
(a decode worker in discovery and healthy) is its `tandem.v1.FrontendService` status, which a
readiness probe checks with `--service tandem.v1.FrontendService`. Without --service, a router
whose front is NOT_SERVING is still SERVING (exit 0: alive) and the line says so.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from cli.config import ConfigError, config_path, own_values, resolve, subparsers
from cli.flags import add_option, options_of


FRONT = "tandem.v1.FrontendService"  # the router's service (router/main.py SERVICE; not imported: torch)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("health", help="check a server's grpc.health.v1 status (exit 0 = SERVING)")
    p.add_argument("address", nargs="?", default="",
                   help="host:port (default: --router, else 127.0.0.1:--port)")
    # a plain flag, not an option with a TANDEM_ROUTER variable (see the module's docstring)
    p.add_argument("--router", default="", help="router address host:port, checked when no ADDRESS is given (a "
                   "router `tandem up --port` put elsewhere; TANDEM_ROUTER is not read here); empty = 127.0.0.1:--port")
    add_option(p, "--port", 50051, "port of the local server to check when no address is given")
    add_option(p, "--service", "", "service name to check ('' = the whole server)")
    add_option(p, "--health-timeout", 2.0, "seconds the check may take", name="health_timeout_s")
    add_option(p, "--tls-ca", "", "PEM certificate of the cluster CA (TLS; with --tls-cert and --tls-key for a "
               "worker, whose port takes only clients with a certificate); empty = plaintext")
    add_option(p, "--tls-cert", "", "PEM certificate issued by the cluster CA, naming a Tandem role")
    add_option(p, "--tls-key", "", "PEM private key of --tls-cert")
    p.set_defaults(func=run)


def check(address: str, service: str = "", timeout_s: float = 2.0, creds=None) -> tuple[bool, str]:
    """(serving?, status name or error) of one Check call, over TLS with `creds`
    (common.tls.TlsCredentials); never raises for RPC failures."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with (grpc.secure_channel(address, creds.channel()) if creds else grpc.insecure_channel(address)) as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=timeout_s)
        except grpc.RpcError as exc:
            return False, f"{exc.code().name}: {exc.details()}"
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, name


def _answered_in_text(status: str) -> bool:
    """Whether a failed check's status says the server answered in text, as an HTTP/1 server
    does: gRPC read its first bytes as an HTTP/2 frame header, whose type byte is then a letter
    of the reply ("Expected SETTINGS frame as the first frame, got frame type 79"; a TLS
    server's bytes give a type below 32)."""
    m = re.search(r"got frame type (\d+)", status)
    return m is not None and 65 <= int(m.group(1)) <= 122


def run(args: argparse.Namespace) -> int:
    from common.tls import TlsFiles

    from cli.client import check_port, local_ca_for

    if not 0 < args.health_timeout_s < float("inf"):  # (NaN too)
        raise ValueError(f"--health-timeout must be a finite number of seconds > 0, got {args.health_timeout_s}")
    address = args.address or args.router or f"127.0.0.1:{args.port}"
    flag, given = ("ADDRESS", "") if args.address else ("--router", "") if args.router else ("--port", str(args.port))
    check_port(address, flag, given)
    if not (args.address or args.router) and os.environ.get("TANDEM_ROUTER"):
        print(f"tandem health: TANDEM_ROUTER is not read here; checking {address} (pass --router "
              f"{os.environ['TANDEM_ROUTER']} to check the router)", file=sys.stderr)
    # like tandem generate: a local `tandem up` router is checked over its cluster's TLS
    ca = args.tls_ca or ("" if args.tls_cert else local_ca_for(address))
    files = TlsFiles(args.tls_cert, args.tls_key, ca, client=True)
    ok, status = check(address, args.service, args.health_timeout_s, files.load() if files.enabled else None)
    hint = ""
    if not ok and status.startswith("UNAVAILABLE") and "refused" in status.lower():
        # nothing listens there: TLS or not is beside the point
        hint = f"\n(nothing listens at {address}: is the server started, and on this port?)"
    elif not ok and status.startswith("UNAVAILABLE") and _answered_in_text(status):
        # something answered, in HTTP/1 (the router's HTTP API, a /metrics port): not a gRPC port
        hint = (f"\n(what listens at {address} answers in HTTP/1, not gRPC: the router's HTTP API or a metrics "
                "port? tandem health checks gRPC ports: the router's --port, a worker's)")
    elif not ok and status.startswith("UNAVAILABLE") and files.enabled and "handshake" in status.lower():
        hint = (f"\n(the TLS handshake failed: the server at {address} serves a certificate of another CA than "
                "--tls-ca, or serves plaintext)")
    elif not ok and status.startswith("UNAVAILABLE") and files.enabled and not args.tls_cert:
        # TLS with no client certificate: a worker's port closes such connections ("Socket closed")
        hint = ("\n(checked over TLS without a client certificate; a worker's port takes only clients with a "
                "certificate of the cluster CA: pass --tls-cert and --tls-key, e.g. a `tandem certs` client's)")
    elif not ok and status.startswith("UNAVAILABLE") and not files.enabled:
        hint = ("\n(checked in plaintext; a server that serves TLS answers nothing to it: pass --tls-ca, and for a "
                "worker's port --tls-cert and --tls-key too)")
    elif ok and not args.service:  # a router: say whether its front can serve now (the readiness check's)
        front_ok, front = check(address, FRONT, args.health_timeout_s, files.load() if files.enabled else None)
        if not front_ok and front == "NOT_SERVING":
            hint = (f" (the process; its {FRONT} is NOT_SERVING: no healthy decode worker, requests fail now; "
                    f"a readiness check passes --service {FRONT})")
    print(f"{address}{' ' + args.service if args.service else ''}: {status}{hint}",
          file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m cli.health`: the same check without importing the model code (torch), for a
    container HEALTHCHECK that runs every few seconds. Options come from flags, TANDEM_*
    variables and the config file (--config / TANDEM_CONFIG) as for `tandem health`; of the file,
    only this command's keys are read and checked (the top level's and [health]'s): the server
    beside it checks the whole file when it starts. A file or value that cannot be used, or TLS
    files that do not go together, is one line and exit status 1 (unhealthy)."""
    parser = argparse.ArgumentParser(prog="python -m cli.health")
    add_parser(parser.add_subparsers(dest="command", required=True))
    health = subparsers(parser)["health"]
    health.add_argument("--config", default=argparse.SUPPRESS, help="TOML config file (default: TANDEM_CONFIG)")
    args = parser.parse_args(["health", *(sys.argv[1:] if argv is None else argv)])
    options = options_of(health)
    try:
        path, _ = config_path(args)
        data = own_values(path, "health", options) if path else {}
        for name, r in resolve("health", options, args, path, data).items():
            setattr(args, name, r.value)
        return run(args)
    except (ConfigError, ValueError, OSError) as exc:  # bad TLS files or settings: unhealthy, one line
        print(f"python -m cli.health: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
