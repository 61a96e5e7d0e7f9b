"""A small deterministic stand-in for `EngineCore` (same methods and attributes), so the server's
protocol handling, and `AsyncLLM`'s input and output processing, are tested in-process in
milliseconds. Tokens are bytes (vocab 256 + BOS/EOS); greedy decoding continues the alphabet;
sampling draws letters from a per-request seeded RNG.
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
from pagoda.core.outputs import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from pagoda.metrics.stats import IterationStats, SchedulerStats
from pagoda.repetition_detection import check_sequence_repetition
from pagoda.sampling_params import SamplingParams

BOS, EOS = 256, 257
UNDECODABLE = 999  # not a token the fake tokenizer knows: decoding it raises
FAIL_MARK = b"FAIL"  # a prompt holding it ends with finish_reason "error" after two tokens
SAY_MARK = b"SAY:"  # greedy, a prompt holding SAY:<text>| answers <text>, then stops
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

    def decode(self, ids: list[int], skip_special_tokens: bool = True, **kw: Any) -> str:
        specials = {BOS: "<s>", EOS: "</s>"}
        out = bytearray()
        for t in ids:
            if t >= self.vocab_size:
                raise ValueError(f"token id {t} is not in the vocabulary")
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
class _Req:
    """One sequence (a sample: the front end fans n > 1 out)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    max_tokens: int
    arrival: float
    rng: random.Random
    token_ids: list[int] = field(default_factory=list)
    scheduled: float | None = None

    @property
    def prompt_ids_bytes(self) -> bytes:
        return bytes(t for t in self.prompt_ids if t < 256)


