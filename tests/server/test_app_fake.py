"""The HTTP protocol against the fake engine, in-process (FastAPI TestClient): response shapes,
streaming, logprobs, echo, errors, auth and metrics, in milliseconds."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import Future

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from pagoda import RepetitionDetectionParams, SamplingParams, StructuredOutputsParams
from pagoda.engine.async_llm import AsyncLLM
from pagoda.server.app import build_app

MODEL = "fake-model"


@pytest.fixture
def client():
    llm = AsyncLLM(FakeEngine(max_model_len=64))
    with TestClient(build_app(llm)) as c:
        yield c
    llm.shutdown()


def _sse(resp) -> list:
    events = [line[len("data: ") :] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _error(resp, status: int, param: str | None) -> str:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param, err
    return err["message"]


def test_completion_greedy_text_and_usage(client):
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "ab", "max_tokens": 4,
                                             "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["choices"][0]["text"] == "defg"  # <s>ab = 3 tokens -> 'd' onwards
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_batch_prompts_with_n_numbers_choices(client):
    r = client.post("/v1/completions", json={"prompt": ["a", "ab"], "n": 2,
                                             "max_tokens": 2, "temperature": 0})  # fmt: skip
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in body["choices"]] == ["cd", "cd", "de", "de"]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 8
    r = client.post("/v1/completions", json={"prompt": [[256, 97], [256, 97, 98]],
                                             "max_tokens": 1, "temperature": 0})  # fmt: skip
    assert [c["text"] for c in r.json()["choices"]] == ["c", "d"]


def test_completion_logprobs_legacy_format(client):
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "logprobs": 2,
                                             "temperature": 0})  # fmt: skip
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["d", "e", "f"]
    assert lp["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert lp["text_offset"] == [2, 3, 4]  # after the prompt text "ab"
    assert all(len(t) == 3 and t[tok] == -0.5 for t, tok in zip(lp["top_logprobs"], "def"))


def test_echo_with_max_tokens_zero_returns_prompt_logprobs(client):
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 0, "echo": True,
                                             "logprobs": 1, "temperature": 0})  # fmt: skip
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["text"] == "abc"
    lp = ch["logprobs"]
    assert lp["tokens"] == ["<s>", "a", "b", "c"]
    assert lp["token_logprobs"] == [None, -1.0, -1.0, -1.0]
    assert lp["top_logprobs"][0] is None
    assert r.json()["usage"]["completion_tokens"] == 0


def test_streaming_completion_with_usage(client):
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "stream": True,
                                             "temperature": 0,
                                             "stream_options": {"include_usage": True}})  # fmt: skip
    chunks = _sse(r)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "def"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_chat_completion_and_logprobs(client):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2,
        "temperature": 0, "logprobs": True, "top_logprobs": 2})  # fmt: skip
    assert r.status_code == 200, r.text
    ch = r.json()["choices"][0]
    assert ch["message"]["role"] == "assistant" and len(ch["message"]["content"]) == 2
    content = ch["logprobs"]["content"]
    assert [c["token"] for c in content] == list(ch["message"]["content"])
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] == -0.5 for c in content)
    # <|user|>hi\n<|assistant|> rendered by the default template, no BOS for chat.
    assert r.json()["usage"]["prompt_tokens"] == len("<|user|>hi\n<|assistant|>")


def test_chat_streaming_role_first_then_content(client):
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 3, "stream": True, "n": 2, "stream_options": {"include_usage": True}})  # fmt: skip
    chunks = _sse(r)
    assert [c["delta"]["role"] for c in chunks[0]["choices"]] == ["assistant", "assistant"]
    text = {0: "", 1: ""}
    for c in chunks[1:-1]:
        for ch in c["choices"]:
            text[ch["index"]] += ch["delta"]["content"]
    assert len(text[0]) == len(text[1]) == 3
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_request_chat_template_refused_unless_trusted(client):
    tpl = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template": tpl}
    assert "--trust-request-chat-template" in _error(
        client.post("/tokenize", json=body), 400, "chat_template"
    )
    llm = AsyncLLM(FakeEngine(max_model_len=64))
    try:
        with TestClient(build_app(llm, trust_request_chat_template=True)) as trusting:
            assert trusting.post("/tokenize", json=body).json()["tokens"] == list(b"[x]")
    finally:
        llm.shutdown()


def test_seed_reproducible(client):
    req = {"prompt": "ab", "max_tokens": 8, "temperature": 1.0, "seed": 7}
    a, b = (client.post("/v1/completions", json=req).json() for _ in range(2))
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


@pytest.mark.parametrize(
    "body,status,param,needle",
    [
        ({"prompt": "a", "temperature": "hot"}, 400, "temperature", "temperature"),
        ({"prompt": "a", "temperature": -1}, 400, "temperature", "temperature"),
        ({"prompt": "a", "top_p": 0}, 400, "top_p", "top_p"),
        ({"prompt": "a", "n": 0}, 400, "n", "n must"),
        ({"prompt": 5}, 400, "prompt", "prompt"),
        ({"prompt": "a", "model": "gpt-9"}, 404, "model", "gpt-9"),
        ({"prompt": "a" * 100}, 400, "prompt", "maximum context length"),
        ({"prompt": "a", "max_tokens": 500}, 400, "max_tokens", "max_tokens"),
        ({"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
        ({"prompt": "a", "logprobs": 50}, 400, "logprobs", "logprobs"),
        ({"prompt": [1, 999]}, 400, "prompt", "vocabulary"),
        ({"prompt": "a", "logit_bias": {"999": 1}}, 400, "logit_bias", "logit_bias"),
        ({}, 400, "prompt", "prompt"),
    ],
)
def test_completion_errors_name_the_field(client, body, status, param, needle):
    msg = _error(client.post("/v1/completions", json=body), status, param)
    assert needle in msg


def test_chat_errors(client):
    base = {"messages": [{"role": "user", "content": "hi"}]}
    r = client.post("/v1/chat/completions", json={**base, "max_completion_tokens": 1000})
    assert "max_completion_tokens" in _error(r, 400, "max_completion_tokens")
    r = client.post("/v1/chat/completions", json={**base, "top_logprobs": 3})
    _error(r, 400, "top_logprobs")
    _error(client.post("/v1/chat/completions", json={"messages": []}), 400, "messages")
    r = client.post("/v1/chat/completions", json={"messages": [{"content": "x"}]})
    _error(r, 400, "messages")


def test_malformed_json_and_unknown_route(client):
    r = client.post(
        "/v1/completions", content=b'{"prompt": ', headers={"content-type": "application/json"}
    )
    assert "Malformed JSON" in _error(r, 400, None)
    r = client.post(
        "/v1/completions", content=b"[1, 2]", headers={"content-type": "application/json"}
    )
    _error(r, 400, None)
    _error(client.get("/v1/nothing"), 404, None)


def test_models_version_tokenize_detokenize(client):
    assert client.get("/health").status_code == 200
    assert client.get("/version").json()["version"]
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 64
    tok = client.post("/tokenize", json={"prompt": "ab"}).json()
    assert tok == {"count": 3, "max_model_len": 64, "tokens": [256, 97, 98]}
    assert client.post("/detokenize", json={"tokens": [97, 98]}).json() == {"prompt": "ab"}
    _error(client.post("/detokenize", json={"tokens": [9999]}), 400, "tokens")


def test_a_large_tokenize_response_is_built_off_the_event_loop(client, monkeypatch):
    """Token strings and JSON for a prompt of ~1M tokens take seconds: not on the loop that
    serves every stream (small responses stay there)."""
    import asyncio

    from fake_engine import FakeTokenizer

    from pagoda.server import app as app_module

    on_loop = []

    def convert(self, ids):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return [chr(i) if i < 256 else "<s>" for i in ids]

    monkeypatch.setattr(FakeTokenizer, "convert_ids_to_tokens", convert)
    monkeypatch.setattr(app_module, "LOOP_TOKENS", 8)
    small = client.post("/tokenize", json={"prompt": "ab", "return_token_strs": True}).json()
    assert small["token_strs"] == ["<s>", "a", "b"]
    big = client.post("/tokenize", json={"prompt": "abcdefghij", "return_token_strs": True})
    assert big.json()["token_strs"] == ["<s>", *"abcdefghij"] and big.json()["count"] == 11
    assert on_loop == [True, False]


def test_api_key_guards_everything_but_health_and_metrics():
    llm = AsyncLLM(FakeEngine())
    try:
        with TestClient(build_app(llm, api_key="sekret")) as c:
            assert c.get("/health").status_code == 200
            assert c.get("/metrics").status_code == 200
            _error(c.get("/v1/models"), 401, None)
            _error(c.post("/v1/completions", json={"prompt": "a"}), 401, None)
            bad = {"Authorization": "Bearer nope"}
            _error(c.post("/tokenize", json={"prompt": "a"}, headers=bad), 401, None)
            ok = {"Authorization": "Bearer sekret"}
            assert c.get("/v1/models", headers=ok).status_code == 200
            r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 1}, headers=ok)
            assert r.status_code == 200
    finally:
        llm.shutdown()


def _metric(text: str, name: str) -> float:
    return _metric_with(text, name)


def _metric_with(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_move_after_requests(client):
    before = client.get("/metrics").text
    assert "pagoda:cache_config_info" in before
    assert _metric(before, "pagoda:generation_tokens_total") == 0
    client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 5})
    after = client.get("/metrics").text
    assert _metric(after, "pagoda:generation_tokens_total") == 5
    assert _metric(after, "pagoda:prompt_tokens_total") == 3
    assert _metric(after, "pagoda:request_success_total") == 1
    assert (
        'pagoda:request_success_total{engine="0",finished_reason="length",model_name="fake-model"}'
        " 1.0" in after
    )
    assert _metric(after, "pagoda:e2e_request_latency_seconds_count") == 1
    assert _metric(after, "pagoda:time_to_first_token_seconds_count") == 1
    assert _metric(after, "pagoda:inter_token_latency_seconds_count") == 4
    assert _metric(after, "pagoda:num_requests_running") == 0
    assert _metric(after, "pagoda:kv_cache_usage_perc") == 0


def test_engine_overload_is_503_with_retry_after():
    # No queue beyond what runs: an idle server serves; a full batch refuses the next one.
    llm = AsyncLLM(FakeEngine(max_num_seqs=1, step_delay=0.02), max_waiting_requests=0)
    try:
        with TestClient(build_app(llm)) as c:
            assert c.post("/v1/completions", json={"prompt": "a"}).status_code == 200
            llm._engine_running = 1  # as the core reports while a request runs
            r = c.post("/v1/completions", json={"prompt": "a"})
            assert "retry" in _error(r, 503, None) and r.headers["retry-after"] == "1"
            r = c.post("/v1/completions", json={"prompt": "a", "stream": True})
            _error(r, 503, None)
            # Counted as vLLM counts a request its queue bound refuses (before: nowhere).
            text = c.get("/metrics").text
            assert _metric(text, "pagoda:admission_rejections_total") == 2
            assert (
                'pagoda:admission_rejections_total{model_name="fake-model",'
                'reason="max_num_queued_reqs"} 2.0' in text
            )
    finally:
        llm.shutdown()


def test_a_batch_of_prompts_is_admitted_or_refused_whole():
    # 2 running + 1 waiting at most: 4 prompts can never run (400, like n=4), 3 can on an
    # idle server, and a busy one refuses them whole (503) and stays usable; an invalid
    # request is a 400 however busy the server is.
    llm = AsyncLLM(FakeEngine(max_num_seqs=2, step_delay=0.01), max_waiting_requests=1)
    try:
        with TestClient(build_app(llm)) as c:
            r = c.post("/v1/completions", json={"prompt": ["a"] * 4, "max_tokens": 2})
            assert "4 samples (prompt x n)" in _error(r, 400, "prompt")
            r = c.post("/v1/completions", json={"prompt": ["a"] * 2, "n": 2, "max_tokens": 2})
            _error(r, 400, "prompt")
            r = c.post("/v1/completions", json={"prompt": ["a"] * 3, "max_tokens": 2})
            assert r.status_code == 200 and len(r.json()["choices"]) == 3
            llm._engine_running = 2  # as the core reports while two requests run
            r = c.post("/v1/completions", json={"prompt": ["a"] * 2, "max_tokens": 2})
            _error(r, 503, None)
            r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "priority": 1})
            _error(r, 400, "priority")  # FCFS scheduling
            llm._engine_running = 0
            r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            assert r.status_code == 200
    finally:
        llm.shutdown()


class _AbandonedFills:
    """The structured-outputs manager as the core's admission sees it: `num_abandoned_running`
    mask fills given up on still run (at PAGODA_GRAMMAR_MAX_ABANDONED: structured requests 503)."""

    def __init__(self, running: int) -> None:
        self.num_abandoned_running = running

    def compiled(self, params) -> bool:
        return True


@pytest.mark.parametrize("load", ["queue full", "abandoned fills"])
def test_a_constraint_invalid_without_a_compiler_is_400_at_any_load(load, monkeypatch):
    # A schema given as text that is not JSON, or not an object, and whitespace_pattern (which
    # xgrammar lacks) are refused where the request is validated, before admission: a 400 on a
    # full server too (before: 503, its compile never reached), and from AsyncLLM.generate. A
    # valid constraint is still shed (503); what only the compiler finds is too
    # (docs/reliability.md says why).
    monkeypatch.setenv("PAGODA_GRAMMAR_MAX_ABANDONED", "2")
    fake = FakeEngine(max_num_seqs=2, max_model_len=64)
    if load == "abandoned fills":
        fake.structured_output = _AbandonedFills(2)
        llm = AsyncLLM(fake)
    else:
        llm = AsyncLLM(fake, max_waiting_requests=0)
        llm._engine_running = 2  # as the core reports while two requests run
    invalid = {
        "not JSON": {"json": "{not json"},
        "a schema must be an object": {"json": "[1, 2]"},
        "whitespace_pattern is not supported": {"json_object": True, "whitespace_pattern": " "},
    }
    try:
        with TestClient(build_app(llm)) as c:
            for message, so in invalid.items():
                body = {"prompt": "x", "max_tokens": 2, "structured_outputs": so}
                assert message in _error(
                    c.post("/v1/completions", json=body), 400, "structured_outputs"
                )
                chat = {"messages": [{"role": "user", "content": "x"}], "structured_outputs": so}
                r = c.post("/v1/chat/completions", json=chat)
                assert message in _error(r, 400, "structured_outputs")
                batch = {**body, "prompt": ["x", "y"]}  # admitted whole before each is processed
                r = c.post("/v1/completions", json=batch)
                assert message in _error(r, 400, "structured_outputs")
            valid = {"prompt": "x", "max_tokens": 2, "structured_outputs": {"regex": "[ab]+"}}
            assert c.post("/v1/completions", json=valid).status_code == 503
            # The 503 alone is a rejection for load, under the limit it hit; the 400s are not.
            reason = "max_num_queued_reqs" if load == "queue full" else "grammar_max_abandoned"
            text = c.get("/metrics").text
            assert _metric(text, "pagoda:admission_rejections_total") == 1
            assert f'reason="{reason}"}} 1.0' in text
        params = SamplingParams(structured_outputs=StructuredOutputsParams(json="{not json"))
        with pytest.raises(ValueError, match="invalid structured_outputs.json: not JSON"):
            asyncio.run(anext(llm.generate("x", params, "library-call")))
    finally:
        llm.shutdown()


class _HeldCompiles:
    """The serving loop's grammar compile pool, its one compile held until the test settles
    its future."""

    num_runaway = 0

    def __init__(self, manager) -> None:
        self.future: Future = Future()

    def submit(self, params, timeout_s: float) -> Future:
        return self.future

    def expire(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Uncompiled(_AbandonedFills):
    def compiled(self, params) -> bool:
        return False


def test_a_request_compiling_its_constraint_waits_deferred_and_a_compile_backlog_is_counted(
    monkeypatch,
):
    # vLLM counts a request waiting for its grammar as waiting, "deferred" (not for room in the
    # batch); Pagoda's waits in the serving loop, off the scheduler. Refused because no compiler
    # was free in time, it is a rejection for load (503), as a full queue is.
    from pagoda.engine import engine_core
    from pagoda.engine.exceptions import StructuredOutputsBusyError

    pools: list[_HeldCompiles] = []

    def pool(manager) -> _HeldCompiles:
        pools.append(_HeldCompiles(manager))
        return pools[-1]

    monkeypatch.setattr(engine_core, "GrammarCompilePool", pool)
    fake = FakeEngine(max_num_seqs=2, max_model_len=64)
    fake.structured_output = _Uncompiled(0)
    llm = AsyncLLM(fake)
    body = {"prompt": "x", "max_tokens": 2, "n": 2, "structured_outputs": {"regex": "[ab]+"}}
    responses = []

    def waiting(c) -> dict[str, float]:
        text = c.get("/metrics").text
        name = "pagoda:num_requests_waiting_by_reason"
        by = {r: _metric_with(text, name, reason=r) for r in ("capacity", "deferred")}
        return {**by, "all": _metric(text, "pagoda:num_requests_waiting")}

    try:
        with TestClient(build_app(llm)) as c:
            t = threading.Thread(
                target=lambda: responses.append(c.post("/v1/completions", json=body))
            )
            t.start()
            deadline = time.monotonic() + 10
            while waiting(c)["deferred"] != 2:  # its two samples
                assert time.monotonic() < deadline, waiting(c)
                time.sleep(0.02)
            assert waiting(c) == {"capacity": 0, "deferred": 2, "all": 2}
            pools[0].future.set_exception(
                StructuredOutputsBusyError("compilers busy: retry later", "grammar_compile_backlog")
            )
            t.join(10)
            _error(responses[0], 503, None)
            text = c.get("/metrics").text
            name, reason = "pagoda:admission_rejections_total", "grammar_compile_backlog"
            assert _metric_with(text, name, reason=reason) == 1
            deadline = time.monotonic() + 10
            while waiting(c)["all"] != 0:
                assert time.monotonic() < deadline, waiting(c)
                time.sleep(0.02)
            assert waiting(c)["deferred"] == 0
    finally:
        llm.shutdown()


def test_load_chat_template(tmp_path):
    from pagoda.server.cli import load_chat_template

    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}x{% endfor %}").startswith("{%")
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="--chat-template"):
        load_chat_template("/no/such/template.jinja")


def test_server_chat_template_overrides_the_model_one():
    llm = AsyncLLM(FakeEngine())
    try:
        app = build_app(
            llm, chat_template="{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
        )
        with TestClient(app) as c:
            r = c.post("/tokenize", json={"messages": [{"role": "user", "content": "q"}]})
            assert r.json()["tokens"] == list(b"<q>")
    finally:
        llm.shutdown()


def test_request_fields_reach_sampling_params():
    from pagoda.server.protocol import CompletionRequest
    from pagoda.server.serving import build_sampling_params

    req = CompletionRequest(
        prompt="x", n=2, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
        temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3, stop=["\n"], ignore_eos=True,
        min_tokens=2, logit_bias={"7": 5.0}, stop_token_ids=[9], include_stop_str_in_output=True,
    )  # fmt: skip
    p = build_sampling_params(req, max_tokens=8, logprobs=1, prompt_logprobs=None)
    got = {k: getattr(p, k) for k in ("n", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
           "ignore_eos", "min_tokens", "logit_bias", "stop_token_ids", "max_tokens", "logprobs",
           "include_stop_str_in_output")}  # fmt: skip
    assert got == dict(n=2, presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                       temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=3, stop=["\n"],
                       ignore_eos=True, min_tokens=2, logit_bias={7: 5.0}, stop_token_ids=[9],
                       max_tokens=8, logprobs=1, include_stop_str_in_output=True)  # fmt: skip
    # Unset OpenAI fields get vLLM's defaults.
    d = build_sampling_params(CompletionRequest(prompt="x"), None, None, None)
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty) == (1.0, 1.0, 0, 1.0)


def test_streaming_echo_with_logprobs_and_stop(client):
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 5, "echo": True,
                                             "logprobs": 0, "stream": True, "temperature": 0,
                                             "stop": ["f"]})  # fmt: skip
    chunks = _sse(r)
    first = chunks[0]["choices"][0]
    assert first["text"] == "abd"  # the prompt comes first, then the first token
    assert first["logprobs"]["tokens"] == ["<s>", "a", "b", "d"]
    assert first["logprobs"]["token_logprobs"][0] is None
    # The stop string ends the text and is not part of it (include_stop_str_in_output).
    assert "".join(c["choices"][0]["text"] for c in chunks) == "abde"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"][0]["stop_reason"] == "f"


@pytest.mark.parametrize("stream", [False, True])
def test_the_stopping_token_stays_out_of_the_text_unless_asked(client, stream):
    # As in vLLM: the token that stops a request (EOS, a stop token id) is not rendered, even
    # with special tokens kept, unless include_stop_str_in_output.
    def text(**kw) -> str:
        body = {"model": MODEL, "prompt": "SAY:hi!there|", "max_tokens": 20, "temperature": 0,
                "skip_special_tokens": False, "stream": stream} | kw  # fmt: skip
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        if stream:
            return "".join(e["choices"][0]["text"] for e in _sse(r) if e["choices"])
        return r.json()["choices"][0]["text"]

    assert text() == "hi!there"  # stopped by EOS
    assert text(include_stop_str_in_output=True) == "hi!there</s>"
    assert text(stop_token_ids=[ord("!")]) == "hi"
    assert text(stop_token_ids=[ord("!")], include_stop_str_in_output=True) == "hi!"
    assert text(skip_special_tokens=True, include_stop_str_in_output=True) == "hi!there"


def test_continuous_usage_stats_put_each_choices_usage_in_every_chunk(client):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 3, "stream": True,
                                             "n": 2, "stream_options": opts})  # fmt: skip
    chunks, seen = _sse(r), {0: 0, 1: 0}
    for c in chunks[:-1]:
        (ch,) = c["choices"]
        seen[ch["index"]] += len(ch["text"])  # one byte a token
        assert c["usage"] == {"prompt_tokens": 3, "completion_tokens": seen[ch["index"]],
                              "total_tokens": 3 + seen[ch["index"]]}  # fmt: skip
    assert seen == {0: 3, 1: 3} and chunks[-1]["usage"]["completion_tokens"] == 6
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
            "stream_options": opts}  # fmt: skip
    chunks = _sse(client.post("/v1/chat/completions", json=body))
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == [0, 1, 2, 2] and chunks[-1]["choices"] == []
    body["stream_options"] = {"include_usage": True}  # usage only at the end, as before
    assert [c.get("usage") is None for c in _sse(client.post("/v1/chat/completions", json=body))] == [True, True, True, False]  # fmt: skip


def test_vllm_refusals_of_field_combinations(client):
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "stream": True,
                                             "prompt_logprobs": 1})  # fmt: skip
    assert "stream" in _error(r, 400, "prompt_logprobs")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2,
        "continue_final_message": True, "add_generation_prompt": True})  # fmt: skip
    _error(r, 400, "continue_final_message")
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2,
                                                  "continue_final_message": True})  # fmt: skip
    assert r.status_code == 200, r.text  # add_generation_prompt's default gives way
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_completion_tokens": 0})
    assert "max_completion_tokens" in _error(r, 400, "max_completion_tokens")


def test_chat_echo_starts_the_answer_with_the_assistant_turn_it_continues(client):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    body = {"messages": msgs, "max_tokens": 2, "temperature": 0, "echo": True,
            "continue_final_message": True}  # fmt: skip
    plain = client.post("/v1/chat/completions", json=body | {"echo": False}).json()
    text = plain["choices"][0]["message"]["content"]
    r = client.post("/v1/chat/completions", json=body)
    assert r.json()["choices"][0]["message"]["content"] == "Hel" + text
    chunks = _sse(client.post("/v1/chat/completions", json=body | {"stream": True}))
    streamed = "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
    )
    assert streamed == "Hel" + text
    # the last message is the user's: nothing to echo
    r = client.post("/v1/chat/completions", json=body | {"messages": msgs[:1],
                                                          "continue_final_message": False})  # fmt: skip
    assert not r.json()["choices"][0]["message"]["content"].startswith("hi")


def test_stream_options_are_vllms(client):
    # The usage chunk only when include_usage says so (stream_options {} or continuous_usage_stats
    # alone: none), and stream_options without a stream a 400, as vLLM and OpenAI.
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in (("/v1/completions", {"prompt": "ab", "max_tokens": 2}),
                       ("/v1/chat/completions", chat)):  # fmt: skip
        for opts in ({}, {"continuous_usage_stats": True}, {"include_usage": False}):
            chunks = _sse(client.post(path, json=body | {"stream": True, "stream_options": opts}))
            assert all(c["choices"] and c.get("usage") is None for c in chunks), (opts, chunks)
        r = client.post(path, json=body | {"stream_options": {"include_usage": True}})
        assert "stream" in _error(r, 400, "stream_options")
        r = client.post(
            path, json=body | {"stream": False, "stream_options": {"include_usage": True}}
        )
        _error(r, 400, "stream_options")
        for opts in ({}, None):  # nothing asked of a stream: as vLLM, not an error
            assert client.post(path, json=body | {"stream_options": opts}).status_code == 200


class _RecordingEngine(FakeEngine):
    """The fake engine, keeping every request the core was handed."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.seen: list = []

    def add_requests(self, requests) -> None:
        self.seen.extend(requests)
        super().add_requests(requests)


