"""A checkpoint's config.json (or GGUF metadata) with a field of the wrong type or range fails at
start-up with a ValueError naming the file and the field, not deep inside the model's
construction."""

from __future__ import annotations

import json

import gguf
import pytest
from model_testing import TINY_CONFIG

from pagoda.engine.arg_utils import EngineArgs
from pagoda.model.loader import get_model_config_dict


def _config_dir(tmp_path, **overrides):
    config = {**TINY_CONFIG, **overrides}
    for key in [k for k, v in overrides.items() if v is ...]:
        del config[key]
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    "field, value",
    [
        ("hidden_size", "sixty-four"),
        ("hidden_size", 64.0),
        ("hidden_size", 65),  # not a multiple of num_attention_heads, and no head_dim
        ("num_hidden_layers", -1),
        ("num_hidden_layers", True),
        ("vocab_size", 0),
        ("intermediate_size", ...),  # missing
        ("num_attention_heads", None),
        ("num_key_value_heads", 3),  # does not divide 4 heads
        ("head_dim", 0),
        ("max_position_embeddings", "2k"),
        ("rms_norm_eps", -1e-6),
        ("rope_theta", float("nan")),
        ("tie_word_embeddings", "yes"),
        ("architectures", "LlamaForCausalLM"),
        ("eos_token_id", -1),
        ("eos_token_id", []),
        ("rope_scaling", {"rope_type": "linear", "factor": "2"}),
        ("rope_scaling", "linear"),
        ("sliding_window", "4k"),
        ("num_experts_per_tok", 0),
        ("moe_intermediate_size", "768"),
        ("norm_topk_prob", "true"),
        ("quantization_config", "awq"),
        ("quantization_config", {"bits": 4}),  # no quant_method
    ],
)
def test_bad_field_names_file_and_field(tmp_path, field, value) -> None:
    path = _config_dir(tmp_path, **{field: value})
    with pytest.raises(ValueError) as e:
        get_model_config_dict(str(path), "dummy")
    assert str(e.value).startswith(f"{path / 'config.json'}: {field} "), str(e.value)


def test_engine_config_refuses_a_bad_config_file(tmp_path) -> None:
    path = _config_dir(tmp_path, num_hidden_layers=-1)
    with pytest.raises(ValueError, match="config.json: num_hidden_layers must be a positive"):
        EngineArgs(model=str(path), load_format="dummy").create_engine_config()


def test_valid_configs_pass_unchanged(tmp_path) -> None:
    overrides = dict(
        head_dim=None, num_key_value_heads=None, rope_scaling=None, sliding_window=None,
        eos_token_id=[1, 2], architectures=["LlamaForCausalLM"], rope_theta=500000,
    )  # fmt: skip
    path = _config_dir(tmp_path, **overrides)
    assert get_model_config_dict(str(path), "dummy") == {**TINY_CONFIG, **overrides}


def _write_gguf(path, **metadata) -> str:
    writer = gguf.GGUFWriter(str(path), "llama")
    values = {"embedding_length": 64, "block_count": 2, "feed_forward_length": 96,
              "attention.head_count": 4, "vocab_size": 128, **metadata}  # fmt: skip
    for key, value in values.items():
        if isinstance(value, str):
            writer.add_string(f"llama.{key}", value)
        else:
            writer.add_int32(f"llama.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_metadata_is_checked_naming_the_key(tmp_path) -> None:
    assert get_model_config_dict(_write_gguf(tmp_path / "ok.gguf"))["num_hidden_layers"] == 2
    path = _write_gguf(tmp_path / "layers.gguf", block_count=0)
    with pytest.raises(ValueError, match=r"layers.gguf: num_hidden_layers \(llama.block_count\)"):
        get_model_config_dict(path)
    path = _write_gguf(tmp_path / "hidden.gguf", embedding_length="sixty-four")
    with pytest.raises(ValueError, match="hidden.gguf: GGUF key llama.embedding_length must be an"):
        get_model_config_dict(path)
