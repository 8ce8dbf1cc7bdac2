"""Observability pieces on their own (log set-up, tracing off, metrics options) and on a real
in-process cluster (ClusterStatus, `tandem top --once`, each component's /metrics endpoint,
outcome and status-code counting)."""

from __future__ import annotations

import argparse
import asyncio
import gc
import io
import json
import logging
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common import logs, tracing
from common.pb.tandem.v1 import frontend_pb2, frontend_pb2_grpc, sampling_pb2
from worker.host import WorkerOptions
from harness import InProcessCluster


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {n: logging.getLogger(n).level for n in ("router", "discovery", "prefill_worker")}
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    for n, lv in levels.items():
        logging.getLogger(n).setLevel(lv)


def test_parse_levels_per_component():
    assert logs.parse_levels("warning,router=debug,prefill=error") == (
        logging.WARNING, {"router": logging.DEBUG, "prefill_worker": logging.ERROR})
    assert logs.parse_levels("router.health=debug") == (logging.INFO, {"router.health": logging.DEBUG})
    with pytest.raises(ValueError, match="loud"):
        logs.parse_levels("info,router=loud")


def test_json_lines_carry_the_request_id(restore_logging):
    out = io.StringIO()
    logs.setup("warning,router=debug", "json", stream=out)
    token = logs.request_id.set("req-42")
    try:
        logging.getLogger("router.service").debug("routed %d", 7)
        logging.getLogger("discovery.watcher").info("hidden: below this component's level")
    finally:
        logs.request_id.reset(token)
    logging.getLogger("discovery.watcher").warning("shown")
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x["message"] for x in lines] == ["routed 7", "shown"]
    assert lines[0]["request_id"] == "req-42" and lines[0]["level"] == "debug" and lines[0]["logger"] == "router.service"
    assert lines[1]["request_id"] == "" and lines[1]["trace_id"] == ""  # tracing is off in this process
    with pytest.raises(ValueError, match="log-format"):
        logs.setup("info", "xml")


def test_tracing_is_off_without_an_endpoint(monkeypatch):
    for var in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    assert not tracing.configured()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317")
    assert tracing.configured()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.configured()
    # This process never called setup(): no interceptors, and span() is the shared no-op.
    assert not tracing.enabled()
    assert tracing.server_interceptors() == [] and tracing.client_interceptors() == []
    with tracing.span("x", {"a": 1}) as s:
        assert s is tracing.NO_SPAN and not s.is_recording()
    assert tracing.span("y") is tracing.NO_SPAN_CM


def test_metrics_port_is_validated():
    with pytest.raises(ValueError, match="--metrics-port"):
        WorkerOptions(metrics_port=-2)
    with pytest.raises(ValueError, match="--metrics-port"):
        WorkerOptions(metrics_port=70000)


