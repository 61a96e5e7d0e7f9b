"""Structured outputs over HTTP: a real server (the engine core in its own process, so the
params cross the process boundary) driven by the `openai` client."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from test_structured_engine import PHONE, SCHEMA, check_schema

pytest.importorskip("xgrammar")

MODEL = "smollm2"
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def url():
    port = _free_port()
    cmd = [
        sys.executable, "-m", "pagoda.entrypoints.openai.api_server", "--port", str(port),
        "--max-model-len", "512", "--served-model-name", MODEL, "--max-num-seqs", "4",
        "--kv-cache-memory-bytes", str(64 << 20), "--uvicorn-log-level", "warning",
        "--disable-log-stats",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        start = time.perf_counter()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stdout.read().decode()[-3000:]}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - start > 120:
                raise RuntimeError("server did not answer /health within 120 s")
            time.sleep(0.05)
        yield base
    finally:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def test_chat_json_schema(client):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=150,
        temperature=0,
        response_format=RESPONSE_FORMAT,
    )
    assert resp.choices[0].finish_reason == "stop"
    check_schema(resp.choices[0].message.content)


def test_chat_json_schema_stream(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=150,
        temperature=0.8,
        seed=4,
        stream=True,
        response_format=RESPONSE_FORMAT,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    check_schema(text)


def test_json_object_and_vllm_extra_body(client):
    resp = client.completions.create(
        model=MODEL,
        prompt="A JSON object:",
        max_tokens=100,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].text), dict)
    resp = client.completions.create(
        model=MODEL,
        prompt="Call me at",
        max_tokens=20,
        n=2,
        seed=1,
        temperature=1.0,
        extra_body={"structured_outputs": {"regex": PHONE}},
    )
    assert all(re.fullmatch(PHONE, c.text) for c in resp.choices)
    resp = client.completions.create(
        model=MODEL,
        prompt="The best pet is a",
        max_tokens=5,
        extra_body={"structured_outputs": {"choice": ["cat", "dog"]}},
    )
    assert resp.choices[0].text in ("cat", "dog")


INVALID = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
        "invalid structured_outputs.json",
    ),
    ({"structured_outputs": {"regex": "(abc"}}, "invalid structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= nope"}}, "invalid structured_outputs.grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one"),
    ({"structured_outputs": {"jsn": {}}}, "jsn"),
    ({"response_format": {"type": "xml"}}, "response_format"),
]


def test_invalid_constraint_is_400_and_server_keeps_serving(url, client):
    for body, match in INVALID:
        for stream in (False, True):
            r = httpx.post(
                url + "/v1/chat/completions",
                json={"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "stream": stream}
                | body,
                timeout=30,
            )
            assert r.status_code == 400, r.text
            assert re.search(match, r.json()["error"]["message"]), r.text
    resp = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=5,
        timeout=60,
        extra_body={"structured_outputs": {"choice": ["ok"]}},
    )
    assert resp.choices[0].message.content == "ok"