def test_bad_words_reach_the_engine_as_token_ids_and_bad_ones_are_400():
    # vLLM's field on completions and chat: the front end tokenizes the words (bytes here; " xy"
    # is one token longer than "xy", so only the word as given is banned, as vLLM's rule says).
    engine = _RecordingEngine(max_model_len=64)
    llm = AsyncLLM(engine)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        with TestClient(build_app(llm)) as client:
            for path, body in (("/v1/completions", {"prompt": "ab", "max_tokens": 2}),
                               ("/v1/chat/completions", chat)):  # fmt: skip
                engine.seen.clear()
                r = client.post(path, json=body | {"bad_words": ["c", "xy", "c"]})
                assert r.status_code == 200, r.text
                (req,) = engine.seen
                assert req.sampling_params.bad_words == ["c", "xy"]
                assert req.sampling_params.bad_words_token_ids == [[ord("c")], [ord("x"), ord("y")]]
                for bad, needle in (("c", "list"), ([1], ""), (["ok", ""], "empty string"),
                                    ([" "], "at least one token")):  # fmt: skip
                    r = client.post(path, json=body | {"bad_words": bad})
                    assert needle in _error(r, 400, "bad_words")
                assert client.post(path, json=body | {"bad_words": []}).status_code == 200
    finally:
        llm.shutdown()


