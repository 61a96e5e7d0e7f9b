"""The fault suite's reproductions against a real `pagoda serve` on the embedded model: sampling
values the kernels cannot take, chat templates that loop or allocate without end, prompts that
take the tokenizer seconds, values nested past the recursion limit, request ids that name
another request's samples, and disconnects, each answered without harm to the server."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import httpx
import pytest
from servers import real_server

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc (Linux)")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = real_server(
        tmp_path_factory.mktemp("real") / "server.log",
        "--max-model-len", "256", "--max-num-seqs", "8", "--kv-cache-memory-bytes",
        str(64 << 20), "--trust-request-chat-template", "--preprocess-timeout", "3",
    )  # fmt: skip
    s.wait_ready()
    yield s
    s.stop()


def _post(server, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.headers, timeout=timeout)


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


class HealthProbe:
    """Polls /health on a thread while the body of a `with` runs; `worst` is the slowest
    answer (a blocked event loop shows here)."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self._stop = url, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            httpx.get(self.url + "/health", timeout=60)
            self.worst = max(self.worst, time.monotonic() - t0)
            time.sleep(0.05)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"n": 1000}, "n"),
        ({"temperature": 1e308}, "temperature"),
        ({"best_of": 3}, "best_of"),
        ({"max_tokens": 2**63}, "max_tokens"),
        ({"n": 11}, "n"),  # more than 8 running + 2 waiting: never admitted, so 400, not 503
        ({"logit_bias": {"5_0": 1}}, "logit_bias"),  # int() reads 50; not a token id as written
        ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "x"}},
         "structured_outputs"),
    ],
)  # fmt: skip
def test_sampling_values_out_of_range_are_400_and_the_engine_lives(server, extra, param):
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2**63 - 1})
    assert r.status_code == 200, r.text


def test_infinite_temperature_is_400(server):
    body = b'{"prompt": "hi", "max_tokens": 2, "temperature": Infinity}'
    r = httpx.post(server.url + "/v1/completions", content=body,
                   headers={**server.headers, "Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400, r.text


@pytest.mark.parametrize(
    "template, needle",
    [
        ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
         "longer than 3 s"),
        ("{{ 'a' * 30000000000 }}", "memory"),
    ],
)  # fmt: skip
def test_request_chat_templates_run_within_limits(server, template, needle):
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": template,
            "max_tokens": 2}  # fmt: skip
    with HealthProbe(server.url) as probe:
        t0 = time.monotonic()
        r = _post(server, "/v1/chat/completions", body)
        took = time.monotonic() - t0
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text
    assert took < 30, took
    assert probe.worst < 2.0, probe.worst  # the event loop kept answering
    assert _rss_kb(server.proc.pid) < 1_500_000


