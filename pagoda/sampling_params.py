"""`SamplingParams`: how to pick each next token and when to stop (vLLM's fields and defaults).

Plain Python (no torch): the scheduler and the server read it too. Every value is checked in
`__post_init__`, type and range, to what the sampler and the engine accept: a bad one raises
`ValueError` whose message starts with the field's name (the server answers it as HTTP 400 with
that name as `param`), so that no request can fail later inside an engine step.

Limits beyond the obvious ranges:
- `n` <= `MAX_N` (128, OpenAI's limit; `PAGODA_MAX_N_SEQUENCES` raises it, as vLLM's
  `VLLM_MAX_N_SEQUENCES`): the engine runs `n` sequences, so `n` is the request's cost.
- `seed` in the signed 64-bit range (vLLM's): `torch.Generator.manual_seed` takes
  [-2**63, 2**64 - 1], and the engine seeds the i-th of `n` samples with `seed + i`.
- `temperature` in [0, 2] (OpenAI's range, which vLLM enforces too): beyond it sampling is
  near-uniform noise, and a huge value rounds to infinity in float32 (NaN logits).
- `logprobs`, `prompt_logprobs` in [0, `MAX_LOGPROBS`] (vLLM's default `max_logprobs`).
- `logprob_token_ids`: at most `MAX_LOGPROB_TOKEN_IDS` (128, vLLM's) ids, each in the
  vocabulary; with `logprobs` set too, `logprobs` must equal their number (as vLLM).
- `prompt_logprob_token_ids`: a non-empty [num_rows, num_ids] integer array (or nested lists,
  padded with -1) of at most `MAX_LOGPROBS` ids a row, each in the vocabulary or -1; the engine
  checks `num_rows` against the prompt (`validate_request`).
- `bad_words`: at most `MAX_NUM_BAD_WORDS` token sequences (each word counts once or twice, see
  `update_from_tokenizer`) of at most `MAX_BAD_WORDS_TOTAL_TOKENS` tokens in all (vLLM's
  `VLLM_MAX_NUM_BAD_WORDS`, `VLLM_MAX_BAD_WORDS_TOTAL_TOKENS`): the sampler checks each one
  against the request's latest tokens at every step, in Python.
"""

from __future__ import annotations

import copy
import enum
import json as _json
import math
import numbers
import operator
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagoda import envs
from pagoda.repetition_detection import RepetitionDetectionParams
from pagoda.utils.fields import dataclass_from_request

_SAMPLING_EPS = 1e-5
MAX_N: int = envs.PAGODA_MAX_N_SEQUENCES
MAX_LOGPROBS = 20
MAX_LOGPROB_TOKEN_IDS = 128
MAX_TEMPERATURE = 2.0
MAX_NUM_BAD_WORDS = 128
MAX_BAD_WORDS_TOTAL_TOKENS = 1024
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_FLAGS = (  # SamplingParams fields that are plain switches
    "ignore_eos",
    "detokenize",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "flat_logprobs",
)
# The fields `SamplingParams.from_optional` gives their default when passed None.
_OPTIONAL_DEFAULTS = (
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
)
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, a regex, one of some strings, an EBNF grammar or
    any JSON object (vLLM's `StructuredOutputsParams`: exactly one of them). The engine
    compiles it with xgrammar (`pagoda.structured_output`) and masks each step's logits."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> StructuredOutputsParams:
        """From a request's `structured_outputs` object (`dataclass_from_request`)."""
        return dataclass_from_request(cls, fields, "structured_outputs")

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag; got {given or 'none'}"
            )
        if self.structural_tag is not None:
            raise ValueError("structured_outputs.structural_tag is not supported by Pagoda yet")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {self.json_object}")
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}"
            )
        if self.choice is not None:
            self.choice = list(self.choice)
        for name in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {v!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"structured_outputs.{name} must be true or false, got {v!r:.50}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (dict or string), got {self.json!r}"
            )

    def cache_key(self) -> str:
        """One string per distinct constraint (compiled grammars are cached by it)."""
        return _json.dumps(
            {k: v for k, v in self.__dict__.items() if v is not None and v is not False},
            sort_keys=True,
        )


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output holds all text/tokens so far
    DELTA = 1  # every output holds only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


