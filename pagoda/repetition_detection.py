"""Repetition detection (vLLM's `SamplingParams.repetition_detection`): end a request whose output
has fallen into a loop ("abcdabcdabcd...") instead of letting it run to max_tokens.

A request's output repeats when its last `k` tokens, for some pattern size `k` in
[`min_pattern_size`, `max_pattern_size`], occur `min_count` times back to back at its end. The
scheduler checks this after every token it appends (past `min_tokens`, after the stop tokens and
the length cap); such a request finishes with finish_reason "repetition" and stop_reason
"repetition_detected", as in vLLM. Plain Python (no torch): the scheduler imports it.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagoda.utils.fields import dataclass_from_request

REPETITION_STOP_REASON = "repetition_detected"


@dataclass
class RepetitionDetectionParams:
    """When an output counts as repeating (vLLM's fields, defaults and messages)."""

    # The longest n-gram to look for; 0 turns detection off.
    max_pattern_size: int = 0
    # The shortest n-gram to look for; 0 means 1. At most max_pattern_size.
    min_pattern_size: int = 0
    # How many times in a row the n-gram must end the output (>= 2 when detection is on).
    min_count: int = 0

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> RepetitionDetectionParams:
        """From a request's `repetition_detection` object (`dataclass_from_request`)."""
        return dataclass_from_request(cls, fields, "repetition_detection")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ValueError(
                    f"repetition_detection.{f.name} must be an integer, got {value!r:.100}"
                )
            setattr(self, f.name, int(value))
        if (
            self.max_pattern_size < 0
            or self.min_pattern_size < 0
            or self.min_pattern_size > self.max_pattern_size
        ):
            raise ValueError(
                "max_pattern_size, min_pattern_size must be >=0, "
                "with min_pattern_size <= max_pattern_size. "
                "Set both to 0 to disable repetitive pattern detection."
            )
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError(
                "min_count must be >= 2 to detect repetitive patterns "
                "in engine output. If you do not wish to detect repetitive "
                "patterns, set max_pattern_size to 0."
            )

    @property
    def enabled(self) -> bool:
        return self.max_pattern_size > 0


def _ends_with_repeats(token_ids: Sequence[int], pattern_len: int, count: int) -> bool:
    """Whether the last `pattern_len` tokens are the same as each of the `count - 1` blocks of
    that length before them (the caller has checked that there are that many tokens)."""
    for n in range(1, pattern_len + 1):
        target = token_ids[-n]
        for m in range(1, count):
            if token_ids[-(pattern_len * m + n)] != target:
                return False
    return True


def check_sequence_repetition(token_ids: Sequence[int], params: RepetitionDetectionParams) -> bool:
    """Whether `token_ids` (a request's output) ends with an n-gram of a size in
    [min_pattern_size, max_pattern_size] repeated `min_count` times in a row (vLLM's
    `check_sequence_repetition`). The smallest size is tried first; sizes whose repeats would
    not fit in the output are not tried."""
    if not params.enabled or params.min_count < 2:
        return False
    min_size = max(params.min_pattern_size, 1)
    for pattern_len in range(min_size, params.max_pattern_size + 1):
        if pattern_len * params.min_count > len(token_ids):
            return False
        if _ends_with_repeats(token_ids, pattern_len, params.min_count):
            return True
    return False