def test_a_big_prompt_does_not_stall_the_event_loop(server):
    # ~1 MB: seconds of tokenizing. A completion refuses it by its length alone (below);
    # /tokenize, bound by no context, tokenizes it, off the event loop.
    text = "hello world, this is a long prompt. " * 30_000
    with HealthProbe(server.url) as probe:
        r = _post(server, "/tokenize", {"prompt": text})
    assert r.status_code == 200 and r.json()["count"] > 200_000, r.text[:200]
    assert probe.worst < 2.0, probe.worst
    assert _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_prompt_too_long_by_its_length_is_refused_before_tokenizing(server):
    # 3.25 MB make at least 40,000 tokens (SmolLM2's longest token is 81 characters), for a
    # context of 256: a 400 naming the context at once (before: tokenized in a worker until
    # the 3 s --preprocess-timeout, then a 400 naming that).
    text = "hello world, " * 250_000
    for path, body, param in (
        ("/v1/completions", {"prompt": text, "max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
    ):
        start = time.monotonic()
        r = _post(server, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert "maximum context length is 256 tokens" in r.json()["error"]["message"]
        assert "3250000 characters, which make at least 40124 tokens" in r.text or (
            param == "messages" and "characters, which make at least" in r.text
        )
        assert time.monotonic() - start < 2.0


def test_disconnected_requests_are_counted_as_aborted(server):
    before = server.metric("pagoda:request_success_total", finished_reason="abort")

    async def drop_after_first_chunk() -> None:
        body = {"prompt": "Tell me a story.", "max_tokens": 200, "stream": True,
                "ignore_eos": True}  # fmt: skip
        async with httpx.AsyncClient(timeout=120) as c:
            async with c.stream("POST", server.url + "/v1/completions", json=body,
                                headers=server.headers) as r:  # fmt: skip
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        return

    async def main() -> None:
        await asyncio.gather(*[drop_after_first_chunk() for _ in range(5)])

    asyncio.run(main())
    deadline = time.monotonic() + 30
    while server.metric("pagoda:request_success_total", finished_reason="abort") < before + 5:
        assert time.monotonic() < deadline, "aborted requests were not counted"
        time.sleep(0.1)
    assert server.metric("pagoda:num_requests_running") == 0
    assert "/site-packages/" not in httpx.get(server.url + "/metrics").text


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"anyOf": [schema]}
    return schema


@pytest.mark.parametrize(
    "path, body, param",
    [
        # Pickling this request to the engine core once overran the recursion limit and killed
        # the thread that sends every request there: all generation hung, /health said ok.
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
          "response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": _nested_schema(450)}}},
         "response_format"),
        # Copying its sampling parameters overran it: a 500 and a 3,000-line traceback.
        ("/v1/completions",
         {"prompt": "Hi", "max_tokens": 5, "structured_outputs": {"json": _nested_schema(300)}},
         "structured_outputs"),
    ],
)  # fmt: skip
def test_values_nested_past_the_limit_are_400_and_generation_goes_on(server, path, body, param):
    r = _post(server, path, body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "nested more than 100" in error["message"], error
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    # A schema nested deep but within the limit is compiled and followed.
    body = {"prompt": "Name:", "max_tokens": 8,
            "structured_outputs": {"json": _nested_schema(40)}}  # fmt: skip
    r = _post(server, "/v1/completions", body, timeout=60)
    assert r.status_code == 200, r.text
    assert "RecursionError" not in server.log()


def test_min_tokens_past_the_context_is_400(server):
    body = {"prompt": "hi", "max_tokens": None, "min_tokens": 10**6}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


@pytest.mark.parametrize("first_n", [2, 1])
def test_a_request_id_naming_another_requests_sample_is_refused_alone(server, first_n):
    """Samples of a request "x" with n > 1 are "0_x", "1_x", ...: a request whose id (or whose
    samples' ids) collide with a running request's is refused with 400, and the running one
    still finishes (it once lost its outputs and hung)."""
    ids = {2: ("x2", "0_x2"), 1: ("0_y1", "y1")}[first_n]
    running = {"prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True,
               "n": first_n, "request_id": ids[0], "stream": True}  # fmt: skip
    second = {"prompt": "Hi", "max_tokens": 5, "n": 3 - first_n, "request_id": ids[1]}
    finished: list[str] = []
    with httpx.stream("POST", server.url + "/v1/completions", json=running,
                      headers=server.headers, timeout=60) as r:  # fmt: skip
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # it runs
        clash = _post(server, "/v1/completions", second, timeout=60)
        assert clash.status_code == 400 and "in use" in clash.text, clash.text
        for line in lines:
            if line.startswith("data: {"):
                finished += [c["finish_reason"] for c in json.loads(line[6:])["choices"]
                             if c.get("finish_reason")]  # fmt: skip
    assert finished == ["length"] * first_n


def test_a_client_that_leaves_is_not_an_error_in_the_log(server):
    body = {"prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        _post(server, "/v1/completions", body, timeout=0.5)  # gone before the answer
    deadline = time.monotonic() + 30
    while server.metric("pagoda:num_requests_running") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert "internal error" not in server.log()


def test_a_tool_call_round_trip_renders(server):
    # What an OpenAI SDK's tool loop sends back: the assistant turn with content null and its
    # tool_calls, then the tool's result (as a string, or as text parts).
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{}"}}  # fmt: skip
    for result in ("22C", [{"type": "text", "text": "22C"}]):
        body = {"max_tokens": 3, "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": result},
        ]}  # fmt: skip
        r = _post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text


def test_chat_template_kwargs_win_over_the_fields_they_name(server):
    messages = [{"role": "user", "content": "hi"}]
    with_prompt = _post(server, "/tokenize", {"messages": messages}).json()["count"]
    body = {"messages": messages, "max_tokens": 1,
            "chat_template_kwargs": {"add_generation_prompt": False}}  # fmt: skip
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] < with_prompt  # no "assistant" turn opened
    body["chat_template_kwargs"] = {"messages": []}
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def _children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out.update(int(c) for c in f.read().split())
    return out


def test_a_constraint_slow_to_compile_stalls_no_one_and_times_out(tmp_path):
    """Compiling a choice of 20,000 strings takes xgrammar longer than the 4 s limit set here
    (5 s alone, 2-core AMD EPYC). It compiles in a worker process of the engine core while the
    other requests' steps go on, and past the limit the request is refused and the worker
    killed (before: every request waited for the compile, /health ok; then, compiled on a
    thread, it ran on after the refusal, a core busy)."""
    s = real_server(
        tmp_path / "server.log", "--max-model-len", "256", "--max-num-seqs", "8",
        "--kv-cache-memory-bytes", str(64 << 20),
        env={"PAGODA_GRAMMAR_COMPILE_TIMEOUT_S": "4"},
    )  # fmt: skip
    try:
        s.wait_ready()
        choice = [f"option number {i} of many" for i in range(20_000)]
        slow = {"prompt": "x", "max_tokens": 20, "structured_outputs": {"choice": choice}}
        result: list[httpx.Response] = []
        t = threading.Thread(target=lambda: result.append(_post(s, "/v1/completions", slow)))
        t0 = time.monotonic()
        t.start()
        time.sleep(0.5)
        took, compiling = [], set()
        while t.is_alive() and time.monotonic() - t0 < 60:
            t1 = time.monotonic()
            r = _post(s, "/v1/completions", {"prompt": "hi", "max_tokens": 5}, timeout=60)
            assert r.status_code == 200, r.text
            took.append(time.monotonic() - t1)
            compiling = compiling or _children(s.engine_core_pid())  # the worker
        t.join(60)
        assert result and result[0].status_code == 400, result
        assert "longer than 4 s to compile" in result[0].json()["error"]["message"]
        assert took and max(took) < 3.0, took
        assert compiling and not compiling & _children(s.engine_core_pid())  # killed
        body = {"prompt": "x", "max_tokens": 3, "structured_outputs": {"regex": "[ab]+"}}
        r = _post(s, "/v1/completions", body, timeout=60)  # in the worker started after it
        assert r.status_code == 200 and set(r.json()["choices"][0]["text"]) <= {"a", "b"}
    finally:
        s.stop()


