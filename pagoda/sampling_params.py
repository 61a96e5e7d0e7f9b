"""`SamplingParams`: how to pick each next token and when to stop (vLLM's fields and defaults).

Plain Python (no torch): the scheduler and the server read it too. Every value is checked in
`__post_init__`; a bad one raises `ValueError` naming the field.
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, field

_SAMPLING_EPS = 1e-5


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
