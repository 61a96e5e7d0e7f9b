"""GGUF reader, ggml dequantization and HF mapping, checked against the `gguf` package and
transformers (the oracles)."""

from __future__ import annotations

import os
import shutil

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from pagoda.config import embedded_model_path
from pagoda.model.loader.gguf import (
    GGUFReader,
    dequantize,
    gguf_name_to_hf,
    gguf_to_hf_config,
    iter_gguf_weights,
    reverse_permute_qk,
)

# Byte ranges of each block's f16 scale fields (the rest of a block is arbitrary bits).
F16_FIELDS = {
    QT.Q4_0: [0],
    QT.Q4_1: [0, 2],
    QT.Q5_0: [0],
    QT.Q5_1: [0, 2],
    QT.Q8_0: [0],
    QT.Q4_K: [0, 2],
    QT.Q5_K: [0, 2],
    QT.Q6_K: [208],
}


def random_blocks(qtype: QT, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random but well-formed blocks: random bits, finite f16 scales in a sane range."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for start in F16_FIELDS[qtype]:
        scales = rng.uniform(-2.0, 2.0, size=(n_blocks, 1)).astype(np.float16)
        blocks[:, start : start + 2] = scales.view(np.uint8)
    return blocks


@pytest.fixture(scope="module")
def reader() -> GGUFReader:
    return GGUFReader(embedded_model_path())


@pytest.fixture(scope="module")
def ref_reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(embedded_model_path())


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda q: q.name)
def test_quant_type_matches_gguf_dequantize(qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype))
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 3, 4
    raw = random_blocks(qtype, rows * blocks_per_row, rng).reshape(rows, -1)
    ours = dequantize(raw, int(qtype), (rows, blocks_per_row * block))
    ref = gguf_dequantize(raw, qtype)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16], ids=lambda q: q.name)
def test_float_types_match_gguf(qtype: QT) -> None:
    values = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    raw = gguf.quants.quantize(values, qtype).view(np.uint8)
    np.testing.assert_array_equal(
        dequantize(raw, int(qtype), (4, 8)), gguf_dequantize(raw, qtype).reshape(4, 8)
    )


def test_unsupported_type_names_type() -> None:
    with pytest.raises(ValueError, match="Q2_K"):
        dequantize(np.zeros(84, np.uint8), int(QT.Q2_K), (256,))


