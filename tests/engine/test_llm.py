"""End-to-end behaviour of `LLM` / `LLMEngine` on the embedded model (real weights, fp32)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import RequestOutputKind

PROMPTS = [
    "The capital of France is",
    "你是一个AI助手。请回答：什么是机器学习？",
    "def fibonacci(n):",
    "Explain paged attention in one sentence.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", max_model_len=1024, max_num_batched_tokens=512, seed=0)


def _texts(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    # Each prompt alone: the reference every batching mode must reproduce.
    return [_texts(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]


def test_generate_returns_vllm_shaped_outputs(llm: LLM) -> None:
    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8))
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    for o in outs:
        assert o.finished and o.prompt in PROMPTS and o.prompt_token_ids
        c = o.outputs[0]
        assert 1 <= len(c.token_ids) <= 8 and c.finish_reason in ("stop", "length")
        assert isinstance(c.text, str)
        assert o.metrics is not None and o.metrics.first_token_time >= o.metrics.arrival_time


def test_batching_does_not_change_greedy_outputs(llm: LLM, reference) -> None:
    assert _texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


def test_chunked_prefill_does_not_change_greedy_outputs(reference) -> None:
    small = LLM(dtype="float32", max_model_len=1024, max_num_batched_tokens=8, seed=0)
    assert _texts(small.generate(PROMPTS, GREEDY, use_tqdm=False)) == reference


def test_preemption_does_not_change_greedy_outputs(reference) -> None:
    # 6 blocks of 16 tokens cannot hold all four requests at once: some get preempted.
    tiny = LLM(dtype="float32", max_model_len=96, num_gpu_blocks_override=8, seed=0)
    finished = []  # each step's finished requests' statistics, as the metrics get them
    tiny.llm_engine.stat_logger = SimpleNamespace(
        record=lambda sched, it: finished.extend(it.finished_requests)
    )
    outs = tiny.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _texts(outs) == reference
    assert tiny.llm_engine.num_preemptions_total > 0
    # Each preemption reaches the preempted request's statistics (request_num_preemptions).
    assert len(finished) == len(PROMPTS)
    assert sum(f.num_preemptions for f in finished) == tiny.llm_engine.num_preemptions_total


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_reports_each_prompt_logprob_once(llm: LLM, async_scheduling) -> None:
    # A preempted request recomputes its prompt: its prompt logprobs must not repeat.
    params = SamplingParams(temperature=0.0, max_tokens=40, prompt_logprobs=1)
    want = llm.generate(PROMPTS, params, use_tqdm=False)
    tiny = LLM(
        dtype="float32",
        max_model_len=96,
        num_gpu_blocks_override=8,
        async_scheduling=async_scheduling,
        seed=0,
    )
    got = tiny.generate(PROMPTS, params, use_tqdm=False)
    assert tiny.llm_engine.num_preemptions_total > 0
    for g, w in zip(got, want):
        assert len(g.prompt_logprobs) == len(g.prompt_token_ids) == len(w.prompt_logprobs)
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)


def test_prefix_hit_reuses_500_tokens(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prefix = list(range(1000, 1500))  # 500 tokens
    first = llm.generate({"prompt_token_ids": prefix + [7, 8, 9]}, GREEDY, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": prefix + [10, 11]}, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens < 496
    assert second.num_cached_tokens >= 496
    assert tok is not None


def test_skip_reading_prefix_cache_gets_no_hit_but_writes_its_blocks(llm: LLM) -> None:
    kv = llm.llm_engine.scheduler.kv_cache_manager
    prompt = {"prompt_token_ids": list(range(3000, 3300))}  # 300 tokens, new to the cache
    skip = SamplingParams(temperature=0, max_tokens=8, skip_reading_prefix_cache=True)
    first = llm.generate(prompt, skip, use_tqdm=False)[0]
    hits = kv.prefix_cache_hits
    second = llm.generate(prompt, skip, use_tqdm=False)[0]  # cached now, but not read
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    assert kv.prefix_cache_hits == hits
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    # Its blocks were written: a request that reads the cache hits them.
    third = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert third.num_cached_tokens >= 288 and kv.prefix_cache_hits - hits >= 288
    assert third.outputs[0].token_ids[:8] == first.outputs[0].token_ids


def test_prefix_cache_hit_does_not_change_greedy_outputs(llm: LLM, reference) -> None:
    again = _texts(llm.generate(PROMPTS, GREEDY, use_tqdm=False))  # prompts now cached
    assert again == reference


def test_n_samples_and_seed_are_reproducible(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=8)
    a = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    b = llm.generate([PROMPTS[0], PROMPTS[1]], params, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1


def test_stop_string_truncates_text(llm: LLM, reference) -> None:
    full = llm.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = full.strip()[3:6]
    assert stop
    out = llm.generate(
        [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert stop not in out.text and full.startswith(out.text)


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_on_the_last_allowed_token_is_the_reason(llm: LLM, include) -> None:
    # The core ends the request for its length on the very token that completes the stop
    # string: the string is still the reason ("stop"), as in vLLM.
    for k in range(3, 12):
        text = llm.generate(
            [PROMPTS[2]], SamplingParams(temperature=0, max_tokens=k), use_tqdm=False
        )[0]
        text = text.outputs[0].text
        stop = text.rstrip()[-2:]
        if len(stop) == 2 and text == text.rstrip() and text.find(stop) == len(text) - 2:
            break
    else:
        pytest.skip("no output ends in a two-character string found nowhere before")
    params = SamplingParams(
        temperature=0, max_tokens=k, stop=[stop], include_stop_str_in_output=include
    )
    out = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == (text if include else text[:-2])


def test_logprobs_and_prompt_logprobs(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == len(comp.token_ids)
    for tok, lp in zip(comp.token_ids, comp.logprobs):
        assert tok in lp and lp[tok].rank == 1  # greedy picks the top token
        assert 3 <= len(lp) <= 4
    assert comp.cumulative_logprob == pytest.approx(
        sum(lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs))
    )
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    for tok, lp in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        assert tok in lp and lp[tok].logprob <= 0.0


def test_prompt_logprobs_once_with_several_samples(llm: LLM) -> None:
    # n samples of one prompt each score it: the output has the prompt's logprobs once.
    params = SamplingParams(n=2, temperature=1.0, seed=0, max_tokens=2, prompt_logprobs=1)
    out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0]
    one = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert len(out.outputs) == 2
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert [
        None if d is None else {t: lp.logprob for t, lp in d.items()} for d in out.prompt_logprobs
    ] == [
        None if d is None else {t: lp.logprob for t, lp in d.items()} for d in one.prompt_logprobs
    ]


def test_logprob_token_ids_are_log_softmax_of_the_models_logits(llm: LLM) -> None:
    import torch

    runner = llm.llm_engine.executor.model_runner
    compute = runner.model.compute_logits
    recorded: list[torch.Tensor] = []  # each step's logits, as the model computed them

    def record(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        recorded.append(logits.clone())
        return logits

    ids = [0, 28, 216, 5000, 49151]  # <|endoftext|>, ",", " ", " properly", the vocab's last
    params = SamplingParams(temperature=0, max_tokens=5, logprob_token_ids=ids)
    runner.model.compute_logits = record
    try:
        out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    finally:
        del runner.model.compute_logits
    assert params.logprobs is None  # num_logprobs comes from the ids, as vLLM
    assert len(out.logprobs) == len(out.token_ids) == len(recorded) == 5
    tokenizer = llm.get_tokenizer()
    for token, step, logits in zip(out.token_ids, out.logprobs, recorded):
        want = torch.log_softmax(logits[-1].double(), dim=-1)
        as_engine = torch.log_softmax(logits[-1].float(), dim=-1)  # the ranks' float32 ties
        assert list(step) == list(dict.fromkeys([token, *ids]))  # the sampled token, the ids
        for t, lp in step.items():
            assert lp.logprob == pytest.approx(want[t].item(), abs=1e-4)
            assert lp.rank == int((as_engine >= as_engine[t]).sum())
            assert lp.decoded_token == tokenizer.decode([t], skip_special_tokens=False)
    assert out.cumulative_logprob == pytest.approx(
        sum(step[t].logprob for t, step in zip(out.token_ids, out.logprobs))
    )


def test_logprob_token_ids_outside_the_vocabulary_are_refused(llm: LLM) -> None:
    bad = SamplingParams(max_tokens=2, logprob_token_ids=[5, 49152])  # the vocab has 49152
    with pytest.raises(ValueError, match=r"^logprob_token_ids .*49152"):
        llm.generate([PROMPTS[0]], bad, use_tqdm=False)
    assert llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_repeating_output_stops_with_finish_reason_repetition(llm: LLM) -> None:
    from pagoda import RepetitionDetectionParams
    from pagoda.repetition_detection import check_sequence_repetition

    prompt = "Count: 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,"  # greedy goes on counting, 15 a round
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=60), use_tqdm=False)
    free = free[0].outputs[0]
    rd = RepetitionDetectionParams(max_pattern_size=16, min_count=2)
    first = next(n for n in range(61) if check_sequence_repetition(free.token_ids[:n], rd))
    assert free.finish_reason == "length" and first <= 45
    params = SamplingParams(temperature=0, max_tokens=60, repetition_detection=rd)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("repetition", "repetition_detected")
    assert out.token_ids == free.token_ids[:first] and free.text.startswith(out.text)
    # Not before min_tokens; then at once (the output repeats from there on).
    params = SamplingParams(
        temperature=0, max_tokens=60, min_tokens=first + 7, repetition_detection=rd
    )
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "repetition" and out.token_ids == free.token_ids[: first + 7]


def test_chat_applies_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "Say hello."}], GREEDY, use_tqdm=False)[0]
    assert "<|im_start|>user" in out.prompt and out.prompt.rstrip().endswith("assistant")
    assert out.outputs[0].token_ids


def test_delta_outputs_concatenate_to_final(llm: LLM) -> None:
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=12, output_kind=RequestOutputKind.DELTA)
    engine.add_request("delta-1", PROMPTS[1], params)
    pieces, tokens = [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            pieces.append(o.outputs[0].text if o.outputs else "")
            tokens += o.outputs[0].token_ids if o.outputs else []
    final = llm.generate([PROMPTS[1]], GREEDY, use_tqdm=False)[0].outputs[0]
    assert "".join(pieces) == final.text and tokens == final.token_ids


def test_stream_interval_batches_deltas_into_the_same_stream(llm: LLM) -> None:
    engine = llm.llm_engine

    def stream(kind: RequestOutputKind, interval: int | None) -> list[tuple[str, list[int]]]:
        params = SamplingParams(
            temperature=0, max_tokens=11, ignore_eos=True, output_kind=kind,
            stream_interval=interval,
        )  # fmt: skip
        engine.add_request(f"si-{kind.name}-{interval}", PROMPTS[1], params)
        chunks = []
        while engine.has_unfinished_requests():
            for o in engine.step():
                chunks.append((o.outputs[0].text, list(o.outputs[0].token_ids)))
        return chunks

    one = stream(RequestOutputKind.DELTA, None)
    four = stream(RequestOutputKind.DELTA, 4)
    assert [len(t) for _, t in one] == [1] * 11
    # The first token at once, then every 4 tokens, the last (2 tokens) at the end.
    assert [len(t) for _, t in four] == [1, 4, 4, 2]
    assert "".join(s for s, _ in four) == "".join(s for s, _ in one)
    assert sum((t for _, t in four), []) == sum((t for _, t in one), [])
    cumulative = stream(RequestOutputKind.CUMULATIVE, 4)
    assert [len(t) for _, t in cumulative] == [1, 5, 9, 11]
    assert cumulative[-1][0] == "".join(s for s, _ in one)
    # LLM.generate (final outputs only) is unaffected.
    params = SamplingParams(temperature=0, max_tokens=11, ignore_eos=True, stream_interval=4)
    final = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
    assert final.token_ids == sum((t for _, t in one), [])


def test_stream_interval_is_raised_to_the_engines() -> None:
    from pagoda.core.outputs import EngineCoreRequest
    from pagoda.engine.output_processor import OutputProcessor

    params = SamplingParams(stream_interval=2)
    core = [EngineCoreRequest("r", [1, 2], params, 0.0, None, 16)]
    op = OutputProcessor(None, stream_interval=5)
    op.add_request("r", None, [1, 2], params, core, 0.0)
    assert op.parents["r"].stream_interval == 5
    op = OutputProcessor(None, stream_interval=1)
    op.add_request("r", None, [1, 2], params, core, 0.0)
    assert op.parents["r"].stream_interval == 2


def test_abort_frees_everything(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("to-abort", PROMPTS[0], SamplingParams(max_tokens=50))
    engine.step()
    engine.abort_request("to-abort")
    assert not engine.has_unfinished_requests()
    engine.step()
    assert engine.scheduler.make_stats().num_running_reqs == 0


def test_an_id_naming_another_requests_sample_is_refused_alone(llm: LLM) -> None:
    # Request "x" with n = 2 has samples "0_x" and "1_x": a request "0_x" must not take over
    # (or drop) the first one's outputs, nor a request "y" with n = 2 the samples of "0_y".
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=4, n=2)
    engine.add_request("x", PROMPTS[0], params)
    with pytest.raises(ValueError, match="'0_x' is in use by the unfinished request 'x'"):
        engine.add_request("0_x", PROMPTS[1], SamplingParams(max_tokens=4))
    engine.add_request("0_y", PROMPTS[1], SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(ValueError, match="in use"):
        engine.add_request("y", PROMPTS[0], params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(done) == ["0_y", "x"]
    assert len(done["x"].outputs) == 2 and all(len(c.token_ids) == 4 for c in done["x"].outputs)


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ("", SamplingParams(), "empty"),
        ({"prompt_token_ids": [10**7]}, SamplingParams(), "token ids"),
        ("x " * 2000, SamplingParams(), "maximum context length"),
        ("hi", SamplingParams(logit_bias={10**7: 1.0}), "logit_bias"),
        ({"prompt_token_ids": [1.0] * 50}, SamplingParams(), "list of token ids"),
        ({"prompt_token_ids": [1, "2"]}, SamplingParams(), "list of token ids"),
        ({"prompt_token_ids": [True, 2]}, SamplingParams(), "list of token ids"),
        ({"prompt_token_ids": None}, SamplingParams(), "list of token ids"),
        ([[1, 2], [3]], SamplingParams(), "list of token ids"),  # one prompt of lists
    ],
)
def test_bad_input_raises_clear_error(llm: LLM, prompt, params, match) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], params, use_tqdm=False)
    # nothing left behind, in the front end or in the core
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.scheduler.make_stats().num_running_reqs == 0
    assert not llm.llm_engine.scheduler.waiting


def test_a_prompt_too_long_by_its_length_is_refused_before_tokenizing(
    llm: LLM, monkeypatch
) -> None:
    # 2.6 million characters make at least 32,000 tokens (no token of SmolLM2's stands for more
    # than 81): a ValueError naming max_model_len at once, not after the tokenizer's seconds
    # over them (10^8 characters took 164 s). As vLLM, the whole call raises and nothing of
    # the batch is left running; the next call is served.
    long_text = "hello world, " * 200_000
    tok = llm.get_tokenizer()
    encode = tok.encode

    def encode_short_only(text: str, *args, **kwargs) -> list[int]:
        assert len(text) < 100_000, "the long prompt was tokenized"
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tok, "encode", encode_short_only)
    too_long = r"maximum context length is 1024 tokens.*2600000 characters.*at least 32099 tokens"
    with pytest.raises(ValueError, match=too_long):
        llm.generate([PROMPTS[0], long_text, PROMPTS[2]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=too_long):
        llm.generate([{"prompt": long_text}], GREEDY, use_tqdm=False)
    short = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="maximum context length is 1024 tokens"):
        llm.chat([short, [{"role": "user", "content": long_text}]], GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests() and engine.num_used_blocks == 0
    assert not engine.scheduler.waiting
    outs = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
    assert len(llm.chat(short, GREEDY, use_tqdm=False)) == 1


@pytest.mark.parametrize(
    "prompts, params, error, match",
    [
        (None, None, ValueError, "prompts must be"),
        (5, None, ValueError, "prompts must be"),
        (["hi"], [{"max_tokens": 2}], TypeError, "SamplingParams objects"),
    ],
)
def test_bad_generate_arguments_raise_clear_errors(llm: LLM, prompts, params, error, match) -> None:
    with pytest.raises(error, match=match):
        llm.generate(prompts, params, use_tqdm=False)


def test_chat_takes_openai_message_forms_and_names_bad_ones(llm: LLM) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}]
    plain = [{"role": "user", "content": "Say hello."}]
    a = llm.chat(parts, GREEDY, use_tqdm=False)[0]
    b = llm.chat(plain, GREEDY, use_tqdm=False)[0]
    assert a.prompt == b.prompt and a.outputs[0].token_ids == b.outputs[0].token_ids
    kw = llm.chat(
        plain, GREEDY, use_tqdm=False, chat_template_kwargs={"add_generation_prompt": False}
    )
    # The kwargs win, as in earlier vLLM releases (in vLLM 0.32 the argument wins).
    assert not kw[0].prompt.rstrip().endswith("assistant")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    for messages, match in [
        ({"role": "user", "content": "hi"}, "list of messages"),
        ("hello", "list of messages"),
        (["hi"], r"messages\[0\] must be an object"),
        (image, "only parts of type 'text'"),
        ([{"role": "user", "content": 5}], "content must be a string"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.chat(messages, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="chat_template must be a string"):
        llm.chat(plain, GREEDY, use_tqdm=False, chat_template=123)
    with pytest.raises(ValueError, match="rejected the messages"):
        llm.chat(plain, GREEDY, use_tqdm=False, chat_template="{{ messages[0].content + 1 }}")


def test_generate_from_two_threads_runs_one_call_at_a_time(llm: LLM, reference) -> None:
    import threading

    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            outs = llm.generate(PROMPTS[2 * i : 2 * i + 2], GREEDY, use_tqdm=False)
            results[i] = [o.outputs[0].token_ids for o in outs]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    assert results[0] + results[1] == reference
    assert llm.llm_engine.scheduler.make_stats().num_running_reqs == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": 100}, "logprobs"),
    ],
)
def test_sampling_params_validation_names_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_serving_leaves_a_core_to_the_front_end_at_small_batches(llm: LLM) -> None:
    import torch

    runner = llm.llm_engine.executor.model_runner
    if runner.cpu_threads < 2:
        pytest.skip("needs at least 2 cores")
    try:
        runner.reserve_core_for_frontend(max_reqs=2)
        alone = llm.generate([PROMPTS[0]], GREEDY, use_tqdm=False)
        assert torch.get_num_threads() == runner.cpu_threads - 1
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert torch.get_num_threads() == runner.cpu_threads
        assert alone[0].outputs[0].token_ids  # same engine, fewer threads: still generates
    finally:
        runner.small_batch_cpu_threads = None
        torch.set_num_threads(runner.cpu_threads)


def test_int8_kv_cache_scales_keep_greedy_output_close(reference) -> None:
    # With per-layer scales taken from the first cached step, an INT8 cache follows the full
    # precision greedy path (with scale 1.0 it produced garbage from token one). Where the two
    # part, it is at a near tie: the full precision token is within a small logprob gap of the
    # INT8 cache's choice (the CPU kernels' results differ in the last bits from one ISA level
    # to another, so which near tie flips depends on the machine).
    int8 = LLM(dtype="float32", max_model_len=1024, kv_cache_dtype="int8", seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5)
    outs = int8.generate(PROMPTS[:3:2], params, use_tqdm=False)
    for out, want in zip(outs, reference[:3:2]):
        got = out.outputs[0].token_ids
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
        assert same >= 4, (got, want)
        if same < len(want):
            top = out.outputs[0].logprobs[same]
            assert want[same] in top, (got, want)
            assert top[got[same]].logprob - top[want[same]].logprob < 0.25, (got, want)


@pytest.mark.parametrize(
    "prompt,word",
    [
        ("The capital of France is", "Paris"),  # one token: never generated
        ("Count: 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,", "4, 5"),  # 5 banned only after "4, "
    ],
)
def test_bad_words_keep_a_word_out_of_greedy_output(llm: LLM, prompt: str, word: str) -> None:
    from pagoda.sample.bad_words import banned_tokens

    free = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20), use_tqdm=False)
    assert word in free[0].outputs[0].text
    params = SamplingParams(temperature=0.0, max_tokens=20, bad_words=[word])
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    ids = list(out.outputs[0].token_ids)
    assert word not in out.outputs[0].text and len(ids) == 20
    # Step by step, the output is the model's argmax given what came before, or, where that was
    # a banned token, the best token not banned (the raw logprobs' order).
    words = SamplingParams(bad_words=[word])
    words.update_from_tokenizer(llm.get_tokenizer())
    contexts = [{"prompt_token_ids": out.prompt_token_ids + ids[:i]} for i in range(len(ids))]
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    steps = llm.generate(contexts, one, use_tqdm=False)
    num_banned = 0
    for i, step in enumerate(steps):
        banned = set(banned_tokens(words.bad_words_token_ids, ids[:i]))
        ranked = sorted(step.outputs[0].logprobs[0].items(), key=lambda kv: kv[1].rank)
        best = next(t for t, _ in ranked if t not in banned)
        assert ids[i] == best, (i, ranked, banned)
        num_banned += ranked[0][0] in banned
    assert num_banned >= 1  # the ban did change a step
