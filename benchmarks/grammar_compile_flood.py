"""What constraints slow to compile cost the other clients of `pagoda serve` (the embedded model):
two requests whose constraint takes xgrammar far longer than PAGODA_GRAMMAR_COMPILE_TIMEOUT_S
(`--timeout`, 10 s here) to compile, then ordinary structured requests (a JSON schema, a new
one each time so that none is cached) and plain ones, sent while the slow ones compile and after
they are refused.

    python benchmarks/grammar_compile_flood.py [--timeout 10] [--choices 50000] [--after 20]

The slow constraints are two choices of `--choices` strings (50,000: 30 s to compile alone,
2-core AMD EPYC). Printed: each request's status and time; how many cores were busy during the
slow compiles and in the `--after` seconds after their refusal, the server's processes (their
CPU time from /proc) and the whole machine's (/proc/stat: the client's own work and anything
else running included); and the server's processes at the end (pid, command). Linux only.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from pagoda.tune.server import TrialServer


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and the processes under it (reaped children's included)."""
    total = 0.0
    for p in [pid, *(child for child, _ in _tree(pid))]:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().split(")")[-1].split()
        except OSError:
            continue
        total += sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return total


def _busy_cores(seconds: float, server: int) -> str:
    """The cores busy on average over the next `seconds`: the server's processes, and the
    whole machine's (other work included)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    t0, i0 = sample()
    c0 = _tree_cpu_s(server)
    time.sleep(seconds)
    t1, i1 = sample()
    c1 = _tree_cpu_s(server)
    machine = (1 - (i1 - i0) / max(1, t1 - t0)) * os.cpu_count()
    return f"server {(c1 - c0) / seconds:.2f}, machine {machine:.2f}"


def _tree(pid: int) -> list[tuple[int, str]]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        for child in children:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:90]
            out += [(child, cmd), *_tree(child)]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--choices", type=int, default=50_000)
    ap.add_argument("--after", type=float, default=20.0)
    args = ap.parse_args()

    log = Path(tempfile.mkdtemp()) / "server.log"
    os.environ["PAGODA_GRAMMAR_COMPILE_TIMEOUT_S"] = str(args.timeout)  # the server inherits it
    cmd = [sys.executable, "-m", "pagoda.entrypoints.openai.api_server", "--max-model-len", "512",
           "--uvicorn-log-level", "warning", "--disable-log-stats"]  # fmt: skip
    server = TrialServer(cmd, {}, str(log))
    url = server.url
    try:
        server.wait_ready(300)
        t_start = time.monotonic()

        def post(body: dict, label: str, timeout: float = 300) -> httpx.Response:
            t0 = time.monotonic()
            r = httpx.post(url + "/v1/completions", json=body, timeout=timeout)
            msg = r.json().get("error", {}).get("message", "")[:80] if r.status_code != 200 else ""
            print(f"[t={t0 - t_start:5.1f} s] {label}: {r.status_code} in "
                  f"{time.monotonic() - t0:.2f} s {msg}", flush=True)  # fmt: skip
            return r

        schemas = iter(range(1000))

        def structured(label: str) -> httpx.Response:
            i = next(schemas)
            schema = {"type": "object", "required": [f"field_{i}"],
                      "properties": {f"field_{i}": {"type": "integer"}}}  # fmt: skip
            body = {"prompt": "JSON:", "max_tokens": 8, "temperature": 0,
                    "structured_outputs": {"json": schema}}  # fmt: skip
            return post(body, label)

        def plain(label: str) -> httpx.Response:
            return post({"prompt": "Hello", "max_tokens": 8, "temperature": 0}, label)

        structured("structured, first (imports xgrammar)")
        structured("structured, warm")
        plain("plain, warm")
        threads = []
        for k in range(2):  # two different constraints (identical ones share one compile)
            choice = [f"option {k} number {i} of many" for i in range(args.choices)]
            slow = {"prompt": "x", "max_tokens": 4, "structured_outputs": {"choice": choice}}
            threads.append(threading.Thread(target=post, args=(slow, f"slow compile {k}")))
        t_slow = time.monotonic()
        for t in threads:
            t.start()
        print(
            f"cores busy in the first 2 s of the slow compiles: {_busy_cores(2.0, server.proc.pid)}"
        )
        structured("structured, during the slow compiles")
        plain("plain, during the slow compiles")
        for t in threads:
            t.join()
        print(f"slow requests answered after {time.monotonic() - t_slow:.1f} s")
        end = time.monotonic() + args.after
        while time.monotonic() < end:
            print(f"cores busy over 3 s after the refusals: {_busy_cores(3.0, server.proc.pid)}")
            structured("structured, after the refusals")
            plain("plain, after the refusals")
        print("server processes:")
        for pid, command in _tree(server.proc.pid):
            print(f"  {pid} {command}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