def _str_list(name: str, value: Any) -> list[str]:
    """`stop`: None, one string or a list of them, each non-empty."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or any(not isinstance(s, str) or not s for s in items):
        raise ValueError(f"{name} must be a non-empty string or a list of them, got {value!r:.200}")
    return list(items)


def _bad_words(value: Any) -> list[str]:
    """`bad_words`: None or a list of non-empty strings, duplicates dropped (as vLLM)."""
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or any(not isinstance(s, str) for s in value):
        raise ValueError(f"bad_words must be a list of strings, got {value!r:.200}")
    if any(not s for s in value):
        raise ValueError(f"bad_words cannot contain an empty string, got {value!r:.200}")
    return list(dict.fromkeys(value))


def _token_id_list(name: str, value: Any) -> list[int]:
    """A list of token ids (non-negative integers; the vocabulary bound is checked by the engine,
    `validate_token_ids`)."""
    if not isinstance(value, (list, tuple)) or any(
        isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0 for t in value
    ):
        raise ValueError(f"{name} must be a list of non-negative token ids, got {value!r:.200}")
    return [int(t) for t in value]


def _prompt_logprob_token_ids(value: Any) -> np.ndarray:
    """`prompt_logprob_token_ids` as a C-contiguous int32 [num_rows, num_ids] array: nested
    lists are padded with -1 to their longest row. The checks are vLLM's (shape, at most
    MAX_LOGPROBS ids a row, integer ids >= -1); the vocabulary bound is `validate_token_ids`'."""
    name = "prompt_logprob_token_ids"
    shape: tuple[int, ...] = ()
    if isinstance(value, (list, tuple)) and all(isinstance(r, (list, tuple)) for r in value):
        shape = (len(value), max(map(len, value), default=0))
    elif isinstance(value, np.ndarray) and value.dtype.kind in "iu":
        shape = value.shape
    if len(shape) != 2 or 0 in shape:
        got = getattr(value, "shape", None) or f"{value!r:.100}"
        raise ValueError(
            f"{name} must be a non-empty integer array of shape [num_rows, num_ids], got {got}"
        )
    if shape[1] > MAX_LOGPROBS:
        raise ValueError(
            f"{name} has {shape[1]} token ids a row; the most is {MAX_LOGPROBS} (max_logprobs)"
        )
    if isinstance(value, np.ndarray):
        ids = value.astype(np.int64)
    else:
        ids = np.full(shape, -1, dtype=np.int64)
        for i, row in enumerate(value):
            if any(isinstance(t, bool) or not isinstance(t, numbers.Integral) for t in row):
                raise ValueError(f"{name} must contain integer token ids, got {row!r:.100}")
            try:
                ids[i, : len(row)] = row
            except OverflowError:
                raise ValueError(f"{name} has a token id out of range in {row!r:.100}") from None
    lo, hi = int(ids.min()), int(ids.max())
    if lo < -1:
        raise ValueError(f"{name} must hold token ids, -1 padding a row; got {lo}")
    if hi > np.iinfo(np.int32).max:
        raise ValueError(f"{name} has token ids outside any vocabulary: {hi}")
    return np.ascontiguousarray(ids, dtype=np.int32)


def _in_vocab_candidates(ids: np.ndarray | None) -> list[int]:
    """The distinct non-padding ids of `prompt_logprob_token_ids` (for the vocabulary check)."""
    if ids is None:
        return []
    return [int(t) for t in np.unique(ids) if t != -1]


_DECIMAL = re.compile(r"-?[0-9]+")


