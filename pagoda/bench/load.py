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


def check_output_path(flag: str, path: str | None) -> None:
    """Refuse a file to be written after the run whose folder does not exist or cannot be
    written, before the run rather than after it."""
    import os

    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or os.path.isdir(path):
        raise ValueError(f"{flag} {path}: cannot write a file there")


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


def apply_device_defaults(args: Any, base_url: str, headers: dict[str, str]) -> str:
    """Fill the workload flags left unset from `DEVICE_DEFAULTS` for the server's device;
    returns the device."""
    device = server_device(base_url, headers)
    for name, value in DEVICE_DEFAULTS[device].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    return device


def plot_latency_vs_throughput(
    series: dict[str, list[dict[str, Any]]], path: str, title: str = ""
) -> str | None:
    """One line per series (label -> metrics of its rates, vLLM's names): p99 TTFT and median
    TPOT against output tokens/s. Returns the path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for label, runs in series.items():
        runs = sorted(runs, key=lambda m: m["output_throughput"])
        x = [m["output_throughput"] for m in runs]
        bold = "baseline" in label or "recommended" in label
        style = {"lw": 2.6 if bold else 1.4, "ms": 6 if bold else 4, "alpha": 1.0 if bold else 0.8}
        (line,) = axes[0].plot(x, [m["p99_ttft_ms"] for m in runs], "o-", label=label, **style)
        axes[1].plot(x, [m["median_tpot_ms"] for m in runs], "o-", color=line.get_color(),
                     **style)  # fmt: skip
    for ax, name in zip(axes, ("p99 TTFT (ms)", "median TPOT (ms)")):
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    fig.legend(loc="center right", fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.78, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_sweep(results: list[dict[str, Any]]) -> None:
    """One line per rate of a sweep."""
    print("{s:{c}^{n}}".format(s=" Request rate sweep ", n=78, c="="))
    print(f"{'rate':>8} {'req/s':>8} {'goodput':>8} {'out tok/s':>10} {'p50 TTFT':>9} "
          f"{'p99 TTFT':>9} {'p50 TPOT':>9} {'p99 E2EL':>9}  (ms)")  # fmt: skip
    for m in results:
        good = m["request_goodput"]
        print(f"{m['rate']:>8.4g} {m['request_throughput']:>8.2f} "
              f"{'-' if good is None else format(good, '.2f'):>8} {m['output_throughput']:>10.1f} "
              f"{m.get('median_ttft_ms', 0):>9.1f} {m.get('p99_ttft_ms', 0):>9.1f} "
              f"{m.get('median_tpot_ms', 0):>9.1f} {m.get('p99_e2el_ms', 0):>9.1f}")  # fmt: skip


def save_result(
    args: Any, base_url: str, goodput: dict[str, float], m: dict[str, Any],
    outputs: list[Any], sweep: bool,
) -> None:  # fmt: skip
    """The run's result as `vllm bench serve --save-result` writes it (its field names)."""
    import json
    import os
    from datetime import datetime

    rate = args.request_rate if args.request_rate != float("inf") else "inf"
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "model_id": args.model,
        "base_url": base_url,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "goodput": goodput or None,
        **m,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_tokens for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "errors": [o.error for o in outputs],
    }
    name = args.result_filename or (
        f"pagoda-{rate}qps-concurrency{args.max_concurrency}-"
        f"{os.path.basename(str(args.model))}-{result['date']}.json"
    )
    if sweep and args.result_filename:  # one file per rate
        stem, ext = os.path.splitext(name)
        name = f"{stem}-{rate}qps{ext or '.json'}"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    with open(name, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"Saved the result to {name}")
