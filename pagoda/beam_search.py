"""Beam search over the engine, as vLLM's `LLM.beam_search` does it: each step asks the engine
for one token of every live beam with its 2 x beam_width most likely next tokens (the prefix
cache makes the beam's re-sent prompt cost one token of compute), extends each beam by each
of them, and keeps the beam_width best by cumulative log probability divided by the length to
the power `length_penalty` (Hugging Face's score); a beam that emits EOS is finished. At the
end the finished and live beams compete together and the best beam_width are returned, best
score first. The scores count the prompt's tokens in the length, as vLLM's do."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagoda.outputs import Logprob
from pagoda.sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (the prompt's first), the candidates' log probabilities at each
    new position, their sum for the chosen tokens, and its text once returned (the whole
    sequence decoded, prompt included, as vLLM returns it)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(
    tokens: list[int], cumulative_logprob: float, eos_token_id: int | None, length_penalty: float
) -> float:
    """cumulative_logprob / length ** length_penalty, the length without a final EOS."""
    seq_len = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    try:
        return cumulative_logprob / (max(seq_len, 1) ** length_penalty)
    except OverflowError:  # a huge penalty: every long sequence scores 0
        return cumulative_logprob * 0.0


def sort_beams_key(
    eos_token_id: int | None, length_penalty: float
) -> Callable[[BeamSearchSequence], float]:
    return lambda b: get_beam_search_score(b.tokens, b.cum_logprob, eos_token_id, length_penalty)


class BeamSearch:
    """The search over one batch of prompts, one step at a time: `step_prompts()` are the live
    beams' tokens to ask the engine one token for (`step_params`), `advance()` takes each
    one's candidates ({token: Logprob}, the engine's first position), `results()` the end.
    `LLM.beam_search` drives it with `generate`, the server with its async engine."""

    def __init__(
        self, prompts: list[list[int]], params: BeamSearchParams, eos: int | None,
        max_model_len: int,
    ) -> None:  # fmt: skip
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        for i, tokens in enumerate(prompts):
            if not tokens:
                raise ValueError(f"prompt {i} is empty")
            if len(tokens) >= max_model_len:
                raise ValueError(
                    f"prompt {i} has {len(tokens)} tokens: no room for one more within "
                    f"max_model_len={max_model_len}"
                )
        self.params, self.eos, self.max_model_len = params, eos, max_model_len
        self.key = sort_beams_key(eos, params.length_penalty)
        self.live = [[BeamSearchSequence(tokens=list(t))] for t in prompts]
        self.done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0
        self.step_params = SamplingParams(
            n=1,
            max_tokens=1,
            temperature=params.temperature,
            logprobs=2 * params.beam_width,
            ignore_eos=True,  # EOS is a candidate like any other; the search ends its beam
            detokenize=False,
        )

    def step_prompts(self) -> list[list[int]]:
        """The tokens of every live beam, prompt by prompt; empty when the search is over."""
        if self.steps >= self.params.max_tokens:
            return []
        for i, instance in enumerate(self.live):  # beams at the context's end are finished
            full = [b for b in instance if len(b.tokens) >= self.max_model_len]
            for beam in full:
                beam.finish_reason = "length"
            self.done[i].extend(full)
            self.live[i] = [b for b in instance if len(b.tokens) < self.max_model_len]
        return [b.tokens for b in itertools.chain.from_iterable(self.live)]

    def advance(self, steps: list[dict[int, Logprob]]) -> None:
        """Each live beam (in `step_prompts` order) extended by each of its candidates; the
        beam_width best kept."""
        self.steps += 1
        at = 0
        for i, instance in enumerate(self.live):
            candidates = []
            for beam, step in zip(instance, steps[at : at + len(instance)]):
                for token, lp in step.items():
                    new = BeamSearchSequence(
                        tokens=beam.tokens + [token],
                        logprobs=beam.logprobs + [step],
                        cum_logprob=beam.cum_logprob + lp.logprob,
                    )
                    if token == self.eos and not self.params.ignore_eos:
                        new.finish_reason = "stop"
                        self.done[i].append(new)
                    else:
                        candidates.append(new)
            at += len(instance)
            self.live[i] = sorted(candidates, key=self.key, reverse=True)[: self.params.beam_width]

    def results(self) -> list[BeamSearchOutput]:
        """Each prompt's best beam_width sequences, best first (their text not set)."""
        outputs = []
        for finished, remaining in zip(self.done, self.live):
            for beam in remaining:
                beam.finish_reason = "length"
            best = sorted(finished + remaining, key=self.key, reverse=True)
            outputs.append(BeamSearchOutput(sequences=best[: self.params.beam_width]))
        return outputs


def beam_search(
    prompts: list[list[int]],
    params: BeamSearchParams,
    generate: Callable[[list[dict[str, list[int]]], SamplingParams], list[Any]],
    tokenizer: Any,
    max_model_len: int,
) -> list[BeamSearchOutput]:
    """The beams of each prompt (token ids); `generate(token prompts, params)` runs one engine
    call. A beam that fills the context ends there (finish_reason "length"). Each returned
    sequence's text is its tokens decoded, prompt included, as vLLM returns it."""
    search = BeamSearch(prompts, params, tokenizer.eos_token_id, max_model_len)
    while batch := search.step_prompts():
        outputs = generate([{"prompt_token_ids": t} for t in batch], search.step_params)
        search.advance([out.outputs[0].logprobs[0] for out in outputs])
    results = search.results()
    for out in results:
        for beam in out.sequences:
            beam.text = tokenizer.decode(
                beam.tokens, skip_special_tokens=params.skip_special_tokens
            )
    return results
