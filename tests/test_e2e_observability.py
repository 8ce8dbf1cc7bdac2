"""Observability end to end, on a real `tandem up` (router, prefill and decode as separate
processes, a real etcd) exporting spans over OTLP/gRPC to a real receiver in this process:
one trace per request with correct parent links across the three processes, an unsampled
incoming context staying unsampled, the incoming tracestate kept; /metrics on every process;
`tandem top --once` showing the fleet."""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.pb.tandem.v1 import frontend_pb2, frontend_pb2_grpc, sampling_pb2
from otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 40  # chunks of 16, 16 and 8 with --chunk-size 16, when nothing is cached
MAX_TOKENS = 4
SERVER, CLIENT = 2, 3  # opentelemetry.proto.trace.v1.Span.SpanKind


class Up:
    """`python -m cli.main up` as a child process, with the addresses it prints."""

    def __init__(self, env: dict[str, str], timeout_s: float = 180.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "cli.main", "up", "--insecure", "--model", "tandem-tiny",
                                      "--port", "0", "--http-port", "0"],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        self._reader = threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout], daemon=True)
        self._reader.start()
        self.router = ""
        self.http = ""
        self.metrics: dict[str, str] = {}
        deadline = time.monotonic() + timeout_s
        self.ready = False
        while len(self.metrics) < 3 or not self.ready:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise TimeoutError("tandem up did not print its addresses:\n" + "".join(self.output))
            self.output.append(line)
            if m := re.search(r"router at (\S+?),", line):
                self.router = m.group(1)
            self.ready = self.ready or line.startswith("tandem up: ready to serve tandem-tiny")
            if m := re.search(r"HTTP API at http://(\S+)/v1", line):
                self.http = m.group(1)
            if m := re.search(r"logs in (\S+?);", line):
                self.log_dir = Path(m.group(1))
            if m := re.search(r"metrics: (\S+) at http://(\S+)/metrics", line):
                self.metrics[m.group(1)] = m.group(2)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._reader.join(10)
        self.proc.stdout.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def cluster():
    with OtlpReceiver() as receiver:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "TANDEM_"))}
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
                   OTEL_BSP_SCHEDULE_DELAY="100", TANDEM_CHUNK_SIZE="16", TANDEM_NUM_BLOCKS="256",
                   TANDEM_LOG_FORMAT="json", TANDEM_LOG_LEVEL="info,router=debug")
        up = Up(env)
        try:
            yield up, receiver
        finally:
            assert up.stop() == 0, "".join(up.output)


def generate(router: str, trace_id: str, sampled: bool, tracestate: str = "") -> list[int]:
    """One Generate call whose parent is a made-up client span of `trace_id`; returns the tokens."""
    metadata = [("traceparent", f"00-{trace_id}-{'c' * 16}-{'01' if sampled else '00'}")]
    if tracestate:
        metadata.append(("tracestate", tracestate))
    prompt = [random.randrange(5, 200) for _ in range(PROMPT_TOKENS)]  # fresh: no prefix cache hit
    req = frontend_pb2.GenerateRequest(token_ids=prompt, sampling=sampling_pb2.SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True))
    with grpc.insecure_channel(router) as ch:
        return [t for msg in frontend_pb2_grpc.FrontendServiceStub(ch).Generate(req, metadata=metadata, timeout=120)
                for t in msg.token_ids]


EXPECTED = {  # (service, span name) -> (parent's service, parent's name); None = the client's span
    ("tandem-router", "/tandem.v1.FrontendService/Generate"): None,
    ("tandem-router", "tandem.route"): ("tandem-router", "/tandem.v1.FrontendService/Generate"),
    ("tandem-router", "/tandem.v1.DecodeService/Generate"): ("tandem-router", "/tandem.v1.FrontendService/Generate"),
    ("tandem-decode", "/tandem.v1.DecodeService/Generate"): ("tandem-router", "/tandem.v1.DecodeService/Generate"),
    ("tandem-decode", "/tandem.v1.PrefillService/Prefill"): ("tandem-decode", "/tandem.v1.DecodeService/Generate"),
    ("tandem-decode", "tandem.kv_receive"): ("tandem-decode", "/tandem.v1.DecodeService/Generate"),
    ("tandem-decode", "tandem.decode"): ("tandem-decode", "/tandem.v1.DecodeService/Generate"),
    ("tandem-prefill", "/tandem.v1.PrefillService/Prefill"): ("tandem-decode", "/tandem.v1.PrefillService/Prefill"),
    ("tandem-prefill", "tandem.prefill"): ("tandem-prefill", "/tandem.v1.PrefillService/Prefill"),
    ("tandem-prefill", "tandem.prefill.chunk"): ("tandem-prefill", "tandem.prefill"),
    ("tandem-prefill", "tandem.kv_transfer"): ("tandem-prefill", "/tandem.v1.PrefillService/Prefill"),
}


