"""vLLM's /ping, /load and /reset_prefix_cache: /ping answers as /health does (SageMaker's
probe); /load counts the generation requests in progress with --enable-server-load-tracking (0
without); with PAGODA_SERVER_DEV_MODE=1, POST /reset_prefix_cache empties the engine's prefix
cache, or answers 409 while requests hold KV blocks."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
import uvicorn
from fake_engine import FakeEngine
from fastapi import FastAPI
from fastapi.testclient import TestClient

from pagoda.engine.arg_utils import EngineArgs
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.exceptions import EngineDrainingError
from pagoda.server.app import build_app
from pagoda.server.cli import make_arg_parser

LONG = {"prompt": "a", "max_tokens": 100, "stream": True}  # 1 s at the fakes' 10 ms a step
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100, "stream": True}


@contextlib.contextmanager
def _serve(app: FastAPI) -> Iterator[str]:
    """`app` behind uvicorn on a thread (real connections: streams and disconnects)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(5)


def _wait_for(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _load(url: str) -> int:
    r = httpx.get(url + "/load")
    assert r.status_code == 200, r.text
    assert set(r.json()) == {"server_load"}, r.json()
    return r.json()["server_load"]


def _metric(text: str, name: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )


def test_ping_answers_as_health_on_get_and_post_and_needs_no_key() -> None:
    llm = AsyncLLM(FakeEngine())
    try:
        with TestClient(build_app(llm, api_key="sekret")) as c:  # open without the key
            for draining in (False, True):
                llm.draining = draining
                health = c.get("/health")
                assert health.status_code == (503 if draining else 200)
                for ping in (c.get("/ping"), c.post("/ping")):
                    assert ping.status_code == health.status_code
                    assert ping.json() == health.json()
                    assert ping.headers.get("retry-after") == health.headers.get("retry-after")
            assert c.get("/load").json() == {"server_load": 0}  # a balancer's poll: open too
            assert c.get("/v1/models").status_code == 401  # the rest still need it
            spec = c.get("/openapi.json", headers={"Authorization": "Bearer sekret"}).json()
            assert set(spec["paths"]["/ping"]) == {"get", "post"}
    finally:
        llm.shutdown()


def test_server_load_tracking_is_vllms_flag_off_by_default() -> None:
    parse = make_arg_parser().parse_args
    assert parse([]).enable_server_load_tracking is False
    assert parse(["--enable-server-load-tracking"]).enable_server_load_tracking is True
    assert parse(["--no-enable-server-load-tracking"]).enable_server_load_tracking is False


def test_load_is_zero_without_tracking() -> None:
    engine = FakeEngine(step_delay=0.01)
    llm = AsyncLLM(engine)
    try:
        with _serve(build_app(llm)) as url, httpx.Client(base_url=url) as client:
            assert _load(url) == 0
            with client.stream("POST", "/v1/completions", json=LONG) as r:
                assert r.status_code == 200
                lines = r.iter_lines()  # (held: a dropped iterator closes the connection)
                next(lines)
                assert engine.running  # in progress, and not counted
                assert _load(url) == 0
    finally:
        llm.shutdown()


def test_load_counts_requests_until_their_response_ends() -> None:
    engine = FakeEngine(step_delay=0.01)
    llm = AsyncLLM(engine)
    try:
        app = build_app(llm, enable_server_load_tracking=True)
        with _serve(app) as url, httpx.Client(base_url=url) as a, httpx.Client(base_url=url) as b:
            assert _load(url) == 0
            with a.stream("POST", "/v1/completions", json=LONG) as first:
                first_lines = first.iter_lines()  # (held: a dropped one closes the connection)
                next(first_lines)
                assert _load(url) == 1
                with b.stream("POST", "/v1/chat/completions", json=CHAT) as second:
                    second_lines = second.iter_lines()
                    next(second_lines)
                    assert _load(url) == 2  # (3 if /load counted itself)
                    assert "data: [DONE]" in list(first_lines)
                    assert _wait_for(lambda: _load(url) == 1)  # a stream, once it has ended
                    assert "data: [DONE]" in list(second_lines)
            assert _wait_for(lambda: _load(url) == 0)
            r = a.post("/v1/completions", json={"prompt": "a", "max_tokens": 3})
            assert r.status_code == 200 and _wait_for(lambda: _load(url) == 0)
            # Requests that fail are not counted after their answer either, nor ever twice.
            failing = [
                ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400),  # validation
                ("/v1/chat/completions", {"messages": "hi"}, 400),
                ("/v1/completions", {"prompt": "a", "model": "nope"}, 404),
                ("/v1/completions", {"prompt": "FAIL", "max_tokens": 8}, 500),  # in the engine
                ("/v1/completions", {"prompt": "FAIL", "max_tokens": 8, "stream": True}, 200),
            ]
            for route, body, status in failing:
                assert a.post(route, json=body).status_code == status, body
                assert _wait_for(lambda: _load(url) == 0), body
            assert a.get("/v1/completions").status_code == 405
            assert _wait_for(lambda: _load(url) == 0)
    finally:
        llm.shutdown()


