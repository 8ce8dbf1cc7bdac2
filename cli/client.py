"""A small streaming client for FrontendService, used by `tandem generate` and the demo."""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import grpc

from common.grpc_server import channel
from common.tls import TlsCredentials, TlsFiles
from common.pb.tandem.v1 import frontend_pb2, frontend_pb2_grpc, sampling_pb2


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = ""
    ttft_s: float = 0.0  # seconds from sending to the first token
    latency_s: float = 0.0  # seconds from sending to the last response
    prompt_tokens: int = 0
    cached_tokens: int = 0


async def generate(stub: frontend_pb2_grpc.FrontendServiceStub, text: str = "", token_ids: list[int] | None = None,
                   max_tokens: int = 64, temperature: float = 0.0, seed: int | None = None,
                   stop: list[str] | None = None, timeout_s: float = 300.0, top_p: float | None = None,
                   on_text: Callable[[str], None] | None = None) -> Completion:
    """Stream one completion; on_text gets each text delta as it arrives.

    Raises:
        grpc.aio.AioRpcError: the router answered an error status.
    """
    sampling = sampling_pb2.SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=stop or [])
    if seed is not None:
        sampling.seed = seed
    if top_p is not None:
        sampling.top_p = top_p
    req = frontend_pb2.GenerateRequest(text=text, token_ids=token_ids or [], sampling=sampling)
    out = Completion()
    start = time.perf_counter()
    async for msg in stub.Generate(req, timeout=timeout_s):
        if msg.token_ids and not out.token_ids:
            out.ttft_s = time.perf_counter() - start
        out.token_ids.extend(msg.token_ids)
        out.text += msg.text
        if on_text and msg.text:
            on_text(msg.text)
        if msg.finish_reason:
            out.finish_reason = sampling_pb2.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_").lower()
            out.prompt_tokens = msg.usage.prompt_tokens
            out.cached_tokens = msg.usage.cached_tokens
    out.latency_s = time.perf_counter() - start
    return out


def _with_key(details: grpc.aio.ClientCallDetails, entry: tuple[str, str]) -> grpc.aio.ClientCallDetails:
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), entry))


class _UnaryKey(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, entry: tuple[str, str]) -> None:
        self.entry = entry

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_with_key(details, self.entry), request)


class _StreamKey(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, entry: tuple[str, str]) -> None:
        self.entry = entry

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_with_key(details, self.entry), request)


def bearer_token(api_key: str) -> list[grpc.aio.ClientInterceptor]:
    """Channel interceptors sending `authorization: Bearer <key>` with every call (the router's
    --api-keys). Interceptors, not call credentials: gRPC sends those over TLS channels only,
    and a key must also reach a plaintext (--insecure) router. Two objects: a channel files an
    interceptor under one call kind only, so one class of both kinds would miss the streams."""
    entry = ("authorization", f"Bearer {api_key}")
    return [_UnaryKey(entry), _StreamKey(entry)]


def check_port(address: str, flag: str = "--router", given: str = "") -> None:
    """Refuse a host:port whose port is not 1..65535, naming `flag` and what was given there
    (default: the address; gRPC would dial the port modulo 65536: 117587 reached 52051).
    Raises ValueError."""
    port = address.rpartition(":")[2]
    if port.lstrip("-").isdigit() and not 1 <= int(port) <= 65535:
        raise ValueError(f"{flag} {given or address}: the port must be in 1..65535")


def frontend_stub(address: str, creds: TlsCredentials | None = None, api_key: str = "",
                  own_connection: bool = False) -> tuple[grpc.aio.Channel, frontend_pb2_grpc.FrontendServiceStub]:
    """A channel to the router at `address`, over TLS with `creds` (plaintext without),
    sending `api_key` as a bearer token when given; `own_connection`: see common.grpc_server.channel.
    Raises ValueError when the address's port is out of range (`check_port`)."""
    check_port(address)
    ch = channel(address, creds, bearer_token(api_key) if api_key else (), own_connection=own_connection)
    return ch, frontend_pb2_grpc.FrontendServiceStub(ch)


