"""OpenTelemetry tracing: one trace per request across router, prefill and decode
(docs/observability.md, "Tracing", lists every span).

Configured only by the standard `OTEL_*` environment variables. Tracing is on when an OTLP
endpoint is set (`OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`), unless
`OTEL_SDK_DISABLED=true` or `OTEL_TRACES_EXPORTER=none`. Off, nothing is installed: no
interceptors on servers or channels, and `span()` returns one shared no-op context manager,
so the request path pays one function call and one global read per would-be span.

On, every process exports spans over OTLP/gRPC with a batch processor (`OTEL_BSP_*`), its
sampler comes from `OTEL_TRACES_SAMPLER` (default `parentbased_always_on`) and is always
wrapped in a parent-based sampler, so an incoming unsampled context stays unsampled whatever
the root sampler is. Context travels in gRPC metadata as W3C `traceparent` / `tracestate`
(`OTEL_PROPAGATORS`, default tracecontext and baggage); an incoming `tracestate` is kept on
every span of the trace and passed on.

Server side we use the public `opentelemetry-instrumentation-grpc` aio server interceptor.
Client side we use our own small interceptor (`_ClientTracing`): the public one ends a
server-streaming call's span only when the response iterator is exhausted, and the router
stops reading a decode stream at its finishing message or a stop string, so the span would
end whenever the call object is garbage collected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

import grpc

log = logging.getLogger(__name__)

TRACER_NAME = "tandem"
# Decode span attribute: MTP draft tokens accepted by the target's verify steps for the request
# (filled by the decode runtime's MTP code; decode_worker/service.py reads it off the request).
MTP_ACCEPTED_TOKENS = "tandem.mtp.accepted_tokens"
# RPCs that are not part of a request: health probes, reflection, the KV event streams, and
# `tandem top`'s polling.
_UNTRACED_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.", "/tandem.v1.KvEventService/",
                      "/tandem.v1.FrontendService/ClusterStatus",
                      # a router's long-lived stream to a decode worker: each request in it gets
                      # its own Generate spans (client_span; worker/session.py)
                      "/tandem.v1.DecodeService/Session")

_tracer: Any = None  # an SDK tracer once setup() turned tracing on; None = off
_provider: Any = None


def configured() -> bool:
    """Whether the OTEL_* environment asks for tracing (see the module docstring)."""
    env = os.environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def enabled() -> bool:
    return _tracer is not None


def setup(role: str) -> bool:
    """Install the tracer provider and OTLP exporter of this process, once; True when on.

    role: "router", "prefill" or "decode" — the default `service.name` is `tandem-{role}`
    (`OTEL_SERVICE_NAME` or `OTEL_RESOURCE_ATTRIBUTES` win); `tandem.role` is always set.
    """
    global _tracer, _provider
    if _tracer is not None or not configured():
        return _tracer is not None
    # Imported here: with tracing off the SDK and exporter are never loaded.
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased

    attrs: dict[str, Any] = {"tandem.role": role}
    if not os.environ.get("OTEL_SERVICE_NAME") and "service.name=" not in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attrs[SERVICE_NAME] = f"tandem-{role}"
    sampler = TracerProvider(shutdown_on_exit=False).sampler  # the one OTEL_TRACES_SAMPLER names
    if not isinstance(sampler, ParentBased):
        sampler = ParentBased(root=sampler)
    provider = TracerProvider(resource=Resource.create(attrs), sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _provider = provider
    _tracer = provider.get_tracer(TRACER_NAME)
    log.info("tracing on: OTLP/gRPC to %s, sampler %s", os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
             or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"), sampler.get_description())
    return True


def use_provider(provider: Any) -> Any:
    """Trace with this SDK TracerProvider (or turn tracing off with None) without touching the
    global provider; returns the previous one. For tests and for embedding Tandem in a process
    that manages its own provider. Servers and channels created afterwards get interceptors."""
    global _tracer, _provider
    previous = _provider
    _provider = provider
    _tracer = provider.get_tracer(TRACER_NAME) if provider is not None else None
    return previous


def shutdown() -> None:
    """Flush and stop the exporter (also runs at interpreter exit)."""
    global _tracer, _provider
    if _provider is not None:
        _provider.shutdown()
    _tracer = _provider = None


class _NoSpan:
    """What `span()` yields when tracing is off: every call is a no-op."""

    def is_recording(self) -> bool:
        return False

    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: dict) -> None:
        pass

    def add_event(self, name: str, attributes: dict | None = None) -> None:
        pass

    def get_span_context(self) -> Any:
        return None


NO_SPAN = _NoSpan()
NO_SPAN_CM = contextlib.nullcontext(NO_SPAN)


def span(name: str, attributes: dict[str, Any] | None = None):
    """A context manager around a child span of the current one, named `name`.

    Off: a shared no-op context manager yielding NO_SPAN. Build costly attributes only under
    `if s.is_recording():` (also False for an unsampled request).
    """
    if _tracer is None:
        return NO_SPAN_CM
    return _tracer.start_as_current_span(name, attributes=attributes)


def record_span(name: str, start_ns: int, end_ns: int, attributes: dict[str, Any] | None = None,
                parent: Any = None) -> Any:
    """A finished span over [start_ns, end_ns] (time.time_ns() of this host), child of `parent`
    or of the current span: for work timed elsewhere, e.g. a pipeline stage process.
    NO_SPAN when tracing is off."""
    if _tracer is None:
        return NO_SPAN
    from opentelemetry import trace
    context = trace.set_span_in_context(parent) if parent is not None else None
    s = _tracer.start_span(name, context=context, attributes=attributes, start_time=start_ns)
    s.end(end_time=end_ns)
    return s


def server_span(name: str, carrier: dict[str, str], attributes: dict[str, Any] | None = None):
    """A SERVER span for a request that did not come over gRPC (the HTTP API), child of the
    W3C `traceparent` in `carrier` (the request's headers) when there is one; NO_SPAN_CM when
    tracing is off. Enter it in the task that runs the request, so that its spans nest."""
    if _tracer is None:
        return NO_SPAN_CM
    from opentelemetry import trace
    from opentelemetry.propagate import extract

    return _tracer.start_as_current_span(name, context=extract(carrier), kind=trace.SpanKind.SERVER,
                                         attributes=attributes)


def current_span() -> Any:
    """The active span (NO_SPAN when tracing is off), e.g. to add attributes to the RPC's span."""
    if _tracer is None:
        return NO_SPAN
    from opentelemetry import trace
    return trace.get_current_span()


def trace_id_hex() -> str:
    """The current trace id as 32 hex digits, or "" (no tracing, or no valid span)."""
    if _tracer is None:
        return ""
    from opentelemetry import trace
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""


def _traced(method: str | bytes) -> bool:
    if isinstance(method, bytes):
        method = method.decode()
    return not method.startswith(_UNTRACED_PREFIXES)


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    """Interceptors for a grpc.aio server: a SERVER span per RPC, the caller's context as parent."""
    if _tracer is None:
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [aio_server_interceptor(tracer_provider=_provider,
                                   filter_=lambda details: _traced(details.method))]


class _ClientTracing:
    """A CLIENT span per outgoing call, ended when the call is done (however it ends), and
    the span's context injected into the call's metadata as W3C traceparent/tracestate."""

    async def _intercept(self, continuation, details: grpc.aio.ClientCallDetails, request):
        if _tracer is None or not _traced(details.method):
            return await continuation(details, request)
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        span, carrier = client_span(method)
        metadata = grpc.aio.Metadata(*(tuple(details.metadata or ()) + tuple(carrier.items())))
        details = grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                             details.wait_for_ready)
        try:
            call = await continuation(details, request)
        except BaseException as exc:
            _end_span(span, grpc.StatusCode.UNKNOWN, repr(exc))
            raise
        call.add_done_callback(lambda c: _keep(asyncio.ensure_future(_end_span_when_done(span, c))))
        return call



