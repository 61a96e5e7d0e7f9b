"""GGUF files: our own reader, ggml dequantization, and the mapping to Hugging Face names.

This module owns everything a `.gguf` file holds for the engine: the header, the metadata
key/values (llama.cpp's names), the tensor table, and the tensor data, memory-mapped with numpy
and dequantized to float32 following ggml's block layouts (ggml-quants.c). It turns the metadata
into the equivalent of a Hugging Face `config.json` (`gguf_to_hf_config`) and yields the weights
under HF parameter names in the HF layout (`iter_gguf_weights`), undoing the Q/K row permutation
that llama.cpp's converter applies to Llama checkpoints. It needs numpy only (torch for the
yielded tensors); the `gguf` package is a test oracle, never imported here.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32
QK_K = 256  # super-block size of the k-quants

# GGUF metadata value types -> struct format (scalars) ; 8 = string, 9 = array.
_SCALAR_FORMATS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd"))
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip
_STRING, _ARRAY = 8, 9
# Numeric arrays at least this long stay numpy arrays (token types, scores); shorter become lists.
_LIST_MAX_LEN = 1024


class GGMLType:
    F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
    Q4_K, Q5_K, Q6_K, BF16 = 12, 13, 14, 30
    NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
             10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
             17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
             23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
             30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}  # fmt: skip


# ggml type -> (elements per block, bytes per block); the sizes of every type we can at least skip.
GGML_BLOCK_SIZES: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 40), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
    15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18),
    21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4),
    27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17),
}  # fmt: skip


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch/HF order: the reverse of ggml's ne[] dims
    ggml_type: int
    offset: int  # absolute byte offset of the data in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGMLType.NAMES.get(self.ggml_type, f"type {self.ggml_type}")


# --------------------------------------------------------------------------------------------
# Dequantization: each function maps blocks [n_blocks, bytes_per_block] uint8 to
# [n_blocks, elements_per_block] float32, bit-for-bit as ggml's dequantize_row_* does.
# --------------------------------------------------------------------------------------------


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)  # [n, 1]


def _low_high_nibbles(qs: np.ndarray) -> np.ndarray:
    # qs [n, 16] -> [n, 32]: element j is the low nibble of byte j, element j+16 its high nibble.
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    # qh [n, 4] little-endian uint32 -> [n, count] bits, bit j for element j.
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")[:, :count]


def _dequant_q4_0(b: np.ndarray) -> np.ndarray:
    q = _low_high_nibbles(b[:, 2:]).astype(np.int8) - 8
    return _f16(b[:, :2]) * q.astype(np.float32)


def _dequant_q4_1(b: np.ndarray) -> np.ndarray:
    q = _low_high_nibbles(b[:, 4:]).astype(np.float32)
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _dequant_q5_0(b: np.ndarray) -> np.ndarray:
    q = _low_high_nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6], 32) << 4)
    return _f16(b[:, :2]) * (q.astype(np.int8) - 16).astype(np.float32)


def _dequant_q5_1(b: np.ndarray) -> np.ndarray:
    q = _low_high_nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8], 32) << 4)
    return _f16(b[:, :2]) * q.astype(np.float32) + _f16(b[:, 2:4])


def _dequant_q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, :2]) * np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # get_scale_min_k4: 8 six-bit scales and 8 six-bit mins packed in 12 bytes.
    q = scales.astype(np.uint8)
    sc = np.concatenate([q[:, 0:4] & 63, (q[:, 8:12] & 0x0F) | ((q[:, 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)  # [n, 8] each


def _dequant_q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qs = b[:, 16:144].reshape(n, 4, 1, 32)  # 4 chunks of 64 values: low nibbles then high
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32).astype(np.float32)
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, QK_K)


def _dequant_q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48].reshape(n, 1, 32)  # bit i of qh[l] is the 5th bit of sub-block i, value l
    ql = b[:, 48:176].reshape(n, 4, 1, 32)
    q = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 8, 32)
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = (q | (((qh >> shifts) & 1) << 4)).astype(np.float32)
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, QK_K)


def _dequant_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [half, 32-byte group, l]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)  # [n, 16]
    d = _f16(b[:, 208:210])
    # Per 128-value half: q1 = ql[l] lo | qh bits 0-1, q2 = ql[l+32] lo | bits 2-3,
    # q3 = ql[l] hi | bits 4-5, q4 = ql[l+32] hi | bits 6-7.
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [n, 2, 4, 32]: q1, q2, q3, q4
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = ((low | (high << 4)).astype(np.int8) - 32).astype(np.float32).reshape(n, 16, 16)
    return ((d * scales)[:, :, None] * q).reshape(n, QK_K)


_DEQUANTIZERS = {
    GGMLType.Q4_0: _dequant_q4_0,
    GGMLType.Q4_1: _dequant_q4_1,
    GGMLType.Q5_0: _dequant_q5_0,
    GGMLType.Q5_1: _dequant_q5_1,
    GGMLType.Q8_0: _dequant_q8_0,
    GGMLType.Q4_K: _dequant_q4_k,
    GGMLType.Q5_K: _dequant_q5_k,
    GGMLType.Q6_K: _dequant_q6_k,
}
SUPPORTED_GGML_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, *_DEQUANTIZERS)


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Raw tensor bytes (uint8) of `ggml_type` -> float32 array of `shape` (HF order)."""
    raw = np.asarray(data, dtype=np.uint8).reshape(-1)
    if ggml_type == GGMLType.F32:
        out = raw.view(np.float32).copy()
    elif ggml_type == GGMLType.F16:
        out = raw.view(np.float16).astype(np.float32)
    elif ggml_type == GGMLType.BF16:
        out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif ggml_type in _DEQUANTIZERS:
        _, type_size = GGML_BLOCK_SIZES[ggml_type]
        out = _DEQUANTIZERS[ggml_type](raw.reshape(-1, type_size))
    else:
        name = GGMLType.NAMES.get(ggml_type, str(ggml_type))
        raise ValueError(f"ggml type {name} is not supported")
    return out.reshape(shape)


