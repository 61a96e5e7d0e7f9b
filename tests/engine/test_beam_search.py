"""`LLM.beam_search` (vLLM's API, `pagoda.beam_search`): the search itself against an exhaustive
one on a toy model whose next-token log probabilities are a table, and on the embedded model
against greedy decoding and its own scores."""

from __future__ import annotations

import itertools
import math
import random
from types import SimpleNamespace

import pytest

from pagoda.beam_search import BeamSearchSequence, beam_search, get_beam_search_score
from pagoda.outputs import Logprob
from pagoda.sampling_params import BeamSearchParams

VOCAB, EOS = 5, 4


class _Toy:
    """Next-token log probabilities that depend on the last two tokens, from a seeded table:
    the `generate` of a model with 5 tokens (4 is EOS), counting the calls."""

    def __init__(self, seed: int):
        rng = random.Random(seed)
        self.table = {}
        for a, b in itertools.product(range(-1, VOCAB), repeat=2):
            w = [rng.random() ** 3 for _ in range(VOCAB)]
            self.table[a, b] = [math.log(x / sum(w)) for x in w]
        self.calls = 0
        self.tokenizer = SimpleNamespace(
            eos_token_id=EOS,
            decode=lambda ids, skip_special_tokens=True: " ".join(map(str, ids)),
        )

    def next_logprobs(self, tokens: list[int]) -> list[float]:
        a, b = ([-1, -1] + tokens)[-2:]
        return self.table[a, b]

    def generate(self, prompts, sp):
        self.calls += 1
        outs = []
        for p in prompts:
            lps = self.next_logprobs(p["prompt_token_ids"])
            top = sorted(range(VOCAB), key=lambda t: -lps[t])[: sp.logprobs]
            step = {t: Logprob(lps[t], rank=r + 1) for r, t in enumerate(top)}
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(logprobs=[step])]))
        return outs


def _exhaustive(toy: _Toy, prompt: list[int], max_tokens: int, length_penalty: float):
    """Every continuation (ended at EOS or at max_tokens), best score first."""
    found = []

    def walk(tokens: list[int], cum: float, left: int) -> None:
        if left == 0:
            found.append((tokens, cum))
            return
        lps = toy.next_logprobs(tokens)
        for t in range(VOCAB):
            if t == EOS:
                found.append((tokens + [t], cum + lps[t]))
            else:
                walk(tokens + [t], cum + lps[t], left - 1)

    walk(list(prompt), 0.0, max_tokens)
    return sorted(found, key=lambda f: -get_beam_search_score(f[0], f[1], EOS, length_penalty))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("length_penalty", [1.0, 0.0, 2.0])
def test_a_beam_that_prunes_nothing_returns_the_exhaustive_search_best(seed, length_penalty):
    # Two new tokens: the first step leaves 4 live beams (EOS ends the fifth), fewer than 10,
    # so nothing is pruned before the last step, whose candidates are final: the 10 returned
    # are the exhaustive search's 10 best.
    toy = _Toy(seed)
    prompt = [1, 2]
    wide = BeamSearchParams(beam_width=10, max_tokens=2, length_penalty=length_penalty)
    got = beam_search([prompt], wide, toy.generate, toy.tokenizer, 100)[0]
    want = _exhaustive(toy, prompt, 2, length_penalty)
    assert [s.tokens for s in got.sequences] == [w[0] for w in want[:10]]
    # A narrow beam over more tokens: ordered by score, no better than the exhaustive best,
    # each sequence's cumulative log probability the sum of its chosen tokens'.
    narrow = BeamSearchParams(beam_width=3, max_tokens=4, length_penalty=length_penalty)
    seqs = beam_search([prompt], narrow, toy.generate, toy.tokenizer, 100)[0].sequences
    scores = [get_beam_search_score(s.tokens, s.cum_logprob, EOS, length_penalty) for s in seqs]
    assert len(seqs) == 3 and scores == sorted(scores, reverse=True)
    assert scores[0] <= get_beam_search_score(*_exhaustive(toy, prompt, 4, length_penalty)[0],
                                              EOS, length_penalty) + 1e-12  # fmt: skip
    for s in seqs:
        lp = sum(step[t].logprob for step, t in zip(s.logprobs, s.tokens[len(prompt) :]))
        assert s.cum_logprob == pytest.approx(lp)
        assert s.finish_reason == ("stop" if s.tokens[-1] == EOS else "length")
        assert s.text == " ".join(map(str, s.tokens))


