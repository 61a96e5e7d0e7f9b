"""`LLM` takes the calls that code written for vLLM makes: vLLM's arguments at their defaults,
continue_final_message, a tqdm factory, reset_prefix_cache, default sampling parameters from
generation_config.json, vLLM's prompt types, priority and tokenization_kwargs, the attributes
vLLM code reads, and a clear error for what Pagoda does not do."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tqdm import tqdm

from pagoda import LLM, SamplingParams, TextPrompt, TokensPrompt

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=512, seed=0)


def test_vllms_default_arguments_are_accepted(llm: LLM) -> None:
    plain = llm.generate("Hi", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(
        ["Hi", "Hi"],
        GREEDY,
        use_tqdm=False,
        lora_request=[None, None],
        prompt_adapter_request=None,
        guided_options_request=None,
    )
    assert [o.outputs[0].token_ids for o in outs] == [plain, plain]
    chat = llm.chat(CHAT, GREEDY, False, None, chat_template_content_format="string")[0]
    assert (
        chat.outputs[0].token_ids == llm.chat(CHAT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    )
    out = llm.chat(CHAT, GREEDY, use_tqdm=False, lora_request=None, mm_processor_kwargs=None)
    assert out[0].outputs[0].token_ids


def test_stop_token_ids_from_the_tokenizer_stop_generation(llm: LLM) -> None:
    comma = llm.get_tokenizer().convert_tokens_to_ids(",")
    params = SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=[comma])
    out = llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == comma == out.token_ids[-1]


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.generate("Hi", GREEDY, lora_request=object()), "lora_request .*LoRA"),
        (lambda m: m.generate("Hi", GREEDY, prompt_adapter_request=1), "prompt_adapter_request"),
        (lambda m: m.generate("Hi", GREEDY, guided_options_request={}), "structured_outputs"),
        (lambda m: m.chat(CHAT, GREEDY, lora_request=object()), "lora_request"),
        (lambda m: m.chat(CHAT, GREEDY, mm_processor_kwargs={"a": 1}), "text-only"),
        (lambda m: m.chat(CHAT, GREEDY, chat_template_content_format="openai"), "as a string"),
        (lambda m: LLM(enable_lora=True), "enable_lora=True is not supported: .*LoRA"),
        (lambda m: LLM(task="embed"), "task='embed' is not supported: .*generative"),
    ],
)
def test_vllm_arguments_pagoda_lacks_are_refused_by_name(llm: LLM, call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call(llm)


def test_chat_continues_the_final_message(llm: LLM) -> None:
    msgs = [*CHAT, {"role": "assistant", "content": "The capital of France is"}]
    out = llm.chat(
        msgs, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=True
    )[0]
    assert out.prompt.endswith("<|im_start|>assistant\nThe capital of France is")
    kwargs = {"add_generation_prompt": False, "continue_final_message": True}
    again = llm.chat(msgs, GREEDY, use_tqdm=False, chat_template_kwargs=kwargs)[0]
    assert again.prompt == out.prompt and again.outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(msgs, GREEDY, use_tqdm=False, continue_final_message=True)


def test_use_tqdm_takes_a_progress_bar_factory(llm: LLM) -> None:
    made = []

    def factory(*args, **kwargs):
        made.append(kwargs)
        return tqdm(*args, **kwargs, disable=True)

    llm.generate(["Hi", "Hello"], GREEDY, use_tqdm=factory)
    assert [m["total"] for m in made] == [2]


def test_reset_prefix_cache_forgets_cached_prefixes(llm: LLM) -> None:
    prompt = {"prompt_token_ids": list(range(1000, 1100))}
    llm.generate(prompt, GREEDY, use_tqdm=False)
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens >= 96
    assert llm.reset_prefix_cache() is True
    assert llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens == 0


def test_default_sampling_params_come_from_generation_config(llm: LLM, tmp_path, monkeypatch):
    defaults = llm.get_default_sampling_params()  # a GGUF file: SamplingParams' own defaults
    assert (defaults.temperature, defaults.top_p, defaults.max_tokens) == (1.0, 1.0, 16)
    config = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 1, "bos_token_id": 1}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    model_config = dataclasses.replace(llm.llm_engine.model_config, model=str(tmp_path))
    monkeypatch.setattr(llm.llm_engine, "model_config", model_config)
    monkeypatch.setattr(llm, "_default_sampling_params", None)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 20, 1)
    assert len(llm.generate("Tell me a long story.", use_tqdm=False)[0].outputs[0].token_ids) == 1
    assert len(llm.chat(CHAT, use_tqdm=False)[0].outputs[0].token_ids) == 1


def test_a_bad_generation_config_fails_before_the_model_loads(tmp_path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 5}))
    # No config.json or weights either: the generation config is read first, and named.
    with pytest.raises(ValueError, match=r"generation_config.json: top_p must be"):
        LLM(model=str(tmp_path))
    with pytest.raises(ValueError, match="no config.json in"):  # ignored: the model is next
        LLM(model=str(tmp_path), generation_config="vllm")


@pytest.mark.parametrize(
    "name, match",
    [
        ("encode", "generative models only"),
        ("embed", "generative models only"),
        ("classify", "generative models only"),
        ("score", "generative models only"),
        ("start_profile", "torch.profiler"),
        ("stop_profile", "start_profile"),
        ("get_metrics", "/metrics"),
    ],
)
def test_vllm_methods_pagoda_lacks_say_what_it_offers(llm: LLM, name, match) -> None:
    with pytest.raises(
        NotImplementedError, match=f"LLM.{name}.. is not implemented by Pagoda: .*{match}"
    ):
        getattr(llm, name)()


def test_vllm_prompt_types_priority_and_empty_chat(llm: LLM) -> None:
    # `from vllm import TokensPrompt` has a Pagoda twin; priority may be one int for all
    # prompts (vLLM 0.32; it was a TypeError), chat takes priority too, and an empty list of
    # conversations gives no outputs, as generate([]) does.
    ids = llm.get_tokenizer().encode("Hi there")
    by_ids = llm.generate(TokensPrompt(prompt_token_ids=ids), GREEDY, use_tqdm=False)[0]
    by_text = llm.generate(TextPrompt(prompt="Hi there"), GREEDY, use_tqdm=False, priority=0)
    assert by_ids.prompt is None and by_text[0].prompt == "Hi there"
    assert by_ids.prompt_token_ids == by_text[0].prompt_token_ids == ids
    assert by_ids.outputs[0].token_ids == by_text[0].outputs[0].token_ids
    assert len(llm.generate(["Hi", "Hello"], GREEDY, use_tqdm=False, priority=0)) == 2
    assert len(llm.chat(CHAT, GREEDY, use_tqdm=False, priority=[0])) == 1
    assert llm.chat([], GREEDY, use_tqdm=False) == []


def test_tokenization_kwargs_truncate_the_prompt(llm: LLM) -> None:
    # vLLM's tokenization_kwargs: truncation keeps the last max_length tokens (vLLM's left
    # side for generation), truncate_prompt_tokens the same; chat tokenizes without special
    # tokens (the template has them). It was a TypeError.
    text = "The capital of France is Paris, and the capital of Spain is"
    ids = llm.get_tokenizer().encode(text)
    for kwargs, kept in [
        ({"truncation": True, "max_length": 3}, ids[-3:]),
        ({"truncate_prompt_tokens": 4}, ids[-4:]),
        ({"truncate_prompt_tokens": 2, "truncation_side": "right"}, ids[:2]),
        ({"add_special_tokens": True}, ids),
    ]:
        out = llm.generate(text, GREEDY, use_tqdm=False, tokenization_kwargs=kwargs)[0]
        assert out.prompt == text and out.prompt_token_ids == kept, kwargs
    ids_only = llm.generate(
        {"prompt_token_ids": ids},
        GREEDY,
        use_tqdm=False,
        tokenization_kwargs={"truncation": True, "max_length": 2},
    )[0]
    assert ids_only.prompt_token_ids == ids[-2:]
    whole = llm.chat(CHAT, GREEDY, use_tqdm=False)[0].prompt_token_ids
    cut = llm.chat(CHAT, GREEDY, use_tqdm=False, tokenization_kwargs={"truncate_prompt_tokens": 5})
    assert cut[0].prompt_token_ids == whole[-5:]


def test_min_tokens_holds_off_stop_strings(llm: LLM) -> None:
    # vLLM looks for stop strings only past the first min_tokens tokens; Pagoda stopped at a
    # stop string inside them, returning fewer tokens than min_tokens with no stop token seen.
    prompt = "The capital of France is"
    base = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
    tok = llm.get_tokenizer()
    stop = tok.decode(base[0].outputs[0].token_ids[1:2]).strip()
    assert stop
    early = SamplingParams(temperature=0.0, max_tokens=12, stop=[stop])
    late = SamplingParams(temperature=0.0, max_tokens=12, stop=[stop], min_tokens=8)
    first, held = (llm.generate(prompt, p, use_tqdm=False)[0].outputs[0] for p in (early, late))
    assert first.stop_reason == stop and len(first.token_ids) < 8
    assert len(held.token_ids) >= 8 and stop in held.text[: len(first.text) + len(stop)]


def test_attributes_vllm_code_reads(llm: LLM) -> None:
    # llm.model_config, llm.llm_engine.get_tokenizer(), hf_config.<key> and get_vocab_size()
    # as vLLM has them (AttributeError before), and vLLM's always-None output fields.
    mc = llm.model_config
    assert mc is llm.llm_engine.model_config and mc.max_model_len == 512
    assert llm.llm_engine.get_tokenizer() is llm.get_tokenizer()
    assert mc.hf_config.vocab_size == mc.get_vocab_size() == mc.hf_config["vocab_size"]
    assert mc.get_hidden_size() == mc.hf_config.hidden_size
    out = llm.generate("Hi", GREEDY, use_tqdm=False)[0]
    assert out.lora_request is None and out.encoder_prompt_token_ids is None
    assert out.kv_transfer_params is None and out.outputs[0].lora_request is None
    assert llm.llm_engine.reset_prefix_cache() is True
