"""`--http-port`, `--http-host` and `--http-tls-*` values, checked without importing the HTTP
stack (FastAPI, uvicorn): a router with the HTTP API off needs neither."""

import ssl

HTTP_OFF = -1


def validate_port(port: int) -> None:
    """Raises ValueError naming --http-port unless port is -1, 0 or a TCP port."""
    if not HTTP_OFF <= port <= 65535:
        raise ValueError(f"--http-port must be -1 (off), 0 (any free port) or a TCP port, got {port}")


def validate_https(port: int, cert: str, key: str, host: str = "") -> None:
    """The HTTP API's own listening options: --http-tls-cert and --http-tls-key together, loadable
    as a server certificate and its key (so a wrong file fails at start-up, not at the first
    client's handshake), and --http-tls-* or --http-host only with the HTTP API on.

    Raises:
        ValueError: naming the flags.
    """
    if bool(cert) != bool(key):
        raise ValueError("--http-tls-cert and --http-tls-key go together (the HTTP API's certificate and its key)")
    if port == HTTP_OFF and (cert or host):
        given = " and ".join(f for f, v in (("--http-host", host), ("--http-tls-cert", cert)) if v)
        raise ValueError(f"{given} set how the HTTP API listens, which is off (--http-port -1): give --http-port too")
    if cert:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
        except OSError as exc:  # ssl.SSLError is one: a key that is not the certificate's, or not PEM
            what = exc.strerror or getattr(exc, "reason", None) or exc
            raise ValueError(f"--http-tls-cert {cert} / --http-tls-key {key}: cannot load them as a server "
                             f"certificate and its key: {what}") from None