# --------------------------------------------------------------------------------------------
# The file.
# --------------------------------------------------------------------------------------------


class _Cursor:
    """Reads little-endian GGUF values from a buffer, failing with a named ValueError."""

    def __init__(self, buf: memoryview, path: str) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def _take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ValueError(f"GGUF file {self.path} is truncated (header or metadata ends early)")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, vtype: int) -> Any:
        fmt = _SCALAR_FORMATS[vtype]
        return struct.unpack("<" + fmt, self._take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar(10)
        return bytes(self._take(n)).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar(4), self.scalar(10)
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype == _ARRAY:
                return [self.value(self.scalar(4)) for _ in range(count)]
            if etype not in _NUMPY_DTYPES:
                raise ValueError(f"GGUF file {self.path} has an array of unknown type {etype}")
            dtype = np.dtype(_NUMPY_DTYPES[etype]).newbyteorder("<")
            arr = np.frombuffer(self._take(count * dtype.itemsize), dtype=dtype).copy()
            return arr if count >= _LIST_MAX_LEN else arr.tolist()
        if vtype not in _SCALAR_FORMATS:
            raise ValueError(f"GGUF file {self.path} has a metadata value of unknown type {vtype}")
        return self.scalar(vtype)


class GGUFReader:
    """Parses a GGUF (v2/v3) file and memory-maps its tensor data."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise ValueError(f"GGUF file {self.path} does not exist: pass the path of a .gguf file")
        file_size = os.path.getsize(self.path)
        if file_size < 24:
            raise ValueError(f"GGUF file {self.path} is truncated ({file_size} bytes)")
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._mmap), self.path)
        if bytes(cur._take(4)) != GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (bad magic; expected b'GGUF')")
        self.version = cur.scalar(4)
        if self.version not in (2, 3):
            raise ValueError(
                f"GGUF file {self.path} has unsupported version {self.version} (supported: 2, 3; "
                "a big-endian file or a very old one must be re-converted with llama.cpp)"
            )
        n_tensors, n_kv = cur.scalar(10), cur.scalar(10)
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar(4))
        self.alignment = int(self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment % 8:
            raise ValueError(
                f"GGUF file {self.path} has invalid general.alignment {self.alignment}"
            )
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            dims = [cur.scalar(10) for _ in range(cur.scalar(4))]
            infos.append((name, dims, cur.scalar(4), cur.scalar(10)))
        self.data_offset = -(-cur.pos // self.alignment) * self.alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, ggml_type, rel_offset in infos:
            if ggml_type not in GGML_BLOCK_SIZES:
                raise ValueError(
                    f"GGUF file {self.path}: tensor {name} has unknown ggml type {ggml_type}"
                )
            block, type_size = GGML_BLOCK_SIZES[ggml_type]
            n_elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
            if dims and dims[0] % block:
                raise ValueError(
                    f"GGUF file {self.path}: tensor {name} row of {dims[0]} is not a multiple of "
                    f"the {GGMLType.NAMES.get(ggml_type)} block size {block}"
                )
            nbytes = n_elements // block * type_size
            offset = self.data_offset + rel_offset
            if offset + nbytes > file_size:
                raise ValueError(
                    f"GGUF file {self.path} is truncated: tensor {name} needs bytes "
                    f"[{offset}, {offset + nbytes}) but the file has {file_size}; download it again"
                )
            shape = tuple(int(d) for d in reversed(dims))
            self.tensors[name] = GGUFTensorInfo(name, shape, ggml_type, offset, nbytes)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view into the memory map."""
        info = self._info(name)
        return self._mmap[info.offset : info.offset + info.nbytes]

    def dequantize(self, name: str) -> np.ndarray:
        info = self._info(name)
        if info.ggml_type not in SUPPORTED_GGML_TYPES:
            raise ValueError(
                f"GGUF file {self.path}: tensor {name} has type {info.type_name}, which Pagoda "
                f"cannot dequantize (supported: {', '.join(GGMLType.NAMES[t] for t in SUPPORTED_GGML_TYPES)})"
            )
        return dequantize(self.raw(name), info.ggml_type, info.shape)

    def _info(self, name: str) -> GGUFTensorInfo:
        if name not in self.tensors:
            raise ValueError(f"GGUF file {self.path} has no tensor named {name!r}")
        return self.tensors[name]


# --------------------------------------------------------------------------------------------
# Hugging Face equivalents: config.json and parameter names.
# --------------------------------------------------------------------------------------------

_ARCHITECTURES = {  # general.architecture -> (HF architecture, model_type)
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# llama.cpp's converter interleaves the rotary halves of Q/K rows for these (LlamaModel.permute).
_PERMUTED_QK_ARCHS = ("llama", "mistral")
_FILE_TYPE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors with no HF parameter: precomputed llama3 rope factors (derived from config instead).
_SKIPPED_TENSORS = ("rope_freqs.weight",)


def _architecture(metadata: Mapping[str, Any]) -> str:
    arch = metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHITECTURES)})"
        )
    return arch


