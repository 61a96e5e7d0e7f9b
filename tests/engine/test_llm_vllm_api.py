"""`LLM` takes the calls that code written for vLLM makes: vLLM's arguments at their defaults,
continue_final_message, a tqdm factory, reset_prefix_cache, default sampling parameters from
generation_config.json, and a clear error for what Pagoda does not do."""

from __future__ import annotations

import dataclasses
import json

import pytest
from tqdm import tqdm

from pagoda import LLM, SamplingParams

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


@pytest.mark.parametrize(
    "name, match",
    [
        ("beam_search", "samples"),
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
