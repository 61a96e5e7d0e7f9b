"""How long one large /tokenize call holds up the server's event loop: a /health request every
10 ms while a prompt of --mb megabytes is tokenized with its token strings; prints the call's
time and the longest and median /health answer times.

    python -m pagoda.entrypoints.openai.api_server --port 8123 &
    python benchmarks/tokenize_stall.py http://localhost:8123 --mb 3.6
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import urllib.request


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--mb", type=float, default=3.6, help="prompt size (under the body limit)")
    args = ap.parse_args()
    prompt = ("hello world, " * (int(args.mb * 1e6) // 13 + 1))[: int(args.mb * 1e6)]
    waits: list[float] = []
    done = threading.Event()

    def ping() -> None:
        while not done.is_set():
            t = time.perf_counter()
            urllib.request.urlopen(args.url + "/health").read()
            waits.append(time.perf_counter() - t)
            time.sleep(0.01)

    pinger = threading.Thread(target=ping)
    pinger.start()
    time.sleep(0.5)
    body = json.dumps({"prompt": prompt, "return_token_strs": True}).encode()
    request = urllib.request.Request(
        args.url + "/tokenize", data=body, headers={"content-type": "application/json"}
    )
    t = time.perf_counter()
    size = len(urllib.request.urlopen(request).read())
    took = time.perf_counter() - t
    time.sleep(0.5)
    done.set()
    pinger.join()
    print(
        f"/tokenize {took:.2f} s, {size / 1e6:.1f} MB answer; /health longest "
        f"{max(waits) * 1e3:.0f} ms, median {statistics.median(waits) * 1e3:.1f} ms "
        f"({len(waits)} pings)"
    )


if __name__ == "__main__":
    main()
