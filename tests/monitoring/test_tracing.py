"""OpenTelemetry request tracing (vLLM's --otlp-traces-endpoint): a real `pagoda serve` on the
embedded model exports its "llm_request" spans over OTLP/HTTP, and an offline `LLM` over gRPC
(the default protocol), to collectors in this test that decode what arrives with
opentelemetry-proto's `ExportTraceServiceRequest`; the attributes are vLLM's names and agree
with the responses; a `traceparent` header puts the span in the caller's trace. Without
OpenTelemetry, the flag is a one-line error naming the pip command; without the flag nothing
of OpenTelemetry is imported."""

from __future__ import annotations

import gzip
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "reliability"))
from servers import real_server  # noqa: E402

from pagoda.engine.arg_utils import EngineArgs  # noqa: E402
from pagoda.server.cli import make_arg_parser  # noqa: E402


def _importable(*names: str) -> bool:
    try:
        for name in names:
            __import__(name)
    except ImportError:
        return False
    return True


HAS_OTEL = _importable(
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
)
HAS_OTEL_GRPC = HAS_OTEL and _importable(
    "grpc",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc",
)
needs_otel = pytest.mark.skipif(not HAS_OTEL, reason="pip install 'pagoda[tracing]'")
needs_otel_grpc = pytest.mark.skipif(not HAS_OTEL_GRPC, reason="pip install 'pagoda[tracing]'")
SPAN_KIND_SERVER = 2  # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER


# -- collectors ------------------------------------------------------------------------------
class Collector:
    """The spans OTLP exporters sent here, decoded by opentelemetry-proto."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self._cond = threading.Condition()

    def take(self, body: bytes) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )

        self.add(ExportTraceServiceRequest.FromString(body))

    def add(self, request: Any) -> None:
        with self._cond:
            for resource_spans in request.resource_spans:
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(scope_spans.spans)
            self._cond.notify_all()

    def wait_for(self, match: Callable[[Any], bool], timeout: float = 30.0) -> Any:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [s for s in self.spans if match(s)]
                if found:
                    assert len(found) == 1, found
                    return found[0]
                left = deadline - time.monotonic()
                assert left > 0, f"no such span among {[attributes(s) for s in self.spans]}"
                self._cond.wait(left)


class HTTPCollector(Collector):
    """POST /v1/traces, OTLP/HTTP with protobuf bodies."""

    def __init__(self) -> None:
        super().__init__()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
                    ExportTraceServiceResponse,
                )

                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                collector.take(body)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class GRPCCollector(Collector):
    """OTLP/gRPC: opentelemetry-proto's TraceService."""

    def __init__(self) -> None:
        super().__init__()
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        collector = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC's name
                collector.add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"127.0.0.1:{port}"

    def close(self) -> None:
        self.server.stop(0)


def attributes(span: Any) -> dict[str, Any]:
    out = {}
    for kv in span.attributes:
        out[kv.key] = getattr(kv.value, kv.value.WhichOneof("value"))
    return out


def _with_id(request_id: str) -> Callable[[Any], bool]:
    return lambda span: attributes(span).get("gen_ai.request.id") == request_id


def _check_latencies(a: dict[str, Any], span: Any, t0: float, t1: float) -> None:
    """The latencies are positive and add up, and the span covers the request's life."""
    e2e, ttft, queue = (
        a["gen_ai.latency.e2e"],
        a["gen_ai.latency.time_to_first_token"],
        a["gen_ai.latency.time_in_queue"],
    )
    prefill = a["gen_ai.latency.time_in_model_prefill"]
    decode = a["gen_ai.latency.time_in_model_decode"]
    inference = a["gen_ai.latency.time_in_model_inference"]
    assert 0 <= queue < ttft <= e2e <= t1 - t0, a
    assert prefill > 0 and decode > 0, a
    assert queue + prefill == pytest.approx(ttft, abs=1e-6), a
    assert prefill + decode == pytest.approx(inference, abs=1e-6), a
    assert queue + inference <= e2e + 1e-6, a
    start, end = span.start_time_unix_nano / 1e9, span.end_time_unix_nano / 1e9
    assert t0 <= start < end <= t1, (t0, start, end, t1)
    assert end - start == pytest.approx(e2e, abs=1e-3), (end - start, e2e)