def test_width_one_is_greedy_and_stops_at_eos() -> None:
    toy = _Toy(7)
    prompt = [0, 3]
    got = beam_search([prompt], BeamSearchParams(1, 6), toy.generate, toy.tokenizer, 100)[
        0
    ].sequences
    greedy = list(prompt)
    for _ in range(6):
        lps = toy.next_logprobs(greedy)
        greedy.append(max(range(VOCAB), key=lambda t: lps[t]))
        if greedy[-1] == EOS:
            break
    assert got[0].tokens == greedy


def test_several_prompts_one_engine_call_a_step_and_beams_end_at_the_context() -> None:
    toy = _Toy(3)
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    outs = beam_search([[0], [1, 1], [2, 3]], params, toy.generate, toy.tokenizer, 100)
    assert len(outs) == 3 and toy.calls == 4  # one call a step for all prompts' beams
    assert all(len(s.tokens) == len(p) + 4 for o, p in zip(outs, [[0], [1, 1], [2, 3]])
               for s in o.sequences)  # fmt: skip
    # ignore_eos: EOS is a token like any other
    short = beam_search(
        [[0, 1]], BeamSearchParams(2, 10, ignore_eos=True), toy.generate, toy.tokenizer, 4
    )
    assert all(len(s.tokens) == 4 and s.finish_reason == "length" for s in short[0].sequences)
    with pytest.raises(ValueError, match="no room for one more"):
        beam_search([[0, 1, 2, 3]], params, toy.generate, toy.tokenizer, 4)


def test_bad_params_and_prompts_are_refused() -> None:
    for bad in ({"beam_width": 0}, {"beam_width": 11}, {"beam_width": 2.0}, {"max_tokens": 0},
                {"temperature": -1.0}, {"temperature": float("nan")},
                {"length_penalty": float("inf")}):  # fmt: skip
        with pytest.raises(ValueError):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})
    toy = _Toy(0)
    with pytest.raises(TypeError, match="BeamSearchParams"):
        beam_search([[1]], {"beam_width": 2}, toy.generate, toy.tokenizer, 100)
    with pytest.raises(ValueError, match="prompt"):
        beam_search([[]], BeamSearchParams(2, 2), toy.generate, toy.tokenizer, 100)


def test_score_is_vllms() -> None:
    seq = BeamSearchSequence(tokens=[1, 2, 3, EOS], cum_logprob=-6.0)
    assert get_beam_search_score(seq.tokens, seq.cum_logprob, EOS, 1.0) == -2.0  # EOS not counted
    assert get_beam_search_score([1, 2], -6.0, EOS, 2.0) == -1.5
    assert get_beam_search_score([1, 2], -6.0, EOS, 0.0) == -6.0
    assert get_beam_search_score([1, 2], -6.0, EOS, 1e300) == 0.0  # no OverflowError


@pytest.fixture(scope="module")
def llm():
    from pagoda import LLM

    return LLM(dtype="float32", seed=0, max_model_len=256)


def test_on_the_embedded_model(llm) -> None:
    from pagoda import SamplingParams

    prompt = "The capital of France is"
    out = llm.beam_search([{"prompt": prompt}], BeamSearchParams(beam_width=3, max_tokens=8))
    seqs = out[0].sequences
    assert len(seqs) == 3 and len({tuple(s.tokens) for s in seqs}) == 3
    assert all(s.text.startswith(prompt) for s in seqs)
    scores = [get_beam_search_score(s.tokens, s.cum_logprob, llm.get_tokenizer().eos_token_id, 1)
              for s in seqs]  # fmt: skip
    assert scores == sorted(scores, reverse=True)
    # Width 1 is greedy decoding, token for token (8 tokens past a clear-cut prompt).
    one = llm.beam_search([prompt], BeamSearchParams(beam_width=1, max_tokens=8))[0].sequences[0]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert one.tokens == list(greedy[0].prompt_token_ids) + list(greedy[0].outputs[0].token_ids)
    with pytest.raises(ValueError, match="prompt"):  # parsed as generate parses prompts
        llm.beam_search([{"text": "x"}], BeamSearchParams(2, 2))
    with pytest.raises(ValueError, match="lora_request"):
        llm.beam_search([prompt], BeamSearchParams(2, 2), lora_request=object())
    two = llm.beam_search(["a", "b", "c"], BeamSearchParams(2, 2), concurrency_limit=2)
    assert len(two) == 3
