"""OpenTelemetry request tracing, as vLLM's (`--otlp-traces-endpoint`, vllm/tracing): each
finished request becomes one span named "llm_request", kind SERVER, from its arrival to its
end, with vLLM's `gen_ai.*` attribute names (`SpanAttributes`), exported over OTLP (gRPC, or
HTTP/protobuf with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf). A request that came with
a W3C `traceparent` header gets its span in the caller's trace, as a child of the caller's span.

OpenTelemetry is optional (`pip install 'pagoda[tracing]'`) and imported only by
`RequestTracer` and `otel_import_error`, that is only where an endpoint is configured: the
engine's import path stays free of it. The span is built in the front end (the process that
runs the output processor), from the timestamps the request's metrics already keep.
"""

from __future__ import annotations

import atexit
import json
import logging
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

# The W3C trace-context headers a request may carry.
TRACE_HEADERS = ("traceparent", "tracestate")
# --collect-detailed-traces values: "model" adds the model forward time of the request's steps,
# "worker" the time the engine core spent executing them, "all" both.
DETAILED_TRACE_MODULES = ("model", "worker", "all")
OTLP_PROTOCOLS = ("grpc", "http/protobuf")
INSTALL_HINT = "pip install 'pagoda[tracing]' (opentelemetry-sdk and opentelemetry-exporter-otlp)"


class SpanAttributes:
    """vLLM's span attribute names (vllm/tracing/utils.py), so that its trace queries work."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_RESPONSE_FINISH_REASON = "gen_ai.response.finish_reasons"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_USAGE_CACHED_TOKENS = "gen_ai.usage.cached_tokens"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def extract_trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The trace-context headers among `headers` (an HTTP request's, any case)."""
    return {h: headers[h] for h in TRACE_HEADERS if h in headers}


def contains_trace_headers(headers: Mapping[str, str]) -> bool:
    return any(h in headers for h in TRACE_HEADERS)


_warned_disabled = False


def log_tracing_disabled_warning() -> None:
    """Once per process: a request carried a trace context that no span will join."""
    global _warned_disabled
    if not _warned_disabled:
        _warned_disabled = True
        logger.warning("Received a request with trace context but tracing is disabled")


def otel_import_error(protocol: str) -> str | None:
    """Why OpenTelemetry's SDK and the OTLP exporter for `protocol` cannot be imported (the
    error, one line), or None when they can."""
    try:
        import opentelemetry.sdk.trace  # noqa: F401

        if protocol == "grpc":
            import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
        else:
            import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    except ImportError as e:
        return f"{type(e).__name__}: {e}"
    return None


def check_tracing_available(protocol: str) -> None:
    """ValueError (one line, naming the pip command) where --otlp-traces-endpoint cannot work."""
    if protocol not in OTLP_PROTOCOLS:
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r} is not supported: "
            f"{' or '.join(OTLP_PROTOCOLS)}"
        )
    error = otel_import_error(protocol)
    if error is not None:
        raise ValueError(
            f"--otlp-traces-endpoint needs OpenTelemetry, which could not be imported ({error}):"
            f" {INSTALL_HINT}"
        )


