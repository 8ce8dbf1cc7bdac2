"""Mutual TLS between Tandem processes, with grpc's own credentials (docs/security.md).

Every process of a cluster holds a certificate issued by the cluster CA that names its role
(ROLE_URI + role, a URI subject alternative name, e.g. "tandem://role/decode"; a process that
plays several roles, such as `tandem mocker`, has one such name per role), and the CA itself.

- Internal servers (prefill and decode workers, simulated workers) require a client
  certificate that chains to the CA (`require_client_auth=True`: the handshake refuses a
  plaintext client and one whose certificate another CA issued) and names a known role;
  RoleCheck then admits to each service only the roles that must call it (SERVICE_ROLES).
- The router's frontend serves TLS with client certificates optional (clients are not
  cluster processes; a certificate they present must still chain to the CA).
- Every channel a process opens presents its certificate and verifies the server's against
  the CA, including a name: the instance of the discovery record it dials
  (`instance_server_name`), or else the host name it dials (a server certificate names the
  hosts and IPs peers reach it at: its --advertise-host).
- A worker's instance id is its certificate's instance name (INSTANCE_URI), and a prefill
  worker writes only into its caller's own pool (`peer_instances`).

The files are read once at start-up: rotating a certificate means restarting the process with
the new files. Without --tls-cert/--tls-key/--tls-ca a process serves and dials in plaintext.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc

log = logging.getLogger(__name__)

ROLE_URI = "tandem://role/"  # + role, a URI SAN of every Tandem certificate (common/certs.py issues them)
# + the certificate's name: the one instance id a worker holding it registers and serves under,
# so a peer can tell which record's process it is talking to (INSTANCE_URI + name, a URI SAN)
INSTANCE_URI = "tandem://instance/"
# ... and as DNS names NAME + INSTANCE_DNS and *.NAME + INSTANCE_DNS (.invalid is reserved: no
# real host has it), so that a client dialling the record of instance I checks, with gRPC's own
# host name check, that the server holds I's certificate (`instance_server_name`). A process
# serving several simulated instances (`tandem mocker`) names them SIM.NAME.
INSTANCE_DNS = ".instance.tandem.invalid"
ROLES = ("router", "prefill", "decode", "client", "admin")
# Which roles may call each internal service; a service not listed (health, reflection) takes
# any known role. Must match who dials whom: router -> decode (Generate), router -> every worker
# (KvEventService, health), decode -> prefill (Prefill). KV events carry every cached block
# hash, so besides the router only an operator's "admin" certificate may read them.
SERVICE_ROLES = {"tandem.v1.PrefillService": frozenset({"decode"}),
                 "tandem.v1.DecodeService": frozenset({"router"}),
                 "tandem.v1.KvEventService": frozenset({"router", "admin"})}


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of one process: its certificate (chain) and key, and the cluster CA.

    Raises (on construction):
        ValueError: naming the flags, when only some of them are set (a client may give --tls-ca
            alone: `client=True`).
    """

    cert: str = ""
    key: str = ""
    ca: str = ""
    client: bool = False  # a client of the frontend: its own certificate is optional

    def __post_init__(self) -> None:
        given = [f for f, v in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)) if v]
        if not given:
            return
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key go together (the certificate and its private key)")
        if not self.ca:
            raise ValueError(f"{' and '.join(given)} need --tls-ca (the cluster CA certificate)")
        if not self.cert and not self.client:
            raise ValueError("--tls-ca needs --tls-cert and --tls-key (this process's certificate and key)")

    @property
    def enabled(self) -> bool:
        return bool(self.ca)

    def load(self) -> TlsCredentials:
        """Read the files (once: rotation is a restart).

        Raises:
            ValueError: naming the flag of a file that cannot be read or is not PEM.
        """
        def read(flag: str, path: str) -> bytes:
            if not path:
                return b""
            try:
                data = Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
            if b"-----BEGIN " not in data:
                raise ValueError(f"{flag} {path}: not a PEM file")
            return data
        ca = read("--tls-ca", self.ca)
        _check_ca(self.ca, ca)
        return TlsCredentials(read("--tls-cert", self.cert), read("--tls-key", self.key), ca)


def _check_ca(path: str, data: bytes) -> None:
    """--tls-ca must hold a CA certificate: a process's own certificate given there by mistake
    (it would trust only that one peer, and chains to nothing) is refused naming the flag.

    Raises:
        ValueError: no certificate in the file is a CA's (basic constraints CA:TRUE).
    """
    from cryptography import x509
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as exc:
        raise ValueError(f"--tls-ca {path}: not a PEM certificate ({exc})") from None
    for cert in certs:
        try:
            if cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
                return
        except x509.ExtensionNotFound:
            continue
    raise ValueError(f"--tls-ca {path}: holds no CA certificate (it looks like a process's own certificate; "
                     "give the cluster CA's, ca.pem from `tandem certs`)")


