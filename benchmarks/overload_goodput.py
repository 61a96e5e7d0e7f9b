"""Goodput of `pagoda serve` at saturation and at three times that load, with load shedding on
(the default) and off (`--max-waiting-requests -1`), on the embedded model.

    python benchmarks/overload_goodput.py [--rates 1,2,4,8] [--duration 40] [--slo-ttft-ms 2000]
        [--slo-tpot-ms 150] [--out DIR] [-- extra pagoda serve flags]

For each setting one server is started; `pagoda bench serve` sends Poisson arrivals of random
128-token prompts asking for 64 tokens (ignore_eos) at each rate of the sweep for `--duration`
seconds; the saturation goodput is the sweep's best (requests/s meeting both SLOs), then the
same requests arrive at three times that rate. A refused request (503) counts as not good, as
does one that misses an SLO. The issue's target: goodput under 3x overload at least half the
saturation goodput.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(flags: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = ["pagoda", "serve", "--port", str(port), "--disable-log-stats", *flags]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pagoda serve exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("pagoda serve did not start")


def stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def bench(url: str, rate: float, args: argparse.Namespace, out: Path) -> dict:
    n = max(8, int(rate * args.duration))
    cmd = [
        "pagoda", "bench", "serve", "--base-url", url, "--dataset-name", "random",
        "--random-input-len", "128", "--random-output-len", "64", "--ignore-eos",
        "--num-prompts", str(n), "--request-rate", str(rate), "--seed", "0",
        "--goodput", f"ttft:{args.slo_ttft_ms}", f"tpot:{args.slo_tpot_ms}",
        "--result-filename", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    r = json.loads(out.read_text())
    return {
        "rate": rate,
        "num_prompts": n,
        "completed": r["completed"],
        "refused_or_failed": r["failed"],
        "goodput": r["request_goodput"],
        "median_ttft_ms": r["median_ttft_ms"],
        "p99_ttft_ms": r["p99_ttft_ms"],
        "median_tpot_ms": r["median_tpot_ms"],
        "output_throughput": r["output_throughput"],
    }


def run_setting(name: str, flags: list[str], args: argparse.Namespace, out: Path) -> dict:
    proc, url = start_server(flags, out / f"{name}-server.log")
    try:
        sweep = []
        for rate in args.rates:
            row = bench(url, rate, args, out / f"{name}-rate{rate:g}.json")
            sweep.append(row)
            print(f"{name:>12} rate {rate:6.2f}/s  goodput {row['goodput']:.2f}/s  "
                  f"completed {row['completed']}/{row['num_prompts']}", flush=True)  # fmt: skip
        best = max(sweep, key=lambda r: r["goodput"])
        over = bench(url, 3 * best["rate"], args, out / f"{name}-overload.json")
        print(f"{name:>12} 3x rate {over['rate']:6.2f}/s  goodput {over['goodput']:.2f}/s  "
              f"completed {over['completed']}/{over['num_prompts']}", flush=True)  # fmt: skip
        return {"flags": flags, "sweep": sweep, "saturation": best, "overload": over,
                "ratio": over["goodput"] / best["goodput"] if best["goodput"] else 0.0}  # fmt: skip
    finally:
        stop_server(proc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rates", type=lambda s: [float(x) for x in s.split(",")],
                   default=[1.0, 2.0, 4.0, 8.0])  # fmt: skip
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per rate")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=150.0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/overload"))
    p.add_argument("--settings", default="shedding,no-shedding")
    args, serve_flags = p.parse_known_args()
    serve_flags = [f for f in serve_flags if f != "--"]
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {
        "shedding": serve_flags,
        "no-shedding": [*serve_flags, "--max-waiting-requests", "-1"],
    }
    results = {}
    for name in args.settings.split(","):
        results[name] = run_setting(name, settings[name], args, args.out)
    (args.out / "summary.json").write_text(json.dumps(results, indent=2))
    print(f"\nSLO: TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms")
    print("| setting | saturation rate | goodput | 3x rate | goodput | ratio |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        s, o = r["saturation"], r["overload"]
        print(f"| {name} | {s['rate']:g}/s | {s['goodput']:.2f}/s | {o['rate']:g}/s | "
              f"{o['goodput']:.2f}/s | {r['ratio']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
