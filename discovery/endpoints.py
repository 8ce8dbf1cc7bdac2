"""etcd endpoint lists and client connection.

The `--etcd` flag takes "host:port[,host:port...]"; `connect_first()` returns an aetcd client for
the first endpoint that answers a read, so a multi-member etcd keeps working when one member is
down. An "https://host:port" endpoint is dialled over TLS with this process's certificate
(--tls-cert, --tls-key, --tls-ca: etcd's --client-cert-auth takes certificates of the cluster
CA), so only processes of the cluster can read or write discovery.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import aetcd
import grpc
from aetcd import rpc
from aetcd import watcher as aetcd_watcher

from common.tls import TlsCredentials

logger = logging.getLogger(__name__)

_CHANNEL_OPTIONS = {
    # Callers drop a client after an error and connect again. By default gRPC shares
    # subchannels between channels to the same target, so the new channel would inherit the
    # old one's reconnect back-off and keep failing with "Connection refused" for seconds after
    # etcd is back; a local pool gives each client a fresh connection attempt.
    "grpc.use_local_subchannel_pool": 1,
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 2_000,
    # Notice a silently dead connection (no RST) within ~15 s. etcd refuses pings more often
    # than every 5 s (--grpc-keepalive-min-time), so stay above that.
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}

# Errors that mean "this etcd did not answer"; callers retry on these.
ETCD_ERRORS: tuple[type[BaseException], ...] = (
    aetcd.ClientError,
    grpc.RpcError,
    OSError,
    asyncio.TimeoutError,
)


def describe_error(exc: BaseException) -> str:
    """A one-line description of an etcd error for logs (gRPC errors print several lines)."""
    cause = exc.__cause__ if isinstance(exc, aetcd.ClientError) and exc.__cause__ else exc
    if isinstance(cause, grpc.aio.AioRpcError):
        return f"{cause.code().name}: {cause.details()}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class EtcdUnavailableError(ConnectionError):
    """No endpoint of the list answered."""


class Endpoint(NamedTuple):
    """One etcd client endpoint; `tls`: dialled over TLS ("https://")."""

    host: str
    port: int
    tls: bool = False

    def __str__(self) -> str:
        hostport = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        return f"https://{hostport}" if self.tls else hostport


def parse_endpoint(text: str) -> Endpoint:
    """Parse one "host:port" ("http://" or "https://" prefix and "[v6]:port" accepted).

    Raises:
        ValueError: malformed entry; the message names the `--etcd` flag.
    """
    item = text.strip()
    tls = item.startswith("https://")
    item = item.removeprefix("https://").removeprefix("http://")
    if "://" in item:
        raise ValueError(f"--etcd: {text!r}: only http:// (plaintext) and https:// (TLS) endpoints are supported")
    item = item.rstrip("/")
    if item.startswith("["):
        host, sep, port_text = item[1:].partition("]:")
    else:
        host, sep, port_text = item.rpartition(":")
    if not sep or not host or not port_text:
        raise ValueError(f"--etcd: {text!r} is not host:port")
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"--etcd: {text!r}: port {port_text!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"--etcd: {text!r}: port {port} is out of range 1..65535")
    return Endpoint(host, port, tls)


def parse_endpoints(spec: str | Sequence[str]) -> list[Endpoint]:
    """Parse "host:port[,host:port...]" (or a sequence of such strings).

    Raises:
        ValueError: empty list or a malformed entry; the message names the `--etcd` flag.
    """
    items = spec.split(",") if isinstance(spec, str) else [p for s in spec for p in s.split(",")]
    items = [item for item in items if item.strip()]
    if not items:
        raise ValueError("--etcd: no endpoint given; expected host:port[,host:port...]")
    return [parse_endpoint(item) for item in items]


class _TlsClient(aetcd.Client):
    """An aetcd client over TLS: aetcd builds only plaintext channels, so the channel its
    connect() made is swapped for a TLS one before anything is sent on it (gRPC channels
    connect lazily), and the stubs are rebuilt on it."""

    def __init__(self, *args: Any, credentials: grpc.ChannelCredentials, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        await super().connect()
        if self.channel is None or getattr(self.channel, "_tandem_tls", False):
            return
        # No await until the stubs are rebuilt: a task that waited for this connect() resumes
        # only at the next await, and must find the TLS stubs.
        plain = self.channel
        self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", self._credentials,
                                               options=list(self._options.items()))
        self.channel._tandem_tls = True  # type: ignore[attr-defined]
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd_watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                              metadata=self.metadata)
        await plain.close()  # never used: gRPC channels connect at their first call


NEEDS_CERT = ("--etcd https://...: dialling etcd over TLS needs --tls-cert, --tls-key and --tls-ca (a certificate "
              "of the cluster CA, which etcd's --client-cert-auth checks)")


def check_etcd_tls(etcd: str, tls_cert: str) -> None:
    """Options check: an https:// `--etcd` endpoint needs this process's certificate.

    Raises:
        ValueError: naming --etcd and --tls-cert (or a malformed --etcd).
    """
    if etcd and not tls_cert and any(e.tls for e in parse_endpoints(etcd)):
        raise ValueError(NEEDS_CERT)


def _credentials(tls: TlsCredentials | None) -> grpc.ChannelCredentials:
    from common import tls as process_tls
    creds = tls or process_tls.TLS
    if creds is None or not creds.cert:
        raise ValueError(NEEDS_CERT)
    return creds.channel()


async def connect_first(
    endpoints: str | Sequence[str] | Sequence[Endpoint],
    *,
    rpc_timeout: float = 5.0,
    tls: TlsCredentials | None = None,
) -> aetcd.Client:
    """Return a client of the first endpoint that answers a read (each tried for `rpc_timeout` s).

    `rpc_timeout` (seconds) also becomes the client's deadline for every unary call. The caller
    owns the client and must `await client.close()`. An https:// endpoint is dialled with `tls`,
    by default this process's credentials (common/tls.py TLS, set from --tls-*).

    Raises:
        ValueError: malformed endpoint list (names `--etcd`), or an https:// endpoint without
            TLS credentials.
        EtcdUnavailableError: no endpoint answered.
    """
    if isinstance(endpoints, str) or not endpoints or isinstance(endpoints[0], str):
        parsed = parse_endpoints(endpoints)  # type: ignore[arg-type]
    else:
        parsed = list(endpoints)  # type: ignore[arg-type]
    errors: list[str] = []
    for endpoint in parsed:
        host = f"[{endpoint.host}]" if ":" in endpoint.host else endpoint.host
        # aetcd's timeout becomes the gRPC deadline of each unary call; its signature says int
        # but any number works.
        if endpoint.tls:
            client: aetcd.Client = _TlsClient(host, endpoint.port, timeout=rpc_timeout,  # type: ignore[arg-type]
                                              options=_CHANNEL_OPTIONS, credentials=_credentials(tls))
        else:
            client = aetcd.Client(host, endpoint.port, timeout=rpc_timeout,  # type: ignore[arg-type]
                                  options=_CHANNEL_OPTIONS)
        try:
            # aetcd's connect() only builds a channel; a read proves that etcd answers.
            await asyncio.wait_for(client.get(b"/tandem/v1/"), rpc_timeout)
            return client
        except ETCD_ERRORS as exc:
            errors.append(f"{endpoint}: {describe_error(exc)}")
            await client.close()
        except BaseException:  # cancelled: don't leak the channel
            await client.close()
            raise
    raise EtcdUnavailableError("no etcd endpoint answered: " + "; ".join(errors))
