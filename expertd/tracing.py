"""Optional OpenTelemetry tracing for the client and the server (docs/operations.md).

Off by default, and then it costs one attribute read per call: nothing imports
OpenTelemetry until tracing is turned on, by `configure(spec)` or the
EXPERTD_TRACE environment variable (the server's `--trace`), one of:

    off            no spans (the default)
    on             spans go to the application's own OpenTelemetry tracer provider
    console        an SDK provider printing each span to stdout
    otlp           an SDK provider exporting over OTLP (OTEL_EXPORTER_OTLP_* variables;
                   needs opentelemetry-exporter-otlp)
    jsonl:PATH     an SDK provider appending one JSON object per span to PATH

The SDK providers sample as OTEL_TRACES_SAMPLER says (default: parent-based,
always on). The caller's span context travels as a W3C `traceparent`: in the
gRPC metadata of a unary Forward, and in ForwardRequest.traceparent on a
ForwardStream, whose metadata is fixed when it opens. `pip install expertd[otel]`
installs the API and the SDK.

The server's spans for a request (queue, forward, encode) are recorded once it is
answered, with the times it measured anyway, so a traced request adds no work on
the path before its answer is written.
"""

from __future__ import annotations

import json
import os
import threading
import time

ENV = "EXPERTD_TRACE"
TRACEPARENT = "traceparent"  # the W3C header, also the ForwardRequest field's name
OFF_VALUES = ("", "off", "0", "false", "no")  # EXPERTD_TRACE values that turn tracing off
ON_VALUES = ("on", "1", "true", "yes")  # ... that hand spans to the application's provider

# perf_counter_ns() + this = time_ns(): the server measures with the former, spans
# carry the latter.
_WALL_OFFSET_NS = time.time_ns() - time.perf_counter_ns()

_tracer = None  # an OpenTelemetry Tracer while tracing is on
_provider = None  # the SDK provider we made (None: off, or the application's own)
_lock = threading.Lock()


def active() -> bool:
    """Is tracing on in this process?"""
    return _tracer is not None


def tracer():
    """The OpenTelemetry tracer (only while `active()`)."""
    return _tracer


def wall_ns(perf_ns: int) -> int:
    """A time.perf_counter_ns() value as epoch nanoseconds (a span's clock)."""
    return perf_ns + _WALL_OFFSET_NS


def configure(spec: str | None = None, *, provider=None) -> bool:
    """Turn tracing on or off -> whether it is on. `spec`: see the module's doc
    (None: the EXPERTD_TRACE variable); `provider`: an OpenTelemetry
    TracerProvider to use (tests, applications with their own)."""
    global _tracer, _provider, _env_read
    _env_read = True
    spec = (os.environ.get(ENV, "") if spec is None else spec).strip()
    with _lock:
        _shutdown_locked()
        if provider is None and spec.lower() in OFF_VALUES:
            return False
        try:
            from opentelemetry import trace
        except ImportError:
            raise RuntimeError(
                f"tracing ({ENV}={spec}) needs OpenTelemetry: pip install 'expertd[otel]'"
            ) from None
        if provider is None and spec.lower() not in ON_VALUES:
            provider = _provider = _sdk_provider(spec)
        source = provider if provider is not None else trace.get_tracer_provider()
        _tracer = source.get_tracer("expertd")
        return True


def shutdown() -> None:
    """Flush and stop the provider `configure` made (a no-op otherwise); tracing off."""
    with _lock:
        _shutdown_locked()


def _shutdown_locked() -> None:
    global _tracer, _provider
    provider, _tracer, _provider = _provider, None, None
    if provider is not None:
        provider.shutdown()  # exports what the batch processor still holds


