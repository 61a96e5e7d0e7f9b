"""Writes grafana-pagoda.json, the Grafana dashboard of a Pagoda server, from the panel list
below (the one place the PromQL lives; tests/monitoring runs every query against a real
Prometheus). Run it after editing a panel:

    python examples/monitoring/build_dashboard.py
"""

from __future__ import annotations

import json
import os

M = 'model_name="$model_name"'
RATE = "$__rate_interval"


def quantiles(metric: str, qs: tuple[float, ...], by: str = "le") -> list[tuple[str, str]]:
    return [
        (f"histogram_quantile({q}, sum by({by}) (rate(pagoda:{metric}_bucket{{{M}}}[{RATE}])))",
         f"p{round(q * 100)}")
        for q in qs
    ]  # fmt: skip


def ratio(num: str, den: str) -> str:
    """num / den over the window; no value (not NaN) while den did not move."""
    return (f"sum(rate(pagoda:{num}{{{M}}}[{RATE}])) / "
            f"(sum(rate(pagoda:{den}{{{M}}}[{RATE}])) > 0)")  # fmt: skip


# (title, unit, [(PromQL, legend)], description)
PANELS: list[tuple[str, str, list[tuple[str, str]], str]] = [
    ("Time to first token", "s", quantiles("time_to_first_token_seconds", (0.5, 0.95, 0.99)),
     "Prefill speed and queueing: time from arrival to the first token."),
    ("Time per output token / inter-token latency", "s",
     [(e, "TPOT " + p) for e, p in quantiles("request_time_per_output_token_seconds", (0.5, 0.99))]
     + [(e, "ITL " + p) for e, p in quantiles("inter_token_latency_seconds", (0.5, 0.99))],
     "Decode speed: per request (TPOT) and between consecutive tokens (ITL)."),
    ("End-to-end request latency", "s", quantiles("e2e_request_latency_seconds", (0.5, 0.95, 0.99)),
     "From arrival to the last token."),
    ("Token throughput", "tokens/s",
     [(f"sum(rate(pagoda:prompt_tokens_total{{{M}}}[{RATE}]))", "prompt tokens/s"),
      (f"sum(rate(pagoda:generation_tokens_total{{{M}}}[{RATE}]))", "generation tokens/s")],
     "Prefill and decode tokens per second."),
    ("Requests running / waiting", "short",
     [(f"sum(pagoda:num_requests_running{{{M}}})", "running"),
      (f"sum(pagoda:num_requests_waiting{{{M}}})", "waiting (queue)"),
      (f'sum(pagoda:num_requests_waiting_by_reason{{{M},reason="deferred"}})',
       "waiting: deferred (constraint compiling)")],
     "A queue that keeps growing means the server cannot keep up. Deferred: waiting for a "
     "structured-outputs constraint to compile, not for room in the batch."),
    ("Admission rejections", "reqps",
     [(f"sum by(reason) (rate(pagoda:admission_rejections_total{{{M}}}[{RATE}]))", "{{reason}}")],
     "Requests refused at the door for load (HTTP 503 with Retry-After), by the limit hit: "
     "max_num_queued_reqs (--max-waiting-requests), grammar_compile_backlog, "
     "grammar_max_abandoned."),
    ("KV-cache usage", "percentunit", [(f"max(pagoda:kv_cache_usage_perc{{{M}}})", "used")],
     "Fraction of KV blocks in use; near 1 requests wait or are preempted."),
    ("Prefix-cache hit rate", "percentunit",
     [(ratio("prefix_cache_hits_total", "prefix_cache_queries_total"), "hit rate")],
     "Prompt tokens found in the prefix cache, of those looked up."),
    ("Prompt tokens: computed / cached", "tokens/s",
     [(f'sum(rate(pagoda:prompt_tokens_by_source_total{{{M},source="local_compute"}}[{RATE}]))',
       "computed"),
      (f"sum(rate(pagoda:prompt_tokens_cached_total{{{M}}}[{RATE}]))", "cached")],
     "Requests' prompt tokens the model computed, and those the prefix cache held."),
    ("Preemptions", "short",
     [(f"sum(increase(pagoda:num_preemptions_total{{{M}}}[{RATE}]))", "preemptions")],
     "Requests evicted from the KV cache to make room (recomputed later)."),
    ("Speculative decoding acceptance rate", "percentunit",
     [(ratio("spec_decode_num_accepted_tokens_total", "spec_decode_num_draft_tokens_total"),
       "accepted / drafted")],
     "Draft tokens accepted by the target model (speculative decoding only)."),
    ("Generation tokens per request: asked / produced", "short",
     [(e, "max_tokens " + p) for e, p in quantiles("request_params_max_tokens", (0.5, 0.99))]
     + [(e, "produced " + p)
        for e, p in quantiles("request_max_num_generation_tokens", (0.5, 0.99))],
     "Each request's max_tokens (resolved against the context), and the most tokens one of "
     "its n samples generated (vLLM's max generation tokens in sequence group)."),
    ("Finished requests by reason", "reqps",
     [(f"sum by(finished_reason) (rate(pagoda:request_success_total{{{M}}}[{RATE}]))",
       "{{finished_reason}}")],
     "stop / length are normal ends; abort is a client gone, error a request that failed."),
    ("Engine restarts", "short",
     [(f"max(pagoda:engine_restarts_total{{{M}}})", "restarts")],
     "Times the engine core was restarted after a failure (--max-engine-restarts)."),
    ("GPU memory", "bytes",
     [(f"sum by(gpu) (pagoda:gpu_memory_used_bytes{{{M}}})", "used GPU {{gpu}}"),
      (f"sum by(gpu) (pagoda:gpu_memory_total_bytes{{{M}}})", "total GPU {{gpu}}")],
     "Device memory in use (all processes), where the server has an NVIDIA GPU."),
]  # fmt: skip

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def panel(i: int, title: str, unit: str, targets: list[tuple[str, str]], desc: str) -> dict:
    return {
        "id": i + 1,
        "type": "timeseries",
        "title": title,
        "description": desc,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {
            "defaults": {"unit": unit, "min": 0, "custom": {"lineWidth": 2, "fillOpacity": 10}},
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "multi"},
        },  # fmt: skip
        "targets": [
            {"datasource": DATASOURCE, "expr": e, "legendFormat": legend, "refId": chr(65 + j)}
            for j, (e, legend) in enumerate(targets)
        ],
    }


def dashboard() -> dict:
    return {
        "title": "Pagoda",
        "uid": "pagoda-serving",
        "description": "Latency, throughput, queue, KV cache and health of a Pagoda server "
        "(pagoda serve exposes /metrics under vLLM's metric names with the pagoda: prefix).",
        "tags": ["pagoda", "llm", "inference"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "model_name",
                    "label": "Model",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "query": {
                        "query": "label_values(pagoda:num_requests_running, model_name)",
                        "refId": "model_name",
                    },
                    "definition": "label_values(pagoda:num_requests_running, model_name)",
                    "refresh": 2,
                    "current": {},
                    "hide": 0,
                },
            ]
        },  # fmt: skip
        "panels": [panel(i, *p) for i, p in enumerate(PANELS)],
    }


def main() -> None:
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grafana-pagoda.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(dashboard(), f, indent=2)
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