def test_bad_words_without_a_tokenizer_are_400():
    # vLLM skips them then; a ban that would silently do nothing is refused.
    llm = AsyncLLM(FakeEngine(max_model_len=64, skip_tokenizer_init=True))
    try:
        with TestClient(build_app(llm)) as client:
            body = {"prompt": [97, 98], "max_tokens": 2, "bad_words": ["c"]}
            r = client.post("/v1/completions", json=body)
            assert "tokenizer" in _error(r, 400, "bad_words")
    finally:
        llm.shutdown()


_CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def test_logprob_token_ids_are_each_positions_candidates_on_completions_and_chat(client):
    ids = [ord("X"), ord("Y")]  # greedy picks lowercase letters
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, "temperature": 0,
                                             "logprobs": 0, "logprob_token_ids": ids})  # fmt: skip
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    assert lp["tokens"] == ["d", "e"] and lp["token_logprobs"] == [-0.5, -0.5]
    assert lp["top_logprobs"] == [{"d": -0.5, "X": -3.0, "Y": -4.0},
                                  {"e": -0.5, "X": -3.0, "Y": -4.0}]  # fmt: skip
    # Chat: the ids take the place of top_logprobs (vLLM), in the engine's order.
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json=_CHAT | {
            "max_completion_tokens": 2, "temperature": 0, "logprobs": True, "top_logprobs": 1,
            "logprob_token_ids": ids, "stream": stream})  # fmt: skip
        assert r.status_code == 200, r.text
        if stream:
            content = [t for e in _sse(r) for c in e["choices"] if c.get("logprobs")
                       for t in c["logprobs"]["content"]]  # fmt: skip
        else:
            content = r.json()["choices"][0]["logprobs"]["content"]
        assert len(content) == 2
        for c in content:
            top = [(t["token"], t["logprob"]) for t in c["top_logprobs"]]
            assert top == [(c["token"], -0.5), ("X", -3.0), ("Y", -4.0)]


