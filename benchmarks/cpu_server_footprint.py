"""Cold start and resident memory of `pagoda serve` on the embedded model, beside llama.cpp's
server on the same GGUF file, one after the other.

    python benchmarks/cpu_server_footprint.py [--llamacpp-python /path/to/venv/bin/python]
        [--repeats 3] [--out benchmarks/results/cpu/footprint.json]

For each server: seconds from process start to /health answering and to the first token of a
first completion, then the resident memory (RSS, the server and all its children summed, from
/proc) after 16 completions of 64 tokens. Pagoda is started with its kernel cache warm and, once,
with an empty one (`PAGODA_CACHE_DIR` a fresh folder: the C kernels are compiled first).
llama.cpp's server is `python -m llama_cpp.server` (llama-cpp-python with its `server` extra's
packages) with a 2048-token context and the same thread count.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pagoda.config import embedded_model_path  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except Exception:  # noqa: BLE001 - not up yet
        return 0


def _complete(url: str, max_tokens: int) -> None:
    body = json.dumps({"prompt": "The capital of France is", "max_tokens": max_tokens,
                       "temperature": 0}).encode()  # fmt: skip
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def _tree_rss_kb(pid: int) -> int:
    """RSS of `pid` and every descendant."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(x.split()[1]) for x in f if x.startswith("VmRSS"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (OSError, StopIteration):
            pass
    return total


def measure(cmd: list[str], port: int, env: dict[str, str] | None = None) -> dict[str, float]:
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, **(env or {})})  # fmt: skip
    try:
        while _get(url + "/health") != 200 and _get(url + "/v1/models") != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd[:3])} exited with {proc.returncode}")
            if time.perf_counter() - t0 > 600:
                raise RuntimeError("no answer in 600 s")
            time.sleep(0.05)
        ready = time.perf_counter() - t0
        _complete(url, 1)
        first_token = time.perf_counter() - t0
        for _ in range(16):
            _complete(url, 64)
        rss = _tree_rss_kb(proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have exited on its own
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return {"ready_s": ready, "first_token_s": first_token, "rss_mib": rss / 1024}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--llamacpp-python", default="/tmp/llamacpp-venv/bin/python")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "benchmarks/results/cpu/footprint.json")
    args = p.parse_args()
    gguf = embedded_model_path()
    runs: dict[str, list[dict[str, float]]] = {}

    def pagoda_cmd(port: int) -> list[str]:
        return [sys.executable, "-m", "pagoda.cli", "serve", "--port", str(port),
                "--disable-log-stats"]  # fmt: skip

    with tempfile.TemporaryDirectory() as empty_cache:
        port = _free_port()
        runs["pagoda, first kernel build"] = [
            measure(pagoda_cmd(port), port, {"PAGODA_CACHE_DIR": empty_cache})
        ]
    for name, make in (
        ("pagoda", pagoda_cmd),
        ("llama.cpp server", lambda port: [
            args.llamacpp_python, "-m", "llama_cpp.server", "--model", gguf, "--port", str(port),
            "--n_ctx", "2048", "--n_threads", str(args.threads)]),
    ):  # fmt: skip
        runs[name] = []
        for _ in range(args.repeats):
            port = _free_port()
            runs[name].append(measure(make(port), port))
    summary = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    result = {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
              "runs": runs, "median": summary}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print("| server | to /health (s) | to first token (s) | RSS after 16 requests (MiB) |")
    print("|---|---|---|---|")
    for name, m in summary.items():
        print(f"| {name} | {m['ready_s']:.1f} | {m['first_token_s']:.1f} | {m['rss_mib']:.0f} |")


if __name__ == "__main__":
    main()
