"""`pagoda serve` on the GPU with dummy Llama-3-8B-shape weights (bf16, or `--quantization Q`;
SMOKE_MODEL another config): request kinds the CPU tests cover, checked here on CUDA: a streamed
completion with usage, n=2 with logprobs, a prompt too long (400), a burst past
--max-waiting-requests (503s counted as admission rejections), then /metrics' engine series.
Prints one line per check; exits 1 if any failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

PORT = 8321
URL = f"http://127.0.0.1:{PORT}"
failed = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}"[:300], flush=True)
    if not ok:
        failed.append(name)


def main() -> int:
    quant = sys.argv[1:]
    model = os.environ.get("SMOKE_MODEL", "benchmarks/presets/llama-3-8b/config.json")
    cmd = [sys.executable, "-m", "pagoda.cli", "serve", model,
           "--load-format", "dummy", "--skip-tokenizer-init", "--served-model-name", "m",
           "--max-model-len", "2048", "--max-num-seqs", "8", "--max-waiting-requests", "8",
           "--port", str(PORT), *quant]  # fmt: skip
    log = open(
        f"{os.environ.get('SMOKE_DIR', '/tmp/run83')}/serve_{'_'.join(quant) or 'bf16'}.log", "w"
    )
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(URL + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() - t0 > 150:
                check("server ready", False, f"exit {proc.poll()}")
                return 1
            time.sleep(1)
        check("server ready", True, f"{time.monotonic() - t0:.1f} s")
        c = httpx.Client(base_url=URL, timeout=60)
        ids = list(range(100, 164))
        r = c.post("/v1/completions", json={"model": "m", "prompt": ids, "max_tokens": 16,
                                            "temperature": 0, "n": 2, "logprobs": 2})  # fmt: skip
        body = r.json()
        check("completion n=2 logprobs", r.status_code == 200 and len(body["choices"]) == 2
              and len(body["choices"][0]["logprobs"]["token_logprobs"]) == 16, r.text[:200])  # fmt: skip
        chunks = []
        with c.stream("POST", "/v1/completions", json={
                "model": "m", "prompt": ids, "max_tokens": 12, "stream": True,
                "stream_options": {"include_usage": True}}) as s:  # fmt: skip
            for line in s.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
        usage = chunks[-1].get("usage") if chunks else None
        check("stream with usage", bool(usage) and usage["completion_tokens"] == 12, str(usage))
        big = c.post("/v1/completions", json={"model": "m", "prompt": [5] * 4000, "max_tokens": 4})
        check("prompt past the context is 400", big.status_code == 400, big.text[:150])
        with ThreadPoolExecutor(40) as ex:
            codes = list(ex.map(lambda _: c.post("/v1/completions", json={
                "model": "m", "prompt": ids, "max_tokens": 300, "ignore_eos": True}).status_code,
                range(40)))  # fmt: skip
        check("burst: 200s and 503s", 200 in codes and 503 in codes and set(codes) <= {200, 503},
              f"{codes.count(200)} x 200, {codes.count(503)} x 503")  # fmt: skip
        m = c.get("/metrics").text
        lines = [x for x in m.splitlines() if x.startswith("pagoda:")]
        rej = [x for x in lines if x.startswith("pagoda:admission_rejections_total")]
        check("admission rejections counted", any(float(x.split()[-1]) >= codes.count(503)
                                                  for x in rej), str(rej))  # fmt: skip
        check(
            'engine="0" on engine series',
            any('engine="0"' in x for x in lines if x.startswith("pagoda:num_requests_running")),
        )
        check("GPU memory series", any(x.startswith("pagoda:gpu_memory_used_bytes") for x in lines))
        for name in (
            "kv_cache_usage_perc",
            "generation_tokens_total",
            "request_success_total",
            "prompt_tokens_cached_total",
            "num_requests_waiting_by_reason",
        ):
            got = [x for x in lines if x.startswith("pagoda:" + name)]
            check(f"metric {name}", bool(got), got[0] if got else "")
        health = c.get("/health").json()
        check("healthy after all", health.get("status") == "ok", str(health))
        return 1 if failed else 0
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


if __name__ == "__main__":
    sys.exit(main())
