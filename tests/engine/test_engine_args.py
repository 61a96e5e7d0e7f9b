"""Engine arguments are honoured, refused with a ValueError naming them, or logged once as
ignored; none is accepted and silently dropped."""

from __future__ import annotations

import json

import pytest
from model_testing import TINY_CONFIG

from pagoda import LLM
from pagoda.cli import build_parser
from pagoda.engine.arg_utils import EngineArgs, legacy_speculative_config


@pytest.fixture
def tiny(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(tmp_path)


def _config(tiny: str, **kwargs):
    return EngineArgs(
        model=tiny, load_format="dummy", device="cpu", **kwargs
    ).create_engine_config()


def test_max_model_len_zero_is_refused_not_defaulted(tiny) -> None:
    with pytest.raises(ValueError, match="max_model_len must be positive, got 0"):
        _config(tiny, max_model_len=0)
    assert _config(tiny).model_config.max_model_len == TINY_CONFIG["max_position_embeddings"]


def test_gpu_memory_utilization_on_a_cpu_is_logged_as_ignored(tiny, warnings) -> None:
    _config(tiny)
    assert not warnings  # the default says nothing
    _config(tiny, gpu_memory_utilization=0.5)
    [record] = warnings
    assert "gpu_memory_utilization=0.5 is ignored on a CPU" in record.getMessage()


def test_served_engine_logs_an_ignored_argument_once(tiny, warnings) -> None:
    """The engine core process checks its arguments before building the engine
    (`check_engine_start`) and builds it from the config that check made: the warning of an
    argument ignored on a CPU comes once, not once for each."""
    from pagoda.engine.serving_engine import build_serving_engine

    args = EngineArgs(
        model=tiny,
        load_format="dummy",
        device="cpu",
        gpu_memory_utilization=0.5,
        skip_tokenizer_init=True,
    )
    build_serving_engine(args)
    assert [r.getMessage() for r in warnings if "gpu_memory_utilization" in r.getMessage()] == [
        "gpu_memory_utilization=0.5 is ignored on a CPU: the KV cache takes "
        "--kv-cache-memory-bytes (default: min(2 GiB, 25% of the available RAM))"
    ]


def test_speculative_max_model_len_is_logged_as_ignored(warnings) -> None:
    kwargs = {"speculative_model": "[ngram]", "num_speculative_tokens": 3,
              "speculative_max_model_len": 512}  # fmt: skip
    config = legacy_speculative_config(kwargs)
    assert config == {"method": "ngram", "num_speculative_tokens": 3} and not kwargs
    [record] = warnings
    assert "speculative_max_model_len=512 is ignored" in record.getMessage()
    assert legacy_speculative_config({"speculative_max_model_len": 512}) is None


def test_legacy_speculative_flags_on_the_command_line(warnings) -> None:
    """vLLM <= 0.6's --speculative-model / --num-speculative-tokens / --ngram-prompt-lookup-*
    (what LLM(speculative_model=...) takes as keywords) become --speculative-config, on `pagoda
    serve` and vLLM's api_server module alike; --speculative-max-model-len is logged as
    ignored."""
    from pagoda.entrypoints.openai.api_server import make_arg_parser

    legacy = ["--speculative-model", "/m/draft", "--num-speculative-tokens", "5"]
    legacy += ["--speculative-max-model-len", "4096"]
    for args in (
        build_parser().parse_args(["serve", *legacy]),
        make_arg_parser().parse_args(legacy),
    ):
        config = EngineArgs.from_cli_args(args).speculative_config
        assert config == {"method": "draft_model", "model": "/m/draft", "num_speculative_tokens": 5}
    assert [r.getMessage() for r in warnings] == [
        "speculative_max_model_len=4096 is ignored: drafts are proposed up to max_model_len"
    ] * 2
    ngram = ["serve", "--speculative-model", "[ngram]", "--ngram-prompt-lookup-max", "4"]
    assert EngineArgs.from_cli_args(build_parser().parse_args(ngram)).speculative_config == {
        "method": "ngram",
        "prompt_lookup_max": 4,
    }
    assert EngineArgs.from_cli_args(build_parser().parse_args(["serve"])).speculative_config is None
    both = [
        "serve",
        "--speculative-model",
        "[ngram]",
        "--speculative-config",
        '{"method": "ngram"}',
    ]
    with pytest.raises(ValueError, match="--speculative-config or --speculative-model, not both"):
        EngineArgs.from_cli_args(build_parser().parse_args(both))
    with pytest.raises(ValueError, match="num_speculative_tokens need speculative_model"):
        EngineArgs.from_cli_args(
            build_parser().parse_args(["serve", "--num-speculative-tokens", "3"])
        )


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("max_num_seqs", "8", "max_num_seqs must be an integer"),
        ("max_model_len", 1.5, "max_model_len must be an integer"),
        ("gpu_memory_utilization", "0.5", "gpu_memory_utilization must be a number"),
        ("enable_prefix_caching", "no", "enable_prefix_caching must be true or false"),
        ("seed", 2**64, "seed must be a signed 64-bit integer"),
        ("num_gpu_blocks_override", 0, "num_gpu_blocks_override must be positive"),
        ("kv_cache_memory_bytes", -1, "kv_cache_memory_bytes must be positive"),
        ("max_num_seqs", 0, "max_num_seqs must be positive"),
        ("speculative_config", "ngram", "speculative_config must be a dict"),
        ("speculative_config", {"num_speculative_tokens": "5"}, "must be an integer"),
        ("stream_interval", 0, "stream_interval must be >= 1"),
        ("stream_interval", "4", "stream_interval must be an integer"),
    ],
)
def test_bad_engine_argument_names_itself(tiny, field, value, match) -> None:
    with pytest.raises(ValueError, match=match):
        _config(tiny, **{field: value})


