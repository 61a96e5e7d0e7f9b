"""`pagoda serve` measured as users run it (issue 15): rate sweep, server overhead, idle latency,
long prompts beside decodes, shared prefixes and an FP8 KV cache, in one run with a time box.

The server is started as a user would (`pagoda serve CONFIG --load-format dummy --dtype bfloat16
--skip-tokenizer-init`, a model-shape preset with random weights and no tokenizer, so prompts
are token ids) with `--max-waiting-requests -1`, so that the `inf` rate measures throughput
rather than load shedding. Requests are the ShareGPT-like log-normal mix of
`pagoda.bench.datasets.LognormalMix` (means 226 prompt / 196 output tokens, log-space sigma 1.0
each, prompt <= 1024, prompt + output <= 2048), greedy, ignore_eos. Parts, in this order:

  c  idle: one request at a time, 512-token prompts, 256 new tokens (`pagoda bench serve
     --max-concurrency 1`): TTFT and decode tokens/s (1 / TPOT);
  a  `--request-rate inf` with --num-prompts-inf requests (the saturation rate, and the API
     process's and engine core's CPU seconds per output token from /proc), then Poisson rates
     at fractions of that rate, each over about --window seconds of arrivals;
  d1 part a's point at --long-mix-fraction of saturation (0.5) again, every 10th prompt
     --long-len tokens long: p99 ITL of the other requests against that point's;
  d2 multi-turn chat: conversations arriving as a Poisson process share a --system-len-token
     system prompt, and each turn resends the history (the replies resent are random tokens of
     the reply's length: without a tokenizer the client never sees the generated ids); TTFT
     and the prefix-cache hit rate from /metrics; then again on a server started with
     --no-enable-prefix-caching;
  b  `pagoda bench throughput` offline on the very requests of the inf point;
  f  a server with `--kv-cache-dtype fp8`: the inf point and the 0.7 point.

Every part has a hard time box inside --time-budget, and $OUT/gpu_serve_bench.json is rewritten
after each, so a timeout loses one part. The table, against the issue's targets, is printed
last. On a CPU, `--dry-run` runs every code path on a small config in a minute or two:

    python benchmarks/gpu_serve_bench.py [--time-budget 480] [--out DIR]
    python benchmarks/gpu_serve_bench.py --dry-run --model /tmp/tiny/config.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from pagoda.bench.datasets import (  # noqa: E402
    LognormalMix,
    SampleRequest,
    TokenIdVocab,
    lognormal_dataset,
)

PCTS = "50,90,99"
SLO = ["ttft:500", "tpot:50"]  # the goodput SLO, ms
START_BOX_S, CLIENT_BOX_S, OFFLINE_BOX_S = 240.0, 100.0, 170.0
TARGETS = {"sat_ratio": 0.95, "p99_ttft_ms": 300.0, "p99_tpot_ms": 40.0}
TARGETS |= {"idle_ttft_ms": 16.0, "idle_decode_tok_s": 225.0, "itl_ratio": 2.0, "ttft_ratio": 3.0}


class Run:
    """Deadline, output folder and the results file, rewritten after every part."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.t0 = args, time.monotonic()
        self.out = Path(os.environ.get("OUT") or args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"gpu_serve_{os.getpid()}"
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, Any] = {"args": vars(args), "parts": {}, "errors": {}}
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO), *filter(None, [self.env.get("PYTHONPATH")])]
        )
        self.vocab, self.mix, self.sat = 0, LognormalMix(), 0.0

    def left(self) -> float:
        return self.args.time_budget - (time.monotonic() - self.t0)

    def box(self, cap: float) -> float:
        return max(0.0, min(cap, self.left() - 5))

    def save(self) -> None:
        self.results["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        (self.out / "gpu_serve_bench.json").write_text(json.dumps(self.results, indent=1))

    def part(self, name: str, fn: Any, *a: Any, need: float = 20.0, store: bool = True) -> Any:
        """Run one part; an error or a timeout is recorded and the run goes on."""
        if self.left() < need:
            self.results["errors"][name] = f"skipped: {self.left():.0f} s left of the budget"
            self.save()
            return None
        t = time.monotonic()
        print(f"--- {name} ({self.left():.0f} s left)", flush=True)
        try:
            res = fn(*a)
            if store:
                self.results["parts"][name] = res
        except Exception as e:  # noqa: BLE001 - one part's failure must not end the run
            res = None
            self.results["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        print(f"--- {name} took {time.monotonic() - t:.1f} s", flush=True)
        self.save()
        return res


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_boxed(run: Run, cmd: list[str], box: float, log: Path) -> tuple[int, float]:
    """Run `cmd` in its own process group, killed after `box` s; (exit code, its CPU s)."""
    with open(log, "ab") as f:
        f.write(f"\n$ {' '.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=run.env,
                                start_new_session=True)  # fmt: skip
    timer = threading.Timer(box, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    _, status, ru = os.wait4(proc.pid, 0)
    timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode == -signal.SIGKILL:
        raise TimeoutError(f"{cmd[3:5]} ran past its {box:.0f} s box")
    return proc.returncode, ru.ru_utime + ru.ru_stime


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child_pids(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return out


class Server:
    """One `pagoda serve` process (the API front end) and its engine core child."""

    def __init__(self, run: Run, name: str, extra: list[str]) -> None:
        import httpx

        self.run, self.log = run, run.out / f"server_{name}.log"
        port = free_port()
        cmd = [sys.executable, "-m", "pagoda.cli", "serve", *engine_flags(run.args), "--port",
               str(port), "--max-waiting-requests", "-1", *extra]  # fmt: skip
        t = time.monotonic()
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=run.env,
                                         start_new_session=True)  # fmt: skip
        self.url = f"http://127.0.0.1:{port}"
        deadline = t + run.box(START_BOX_S)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pagoda serve exited: {self.log.read_text()[-1500:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("pagoda serve did not answer /health in its box")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.start_s = round(time.monotonic() - t, 1)
        self.model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        print(f"server {name} up in {self.start_s} s", flush=True)

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far of the API process and of its children (the engine core)."""
        kids = sum(cpu_seconds(p) for p in child_pids(self.proc.pid))
        return {"api": cpu_seconds(self.proc.pid), "children": kids}

    def metric(self, name: str) -> float:
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(x.rsplit(" ", 1)[1]) for x in text.splitlines() if x.startswith(name))

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(15)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def engine_flags(args: argparse.Namespace, model_flag: bool = False) -> list[str]:
    """The engine's flags; `pagoda serve` takes the model as its argument, the others as --model."""
    model = ["--model", args.model] if model_flag else [args.model]
    flags = [*model, "--load-format", "dummy", "--dtype", args.dtype, "--skip-tokenizer-init"]
    return flags + (args.engine_flags.split() if args.engine_flags else [])


def mix_flags(mix: LognormalMix) -> list[str]:
    return ["--lognormal-input-mean", str(mix.input_mean), "--lognormal-output-mean",
            str(mix.output_mean), "--lognormal-input-sigma", str(mix.input_sigma),
            "--lognormal-output-sigma", str(mix.output_sigma), "--lognormal-max-len",
            str(mix.max_len)]  # fmt: skip


def summary(m: dict[str, Any]) -> dict[str, Any]:
    keep = ["completed", "failed", "duration", "request_throughput", "output_throughput",
            "total_input_tokens", "total_output_tokens", "request_goodput"]  # fmt: skip
    out = {k: m[k] for k in keep if k in m}
    for key in ("ttft", "tpot", "itl", "e2el"):
        for p, name in (("median", "p50"), ("p90", "p90"), ("p99", "p99")):
            if f"{p}_{key}_ms" in m:
                out[f"{name}_{key}_ms"] = round(m[f"{p}_{key}_ms"], 2)
    if m.get("errors"):
        out["first_error"] = next((e for e in m["errors"] if e), None)
    return out


def bench_serve(run: Run, srv: Server, name: str, flags: list[str], box: float) -> dict[str, Any]:
    """`pagoda bench serve` in a child process, as a user runs it; its summary."""
    res = run.tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "pagoda.cli", "bench", "serve", "--base-url", srv.url,
           "--prompt-token-ids", "--vocab-size", str(run.vocab), "--ignore-eos",
           "--metric-percentiles", PCTS, "--goodput", *SLO, "--result-filename", str(res),
           *flags]  # fmt: skip
    rc, client_cpu = run_boxed(run, cmd, run.box(box), run.out / "clients.log")
    if rc != 0 or not res.exists():
        raise RuntimeError(f"pagoda bench serve exited with {rc} (clients.log)")
    out = summary(json.loads(res.read_text()))
    out["client_cpu_s"] = round(client_cpu, 2)
    print(f"{name}: {json.dumps(out)}", flush=True)
    return out


def part_idle(run: Run, srv: Server) -> dict[str, Any]:
    a = run.args
    flags = ["--dataset-name", "random", "--random-input-len", str(a.idle_prompt_len),
             "--random-output-len", str(a.idle_output_len), "--num-prompts",
             str(a.idle_requests), "--max-concurrency", "1", "--seed", "7"]  # fmt: skip
    out = bench_serve(run, srv, "idle", flags, CLIENT_BOX_S)
    out["decode_tok_s"] = round(1000.0 / out["p50_tpot_ms"], 1) if out["p50_tpot_ms"] else None
    return out


def py_spy_argv(run: Run, name: str) -> list[str] | None:
    """`py-spy record` writing $OUT/<name>.txt as collapsed stacks, to be completed with
    `--pid PID --duration S` or `-- CMD`; None where py-spy is missing or --profile is 0."""
    import shutil

    exe = shutil.which("py-spy")
    if not run.args.profile or exe is None:
        return None
    out = str(run.out / f"{name}.txt")
    return [exe, "record", "--format", "raw", "--rate", "100", "--nonblocking", "--output", out]


def py_spy(run: Run, pid: int, name: str) -> subprocess.Popen | None:
    """Profile a running process for --profile seconds, in the background."""
    argv = py_spy_argv(run, name)
    if argv is None:
        return None
    argv += ["--pid", str(pid), "--duration", str(int(run.args.profile))]
    log = open(run.out / "py_spy.log", "ab")  # noqa: SIM115 - the child keeps it
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=run.env)


def part_inf(run: Run, srv: Server, name: str) -> dict[str, Any]:
    before = srv.cpu()
    spies = [
        py_spy(run, pid, f"profile_{name}_{who}{pid}")
        for who, pid in (("api", srv.proc.pid), *(("core", p) for p in child_pids(srv.proc.pid)))
    ]
    flags = ["--dataset-name", "lognormal", *mix_flags(run.mix), "--num-prompts",
             str(run.args.num_prompts_inf), "--request-rate", "inf", "--seed", "0"]  # fmt: skip
    out = bench_serve(run, srv, name, flags, CLIENT_BOX_S)
    after = srv.cpu()
    for spy in filter(None, spies):
        spy.wait(30)
    tokens = max(out["total_output_tokens"], 1)
    for k in ("api", "children"):
        cpu = after[k] - before[k]
        out[f"{k}_cpu_s"] = round(cpu, 2)
        out[f"{k}_cpu_ms_per_output_token"] = round(1000 * cpu / tokens, 4)
        out[f"{k}_cpu_share_of_one_core"] = round(cpu / out["duration"], 3)
    return out


def part_rate(run: Run, srv: Server, name: str, rate: float, seed: int) -> dict[str, Any]:
    n = max(8, round(rate * run.args.window))
    flags = ["--dataset-name", "lognormal", *mix_flags(run.mix), "--num-prompts", str(n),
             "--request-rate", f"{rate:.3f}", "--seed", str(seed)]  # fmt: skip
    out = bench_serve(run, srv, name, flags, CLIENT_BOX_S)
    out["rate"] = round(rate, 3)
    return out


async def _client(run: Run, srv: Server, coro_fn: Any) -> Any:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=run.box(CLIENT_BOX_S))
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        return await asyncio.wait_for(coro_fn(session), run.box(CLIENT_BOX_S))


def part_long_mix(run: Run, srv: Server, rate: float) -> dict[str, Any]:
    """A part-a point with every 10th prompt --long-len tokens long (another seed: no hits)."""
    from pagoda.bench.serve import benchmark, calculate_metrics

    a, rng = run.args, random.Random(300)
    n = max(10, round(rate * a.window))
    reqs = lognormal_dataset(TokenIdVocab(run.vocab), n, run.mix, seed=301)
    for i in range(0, n, 10):
        n_out = max(1, min(reqs[i].expected_output_len, a.max_model_len - a.long_len))
        ids = [rng.randrange(run.vocab) for _ in range(a.long_len)]
        reqs[i] = SampleRequest(ids, a.long_len, n_out)
    ns = argparse.Namespace(model=srv.model, ignore_eos=True, max_concurrency=None,
                            request_rate=rate, burstiness=1.0, seed=302)  # fmt: skip
    url = srv.url + "/v1/completions"
    outs, duration = asyncio.run(
        asyncio.wait_for(benchmark(ns, reqs, url, {}), run.box(CLIENT_BOX_S))
    )
    pcts, slo = [50.0, 90.0, 99.0], {"ttft": 500.0, "tpot": 50.0}
    long_idx = set(range(0, n, 10))
    short = [o for i, o in enumerate(outs) if i not in long_idx]
    long = [o for i, o in enumerate(outs) if i in long_idx]
    return {
        "rate": round(rate, 3),
        "num_long": len(long),
        "long_len": a.long_len,
        "all": summary(calculate_metrics(outs, duration, pcts, slo)),
        "short_requests": summary(calculate_metrics(short, duration, pcts, slo)),
        "long_requests": summary(calculate_metrics(long, duration, pcts, slo)),
    }


def part_multi_turn(run: Run, srv: Server, name: str) -> dict[str, Any]:
    from pagoda.bench.serve import request_completion

    a = run.args
    rng = random.Random(400)  # the same conversations on every server

    def ids(k: int) -> list[int]:
        return [rng.randrange(run.vocab) for _ in range(k)]

    system = ids(a.system_len)
    url = srv.url + "/v1/completions"
    q0, h0 = srv.metric("pagoda:prefix_cache_queries"), srv.metric("pagoda:prefix_cache_hits")
    arrivals = []
    t = 0.0
    for _ in range(a.conversations):
        arrivals.append(t)
        t += rng.expovariate(a.conversation_rate)

    async def conversations(session: Any) -> list[tuple[int, float, bool]]:
        async def one(delay: float) -> list[tuple[int, float, bool]]:
            await asyncio.sleep(delay)
            history, res = list(system), []
            for turn in range(a.turns):
                history += ids(a.user_len)
                req = SampleRequest(list(history), len(history), a.reply_len)
                out = await request_completion(session, url, srv.model, req, True, {})
                res.append((turn, out.ttft, out.success))
                history += ids(a.reply_len)
            return res

        done = await asyncio.gather(*(one(d) for d in arrivals))
        return [x for conv in done for x in conv]

    t0 = time.monotonic()
    rows = asyncio.run(_client(run, srv, conversations))
    q1, h1 = srv.metric("pagoda:prefix_cache_queries"), srv.metric("pagoda:prefix_cache_hits")
    ttfts = sorted(1000 * x[1] for x in rows if x[2])
    later = sorted(1000 * x[1] for x in rows if x[2] and x[0] > 0)

    def pct(v: list[float], p: float) -> float | None:
        return round(v[min(len(v) - 1, int(p / 100 * len(v)))], 2) if v else None

    return {
        "requests": len(rows),
        "failed": sum(not x[2] for x in rows),
        "duration_s": round(time.monotonic() - t0, 2),
        "p50_ttft_ms": pct(ttfts, 50),
        "p99_ttft_ms": pct(ttfts, 99),
        "p50_ttft_later_turns_ms": pct(later, 50),
        "prefix_cache_hit_rate": round((h1 - h0) / (q1 - q0), 4) if q1 > q0 else None,
    }


def part_offline(run: Run) -> dict[str, Any]:
    res = run.tmp / "offline.json"
    cmd = [sys.executable, "-m", "pagoda.cli", "bench", "throughput", *engine_flags(run.args, True),
           "--dataset-name", "lognormal", *mix_flags(run.mix), "--num-prompts",
           str(run.args.num_prompts_inf), "--seed", "0", "--output-json", str(res)]  # fmt: skip
    if spy := py_spy_argv(run, "profile_offline"):
        cmd = [*spy, "--", *cmd]
    rc, _ = run_boxed(run, cmd, run.box(OFFLINE_BOX_S), run.out / "offline.log")
    if rc != 0 or not res.exists():
        raise RuntimeError(f"pagoda bench throughput exited with {rc} (offline.log)")
    return json.loads(res.read_text())


def serve_parts(run: Run, name: str, extra: list[str], parts: Any, need: float) -> None:
    """Start a server, run `parts(srv)` (each through run.part), stop it."""
    srv = run.part(f"start_{name}", lambda: Server(run, name, extra), need=need, store=False)
    if srv is None:
        return
    run.results["parts"][f"start_{name}"] = {"start_s": srv.start_s}
    try:
        parts(srv)
    finally:
        srv.stop()
        run.save()


def main_parts(run: Run) -> None:
    a = run.args
    only = set(a.only.split(","))
    fractions = [float(x) for x in a.rate_fractions.split(",")]

    def bf16(srv: Server) -> None:
        if "c" in only:
            run.part("c_idle", part_idle, run, srv)
        if "a" not in only:
            return
        if a.sat:
            run.sat = a.sat  # the saturation rate from an earlier run
        else:
            inf = run.part("a_inf", part_inf, run, srv, "a_inf")
            if not inf:
                return
            run.sat = inf["request_throughput"]
        for i, f in enumerate(fractions):
            run.part(f"a_rate_{f:g}", part_rate, run, srv, f"a_rate_{f:g}", f * run.sat, 100 + i)
        if "d" in only:
            run.part("d1_long_mix", part_long_mix, run, srv, a.long_mix_fraction * run.sat, need=40)
            run.part("d2_multi_turn_prefix_caching", part_multi_turn, run, srv, "cache")

    if only & {"a", "c", "d"}:
        serve_parts(run, "bf16", [], bf16, need=60)
    if "b" in only:
        run.part("b_offline", part_offline, run, need=60)
    if "d" in only:
        serve_parts(run, "noprefix", ["--no-enable-prefix-caching"], lambda srv: run.part(
            "d2_multi_turn_no_prefix_caching", part_multi_turn, run, srv, "nocache"), need=70)  # fmt: skip

    def fp8(srv: Server) -> None:
        run.part("f_inf", part_inf, run, srv, "f_inf")
        if run.sat:
            run.part("f_rate_0.7", part_rate, run, srv, "f_rate_0.7", 0.7 * run.sat, 102)

    if "f" in only:
        serve_parts(run, "fp8", ["--kv-cache-dtype", "fp8"], fp8, need=70)

    if "t" in only and run.sat:
        for variant in filter(None, a.long_variants.split(";")):
            label, flags = variant.split(":", 1)
            serve_parts(run, label, flags.split(), lambda srv, label=label: run.part(
                f"d1_long_mix_{label}", part_long_mix, run, srv,
                a.long_mix_fraction * run.sat, need=40), need=70)  # fmt: skip


def table(run: Run) -> list[tuple[str, Any, str, str]]:
    """(metric, value, target, met?) rows for what was measured."""
    p, t = run.results["parts"], TARGETS
    rows: list[tuple[str, Any, str, str]] = []

    def row(name: str, value: Any, target: str = "", ok: bool | None = None) -> None:
        rows.append((name, value, target, "" if ok is None else ("yes" if ok else "no")))

    if c := p.get("c_idle"):
        row("idle TTFT p50, 512 tokens, ms", c["p50_ttft_ms"], "<= 16", c["p50_ttft_ms"] <= 16)
        ok = (c["decode_tok_s"] or 0) >= t["idle_decode_tok_s"]
        row("idle decode tok/s (1 / TPOT p50)", c["decode_tok_s"], ">= 225", ok)
    for key in [k for k in p if k.startswith(("a_", "f_"))]:
        m = p[key]
        row(f"{key}: req/s, output tok/s", f"{m['request_throughput']:.2f}, "
            f"{m['output_throughput']:.0f}")  # fmt: skip
        row(
            f"{key}: TTFT p50/p90/p99 ms",
            f"{m['p50_ttft_ms']}/{m['p90_ttft_ms']}/{m['p99_ttft_ms']}",
        )
        row(
            f"{key}: TPOT p50/p90/p99 ms",
            f"{m['p50_tpot_ms']}/{m['p90_tpot_ms']}/{m['p99_tpot_ms']}",
        )
        row(f"{key}: ITL p50/p99, e2e p50/p99 ms", f"{m['p50_itl_ms']}/{m['p99_itl_ms']}, "
            f"{m['p50_e2el_ms']}/{m['p99_e2el_ms']}")  # fmt: skip
        row(f"{key}: goodput req/s (TTFT<=500, TPOT<=50)", round(m["request_goodput"] or 0, 2))
    if (r := p.get("a_rate_0.7")) is not None:
        row("0.7 x sat: p99 TTFT ms", r["p99_ttft_ms"], "<= 300", r["p99_ttft_ms"] <= 300)
        row("0.7 x sat: p99 TPOT ms", r["p99_tpot_ms"], "<= 40", r["p99_tpot_ms"] <= 40)
    if (inf := p.get("a_inf")) and (b := p.get("b_offline")):
        ratio = inf["output_throughput"] / b["output_tokens_per_s"]
        row("offline output tok/s (same requests)", b["output_tokens_per_s"])
        row("server inf / offline output tok/s", round(ratio, 3), ">= 0.95", ratio >= 0.95)
    if inf := p.get("a_inf"):
        row("API process CPU ms / output token (inf)", inf["api_cpu_ms_per_output_token"])
        row("API process CPU share of one core (inf)", inf["api_cpu_share_of_one_core"])
    if (d1 := p.get("d1_long_mix")) and (r := p.get(f"a_rate_{run.args.long_mix_fraction:g}")):
        ratio = d1["short_requests"]["p99_itl_ms"] / max(r["p99_itl_ms"], 1e-9)
        row("long mix: p99 ITL of the others ms", d1["short_requests"]["p99_itl_ms"])
        row("long mix / plain p99 ITL", round(ratio, 2), "<= 2", ratio <= 2)
    base = p.get(f"a_rate_{run.args.long_mix_fraction:g}")
    for key in [k for k in p if k.startswith("d1_long_mix_")] if base else []:
        short, long = p[key]["short_requests"], p[key]["long_requests"]
        ratio = short["p99_itl_ms"] / max(base["p99_itl_ms"], 1e-9)
        label = key.removeprefix("d1_long_mix_")
        row(f"long mix {label}: others' p99 ITL ms, x plain", f"{short['p99_itl_ms']}, "
            f"{ratio:.2f}", "<= 2", ratio <= 2)  # fmt: skip
        row(f"long mix {label}: output tok/s, long TTFT p50 ms",
            f"{p[key]['all']['output_throughput']:.0f}, {long['p50_ttft_ms']}")  # fmt: skip
    on, off = p.get("d2_multi_turn_prefix_caching"), p.get("d2_multi_turn_no_prefix_caching")
    if on:
        row("multi-turn prefix-cache hit rate", on["prefix_cache_hit_rate"])
    if on and off and on["p50_ttft_ms"]:
        ratio = off["p50_ttft_ms"] / on["p50_ttft_ms"]
        row("multi-turn TTFT p50 ms, cache on / off", f"{on['p50_ttft_ms']} / {off['p50_ttft_ms']}")
        row("TTFT p50 off / on", round(ratio, 2), ">= 3", ratio >= 3)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = ap.add_argument
    a("--model", default=str(REPO / "benchmarks/presets/llama-3-8b/config.json"))
    a("--dtype", default="bfloat16")
    a("--engine-flags", default="", help="more flags for pagoda serve / bench throughput")
    a("--out", default=str(REPO / "gpu_serve_out"), help="results folder ($OUT wins)")
    a("--time-budget", type=float, default=480.0, help="seconds for the whole run")
    a("--only", default="a,b,c,d,f")
    a("--num-prompts-inf", type=int, default=512)
    a("--rate-fractions", default="0.25,0.5,0.7,0.9", help="of the inf point's request rate")
    a("--window", type=float, default=15.0, help="seconds of arrivals per rate point")
    a("--idle-requests", type=int, default=6)
    a("--idle-prompt-len", type=int, default=512)
    a("--idle-output-len", type=int, default=256)
    a("--long-len", type=int, default=8000)
    a("--long-mix-fraction", type=float, default=0.5, help="d1's rate, of saturation")
    a("--max-model-len", type=int, default=8192, help="the model's context (for long prompts)")
    a("--system-len", type=int, default=1000)
    a("--user-len", type=int, default=100)
    a("--reply-len", type=int, default=100)
    a("--turns", type=int, default=4)
    a("--conversations", type=int, default=48)
    a("--conversation-rate", type=float, default=8.0, help="conversations started per second")
    a(
        "--long-variants",
        default="lpt1024:--long-prefill-token-threshold 1024;"
        "lpt512:--long-prefill-token-threshold 512;mbt512:--max-num-batched-tokens 512",
        help="part t: label:server flags;... each serving part d1's long mix again",
    )
    a("--sat", type=float, default=0.0, help="the saturation rate, req/s (skips the inf point)")
    a(
        "--profile",
        type=float,
        default=0.0,
        help="py-spy the inf point's processes (s) and the offline run, where py-spy is installed",
    )
    a("--mix-max-len", type=int, default=2048, help="the log-normal mix's prompt+output cap")
    a("--dry-run", action="store_true", help="small numbers on a CPU (with a tiny --model)")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.engine_flags = (args.engine_flags + " --device cpu --kv-cache-memory-bytes "
                             "67108864 --max-model-len 2048").strip()  # fmt: skip
        args.num_prompts_inf, args.window, args.rate_fractions = 16, 2.0, "0.5,0.7"
        args.long_mix_fraction = 0.5
        args.idle_requests, args.idle_prompt_len, args.idle_output_len = 2, 64, 8
        args.long_len, args.max_model_len, args.system_len = 600, 2048, 64
        args.user_len, args.reply_len, args.turns, args.conversations = 16, 8, 2, 4
        args.mix_max_len = 256
    return args


def main() -> int:
    args = parse_args()
    run = Run(args)
    with open(args.model) as f:
        run.vocab = int(json.load(f)["vocab_size"])
    run.mix = LognormalMix(max_len=args.mix_max_len)
    reqs = lognormal_dataset(TokenIdVocab(run.vocab), args.num_prompts_inf, run.mix, seed=0)
    run.results["mix"] = {
        "params": vars(run.mix),
        "inf_mean_prompt": round(sum(r.prompt_len for r in reqs) / len(reqs), 1),
        "inf_mean_output": round(sum(r.expected_output_len for r in reqs) / len(reqs), 1),
    }
    run.results["commit"] = (
        os.environ.get("PAGODA_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
        ).stdout.strip()
    )
    run.save()
    main_parts(run)
    rows = table(run)
    run.results["table"] = rows
    run.save()
    print(f"\nerrors: {json.dumps(run.results['errors'])}")
    w = max([len(r[0]) for r in rows] + [10])
    print(f"{'metric':<{w}}  {'value':<28} {'target':<8} met?")
    for name, value, target, ok in rows:
        print(f"{name:<{w}}  {str(value):<28} {target:<8} {ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