def _sdk_provider(spec: str):
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    kind, _, arg = spec.partition(":")
    kind = kind.lower()
    if kind == "console":
        exporter = ConsoleSpanExporter()
    elif kind == "jsonl" and arg:
        exporter = JsonLinesExporter(arg)
    elif kind == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise RuntimeError(
                f"{ENV}=otlp needs the OTLP exporter: pip install opentelemetry-exporter-otlp"
            ) from None
        exporter = OTLPSpanExporter()
    else:
        raise ValueError(f"{ENV}={spec!r}: want off, on, console, otlp or jsonl:PATH")
    name = os.environ.get("OTEL_SERVICE_NAME", "expertd")
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class JsonLinesExporter:
    """A span exporter appending one JSON object per span to a file: trace_id,
    span_id, parent_span_id (hex, as in traceparent), name, start_ns, end_ns,
    attributes, service. For tests and offline reading; no collector needed."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (held)
        self._lock = threading.Lock()

    def export(self, spans):
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = []
        for s in spans:
            parent = s.parent
            lines.append(
                json.dumps(
                    {
                        "trace_id": f"{s.context.trace_id:032x}",
                        "span_id": f"{s.context.span_id:016x}",
                        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
                        "name": s.name,
                        "start_ns": s.start_time,
                        "end_ns": s.end_time,
                        "attributes": dict(s.attributes or {}),
                        "service": (s.resource.attributes or {}).get("service.name"),
                    }
                )
            )
        with self._lock:
            if not self._file.closed:
                self._file.write("".join(line + "\n" for line in lines))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


# -- context in and out -----------------------------------------------------------------


def traceparent(span) -> str:
    """The W3C traceparent naming `span` as the parent ("" when it is not recording)."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return ""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


# A traceparent in binary, as the slot transports carry it (shm's control block, the raw
# TCP and NIXL call headers): trace id high and low 64 bits, span id, flags. A span id
# of 0 (invalid in W3C) means "no parent".
NO_CONTEXT = (0, 0, 0, 0)


def context_fields(value: str) -> tuple[int, int, int, int]:
    """A W3C traceparent -> (trace_hi, trace_lo, span_id, flags); NO_CONTEXT for ""
    or anything that is not one."""
    parts = value.split("-") if value else ()
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16 or len(parts[3]) != 2:
        return NO_CONTEXT
    try:
        trace, span, flags = int(parts[1], 16), int(parts[2], 16), int(parts[3], 16)
    except ValueError:
        return NO_CONTEXT
    if not trace or not span:
        return NO_CONTEXT
    return trace >> 64, trace & 0xFFFFFFFFFFFFFFFF, span, flags


def from_fields(trace_hi: int, trace_lo: int, span_id: int, flags: int) -> str:
    """context_fields' inverse ("" for no parent)."""
    if not span_id or not (trace_hi or trace_lo):
        return ""
    return f"00-{trace_hi:016x}{trace_lo:016x}-{span_id:016x}-{flags & 0xFF:02x}"


def parent_context(value: str):
    """An OpenTelemetry Context whose parent is the remote span in a traceparent
    (None when `value` is empty or not a W3C traceparent: a root span)."""
    if not value:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    ctx = TraceContextTextMapPropagator().extract({TRACEPARENT: value})
    from opentelemetry import trace

    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def record(name: str, start_ns: int, end_ns: int, parent=None, attributes=None):
    """A finished span from perf_counter_ns() times -> the span (for children).
    `parent`: a Context, or a span."""
    from opentelemetry import trace

    if parent is not None and not isinstance(parent, dict) and hasattr(parent, "get_span_context"):
        parent = trace.set_span_in_context(parent)
    span = _tracer.start_span(
        name, context=parent, attributes=attributes, start_time=wall_ns(start_ns)
    )
    span.end(end_time=wall_ns(end_ns))
    return span


def start(name: str, attributes=None, parent=None):
    """Start a span (a child of `parent`, a Context, else of the current span)."""
    return _tracer.start_span(name, context=parent, attributes=attributes)


def current_context():
    """The current OpenTelemetry Context (to carry a parent to another thread)."""
    from opentelemetry import context

    return context.get_current()


def attach(span):
    """Make `span` current in this task or thread -> a token for `detach`."""
    from opentelemetry import context, trace

    return context.attach(trace.set_span_in_context(span))


def detach(token) -> None:
    from opentelemetry import context

    context.detach(token)


def end(span, error: BaseException | None = None) -> None:
    """End `span`, marked as failed with `error`'s text when there is one."""
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()


_env_read = False


def configure_from_env() -> None:
    """Turn tracing on as EXPERTD_TRACE says, once per process, unless `configure`
    was called already (a client calls this when it is made)."""
    global _env_read
    if _env_read:
        return
    _env_read = True
    if _tracer is None and os.environ.get(ENV, "").strip():
        configure()