def test_a_constraint_slow_to_apply_fails_alone_and_the_others_keep_their_pace(server):
    """xgrammar takes 0.66 s to compute this regex's first next-token mask over the embedded
    model's vocabulary, and 18 s a token a few tokens later. Every step waited for it: a stream
    beside it went from a token every ~10 ms to one every 0.66 s, then 11 s, with /health ok.
    Now a step waits for a request's mask no longer than PAGODA_GRAMMAR_MASK_BUDGET_MS (100 ms
    by default): that request ends with a 400 (in a stream: an in-band error, then [DONE]), and
    the stream beside it keeps its pace and loses no token."""
    plain = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
             "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    streams: list[tuple[list[float], list[dict]]] = []  # (arrival times, events) per stream
    done = threading.Event()

    def stream_plain() -> None:
        # Back to back until both refusals are in: one 200-token stream can end before the
        # first refusal on a fast machine (max-model-len 256 caps a single stream).
        while not done.is_set():
            arrivals: list[float] = []
            events: list[dict] = []
            streams.append((arrivals, events))
            with httpx.stream("POST", server.url + "/v1/completions", json=plain,
                              headers=server.headers, timeout=60) as r:  # fmt: skip
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        arrivals.append(time.monotonic())
                        events.append(json.loads(line[6:]))

    # A compile worker up first (starting one takes seconds, the plain stream about two).
    warm = {"prompt": "x", "max_tokens": 1, "structured_outputs": {"regex": "[ab]+"}}
    assert _post(server, "/v1/completions", warm, timeout=60).status_code == 200
    t = threading.Thread(target=stream_plain)
    t.start()
    while not (streams and streams[0][0]) and t.is_alive():
        time.sleep(0.01)
    regex = "([^a]{1,50}[^b]{1,50}){1,50}"
    bad = {"prompt": "Write anything:", "max_tokens": 20, "structured_outputs": {"regex": regex}}
    sent_at = time.monotonic()
    r = _post(server, "/v1/completions", bad, timeout=20)
    refused_at = time.monotonic()
    assert r.status_code == 400, r.text
    assert (
        "took longer than 100 ms to compute the next token's mask" in r.json()["error"]["message"]
    )
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "stream": True,
            "structured_outputs": {"regex": regex}}  # fmt: skip
    r = _post(server, "/v1/chat/completions", chat, timeout=20)
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "[DONE]", r.text
    error = json.loads(lines[-2])["error"]
    assert error["code"] == 400 and "PAGODA_GRAMMAR_MASK_BUDGET_MS" in error["message"], error
    done.set()
    t.join(60)
    assert not t.is_alive()
    # Plain streams ran from before the first bad request to after its refusal, back to back,
    # each keeping its pace ...
    arrivals = [at for a, _ in streams for at in a]
    assert arrivals[0] < sent_at and arrivals[-1] > refused_at, (sent_at, refused_at, arrivals)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert max(gaps) < 0.5, sorted(gaps)[-5:]  # the steps that waited 100 ms for a bad mask
    for _, events in streams:  # ... and every stream got all its tokens.
        assert events[-1]["usage"]["completion_tokens"] == 200
        assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_prompt_logprobs_are_returned(server):
    # Asked for, they come back (vLLM's form): per prompt position, None first, then
    # {token id: {logprob, rank, decoded_token}} holding the prompt's own token.
    ids = _post(server, "/tokenize", {"prompt": "The cat sat on the mat"}).json()["tokens"]
    body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    plps = r.json()["choices"][0]["prompt_logprobs"]
    assert len(plps) == len(ids) and plps[0] is None
    for token, step in zip(ids[1:], plps[1:], strict=True):
        assert str(token) in step and 1 <= len(step) <= 3
        assert all(v["logprob"] <= 0 and v["rank"] >= 1 for v in step.values())
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "prompt_logprobs": 0}  # fmt: skip
    r = _post(server, "/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    plps = r.json()["prompt_logprobs"]
    assert plps[0] is None and len(plps) == r.json()["usage"]["prompt_tokens"]
    assert all(len(step) == 1 for step in plps[1:])
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert r.json()["choices"][0]["prompt_logprobs"] is None
