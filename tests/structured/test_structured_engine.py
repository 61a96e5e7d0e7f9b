"""Structured outputs on the embedded model, offline: every output matches its constraint
(greedy and seeded sampling, n > 1), masked tokens have -inf logprobs, free requests in the
same batch are untouched, and preemption, async scheduling and n-gram drafts keep outputs valid."""

from __future__ import annotations

import json
import re

import pytest

from pagoda import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PROMPT = [{"role": "user", "content": "Describe a person as JSON."}]


def check_schema(text: str) -> None:
    obj = json.loads(text)
    try:
        import jsonschema
    except ImportError:  # by hand
        assert set(obj) == set(SCHEMA["required"])
        assert isinstance(obj["name"], str) and len(obj["name"]) <= 16
        assert isinstance(obj["age"], int) and 18 <= obj["age"] <= 99
        assert obj["color"] in ("red", "green", "blue")
        assert isinstance(obj["tags"], list) and all(isinstance(t, str) for t in obj["tags"])
        return
    jsonschema.validate(obj, SCHEMA)


def so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=512, seed=0)


def test_json_schema_greedy_and_sampled(llm):
    params = [
        SamplingParams(temperature=0, max_tokens=150, structured_outputs=so(json=SCHEMA)),
        SamplingParams(
            temperature=1.0, seed=7, n=3, max_tokens=150, structured_outputs=so(json=SCHEMA)
        ),
    ]
    outs = llm.chat([PROMPT, PROMPT], params, use_tqdm=False)
    completions = outs[0].outputs + outs[1].outputs
    assert len(completions) == 4
    for c in completions:
        assert c.finish_reason == "stop", c.text
        check_schema(c.text)
    # The same seed gives the same samples (json, as a string schema, hits the same grammar).
    again = llm.chat(
        PROMPT,
        SamplingParams(
            temperature=1.0,
            seed=7,
            n=3,
            max_tokens=150,
            structured_outputs=so(json=json.dumps(SCHEMA)),
        ),
        use_tqdm=False,
    )
    assert [c.text for c in again[0].outputs] == [c.text for c in outs[1].outputs]


def test_choice_regex_json_object(llm):
    choices = ["Paris", "London", "Tokyo"]
    outs = llm.generate(
        ["The capital of France is", "Call me at", "A JSON object:", "The capital of Japan is"],
        [
            SamplingParams(temperature=0, max_tokens=10, structured_outputs=so(choice=choices)),
            SamplingParams(
                temperature=0.9, seed=1, max_tokens=30, structured_outputs=so(regex=PHONE)
            ),
            SamplingParams(temperature=0, max_tokens=100, structured_outputs=so(json_object=True)),
            SamplingParams(
                temperature=1.0, seed=3, max_tokens=10, structured_outputs=so(choice=choices)
            ),
        ],
        use_tqdm=False,
    )
    assert outs[0].outputs[0].text in choices and outs[3].outputs[0].text in choices
    assert re.fullmatch(PHONE, outs[1].outputs[0].text)
    obj = outs[2].outputs[0]
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict)