# -- a served request, over OTLP/HTTP ----------------------------------------------------------
@pytest.fixture(scope="module")
def traced_server(tmp_path_factory):
    if not HAS_OTEL:
        pytest.skip("pip install 'pagoda[tracing]'")
    collector = HTTPCollector()
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "50"}
    server = real_server(
        tmp_path_factory.mktemp("tracing") / "server.log",
        "--max-model-len", "512", "--otlp-traces-endpoint", collector.endpoint,
        "--collect-detailed-traces", "all",
        env=env,
    )  # fmt: skip
    try:
        server.wait_ready()
        yield server, collector
    finally:
        server.stop()
        collector.close()


@needs_otel
def test_served_request_span_has_vllms_attributes_and_joins_the_callers_trace(traced_server):
    server, collector = traced_server
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    body = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 12,
            "temperature": 0.5, "top_p": 0.9, "n": 2}  # fmt: skip
    t0 = time.time()
    r = httpx.post(
        server.url + "/v1/completions",
        json=body,
        headers={**server.headers, "traceparent": f"00-{trace_id}-{parent_id}-01"},
        timeout=120,
    )
    t1 = time.time()
    assert r.status_code == 200, r.text
    response = r.json()
    span = collector.wait_for(_with_id(response["id"]))
    a = attributes(span)
    assert span.name == "llm_request" and span.kind == SPAN_KIND_SERVER
    # A child of the caller's span, in the caller's trace (before: no span at all).
    assert span.trace_id.hex() == trace_id and span.parent_span_id.hex() == parent_id
    usage = response["usage"]
    assert a["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] > 0
    assert a["gen_ai.response.model"] == response["model"] == "smol"
    assert a["gen_ai.request.n"] == 2 and a["gen_ai.usage.num_sequences"] == 2
    assert a["gen_ai.request.max_tokens"] == 12
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == 0.9
    reasons = sorted(c["finish_reason"] for c in response["choices"])
    assert sorted(json.loads(a["gen_ai.response.finish_reasons"])) == reasons
    _check_latencies(a, span, t0, t1)
    # --collect-detailed-traces all: the steps' forward passes within their executor calls,
    # measured in the engine core's process.
    forward = a["gen_ai.latency.time_in_model_forward"]
    execute = a["gen_ai.latency.time_in_model_execute"]
    assert 0 < forward <= execute <= a["gen_ai.latency.e2e"], a


@needs_otel
def test_a_request_without_traceparent_starts_a_trace_of_its_own(traced_server):
    server, collector = traced_server
    body = {"model": "smol", "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 5}
    r = httpx.post(
        server.url + "/v1/chat/completions", json=body, headers=server.headers, timeout=120
    )
    assert r.status_code == 200, r.text
    response = r.json()
    span = collector.wait_for(_with_id(response["id"]))
    assert span.parent_span_id == b"" and span.trace_id != bytes(16)
    a = attributes(span)
    assert a["gen_ai.usage.prompt_tokens"] == response["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == response["usage"]["completion_tokens"]
    assert a["gen_ai.request.n"] == 1


# -- offline, over gRPC --------------------------------------------------------------------------
@needs_otel_grpc
def test_offline_llm_exports_spans_over_grpc_by_default(monkeypatch):
    from pagoda import LLM, SamplingParams

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    collector = GRPCCollector()
    llm = None
    try:
        t0 = time.time()
        llm = LLM(otlp_traces_endpoint=collector.endpoint, max_model_len=256)
        t0 = time.time()
        outs = llm.generate(
            ["Hello there", "Explain paged attention."],
            SamplingParams(max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )
        t1 = time.time()
        assert llm.llm_engine.tracer.force_flush()
        for out in outs:
            span = collector.wait_for(_with_id(out.request_id))
            a = attributes(span)
            assert span.name == "llm_request" and span.kind == SPAN_KIND_SERVER
            assert span.parent_span_id == b""
            assert a["gen_ai.usage.prompt_tokens"] == len(out.prompt_token_ids)
            assert a["gen_ai.usage.completion_tokens"] == len(out.outputs[0].token_ids) == 8
            assert json.loads(a["gen_ai.response.finish_reasons"]) == ["length"]
            # The request's own metrics are the span's: the same clocks.
            m = out.metrics
            assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(
                m.first_token_time - m.arrival_time, abs=1e-6
            )
            assert a["gen_ai.latency.time_in_queue"] == pytest.approx(m.time_in_queue, abs=1e-6)
            _check_latencies(a, span, t0, t1)
            # No --collect-detailed-traces: no detailed timings.
            assert "gen_ai.latency.time_in_model_forward" not in a, a
            assert "gen_ai.latency.time_in_model_execute" not in a, a
        # An aborted request has its span too, its finish reason "abort".
        engine = llm.llm_engine
        engine.add_request("gone", "Once upon a time", SamplingParams(max_tokens=50))
        engine.step()
        engine.abort_request("gone")
        assert engine.tracer.force_flush()
        a = attributes(collector.wait_for(_with_id("gone")))
        assert json.loads(a["gen_ai.response.finish_reasons"]) == ["abort"], a
        assert a["gen_ai.latency.e2e"] >= a["gen_ai.latency.time_in_queue"] >= 0, a
    finally:
        if llm is not None and llm.llm_engine.tracer is not None:
            llm.llm_engine.tracer.shutdown()
        collector.close()


# -- flags and the missing dependency ------------------------------------------------------------
@needs_otel
def test_flags_parse_as_vllms() -> None:
    args = make_arg_parser().parse_args(
        ["--otlp-traces-endpoint", "collector:4317", "--collect-detailed-traces", "model", "worker"]
    )
    obs = EngineArgs.from_cli_args(args)._observability_config()
    assert obs.otlp_traces_endpoint == "collector:4317"
    assert obs.collect_detailed_traces == ("model", "worker")
    assert obs.collect_model_forward_time and obs.collect_model_execute_time
    # vLLM's older comma-separated form, and LLM(...)'s keyword.
    args = make_arg_parser().parse_args(
        ["--otlp-traces-endpoint", "x:1", "--collect-detailed-traces", "worker,model"]
    )
    assert EngineArgs.from_cli_args(args)._observability_config().collect_detailed_traces == (
        "worker",
        "model",
    )
    obs = EngineArgs(otlp_traces_endpoint="x:1", collect_detailed_traces="all")
    assert obs._observability_config().collect_model_forward_time
    obs = EngineArgs(otlp_traces_endpoint="x:1", collect_detailed_traces=["worker"])
    assert not obs._observability_config().collect_model_forward_time
    # Off by default.
    obs = EngineArgs.from_cli_args(make_arg_parser().parse_args([]))._observability_config()
    assert obs.otlp_traces_endpoint is None and obs.collect_detailed_traces is None
    with pytest.raises(ValueError, match="--collect-detailed-traces.*'gpu'"):
        EngineArgs(
            otlp_traces_endpoint="x:1", collect_detailed_traces="gpu"
        )._observability_config()


def test_detailed_traces_need_an_endpoint() -> None:
    with pytest.raises(ValueError, match="requires --otlp-traces-endpoint"):
        EngineArgs(collect_detailed_traces="all").check_model_config()


@needs_otel
def test_an_unknown_otlp_protocol_is_refused_naming_the_variable(monkeypatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL must be one of"):
        EngineArgs(otlp_traces_endpoint="x:1").check_model_config()


def test_serve_without_opentelemetry_fails_at_start_naming_the_pip_command(
    monkeypatch, capsys
) -> None:
    from pagoda.cli import main

    # OpenTelemetry made unimportable, as where it is not installed.
    for name in [m for m in sys.modules if m.split(".")[0] == "opentelemetry"]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    code = main(["serve", "--otlp-traces-endpoint", "localhost:4317", "--port", "0"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: --otlp-traces-endpoint needs OpenTelemetry"), err
    assert "pip install 'pagoda[tracing]'" in err, err


def test_without_the_flag_the_engine_imports_no_opentelemetry() -> None:
    code = (
        "import sys\n"
        "import pagoda.engine.async_llm, pagoda.engine.core, pagoda.entrypoints.llm\n"
        "from pagoda.tracing import SpanAttributes\n"
        "from pagoda.engine.arg_utils import EngineArgs\n"
        "EngineArgs().check_model_config()\n"
        "print([m for m in sys.modules if m.startswith('opentelemetry')])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_trace_headers_are_taken_only_when_tracing(monkeypatch, warnings) -> None:
    from types import SimpleNamespace

    import pagoda.tracing
    from pagoda.server.serving import ServingContext

    headers = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01", "x-other": "y"}
    on = ServingContext(SimpleNamespace(is_tracing_enabled=True), ["m"], 8, None)
    assert on.trace_headers(headers) == {"traceparent": headers["traceparent"]}
    # Without tracing the context is dropped, with a warning once (vLLM's).
    monkeypatch.setattr(pagoda.tracing, "_warned_disabled", False)
    off = ServingContext(SimpleNamespace(is_tracing_enabled=False), ["m"], 8, None)
    assert off.trace_headers(headers) is None and off.trace_headers(headers) is None
    said = [r.getMessage() for r in warnings]
    assert said == ["Received a request with trace context but tracing is disabled"], said
    assert off.trace_headers({"x-other": "y"}) is None
