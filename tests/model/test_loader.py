"""Weight loading: HF directories (safetensors, sharded, .bin), dummy weights, and the errors a
user can cause, each a ValueError naming the file or tensor."""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_testing import make_tiny_checkpoint
from safetensors.torch import load_file, save_file

from pagoda.config import ModelConfig
from pagoda.model.loader import get_model_config_dict, load_model
from pagoda.model.registry import get_model_class, supported_architectures


def _model_config(path, load_format="auto", dtype="float32", seed=0):
    hf_config = get_model_config_dict(str(path), load_format)
    return ModelConfig(
        model=str(path),
        hf_config=hf_config,
        dtype=dtype,
        max_model_len=64,
        load_format=load_format,
        seed=seed,
    )


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture()
def llama_dir(tmp_path):
    make_tiny_checkpoint(tmp_path, "llama_untied_linear_rope")
    return tmp_path


def test_sharded_and_bin_checkpoints_load_the_same_weights(llama_dir, tmp_path_factory):
    ref = _state(load_model(_model_config(llama_dir), "cpu"))
    tensors = load_file(os.path.join(llama_dir, "model.safetensors"))
    names = sorted(tensors)
    # Sharded: two files plus an index.
    sharded = tmp_path_factory.mktemp("sharded")
    os.link(llama_dir / "config.json", sharded / "config.json")
    halves = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(sharded / file))
    weight_map = {k: f for f, keys in halves.items() for k in keys}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    # PyTorch .bin.
    binary = tmp_path_factory.mktemp("bin")
    os.link(llama_dir / "config.json", binary / "config.json")
    torch.save(tensors, binary / "pytorch_model.bin")
    for path in (sharded, binary):
        state = _state(load_model(_model_config(path), "cpu"))
        assert state.keys() == ref.keys()
        assert all(torch.equal(state[k], ref[k]) for k in ref)


def test_dummy_weights_are_deterministic_per_seed(llama_dir):
    config_json = str(llama_dir / "config.json")
    a = _state(load_model(_model_config(config_json, "dummy", "bfloat16", seed=3), "cpu"))
    b = _state(load_model(_model_config(llama_dir, "dummy", "bfloat16", seed=3), "cpu"))
    c = _state(load_model(_model_config(llama_dir, "dummy", "bfloat16", seed=4), "cpu"))
    w = "model.layers.0.self_attn.qkv_proj.weight"
    assert a[w].dtype == torch.bfloat16 and 0.01 < a[w].float().std() < 0.03
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a[w], c[w])


def test_registry_lists_the_llama_family():
    assert {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    } <= set(supported_architectures())
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        get_model_class("GPT2LMHeadModel")


def test_missing_paths_and_config_are_named(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        get_model_config_dict(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="no config.json"):
        get_model_config_dict(str(tmp_path))


def test_missing_weights_are_named(llama_dir):
    mc = _model_config(llama_dir)
    os.remove(llama_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"no weights in .*safetensors"):
        load_model(mc, "cpu")


def test_truncated_safetensors_is_named(llama_dir):
    path = llama_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors.*truncated"):
        load_model(_model_config(llama_dir), "cpu")


def test_shape_mismatch_names_tensor(llama_dir):
    mc = _model_config(llama_dir)
    bad = dict(mc.hf_config, intermediate_size=mc.hf_config["intermediate_size"] * 2)
    mc = ModelConfig(model=mc.model, hf_config=bad, dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match=r"mlp\.(gate|up|down)_proj\.weight.*shape mismatch"):
        load_model(mc, "cpu")


def test_missing_tensor_is_named(llama_dir):
    path = str(llama_dir / "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"lacks tensors.*model\.layers\.1\.self_attn\.k_proj"):
        load_model(_model_config(llama_dir), "cpu")


def test_unexpected_tensor_is_named(llama_dir):
    path = str(llama_dir / "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.7.mlp.up_proj.weight"] = torch.zeros(96, 64)
    save_file(tensors, path)
    with pytest.raises(ValueError, match=r"model\.layers\.7\.mlp\.up_proj\.weight.*no place"):
        load_model(_model_config(llama_dir), "cpu")
