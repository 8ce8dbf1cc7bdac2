"""Start a grpc.aio server the way every Tandem process does.

Every server also serves grpc.health.v1 (overall status "" plus one entry per service) and
server reflection, following the grpc.aio examples (graceful shutdown with a bounded grace).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from dataclasses import dataclass
from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import tls, tracing

log = logging.getLogger(__name__)
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Keepalive:
    """HTTP/2 keepalive of every client channel: a PING every `time_s` seconds, with or without
    calls in flight; a peer that answers none within `timeout_s` seconds (a stopped process, a
    wedged or unplugged host: its kernel may still hold the TCP connection) fails the channel's
    calls with UNAVAILABLE. Servers accept PINGs as often as every MIN_PING_INTERVAL_S."""

    time_s: float = 10.0
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.time_s < MIN_PING_INTERVAL_S or self.timeout_s <= 0:
            raise ValueError(f"--keepalive-time must be >= {MIN_PING_INTERVAL_S} s and --keepalive-timeout > 0 s, "
                             f"got {self.time_s} and {self.timeout_s}")

    def options(self) -> list[tuple[str, int]]:
        # grpc.http2.ping_timeout_ms bounds the wait for a PING's ack too: without it grpc 1.85
        # waits its own 60 s default whatever keepalive_timeout says (measured: 70 s, not 15 s)
        return [("grpc.keepalive_time_ms", int(self.time_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(self.timeout_s * 1000)),
                ("grpc.http2.ping_timeout_ms", int(self.timeout_s * 1000)),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.max_pings_without_data", 0)]


MIN_PING_INTERVAL_S = 1.0  # servers accept client PINGs this often; must be <= every Keepalive.time_s
KEEPALIVE = Keepalive()  # set once per process by its main (the router's --keepalive-time/--keepalive-timeout)


def set_keepalive(keepalive: Keepalive) -> None:
    """Keepalive of the channels this process opens from now on."""
    global KEEPALIVE
    KEEPALIVE = keepalive


class GatedHealth(health.aio.HealthServicer):
    """grpc.health.v1 with, per named service, an optional gate read at every Check: a service
    whose stored status is SERVING answers NOT_SERVING while its gate says no (the router's
    front without a decode worker, router/main.py). Read at the call, not copied in by a poll,
    so a check right after the gate opens or closes already sees it. Watch streams follow the
    stored status alone (probes and `tandem health` use Check)."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[str, Callable[[], bool]] = {}

    async def Check(self, request: health_pb2.HealthCheckRequest, context) -> health_pb2.HealthCheckResponse:
        resp = await super().Check(request, context)
        gate = self.gates.get(request.service)
        if resp is not None and resp.status == health_pb2.HealthCheckResponse.SERVING and gate is not None \
                and not gate():
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return resp


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int
    health: GatedHealth
    service_names: tuple[str, ...]

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


