"""Engine arguments are honoured, refused with a ValueError naming them, or logged once as
ignored; none is accepted and silently dropped."""

from __future__ import annotations

import json
import logging

import pytest
from model_testing import TINY_CONFIG

from pagoda import LLM
from pagoda.cli import build_parser
from pagoda.engine.arg_utils import EngineArgs
from pagoda.entrypoints.llm import _legacy_speculative_config


@pytest.fixture
def tiny(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(tmp_path)


@pytest.fixture
def warnings():
    """Warnings of the `pagoda` loggers (they do not propagate to the root logger)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("pagoda").addHandler(handler)
    yield records
    logging.getLogger("pagoda").removeHandler(handler)


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


def test_speculative_max_model_len_is_logged_as_ignored(warnings) -> None:
    kwargs = {"speculative_model": "[ngram]", "num_speculative_tokens": 3,
              "speculative_max_model_len": 512}  # fmt: skip
    config = _legacy_speculative_config(kwargs)
    assert config == {"method": "ngram", "num_speculative_tokens": 3} and not kwargs
    [record] = warnings
    assert "speculative_max_model_len=512 is ignored" in record.getMessage()
    assert _legacy_speculative_config({"speculative_max_model_len": 512}) is None


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
    ],
)
def test_bad_engine_argument_names_itself(tiny, field, value, match) -> None:
    with pytest.raises(ValueError, match=match):
        _config(tiny, **{field: value})


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
