"""The tuning path of `pagoda tune`, after the seeds' chapter on tuning: run the defaults first
and record a baseline, then change one knob at a time along the goal's path, keep a change only
when it helps, and measure the baseline and the result once more at the end.

- throughput first: larger max_num_seqs and max_num_batched_tokens, an FP8 KV cache, prefix
  caching, n-gram speculation;
- latency first: smaller max_num_seqs, n-gram speculation, smaller prefill chunks
  (max_num_batched_tokens), prefix caching;
- a quantized checkpoint, when the user gives one (`--quantized-model`), on either path.

Every trial serves the same requests at the same rates, after serving them once unmeasured: 50%
and 80% of the baseline's saturated request rate (Poisson arrivals), then all at once (inf). Throughput is scored by
goodput (requests/s meeting the SLOs, the best of the rates), latency by p99 TTFT at 50% load.
A change is kept when it beats the current best by more than `MIN_GAIN`.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagoda.bench.load import run_load
from pagoda.bench.serve import calculate_metrics
from pagoda.tune.server import TrialServer

# A change must beat the current best by this much to be kept: on a shared machine run-to-run
# noise of a few percent would otherwise pick knobs at random.
MIN_GAIN = 0.05
PERCENTILES = [50.0, 90.0, 99.0]
WARMUP = 4  # requests sent to the baseline's server before its first run
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


@dataclass
class Trial:
    name: str  # "baseline", "max_num_seqs=64", ...
    knobs: dict[str, Any]  # every knob that differs from the defaults
    runs: list[dict[str, Any]] = field(default_factory=list)  # metrics per request rate
    # (rate, per-request outputs, seconds) per rate: runs are recomputed from them once the
    # SLOs are known
    outputs: list[tuple[float, list[Any], float]] = field(default_factory=list)
    load_avg: list[float] = field(default_factory=list)  # the machine's, after each run
    score: float | None = None
    kept: bool = False
    note: str = ""
    seconds: float = 0.0


@dataclass
class TuneSettings:
    goal: str  # "latency" | "throughput"
    base_cmd: list[str]
    model_name: str
    requests: list[Any]
    defaults: dict[str, Any]  # the knobs' default values (max_num_seqs, ...)
    budget_s: float
    out_dir: str
    slo: dict[str, float] = field(default_factory=dict)  # ttft / tpot in ms; set after baseline
    headers: dict[str, str] = field(default_factory=dict)
    quantized_model: str | None = None
    device: str = "cpu"
    ready_timeout_s: float = 300.0


def knob_path(goal: str, d: dict[str, Any], device: str, quantized: str | None) -> list[tuple]:
    """(knob, candidate values) in the order the goal's path tries them."""
    seqs, tokens = d["max_num_seqs"], d["max_num_batched_tokens"]
    if goal == "throughput":
        path: list[tuple] = [
            ("max_num_seqs", [seqs * 2, max(seqs // 4, 1)]),
            ("max_num_batched_tokens", [tokens * 2, tokens * 4]),
            # on a CPU only e5m2 has the C attention kernel (e4m3 runs the torch path)
            ("kv_cache_dtype", ["fp8_e5m2" if device == "cpu" else "fp8"]),
            ("enable_prefix_caching", [not d["enable_prefix_caching"]]),
            ("speculative_config", [NGRAM]),
        ]
    else:
        path = [
            ("max_num_seqs", [max(seqs // 4, 1), max(seqs // 16, 1)]),
            ("speculative_config", [NGRAM]),
            ("max_num_batched_tokens", [max(tokens // 4, 64)]),
            ("enable_prefix_caching", [not d["enable_prefix_caching"]]),
        ]
    if quantized:
        path.insert(0, ("model", [quantized]))
    return path


def score(goal: str, runs: list[dict[str, Any]]) -> float:
    """Higher is better: goodput (best over the rates) or minus p99 TTFT at the lowest rate."""
    if goal == "throughput":
        return max(m["request_goodput"] or 0.0 for m in runs)
    lowest = min(runs, key=lambda m: m["rate"])
    return -lowest["p99_ttft_ms"] if lowest["completed"] else float("-inf")


def better(goal: str, new: float, best: float) -> bool:
    if goal == "throughput":
        return new > best * (1 + MIN_GAIN) and new > 0
    return new > best * (1 - MIN_GAIN)  # scores are negative latencies


class Tuner:
    def __init__(self, s: TuneSettings, progress: Callable[[str], None] = print) -> None:
        self.s, self.progress = s, progress
        self.start = time.monotonic()
        self.rates: list[float] = [float("inf")]
        self.trials: list[Trial] = []
        self.server: TrialServer | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    # -- one trial ---------------------------------------------------------------------------
    def run_trial(self, name: str, knobs: dict[str, Any], find_rates: bool = False) -> Trial:
        """Start a server with `knobs`, send the requests at each rate, stop it. With
        `find_rates` (the baseline) a first run at rate inf sets the rates, then all run."""
        t0 = time.monotonic()
        trial = Trial(name, dict(knobs))
        cmd = list(self.s.base_cmd)
        if "model" in knobs:  # a quantized checkpoint in place of the model
            if "--model" in cmd:
                cmd[cmd.index("--model") + 1] = knobs["model"]
            else:
                cmd += ["--model", knobs["model"]]
        flags = {k: v for k, v in knobs.items() if k != "model"}
        log = os.path.join(self.s.out_dir, f"server-{len(self.trials):02d}.log")
        self.server = TrialServer(cmd + ["--served-model-name", self.s.model_name], flags, log)
        self.progress(f"[{self.elapsed():5.0f} s] {name}: server pid {self.server.proc.pid}")
        try:
            self.server.wait_ready(self.s.ready_timeout_s)
            # Requests first, not counted: a fresh server's first batches pay one-time costs
            # (first-touched KV pages, kernels picked per shape) that would land on whichever
            # run came first. All of them at once; the baseline's first run does the same.
            warmup = self.s.requests[:WARMUP] if find_rates else self.s.requests
            self._within_budget(self._load(self.server.url, float("inf"), warmup))
            rates = [float("inf")] if find_rates else list(self.rates)
            while rates:
                rate = rates.pop(0)
                outputs, duration = self._within_budget(self._load(self.server.url, rate))
                trial.outputs.append((rate, outputs, duration))
                trial.load_avg.append(os.getloadavg()[0])
                m = self.metrics(rate, outputs, duration)
                self.progress(
                    f"[{self.elapsed():5.0f} s]   rate {rate:.2f}: {m['request_throughput']:.2f} "
                    f"req/s, {m['output_throughput']:.0f} tok/s, p99 TTFT {m['p99_ttft_ms']:.0f}"
                    f" ms, median TPOT {m['median_tpot_ms']:.1f} ms, failed {m['failed']}"
                )
                failed = [o.error for o in outputs if not o.success]
                if failed:
                    self.progress(f"          first error: {' '.join(failed[0].split())[:300]}")
                if not m["completed"]:
                    raise ValueError(f"no request was served ({failed[0][:300]})")
                if find_rates and rate == float("inf") and not self.rates[:-1]:
                    # This run only sets the rates: the fresh server's first big batch pays
                    # first-touch costs (KV pages) the other trials' last runs do not. The
                    # baseline then runs every rate in the trials' order, inf last.
                    saturated = m["request_throughput"]
                    self.rates = [saturated * 0.5, saturated * 0.8, float("inf")]
                    rates = list(self.rates)
                    trial.outputs.clear()
                    trial.load_avg.clear()
        except ValueError as e:
            trial.note = f"failed: {' '.join(str(e).split())[:300]}"
        except (TimeoutError, asyncio.TimeoutError):  # the same class from Python 3.11
            trial.note = "stopped: time budget"
            trial.outputs.clear()
            self.progress(f"[{self.elapsed():5.0f} s]   stopped: the time budget ran out")
        finally:
            self.server.stop()
            self.server = None
        trial.seconds = time.monotonic() - t0
        trial.outputs.sort(key=lambda r: r[0])
        return trial

    def _within_budget(self, load: Any) -> Any:
        """Run `load`; TimeoutError once the budget (plus a minute's grace) has run out."""
        left = self.s.budget_s + 60 - self.elapsed()
        if left <= 0:
            load.close()
            raise TimeoutError
        return asyncio.run(asyncio.wait_for(load, left))

    def metrics(self, rate: float, outputs: list[Any], duration: float) -> dict[str, Any]:
        m = calculate_metrics(outputs, duration, PERCENTILES, self.s.slo or {"e2el": 1e12})
        m["rate"] = rate
        return m

    def finish(self, trial: Trial) -> Trial:
        """The trial's metrics under the final SLOs, and its score."""
        trial.runs = [self.metrics(*r) for r in trial.outputs]
        if trial.runs and not trial.note:
            trial.score = score(self.s.goal, trial.runs)
        return trial

    async def _load(
        self, base_url: str, rate: float, requests: list[Any] | None = None
    ) -> tuple[list[Any], float]:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=3600)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await run_load(
                session, base_url + "/v1/completions", self.s.model_name,
                self.s.requests if requests is None else requests, rate, ignore_eos=True,
                headers=self.s.headers, seed=len(self.trials),
            )  # fmt: skip

    # -- the path ----------------------------------------------------------------------------
    def run(self) -> tuple[Trial, Trial, Trial | None, Trial | None]:
        """Baseline, the knobs one at a time, the confirmation. Returns (baseline, best,
        baseline again, best again); the last two None when there was nothing to confirm or
        no time left."""
        s = self.s
        base = self.run_trial("baseline (defaults)", {}, find_rates=True)
        self.trials.append(base)
        if base.note or len(base.outputs) < 3:
            why = base.note or "no requests served"
            if why.startswith("stopped"):
                why += ": raise --budget-minutes"
            raise ValueError(f"the baseline did not run: {why}")
        if not s.slo:  # what the defaults give at 50% load, with 2x headroom
            m = self.metrics(*base.outputs[0])
            s.slo = {"ttft": 2 * m["median_ttft_ms"], "tpot": 2 * m["median_tpot_ms"]}
            self.progress(f"SLOs (2 x the baseline's median at 50% load): TTFT "
                          f"{s.slo['ttft']:.0f} ms, TPOT {s.slo['tpot']:.1f} ms")  # fmt: skip
        self.finish(base).kept = True
        best, per_trial = base, base.seconds
        for knob, values in knob_path(s.goal, s.defaults, s.device, s.quantized_model):
            chosen = None
            for value in values:
                knobs = {**best.knobs, knob: value}
                name = f"{knob}={'ngram' if isinstance(value, dict) else value}"
                if s.budget_s - self.elapsed() - 2 * per_trial < per_trial:
                    self.trials.append(Trial(name, knobs, note="skipped: time budget"))
                    continue
                trial = self.finish(self.run_trial(name, knobs))
                self.trials.append(trial)
                ref = chosen or best
                if trial.score is not None and better(s.goal, trial.score, ref.score):
                    chosen = trial
            if chosen is not None:
                chosen.kept, best = True, chosen
        if best is base or s.budget_s - self.elapsed() < 1.5 * per_trial:
            return base, best, None, None
        # Measured once more, one after the other: did the gain hold?
        again = self.finish(self.run_trial("baseline, again", {}))
        best_again = self.finish(self.run_trial("recommended, again", best.knobs))
        for t in (again, best_again):
            t.note = t.note or "confirmation"
        self.trials += [again, best_again]
        return base, best, again, best_again

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
