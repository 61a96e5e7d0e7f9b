"""A real server process (the embedded SmolLM2-135M) driven by the official `openai` client.

One server per module: `python -m pagoda.entrypoints.openai.api_server` with a small context,
an API key, 4 sequences at once and a waiting bound of 8 (so 503s can be provoked). The last
test sends SIGTERM and checks the drain.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

KEY = "test-key"
MODEL = "smol"
MAX_MODEL_LEN = 256
STREAM_TOKENS = 48  # per streamed request in the burst and drain tests


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "pagoda.entrypoints.openai.api_server",
            "--max-model-len", str(MAX_MODEL_LEN), "--port", str(self.port),
            "--served-model-name", MODEL, "--api-key", KEY, "--max-num-seqs", "4",
            "--max-waiting-requests", "8", "--kv-cache-memory-bytes", str(64 << 20),
            "--drain-timeout", "600", "--uvicorn-log-level", "warning", "--disable-log-stats",
        ]  # fmt: skip
        start = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read().decode()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() - start > 120:
                raise RuntimeError("server did not answer /health within 120 s")
            time.sleep(0.05)
        self.cold_start_s = time.perf_counter() - start

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.url + "/metrics").text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if (line.startswith(name + "{") or line.startswith(name + " "))
            and all(f'{k}="{v}"' in line for k, v in labels.items())
        )

    def children(self) -> list[int]:
        """The server's child processes (the engine core), from /proc."""
        pids: list[int] = []
        for task in os.listdir(f"/proc/{self.proc.pid}/task"):
            with open(f"/proc/{self.proc.pid}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        return pids

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def server():
    s = Server()
    print(f"\ncold start (process start to /health 200): {s.cold_start_s:.1f} s")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "Z":
                    return True  # exited; only its parent's wait is missing
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc (Linux)")
def test_engine_core_runs_in_a_child_and_dies_with_a_killed_server():
    # Its own server: SIGKILL leaves the engine core no chance to be told.
    s = Server()
    try:
        children = s.children()  # the engine core and multiprocessing's resource tracker
        cmdlines = []
        for pid in children:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdlines.append(f.read().replace(b"\0", b" ").decode())
        assert sum("spawn_main" in c for c in cmdlines) == 1, cmdlines
        s.stop()
        assert all(_gone(pid, 15) for pid in children), "a child outlived its SIGKILLed server"
    finally:
        s.stop()


def test_completion_and_chat(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=4, temperature=0)  # fmt: skip
    assert "Paris" in r.choices[0].text
    assert r.usage.completion_tokens == 4 and r.usage.prompt_tokens > 0
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=8, temperature=0, stop=["."])  # fmt: skip
    assert r.choices[0].text == " Paris" and r.choices[0].finish_reason == "stop"
    c = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=12,
        temperature=0,
    )  # fmt: skip
    assert c.choices[0].message.role == "assistant" and "4" in c.choices[0].message.content
    assert c.usage.completion_tokens <= 12


def test_streaming_matches_non_streaming(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage.completion_tokens == 6
    assert sum(1 for c in chunks if c.choices) == 6  # one token per chunk
    msgs = [{"role": "user", "content": "Say hi"}]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5,
                                            temperature=0, stream=True)  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat.choices[0].message.content


def test_stream_interval_batches_chunks_of_the_same_text(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=7, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    chunks = [c for c in client.completions.create(**kw, stream=True,
                                                    extra_body={"stream_interval": 3}) if c.choices]  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == full
    assert len(chunks) == 3  # the first token, then 3 and 3
    with pytest.raises(openai.BadRequestError, match="stream_interval"):
        client.completions.create(**kw, stream=True, extra_body={"stream_interval": 0})


def test_n_samples_and_seed(client):
    kw = dict(model=MODEL, prompt="My favourite colour is", max_tokens=6, temperature=1.0)
    a = client.completions.create(**kw, n=2, seed=1234)
    assert [c.index for c in a.choices] == [0, 1] and a.usage.completion_tokens == 12
    b = client.completions.create(**kw, n=2, seed=1234)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_logprobs_and_echo_agree(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is",
                                  max_tokens=1, temperature=0, logprobs=3)  # fmt: skip
    lp = r.choices[0].logprobs
    assert lp.tokens == [r.choices[0].text] and len(lp.top_logprobs[0]) >= 3
    # Echo the prompt plus that token: the last prompt position must score it the same.
    e = client.completions.create(model=MODEL, prompt="The capital of France is" + r.choices[0].text,
                                  max_tokens=0, echo=True, logprobs=1)  # fmt: skip
    elp = e.choices[0].logprobs
    assert e.choices[0].text == "The capital of France is" + r.choices[0].text
    assert elp.token_logprobs[0] is None and elp.top_logprobs[0] is None
    assert elp.tokens[-1] == r.choices[0].text
    assert elp.token_logprobs[-1] == pytest.approx(lp.token_logprobs[0], abs=0.05)
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, logprobs=True, top_logprobs=2)  # fmt: skip
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


