"""Per-request metrics of a real `pagoda serve` on the embedded model, read from /metrics as a
Prometheus scrape sees them: a request dropped from the queue is queue time, not prefill; the
prompt tokens counted are the prompts', prefix-cache hits included; a request refused at the
door for the queue bound is an admission rejection."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
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
    names = ("prompt_tokens_total", "prefix_cache_hits_total", "request_prompt_tokens_sum",
             "prompt_tokens_cached_total", "prompt_tokens_cached_by_source_total",
             "request_prefill_kv_computed_tokens_sum", "request_num_preemptions_count",
             "request_params_max_tokens_sum", "request_params_n_sum")  # fmt: skip
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
    # vLLM's names for the same split: the cached tokens (the device's prefix cache is the one
    # tier), and per request what prefill computed.
    assert delta["prompt_tokens_cached_total"] == src["local_cache_hit"], delta
    assert delta["prompt_tokens_cached_by_source_total"] == src["local_cache_hit"], delta
    assert delta["request_prefill_kv_computed_tokens_sum"] == src["local_compute"], delta
    assert delta["request_num_preemptions_count"] == 2, delta
    assert delta["request_params_max_tokens_sum"] == 2 * 2, delta
    assert delta["request_params_n_sum"] == 2, delta


def test_a_request_refused_at_the_door_is_an_admission_rejection(server):
    # One running, 4 waiting at most: of 8 at once some are refused at the door (503) and
    # counted by reason (before: counted nowhere); a 503 for waiting past --max-queue-delay-s
    # ends an admitted request (finish_reason "abort"), not a rejection. Each request holds its
    # place long enough (120 tokens) that the burst's last arrive before the first ends, even
    # on a busy machine.
    rejected0 = server.metric("pagoda:admission_rejections_total", reason="max_num_queued_reqs")
    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(lambda i: _post(server, {"prompt": f"burst {i}", "max_tokens": 120,
                                                       "ignore_eos": True}), range(8)))  # fmt: skip
    at_door = [r for r in answers if r.status_code == 503 and "at capacity" in r.text]
    assert at_door and any(r.status_code == 200 for r in answers), [r.text for r in answers]
    rejected = server.metric("pagoda:admission_rejections_total", reason="max_num_queued_reqs")
    assert rejected - rejected0 == len(at_door), [r.text for r in answers]
