"""A soak run (marked slow): hundreds of requests against a real server with a KV cache small
enough to preempt, a shared system prompt (prefix hits) and a third of the clients dropping
their stream midway. Afterwards every block is free, nothing runs or waits, each request is
counted once under its finish reason, and the processes' memory is back near where the first
round left it."""

from __future__ import annotations

import asyncio
import os
import random

import httpx
import pytest
from servers import real_server

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc (Linux)"),
]

SYSTEM = "You are a careful assistant. Answer briefly and precisely. " * 6


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


async def _one(c: httpx.AsyncClient, s, rng: random.Random) -> str:
    body = {
        "prompt": SYSTEM + f"Question {rng.randrange(10_000)}: count to {rng.randrange(50)}.",
        "max_tokens": rng.randrange(8, 64),
        "temperature": rng.choice([0.0, 0.8]),
        "stream": True,
        "ignore_eos": rng.random() < 0.5,
    }
    drop_after = rng.randrange(1, 6) if rng.random() < 0.33 else None
    got = 0
    async with c.stream("POST", s.url + "/v1/completions", json=body, headers=s.headers) as r:
        if r.status_code != 200:
            return str(r.status_code)
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                got += 1
                if drop_after is not None and got >= drop_after:
                    return "dropped"
    return "done"


async def _round(s, n: int, concurrency: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    sem = asyncio.Semaphore(concurrency)

    async def limited(c: httpx.AsyncClient) -> str:
        async with sem:
            return await _one(c, s, rng)

    async with httpx.AsyncClient(timeout=300) as c:
        return await asyncio.gather(*[limited(c) for _ in range(n)])


def test_soak_returns_to_baseline(tmp_path):
    s = real_server(tmp_path / "server.log", "--max-model-len", "512", "--max-num-seqs", "16",
                    "--num-gpu-blocks-override", "40", "--max-waiting-requests", "-1")  # fmt: skip
    try:
        s.wait_ready()
        core = s.engine_core_pid()
        first = asyncio.run(_round(s, 60, 16, seed=0))
        rss0 = _rss_kb(s.proc.pid) + _rss_kb(core)
        results = first + asyncio.run(_round(s, 240, 16, seed=1))
        assert set(results) <= {"done", "dropped"}, sorted(set(results))

        counted = sum(
            s.metric("pagoda:request_success_total", finished_reason=r)
            for r in ("stop", "length", "abort", "error")
        )
        for _ in range(100):  # the last aborts reach the metrics with the next step
            if counted == len(results):
                break
            asyncio.run(asyncio.sleep(0.1))
            counted = sum(
                s.metric("pagoda:request_success_total", finished_reason=r)
                for r in ("stop", "length", "abort", "error")
            )
        assert counted == len(results)
        assert s.metric("pagoda:request_success_total", finished_reason="error") == 0
        assert s.metric("pagoda:kv_cache_usage_perc") == 0
        assert s.metric("pagoda:num_requests_running") == 0
        assert s.metric("pagoda:num_requests_waiting") == 0
        assert s.metric("pagoda:num_preemptions_total") > 0
        assert s.metric("pagoda:prefix_cache_hits_total") > 0
        rss1 = _rss_kb(s.proc.pid) + _rss_kb(core)
        assert rss1 < rss0 + 150_000, (rss0, rss1)
        assert "Traceback" not in s.log()
    finally:
        s.stop()
