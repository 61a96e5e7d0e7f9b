"""Checkpoints damaged in ways the loader used to take: each fails at load with a ValueError
naming the file and the tensor or field, instead of loading into a model that answers garbage
or failing with a library's own exception (the inputs already covered are in test_loader.py,
test_gguf.py and test_config_checks.py)."""

from __future__ import annotations

import json
import struct

import gguf
import numpy as np
import pytest
import torch
from model_testing import make_tiny_checkpoint
from quant_testing import quantized_checkpoint
from safetensors.torch import load_file, save_file

from pagoda.config import ModelConfig, embedded_model_path
from pagoda.model.loader import get_model_config_dict, load_model
from pagoda.model.loader.gguf import GGUFReader, iter_gguf_weights
from pagoda.tokenizer import Tokenizer

LLAMA_KEYS = {"embedding_length": 64, "block_count": 1, "feed_forward_length": 96,
              "attention.head_count": 4}  # fmt: skip


def _write_gguf(path, tensors: dict[str, np.ndarray], **metadata) -> str:
    """A GGUF file of float32 `tensors` and llama `metadata` (strings and lists of strings
    as such, integers as uint32)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {**{f"llama.{k}": v for k, v in LLAMA_KEYS.items()}, **metadata}.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    for name, values in tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _patch(path: str, old: bytes, new: bytes, after: bytes = b"") -> None:
    """Replace the first `old` (after the first `after`) in the file by `new`."""
    data = bytearray(open(path, "rb").read())
    at = data.index(old, data.index(after) if after else 0)
    data[at : at + len(new)] = new
    open(path, "wb").write(bytes(data))


def _table_entry(name: bytes, n_dims: int) -> tuple[bytes, int]:
    """The bytes that open `name`'s entry in a GGUF tensor table, and where its ggml type is
    from there (then its 8-byte data offset)."""
    return struct.pack("<Q", len(name)) + name, 8 + len(name) + 4 + 8 * n_dims


def _tensor_field(path: str, name: bytes, n_dims: int, field: str) -> int:
    entry, type_at = _table_entry(name, n_dims)
    data = open(path, "rb").read()
    return data.index(entry) + type_at + (4 if field == "offset" else 0)


def _three_tensors(path) -> str:
    rng = np.random.default_rng(0)
    tensors = {n: rng.standard_normal((4, 64)).astype(np.float32) for n in ("ta", "tb", "tc")}
    return _write_gguf(path, tensors)


def test_a_gguf_table_whose_types_or_offsets_do_not_match_the_data_is_refused(tmp_path) -> None:
    """A type id or an offset edited in the tensor table (here `ta` F32 -> F16, and `ta`/`tb`
    swapped) read other bytes as the weights: the file loaded and answered garbage. As
    llama.cpp, each tensor must start where the one before it ends (padded)."""
    ok = _three_tensors(tmp_path / "ok.gguf")
    assert set(GGUFReader(ok).tensors) == {"ta", "tb", "tc"}
    retyped = _three_tensors(tmp_path / "retyped.gguf")
    with open(retyped, "r+b") as f:
        f.seek(_tensor_field(retyped, b"ta", 2, "type"))
        f.write(struct.pack("<I", 1))  # F16: half the bytes
    with pytest.raises(ValueError, match=r"retyped.gguf: tensor tb starts at data offset 1024, "
                       r"but ta before it \(F16, shape \[4, 64\]\) ends at 512"):  # fmt: skip
        GGUFReader(retyped)
    swapped = _three_tensors(tmp_path / "swapped.gguf")
    a, b = (_tensor_field(swapped, n, 2, "offset") for n in (b"ta", b"tb"))
    data = bytearray(open(swapped, "rb").read())
    data[a : a + 8], data[b : b + 8] = data[b : b + 8], data[a : a + 8]
    open(swapped, "wb").write(bytes(data))
    with pytest.raises(ValueError, match=r"tensor ta starts at data offset 1024, but the data"):
        GGUFReader(swapped)


def test_a_gguf_naming_a_tensor_or_key_twice_is_refused(tmp_path) -> None:
    path = _three_tensors(tmp_path / "dup.gguf")
    entry, _ = _table_entry(b"tb", 2)
    _patch(path, entry, struct.pack("<Q", 2) + b"ta")
    with pytest.raises(ValueError, match="dup.gguf: tensor ta is in the table twice"):
        GGUFReader(path)
    path = _write_gguf(tmp_path / "dupkey.gguf", {}, **{"test.aa": 1, "test.ab": 2})
    _patch(path, b"test.ab", b"test.aa")
    with pytest.raises(ValueError, match="dupkey.gguf has metadata key test.aa twice"):
        GGUFReader(path)


def test_a_gguf_tensor_of_no_known_layer_names_the_file(tmp_path) -> None:
    path = _write_gguf(tmp_path / "odd.gguf", {"blk.0.attn_x.weight": np.ones((64, 64), "f4")})
    with pytest.raises(ValueError, match=r"odd.gguf: GGUF tensor 'blk.0.attn_x.weight' has no"):
        list(iter_gguf_weights(path))


def test_a_gguf_bpe_tokenizer_without_merges_is_refused(tmp_path) -> None:
    """Byte-level BPE without its merges encoded every text byte by byte: a model that loads
    and reads garbage. llama.cpp refuses such a file too."""
    tokens = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"]}
    path = _write_gguf(tmp_path / "nomerges.gguf", {}, **tokens)
    with pytest.raises(ValueError, match="nomerges.gguf has no tokenizer.ggml.merges"):
        Tokenizer.from_gguf(path)
    path = _write_gguf(tmp_path / "merges.gguf", {}, **tokens, **{"tokenizer.ggml.merges": ["a b"]})
    assert Tokenizer.from_gguf(path).encode("ab", add_special_tokens=False) == [2]
    path = _write_gguf(
        tmp_path / "badmerge.gguf", {}, **tokens, **{"tokenizer.ggml.merges": ["ab"]}
    )
    with pytest.raises(ValueError, match="badmerge.gguf: tokenizer.ggml.merges must be"):
        Tokenizer.from_gguf(path)


def test_a_directory_of_gguf_files_names_them(tmp_path) -> None:
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(ValueError, match=r"without a config.json; it holds a.gguf, b.gguf: pass"):
        get_model_config_dict(str(tmp_path))
    with pytest.raises(ValueError, match="is a directory: pass the path of a .gguf file"):
        GGUFReader(tmp_path)


def _model_config(path) -> ModelConfig:
    hf_config = get_model_config_dict(str(path))
    quant = (hf_config.get("quantization_config") or {}).get("quant_method")
    return ModelConfig(
        model=str(path), hf_config=hf_config, dtype="float32", max_model_len=64, quantization=quant
    )


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("model.layers.1.self_attn.q_proj.weight", torch.int32),
        ("model.layers.0.mlp.up_proj.weight", torch.int8),
        ("model.layers.0.input_layernorm.weight", torch.bool),
    ],
)
def test_integer_values_for_float_weights_are_refused(tmp_path, name, dtype) -> None:
    """The copy into the parameter cast them: a model that loaded and answered garbage."""
    make_tiny_checkpoint(tmp_path, "llama_untied_linear_rope")
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    tensors[name] = (tensors[name] * 100).to(dtype)
    save_file(tensors, path)
    short = str(dtype).removeprefix("torch.")
    with pytest.raises(ValueError, match=rf"{name}' has dtype {short} where the model expects "
                       "floating-point weights"):  # fmt: skip
        load_model(_model_config(tmp_path), "cpu")


def test_float_values_for_packed_integers_are_refused(tmp_path) -> None:
    _, path = quantized_checkpoint(tmp_path, "gptq", act_order=True)
    file = str(path / "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name].float() + 0.5
    save_file(tensors, file)
    with pytest.raises(ValueError, match=rf"{name}' has dtype float32 where the model expects int"):
        load_model(_model_config(path), "cpu")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The embedded model's tokenizer as Hugging Face files."""
    path = tmp_path_factory.mktemp("tok")
    Tokenizer.from_gguf(embedded_model_path()).save_pretrained(path)
    return path


