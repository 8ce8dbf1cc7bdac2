"""`--http-port`, `--http-host` and `--http-tls-*` values, checked without importing the HTTP
stack (FastAPI, uvicorn): a router with the HTTP API off needs neither."""

import logging
import ssl
import time

HTTP_OFF = -1

log = logging.getLogger(__name__)


def validate_port(port: int) -> None:
    """Raises ValueError naming --http-port unless port is -1, 0 or a TCP port."""
    if not HTTP_OFF <= port <= 65535:
        raise ValueError(f"--http-port must be -1 (off), 0 (any free port) or a TCP port, got {port}")


def url(scheme: str, address: str) -> str:
    """scheme://host:port of a host:port address, an IPv6 host in brackets."""
    host, _, port = address.rpartition(":")
    return f"{scheme}://{f'[{host}]' if ':' in host and not host.startswith('[') else host}:{port}"


def validate_https(port: int, cert: str, key: str, host: str = "") -> None:
    """The HTTP API's own listening options: --http-tls-cert and --http-tls-key together, loadable
    as a server certificate and its key (so a wrong file fails at start-up, not at the first
    client's handshake; an encrypted key is refused, not prompted for), and --http-tls-* or
    --http-host only with the HTTP API on.

    Raises:
        ValueError: naming the flags.
    """
    if bool(cert) != bool(key):
        raise ValueError("--http-tls-cert and --http-tls-key go together (the HTTP API's certificate and its key)")
    if port == HTTP_OFF and (cert or host):
        given = [f for f, v in (("--http-host", host), ("--http-tls-cert", cert)) if v]
        raise ValueError(f"{' and '.join(given)} {'set' if len(given) > 1 else 'sets'} how the HTTP API listens, "
                         f"which is off (--http-port -1): turn it on with --http-port, or leave "
                         f"{' and '.join(given)} out")
    if cert:
        load_certificate(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), cert, key)


def load_certificate(context: ssl.SSLContext, cert: str, key: str) -> None:
    """Load --http-tls-cert and --http-tls-key into `context` (new connections use them).

    Raises:
        ValueError: unreadable, not PEM, a key that is not the certificate's, or an encrypted key.
    """
    try:
        # an empty passphrase: an encrypted key fails here instead of prompting on the terminal
        context.load_cert_chain(cert, key, password="")
    except OSError as exc:  # ssl.SSLError is one
        what = exc.strerror or getattr(exc, "reason", None) or exc
        encrypted = "ENCRYPTED" in _head(key)
        hint = (" (the key is encrypted: give it decrypted, e.g. `openssl pkey -in KEY -out PLAIN`, readable by "
                "this process only)") if encrypted else ""
        raise ValueError(f"--http-tls-cert {cert} / --http-tls-key {key}: cannot load them as a server "
                         f"certificate and its key: {what}{hint}") from None


def _head(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read(4096).decode(errors="replace")
    except OSError:
        return ""


class PlainHttpLog:
    """Counts TLS handshakes on the HTTPS port that failed because the client spoke plain HTTP,
    and logs them at most once per `every_s` seconds (a warning naming the count since the last
    line), so that an operator learns why such clients get nothing: asyncio drops TLS handshake
    errors without a word, and the client sees the connection close."""

    def __init__(self, every_s: float = 60.0) -> None:
        self.every_s = every_s
        self.total = 0  # plain-HTTP handshakes since start
        self._unlogged = 0
        self._last = float("-inf")

    def note(self) -> None:
        self.total += 1
        self._unlogged += 1
        now = time.monotonic()
        if now - self._last >= self.every_s:
            log.warning("plain HTTP reached the HTTPS API port (%d connection%s since the last such line): "
                        "clients must use https:// and trust its certificate", self._unlogged,
                        "" if self._unlogged == 1 else "s")
            self._unlogged, self._last = 0, now


def watch_handshakes(context: ssl.SSLContext, plain_http: PlainHttpLog) -> None:
    """Make `context`'s server connections report a handshake that failed on plain HTTP to
    `plain_http` (through `SSLContext.sslobject_class`, the object asyncio's TLS transport drives).
    Other handshake failures (a client that does not trust the certificate) stay unlogged: the
    client reports those itself."""

    class _Watched(ssl.SSLObject):
        def do_handshake(self) -> None:
            try:
                super().do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                raise  # the handshake goes on when more bytes arrive
            except ssl.SSLError as exc:
                if exc.reason == "HTTP_REQUEST":  # OpenSSL's SSL_R_HTTP_REQUEST: "GET ", "POST", ...
                    plain_http.note()
                raise

    context.sslobject_class = _Watched
