"""Incremental detokenization and stop strings for one request's output stream.

`IncrementalDetokenizer` turns the tokens a request generates into text as they arrive, in
O(new tokens) per update: it decodes only a small window of token ids (vLLM's
`detokenize_incrementally` "prefix offset / read offset" scheme: the text of
`ids[prefix_offset:]` minus that of `ids[prefix_offset:read_offset]` is the new text), so the
output is never re-decoded whole. A character whose UTF-8 bytes are split across tokens is held
back until it is complete (no '\\ufffd' mid-character). It also finds stop strings that span
token boundaries, truncates the text at them, and holds back the last `len(longest stop) - 1`
characters while streaming so that a stop string is never sent in part.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagoda.tokenizer import Tokenizer

# Prompt tokens kept as decoding context, so the first output token decodes with the spacing it
# has after the prompt (e.g. SentencePiece's "▁Hello" is " Hello" there, not "Hello").
INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Detokenizes one sequence incrementally; `output_text` is all text so far."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        # As vLLM: a stop string that ends within the first min_tokens tokens' text does not stop.
        self.min_tokens = min_tokens
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        # Streaming holds back this many trailing characters: the most a partial stop string
        # can occupy (none when the stop string is kept in the output anyway).
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1
            if self.stop and not include_stop_str_in_output
            else 0
        )
        context = list(prompt_token_ids[-INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET:])
        self._num_context_tokens = len(context)
        self.token_ids: list[int] = context  # decoding context + every output token
        self.prefix_offset = 0
        self.read_offset = len(context)
        self._prefix_text_len = len(self._decode(self.prefix_offset, self.read_offset))
        # Characters of the pending window (past read_offset) already emitted before a
        # trailing incomplete character made us keep the offsets where they are.
        self._pending_emitted = 0
        self.output_text = ""
        self._last_output_text_offset = 0
        self.stop_reason: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self._num_context_tokens :]

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(
            self.token_ids[start:end],
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            # Clean-up rewrites text across token boundaries (" ." -> "."), which would change
            # characters already streamed; vLLM's incremental path skips it too.
            clean_up_tokenization_spaces=False,
        )

    def _decode_next(self) -> str:
        """The text that the tokens past read_offset add, as far as it is complete."""
        text = self._decode(self.prefix_offset)
        start = self._prefix_text_len + self._pending_emitted
        if text.endswith(_REPLACEMENT_CHAR):
            # The last token(s) end inside a multi-byte character: emit what precedes it and
            # keep the window, so the character is decoded whole once its last byte arrives.
            stable = len(text.rstrip(_REPLACEMENT_CHAR))
            if stable <= start:
                return ""
            self._pending_emitted += stable - start
            return text[start:stable]
        if len(text) <= self._prefix_text_len:
            # Nothing printable yet (e.g. a skipped special token): keep the window.
            return ""
        delta = text[start:]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._prefix_text_len = len(self._decode(self.prefix_offset, self.read_offset))
        self._pending_emitted = 0
        return delta

    def update(self, new_token_ids: Iterable[int]) -> str | None:
        """Append tokens and extend `output_text`; return the stop string if one now appears
        (the text is then cut before it, or after it with include_stop_str_in_output)."""
        new_token_ids = list(new_token_ids)
        if not new_token_ids or self.stop_reason is not None:
            return None
        short = self.min_tokens - len(self.output_token_ids)
        if self.stop and 0 < short < len(new_token_ids):
            # The step crosses min_tokens: only the text of the tokens past it is searched.
            self.update(new_token_ids[:short])
            return self.update(new_token_ids[short:])
        self.token_ids.extend(new_token_ids)
        new_text = self._decode_next()
        self.output_text += new_text
        if not self.stop or not new_text or len(self.output_token_ids) <= self.min_tokens:
            return None
        return self._check_stop_strings(len(new_text))

    def _check_stop_strings(self, new_char_count: int) -> str | None:
        # A match must end inside the new text, so only its last len(new)+len(stop)-1
        # characters are searched; the earliest match wins.
        best: tuple[int, str] | None = None
        for stop in self.stop:
            start = max(len(self.output_text) - new_char_count - len(stop) + 1, 0)
            index = self.output_text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        self.stop_reason = stop
        return stop

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to send now: all of it (`delta=False`) or what is new since the last call.

        While not finished, the last `stop_buffer_length` characters are held back, since they
        may be the start of a stop string that later tokens complete.
        """
        buffer_length = 0 if finished else self.stop_buffer_length
        length = max(len(self.output_text) - buffer_length, 0)
        if not delta:
            return self.output_text[:length]
        last = self._last_output_text_offset
        if last >= length:
            return ""
        self._last_output_text_offset = length
        return self.output_text[last:length]