@pytest.mark.parametrize(
    "route,body,needle",
    [
        ("/v1/completions", {"logprob_token_ids": [1]}, "`logprobs` must be set."),
        ("/v1/chat/completions", {"logprob_token_ids": [1]}, "`logprobs` must be set to true"),
        (
            "/v1/chat/completions",
            {"logprobs": True, "logprob_token_ids": [1], "use_beam_search": True, "n": 2},
            "beam search",
        ),
        (
            "/v1/completions",
            {"logprobs": 1, "logprob_token_ids": [1], "echo": True, "max_tokens": 0},
            "no output tokens",
        ),
        ("/v1/completions", {"logprobs": 1, "logprob_token_ids": [7, 258]}, "[0, 258): [258]"),
        ("/v1/chat/completions", {"logprobs": True, "logprob_token_ids": [1000]}, "[1000]"),
        ("/v1/completions", {"logprobs": 1, "logprob_token_ids": list(range(129))}, "128"),
        ("/v1/completions", {"logprobs": 1, "logprob_token_ids": [-1]}, "non-negative"),
    ],
)
def test_bad_logprob_token_ids_are_400_naming_the_field(client, route, body, needle):
    base = {"prompt": "ab"} if route == "/v1/completions" else _CHAT
    r = client.post(route, json=base | {"max_tokens": 2} | body)
    assert needle in _error(r, 400, "logprob_token_ids")
    assert client.post(route, json=base | {"max_tokens": 2}).status_code == 200  # still serving


