"""Load for `pagoda bench serve` and `pagoda tune`: arrivals at a request rate, a sweep of rates,
defaults by the server's device, and the latency-vs-throughput plot.

Arrivals follow vLLM's benchmark: gaps drawn from a gamma distribution of mean 1 / rate and
shape `burstiness` (1: a Poisson process; below 1 burstier, above 1 more even), or all at once
for rate inf; at most `max_concurrency` requests in flight. Each request is one streamed
completion timed by `serve.request_completion`.
"""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request
from collections.abc import Sequence
from typing import Any

# Defaults of `pagoda bench serve` by the server's device: vLLM's 1,000 prompts of 1,024 tokens
# run for hours on a CPU; there 100 prompts of 256 tokens with 64 out take a minute or two.
DEVICE_DEFAULTS = {
    "cuda": {"num_prompts": 1000, "random_input_len": 1024, "random_output_len": 128},
    "cpu": {"num_prompts": 100, "random_input_len": 256, "random_output_len": 64},
}


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds to wait before each of `n` requests (the first at 0): gamma-distributed with
    mean 1 / rate and shape `burstiness`; all zeros for rate inf."""
    if rate <= 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    return [0.0] + [rng.gammavariate(burstiness, theta) for _ in range(n - 1)]


async def run_load(
    session: Any, url: str, model: str, requests: Sequence[Any], rate: float,
    burstiness: float = 1.0, max_concurrency: int | None = None, ignore_eos: bool = False,
    headers: dict[str, str] | None = None, seed: int = 0,
) -> tuple[list[Any], float]:  # fmt: skip
    """Send `requests` to `url` at `rate`; returns (per-request outputs, seconds)."""
    from pagoda.bench.serve import request_completion

    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(req: Any) -> Any:
        if sem is None:
            return await request_completion(session, url, model, req, ignore_eos, headers or {})
        async with sem:
            return await request_completion(session, url, model, req, ignore_eos, headers or {})

    start = time.perf_counter()
    tasks = []
    for req, gap in zip(requests, arrival_gaps(len(requests), rate, burstiness, seed)):
        if gap:
            await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(req)))
    try:
        outputs = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        raise
    return list(outputs), time.perf_counter() - start


def get_json(url: str, headers: dict[str, str] | None = None, timeout: float = 30) -> Any:
    """GET `url` as JSON with the standard library (no HTTP client to install)."""
    import json

    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - the user's server
        return json.loads(r.read())


def post_json(url: str, body: Any, headers: dict[str, str] | None = None,
              timeout: float = 60) -> tuple[int, Any]:  # fmt: skip
    """POST JSON; returns (status, decoded body or None)."""
    import json
    import urllib.error

    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, None


def server_device(base_url: str, headers: dict[str, str] | None = None) -> str:
    """ "cuda" or "cpu" for the server at `base_url`, from its /metrics: a Pagoda server on a GPU
    exports pagoda:gpu_memory_total_bytes; other servers (vLLM) are taken to run on a GPU."""
    try:
        req = urllib.request.Request(base_url + "/metrics", headers=headers or {})
        with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310
            text = r.read().decode(errors="replace")
    except OSError:
        return "cuda"
    if "pagoda:" not in text:
        return "cuda"
    return "cuda" if "pagoda:gpu_memory_total_bytes" in text else "cpu"


def plot_latency_vs_throughput(
    series: dict[str, list[dict[str, Any]]], path: str, title: str = ""
) -> str | None:
    """One line per series (label -> metrics of its rates, vLLM's names): p99 and median TTFT
    and median TPOT against output tokens/s. Returns the path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, runs in series.items():
        runs = sorted(runs, key=lambda m: m["output_throughput"])
        x = [m["output_throughput"] for m in runs]
        (line,) = axes[0].plot(x, [m["p99_ttft_ms"] for m in runs], "o-", label=f"{label} p99")
        axes[0].plot(x, [m["median_ttft_ms"] for m in runs], "o--", color=line.get_color(),
                     alpha=0.6, label=f"{label} p50")  # fmt: skip
        axes[1].plot(x, [m["median_tpot_ms"] for m in runs], "o-", color=line.get_color(),
                     label=label)  # fmt: skip
    for ax, name in zip(axes, ("TTFT (ms)", "median TPOT (ms)")):
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