def local_ca_file(port: int) -> Path:
    """Where `tandem up` leaves its CA certificate for clients of its router on `port` (this
    user's folder under the temp directory; removed when the cluster stops, and ignored by
    clients once the `tandem up` that wrote it is gone: see `LocalCaFile`)."""
    return Path(tempfile.gettempdir()) / f"tandem-{os.getuid()}" / f"up-{port}-ca.pem"


def _private(path: Path) -> bool:
    """path and its folder exist, belong to this user and are writable by no one else (so no
    other local user can have planted the CA a client would trust)."""
    try:
        folder, file = path.parent.lstat(), path.lstat()
    except OSError:
        return False
    return (stat.S_ISDIR(folder.st_mode) and stat.S_ISREG(file.st_mode)
            and all(st.st_uid == os.getuid() and not st.st_mode & 0o022 for st in (folder, file)))


def _is_file_of(fd: int, path: Path) -> bool:
    """Whether path names the file open at fd (not one removed since, nor another put there)."""
    try:
        mine, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)


def _held(path: Path) -> bool:
    """Whether a live process holds path's lock (`LocalCaFile`): the kernel drops a lock when its
    holder dies, SIGKILL included, so a file left by a killed `tandem up` reads as not held."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # (closing it drops a lock this call took)
    return False


def _private_folder(folder: Path) -> None:
    """Make this user's folder for `tandem up`'s files (mode 0700); PermissionError when it is
    not this user's own or others may write to it."""
    folder.mkdir(mode=0o700, exist_ok=True)
    st = folder.lstat()
    if not folder.is_dir() or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{folder} is not private to this user; not writing there")


class PortBusy(RuntimeError):
    """Another `tandem up` of this user serves, starts or stops on the port."""


class PortLock:
    """A `tandem up`'s claim on its router port, held (flock) from before its cluster starts
    until this process exits: a second `tandem up` on the port is refused before it starts
    anything (router replicas bind with SO_REUSEPORT, so the port alone would not refuse it
    while the first is starting), and one that is still stopping keeps the port's files (its
    CA file) until it is gone. The kernel drops the lock with the process, SIGKILL included.
    Raises PortBusy naming the port, PermissionError as `_private_folder`."""

    def __init__(self, port: int) -> None:
        self.path = path = local_ca_file(port).with_name(f"up-{port}.lock")
        _private_folder(path.parent)
        while True:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(self._fd)
                raise PortBusy(f"another tandem up serves, starts or stops on port {port} (it holds {path}); "
                               "stop it first, or pick another --port") from None
            # the holder before removes the file as it lets go (`close`): a lock taken on that
            # removed file claims nothing, so take it again on the path's file of now
            if _is_file_of(self._fd, path):
                return
            os.close(self._fd)

    def close(self) -> None:
        """Let go of the port, removing its lock file (still locked, so no claim is lost: see
        __init__): one file a port used would otherwise stay in the folder."""
        if self._fd >= 0:
            if _is_file_of(self._fd, self.path):  # (someone may have removed it meanwhile)
                self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = -1


class LocalCaFile:
    """The CA certificate of `tandem up`'s router on `port`, left for local clients at
    `local_ca_file(port)` and locked (flock) by this process for as long as it is open, so
    that clients trust it only while its cluster runs; `close()` removes it. Raises
    PermissionError when the folder is not this user's own."""

    def __init__(self, port: int, pem: bytes) -> None:
        self.path = path = local_ca_file(port)
        _private_folder(path.parent)
        # written and locked under another name, then renamed into place: no client sees it
        # unlocked (the lock belongs to the file, which the rename keeps)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.unlink(missing_ok=True)
        self._fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        os.write(self._fd, pem)
        os.replace(tmp, path)

    def close(self) -> None:
        """Remove the file, if it is still this one (not another cluster's since)."""
        if self._fd < 0:
            return
        if _is_file_of(self._fd, self.path):
            self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = -1