def test_stream_interval_flag_reaches_the_scheduler_config(tiny) -> None:
    from pagoda.entrypoints.openai.api_server import make_arg_parser

    for args in (
        build_parser().parse_args(["serve", "--stream-interval", "4"]),
        make_arg_parser().parse_args(["--stream-interval", "4"]),
    ):
        assert EngineArgs.from_cli_args(args).stream_interval == 4
    assert _config(tiny, stream_interval=4).scheduler_config.stream_interval == 4
    assert _config(tiny).scheduler_config.stream_interval == 1


def test_max_waiting_requests_is_a_server_flag_only() -> None:
    # It bounds a server's queue; offline and in `pagoda generate` it had no effect.
    with pytest.raises(ValueError, match="unknown LLM argument.*max_waiting_requests"):
        LLM(max_waiting_requests=4)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--max-waiting-requests", "4"])
    args = build_parser().parse_args(["serve", "--max-waiting-requests", "4"])
    assert args.max_waiting_requests == 4


def test_cuda_without_a_gpu_is_a_clear_error(tiny) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="no CUDA GPU is available"):
        EngineArgs(model=tiny, load_format="dummy", device="cuda").create_engine_config()


def test_a_kv_cache_past_the_machines_memory_is_a_clear_error() -> None:
    import torch

    from pagoda.worker.kv_cache import _zeros

    with pytest.raises(ValueError, match="cannot be allocated.*kv_cache_memory_bytes"):
        _zeros((2**52,), torch.uint8, torch.device("cpu"))  # 4 PiB


def test_an_empty_model_path_is_refused_not_the_embedded_model() -> None:
    with pytest.raises(ValueError, match="model must be a path"):
        EngineArgs(model="  ").create_engine_config()


@pytest.mark.parametrize(
    "kwargs, flags",
    [
        ({"max_num_seqs": 10**11}, "lower max_num_seqs \\(--max-num-seqs\\)$"),
        ({"max_num_batched_tokens": 10**13}, "lower max_num_batched_tokens"),
        ({"max_num_seqs": 10**11, "max_num_batched_tokens": 10**13}, "lower max_num_seqs .* or"),
    ],
)
def test_sizes_whose_step_inputs_cannot_be_allocated_are_refused_at_configuration(
    tiny, kwargs, flags
) -> None:
    # Each sequence has a block-table row of max_model_len / block_size block ids (256 / 16 =
    # 16 here: 80 bytes with its two offsets), each token four ids: 10^11 sequences or 10^13
    # tokens are terabytes. Before, torch's allocator failed deep in the model runner.
    with pytest.raises(
        ValueError, match=f"cannot be honoured: .* GiB of memory available: {flags}"
    ):
        _config(tiny, **kwargs)
    with pytest.raises(ValueError, match="max_num_seqs=100000000000 .* cannot be honoured"):
        LLM(model=tiny, load_format="dummy", device="cpu", max_num_seqs=10**11)
    assert _config(tiny, max_num_seqs=100_000).scheduler_config.max_num_seqs == 100_000


def test_the_step_input_bound_is_what_the_input_builder_allocates() -> None:
    import torch

    from pagoda.worker.input_batch import InputBufferBytes, InputBuilder, input_buffer_bytes

    for tokens, reqs, blocks in ((2048, 256, 512), (7, 3, 5), (16, 1000, 1)):
        b = InputBuilder(tokens, reqs, blocks, 16, torch.device("cpu"))
        allocated = b._tokens.host_t.nbytes + b._reqs.host_t.nbytes + b._arange.nbytes
        assert input_buffer_bytes(tokens, reqs, blocks, False).host == allocated
        assert input_buffer_bytes(tokens, reqs, blocks, False).device == 0
        copied = InputBuilder(tokens, reqs, blocks, 16, torch.device("cpu"), copy_to_device=True)
        device = copied._tokens.dev.nbytes + copied._reqs.dev.nbytes
        assert input_buffer_bytes(tokens, reqs, blocks, True) == InputBufferBytes(allocated, device)


def test_on_a_gpu_the_step_inputs_must_also_fit_its_memory_budget(tiny, monkeypatch) -> None:
    # On CUDA the buffers are allocated twice, pinned on the host and on the device: 10^7
    # sequences (about 0.7 GB each side) fit a host but not gpu_memory_utilization=0.5 of 1 GiB.
    import dataclasses
    import types

    import torch

    from pagoda.config import DeviceConfig
    from pagoda.engine.arg_utils import check_input_buffers_fit

    gib = types.SimpleNamespace(total_memory=2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: gib)
    config = _config(tiny, max_num_seqs=10**7, gpu_memory_utilization=0.5)
    check_input_buffers_fit(config)  # on the CPU: host memory only
    on_gpu = dataclasses.replace(config, device_config=DeviceConfig(device="cuda"))
    with pytest.raises(ValueError, match="0.5 GiB of GPU memory .*: lower max_num_seqs"):
        check_input_buffers_fit(on_gpu)
    check_input_buffers_fit(
        dataclasses.replace(on_gpu, scheduler_config=_config(tiny).scheduler_config)
    )
