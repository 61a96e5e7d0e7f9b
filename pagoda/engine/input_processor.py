"""Input processing, in the front end (`LLMEngine`, `AsyncLLM`, the HTTP server).

A prompt (text, token ids, or a dict with `prompt` / `prompt_token_ids`) becomes token ids,
is validated once by `validate_request` (THE rule for every entry point: a prompt must leave
room for at least one generated token, so one of `max_model_len` tokens or more is refused),
and a request with n > 1 is fanned out into n one-sample `EngineCoreRequest`s. The engine
core receives only these: token ids and sampling parameters. Text is checked against the same
rule before it is tokenized (`check_prompt_text`): one too long by its length alone is refused
without the tokenizer's seconds to minutes over it.
"""

from __future__ import annotations

import numbers
from typing import Any

from pagoda.core.outputs import EngineCoreRequest
from pagoda.sampling_params import SamplingParams
from pagoda.structured_output.backend_xgrammar import check_constraint

PromptType = str | list[int] | dict[str, Any]


class PromptValidationError(ValueError):
    """A request refused before it reaches the engine core (`validate_request`, admission);
    `param` is the field at fault ("prompt", "max_tokens", "n", or the sampling parameter the
    message starts with)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def token_id_list(ids: Any, what: str) -> list[int]:
    """`ids` as a list of ints, or a ValueError naming `what`: floats, strings, booleans or
    nested lists are no token ids (a float would otherwise run as its integer part)."""
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"{what} must be a list of token ids (ints), got {type(ids).__name__}")
    out = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"{what} must be a list of token ids (ints), found {t!r:.40}")
        out.append(int(t))
    return out


def validate_request(
    prompt_token_ids: list[int],
    params: SamplingParams,
    max_model_len: int,
    vocab_size: int,
    *,
    strict_max_tokens_field: str | None = None,
) -> int:
    """Validate a request's prompt and token ids; return its max_tokens resolved against the
    context (None: the rest of it). A max_tokens past the context is cut to fit, or, with
    `strict_max_tokens_field` (the OpenAI server: the field's name), refused."""
    n = len(prompt_token_ids)
    if n == 0:
        raise PromptValidationError("the prompt is empty: give at least one token", "prompt")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise PromptValidationError(
            f"the prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
            "prompt",
        )
    if n >= max_model_len:
        raise PromptValidationError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{n} tokens and at least one token must be generated: shorten the prompt (or raise "
            "max_model_len, --max-model-len)",
            "prompt",
        )
    try:
        params.validate_token_ids(vocab_size)
    except ValueError as e:
        raise PromptValidationError(str(e), str(e).split(" ", 1)[0]) from None
    check_prompt_logprob_rows(params, n)
    room = max_model_len - n
    field_name = strict_max_tokens_field
    if params.min_tokens > room and field_name is not None:
        raise PromptValidationError(
            f"min_tokens {params.min_tokens} is more than the {room} tokens this model's context "
            f"({max_model_len}) leaves after the prompt ({n} tokens)",
            "min_tokens",
        )
    if params.max_tokens is None:
        return room
    if params.max_tokens > room and field_name is not None:
        raise PromptValidationError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} "
            f"in the completion). Reduce {field_name} to at most {room} or shorten the prompt.",
            field_name,
        )
    return min(room, params.max_tokens)


def check_prompt_logprob_rows(params: SamplingParams, prompt_len: int) -> None:
    """`prompt_logprob_token_ids` must have a row for each prompt position from
    `prompt_logprob_start` to the last but one (the last predicts the first generated token)."""
    rows = params.prompt_logprob_token_ids
    if rows is None:
        return
    start = params.prompt_logprob_start or 0
    if 2 <= prompt_len <= start + 1:
        raise PromptValidationError(
            f"prompt_logprob_start must be at most {prompt_len - 2} for this prompt of "
            f"{prompt_len} tokens (the last row it can score), got {start}",
            "prompt_logprob_start",
        )
    num_rows = max(prompt_len - 1 - start, 0)
    if len(rows) != num_rows:
        raise PromptValidationError(
            f"prompt_logprob_token_ids has {len(rows)} rows, but the prompt has {num_rows} "
            "scored rows (prompt_len - 1 - prompt_logprob_start)",
            "prompt_logprob_token_ids",
        )


