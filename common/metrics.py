"""Prometheus metrics plumbing shared by every process (docs/observability.md lists the metrics).

Each component owns its own `CollectorRegistry` (tests run several routers and workers in one
process, so the global registry would see duplicates) and serves it at `/metrics` over HTTP
with prometheus-client's server thread. Counters the code already keeps (WorkerStats, the
router's counters, health state, load) are read at scrape time by custom collectors instead
of being copied into client-library metrics on the request path.

`--metrics-port`: -1 (the default) = no metrics server, 0 = any free port (announced in the
process's discovery record as `metrics_address` and logged), otherwise that port.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

METRICS_OFF = -1
# Latency buckets (seconds) for token-level and request-level histograms: 1 ms .. 2 min.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   30.0, 60.0, 120.0)
# Router decision time (hash + index lookup + scoring): 5 us .. 100 ms.
DECISION_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


def validate_port(port: int) -> None:
    """Raises ValueError naming --metrics-port unless port is -1, 0 or a TCP port."""
    if not METRICS_OFF <= port <= 65535:
        raise ValueError(f"--metrics-port must be -1 (off), 0 (any free port) or a TCP port, got {port}")


@dataclass
class MetricsServer:
    """A running /metrics endpoint; `address` is host:port."""

    address: str
    _httpd: Any

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def serve(registry: CollectorRegistry, host: str, port: int, name: str) -> MetricsServer | None:
    """Serve `registry` at http://host:port/metrics; None when port is -1.

    Raises:
        OSError: the port could not be bound (the message names --metrics-port).
    """
    validate_port(port)
    if port == METRICS_OFF:
        return None
    try:
        httpd, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise OSError(exc.errno, f"--metrics-port {port}: cannot listen on {host}:{port}: {exc.strerror}") from None
    server = MetricsServer(f"{host}:{httpd.server_port}", httpd)
    log.info("%s metrics at http://%s/metrics", name, server.address)
    return server


class FunctionCollector(Collector):
    """A collector whose metric families are produced by a function at scrape time.

    With `loop` set, the function runs on that asyncio loop (the scrape thread waits for it,
    at most `timeout_s`), so it reads the state the loop owns without any race; a loop that is
    closed or does not answer in time yields nothing for this scrape.
    """

    def __init__(self, fn: Callable[[], Iterable[Any]], loop: asyncio.AbstractEventLoop | None = None,
                 timeout_s: float = 2.0) -> None:
        self._fn = fn
        self.loop = loop
        self.timeout_s = timeout_s

    def collect(self) -> Iterable[Any]:
        if self.loop is None:
            return list(self._fn())
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(list(self._fn()))
            except BaseException as exc:  # noqa: BLE001 - reported to the scrape thread
                fut.set_exception(exc)

        try:
            self.loop.call_soon_threadsafe(run)
            return fut.result(self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a closed or stuck loop, or a bug: skip, say why
            log.warning("metrics collection skipped: %s", repr(exc))
            return []


def counter(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> CounterMetricFamily:
    """One counter family; `name` without the `_total` suffix (the exposition adds it)."""
    fam = CounterMetricFamily(name, doc, labels=list(labels) if labels else None)
    fam.add_metric(list(labels.values()) if labels else [], value)
    return fam


def gauge(name: str, doc: str, value: float, labels: dict[str, str] | None = None) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, doc, labels=list(labels) if labels else None)
    fam.add_metric(list(labels.values()) if labels else [], value)
    return fam