def request_span_attributes(
    *,
    request_id: str,
    model: str,
    params: Any,
    max_tokens: int | None,
    num_prompt_tokens: int,
    num_generation_tokens: int,
    num_cached_tokens: int,
    finish_reasons: list[str],
    arrival_time: float,
    first_scheduled_time: float | None,
    first_token_time: float | None,
    last_token_time: float | None,
    finished_time: float,
    model_forward_time: float | None = None,
    model_execute_time: float | None = None,
) -> dict[str, Any]:
    """The attributes of a finished request's "llm_request" span, vLLM's names and units
    (seconds). Timestamps are the request's (time.time()); a phase it never reached is left
    out: a request that never left the queue has queue time and e2e only."""
    a = SpanAttributes
    attributes: dict[str, Any] = {
        a.GEN_AI_RESPONSE_MODEL: model,
        a.GEN_AI_REQUEST_ID: request_id,
        a.GEN_AI_REQUEST_N: params.n,
        a.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
        a.GEN_AI_REQUEST_TOP_P: params.top_p,
        a.GEN_AI_USAGE_NUM_SEQUENCES: len(finish_reasons),
        a.GEN_AI_USAGE_PROMPT_TOKENS: num_prompt_tokens,
        a.GEN_AI_USAGE_COMPLETION_TOKENS: num_generation_tokens,
        a.GEN_AI_USAGE_CACHED_TOKENS: num_cached_tokens,
        a.GEN_AI_RESPONSE_FINISH_REASON: json.dumps(finish_reasons),
        a.GEN_AI_LATENCY_E2E: finished_time - arrival_time,
    }
    if max_tokens is not None:
        attributes[a.GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
    scheduled = first_scheduled_time if first_scheduled_time is not None else first_token_time
    queue_end = scheduled if scheduled is not None else finished_time
    attributes[a.GEN_AI_LATENCY_TIME_IN_QUEUE] = queue_end - arrival_time
    if first_token_time is not None and scheduled is not None:
        last = last_token_time if last_token_time is not None else first_token_time
        attributes[a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = first_token_time - arrival_time
        attributes[a.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = first_token_time - scheduled
        attributes[a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = last - first_token_time
        attributes[a.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = last - scheduled
    if model_forward_time is not None:
        attributes[a.GEN_AI_LATENCY_TIME_IN_MODEL_FORWARD] = model_forward_time
    if model_execute_time is not None:
        attributes[a.GEN_AI_LATENCY_TIME_IN_MODEL_EXECUTE] = model_execute_time
    return attributes


class RequestTracer:
    """Exports "llm_request" spans to `endpoint` over OTLP (`protocol`: "grpc", as vLLM by
    default, or "http/protobuf", whose endpoint is the whole URL, e.g.
    http://collector:4318/v1/traces). Spans are batched and sent by OpenTelemetry's
    `BatchSpanProcessor` thread; `shutdown` (also run at exit) sends what is left.

    The tracer provider is this object's own, not OpenTelemetry's global one: two engines in
    one process may export to different endpoints. The resource comes from OpenTelemetry's
    environment (OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES)."""

    def __init__(self, endpoint: str, protocol: str = "grpc", model_name: str = "") -> None:
        check_tracing_available(protocol)
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            # As vLLM: a plain host:port is a plaintext channel (an https:// URL stays TLS).
            exporter: Any = OTLPSpanExporter(endpoint=endpoint, insecure=True)
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as OTLPHttpSpanExporter,
            )

            exporter = OTLPHttpSpanExporter(endpoint=endpoint)
        self.endpoint, self.protocol, self.model_name = endpoint, protocol, model_name
        self._provider = TracerProvider(resource=Resource.create({}))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("pagoda")
        self._server_kind = SpanKind.SERVER
        self._propagator = TraceContextTextMapPropagator()
        self._shut_down = False
        atexit.register(self.shutdown)
        logger.info("tracing: requests' spans go to %s over OTLP %s", endpoint, protocol)

    def emit(
        self,
        attributes: dict[str, Any],
        start_time: float,
        end_time: float,
        trace_headers: Mapping[str, str] | None = None,
    ) -> None:
        """One "llm_request" span from `start_time` to `end_time` (time.time() seconds), in the
        trace `trace_headers` (traceparent / tracestate) name, else in a new trace."""
        context = self._propagator.extract(trace_headers) if trace_headers else None
        span = self._tracer.start_span(
            "llm_request",
            context=context,
            kind=self._server_kind,
            attributes=attributes,
            start_time=int(start_time * 1e9),
        )
        span.end(end_time=max(int(end_time * 1e9), int(start_time * 1e9)))

    def force_flush(self, timeout_millis: int = 10_000) -> bool:
        """Send the spans ended so far; False if that took longer than the timeout."""
        return self._provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        """Send what is left and stop the exporter (a second call does nothing)."""
        if self._shut_down:
            return
        self._shut_down = True
        atexit.unregister(self.shutdown)
        self._provider.shutdown()


def make_request_tracer(observability_config: Any, model_name: str = "") -> RequestTracer | None:
    """The tracer an engine's front end uses: None unless the config has an endpoint."""
    endpoint = getattr(observability_config, "otlp_traces_endpoint", None)
    if not endpoint:
        return None
    from pagoda import envs

    return RequestTracer(endpoint, envs.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, model_name)
