"""The HTTP front end under hostile and careless clients, on `pagoda serve`'s stack with the fake
engine (no model, so each case takes milliseconds): schemathesis against /openapi.json, bodies
too large, lone surrogates on a kept-alive connection, HTTP conformance, load shedding, the
engine core killed (restarted, then the server exits 1), and the drain's deadline."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
from servers import HERE, KEY, fake_server

sys.path.insert(0, str(HERE.parent / "server"))

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc (Linux)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = fake_server(tmp_path_factory.mktemp("fake") / "server.log", "--max-model-len", "256")
    s.wait_ready(60)
    yield s
    s.stop()


def test_schemathesis_finds_no_server_error_and_no_undocumented_status(server, tmp_path):
    st = shutil.which("st") or os.path.join(os.path.dirname(sys.executable), "st")
    if not os.path.exists(st):
        pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    cmd = [
        st, "run", server.url + "/openapi.json", "--seed", "0", "--max-examples", "25",
        "--checks", "not_a_server_error,status_code_conformance,content_type_conformance",
        "--request-timeout", "20", "--workers", "1", "--generation-database", "none",
        "--header", f"Authorization: Bearer {KEY}", "--no-color",
        "--phases", "examples,coverage,fuzzing", "--suppress-health-check", "all",
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert "Traceback" not in server.log()


def test_a_body_over_the_limit_is_413_and_the_server_stays_small(server):
    body = b'{"prompt": "' + b"a" * (5 << 20) + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=body, headers=server.headers)
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: refused as the bytes pass the limit
        for _ in range(10):
            yield b"a" * (1 << 20)

    r = httpx.post(server.url + "/v1/completions", content=chunks(), headers=server.headers)
    assert r.status_code == 413
    with open(f"/proc/{server.proc.pid}/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    assert rss_kb < 400_000, rss_kb
    assert httpx.get(server.url + "/health").status_code == 200


def test_lone_surrogate_is_400_on_a_connection_that_stays_open(server):
    headers = {**server.headers, "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, headers=headers) as c:
        for body in (
            b'{"prompt": "\\ud800", "max_tokens": 2}',
            b'{"prompt": "hi", "stop": ["\\udfff"]}',
        ):
            r = c.post("/v1/completions", content=body)
            assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text
        r = c.post(
            "/v1/chat/completions",
            content=b'{"messages": [{"role": "user", "content": "x\\ud800"}]}',
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        assert c.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2}).status_code == 200
        assert c.get("/health").status_code == 200
    log = server.log()
    assert "Traceback" not in log and " 500" not in log


def test_http_conformance(server):
    u = server.url
    r = httpx.get(u + "/health")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json()["status"] == "ok"
    assert httpx.head(u + "/health").status_code == 200
    r = httpx.get(u + "/v1/completions", headers=server.headers)
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    r = httpx.get(u + "/v1/models")
    assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
    assert (
        httpx.get(u + "/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    )
    assert httpx.get(u + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    spec = httpx.get(u + "/openapi.json", headers=server.headers).json()
    op = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert "422" not in op and {"400", "401", "413", "500", "503"} <= set(op)
    assert "422" not in json.dumps(spec["paths"])


def test_metrics_and_models_disclose_no_paths():
    from fake_engine import FakeEngine
    from fastapi.testclient import TestClient

    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.server.app import build_app

    engine = FakeEngine()
    engine.model_config.name = engine.model_config.model = "/srv/models/Smol-135M.Q4_1.gguf"
    llm = AsyncLLM(engine)
    try:
        with TestClient(build_app(llm)) as c:
            assert "/srv/" not in c.get("/metrics").text
            assert 'model_name="Smol-135M.Q4_1"' in c.get("/metrics").text
            assert "/srv/" not in c.get("/v1/models").text
            for name in ("Smol-135M.Q4_1", "/srv/models/Smol-135M.Q4_1.gguf"):  # both accepted
                r = c.post("/v1/completions", json={"prompt": "a", "model": name})
                assert r.status_code == 200, r.text
    finally:
        llm.shutdown()


def test_overload_answers_503_with_retry_after_and_serves_the_rest(tmp_path):
    s = fake_server(tmp_path / "server.log", "--max-num-seqs", "4", "--max-waiting-requests",
                    "4", "--step-delay", "0.01")  # fmt: skip
    try:
        s.wait_ready(60)

        async def one(c: httpx.AsyncClient) -> tuple[int, str | None, bool]:
            body = {"prompt": "Count:", "max_tokens": 20}
            r = await c.post(s.url + "/v1/completions", json=body, headers=s.headers)
            done = r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
            return r.status_code, r.headers.get("retry-after"), done

        async def flood() -> list:
            limits = httpx.Limits(max_connections=300)
            async with httpx.AsyncClient(timeout=60, limits=limits) as c:
                return await asyncio.gather(*[one(c) for _ in range(300)])

        results = asyncio.run(flood())
        codes = [r[0] for r in results]
        assert set(codes) == {200, 503}, codes
        assert all(r[1] == "1" for r in results if r[0] == 503)
        assert all(r[2] for r in results if r[0] == 200)  # everything admitted is served whole
        assert codes.count(200) >= 8
        with open(f"/proc/{s.proc.pid}/status") as f:
            rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        assert rss_kb < 400_000, rss_kb
        assert httpx.get(s.url + "/health").json()["status"] == "ok"
    finally:
        s.stop()


def test_max_waiting_requests_zero_serves_an_idle_server(tmp_path):
    s = fake_server(tmp_path / "server.log", "--max-waiting-requests", "0")
    try:
        s.wait_ready(60)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "a"}, headers=s.headers)
        assert r.status_code == 200
    finally:
        s.stop()


def test_queue_delay_limit_answers_503(tmp_path):
    s = fake_server(tmp_path / "server.log", "--max-num-seqs", "1", "--max-queue-delay-s",
                    "0.3", "--step-delay", "0.05", "--max-waiting-requests", "-1")  # fmt: skip
    try:
        s.wait_ready(60)

        async def main() -> list[int]:
            async with httpx.AsyncClient(timeout=60) as c:
                body = {"prompt": "a", "max_tokens": 40}
                rs = await asyncio.gather(
                    *[c.post(s.url + "/v1/completions", json=body, headers=s.headers)
                      for _ in range(4)]
                )  # fmt: skip
                return [r.status_code for r in rs]

        codes = asyncio.run(main())
        assert codes.count(200) >= 1 and 503 in codes, codes
    finally:
        s.stop()


def test_killed_engine_core_restarts_then_the_server_exits_1(tmp_path):
    s = fake_server(tmp_path / "server.log", "--max-engine-restarts", "1", "--die-on-prompt",
                    "DIE")  # fmt: skip
    try:
        s.wait_ready(60)
        h = s.headers
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "DIE"}, headers=h, timeout=30)
        assert r.status_code == 500 and "server log" in r.json()["error"]["message"]
        assert "Error(" not in r.text  # no exception repr reaches the client
        deadline = time.monotonic() + 60
        while httpx.get(s.url + "/health").json()["status"] != "ok":
            assert time.monotonic() < deadline, "the engine core was not restarted"
            time.sleep(0.1)
        assert s.metric("pagoda:engine_restarts_total") == 1
        assert (
            httpx.post(s.url + "/v1/completions", json={"prompt": "a"}, headers=h).status_code
            == 200
        )
        os.kill(s.engine_core_pid(), signal.SIGKILL)  # the second failure: no restart left
        assert s.proc.wait(30) == 1
        assert "exiting with code 1" in s.log()
    finally:
        s.stop()


def test_drain_deadline_ends_streams_in_band_and_exits_in_time(tmp_path):
    s = fake_server(tmp_path / "server.log", "--drain-timeout", "1", "--step-delay", "0.05")
    try:
        s.wait_ready(60)

        async def stream(started: asyncio.Event) -> list[str]:
            body = {"prompt": "a", "max_tokens": 250, "stream": True}
            lines = []
            async with httpx.AsyncClient(timeout=60) as c:
                async with c.stream("POST", s.url + "/v1/completions", json=body,
                                    headers=s.headers) as r:  # fmt: skip
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line[6:])
                            started.set()
            return lines

        async def main() -> tuple[list[str], float]:
            started = asyncio.Event()
            task = asyncio.ensure_future(stream(started))
            await asyncio.wait_for(started.wait(), 30)
            t0 = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            lines = await task
            await asyncio.get_running_loop().run_in_executor(None, s.proc.wait, 30)
            return lines, time.monotonic() - t0

        lines, took = asyncio.run(main())
        assert lines[-1] == "[DONE]"
        assert "error" in json.loads(lines[-2]) and "drain" in lines[-2]
        assert s.proc.returncode == 0 and took < 1 + 2 + 5, took  # timeout + 2 s, + slack
        log = s.log()
        assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
    finally:
        s.stop()
