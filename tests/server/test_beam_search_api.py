"""vLLM's `use_beam_search` on a real server (the embedded model) through the `openai` client:
`n` beams as the choices of a completion and of a chat completion, best first, the same
search `LLM.beam_search` runs offline; the refusals name their field."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "reliability"))
from servers import KEY, real_server  # noqa: E402

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = real_server(tmp_path_factory.mktemp("beam") / "server.log", "--max-model-len", "256")
    s.wait_ready()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)


def _beam(**kw):
    return {"extra_body": {"use_beam_search": True, **kw.pop("extra", {})}, **kw}


def test_completion_beams_are_the_choices_best_first(client) -> None:
    r = client.completions.create(
        model="smol", prompt=PROMPT, max_tokens=8, n=3, temperature=0, logprobs=1, **_beam()
    )
    texts = [c.text for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 3
    for c in r.choices:
        assert c.finish_reason in ("stop", "length")
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) <= 8
        assert "".join(c.logprobs.tokens) == c.text  # the EOS that ended a beam left out
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    # The search LLM.beam_search runs: with width 1 it is greedy decoding.
    one = client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, n=1,
                                    temperature=0, **_beam())  # fmt: skip
    greedy = client.completions.create(model="smol", prompt=PROMPT, max_tokens=8, temperature=0)
    assert one.choices[0].text == greedy.choices[0].text
    # Two prompts at once: n choices each, numbered prompt by prompt.
    two = client.completions.create(model="smol", prompt=[PROMPT, "Once upon a time"],
                                    max_tokens=4, n=2, temperature=0, **_beam())  # fmt: skip
    assert [c.index for c in two.choices] == [0, 1, 2, 3]


def test_chat_beams(client) -> None:
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=16, n=2, temperature=0, **_beam(),
    )  # fmt: skip
    assert len(r.choices) == 2 and all(c.message.content for c in r.choices)
    assert r.choices[0].message.content != r.choices[1].message.content


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"stream": True}, "stream"),
        ({"n": 11}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_what_beam_search_cannot_take_is_a_400(client, kw, param) -> None:
    args = {"model": "smol", "prompt": PROMPT, "max_tokens": 4, "n": 2, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**_beam(**args))
    assert e.value.body["param"] == param, e.value.body
    assert client.completions.create(model="smol", prompt=PROMPT, max_tokens=2).choices  # alive


def test_a_length_penalty_that_is_not_a_number_is_a_400(server, client) -> None:
    import httpx

    body = ('{"model": "smol", "prompt": "x", "max_tokens": 2, "n": 2, "use_beam_search": true,'
            ' "length_penalty": Infinity}')  # fmt: skip
    r = httpx.post(server.url + "/v1/completions", content=body, headers=server.headers
                   | {"content-type": "application/json"}, timeout=60)  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty", r.text
    # A huge one is a number: long beams score 0, nothing overflows.
    huge = client.completions.create(model="smol", prompt=PROMPT, max_tokens=3, n=2,
                                     **_beam(extra={"length_penalty": 1e300}))  # fmt: skip
    assert len(huge.choices) == 2