def test_written_file_round_trips_every_type(tmp_path) -> None:
    """A file written by gguf.GGUFWriter (all our types + one we cannot dequantize)."""
    rng = np.random.default_rng(1)
    path = str(tmp_path / "all.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint32("test.u32", 7)
    writer.add_array("test.floats", [0.5, 1.5])
    writer.add_string("test.str", "héllo")
    for qtype in (QT.F32, QT.F16, QT.BF16):
        values = rng.standard_normal((2, 64)).astype(np.float32)
        writer.add_tensor(qtype.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    for qtype in (*F16_FIELDS, QT.Q2_K):
        block, _ = gguf.GGML_QUANT_SIZES[qtype]
        if qtype == QT.Q2_K:
            raw = rng.integers(0, 256, size=(2, 84), dtype=np.uint8)
        else:
            raw = random_blocks(qtype, 2 * (256 // block), rng).reshape(2, -1)
        writer.add_tensor(qtype.name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    ours, ref = GGUFReader(path), gguf.GGUFReader(path)
    assert ours.metadata["test.u32"] == 7
    assert ours.metadata["test.floats"] == [0.5, 1.5]
    assert ours.metadata["test.str"] == "héllo"
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == int(t.tensor_type)
        assert info.nbytes == t.n_bytes
        if t.tensor_type == QT.Q2_K:
            with pytest.raises(ValueError, match="Q2_K"):
                ours.dequantize(t.name)
            continue
        expected = gguf_dequantize(t.data, t.tensor_type)
        np.testing.assert_array_equal(ours.dequantize(t.name), expected.reshape(info.shape))


def test_embedded_metadata_matches_gguf_package(reader: GGUFReader, ref_reader) -> None:
    ref = ref_reader
    assert reader.version == 3
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        got = reader.metadata[key]
        got = got.tolist() if isinstance(got, np.ndarray) else got
        if isinstance(expected, float):
            assert got == pytest.approx(expected), key
        else:
            assert got == expected, key
    assert reader.metadata["general.architecture"] == "llama"
    assert len(reader.metadata["tokenizer.ggml.tokens"]) == 49152
    assert "<|im_start|>" in reader.metadata["tokenizer.chat_template"]


def test_embedded_config(reader: GGUFReader) -> None:
    config = gguf_to_hf_config(reader)
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "attention_bias": False,
        "rope_theta": 100000.0,
        "rope_scaling": None,
    }
    assert {k: config[k] for k in expected} == expected
    assert config["rms_norm_eps"] == pytest.approx(1e-5)


def test_every_embedded_tensor_matches_gguf_package(reader: GGUFReader, ref_reader) -> None:
    ref = ref_reader
    assert len(reader.tensors) == len(ref.tensors) == 272
    for t in ref.tensors:
        info = reader.tensors[t.name]
        assert info.shape == tuple(int(d) for d in reversed(t.shape))
        expected = gguf_dequantize(t.data, t.tensor_type).reshape(info.shape)
        np.testing.assert_array_equal(reader.dequantize(t.name), expected, err_msg=t.name)


def test_reverse_permute_undoes_llama_cpp_permute() -> None:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute, applied to HF Q/K rows.
    def permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return (
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape)
        )

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    assert not np.array_equal(permute(w, 3), w)
    np.testing.assert_array_equal(reverse_permute_qk(permute(w, 3), 3), w)
    b = np.arange(24, dtype=np.float32)
    np.testing.assert_array_equal(reverse_permute_qk(permute(b, 3), 3), b)


def test_weight_names_follow_hf(reader: GGUFReader) -> None:
    names = [gguf_name_to_hf(n) for n in reader.tensors]
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    assert "lm_head.weight" not in names  # tied
    for i in (0, 29):
        for part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
                     "post_attention_layernorm"):  # fmt: skip
            assert f"model.layers.{i}.{part}.weight" in names
    assert gguf_name_to_hf("blk.3.attn_q_norm.weight") == "model.layers.3.self_attn.q_norm.weight"
    assert gguf_name_to_hf("output.weight") == "lm_head.weight"
    assert gguf_name_to_hf("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="blk.0.mystery"):
        gguf_name_to_hf("blk.0.mystery.weight")


def test_qwen_configs() -> None:
    base = {"embedding_length": 1024, "block_count": 2, "feed_forward_length": 3072,
            "attention.head_count": 16, "attention.head_count_kv": 8, "context_length": 4096,
            "rope.freq_base": 1e6, "attention.layer_norm_rms_epsilon": 1e-6}  # fmt: skip
    tokens = ["a", "b", "c"]
    qwen3 = {f"qwen3.{k}": v for k, v in base.items()} | {
        "general.architecture": "qwen3", "qwen3.attention.key_length": 128,
        "tokenizer.ggml.tokens": tokens,
    }  # fmt: skip
    cfg = gguf_to_hf_config(qwen3, ["token_embd.weight", "output.weight"])
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["head_dim"] == 128
    assert cfg["vocab_size"] == 3 and cfg["tie_word_embeddings"] is False
    qwen2 = {f"qwen2.{k}": v for k, v in base.items()} | {"general.architecture": "qwen2"}
    cfg = gguf_to_hf_config(
        qwen2 | {"qwen2.rope.scaling.type": "linear", "qwen2.rope.scaling.factor": 2.0}
    )
    assert cfg["attention_bias"] is True and cfg["head_dim"] == 64
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    with pytest.raises(ValueError, match="gpt2"):
        gguf_to_hf_config({"general.architecture": "gpt2"})


def test_missing_file() -> None:
    with pytest.raises(ValueError, match="does not exist"):
        GGUFReader("/nonexistent/model.gguf")


def test_bad_magic(tmp_path) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="bad magic"):
        GGUFReader(path)


def test_unsupported_version(tmp_path) -> None:
    path = tmp_path / "v9.gguf"
    path.write_bytes(b"GGUF" + (9).to_bytes(4, "little") + bytes(60))
    with pytest.raises(ValueError, match="version 9"):
        GGUFReader(path)


def test_truncated_file(tmp_path) -> None:
    src = embedded_model_path()
    path = tmp_path / "truncated.gguf"
    with open(src, "rb") as f_in, open(path, "wb") as f_out:
        shutil.copyfileobj(f_in, f_out)
        f_out.truncate(os.path.getsize(src) - 1000)
    with pytest.raises(ValueError, match=r"truncated.*tensor"):
        GGUFReader(path)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(open(src, "rb").read(4000))
    with pytest.raises(ValueError, match="truncated"):
        GGUFReader(header_only)


@pytest.mark.slow
def test_weights_equal_transformers_state_dict() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    state_dict = model.state_dict()
    ours = dict(iter_gguf_weights(path))
    assert set(ours) == set(state_dict) - {"lm_head.weight"}  # tied to embed_tokens
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, state_dict[name], rtol=0, atol=0, msg=name)
