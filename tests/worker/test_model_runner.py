"""ModelRunner end to end on a tiny checkpoint, driven by hand-made SchedulerOutputs.

A small driver plays the scheduler: it hands out scattered blocks, records where each request
starts (SchedulerOutput.num_computed_tokens), advances requests and appends sampled tokens; the
runner hears of them as the scheduler tells it (`step_testing.StepFeed`: whole, then diffs).
Greedy tokens must not depend on batching, chunking, prefix reuse or speculation, and must
equal transformers' greedy continuation.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from model_testing import make_tiny_checkpoint
from step_testing import StepFeed

from pagoda.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig, SchedulerConfig
from pagoda.core.request import Request
from pagoda.model.loader import get_model_config_dict
from pagoda.sampling_params import SamplingParams
from pagoda.worker.model_runner import ModelRunner

MAX_LEN = 96


def make_runner(path, block_size=4, num_blocks=200) -> ModelRunner:
    hf_config = get_model_config_dict(str(path))
    config = EngineConfig(
        model_config=ModelConfig(
            model=str(path), hf_config=hf_config, dtype="float32", max_model_len=MAX_LEN
        ),
        cache_config=CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=64, max_model_len=MAX_LEN
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    runner = ModelRunner(config)
    runner.load_model()
    runner.initialize_kv_cache(runner.determine_num_blocks())
    return runner


class Driver:
    """A scheduler stand-in: scattered block allocation and explicit per-step token counts."""

    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.block_size = runner.block_size
        self.free = list(range(1, runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.feed = StepFeed()

    def step(self, plan, spec=None, finished=()):
        """plan: list of (request, num_tokens incl. drafts), requests the runner knows first
        (as the scheduler orders a step); spec: req_id -> num drafts."""
        starts = {r.request_id: r.num_computed_tokens for r, _ in plan}
        by_id = {r.request_id: r for r, _ in plan}
        for r, n in plan:
            table = self.tables.setdefault(r.request_id, [])
            while len(table) * self.block_size < r.num_computed_tokens + n:
                table.append(self.free.pop())
            r.num_computed_tokens += n
        so = self.feed.step(
            [r for r, _ in plan],
            {r.request_id: n for r, n in plan},
            self.tables,
            starts,
            spec={rid: by_id[rid].spec_token_ids[:k] for rid, k in (spec or {}).items()},
            finished=set(finished),
        )
        out = self.runner.execute_model(so)
        for r, _ in plan:
            sampled = out.sampled_token_ids[r.request_id]
            if spec and r.request_id in spec:
                r.num_computed_tokens -= spec[r.request_id] - (len(sampled) - 1)
                r.spec_token_ids = []
            r.append_output_token_ids(sampled)
        return out

    def generate(self, requests, max_tokens, chunk=64):
        """Run all requests together until each has max_tokens outputs (budget `chunk` each)."""
        while any(r.num_output_tokens < max_tokens for r in requests):
            plan = [
                (r, min(chunk, r.num_tokens - r.num_computed_tokens))
                for r in requests
                if r.num_output_tokens < max_tokens
            ]
            self.step(plan)
        return [r.output_token_ids[:max_tokens] for r in requests]


def req(rid, prompt, **params):
    return Request(rid, prompt, SamplingParams(**{"temperature": 0.0, **params}), None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3")
    hf = make_tiny_checkpoint(path, "qwen3", num_hidden_layers=3)
    return path, hf


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    # Tests share a small machine: a second OpenMP thread waiting for a busy core makes every
    # op slow. Results do not depend on the thread count.
    old_env, old_threads = os.environ.get("PAGODA_CPU_THREADS"), torch.get_num_threads()
    os.environ["PAGODA_CPU_THREADS"] = "1"
    yield
    if old_env is None:
        del os.environ["PAGODA_CPU_THREADS"]
    else:
        os.environ["PAGODA_CPU_THREADS"] = old_env
    torch.set_num_threads(old_threads)


@pytest.fixture(scope="module")
def runner(checkpoint):
    return make_runner(checkpoint[0])


PROMPTS = [
    [5, 17, 99, 3, 42, 8, 8, 61, 12, 7, 33],
    [1, 2, 3],
    list(range(40, 77)),
    [120],
]


def test_greedy_equals_transformers_and_is_batch_invariant(checkpoint, runner):
    _, hf = checkpoint
    alone = [Driver(runner).generate([req(f"a{i}", p)], 8)[0] for i, p in enumerate(PROMPTS)]
    batched = Driver(runner, seed=1).generate([req(f"b{i}", p) for i, p in enumerate(PROMPTS)], 8)
    assert batched == alone
    for prompt, tokens in zip(PROMPTS, alone):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert tokens == ref[0, len(prompt) :].tolist()


def test_chunked_prefill_in_three_chunks(runner):
    prompt = PROMPTS[2]
    whole = Driver(runner).generate([req("w", prompt)], 6)[0]
    r = req("c", prompt)
    d = Driver(runner, seed=2)
    for n in (10, 1, len(prompt) - 11):  # the last chunk reaches the end and samples
        out = d.step([(r, n)])
    assert out.sampled_token_ids["c"] == whole[:1]
    assert d.generate([r], 6)[0] == whole


def test_mixed_step_of_decodes_and_a_prefill_chunk(runner):
    expected = [Driver(runner).generate([req(f"e{i}", p)], 5)[0] for i, p in enumerate(PROMPTS)]
    d = Driver(runner, seed=3)
    reqs = [req(f"m{i}", p) for i, p in enumerate(PROMPTS)]
    d.step([(reqs[0], 11), (reqs[1], 3)])  # two prefills
    d.step([(reqs[0], 1), (reqs[2], 20), (reqs[1], 1)])  # decodes + a partial prefill chunk
    out = d.step([(reqs[1], 1), (reqs[2], 17), (reqs[0], 1), (reqs[3], 1)])
    assert out.req_ids == ["m1", "m2", "m0", "m3"]  # scheduler order is kept in the output
    assert d.generate(reqs, 5) == expected


def test_prefix_hit_reuses_computed_blocks(runner):
    shared = PROMPTS[2][:24]  # six full blocks of 4
    a = req("pa", shared + [1, 2, 3])
    b = req("pb", shared + [9, 9])
    d = Driver(runner, seed=4)
    expected_b = Driver(runner).generate([req("ref", shared + [9, 9])], 6)[0]
    d.generate([a], 1)
    # b starts with a's six cached blocks: only its last two prompt tokens are computed.
    d.tables["pb"] = list(d.tables["pa"][:6])
    b.num_computed_tokens = 24
    out = d.step([(b, 2)])
    assert out.sampled_token_ids["pb"] == expected_b[:1]
    assert d.generate([b], 6)[0] == expected_b


def test_speculative_drafts_are_verified(runner):
    prompt = PROMPTS[0]
    greedy = Driver(runner).generate([req("g", prompt)], 8)[0]
    d = Driver(runner, seed=5)
    r = req("s", prompt)
    d.generate([r], 1)
    # Three correct drafts: all accepted plus the bonus token.
    r.spec_token_ids = greedy[1:4]
    out = d.step([(r, 4)], spec={"s": 3})
    assert out.sampled_token_ids["s"] == greedy[1:5]
    # A wrong second draft: the first is accepted, then the model's token replaces it.
    wrong = (greedy[6] + 1) % 128
    r.spec_token_ids = [greedy[5], wrong, 0]
    out = d.step([(r, 4)], spec={"s": 3})
    assert out.sampled_token_ids["s"] == greedy[5:7]
    assert d.generate([r], 8)[0] == greedy


def test_seeded_sampling_does_not_depend_on_the_batch(runner):
    def sample(batch_with_others: bool, seed_shift: int = 0):
        rid = f"x{batch_with_others}{seed_shift}"  # the runner keeps a generator per request
        reqs = [req(rid, PROMPTS[0], temperature=1.0, seed=1234 + seed_shift)]
        if batch_with_others:
            reqs += [req(f"o{i}", p, temperature=1.0) for i, p in enumerate(PROMPTS[1:])]
        return Driver(runner, seed=6).generate(reqs, 10)[0]

    alone = sample(False)
    assert sample(True) == alone
    assert sample(False, seed_shift=1) != alone


def test_logprobs_and_prompt_logprobs_match_transformers(checkpoint, runner):
    _, hf = checkpoint
    prompt = PROMPTS[0]
    r = req("lp", prompt, logprobs=2, prompt_logprobs=1)
    d = Driver(runner, seed=7)
    first = d.step([(r, 4)])  # a partial chunk: prompt logprobs for positions 0..3, no sample
    assert first.sampled_token_ids["lp"] == [] and "lp" not in first.logprobs
    second = d.step([(r, len(prompt) - 4)])
    prompt_lps = first.prompt_logprobs["lp"] + second.prompt_logprobs["lp"]
    assert len(prompt_lps) == len(prompt) - 1
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for pos, lp in enumerate(prompt_lps):
        target = prompt[pos + 1]
        assert abs(lp[target][0] - ref[pos, target].item()) < 1e-4
    (sampled_lp,) = second.logprobs["lp"]
    token = second.sampled_token_ids["lp"][0]
    assert token == int(ref[-1].argmax())
    assert sampled_lp[token][1] == 1 and len(sampled_lp) == 2


def test_finished_requests_drop_their_generator(runner):
    d = Driver(runner, seed=8)
    r = req("f", PROMPTS[1], temperature=1.0, seed=3)
    d.generate([r], 1)
    assert "f" in runner.generators
    d.step([(req("other", PROMPTS[3]), 1)], finished={"f"})
    assert "f" not in runner.generators


def test_kv_cache_shape_and_cpu_sizing(checkpoint):
    runner = make_runner(checkpoint[0], block_size=16, num_blocks=10)
    spec = runner.get_kv_cache_spec()
    assert runner.kv_caches[0].shape == (2, 10, 16, spec.num_kv_heads, spec.head_size)
    assert len(runner.kv_caches) == 3
    assert runner.bytes_per_block() == 2 * 16 * 2 * 32 * 4 * 3  # K+V, 2 KV heads, head_dim 32
    with pytest.raises(ValueError, match="max_model_len"):
        make_runner(checkpoint[0], block_size=16, num_blocks=3)
