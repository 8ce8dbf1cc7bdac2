"""A real OTLP/gRPC trace receiver for tests: the `TraceService` of `opentelemetry-proto`,
served on loopback by a grpc server in a background thread, keeping every span it receives
with the `service.name` of the process that sent it."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # resource attribute service.name
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    trace_state: str
    attributes: dict[str, Any]
    start_ns: int = 0  # start_time_unix_nano
    end_ns: int = 0  # end_time_unix_nano


def _value(v) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpReceiver) -> None:
        self.sink = sink

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ReceivedSpan(service, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                            s.name, s.kind, s.trace_state,
                                            {a.key: _value(a.value) for a in s.attributes},
                                            s.start_time_unix_nano, s.end_time_unix_nano))
        with self.sink.lock:
            self.sink.spans.extend(got)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """`with OtlpReceiver() as r:` serves at r.endpoint ("http://127.0.0.1:PORT")."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(0)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float) -> list[ReceivedSpan]:
        """The trace's spans once done(spans) holds; raises TimeoutError with what arrived."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.trace(trace_id)
            if done(spans):
                return spans
            if time.monotonic() > deadline:
                raise TimeoutError(f"trace {trace_id} incomplete after {timeout_s} s: "
                                   f"{sorted((s.service, s.name) for s in spans)}")
            time.sleep(0.05)
