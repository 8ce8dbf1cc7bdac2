"""`--http-port` values, without importing the HTTP stack (FastAPI, uvicorn): a router with the
HTTP API off needs neither."""

HTTP_OFF = -1


def validate_port(port: int) -> None:
    """Raises ValueError naming --http-port unless port is -1, 0 or a TCP port."""
    if not HTTP_OFF <= port <= 65535:
        raise ValueError(f"--http-port must be -1 (off), 0 (any free port) or a TCP port, got {port}")