def validate_listen_port(port: int, flag: str = "--port") -> None:
    """Raises ValueError naming `flag` unless port is 0 (any free port) or a TCP port 1..65535
    (the OS would take 99999 as 99999 mod 65536, and -1 as 65535)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"{flag} must be 0 (any free port) or a TCP port 1-65535, got {port}")


async def start_server(address: str, add_services: Sequence[Callable[[grpc.aio.Server], None]],
                       service_names: Sequence[str], internal: bool = True,
                       interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                       reuse_port: bool = False,
                       health_gates: dict[str, Callable[[], bool]] | None = None) -> RunningServer:
    """Bind `address` (host:port; port 0 picks a free one), add services, start serving.

    With TLS on (common/tls.py set_tls) an internal server (a worker's) takes only clients
    whose certificate chains to the cluster CA and names a role its services admit
    (tls.RoleCheck); `internal=False` (the router's frontend) serves TLS with client
    certificates optional. With TLS off it serves plaintext. `interceptors` run after those
    (the router's API key check, router/api_keys.py). `reuse_port`: bind with SO_REUSEPORT, so
    that several processes of this host serve one port and the kernel spreads new connections
    over them (router replicas: `tandem router --reuse-port`). `health_gates`: per service name, a
    function read at every health Check of that service (`GatedHealth`).

    Raises:
        OSError: the address could not be bound, naming --port and the OS's reason (a port in
            use, an address not of this machine).
    """
    creds = tls.TLS
    # Tracing interceptors exist only when tracing is on (common/tracing.py): off costs nothing.
    interceptors = [*(tracing.server_interceptors() or ()), *([tls.RoleCheck()] if creds and internal else []),
                    *interceptors]
    server = grpc.aio.server(interceptors=interceptors or None,
                             options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 1 if reuse_port else 0),
                                      # Answer clients' keepalive PINGs (Keepalive) instead of
                                      # closing the connection with "too many pings".
                                      ("grpc.keepalive_permit_without_calls", 1),
                                      ("grpc.http2.min_ping_interval_without_data_ms",
                                       int(MIN_PING_INTERVAL_S * 1000)),
                                      ("grpc.http2.max_ping_strikes", 0)])
    for add in add_services:
        add(server)
    health_servicer = GatedHealth()
    health_servicer.gates.update(health_gates or {})  # before the server starts: no check sees it ungated
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    try:
        port = server.add_secure_port(address, creds.server(internal)) if creds else server.add_insecure_port(address)
    except RuntimeError:  # grpc says only "Failed to bind"; the OS says why
        port = 0
    if port == 0:
        raise _bind_error(address)
    await server.start()
    running = RunningServer(server, port, health_servicer, tuple(service_names))
    await running.set_serving(True)
    return running


def _bind_error(address: str) -> OSError:
    """Why `address` (host:port) cannot be bound, from a plain socket bind, naming --port."""
    import errno
    import socket
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    reason = "gRPC could not bind it"
    code = errno.EADDRNOTAVAIL
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, int(port)))
    except OSError as exc:
        code, reason = exc.errno or code, exc.strerror or str(exc)
    except ValueError:
        pass
    return OSError(code, f"--port {port}: cannot listen on {address}: {reason} (another process has it? pick "
                         "another --port, or 0 for any free one)")


WILDCARDS = ("0.0.0.0", "::", "[::]", "")


def advertised_host(host: str, advertise_host: str = "") -> str:
    """The host other processes reach a server listening on `host` at (its etcd record).

    advertise_host when set; else host, unless host listens on every interface: then the
    address this machine's hostname resolves to (a container's or pod's own IP), which must
    not be a loopback address (Debian maps the hostname to 127.0.1.1 on bare hosts).

    An IPv6 literal comes back in brackets, ready for "host:port" (an IPv6 pod IP).

    Raises:
        ValueError: naming --advertise-host, when no usable address is known.
    """
    if advertise_host:
        return _bracketed(advertise_host)
    if host not in WILDCARDS:
        return _bracketed(host)
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        ip = ""
    if not ip or ipaddress.ip_address(ip).is_loopback:
        raise ValueError(f"--host {host!r} listens on every interface and this machine's hostname resolves to "
                         f"{ip or 'nothing'}; set --advertise-host to the address other processes reach this one at")
    return ip


def _addresses(host: str) -> set:
    """The IP addresses `host` (a literal, bracketed or not, or a name) stands for here; empty when
    a name does not resolve."""
    h = host.strip("[]")
    try:
        return {ipaddress.ip_address(h)}
    except ValueError:
        pass
    try:
        return {ipaddress.ip_address(info[4][0].split("%")[0]) for info in socket.getaddrinfo(h, None)}
    except (OSError, ValueError):
        return set()


def unreachable_record(host: str, advertise_host: str) -> bool:
    """Whether a server listening on `host` and registered at `advertise_host` cannot be reached
    there: it listens on loopback only (an address, or a name such as localhost that stands for
    loopback addresses only) and advertise_host stands for none of those addresses (another
    interface's IP, 127.0.0.2 for 127.0.0.1, ::1 for 127.0.0.1, a name resolving elsewhere or
    nowhere). Only a proxy on this machine that forwards to the loopback port would reach it.
    A server on a specific non-loopback interface may be reached through a NAT: not judged."""
    if not advertise_host or host in WILDCARDS:
        return False
    mine = _addresses(host)
    if not mine or not all(a.is_loopback for a in mine):
        return False
    return not mine & _addresses(advertise_host)


def record_address(host: str, advertise_host: str, port: int) -> str:
    """host:port of a server's discovery record (`advertised_host`), logging a warning when
    nothing listens there (`unreachable_record`: a loopback listener registered elsewhere)."""
    address = f"{advertised_host(host, advertise_host)}:{port}"
    if unreachable_record(host, advertise_host):
        log.warning("listening on %s (loopback) only, but registered at %s: whoever dials it there reaches it only "
                    "through a proxy on this machine that forwards to port %d; --host 0.0.0.0 (or --host %s) "
                    "listens where it is registered", host, address, port, advertise_host)
    return address


def _bracketed(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:  # a name, or already bracketed
        return host


def channel(address: str, creds: tls.TlsCredentials | None = None,
            interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
            server_name: str | None = None, own_connection: bool = False) -> grpc.aio.Channel:
    """A client channel with Tandem's message size limits and keepalive (KEEPALIVE), over
    mTLS with `creds` or else this process's (tls.TLS; None: plaintext); `interceptors` run
    after tracing's (a frontend client's API key, cli/client.py). With TLS and `server_name`
    the server's certificate is checked against that name instead of the address's host (a
    discovery record's instance: tls.instance_server_name). `own_connection`: a TCP connection
    of this channel's own, not one shared with this process's other channels to the same
    address (gRPC's global subchannel pool): router replicas on one port (SO_REUSEPORT) are
    reached by opening several."""
    creds = creds or tls.TLS
    # A restarted peer at the same address is reachable again within ~1 s, not after gRPC's
    # default reconnect back-off of up to 120 s.
    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.initial_reconnect_backoff_ms", 200),
               ("grpc.max_reconnect_backoff_ms", 1000),
               *KEEPALIVE.options(),
               *([("grpc.use_local_subchannel_pool", 1)] if own_connection else [])]
    chain = [*(tracing.client_interceptors() or ()), *interceptors] or None
    if creds is not None and server_name:
        options.append(("grpc.ssl_target_name_override", server_name))
    if creds is not None:
        return grpc.aio.secure_channel(address, creds.channel(), interceptors=chain, options=options)
    return grpc.aio.insecure_channel(address, interceptors=chain, options=options)


def add_lenient_service(server: grpc.aio.Server, service: str, servicer: object,
                        methods: dict[str, tuple[str, type, type]]) -> None:
    """Register `servicer`'s methods for `service` with lenient request parsing.

    Used instead of the generated add_*Servicer_to_server so that a request with invalid
    UTF-8 reaches the method as common.lenient_parse.Unparsable (answered INVALID_ARGUMENT
    with the field named) rather than failing inside grpc as INTERNAL.
    methods: name -> (kind, request class, response class), kind "unary", "stream"
    (server-streaming) or "bidi" (both directions streaming).
    """
    from common.lenient_parse import deserializer

    handlers = {}
    kinds = {"unary": grpc.unary_unary_rpc_method_handler, "stream": grpc.unary_stream_rpc_method_handler,
             "bidi": grpc.stream_stream_rpc_method_handler}
    for name, (kind, req_cls, resp_cls) in methods.items():
        make = kinds[kind]
        handlers[name] = make(getattr(servicer, name), request_deserializer=deserializer(req_cls),
                              response_serializer=resp_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