def _one_value(value: Any, key: str) -> int:
    # Some files store a per-layer list (e.g. head_count_kv); Pagoda needs one value for all layers.
    if isinstance(value, (list, np.ndarray)):
        values = set(int(v) for v in value)
        if len(values) != 1:
            raise ValueError(
                f"GGUF key {key} differs across layers ({sorted(values)}): not supported"
            )
        return values.pop()
    return int(value)


def gguf_to_hf_config(
    metadata: Mapping[str, Any] | GGUFReader, tensor_names: Iterable[str] | None = None
) -> dict[str, Any]:
    """The Hugging Face `config.json` equivalent of a GGUF file's metadata.

    Pass the reader (or the tensor names) so that tied embeddings and attention biases are read
    from the tensors present rather than guessed from the architecture.
    """
    if isinstance(metadata, GGUFReader):
        tensor_names = tensor_names if tensor_names is not None else metadata.tensors.keys()
        metadata = metadata.metadata
    names = set(tensor_names) if tensor_names is not None else None
    arch = _architecture(metadata)
    hf_arch, model_type = _ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    for key in ("embedding_length", "block_count", "attention.head_count"):
        if get(key) is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}: the file is incomplete")
    num_heads = _one_value(get("attention.head_count"), f"{arch}.attention.head_count")
    num_kv_heads = _one_value(
        get("attention.head_count_kv", num_heads), f"{arch}.attention.head_count_kv"
    )
    hidden_size = int(get("embedding_length"))
    vocab_size = get("vocab_size")
    if vocab_size is None:
        vocab_size = len(metadata.get("tokenizer.ggml.tokens", ()))
    rope_scaling = None
    scaling_type = get("rope.scaling.type")
    if scaling_type in ("linear", "yarn") and get("rope.scaling.factor"):
        rope_scaling = {"rope_type": scaling_type, "factor": float(get("rope.scaling.factor"))}
        if get("rope.scaling.original_context_length"):
            rope_scaling["original_max_position_embeddings"] = int(
                get("rope.scaling.original_context_length")
            )
    if names is not None:
        tie = "output.weight" not in names
        attention_bias = "blk.0.attn_q.bias" in names
    else:
        tie, attention_bias = True, arch == "qwen2"
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "intermediate_size": _one_value(get("feed_forward_length"), f"{arch}.feed_forward_length"),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": int(get("attention.key_length") or hidden_size // num_heads),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(vocab_size),
        "tie_word_embeddings": tie,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
        "attention_bias": attention_bias,
        # Quantized files dequantize to float; float16 matches ggml's f16 block scales.
        "torch_dtype": _FILE_TYPE_DTYPES.get(metadata.get("general.file_type"), "float16"),
    }
    if get("attention.sliding_window"):
        config["sliding_window"] = int(get("attention.sliding_window"))
    return config