def client_span(method: str) -> tuple[Any, dict[str, str]]:
    """A CLIENT span for the gRPC method "/service/name", started now, and the W3C carrier of
    its context (traceparent, tracestate) for the callee; (None, {}) when tracing is off. End
    it with end_client_span. (A request carried in a DecodeService Session gets one, as a
    Generate call gets one from the client interceptor.)"""
    if _tracer is None:
        return None, {}
    from opentelemetry import context, trace
    from opentelemetry.propagate import inject

    span = _tracer.start_span(method, kind=trace.SpanKind.CLIENT, attributes=rpc_attributes(method))
    carrier: dict[str, str] = {}
    inject(carrier, context=trace.set_span_in_context(span, context.get_current()))
    return span, carrier


def end_client_span(span: Any, code: grpc.StatusCode, details: str) -> None:
    """End a client_span span with the call's status (nothing when span is None)."""
    if span is not None:
        _end_span(span, code, details)


# grpc.aio files an interceptor under the first kind it is an instance of: one class per kind.
class _UnaryUnaryTracing(_ClientTracing, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await self._intercept(continuation, client_call_details, request)


class _UnaryStreamTracing(_ClientTracing, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await self._intercept(continuation, client_call_details, request)


_ending: set[asyncio.Future] = set()  # strong references to the span-ending tasks


def _keep(task: asyncio.Future) -> None:
    _ending.add(task)
    task.add_done_callback(_ending.discard)


async def _end_span_when_done(span: Any, call: grpc.aio.Call) -> None:
    try:
        code, details = await call.code(), await call.details()
    except BaseException:  # noqa: BLE001 - never let a span keep a failure alive
        code, details = grpc.StatusCode.UNKNOWN, ""
    _end_span(span, code, details)


def set_rpc_status(span: Any, code: grpc.StatusCode, details: str) -> None:
    """Record a gRPC call's final status on its span (`rpc.grpc.status_code`; ERROR unless OK)."""
    if not span.is_recording():
        return
    from opentelemetry.trace import Status, StatusCode

    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details}"))


def rpc_attributes(method: str) -> dict[str, str]:
    """The gRPC semantic-convention attributes of a span for the method "/service/name"."""
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def _end_span(span: Any, code: grpc.StatusCode, details: str) -> None:
    set_rpc_status(span, code, details)
    span.end()


def client_interceptors() -> list[Any]:
    """Interceptors for a grpc.aio channel ([] when tracing is off)."""
    return [_UnaryUnaryTracing(), _UnaryStreamTracing()] if _tracer is not None else []
