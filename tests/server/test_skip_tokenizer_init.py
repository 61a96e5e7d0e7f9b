"""A server without a tokenizer (`pagoda serve CONFIG --load-format dummy --skip-tokenizer-init`,
how a model-shape preset is served): token-id prompts work, streamed one chunk per token, and
every route that needs text is a 400 naming the field, not a 500."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from pagoda.engine.async_llm import AsyncLLM
from pagoda.server.app import build_app


@pytest.fixture
def client():
    llm = AsyncLLM(FakeEngine(max_model_len=64, skip_tokenizer_init=True))
    with TestClient(build_app(llm)) as c:
        yield c
    llm.shutdown()


def test_token_id_prompt_streams_one_chunk_per_token_with_usage(client):
    body = {"prompt": [65, 66, 67], "max_tokens": 4, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    events = [json.loads(x[6:]) for x in resp.text.splitlines() if x.startswith("data: {")]
    assert sum(1 for e in events if e["choices"]) == 4
    assert events[-1]["usage"]["completion_tokens"] == 4


def test_logprobs_name_undecoded_tokens_by_id(client):
    body = {"prompt": [65, 66], "max_tokens": 2, "logprobs": 1, "echo": True}
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    # The first prompt token has no logprob, so no decoded text: vLLM's "token_id:N" form.
    assert resp.json()["choices"][0]["logprobs"]["tokens"][0] == "token_id:65"


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/v1/completions", {"prompt": "hello", "max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ("/tokenize", {"prompt": "hello"}, "prompt"),
        ("/detokenize", {"tokens": [65]}, "tokens"),
    ],
)
def test_text_routes_are_a_400_naming_the_field(client, route, body, param):
    resp = client.post(route, json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and "--skip-tokenizer-init" in err["message"]


def test_token_ids_are_checked_against_the_model_vocabulary(client):
    resp = client.post("/v1/completions", json={"prompt": [65, 258], "max_tokens": 2})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"


def test_bench_serve_sends_token_ids_to_a_server_without_tokenizer(tmp_path):
    """`pagoda bench serve` finds no tokenizer, probes the vocabulary with one-token
    completions and sends the log-normal mix as token-id prompts."""
    import argparse
    import socket
    import threading
    import time

    import uvicorn

    from pagoda.bench.serve import add_bench_serve_args, run_bench_serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    llm = AsyncLLM(FakeEngine(max_model_len=256, max_num_seqs=8, skip_tokenizer_init=True))
    server = uvicorn.Server(
        uvicorn.Config(build_app(llm), host="127.0.0.1", port=port, log_level="warning")
    )
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    while not server.started:
        time.sleep(0.01)
    try:
        out = tmp_path / "res.json"
        args = add_bench_serve_args(argparse.ArgumentParser()).parse_args([
            "--base-url", f"http://127.0.0.1:{port}", "--dataset-name", "lognormal",
            "--lognormal-max-len", "64", "--num-prompts", "6", "--ignore-eos",
            "--result-filename", str(out),
        ])  # fmt: skip
        assert run_bench_serve(args) == 0
        res = json.loads(out.read_text())
        assert res["completed"] == 6 and res["failed"] == 0
        assert all(4 <= n <= 32 for n in res["input_lens"])
        assert res["total_output_tokens"] == sum(res["output_lens"])
    finally:
        server.should_exit = True
        t.join(5)
        llm.shutdown()
