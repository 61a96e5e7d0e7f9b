"""examples/monitoring for real: a Prometheus server (Debian's `prometheus`) started with the
shipped prometheus.yml (its target pointed at the test's port) scrapes a running server (the
fake-engine server: the real app and /metrics), requests flow, and every query of every panel
of grafana-pagoda.json runs through Prometheus's HTTP API and must return sensible values."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).parent
EXAMPLES = HERE.parents[1] / "examples" / "monitoring"
sys.path.insert(0, str(HERE.parent / "reliability"))
sys.path.insert(0, str(HERE))

from servers import ServerProcess, free_port  # noqa: E402
from traffic import Traffic, overload_once, restart_engine_once  # noqa: E402

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="the prometheus binary is missing (Debian: apt-get install prometheus; .ci/run "
    "installs it)",
)
KEY = "test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    cmd = [sys.executable, str(HERE / "monitored_fake_server.py"), "--api-key", KEY,
           "--served-model-name", "smol", "--uvicorn-log-level", "warning",
           "--max-num-seqs", "4", "--max-waiting-requests", "8",
           "--die-once-file", str(log.parent / "died")]  # fmt: skip
    s = ServerProcess(cmd, log).wait_ready(60)
    restart_engine_once(s.url, s.headers)
    overload_once(s.url, s.headers)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    config = (EXAMPLES / "prometheus.yml").read_text()
    assert '"localhost:8000"' in config
    config = config.replace('"localhost:8000"', f'"127.0.0.1:{server.port}"')
    config = config.replace("scrape_interval: 5s", "scrape_interval: 1s")
    (tmp / "prometheus.yml").write_text(config)
    port = free_port()
    log = open(tmp / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}", f"--storage.tsdb.path={tmp}/data",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp / "prometheus.log").read_text()[-2000:]
        try:
            if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(20)
    log.close()


def _query(url: str, expr: str) -> list[dict]:
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _targets() -> list[tuple[str, str, str]]:
    dash = json.loads((EXAMPLES / "grafana-pagoda.json").read_text())
    return [
        (p["title"], t["legendFormat"], t["expr"]) for p in dash["panels"] for t in p["targets"]
    ]


def _sensible(title: str, legend: str, values: list[float]) -> None:
    assert values and all(math.isfinite(v) for v in values), (title, legend, values)
    assert all(v >= 0 for v in values), (title, values)
    if title in ("KV-cache usage", "Prefix-cache hit rate", "Speculative decoding acceptance rate"):
        assert all(v <= 1 for v in values), (title, values)
    if "latency" in title.lower() or title == "Time to first token":
        assert all(0 < v < 60 for v in values), (title, legend, values)
    if title in ("Token throughput", "Prefix-cache hit rate", "Speculative decoding "
                 "acceptance rate", "Finished requests by reason"):  # fmt: skip
        assert all(v > 0 for v in values), (title, legend, values)


def test_every_grafana_panel_query_returns_data_from_a_real_prometheus(server, prometheus):
    targets = _targets()
    assert {t for t, _, _ in targets} >= {
        "Time to first token", "Token throughput", "Requests running / waiting",
        "KV-cache usage", "Prefix-cache hit rate", "Preemptions", "Finished requests by reason",
        "Speculative decoding acceptance rate", "Engine restarts", "GPU memory",
        "Admission rejections", "Prompt tokens: computed / cached",
        "Generation tokens per request: asked / produced",
    }  # fmt: skip
    with Traffic(server.url, {"Authorization": f"Bearer {KEY}"}):
        # Until Prometheus has scraped enough of the traffic that every query answers.
        deadline, missing = time.monotonic() + 90, targets
        while missing and time.monotonic() < deadline:
            time.sleep(2)
            missing = []
            for title, legend, expr in targets:
                expr = expr.replace("$model_name", "smol").replace("$__rate_interval", "30s")
                result = _query(prometheus, expr)
                if (
                    not result
                    or title == "Preemptions"
                    and not any(float(r["value"][1]) > 0 for r in result)
                ):
                    missing.append((title, legend, expr))
        assert not missing, f"no data for {missing}"
        reasons = set()
        for title, legend, expr in targets:
            expr = expr.replace("$model_name", "smol").replace("$__rate_interval", "30s")
            result = _query(prometheus, expr)
            _sensible(title, legend, [float(r["value"][1]) for r in result])
            if title == "Finished requests by reason":
                reasons = {r["metric"]["finished_reason"] for r in result}
    assert reasons >= {"stop", "length", "abort", "error", "repetition"}
    restarts = _query(prometheus, 'pagoda:engine_restarts_total{model_name="smol"}')
    assert [float(r["value"][1]) for r in restarts] == [1.0]
    # A vLLM dashboard's query, renamed, selects the same series: engine="0" as vLLM's.
    engine0 = _query(prometheus, 'pagoda:engine_restarts_total{engine="0"}')
    assert [r["metric"] for r in engine0] == [r["metric"] for r in restarts]
    # The burst refused at the door, by the limit it hit (no engine label, as vLLM's).
    refused = _query(prometheus, "pagoda:admission_rejections_total > 0")
    assert [r["metric"]["reason"] for r in refused] == ["max_num_queued_reqs"], refused
    assert "engine" not in refused[0]["metric"]
    up = _query(prometheus, 'up{job="pagoda"}')
    assert [float(r["value"][1]) for r in up] == [1.0]
    # The model variable of the dashboard lists the served name.
    r = httpx.get(prometheus + "/api/v1/label/model_name/values", timeout=10).json()
    assert "smol" in r["data"]