def complete(spans) -> bool:
    names = [(s.service, s.name) for s in spans]
    return set(EXPECTED) <= set(names) and names.count(("tandem-prefill", "tandem.prefill.chunk")) >= 3


def test_one_trace_per_request_across_processes(cluster):
    up, receiver = cluster
    trace_id = secrets.token_hex(16)
    assert len(generate(up.router, trace_id, sampled=True, tracestate="tandem=test,vendor=x1")) == MAX_TOKENS
    spans = receiver.wait_for(trace_id, complete, timeout_s=60)
    by_id = {s.span_id: s for s in spans}
    for s in spans:  # every span of the request is in this trace, with a parent inside it (or the client)
        assert s.trace_state == "tandem=test,vendor=x1", s
        want = EXPECTED[(s.service, s.name)]
        if want is None:
            assert s.parent_span_id == "c" * 16 and s.kind == SERVER
        else:
            parent = by_id[s.parent_span_id]
            assert (parent.service, parent.name) == want, (s, parent)
    one = {(s.service, s.name): s for s in spans}
    api = one[("tandem-router", "/tandem.v1.FrontendService/Generate")]
    assert api.attributes["tandem.completion_tokens"] == MAX_TOKENS and api.attributes["tandem.request_id"]
    route = one[("tandem-router", "tandem.route")].attributes
    assert sorted(route["tandem.route.candidates.role"]) == ["decode", "prefill"]
    assert len(route["tandem.route.candidates.cost"]) == len(route["tandem.route.candidates.overlap_blocks"]) == 2
    assert route["tandem.route.local_prefill"] is False and route["tandem.route.prefill_instance"]
    assert route["tandem.route.decode_instance"] in route["tandem.route.candidates.instance_id"]
    assert one[("tandem-router", "/tandem.v1.DecodeService/Generate")].kind == CLIENT
    prefill = one[("tandem-prefill", "tandem.prefill")].attributes
    assert prefill["tandem.prefill.chunks"] == 3 and prefill["tandem.prompt_tokens"] == PROMPT_TOKENS
    chunks = sorted(s.attributes["tandem.chunk.tokens"] for s in spans if s.name == "tandem.prefill.chunk")
    assert chunks == [8, 16, 16]
    transfer = one[("tandem-prefill", "tandem.kv_transfer")].attributes
    assert transfer["tandem.transfer.bytes"] > 0 and transfer["tandem.transfer.backend"] in ("shm", "nixl")
    assert transfer["tandem.transfer.writes"] >= 1
    assert transfer["tandem.transfer.seconds"] >= 0
    assert one[("tandem-decode", "tandem.decode")].attributes["tandem.decode.tokens"] == MAX_TOKENS
    # JSON logs: the router's debug line for this request carries its request id and trace id.
    lines = [json.loads(x) for x in (up.log_dir / "router.log").read_text().splitlines() if x.startswith("{")]
    mine = [x for x in lines if x["trace_id"] == trace_id]
    assert mine and all(x["request_id"] == api.attributes["tandem.request_id"] for x in mine), lines[-5:]
    assert any(x["level"] == "debug" and x["logger"] == "router.service" for x in mine)