def test_a_client_that_leaves_is_no_longer_counted() -> None:
    engine = FakeEngine(step_delay=0.01)
    llm = AsyncLLM(engine)
    try:
        app = build_app(llm, enable_server_load_tracking=True)
        with _serve(app) as url:
            with httpx.Client(base_url=url) as client:
                with client.stream("POST", "/v1/completions", json=LONG) as r:
                    lines = r.iter_lines()
                    next(lines)
                    assert _load(url) == 1
            # The stream closed after its first chunk, with its connection.
            assert _wait_for(lambda: _load(url) == 0 and not engine.running)
            with pytest.raises(httpx.ReadTimeout):  # not streamed: it leaves before the answer
                httpx.post(url + "/v1/completions", json={**LONG, "stream": False}, timeout=0.3)
            assert _wait_for(lambda: _load(url) == 0 and not engine.running)
            assert _load(url) == 0
    finally:
        llm.shutdown()


@pytest.mark.parametrize("dev_mode", [None, "0", "1"])
def test_reset_prefix_cache_is_served_only_in_dev_mode(monkeypatch, dev_mode) -> None:
    if dev_mode is None:
        monkeypatch.delenv("PAGODA_SERVER_DEV_MODE", raising=False)
    else:
        monkeypatch.setenv("PAGODA_SERVER_DEV_MODE", dev_mode)
    llm = AsyncLLM(FakeEngine())
    try:
        with TestClient(build_app(llm)) as c:
            r = c.post("/reset_prefix_cache")
            paths = c.get("/openapi.json").json()["paths"]
            if dev_mode == "1":
                assert r.status_code == 200 and r.content == b""  # vLLM's answer
                assert "409" in paths["/reset_prefix_cache"]["post"]["responses"]
                assert c.get("/reset_prefix_cache").status_code == 405
            else:
                assert r.status_code == 404
                assert r.json()["error"]["type"] == "NotFoundError"
                assert "/reset_prefix_cache" not in paths
            assert "/load" in paths and "/ping" in paths
    finally:
        llm.shutdown()


def test_reset_prefix_cache_is_refused_while_requests_hold_blocks(monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_SERVER_DEV_MODE", "1")
    engine = FakeEngine(step_delay=0.01)
    llm = AsyncLLM(engine)
    try:
        with _serve(build_app(llm)) as url, httpx.Client(base_url=url) as client:
            with client.stream("POST", "/v1/completions", json=LONG) as r:
                lines = r.iter_lines()
                next(lines)
                refused = httpx.post(url + "/reset_prefix_cache")
                assert "data: [DONE]" in list(lines)
            assert refused.status_code == 409
            error = refused.json()["error"]
            assert error["type"] == "ConflictError" and error["code"] == 409
            assert "hold KV-cache blocks" in error["message"] and "retry" in error["message"]
            assert _wait_for(lambda: not engine.running)
            assert httpx.post(url + "/reset_prefix_cache").status_code == 200
    finally:
        llm.shutdown()


def test_reset_prefix_cache_empties_the_engines_prefix_cache(monkeypatch) -> None:
    """The embedded model, its engine core in a child process as `pagoda serve` runs it: a
    repeated prompt's cached tokens are 0 after the reset, and come back after it."""
    monkeypatch.setenv("PAGODA_SERVER_DEV_MODE", "1")
    args = EngineArgs(max_model_len=256, kv_cache_memory_bytes=16 << 20, max_num_seqs=4)
    llm = AsyncLLM.from_engine_args(args, multiprocess=True)
    prompt = "The quick brown fox jumps over the lazy dog. " * 6  # several full blocks
    try:
        with TestClient(build_app(llm)) as c:

            def cached_tokens() -> float:
                """The prompt tokens the prefix cache held for one more request."""
                before = _metric(c.get("/metrics").text, "pagoda:prompt_tokens_cached_total")
                body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return _metric(c.get("/metrics").text, "pagoda:prompt_tokens_cached_total") - before

            cached_tokens()
            assert cached_tokens() >= 32
            r = c.post("/reset_prefix_cache")
            assert r.status_code == 200, r.text
            assert cached_tokens() == 0
            assert cached_tokens() >= 32
    finally:
        llm.shutdown()


@pytest.mark.parametrize("in_process", [True, False])
def test_async_llm_resets_through_the_engine_core(in_process: bool) -> None:
    """The command reaches the core on its thread or in its process, and is answered; once
    the core has stopped, the call raises rather than waits."""
    if in_process:
        llm = AsyncLLM(FakeEngine())
    else:
        llm = AsyncLLM(engine_factory=functools.partial(FakeEngine))
    try:
        assert asyncio.run(llm.reset_prefix_cache()) is True
    finally:
        llm.shutdown()
    with pytest.raises(EngineDrainingError):
        asyncio.run(asyncio.wait_for(llm.reset_prefix_cache(), 5))
