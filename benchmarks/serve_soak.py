"""A soak run of `pagoda serve` on any device: rounds of hundreds of concurrent requests of
mixed kinds against one server whose KV cache is small enough to preempt, then the checks that
it came back to rest. `tests/reliability/test_soak.py` does this on a CPU with the embedded
model; this script runs it anywhere, e.g. on a GPU with dummy Llama-3-8B-shape weights and
token-id prompts (`--skip-tokenizer-init`), where no test runs it.

Requests, each drawn at random: streamed completions (a third of the clients leave midway),
non-streamed ones with n=2 and logprobs, greedy ones with a seed, and requests the server must
refuse with a 400 (a prompt past the context, max_tokens=0, temperature=-1, top_p=2). Every
prompt starts with the same 96-token system prefix (prefix-cache hits). Afterwards: every
admitted request counted once under its finish reason and none as an error, no block in use,
nothing running or waiting, preemptions and prefix hits seen, the refusals were 400s and
nothing else failed (each sample of an n=2 request counted as a request, as vLLM counts them), `/health` still 200, no traceback in the log, and the server's memory
(and the GPU's, where there is one) no higher after the last round than after the first
beyond a margin.

    python benchmarks/serve_soak.py                                    # CPU, embedded model
    python benchmarks/serve_soak.py --model benchmarks/presets/llama-3-8b/config.json \\
        --dummy --quantization awq --requests 400 --concurrency 64 --blocks 192
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
import time

import httpx

SYSTEM_IDS = list(range(1000, 1096))  # a shared prefix of 96 token ids (6 blocks of 16)
SYSTEM_TEXT = "You are a careful assistant. Answer briefly and precisely. " * 6
BAD_FIELDS = {"max_tokens": {"max_tokens": 0}, "temperature": {"temperature": -1.0},
              "top_p": {"top_p": 2.0}}  # fmt: skip


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def rss_kb(pid: int) -> int:
    """Resident memory of `pid` and its children (the engine core), in KiB."""
    pids = [pid]
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
        pids += [int(p) for p in out.split()]
    except FileNotFoundError:
        pass
    total = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        except (FileNotFoundError, StopIteration):
            pass
    return total


def gpu_used_mib() -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        ).stdout  # fmt: skip
        return int(out.split()[0])
    except (FileNotFoundError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


class Soak:
    def __init__(self, url: str, token_ids: bool, max_model_len: int):
        self.url = url
        self.token_ids = token_ids
        self.max_model_len = max_model_len

    def prompt(self, rng: random.Random, extra: int):
        if self.token_ids:
            return SYSTEM_IDS + [rng.randrange(2000, 30000) for _ in range(extra)]
        return SYSTEM_TEXT + f"Question {rng.randrange(10_000)}: count to {extra}."

    async def one(self, c: httpx.AsyncClient, rng: random.Random) -> str:
        kind = rng.choices(["stream", "n2", "seeded", "bad"], [0.6, 0.15, 0.15, 0.1])[0]
        body = {"model": "m", "prompt": self.prompt(rng, rng.randrange(4, 160))}
        if kind == "bad":
            bad = rng.choice(["long", "max_tokens", "temperature", "top_p"])
            if bad == "long":
                long = self.prompt(rng, self.max_model_len)
                body["prompt"] = long if self.token_ids else "word " * (4 * self.max_model_len)
            else:
                body.update(BAD_FIELDS[bad])
            r = await c.post(self.url + "/v1/completions", json=body)
            return "refused" if r.status_code == 400 else f"bad request answered {r.status_code}"
        body["max_tokens"] = rng.randrange(8, 96)
        body["ignore_eos"] = rng.random() < 0.5
        if kind == "n2":
            body.update({"n": 2, "logprobs": 2, "temperature": 0.8})
            r = await c.post(self.url + "/v1/completions", json=body)
            if r.status_code != 200:
                return f"n2 {r.status_code}"
            ok = len(r.json()["choices"]) == 2
            return "done n=2" if ok else "n2 without 2 choices"
        if kind == "seeded":
            body.update({"temperature": 0.7, "seed": rng.randrange(1 << 30)})
            r = await c.post(self.url + "/v1/completions", json=body)
            return "done" if r.status_code == 200 else f"seeded {r.status_code}"
        body.update({"stream": True, "temperature": rng.choice([0.0, 0.8])})
        drop_after = rng.randrange(1, 6) if rng.random() < 0.33 else None
        got = 0
        async with c.stream("POST", self.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"stream {r.status_code}"
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    got += 1
                    if drop_after is not None and got >= drop_after:
                        return "dropped"
        return "done"

    async def round(self, n: int, concurrency: int, seed: int) -> list[str]:
        rng = random.Random(seed)
        sem = asyncio.Semaphore(concurrency)

        async def limited(c: httpx.AsyncClient) -> str:
            async with sem:
                try:
                    return await self.one(c, rng)
                except httpx.HTTPError as e:
                    return f"{type(e).__name__}"

        limits = httpx.Limits(max_connections=concurrency + 8)
        async with httpx.AsyncClient(timeout=600, limits=limits) as c:
            return await asyncio.gather(*[limited(c) for _ in range(n)])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model path (default: the embedded GGUF)")
    ap.add_argument("--dummy", action="store_true", help="random weights, token-id prompts")
    ap.add_argument("--quantization")
    ap.add_argument("--requests", type=int, default=240, help="requests of the second round")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=40, help="--num-gpu-blocks-override")
    ap.add_argument("--port", type=int, default=8331)
    ap.add_argument("--log", default="/tmp/serve_soak.log")
    args = ap.parse_args()

    cmd = [sys.executable, "-m", "pagoda.cli", "serve"] + ([args.model] if args.model else [])
    cmd += ["--served-model-name", "m", "--port", str(args.port), "--max-model-len",
            str(args.max_model_len), "--max-num-seqs", str(args.max_num_seqs),
            "--num-gpu-blocks-override", str(args.blocks), "--max-waiting-requests", "-1",
            "--uvicorn-log-level", "warning"]  # fmt: skip
    if args.dummy:
        cmd += ["--load-format", "dummy", "--skip-tokenizer-init"]
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    url = f"http://127.0.0.1:{args.port}"
    failed: list[str] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}"[:400], flush=True)
        if not ok:
            failed.append(name)

    log = open(args.log, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        t0 = time.monotonic()
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() - t0 > 300:
                check("server ready", False, f"exit {proc.poll()}")
                return 1
            time.sleep(1)
        check("server ready", True, f"{time.monotonic() - t0:.1f} s")
        soak = Soak(url, args.dummy, args.max_model_len)
        first = asyncio.run(soak.round(max(args.requests // 4, 1), args.concurrency, seed=0))
        rss0, gpu0 = rss_kb(proc.pid), gpu_used_mib()
        t1 = time.monotonic()
        second = asyncio.run(soak.round(args.requests, args.concurrency, seed=1))
        took = time.monotonic() - t1
        results = first + second
        kinds = {r: results.count(r) for r in sorted(set(results))}
        print(f"     {len(results)} requests: {kinds}; second round {took:.1f} s", flush=True)
        check("only done, dropped or refused", set(results) <= {"done", "done n=2", "dropped", "refused"},
              str(kinds))  # fmt: skip
        # each of an n=2 request's samples finishes (and is counted) as a request of its own
        admitted = sum(2 if r == "done n=2" else 1 for r in results if r != "refused")
        reasons = ("stop", "length", "abort", "error")
        text = ""
        for _ in range(100):  # the last aborts reach the metrics with the next step
            text = httpx.get(url + "/metrics", timeout=10).text
            counted = sum(
                metric(text, "pagoda:request_success_total", finished_reason=r) for r in reasons
            )
            if counted >= admitted:
                break
            time.sleep(0.2)
        check("each admitted request counted once", counted == admitted,
              f"{counted:.0f} counted, {admitted} admitted")  # fmt: skip
        errors = metric(text, "pagoda:request_success_total", finished_reason="error")
        check("none finished as an error", errors == 0, f"{errors:.0f}")
        for name in ("pagoda:kv_cache_usage_perc", "pagoda:num_requests_running",
                     "pagoda:num_requests_waiting"):  # fmt: skip
            check(f"{name} back to 0", metric(text, name) == 0, f"{metric(text, name)}")
        check("preempted", metric(text, "pagoda:num_preemptions_total") > 0,
              f"{metric(text, 'pagoda:num_preemptions_total'):.0f}")  # fmt: skip
        check("prefix-cache hits", metric(text, "pagoda:prefix_cache_hits_total") > 0,
              f"{metric(text, 'pagoda:prefix_cache_hits_total'):.0f} tokens")  # fmt: skip
        check("/health", httpx.get(url + "/health", timeout=10).status_code == 200)
        rss1, gpu1 = rss_kb(proc.pid), gpu_used_mib()
        check("server memory back near the first round's", rss1 < rss0 + 200_000,
              f"{rss0 // 1024} -> {rss1 // 1024} MiB")  # fmt: skip
        if gpu0 is not None and gpu1 is not None:
            check("GPU memory steady", gpu1 <= gpu0 + 256, f"{gpu0} -> {gpu1} MiB")
        out = metric(text, "pagoda:generation_tokens_total")
        print(f"     generated {out:.0f} tokens in all; second round {len(second) / took:.1f} "
              f"requests/s", flush=True)  # fmt: skip
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    with open(args.log) as f:
        logged = f.read()
    check("no traceback in the log", "Traceback" not in logged,
          next(iter(re.findall(r"Traceback.*\n.*\n.*", logged)), ""))  # fmt: skip
    print("soak:", "FAILED " + ", ".join(failed) if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