@pytest.mark.parametrize(
    "rd,needle",
    [
        (
            {"max_pattern_size": 3, "min_count": 1},
            "min_count must be >= 2 to detect repetitive patterns in engine output.",
        ),
        (
            {"max_pattern_size": 1, "min_pattern_size": 2, "min_count": 2},
            "max_pattern_size, min_pattern_size must be >=0, with min_pattern_size <=",
        ),
        ({"max_pattern": 3}, "repetition_detection has no field 'max_pattern'"),
        ({"max_pattern_size": "x", "min_count": 2}, "max_pattern_size must be an integer"),
    ],
)
def test_bad_repetition_detection_is_400_with_vllms_message(client, rd, needle):
    for route, base in (("/v1/completions", {"prompt": "ab"}), ("/v1/chat/completions", _CHAT)):
        r = client.post(route, json=base | {"max_tokens": 2, "repetition_detection": rd})
        assert needle in _error(r, 400, "repetition_detection")


def test_repetition_detection_reaches_the_engine():
    engine = _RecordingEngine(max_model_len=64)
    llm = AsyncLLM(engine)
    rd = {"max_pattern_size": 4, "min_pattern_size": 2, "min_count": 3}
    try:
        with TestClient(build_app(llm)) as client:
            for route, base in (("/v1/completions", {"prompt": "ab"}),
                                ("/v1/chat/completions", _CHAT)):  # fmt: skip
                engine.seen.clear()
                r = client.post(route, json=base | {"max_tokens": 2, "repetition_detection": rd})
                assert r.status_code == 200, r.text
                (req,) = engine.seen
                assert req.sampling_params.repetition_detection == RepetitionDetectionParams(**rd)
    finally:
        llm.shutdown()
