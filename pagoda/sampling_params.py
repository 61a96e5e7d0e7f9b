"""`SamplingParams`: how to pick each next token and when to stop (vLLM's fields and defaults).

Plain Python (no torch): the scheduler and the server read it too. Every value is checked in
`__post_init__`; a bad one raises `ValueError` naming the field.
"""

from __future__ import annotations

import copy
import enum
import json as _json
from dataclasses import dataclass, field
from typing import Any

_SAMPLING_EPS = 1e-5
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


@dataclass
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
    # Filled in by the engine: the tokenizer's eos id(s) plus stop_token_ids, used for min_tokens.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError) as e:
                raise ValueError(f"logit_bias must map token ids to numbers: {e}") from None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be a StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}"
            )
        self._verify()
        if self.temperature < _SAMPLING_EPS:
            # Greedy: the other sampling knobs have no effect.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def check(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ValueError(f"{name} {msg}, got {getattr(self, name)!r}")

        check(isinstance(self.n, int) and self.n >= 1, "n", "must be an integer >= 1")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]")
        check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty", "must be in (0, 2]")
        check(self.temperature >= 0.0, "temperature", "must be non-negative")
        check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        check(isinstance(self.top_k, int), "top_k", "must be an integer")
        check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        if self.max_tokens is not None:
            check(
                isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                "max_tokens",
                "must be an integer >= 1",
            )
        check(
            isinstance(self.min_tokens, int) and self.min_tokens >= 0,
            "min_tokens",
            "must be an integer >= 0",
        )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                check(isinstance(v, int) and 0 <= v <= 20, name, "must be an integer in [0, 20]")
        if self.seed is not None:
            check(isinstance(self.seed, int), "seed", "must be an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or list of them, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
            )
        for v in (self.logit_bias or {}).values():
            if not -100.0 <= v <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {v}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def validate_token_ids(self, vocab_size: int) -> None:
        """Check token ids named by the user against the model's vocabulary."""
        for name, ids in (
            ("logit_bias", list((self.logit_bias or {}).keys())),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("stop_token_ids", self.stop_token_ids or []),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}"
                )

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)