def check_prompt_text(tokenizer: Any, text: str, max_model_len: int) -> None:
    """`validate_request`'s context rule for a prompt not tokenized yet: refuse `text` when
    its length alone shows it is `max_model_len` tokens or more (`Tokenizer.min_num_tokens`:
    no token stands for more characters than the longest in the vocabulary). Tokenizing it
    would take the tokenizer seconds for a megabyte, minutes for 100 MB, and only to refuse it;
    a text under the bound is tokenized and validated as usual."""
    min_tokens = getattr(tokenizer, "min_num_tokens", None)
    if min_tokens is None or len(text) < max_model_len:  # (the bound: a token a character)
        return
    n = min_tokens(text)
    if n >= max_model_len:
        raise PromptValidationError(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
            f"{len(text)} characters, which make at least {n} tokens, and at least one token "
            "must be generated: shorten the prompt (or raise max_model_len, --max-model-len)",
            "prompt",
        )


def fan_out(request_id: str, params: SamplingParams) -> tuple[list[str], list[SamplingParams]]:
    """The one-sample requests of a request with `params.n` samples: ids `{i}_{request_id}`,
    seeds `seed + i` (distinct but reproducible samples)."""
    if params.n == 1:
        return [request_id], [params]
    ids, plist = [], []
    for i in range(params.n):
        p = params.clone()
        p.n = 1
        if params.seed is not None:
            p.seed = params.seed + i
        ids.append(f"{i}_{request_id}")
        plist.append(p)
    return ids, plist


class InputProcessor:
    """Turns a user's prompt and sampling parameters into validated `EngineCoreRequest`s.

    `model_config` is read at each request (its max_model_len and vocab_size); the tokenizer is
    None for an engine started with skip_tokenizer_init, which then takes token ids only."""

    def __init__(self, tokenizer: Any, model_config: Any, scheduling_policy: str = "fcfs") -> None:
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.scheduling_policy = scheduling_policy

    @property
    def eos_token_id(self) -> int | None:
        return eos_token_id(self.tokenizer, self.model_config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids; a PromptValidationError, before tokenizing, for a text too long
        for the context by its length alone (`check_prompt_text`)."""
        if self.tokenizer is None:
            raise ValueError("the engine runs with skip_tokenizer_init: give prompt token ids")
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {type(text).__name__}")
        check_prompt_text(self.tokenizer, text, self.model_config.max_model_len)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def process_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(the prompt's text if it has one, its token ids)."""
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"a prompt dict's 'prompt' must be a string, got {text!r:.40}")
                return text, token_id_list(prompt["prompt_token_ids"], "prompt_token_ids")
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs a 'prompt' string or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, token_id_list(prompt, "prompt")
        raise ValueError(
            f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def tokenize_bad_words(self, params: SamplingParams) -> None:
        """Fill `params.bad_words_token_ids` (`SamplingParams.update_from_tokenizer`), once per
        request, so that the engine core and its workers get token ids only (and only those of
        `bad_words`)."""
        if not params.bad_words:
            params._bad_words_token_ids = None
            return
        if self.tokenizer is None:
            # (vLLM ignores them then; a ban that silently does nothing is refused here.)
            raise PromptValidationError(
                "bad_words need the tokenizer: the engine runs with skip_tokenizer_init",
                "bad_words",
            )
        try:
            params.update_from_tokenizer(self.tokenizer)
        except ValueError as e:
            raise PromptValidationError(str(e), "bad_words") from None

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
    ) -> tuple[str | None, list[int], list[EngineCoreRequest]]:
        """(prompt text, prompt token ids, the core requests: one per sample)."""
        if priority != 0 and self.scheduling_policy != "priority":
            # As vLLM: a priority the scheduler would ignore is an error, not a silent no-op.
            raise PromptValidationError(
                f"priority {priority} needs --scheduling-policy priority "
                f"(this server schedules {self.scheduling_policy})",
                "priority",
            )
        prompt_text, prompt_ids = self.process_prompt(prompt)
        self.tokenize_bad_words(params)
        mc = self.model_config
        max_tokens = validate_request(prompt_ids, params, mc.max_model_len, mc.vocab_size)
        if params.structured_outputs is not None:  # what needs no grammar compiler to refuse
            check_constraint(params.structured_outputs)
        eos = self.eos_token_id
        params.all_stop_token_ids = set(params.stop_token_ids or [])
        if eos is not None:
            params.all_stop_token_ids.add(eos)
        child_ids, child_params = fan_out(request_id, params)
        requests = [
            EngineCoreRequest(cid, prompt_ids, p, arrival_time, eos, max_tokens, priority)
            for cid, p in zip(child_ids, child_params)
        ]
        return prompt_text, prompt_ids, requests


def eos_token_id(tokenizer: Any, model_config: Any) -> int | None:
    """The tokenizer's EOS, else the model config's (the first, where it lists several)."""
    if tokenizer is not None:
        return tokenizer.eos_token_id
    hf = getattr(model_config, "hf_config", None) or {}
    eos = hf.get("eos_token_id")
    return eos[0] if isinstance(eos, list) else eos