def gguf_name_to_hf(name: str) -> str | None:
    """HF parameter name of a GGUF tensor, or None for tensors HF models do not hold."""
    if name in _SKIPPED_TENSORS:
        return None
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"GGUF tensor {name!r} has no Hugging Face equivalent that Pagoda knows")


def reverse_permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of Q/K rows (transformers' `_reverse_permute_weights`).

    The converter regroups each head's rows from [half0 | half1] to interleaved pairs so that
    ggml's rope (adjacent pairs) matches HF's rotate_half (split halves); we swap them back.
    """
    dim = weight.shape[0] // n_head // 2
    w = weight.reshape(n_head, dim, 2, *weight.shape[1:])
    return w.swapaxes(2, 1).reshape(weight.shape)


def iter_gguf_weights(reader_or_path: GGUFReader | str) -> Iterator[tuple[str, Any]]:
    """Yield (HF parameter name, float32 torch.Tensor) for every weight of the file."""
    import torch

    reader = (
        reader_or_path if isinstance(reader_or_path, GGUFReader) else GGUFReader(reader_or_path)
    )
    arch = _architecture(reader.metadata)
    config = gguf_to_hf_config(reader)
    for name in reader.tensors:
        hf_name = gguf_name_to_hf(name)
        if hf_name is None:
            continue
        weight = reader.dequantize(name)
        if arch in _PERMUTED_QK_ARCHS and (".attn_q." in name or ".attn_k." in name):
            n_head = config["num_attention_heads" if ".attn_q." in name else "num_key_value_heads"]
            weight = reverse_permute_qk(weight, n_head)
        yield hf_name, torch.from_numpy(np.ascontiguousarray(weight))