@pytest.mark.parametrize(
    "kwargs,exc,param",
    [
        (dict(model="nope"), openai.NotFoundError, "model"),
        (dict(prompt="hello " * 300), openai.BadRequestError, "prompt"),
        (dict(max_tokens=1000), openai.BadRequestError, "max_tokens"),
        (dict(temperature=-1.0), openai.BadRequestError, "temperature"),
        (dict(extra_body={"top_p": "high"}), openai.BadRequestError, "top_p"),
        (dict(logprobs=99), openai.BadRequestError, "logprobs"),
    ],
)
def test_errors_name_the_field(client, kwargs, exc, param):
    kw = dict(model=MODEL, prompt="hi", max_tokens=2) | kwargs
    with pytest.raises(exc) as ei:
        client.completions.create(**kw)
    assert ei.value.body["param"] == param and param in ei.value.body["message"]
    assert 400 <= ei.value.status_code < 500


def test_malformed_json_and_auth(server):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and "Malformed JSON" in r.json()["error"]["message"]
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_metrics_move(server, client):
    gen0 = server.metric("pagoda:generation_tokens_total")
    e2e0 = server.metric("pagoda:e2e_request_latency_seconds_count")
    ttft0 = server.metric("pagoda:time_to_first_token_seconds_count")
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})  # fmt: skip
    assert server.metric("pagoda:generation_tokens_total") == gen0 + 5
    assert server.metric("pagoda:e2e_request_latency_seconds_count") == e2e0 + 1
    assert server.metric("pagoda:time_to_first_token_seconds_count") == ttft0 + 1
    assert server.metric("pagoda:prompt_tokens_total") > 0
    assert server.metric("pagoda:request_success_total") >= 1


def test_logprob_token_ids_are_each_positions_candidates(client):
    ids = [28, 216]  # "," and " " in SmolLM2's vocabulary
    r = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=4,
                                  temperature=0, logprobs=0,
                                  extra_body={"logprob_token_ids": ids})  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert set(top) == {token, ",", " "} and top[token] == value
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, logprobs=True,
                                       extra_body={"logprob_token_ids": ids})  # fmt: skip
    for t in c.choices[0].logprobs.content:
        assert [x.token for x in t.top_logprobs] == list(dict.fromkeys([t.token, ",", " "]))
    # Ids outside the vocabulary are a 400 naming the field; the server goes on.
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=1,
                                  extra_body={"logprob_token_ids": [49152]})  # fmt: skip
    assert ei.value.body["param"] == "logprob_token_ids"
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text


def test_repetition_detection_stops_a_repeating_output(server, client):
    # Greedy counting repeats "3, 4, 5, 1, 2," (15 tokens): stopped after two rounds.
    repeats0 = server.metric("pagoda:request_success_total", finished_reason="repetition")
    rd = {"max_pattern_size": 16, "min_count": 2}
    r = client.completions.create(model=MODEL, prompt="Count: 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,",
                                  max_tokens=60, temperature=0,
                                  extra_body={"repetition_detection": rd})  # fmt: skip
    choice = r.choices[0]
    assert (choice.finish_reason, choice.stop_reason) == ("repetition", "repetition_detected")
    assert r.usage.completion_tokens == 30
    assert server.metric("pagoda:request_success_total", finished_reason="repetition") == (
        repeats0 + 1
    )
    # vLLM's message for bad values, as a 400 naming the field; the server goes on.
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                  extra_body={"repetition_detection": {"max_pattern_size": 2}})  # fmt: skip
    assert ei.value.body["param"] == "repetition_detection"
    assert ei.value.body["message"].startswith("min_count must be >= 2")
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text