def client_credentials(args) -> TlsCredentials | None:
    """The TLS credentials of a frontend client from its --tls-ca (and optional --tls-cert and
    --tls-key). Without --tls-ca, a router on a loopback address whose port a running
    `tandem up` serves is reached with that cluster's CA (`local_ca_file`); otherwise None
    (plaintext).

    Raises:
        ValueError: naming the flag, for a missing flag or unreadable file.
    """
    ca = args.tls_ca or ("" if args.tls_cert else local_ca_for(getattr(args, "router", "")))
    files = TlsFiles(args.tls_cert, args.tls_key, ca, client=True)
    return files.load() if files.enabled else None


def local_ca_for(address: str) -> str:
    """The CA file a running `tandem up` left for a loopback `address` (host:port) of its router,
    when that file is private to this user (`_private`) and its `tandem up` still runs
    (`_held`); "" otherwise."""
    host, _, port = address.rpartition(":")
    if host in ("127.0.0.1", "localhost", "[::1]") and port.isdigit():
        path = local_ca_file(int(port))
        if _private(path) and _held(path):
            return str(path)
    return ""


CLIENT_TLS_HELP = {
    "--tls-ca": "PEM certificate of the cluster CA: the router's certificate must chain to it (TLS; "
                "`tandem up` prints its path); empty = the CA of a `tandem up` running here whose router "
                "port --router names on a loopback address, else plaintext",
    "--tls-cert": "PEM client certificate issued by the cluster CA (optional; with --tls-key)",
    "--tls-key": "PEM private key of --tls-cert"}


# the request fields a router's INVALID_ARGUMENT names (common/validation.py), as `tandem generate`'s flags
GENERATE_FLAGS = {"sampling.max_tokens": "--max-tokens", "sampling.temperature": "--temperature",
                  "sampling.top_p": "--top-p", "sampling.stop": "--stop",
                  "text": ""}  # the prompt: its messages say "prompt ..." themselves


def flag_named(details: str) -> str:
    """A router's error text with its leading request field ("sampling.max_tokens: must be >= 1")
    named as the CLI flag that set it ("--max-tokens: must be >= 1"); other text unchanged."""
    field, sep, rest = details.partition(": ")
    base, bracket, index = field.partition("[")  # sampling.stop[1] -> --stop[1]
    if not sep or base not in GENERATE_FLAGS:
        return details
    return f"{GENERATE_FLAGS[base]}{bracket}{index}{sep}{rest}" if GENERATE_FLAGS[base] else rest


DEFAULT_ROUTER = "127.0.0.1:50051"  # the clients' --router default, `tandem up`'s router


def _where_else(router: str) -> str:
    """What to do when no router answered at `router`: start one, or fix the address given."""
    if router == DEFAULT_ROUTER:
        return "start a local cluster with `tandem up`, or pass --router (or TANDEM_ROUTER) with the address of yours"
    return (f"check the address given by --router (or TANDEM_ROUTER), or start a local cluster with `tandem up` "
            f"(its router listens at {DEFAULT_ROUTER} unless given --port)")


def no_router_hint(exc, router: str, tls: bool = True) -> str:
    """For a call that found no router: what to do about it (`tls`: whether the call used TLS)."""
    details = (exc.details() or "").lower()
    if exc.code() != grpc.StatusCode.UNAVAILABLE or "connect" not in details:
        return ""
    if "handshake" in details:  # something answered, but not with a certificate of our CA
        return (f"\nthe TLS handshake with {router} failed: the router there serves a certificate of another CA "
                f"than --tls-ca (or TANDEM_TLS_CA), or serves plaintext (then leave --tls-ca out)")
    if "refused" in details:  # nothing listens there: TLS or not is beside the point
        return f"\nnothing listens at {router}: {_where_else(router)}"
    if not tls:
        return (f"\nno router answered at {router} in plaintext. If one serves TLS there (`tandem up`'s does, and "
                f"any router given --tls-cert), pass --tls-ca with its cluster CA (or TANDEM_TLS_CA; `tandem up` "
                f"prints the export line); otherwise {_where_else(router)}")
    return f"\nno router at {router}: {_where_else(router)}"
