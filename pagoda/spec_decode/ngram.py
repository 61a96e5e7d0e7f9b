"""N-gram (prompt lookup) speculation: the tokens that followed the last occurrence of the
request's latest n-gram earlier in its own text (Saxena, "Prompt Lookup Decoding", 2023).

Torch-free and deterministic in the request's known tokens, which is what makes the runner's
"accept a draft iff the target samples it" verification exact. It pays off where outputs copy
their input: summaries, extraction, code edits, retrieval-augmented answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pagoda.core.request import Request


class NgramProposer:
    """Proposes up to `num_speculative_tokens` drafts from the longest n-gram, `prompt_lookup_max`
    down to `prompt_lookup_min` tokens, that ends the sequence and occurred before; the most
    recent earlier occurrence wins."""

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
    ) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{prompt_lookup_min} and {prompt_lookup_max}"
            )
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: Sequence[int], max_drafts: int | None = None) -> list[int]:
        """Drafts to follow `token_ids` (at most `max_drafts`, default k); [] if no n-gram of
        the allowed sizes recurs."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        n_total = len(token_ids)
        if k <= 0 or n_total < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, n_total - 1), self.min_n - 1, -1):
            suffix = tokens[n_total - n :]
            # Starts i of earlier occurrences: tokens[i : i + n] == suffix with i + n < n_total,
            # so at least one token follows. Candidates by the first token, checked newest first.
            starts = np.flatnonzero(tokens[: n_total - n] == suffix[0])
            for i in starts[::-1]:
                if np.array_equal(tokens[i : i + n], suffix):
                    return tokens[i + n : i + n + k].tolist()
        return []

    def propose_requests(
        self, requests: list[Request], max_drafts: dict[str, int]
    ) -> dict[str, list[int]]:
        """Drafts per request id from each request's own tokens."""
        return {
            req.request_id: self.propose(req.all_token_ids, max_drafts.get(req.request_id))
            for req in requests
        }

    def release(self, keep: set[str]) -> None:
        """Nothing is kept per request."""
