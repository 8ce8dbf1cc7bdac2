"""Logging set-up: text (default) or JSON lines, a level per component, and the request id
and trace id of the request being served on every line (docs/observability.md, "Logs").

The servicers set `request_id` (a ContextVar: every RPC runs in its own asyncio task, so the
value follows the request and never leaks into another one); the trace id comes from the
active OpenTelemetry span (common/tracing.py).
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

from common import tracing

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("tandem_request_id", default="")

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
FORMATS = ("text", "json")
# Short component names accepted in --log-level, and the logger (package) each one means.
COMPONENTS = {"prefill": "prefill_worker", "decode": "decode_worker", "transfer": "kv_transfer"}


class _RequestContext(logging.Filter):
    """Adds `request_id` and `trace_id` (empty when none) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        record.trace_id = tracing.trace_id_hex()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts (RFC 3339, UTC), level, logger, message, request_id,
    trace_id, and exc_info when an exception is attached."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", ""),
            "trace_id": getattr(record, "trace_id", ""),
        }
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def parse_levels(spec: str) -> tuple[int, dict[str, int]]:
    """'info,router=debug,discovery=warning' -> (INFO, {"router": DEBUG, "discovery": WARNING}).

    The bare entry is the root level (default info); `name=level` sets one component, named
    by its package (`router`, `engine`, `discovery`, `kv_transfer`, ...), a short name
    (`prefill`, `decode`, `transfer`) or any logger name (`router.health`).

    Raises:
        ValueError: an unknown level name (the message names the entry).
    """
    root, per = logging.INFO, {}
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        name, _, level = entry.rpartition("=")
        value = logging.getLevelName(level.strip().upper())
        if not isinstance(value, int):
            raise ValueError(f"--log-level: unknown level {level!r} in {entry!r} (debug, info, warning, error)")
        if name:
            per[COMPONENTS.get(name.strip(), name.strip())] = value
        else:
            root = value
    return root, per


def setup(level_spec: str = "info", fmt: str = "text", stream=None) -> None:
    """Configure the root logger (replacing its handlers).

    Raises:
        ValueError: unknown format or level.
    """
    if fmt not in FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    root_level, per = parse_levels(level_spec)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(_RequestContext())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(root_level)
    # torch logs its own bookkeeping at INFO (FakeTensor cache statistics at every exit once
    # compiled code ran): not this process's news unless asked for (--log-level torch=info)
    logging.getLogger("torch").setLevel(max(root_level, logging.WARNING))
    for name, level in per.items():
        logging.getLogger(name).setLevel(level)