@pytest.fixture(scope="module")
def spans():
    """Tracing on in this process for the module's cluster: an SDK provider exporting every span
    to memory, as it ends."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    previous = tracing.use_provider(provider)
    yield exporter
    tracing.use_provider(previous)
    provider.shutdown()


@pytest.fixture(scope="module")
def cluster(etcd_server, tiny_model, spans):
    c = InProcessCluster(etcd_server.endpoint, tiny_model, namespace="obs-inproc")
    c.router = c.start("router", metrics_port=0)
    c.prefill = c.start("prefill", metrics_port=0)
    c.decode = c.start("decode", metrics_port=0)
    c.wait_roles(c.router, 1, 1)
    yield c
    c.close()


def scrape(address: str) -> list:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        return [s for fam in text_string_to_metric_families(resp.read().decode()) for s in fam.samples]


def value(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def test_cluster_status_metrics_and_top(cluster, capsys):
    with grpc.insecure_channel(cluster.router.address) as ch:
        stub = frontend_pb2_grpc.FrontendServiceStub(ch)
        req = frontend_pb2.GenerateRequest(token_ids=list(range(10, 60)),
                                           sampling=sampling_pb2.SamplingParams(max_tokens=3, ignore_eos=True))
        assert sum(len(m.token_ids) for m in stub.Generate(req, timeout=60)) == 3
        with pytest.raises(grpc.RpcError) as err:  # a client error: counted with its status code
            list(stub.Generate(frontend_pb2.GenerateRequest(token_ids=[10], model="nope"), timeout=60))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        status = stub.ClusterStatus(frontend_pb2.ClusterStatusRequest(), timeout=10)
    assert status.model == cluster.loaded.name and status.mode == "kv"
    with grpc.insecure_channel(cluster.router.address) as ch:  # itself, from discovery (eventually)
        stub = frontend_pb2_grpc.FrontendServiceStub(ch)
        for _ in range(100):
            seen = stub.ClusterStatus(frontend_pb2.ClusterStatusRequest(), timeout=10)
            if seen.routers:
                break
            time.sleep(0.1)
    assert [r.instance_id for r in seen.routers] == [seen.router_instance_id]
    assert seen.routers[0].metrics_address == seen.metrics_address
    by_role = {w.role: w for w in status.workers}
    assert set(by_role) == {"prefill", "decode"}
    assert by_role["decode"].instance_id == cluster.decode.runtime.instance_id
    for w in status.workers:
        assert w.healthy and w.state == "serving" and w.routed_requests == 1 and w.kv_capacity_blocks == 512
        assert w.metrics_address  # announced in discovery
    assert by_role["decode"].indexed_blocks >= 3  # the prompt's full blocks, learned from KV events

    args = argparse.Namespace(router=cluster.router.address, once=True, interval=1.0, tls_ca="", tls_cert="",
                              tls_key="", api_key="")
    from cli.top import _run
    assert asyncio.run(_run(args)) == 0
    shown = capsys.readouterr().out
    for w in status.workers:
        assert w.instance_id in shown and w.metrics_address in shown
    assert shown.count("healthy") >= 2

    router = scrape(status.metrics_address)
    assert value(router, "tandem_router_requests_total", outcome="length", code="OK") == 1
    assert value(router, "tandem_router_requests_total", outcome="error", code="NOT_FOUND") == 1
    assert value(router, "tandem_router_ttft_seconds_count") == 1
    assert value(router, "tandem_router_worker_healthy", role="decode") == 1
    decode = scrape(by_role["decode"].metrics_address)
    assert value(decode, "tandem_worker_generated_tokens_total") == 3
    assert value(decode, "tandem_worker_running_requests") == 0
    assert value(decode, "tandem_worker_kv_blocks") == 512
    # the process's garbage collections, by generation (a full one at least: the start-up's own)
    gc.collect()
    decode = scrape(by_role["decode"].metrics_address)
    assert value(decode, "tandem_worker_gc_collections_total", generation="2") >= 1
    assert value(decode, "tandem_worker_gc_seconds_total", generation="2") > 0
    prefill = scrape(by_role["prefill"].metrics_address)
    assert value(prefill, "tandem_worker_kv_transfers_total") == 1
    # the one prompt's forward ran on the prefill worker (its device time: wall time on a CPU)
    assert value(prefill, "tandem_worker_prefill_forwards_total") == 1
    assert value(prefill, "tandem_worker_prefill_device_seconds_total") > 0
    assert value(decode, "tandem_worker_prefill_device_seconds_total") == 0


def test_refused_decode_calls_are_retried_in_migration_spans(cluster, spans):
    """Both decode workers refuse (draining while discovery still says SERVING): the router
    retries each inside a `tandem.migration` span, then answers UNAVAILABLE."""
    second = cluster.start("decode")
    cluster.wait_roles(cluster.router, 1, 2)
    decodes = [cluster.decode, second]
    spans.clear()
    for h in decodes:
        h.runtime.draining = True
    try:
        with grpc.insecure_channel(cluster.router.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                list(frontend_pb2_grpc.FrontendServiceStub(ch).Generate(
                    frontend_pb2.GenerateRequest(token_ids=list(range(70, 90))), timeout=60))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        for h in decodes:
            h.runtime.draining = False
        cluster.stop(second)
    got = spans.get_finished_spans()
    api = next(s for s in got if s.name == "/tandem.v1.FrontendService/Generate")
    trace_id = api.context.trace_id
    mine = [s for s in got if s.context.trace_id == trace_id]
    migrations = sorted((s for s in mine if s.name == "tandem.migration"), key=lambda s: s.attributes["tandem.migration.attempt"])
    assert [s.attributes["tandem.migration.attempt"] for s in migrations] == [1, 2]
    ids = {h.runtime.instance_id for h in decodes}
    assert {migrations[0].attributes["tandem.migration.from_instance"]} < ids
    for m in migrations:
        assert m.parent.span_id == api.context.span_id
        assert m.attributes["tandem.migration.kind"] == "retry"
        assert m.attributes["tandem.migration.reason"] == "UNAVAILABLE"
    # Attempt 1 routed to the other decode worker inside its migration span; attempt 2 found none.
    routes = [s for s in mine if s.name == "tandem.route"]
    assert len(routes) == 3
    in_first = [s for s in routes if s.parent.span_id == migrations[0].context.span_id]
    assert len(in_first) == 1
    assert {migrations[0].attributes["tandem.migration.from_instance"],
            in_first[0].attributes["tandem.route.decode_instance"]} == ids
    router = scrape(cluster.router.servicer.cluster_status.metrics_address)
    assert value(router, "tandem_router_requests_total", outcome="error", code="UNAVAILABLE") == 1
    assert value(router, "tandem_router_retries_total") == 2


def test_metrics_port_in_use_names_the_flag():
    import socket

    from prometheus_client import CollectorRegistry

    from common import metrics as metrics_http

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"--metrics-port {port}"):
            metrics_http.serve(CollectorRegistry(), "127.0.0.1", port, "test")