async def _stream_some(
    url: str,
    n_chunks: int | None,
    max_tokens: int = STREAM_TOKENS,
    started: asyncio.Event | None = None,
) -> int:
    """Stream a long completion; read n_chunks then drop the connection (None: read all).
    `started` is set once the first chunk arrived."""
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}  # fmt: skip
    h = {"Authorization": f"Bearer {KEY}"}
    got = 0
    async with httpx.AsyncClient(timeout=120) as c:
        async with c.stream("POST", url + "/v1/completions", json=body, headers=h) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got += 1
                    if started is not None:
                        started.set()
                    if n_chunks is not None and got >= n_chunks:
                        return got  # leaving the block closes the connection mid-stream
    return got


def test_disconnects_abort_and_free_the_kv_cache(server):
    async def burst() -> list[int]:
        tasks = [_stream_some(server.url, 3 if i % 2 else None) for i in range(8)]
        return await asyncio.gather(*tasks)

    aborted0 = server.metric("pagoda:request_success_total", finished_reason="abort")
    got = asyncio.run(burst())
    assert sorted(got) == [3] * 4 + [STREAM_TOKENS] * 4
    # The 4 dropped requests were aborted, not run to the end in the background.
    deadline = time.time() + 60
    while time.time() < deadline and (
        server.metric("pagoda:kv_cache_usage_perc") != 0
        or server.metric("pagoda:request_success_total", finished_reason="abort") < aborted0 + 4
    ):
        time.sleep(0.1)
    assert server.metric("pagoda:request_success_total", finished_reason="abort") == aborted0 + 4
    assert server.metric("pagoda:kv_cache_usage_perc") == 0
    assert server.metric("pagoda:num_requests_running") == 0
    assert server.metric("pagoda:num_requests_waiting") == 0
    assert httpx.get(server.url + "/health").status_code == 200


def test_non_streaming_disconnect_aborts(server):
    gen0 = server.metric("pagoda:generation_tokens_total")
    body = {"model": MODEL, "prompt": "Write an essay.", "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5,
                   headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
    deadline = time.time() + 60
    while time.time() < deadline and server.metric("pagoda:num_requests_running") != 0:
        time.sleep(0.1)
    assert server.metric("pagoda:num_requests_running") == 0
    assert server.metric("pagoda:kv_cache_usage_perc") == 0
    assert server.metric("pagoda:generation_tokens_total") - gen0 < 200


def test_overload_answers_503(server):
    async def one(c: httpx.AsyncClient) -> int:
        body = {"model": MODEL, "prompt": "Count:", "max_tokens": 8, "ignore_eos": True}
        r = await c.post(server.url + "/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
        return r.status_code

    async def flood() -> list[int]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*[one(c) for _ in range(24)])

    codes = asyncio.run(flood())
    assert set(codes) == {200, 503} and codes.count(200) >= 4, codes
    assert httpx.get(server.url + "/health").status_code == 200


def test_sigterm_drains_then_exits(server):
    # Long enough to still be running when the late request arrives, however fast the engine.
    drain_tokens = MAX_MODEL_LEN - 16

    async def scenario() -> tuple[int, int]:
        started = asyncio.Event()
        running = asyncio.ensure_future(
            _stream_some(server.url, None, max_tokens=drain_tokens, started=started)
        )
        await asyncio.wait_for(started.wait(), 60)  # the stream is under way
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient() as c:
            late = await c.post(server.url + "/v1/completions", json={"prompt": "x"},
                                headers={"Authorization": f"Bearer {KEY}"})  # fmt: skip
        return await running, late.status_code

    children = server.children() if os.path.isdir("/proc/self/task") else None
    got, late_status = asyncio.run(scenario())
    assert late_status == 503
    assert got == drain_tokens  # the running request finished
    assert server.proc.wait(60) == 0
    if children is not None:  # no orphan engine core
        assert children and all(_gone(pid, 5) for pid in children)
