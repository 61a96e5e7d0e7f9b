"""Per-request metrics of a real `pagoda serve` on the embedded model, read from /metrics as a
Prometheus scrape sees them: a request dropped from the queue is queue time, not prefill; the
prompt tokens counted are the prompts', prefix-cache hits included."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "reliability"))
from servers import real_server  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = real_server(
        tmp_path_factory.mktemp("metrics") / "server.log",
        "--max-model-len", "512", "--max-num-seqs", "1", "--max-waiting-requests", "4",
        "--max-queue-delay-s", "1",
    )  # fmt: skip
    s.wait_ready()
    yield s
    s.stop()


def _post(server, body: dict) -> httpx.Response:
    body = {"model": "smol", **body}
    return httpx.post(server.url + "/v1/completions", json=body, headers=server.headers,
                      timeout=120)  # fmt: skip


def _metrics(server, *names: str) -> dict[str, float]:
    return {n: server.metric("pagoda:" + n) for n in names}


def test_a_request_dropped_from_the_queue_is_queue_time_not_prefill(server):
    names = ("request_queue_time_seconds_sum", "request_prefill_time_seconds_count",
             "request_inference_time_seconds_sum", "request_decode_time_seconds_count",
             "request_success_total")  # fmt: skip
    busy, stop = threading.Event(), threading.Event()

    def occupy() -> None:  # the one running place, held until the checks are done
        body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 400,
                "ignore_eos": True, "stream": True}  # fmt: skip
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          headers=server.headers, timeout=120) as r:  # fmt: skip
            for _line in r.iter_lines():
                busy.set()
                if stop.is_set():
                    return

    t = threading.Thread(target=occupy, daemon=True)
    t.start()
    assert busy.wait(60)
    before = _metrics(server, *names)
    r = _post(server, {"prompt": "Refused one", "max_tokens": 5})
    assert r.status_code == 503, r.text
    deadline = time.monotonic() + 30
    while (after := _metrics(server, *names))["request_success_total"] < before[
        "request_success_total"
    ] + 1:
        assert time.monotonic() < deadline, "the dropped request was not counted"
        time.sleep(0.1)
    stop.set()
    t.join(120)
    delta = {n: after[n] - before[n] for n in names}
    # It waited its 1 s in the queue and never ran (before: queue time 0, the wait recorded
    # as prefill and inference time).
    assert delta["request_queue_time_seconds_sum"] >= 0.9, delta
    assert delta["request_prefill_time_seconds_count"] == 0, delta
    assert delta["request_decode_time_seconds_count"] == 0, delta
    assert delta["request_inference_time_seconds_sum"] == 0, delta


def test_prompt_tokens_total_counts_prefix_cache_hits(server):
    names = ("prompt_tokens_total", "prefix_cache_hits_total", "request_prompt_tokens_sum")
    by_source = {src: {"source": src} for src in ("local_compute", "local_cache_hit")}
    before = _metrics(server, *names)
    before_src = {k: server.metric("pagoda:prompt_tokens_by_source_total", **v)
                  for k, v in by_source.items()}  # fmt: skip
    prompt = "The quick brown fox jumps over the lazy dog. " * 10 + str(time.time())
    usage = sum(
        _post(server, {"prompt": prompt, "max_tokens": 2}).json()["usage"]["prompt_tokens"]
        for _ in range(2)
    )
    after = _metrics(server, *names)
    src = {k: server.metric("pagoda:prompt_tokens_by_source_total", **v) - before_src[k]
           for k, v in by_source.items()}  # fmt: skip
    delta = {n: after[n] - before[n] for n in names}
    # The second prompt came from the prefix cache (before: left out of prompt_tokens_total,
    # 126 of 238 counted), as vLLM: the counter agrees with usage and request_prompt_tokens.
    assert delta["prefix_cache_hits_total"] > 0, delta
    assert delta["prompt_tokens_total"] == usage == delta["request_prompt_tokens_sum"], delta
    assert src["local_cache_hit"] == delta["prefix_cache_hits_total"], (src, delta)
    assert src["local_compute"] + src["local_cache_hit"] == usage, src