def _copy_tokenizer(src, dst, **config_changes):
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())
    config = json.loads((src / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**config, **config_changes}))
    return dst


def test_a_corrupt_tokenizer_file_is_named(tokenizer_dir, tmp_path) -> None:
    path = _copy_tokenizer(tokenizer_dir, tmp_path / "cut")
    data = (path / "tokenizer.json").read_bytes()
    for content in (data[:5000], b"{}"):  # truncated; not a tokenizer
        (path / "tokenizer.json").write_bytes(content)
        with pytest.raises(ValueError, match=r"cut/tokenizer.json is not a readable tokenizer"):
            Tokenizer.from_pretrained(path)
    path = _copy_tokenizer(tokenizer_dir, tmp_path / "list")
    (path / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"tokenizer_config.json must hold a JSON object"):
        Tokenizer.from_pretrained(path)


def test_a_chat_template_that_is_no_template_is_named(tokenizer_dir, tmp_path) -> None:
    """Not a string: refused at load, naming the field (it failed each chat with Jinja's "Can't
    compile non template nodes"). Not valid Jinja: loads (completions work) and each chat fails
    naming the line and the model."""
    path = _copy_tokenizer(tokenizer_dir, tmp_path / "int", chat_template=5)
    with pytest.raises(ValueError, match=r"tokenizer_config.json: chat_template must be a string"):
        Tokenizer.from_pretrained(path)
    path = _copy_tokenizer(tokenizer_dir, tmp_path / "jinja", chat_template="{{ x }\n")
    tok = Tokenizer.from_pretrained(path)
    assert tok.encode("hi")
    with pytest.raises(ValueError, match=r"not valid jinja \(line 1\): .*\(the chat template of "
                       r".*jinja: fix it"):  # fmt: skip
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_a_quantization_config_pagoda_cannot_read_names_the_model(tmp_path) -> None:
    _, path = quantized_checkpoint(tmp_path, "awq")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["bits"] = 8
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"^{path}: AWQ bits=8, .* Pagoda reads 4-bit"):
        load_model(_model_config(path), "cpu")


@pytest.mark.parametrize("change", [{"group_size": 64}, {"bits": 8}])
def test_a_quantization_config_not_matching_the_tensors_names_it(tmp_path, change) -> None:
    _, path = quantized_checkpoint(tmp_path, "gptq")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"\.(qweight|qzeros|scales|g_idx)': .* does not "
                       r"match its config.json \(quantization_config: bits / group_size\)"):  # fmt: skip
        load_model(_model_config(path), "cpu")


@pytest.mark.parametrize("shift", [100, -1])
def test_gptq_group_numbers_outside_the_groups_are_refused(tmp_path, shift) -> None:
    """Past the last group: torch's IndexError (a traceback from pagoda serve); negative: read
    from the last groups, a model answering garbage."""
    _, path = quantized_checkpoint(tmp_path, "gptq", act_order=True)
    file = str(path / "model.safetensors")
    tensors = load_file(file)
    name = "model.layers.0.mlp.down_proj.g_idx"
    tensors[name] = tensors[name] + shift
    save_file(tensors, file)
    with pytest.raises(ValueError, match=rf"{name}': g_idx holds group numbers from .* outside "
                       r"the layer's 3 groups \[0, 3\)"):  # fmt: skip
        load_model(_model_config(path), "cpu")
