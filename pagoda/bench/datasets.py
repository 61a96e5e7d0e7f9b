"""Workloads for `pagoda bench serve`, as vLLM's benchmark builds them: `random` (prompts of
random token ids, lengths uniform in input_len * [1 - r, 1 + r]), `prefix_repetition` (a few
shared prefixes with random suffixes: exercises prefix caching) and `sharegpt` (first human
turn as the prompt, the reply's token count as the output length); and `lognormal`, a
ShareGPT-like length mix for when the data set cannot be had (log-normal prompt and output
lengths with ShareGPT's means, capped at a context length).

Prompts are text, built with the *server's* tokenizer (a local one with --tokenizer, or the
server's /tokenize and /detokenize) and re-encoded until they measure the requested length,
so the server sees about input_len tokens. With `TokenIdVocab` in place of a tokenizer they
are lists of random token ids, sent as they are: for a server without a tokenizer
(--skip-tokenizer-init), and the very requests `pagoda bench throughput` runs offline.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class SampleRequest:
    prompt: str | list[int]  # text, or token ids (TokenIdVocab)
    prompt_len: int
    expected_output_len: int


class BenchTokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class TokenIdVocab:
    """Prompts as lists of token ids drawn uniformly below `vocab_size`: no tokenizer needed."""

    vocab_size: int


class LocalTokenizer:
    """pagoda.tokenizer loaded from a model path (GGUF file or HF directory)."""

    def __init__(self, path: str) -> None:
        from pagoda.tokenizer import get_tokenizer

        self._tok = get_tokenizer(path)
        self.vocab_size = self._tok.vocab_size
        self.special_ids = set(getattr(self._tok, "all_special_ids", []) or [])

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class ServerTokenizer:
    """The server's tokenizer over HTTP (/tokenize, /detokenize: pagoda's and vLLM's routes)."""

    def __init__(self, base_url: str, model: str | None, headers: dict[str, str]) -> None:
        self._base_url, self._headers = base_url, headers
        self._model = model
        self.special_ids: set[int] = set()
        self.vocab_size = self._probe_vocab_size()

    def _post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        from pagoda.bench.load import post_json  # the standard library's HTTP client

        return post_json(self._base_url + path, body, self._headers)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        body = {"model": self._model, "prompt": text, "add_special_tokens": add_special_tokens}
        status, reply = self._post("/tokenize", body)
        if status != 200:
            raise ValueError(f"the server's /tokenize answered HTTP {status}")
        return reply["tokens"]

    def decode(self, ids: list[int]) -> str:
        status, reply = self._post("/detokenize", {"model": self._model, "tokens": ids})
        if status != 200:
            raise ValueError(f"the server's /detokenize answered HTTP {status}")
        return reply["prompt"]

    def _valid(self, token_id: int) -> bool:
        return self._post("/detokenize", {"model": self._model, "tokens": [token_id]})[0] == 200

    def _probe_vocab_size(self) -> int:
        """Binary search for the first id the server refuses (no route reports vocab size)."""
        if not self._valid(0):
            raise ValueError(
                "the server's /detokenize does not work: pass --tokenizer PATH to build prompts "
                "with a local tokenizer"
            )
        lo, hi = 0, 1 << 20  # lo valid, hi invalid
        if self._valid(hi):
            raise ValueError("cannot find the vocabulary size over HTTP: pass --tokenizer PATH")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._valid(mid) else (lo, mid)
        return hi


def _random_text(tok: BenchTokenizer, rng: random.Random, length: int) -> tuple[str, int]:
    """Text that re-encodes to about `length` tokens (decoding and re-encoding random ids
    merges or splits some, so adjust a few times); returns (text, its token count)."""
    specials = getattr(tok, "special_ids", set())

    def draw(n: int) -> list[int]:
        ids: list[int] = []
        while len(ids) < n:
            t = rng.randrange(tok.vocab_size)
            if t not in specials:
                ids.append(t)
        return ids

    ids = draw(length)
    for _ in range(8):
        text = tok.decode(ids)
        # Re-encoded ids are what the server will see; trim or extend them and try again.
        enc = tok.encode(text)
        if len(enc) == length:
            break
        ids = enc[:length] if len(enc) > length else enc + draw(length - len(enc))
    return text, len(tok.encode(text))


def _random_prompt(
    tok: BenchTokenizer | TokenIdVocab, rng: random.Random, length: int
) -> tuple[str | list[int], int]:
    if isinstance(tok, TokenIdVocab):
        return [rng.randrange(tok.vocab_size) for _ in range(length)], length
    return _random_text(tok, rng, length)


def _lengths(mean: int, ratio: float, rng: random.Random) -> int:
    if not 0 <= ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def random_dataset(
    tok: BenchTokenizer | TokenIdVocab, num_prompts: int, input_len: int, output_len: int,
    range_ratio: float, seed: int,
) -> list[SampleRequest]:  # fmt: skip
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        n_in, n_out = _lengths(input_len, range_ratio, rng), _lengths(output_len, range_ratio, rng)
        prompt, n = _random_prompt(tok, rng, n_in)
        out.append(SampleRequest(prompt, n, n_out))
    return out


