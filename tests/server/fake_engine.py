"""A small deterministic stand-in for `LLMEngine` (same methods and attributes), so the server's
protocol handling is tested in-process in milliseconds. Tokens are bytes (vocab 256 + BOS/EOS);
greedy decoding continues the alphabet; sampling draws letters from a per-request seeded RNG.
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import jinja2

from pagoda.config import DEFAULT_MAX_NUM_SEQS, CacheConfig
from pagoda.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams

BOS, EOS = 256, 257
FAIL_MARK = b"FAIL"  # a prompt holding it ends with finish_reason "error" after two tokens
DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class FakeTokenizer:
    vocab_size = 258
    eos_token_id = EOS
    bos_token_id = BOS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        specials = {BOS: "<s>", EOS: "</s>"}
        out = bytearray()
        for t in ids:
            if t < 256:
                out.append(t)
            elif not skip_special_tokens:
                out.extend(specials[t].encode())
        return out.decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.decode([t], skip_special_tokens=False) for t in ids]

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False,
        chat_template: str | None = None, tools: Any = None, **kw: Any,
    ) -> str:  # fmt: skip
        env = jinja2.Environment(undefined=jinja2.StrictUndefined)
        tpl = env.from_string(chat_template or DEFAULT_TEMPLATE)
        return tpl.render(messages=messages, add_generation_prompt=add_generation_prompt, **kw)


@dataclass
class _Sample:
    index: int
    rng: random.Random
    token_ids: list[int] = field(default_factory=list)
    sent: int = 0
    finish_reason: str | None = None
    stop_reason: Any = None
    first_token_time: float | None = None


@dataclass
class _Req:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival: float
    samples: list[_Sample]
    scheduled: float | None = None
    prompt_logprobs_sent: bool = False

    @property
    def prompt_ids_bytes(self) -> bytes:
        return bytes(t for t in self.prompt_ids if t < 256)


class FakeEngine:
    def __init__(
        self, max_model_len: int = 128, max_num_seqs: int | None = 4, step_delay: float = 0.0,
        num_blocks: int = 64, block_size: int = 16,
    ) -> None:  # fmt: skip
        self.tokenizer = FakeTokenizer()
        self.model_config = SimpleNamespace(
            max_model_len=max_model_len, name="fake-model", model="/models/fake", vocab_size=258
        )
        if max_num_seqs is None:  # the --max-num-seqs flag not given: the engine's default
            max_num_seqs = DEFAULT_MAX_NUM_SEQS
        self.config = SimpleNamespace(
            cache_config=CacheConfig(block_size=block_size),
            scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        )
        self.max_num_seqs, self.step_delay = max_num_seqs, step_delay
        self.num_blocks, self.block_size = num_blocks, block_size
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.last_scheduler_stats = SchedulerStats(num_total_blocks=num_blocks)
        self.last_iteration_stats = IterationStats()
        self.engine_thread_ids: set[int] = set()  # every thread that called into the engine

    def _touch(self) -> None:
        self.engine_thread_ids.add(threading.get_ident())

    def add_request(self, request_id, prompt, params, arrival_time=None, priority=0) -> None:
        self._touch()
        ids = prompt if isinstance(prompt, list) else self.tokenizer.encode(prompt)
        if len(ids) >= self.model_config.max_model_len:
            raise ValueError("the prompt is longer than the maximum model length")
        if any(r.request_id == request_id for r in self.waiting + self.running):
            raise ValueError(f"request_id {request_id!r} is already in use")
        max_tokens = self.model_config.max_model_len - len(ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        samples = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            samples.append(_Sample(i, random.Random(seed)))
        self.waiting.append(
            _Req(request_id, list(ids), params, max_tokens, arrival_time or time.time(), samples)
        )

    def abort_request(self, request_ids) -> None:
        self._touch()
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        self.waiting = [r for r in self.waiting if r.request_id not in ids]
        self.running = [r for r in self.running if r.request_id not in ids]

    def abort_expired_waiting(self, max_queue_delay_s: float, now: float) -> list[str]:
        expired = [r.request_id for r in self.waiting if now - r.arrival > max_queue_delay_s]
        self.abort_request(expired)
        return expired

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_waiting_requests(self) -> int:
        return len(self.waiting)

    @property
    def num_used_blocks(self) -> int:
        return sum(
            math.ceil((len(r.prompt_ids) + len(s.token_ids) + 1) / self.block_size)
            for r in self.running
            for s in r.samples
        )

    @property
    def kv_cache_usage(self) -> float:
        return min(1.0, self.num_used_blocks / self.num_blocks)

    def _next_token(self, r: _Req, s: _Sample) -> int:
        if r.params.temperature == 0:
            return ord("a") + (len(r.prompt_ids) + len(s.token_ids)) % 26
        return ord("a") + s.rng.randrange(26)

    def _logprobs(self, tok: int, k: int) -> dict[int, Logprob]:
        d = {tok: Logprob(-0.5, 1, chr(tok))}
        for j in range(k):
            alt = ord("A") + (tok + j) % 26
            d.setdefault(alt, Logprob(-2.0 - j, j + 2, chr(alt)))
        return d

    def step(self) -> list[RequestOutput]:
        self._touch()
        if self.step_delay:
            time.sleep(self.step_delay)
        now = time.time()
        it = IterationStats(iteration_timestamp=now)
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.pop(0)
            r.scheduled = now
            it.num_prompt_tokens += len(r.prompt_ids)
            self.running.append(r)
        outputs = []
        for r in list(self.running):
            p = r.params
            completions = []
            for s in r.samples:
                if s.finish_reason is not None:
                    continue
                tok = self._next_token(r, s)
                s.token_ids.append(tok)
                it.num_generation_tokens += 1
                if s.first_token_time is None:
                    s.first_token_time = now
                    it.time_to_first_tokens_iter.append(now - r.arrival)
                else:
                    it.inter_token_latencies_iter.append(self.step_delay)
                text = self.tokenizer.decode(s.token_ids)
                for stop in p.stop or []:
                    if text.endswith(stop):
                        s.finish_reason, s.stop_reason = "stop", stop
                if s.finish_reason is None and len(s.token_ids) >= r.max_tokens:
                    s.finish_reason = "length"
                if (
                    s.finish_reason is None
                    and FAIL_MARK in r.prompt_ids_bytes
                    and len(s.token_ids) > 1
                ):
                    s.finish_reason = "error"  # as LLMEngine ends a request it failed to process
                new = s.token_ids[s.sent :]
                s.sent = len(s.token_ids)
                lps = (
                    [self._logprobs(t, p.logprobs) for t in new] if p.logprobs is not None else None
                )
                completions.append(
                    CompletionOutput(s.index, self.tokenizer.decode(new), new, None, lps,
                                     s.finish_reason, s.stop_reason)
                )  # fmt: skip
            prompt_lps = None
            if p.prompt_logprobs is not None and not r.prompt_logprobs_sent:
                r.prompt_logprobs_sent = True
                prompt_lps = [None] + [
                    {t: Logprob(-1.0, 1, chr(t) if t < 256 else "<s>")} for t in r.prompt_ids[1:]
                ]
            finished = all(s.finish_reason is not None for s in r.samples)
            error = "ValueError while processing the request's output" if any(
                s.finish_reason == "error" for s in r.samples) else None  # fmt: skip
            outputs.append(
                RequestOutput(
                    r.request_id, None, r.prompt_ids, prompt_lps, completions, finished, error=error
                )  # fmt: skip
            )
            if finished:
                self.running.remove(r)
                for s in r.samples:
                    n = len(s.token_ids)
                    it.finished_requests.append(
                        FinishedRequestStats(s.finish_reason, now - r.arrival, len(r.prompt_ids),
                                             n, r.scheduled - r.arrival, 0.0, 0.0, 0.0)
                    )  # fmt: skip
        self.last_iteration_stats = it
        self.last_scheduler_stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_usage,
            num_used_blocks=self.num_used_blocks,
            num_total_blocks=self.num_blocks,
            prefix_cache_queries=it.num_prompt_tokens,
        )
        return outputs


# ---- factories for AsyncLLM(engine_factory=...): they run in the engine core process ----
def failing_engine() -> FakeEngine:
    """An engine whose first step raises (a device lost mid-serving)."""
    engine = FakeEngine()

    def boom() -> list[RequestOutput]:
        raise RuntimeError("device lost")

    engine.step = boom  # type: ignore[method-assign]
    return engine


def crashing_engine() -> FakeEngine:
    """An engine whose process dies without a word at its first step (OOM killer, segfault)."""
    import os

    engine = FakeEngine()

    def die() -> list[RequestOutput]:
        os._exit(3)

    engine.step = die  # type: ignore[method-assign]
    return engine


def misconfigured_engine() -> FakeEngine:
    raise ValueError("max_model_len (9999) is larger than the model's; lower --max-model-len")