def test_masked_tokens_have_no_probability(llm):
    from pagoda.structured_output.vocab import token_bytes

    choices = ["yes", "no"]
    out = llm.generate(
        "Is the sky blue? Answer:",
        SamplingParams(
            temperature=0, max_tokens=5, logprobs=20, structured_outputs=so(choice=choices)
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text in choices
    vocab = token_bytes(llm.get_tokenizer(), llm.llm_engine.model_config.vocab_size)
    first = out.logprobs[0]
    # Allowed first tokens spell a non-empty prefix of a choice; every other token is -inf.
    allowed = [t for t, lp in first.items() if lp.logprob > float("-inf")]
    assert out.token_ids[0] in allowed
    assert any(first[t].logprob == float("-inf") for t in first)  # the top 20 hold masked ones
    for t in allowed:
        assert vocab[t] and any(c.encode().startswith(vocab[t]) for c in choices), vocab[t]
    # Each chosen token was allowed at its step.
    for step, t in zip(out.logprobs, out.token_ids):
        assert step[t].logprob > float("-inf")


def test_free_requests_unchanged_in_a_mixed_batch(llm):
    free = ["Explain paged attention.", "Write a haiku about tea."]
    greedy = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(free, greedy, use_tqdm=False)]
    structured = SamplingParams(temperature=0, max_tokens=60, structured_outputs=so(json=SCHEMA))
    mixed = llm.generate(
        [free[0], "Make a person:", free[1], "Another person:"],
        [greedy, structured, greedy, structured],
        use_tqdm=False,
    )
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone


def test_a_grammar_compiled_in_a_worker_process_decodes_as_one_compiled_here(llm, monkeypatch):
    """The serving loop compiles a constraint in a worker process it can kill, and reads the
    grammar back (`compile_pool.py`); offline, the engine compiles it itself. Greedy outputs
    under a JSON schema are the same, and the worker is gone when the served engine stops."""
    import asyncio
    import multiprocessing

    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.sampling_params import RequestOutputKind

    params = SamplingParams(
        temperature=0,
        max_tokens=80,
        output_kind=RequestOutputKind.FINAL_ONLY,
        structured_outputs=so(json=SCHEMA),
    )
    prompt = "A person, as JSON:"
    offline = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    manager = llm.llm_engine.structured_output
    backend = manager.backend
    monkeypatch.setattr(backend, "_compiled", type(backend._compiled)())  # compile anew
    from_worker: list = []
    put = manager.put_compiled
    monkeypatch.setattr(
        manager, "put_compiled", lambda p, c: (from_worker.append(c), put(p, c))[-1]
    )

    async def serve(engine: AsyncLLM) -> list:
        return [o async for o in engine.generate(prompt, params, "served")]

    engine = AsyncLLM(llm.llm_engine)  # the serving loop, on a thread
    try:
        served = asyncio.run(serve(engine))[-1].outputs[0]
    finally:
        engine.shutdown()
    assert len(from_worker) == 1
    check_schema(offline.text)
    assert served.token_ids == offline.token_ids and served.text == offline.text
    assert not [p for p in multiprocessing.active_children() if "grammar" in p.name]


def test_invalid_constraints_raise_at_add_request(llm):
    for bad in (
        so(regex="(abc"),
        so(json={"type": "nonsense"}),
        so(json="{not json"),
        so(grammar="root ::= undefined_rule"),
    ):
        with pytest.raises(ValueError, match="invalid structured_outputs"):
            llm.generate("x", SamplingParams(structured_outputs=bad), use_tqdm=False)
    # The engine keeps serving.
    out = llm.generate(
        "x", SamplingParams(max_tokens=8, structured_outputs=so(choice=["a"])), use_tqdm=False
    )
    assert out[0].outputs[0].text == "a"


def test_grammar_constraint(llm):
    grammar = 'root ::= "The answer is " [0-9] [0-9]? "."'
    out = llm.generate(
        "What is 6 times 7?",
        SamplingParams(temperature=0, max_tokens=20, structured_outputs=so(grammar=grammar)),
        use_tqdm=False,
    )[0].outputs[0]
    assert re.fullmatch(r"The answer is \d\d?\.", out.text)


def test_preemption_async_scheduling_and_drafts_keep_outputs_valid():
    # 8 blocks of 16 tokens for 4 requests of ~100 tokens: they preempt each other; the
    # scheduler runs ahead (async) whenever no structured request is running; n-gram drafts
    # are proposed for the free ones only.
    tiny = LLM(
        dtype="float32",
        max_model_len=160,
        num_gpu_blocks_override=14,
        seed=0,
        async_scheduling=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    structured = SamplingParams(
        temperature=0.7, seed=5, max_tokens=110, structured_outputs=so(json=SCHEMA)
    )
    free = SamplingParams(temperature=0, max_tokens=110, ignore_eos=True)
    outs = tiny.generate(
        ["Person one:", "Count: 1 2 3 4 5", "Person two:", "Count: 1 2 3"],
        [structured, free, structured, free],
        use_tqdm=False,
    )
    assert tiny.llm_engine.num_preemptions_total > 0
    for o in (outs[0], outs[2]):
        check_schema(o.outputs[0].text)
    assert all(len(o.outputs[0].token_ids) == 110 for o in (outs[1], outs[3]))