@dataclass(frozen=True)
class LognormalMix:
    """Log-normal prompt and output lengths with the given means (ShareGPT's, as vLLM's
    benchmark filters it, by default: 226 prompt and 196 output tokens) and log-space standard
    deviations; a prompt is capped at half of `max_len`, prompt plus output at `max_len`
    (vLLM's ShareGPT bounds at its default 2048), and both are at least 4 tokens."""

    input_mean: float = 226.0
    output_mean: float = 196.0
    input_sigma: float = 1.0
    output_sigma: float = 1.0
    max_len: int = 2048

    def __post_init__(self) -> None:
        means = (self.input_mean, self.output_mean)
        if not all(1 <= m < float("inf") for m in means) or self.max_len < 16:  # nan too
            raise ValueError("--lognormal-*-mean must be >= 1 and --lognormal-max-len >= 16")
        if not all(0 <= s < float("inf") for s in (self.input_sigma, self.output_sigma)):
            raise ValueError("--lognormal-*-sigma must be >= 0")

    def draw(self, rng: random.Random) -> tuple[int, int]:
        # A log-normal with mean m and log-space sigma s has mu = ln(m) - s^2 / 2.
        def one(mean: float, sigma: float) -> float:
            return rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)

        n_in = min(max(4, round(one(self.input_mean, self.input_sigma))), self.max_len // 2)
        n_out = min(max(4, round(one(self.output_mean, self.output_sigma))), self.max_len - n_in)
        return n_in, n_out


def add_lognormal_args(parser: argparse.ArgumentParser) -> None:
    d = LognormalMix()
    a = parser.add_argument
    a("--lognormal-input-mean", type=float, default=d.input_mean, help="mean prompt tokens")
    a("--lognormal-output-mean", type=float, default=d.output_mean, help="mean output tokens")
    a("--lognormal-input-sigma", type=float, default=d.input_sigma, help="log-space std")
    a("--lognormal-output-sigma", type=float, default=d.output_sigma, help="log-space std")
    a("--lognormal-max-len", type=int, default=d.max_len, help="cap on prompt + output tokens")


def lognormal_mix_from_args(args: argparse.Namespace) -> LognormalMix:
    return LognormalMix(
        args.lognormal_input_mean,
        args.lognormal_output_mean,
        args.lognormal_input_sigma,
        args.lognormal_output_sigma,
        args.lognormal_max_len,
    )


def lognormal_dataset(
    tok: BenchTokenizer | TokenIdVocab, num_prompts: int, mix: LognormalMix, seed: int
) -> list[SampleRequest]:
    """`num_prompts` requests of `mix`'s lengths; the lengths depend on the seed alone, so a
    text and a token-id run of one seed ask for the same work."""
    rng = random.Random(seed)
    lengths = [mix.draw(rng) for _ in range(num_prompts)]
    out = []
    for n_in, n_out in lengths:
        prompt, n = _random_prompt(tok, rng, n_in)
        out.append(SampleRequest(prompt, n, n_out))
    return out


def prefix_repetition_dataset(
    tok: BenchTokenizer | TokenIdVocab, num_prompts: int, prefix_len: int, suffix_len: int,
    num_prefixes: int, output_len: int, seed: int,
) -> list[SampleRequest]:  # fmt: skip
    if num_prefixes < 1:
        raise ValueError("--prefix-repetition-num-prefixes must be >= 1")
    rng = random.Random(seed)
    prefixes = [_random_prompt(tok, rng, prefix_len)[0] for _ in range(num_prefixes)]
    out = []
    for i in range(num_prompts):
        prefix = prefixes[i % num_prefixes]
        suffix, _ = _random_prompt(tok, rng, suffix_len)
        prompt = prefix + suffix
        n = len(prompt) if isinstance(prompt, list) else len(tok.encode(prompt))
        out.append(SampleRequest(prompt, n, output_len))
    rng.shuffle(out)
    return out


def sharegpt_dataset(
    tok: BenchTokenizer, path: str, num_prompts: int, output_len: int | None, seed: int
) -> list[SampleRequest]:
    """ShareGPT JSON: [{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}]."""
    try:
        with open(path, encoding="utf-8") as f:
            data: list[dict[str, Any]] = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--dataset-path {path!r}: cannot read ShareGPT JSON: {e}") from None
    rng = random.Random(seed)
    convs = [d.get("conversations") or d.get("conversation") or [] for d in data]
    convs = [c for c in convs if len(c) >= 2]
    rng.shuffle(convs)
    out = []
    for conv in convs:
        if len(out) >= num_prompts:
            break
        prompt, reply = conv[0]["value"], conv[1]["value"]
        n_in = len(tok.encode(prompt))
        n_out = output_len or len(tok.encode(reply))
        # vLLM's filter: drop too-short pairs and ones that would not fit a 2k context.
        if n_in < 4 or n_out < 4 or n_in > 1024 or n_in + n_out > 2048:
            continue
        out.append(SampleRequest(prompt, n_in, n_out))
    if len(out) < num_prompts:
        raise ValueError(f"--dataset-path {path!r} has only {len(out)} usable conversations")
    return out