class FakeEngine:
    """A fake `EngineCore`: takes `EngineCoreRequest`s, returns token ids (`EngineCoreOutputs`);
    the front end (`AsyncLLM`) tokenizes, validates, detokenizes and finds stop strings."""

    def __init__(
        self, max_model_len: int = 128, max_num_seqs: int | None = 4, step_delay: float = 0.0,
        num_blocks: int = 64, block_size: int = 16, skip_tokenizer_init: bool = False,
    ) -> None:  # fmt: skip
        self.tokenizer = None if skip_tokenizer_init else FakeTokenizer()
        self.model_config = SimpleNamespace(
            max_model_len=max_model_len, name="fake-model", model="/models/fake", vocab_size=258,
            hf_config={"eos_token_id": EOS},
        )  # fmt: skip
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
        self.groups: dict[str, tuple[str, ...]] = {}  # requests added together
        self.last_scheduler_stats = SchedulerStats(num_total_blocks=num_blocks)
        self.last_iteration_stats = IterationStats()
        self.num_preemptions_total = 0
        self.engine_thread_ids: set[int] = set()  # every thread that called into the engine

    def _touch(self) -> None:
        self.engine_thread_ids.add(threading.get_ident())

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._touch()
        known = {r.request_id for r in self.waiting + self.running}
        for r in requests:
            if r.request_id in known:
                raise ValueError(f"request_id {r.request_id!r} is already in use")
        for r in requests:
            p = r.sampling_params
            rng = random.Random(p.seed)
            self.waiting.append(
                _Req(r.request_id, list(r.prompt_token_ids), p, r.max_tokens, r.arrival_time, rng)
            )
        if len(requests) > 1:
            group = tuple(r.request_id for r in requests)
            for rid in group:
                self.groups[rid] = group

    def abort_requests(self, request_ids) -> None:
        self._touch()
        ids = set(request_ids)
        for rid in ids:
            self.groups.pop(rid, None)
        self.waiting = [r for r in self.waiting if r.request_id not in ids]
        self.running = [r for r in self.running if r.request_id not in ids]

    def abort_expired_waiting(self, max_queue_delay_s: float, now: float) -> list[str]:
        old = {r.request_id for r in self.waiting if now - r.arrival > max_queue_delay_s}
        expired = [rid for rid in old if all(m in old for m in self.groups.get(rid, (rid,)))]
        self.abort_requests(expired)
        return expired

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def reset_prefix_cache(self) -> bool:
        """As the real one: False while a request holds KV blocks (the fake caches nothing)."""
        self._touch()
        return self.num_used_blocks == 0

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_waiting_requests(self) -> int:
        return len(self.waiting)

    @property
    def num_used_blocks(self) -> int:
        return sum(
            math.ceil((len(r.prompt_ids) + len(r.token_ids) + 1) / self.block_size)
            for r in self.running
        )

    @property
    def kv_cache_usage(self) -> float:
        return min(1.0, self.num_used_blocks / self.num_blocks)

    def _next_token(self, r: _Req) -> int:
        if FAIL_MARK in r.prompt_ids_bytes and len(r.token_ids) >= 2:
            # An id the tokenizer cannot decode: the front end's output processing fails, and
            # ends the request with finish_reason "error".
            return UNDECODABLE
        if r.params.temperature == 0:
            if SAY_MARK in r.prompt_ids_bytes:
                script = r.prompt_ids_bytes.split(SAY_MARK, 1)[1].split(b"|", 1)[0]
                return script[len(r.token_ids)] if len(r.token_ids) < len(script) else EOS
            return ord("a") + (len(r.prompt_ids) + len(r.token_ids)) % 26
        return ord("a") + r.rng.randrange(26)

    def _logprobs(self, tok: int, p: SamplingParams) -> dict[int, tuple[float, int]]:
        d = {tok: (-0.5, 1)}
        if p.logprob_token_ids:  # the sampled token, then exactly these
            for j, t in enumerate(p.logprob_token_ids):
                d.setdefault(t, (-3.0 - j, 10 + j))
            return d
        for j in range(p.logprobs):
            alt = ord("A") + (tok + j) % 26
            d.setdefault(alt, (-2.0 - j, j + 2))
        return d

    def step(self) -> EngineCoreOutputs:
        self._touch()
        if self.step_delay:
            time.sleep(self.step_delay)
        now = time.time()
        it = IterationStats(iteration_timestamp=now)
        result = EngineCoreOutputs(iteration_stats=it)
        new: set[str] = set()
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.pop(0)
            r.scheduled = now
            result.first_scheduled[r.request_id] = now
            it.num_prompt_tokens += len(r.prompt_ids)
            self.running.append(r)
            new.add(r.request_id)
        for r in list(self.running):
            p = r.params
            tok = self._next_token(r)
            r.token_ids.append(tok)
            finish = "length" if len(r.token_ids) >= r.max_tokens else None
            repeats = p.repetition_detection
            if finish is None and repeats and check_sequence_repetition(r.token_ids, repeats):
                finish = "repetition"
            finish = "stop" if tok == EOS or tok in (p.stop_token_ids or ()) else finish
            prompt_lps = None
            if p.prompt_logprobs is not None and r.request_id in new:
                prompt_lps = [{t: (-1.0, 1)} for t in r.prompt_ids[1:]]
            result.outputs.append(
                EngineCoreOutput(
                    r.request_id,
                    [tok],
                    [self._logprobs(tok, p)] if p.num_logprobs is not None else None,
                    prompt_lps,
                    finish,
                )
            )
            if finish is not None:
                self.running.remove(r)
                self.groups.pop(r.request_id, None)
        self.last_iteration_stats = it
        self.last_scheduler_stats = SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_usage,
            num_used_blocks=self.num_used_blocks,
            num_total_blocks=self.num_blocks,
            prefix_cache_queries=it.num_prompt_tokens,
        )
        return result


# ---- factories for AsyncLLM(engine_factory=...): they run in the engine core process ----
def failing_engine() -> FakeEngine:
    """An engine whose first step raises (a device lost mid-serving)."""
    engine = FakeEngine()

    def boom() -> EngineCoreOutputs:
        raise RuntimeError("device lost")

    engine.step = boom  # type: ignore[method-assign]
    return engine


def crashing_engine() -> FakeEngine:
    """An engine whose process dies without a word at its first step (OOM killer, segfault)."""
    import os

    engine = FakeEngine()

    def die() -> EngineCoreOutputs:
        os._exit(3)

    engine.step = die  # type: ignore[method-assign]
    return engine


def misconfigured_engine() -> FakeEngine:
    raise ValueError("max_model_len (9999) is larger than the model's; lower --max-model-len")


def structured_engine(**kw: Any) -> FakeEngine:
    """The fake engine with a real `StructuredOutputManager` over the embedded model's tokenizer:
    the serving loop compiles its constraints as the real engine's (in compile worker
    processes); steps ignore them."""
    from pagoda.config import embedded_model_path
    from pagoda.structured_output import StructuredOutputManager
    from pagoda.tokenizer import get_tokenizer

    engine = FakeEngine(**kw)
    tokenizer = get_tokenizer(embedded_model_path())
    engine.structured_output = StructuredOutputManager(  # type: ignore[attr-defined]
        tokenizer, len(tokenizer), tokenizer.eos_token_id
    )
    return engine