@dataclass(frozen=True)
class TlsCredentials:
    """The loaded PEM bytes; cert and key are empty for a frontend client without a certificate."""

    cert: bytes
    key: bytes
    ca: bytes

    @functools.cached_property
    def instance(self) -> str | None:
        """The instance name this process's certificate carries (INSTANCE_URI), or None
        (no certificate, or one made before certificates named their instance); parsed once."""
        if not self.cert:
            return None
        from cryptography import x509
        cert = x509.load_pem_x509_certificates(self.cert)[0]
        try:
            uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
                x509.UniformResourceIdentifier)
        except x509.ExtensionNotFound:
            return None
        return next((u.removeprefix(INSTANCE_URI) for u in uris if u.startswith(INSTANCE_URI)), None)

    def server(self, require_client_auth: bool) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=require_client_auth)

    def channel(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key or None,
                                            certificate_chain=self.cert or None)


TLS: TlsCredentials | None = None  # set once per process by its main (set_tls); None = plaintext


def set_tls(files: TlsFiles | None) -> None:
    """Serve and dial with these files from now on (None or no files: plaintext, logged).

    Raises:
        ValueError: see TlsFiles.load.
    """
    global TLS
    TLS = files.load() if files is not None and files.enabled else None
    if TLS is None:
        log.warning("no --tls-cert/--tls-key/--tls-ca: serving and dialling gRPC in plaintext, "
                    "unauthenticated (docs/security.md)")


def peer_roles(context: grpc.aio.ServicerContext) -> frozenset[str]:
    """The known roles the calling peer's verified certificate names (empty without one)."""
    names = context.auth_context().get("x509_subject_alternative_name", [])
    roles = {n.decode(errors="replace").removeprefix(ROLE_URI) for n in names
             if n.startswith(ROLE_URI.encode())}
    return frozenset(roles & set(ROLES))


def instance_server_name(instance_id: str | None) -> str | None:
    """The host name to check a server's certificate against when dialling the record of
    `instance_id` (gRPC's ssl_target_name_override), so that only the process holding that
    instance's certificate passes; None without TLS (or without an instance id)."""
    if TLS is None or not instance_id:
        return None
    return instance_id + INSTANCE_DNS


def peer_instances(context: grpc.aio.ServicerContext) -> frozenset[str]:
    """The instance names the calling peer's verified certificate carries (empty without one)."""
    names = context.auth_context().get("x509_subject_alternative_name", [])
    return frozenset(n.decode(errors="replace").removeprefix(INSTANCE_URI) for n in names
                     if n.startswith(INSTANCE_URI.encode()))


class RoleCheck(grpc.aio.ServerInterceptor):
    """PERMISSION_DENIED for a call whose client certificate names no role the service admits
    (SERVICE_ROLES; other services: any known role). Installed on internal servers with TLS on,
    where the handshake has already verified the chain."""

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        service = details.method.lstrip("/").split("/", 1)[0]
        allowed = SERVICE_ROLES.get(service, frozenset(ROLES))

        async def check(context: grpc.aio.ServicerContext) -> None:
            roles = peer_roles(context)
            if not roles & allowed:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"{service} accepts calls from {', '.join(sorted(allowed))} only; the client's "
                                    f"certificate names {', '.join(sorted(roles)) or 'no Tandem role'}")
        return guarded(handler, check)


def guarded(handler: grpc.RpcMethodHandler,
            check: Callable[[grpc.aio.ServicerContext], Awaitable[None]]) -> grpc.RpcMethodHandler:
    """`handler` with `await check(context)` run first, in the call's own task (so a contextvar
    it sets is seen by the method); check ends the call with context.abort to refuse it."""

    def one_response(inner):  # unary_unary, stream_unary: one response (or a coroutine of it)
        async def method(request, context):
            await check(context)
            result = inner(request, context)
            return await result if inspect.isawaitable(result) else result
        return method

    def streamed(inner):  # unary_stream, stream_stream: an async generator, or a coroutine that writes
        async def method(request, context):
            await check(context)
            result = inner(request, context)
            if inspect.isasyncgen(result):
                async for response in result:
                    yield response
            else:  # a coroutine that writes with context.write
                await result
        return method

    for kind, wrap in (("unary_unary", one_response), ("stream_unary", one_response),
                       ("unary_stream", streamed), ("stream_stream", streamed)):
        inner = getattr(handler, kind)
        if inner is not None:
            return handler._replace(**{kind: wrap(inner)})
    return handler
