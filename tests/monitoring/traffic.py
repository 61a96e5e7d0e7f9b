"""Requests that move every panel of the dashboards: completions and chat, streamed or not,
one that fails (finish_reason "error" on the fake engine), one that repeats itself
(finish_reason "repetition"), streams dropped mid-way (abort)."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

FAIL_PROMPT = "please FAIL here"  # the fake engine ends it with finish_reason "error"
SAY_ABAB = "SAY:abababababab|"  # the fake engine's greedy output for it


def one_round(url: str, headers: dict[str, str], rng: random.Random) -> None:
    with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
        body = {"model": "smol", "prompt": "shared system prompt " + str(rng.random()),
                "max_tokens": rng.randint(4, 24)}  # fmt: skip
        c.post("/v1/completions", json=body)
        stop = {"max_tokens": 26, "temperature": 0, "stop": ["a", "e", "i", "o"]}
        c.post("/v1/completions", json={**body, **stop})  # greedy: the alphabet, so it stops
        c.post("/v1/chat/completions", json={"model": "smol", "max_tokens": 8,
                                             "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        c.post("/v1/completions", json={**body, "prompt": FAIL_PROMPT})
        repeats = {"max_pattern_size": 2, "min_count": 3}  # "ababab": finish_reason "repetition"
        c.post("/v1/completions", json={**body, "prompt": SAY_ABAB, "temperature": 0,
                                        "repetition_detection": repeats})  # fmt: skip
        with c.stream("POST", "/v1/completions",
                      json={**body, "max_tokens": 200, "stream": True}) as r:  # fmt: skip
            for _ in r.iter_lines():
                break  # the client goes away: the request is aborted


def restart_engine_once(url: str, headers: dict[str, str]) -> None:
    """The monitored fake server's engine core dies at this prompt and is restarted."""
    with httpx.Client(base_url=url, headers=headers, timeout=30) as c:
        r = c.post("/v1/completions", json={"model": "smol", "prompt": "DIE-ONCE", "max_tokens": 2})
        assert r.status_code in (500, 503), r.text
        deadline = time.monotonic() + 60
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine core was not restarted"
            time.sleep(0.2)


def overload_once(url: str, headers: dict[str, str], n: int = 24) -> None:
    """More requests at once than the server admits (started with --max-num-seqs 4
    --max-waiting-requests 8): some are refused at the door, a 503 that
    admission_rejections_total counts."""
    body = {"model": "smol", "prompt": "burst", "max_tokens": 200}
    with httpx.Client(base_url=url, headers=headers, timeout=60) as c, ThreadPoolExecutor(n) as ex:
        codes = list(ex.map(lambda _: c.post("/v1/completions", json=body).status_code, range(n)))
    assert 503 in codes and 200 in codes, codes


class Traffic:
    """Rounds of `one_round` from `n` threads until stopped (bounded by `max_rounds`)."""

    def __init__(self, url: str, headers: dict[str, str], n: int = 3, max_rounds: int = 400):
        self.stop = threading.Event()
        self.rounds = 0
        self.threads = [threading.Thread(target=self._run, args=(url, headers, i, max_rounds),
                                         daemon=True) for i in range(n)]  # fmt: skip

    def _run(self, url: str, headers: dict[str, str], seed: int, max_rounds: int) -> None:
        rng = random.Random(seed)
        for _ in range(max_rounds):
            if self.stop.is_set():
                return
            try:
                one_round(url, headers, rng)
                self.rounds += 1
            except httpx.HTTPError:
                pass

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)