def _logit_bias(bias: Any) -> dict[int, float]:
    """{token id: bias in [-100, 100]} (OpenAI's range); JSON gives the ids as strings."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r:.200}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            if isinstance(key, bool):
                raise TypeError
            if isinstance(key, str) and not _DECIMAL.fullmatch(key):
                raise ValueError  # int() would also take " 5 ", "5_0" and non-ASCII digits
            token_id = int(key) if isinstance(key, str) else operator.index(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r:.50}") from None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"logit_bias values must be numbers, got {value!r:.50}")
        if not -100.0 <= value <= 100.0:  # NaN fails the comparison too
            raise ValueError(f"logit_bias values must be in [-100, 100], got {value}")
        out[token_id] = float(value)
    return out


@dataclass(eq=False)  # __eq__ below: a field may hold a numpy array
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's field for custom samplers and plugins: kept and passed along, never read by Pagoda.
    extra_args: dict[str, Any] | None = None
    # Words never to generate: the last token of a word's token sequence is banned whenever the
    # tokens generated last are the ones before it (a one-token word always). The engine
    # tokenizes them (`update_from_tokenizer`) into `bad_words_token_ids`.
    bad_words: list[str] | None = None
    # Streaming (output_kind DELTA or CUMULATIVE, as AsyncLLM and the server's streams): how many
    # new tokens to batch into each `RequestOutput` (vLLM's). The first and the final outputs
    # go out at once; the engine's --stream-interval raises a smaller value to its own. Batched
    # DELTA chunks concatenate to the unbatched stream. No effect on FINAL_ONLY (LLM.generate).
    stream_interval: int | None = None
    # True: the request reuses no cached prefix blocks (its own blocks still enter the prefix
    # cache). None becomes vLLM's default, True when prompt_logprobs are asked for (they need
    # every prompt position computed: with them the cache is never read, whatever this says).
    skip_reading_prefix_cache: bool | None = None
    # Logprobs of exactly these token ids at each generated position, besides the sampled
    # token's (vLLM's; e.g. the labels of a classification prompt): each position's dict holds
    # the sampled token and these, in place of the top-`logprobs` tokens. `logprobs` may be
    # left unset (`num_logprobs` is then their number).
    logprob_token_ids: list[int] | None = None
    # End the request early when its output starts repeating an n-gram (vLLM's; finish_reason
    # "repetition"): `pagoda.repetition_detection`. A dict is taken as its fields.
    repetition_detection: RepetitionDetectionParams | None = None
    # Score fixed token ids at prompt positions (vLLM's; e.g. the labels of each example of a
    # few-shot prompt): row i of this [num_rows, num_ids] int array (or nested lists, -1
    # padding a short row) holds ids scored as predictions of prompt token
    # prompt_logprob_start + i + 1, so num_rows = prompt_len - 1 - prompt_logprob_start.
    # Their logprobs come back once in `RequestOutput.prompt_token_id_logprobs`, a float32
    # array of the same shape, -inf at the padding. Independent of `prompt_logprobs`.
    prompt_logprob_token_ids: np.ndarray | list[list[int]] | None = None
    # The first prompt row (position) that `prompt_logprob_token_ids` scores; None: row 0.
    prompt_logprob_start: int | None = None
    # Return logprobs and prompt_logprobs as `FlatLogprobs` (vLLM's; a few flat lists for the
    # whole request, far less garbage-collector work than a dict per position) in place of
    # lists of dicts. Offline only, as in vLLM.
    flat_logprobs: bool = False
    _bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    # Filled in by the engine: the tokenizer's eos id(s) plus stop_token_ids, used for min_tokens.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if self.seed == -1:
            self.seed = None  # as vLLM (and OpenAI clients): -1 asks for no seed, not seed -1
        self.stop = _str_list("stop", self.stop)
        self.stop_token_ids = _token_id_list("stop_token_ids", self.stop_token_ids or [])
        self.bad_words = _bad_words(self.bad_words)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_id_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must not be empty")
        if self.logit_bias:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.logprob_token_ids is not None:
            ids = _token_id_list("logprob_token_ids", self.logprob_token_ids)
            if len(ids) > MAX_LOGPROB_TOKEN_IDS:
                raise ValueError(
                    f"logprob_token_ids has {len(ids)} token ids; the most is "
                    f"{MAX_LOGPROB_TOKEN_IDS}"
                )
            self.logprob_token_ids = ids or None  # as vLLM, an empty list asks for nothing
        if self.prompt_logprob_token_ids is not None:
            self.prompt_logprob_token_ids = _prompt_logprob_token_ids(self.prompt_logprob_token_ids)
        elif self.prompt_logprob_start is not None:
            raise ValueError(
                "prompt_logprob_start requires prompt_logprob_token_ids (the ids to score)"
            )
        if isinstance(self.repetition_detection, dict):
            self.repetition_detection = RepetitionDetectionParams.from_dict(
                self.repetition_detection
            )
        elif self.repetition_detection is not None and not isinstance(
            self.repetition_detection, RepetitionDetectionParams
        ):
            raise ValueError(
                "repetition_detection must be a RepetitionDetectionParams, got "
                f"{type(self.repetition_detection).__name__}"
            )
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}"
            )
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {type(self.extra_args).__name__}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other sampling knobs have no effect.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        """Check (and normalize: numpy scalars to int/float, top_k -1 to 0) every number."""
        self._int("n", 1, MAX_N, note=" (PAGODA_MAX_N_SEQUENCES raises the bound)")
        self._float("presence_penalty", -2.0, 2.0)
        self._float("frequency_penalty", -2.0, 2.0)
        self._float("repetition_penalty", 0.0, math.inf, lo_open=True)  # any, as vLLM and HF
        self._float("temperature", 0.0, MAX_TEMPERATURE)
        self._float("top_p", 0.0, 1.0, lo_open=True)
        self._float("min_p", 0.0, 1.0)
        if self.top_k is None:
            self.top_k = 0
        self._int("top_k", -1, None, note=" (0 or -1: all tokens)")
        self.top_k = max(self.top_k, 0)
        self._int("seed", _INT64_MIN, _INT64_MAX, optional=True, bounds="a signed 64-bit")
        self._int("max_tokens", 1, None, optional=True)
        self._int("min_tokens", 0, None)
        self._int("stream_interval", 1, None, optional=True)
        self._int("prompt_logprob_start", 0, None, optional=True)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is True:  # vLLM reads True as 1
                setattr(self, name, 1)
            self._int(name, 0, MAX_LOGPROBS, optional=True)
        ids = self.logprob_token_ids
        if ids and self.logprobs is not None and self.logprobs != len(ids):
            raise ValueError(
                f"logprob_token_ids has {len(ids)} token ids but logprobs is {self.logprobs}: "
                "when both are set, logprobs must equal len(logprob_token_ids) (as vLLM)"
            )
        if self.skip_reading_prefix_cache is None:
            self.skip_reading_prefix_cache = (
                self.prompt_logprobs is not None or self.prompt_logprob_token_ids is not None
            )
        for name in (*_FLAGS, "skip_reading_prefix_cache"):  # "no" would otherwise be true
            value = getattr(self, name)
            if isinstance(value, str) or value is None or value not in (True, False):
                raise ValueError(f"{name} must be true or false, got {value!r:.100}")
            setattr(self, name, bool(value))
        if self.stop and not self.detokenize:  # as vLLM: no text to find them in
            raise ValueError("stop strings need detokenize=True (or use stop_token_ids)")

    def _int(
        self,
        name: str,
        lo: int,
        hi: int | None,
        optional: bool = False,
        note: str = "",
        bounds: str | None = None,
    ) -> None:
        value = getattr(self, name)
        if value is None and optional:
            return
        if bounds is not None:
            what = f"{bounds} integer"
        else:
            what = "an integer " + (f"in [{lo}, {hi}]" if hi is not None else f">= {lo}")
        # bool is an int to Python but never a count or a seed (torch refuses it as a seed).
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name} must be {what}{note}, got {value!r:.100}")
        value = int(value)
        if value < lo or (hi is not None and value > hi):
            raise ValueError(f"{name} must be {what}{note}, got {value}")
        setattr(self, name, value)

    def _float(self, name: str, lo: float, hi: float, lo_open: bool = False) -> None:
        value = getattr(self, name)
        bounds = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi == math.inf else ']'}"
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be a number in {bounds}, got {value!r:.100}")
        value = float(value)
        # NaN fails every comparison, so it is refused here too.
        if not (lo < value if lo_open else lo <= value) or not math.isfinite(value) or value > hi:
            raise ValueError(f"{name} must be a number in {bounds}, got {value}")
        setattr(self, name, value)

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def num_logprobs(self) -> int | None:
        """How many logprobs besides the sampled token's each generated position reports, None
        when it reports none (vLLM's): `logprobs`, else the number of `logprob_token_ids`."""
        if self.logprobs is not None:
            return self.logprobs
        return len(self.logprob_token_ids) if self.logprob_token_ids else None

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """`bad_words` as token sequences (None until `update_from_tokenizer` has run)."""
        return self._bad_words_token_ids

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize `bad_words` into `bad_words_token_ids`, as vLLM's method of this name: each
        word (its leading whitespace stripped) as it is, and with one leading space where that
        gives a different first token and as many tokens (a word within the text rather than at
        its start). A word of no tokens, a token outside the vocabulary or more than the bounds
        (module docstring) is a ValueError naming bad_words."""
        if not self.bad_words:
            self._bad_words_token_ids = None
            return
        min_num_tokens = getattr(tokenizer, "min_num_tokens", None)
        if min_num_tokens is not None:
            # A huge word is refused without the seconds that tokenizing it would take.
            chars = "".join(self.bad_words)
            if len(chars) > MAX_BAD_WORDS_TOTAL_TOKENS:
                n = min_num_tokens(chars)
                if n > MAX_BAD_WORDS_TOTAL_TOKENS:
                    raise ValueError(
                        f"bad_words make at least {n} tokens; the most is "
                        f"{MAX_BAD_WORDS_TOTAL_TOKENS}"
                    )
        words: list[list[int]] = []
        for word in self.bad_words:
            word = word.lstrip()
            plain = tokenizer.encode(word, add_special_tokens=False)
            if not plain:
                raise ValueError(
                    f"bad_words entries must tokenize to at least one token, got {word!r:.100}"
                )
            words.append(plain)
            spaced = tokenizer.encode(" " + word, add_special_tokens=False)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                words.append(spaced)
        if len(words) > MAX_NUM_BAD_WORDS:
            raise ValueError(
                f"bad_words make {len(words)} token sequences (a word with and without a "
                f"leading space); the most is {MAX_NUM_BAD_WORDS}"
            )
        total = sum(map(len, words))
        if total > MAX_BAD_WORDS_TOTAL_TOKENS:
            raise ValueError(
                f"bad_words make {total} tokens; the most is {MAX_BAD_WORDS_TOTAL_TOKENS}"
            )
        max_token_id = getattr(tokenizer, "max_token_id", None)
        if max_token_id is None and getattr(tokenizer, "vocab_size", None) is not None:
            max_token_id = tokenizer.vocab_size - 1
        if max_token_id is not None:
            bad = [t for w in words for t in w if not 0 <= t <= max_token_id]
            if bad:
                raise ValueError(
                    f"bad_words have token ids outside the vocabulary [0, {max_token_id}]: "
                    f"{bad[:5]}"
                )
        self._bad_words_token_ids = words

    def validate_token_ids(self, vocab_size: int) -> None:
        """Check token ids named by the user against the model's vocabulary."""
        for name, ids in (
            ("logit_bias", list((self.logit_bias or {}).keys())),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("stop_token_ids", self.stop_token_ids or []),
            ("logprob_token_ids", self.logprob_token_ids or []),
            ("prompt_logprob_token_ids", _in_vocab_candidates(self.prompt_logprob_token_ids)),
            ("bad_words", [t for w in self.bad_words_token_ids or () for t in w]),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                pad = " (-1 pads a row)" if name == "prompt_logprob_token_ids" else ""
                raise ValueError(
                    f"{name} has token ids outside the vocabulary [0, {vocab_size}){pad}: {bad[:5]}"
                )

    @staticmethod
    def from_optional(**kwargs: Any) -> SamplingParams:
        """vLLM's constructor for values that may be None (a request's unset fields, a
        generation config): n, presence_penalty, frequency_penalty, repetition_penalty,
        temperature and top_p given as None take their defaults; logit_bias values are
        clamped to [-100, 100] rather than refused."""
        for name in _OPTIONAL_DEFAULTS:
            if kwargs.get(name, 0) is None:
                del kwargs[name]
        bias = kwargs.get("logit_bias")
        if isinstance(bias, dict):
            kwargs["logit_bias"] = {
                k: min(100.0, max(-100.0, v)) if isinstance(v, (int, float)) else v
                for k, v in bias.items()
            }
        return SamplingParams(**kwargs)

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    def __eq__(self, other: object) -> bool:
        """Field by field, as the dataclass's own would, with an array field
        (`prompt_logprob_token_ids`) equal where its values are."""
        if other.__class__ is not self.__class__:
            return NotImplemented
        for name in self.__dataclass_fields__:
            a, b = getattr(self, name), getattr(other, name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                both = isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                if not (both and np.array_equal(a, b)):  # shapes and values
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # mutable, as the dataclass's eq=True leaves it


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters (`LLM.beam_search`, `pagoda.beam_search`): `beam_width`
    beams are kept (each step looks at 2 x beam_width candidates a beam, so beam_width <=
    MAX_LOGPROBS / 2); `max_tokens` new tokens at most; `temperature` scales the logits the
    candidates are drawn from (0: greedy, the usual); `length_penalty` > 1 favours longer
    sequences; `skip_special_tokens` for the text. `include_stop_str_in_output` is vLLM's
    and has nothing to act on (a beam stops at EOS only)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(
                f"beam_width must be an integer in [1, {MAX_LOGPROBS // 2}], got {self.beam_width}"
            )
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:  # NaN fails too
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}")