def test_http_request_traced_like_grpc(cluster):
    """A request to the HTTP API gets a SERVER span (child of its traceparent header) with the
    gRPC path's spans below it."""
    up, receiver = cluster
    trace_id = secrets.token_hex(16)
    body = {"model": "tandem-tiny", "prompt": [random.randrange(5, 200) for _ in range(PROMPT_TOKENS)],
            "max_tokens": MAX_TOKENS, "ignore_eos": True}
    req = urllib.request.Request(f"http://{up.http}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          "traceparent": f"00-{trace_id}-{'c' * 16}-01"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert json.loads(resp.read())["usage"]["completion_tokens"] == MAX_TOKENS
    http = ("tandem-router", "POST /v1/completions")
    expected = {k: (http if v == ("tandem-router", "/tandem.v1.FrontendService/Generate") else v)
                for k, v in EXPECTED.items() if k != ("tandem-router", "/tandem.v1.FrontendService/Generate")}
    expected[http] = None
    spans = receiver.wait_for(trace_id, lambda ss: set(expected) <= {(s.service, s.name) for s in ss}, timeout_s=60)
    by_id = {s.span_id: s for s in spans}
    for s in spans:
        want = expected[(s.service, s.name)]
        if want is None:
            assert s.parent_span_id == "c" * 16 and s.kind == SERVER
        else:
            assert (by_id[s.parent_span_id].service, by_id[s.parent_span_id].name) == want, s
    api = next(s for s in spans if (s.service, s.name) == http)
    assert api.attributes["tandem.completion_tokens"] == MAX_TOKENS and api.attributes["tandem.request_id"]


def test_unsampled_context_stays_unsampled(cluster):
    up, receiver = cluster
    unsampled, barrier = secrets.token_hex(16), secrets.token_hex(16)
    assert len(generate(up.router, unsampled, sampled=False)) == MAX_TOKENS
    generate(up.router, barrier, sampled=True)
    receiver.wait_for(barrier, complete, timeout_s=60)  # every process has exported past the unsampled request
    time.sleep(0.5)
    assert receiver.trace(unsampled) == []


def _scrape(address: str) -> dict[str, list]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples} | \
        {"_samples": [s for fam in text_string_to_metric_families(text) for s in fam.samples]}


def _value(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples["_samples"] if s.name == name and labels.items() <= s.labels.items())


def test_every_process_serves_metrics(cluster):
    up, _ = cluster
    generate(up.router, secrets.token_hex(16), sampled=True)
    scraped = {iid: _scrape(addr) for iid, addr in up.metrics.items()}
    roles = {iid.split("-")[0] for iid in scraped}
    assert roles == {"router", "prefill", "decode"}, up.metrics
    for iid, m in scraped.items():
        if iid.startswith("router"):
            assert _value(m, "tandem_router_ttft_seconds_count") >= 1
            assert _value(m, "tandem_router_inter_token_latency_seconds_count") >= MAX_TOKENS - 1
            assert _value(m, "tandem_router_requests_total", outcome="length", code="OK") >= 1
            assert _value(m, "tandem_router_decision_seconds_count") >= 1
            assert _value(m, "tandem_router_kv_events_applied_total") > 0
            assert _value(m, "tandem_router_worker_healthy") == 2  # both workers, 1 each
            assert _value(m, "tandem_router_worker_routed_requests_total") >= 2
        elif iid.startswith("prefill"):
            assert _value(m, "tandem_worker_kv_transfers_total") >= 1
            assert _value(m, "tandem_worker_kv_transfer_bytes_total") > 0
            assert _value(m, "tandem_worker_kv_transfer_duration_seconds_count") >= 1
            assert _value(m, "tandem_worker_prefill_duration_seconds_count", where="remote") >= 1
            assert _value(m, "tandem_worker_kv_blocks") == 256
            assert _value(m, "tandem_worker_kv_cached_blocks") > 0
        else:
            assert _value(m, "tandem_worker_remote_prefills_total") >= 1
            assert _value(m, "tandem_worker_generated_tokens_total") >= MAX_TOKENS
            assert _value(m, "tandem_worker_prefix_cache_query_tokens_total") >= PROMPT_TOKENS
            assert _value(m, "tandem_worker_kv_event_batches_total") > 0


def test_top_once_shows_the_fleet(cluster, capsys):
    from cli.main import main

    up, _ = cluster
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:  # the CLI's entry point, in this process (a child would spend seconds importing torch)
        assert main(["top", "--router", up.router, "--once"]) == 0
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
    shown = capsys.readouterr().out
    for iid, addr in up.metrics.items():
        if not iid.startswith("router"):
            assert iid in shown and addr in shown
    assert shown.count("healthy") >= 2 and "prefill" in shown and "decode" in shown
