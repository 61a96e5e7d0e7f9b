"""GGUF files: our own reader and the mapping to Hugging Face names.

This module owns everything a `.gguf` file holds for the engine: the header, the metadata
key/values (llama.cpp's names), the tensor table, and the tensor data, memory-mapped with numpy
and dequantized to float32 by `gguf_quants` (ggml's block layouts; its names are re-exported
here). It turns the metadata into the equivalent of a Hugging Face `config.json`
(`gguf_to_hf_config`) and yields the weights under HF parameter names in the HF layout
(`iter_gguf_weights`), undoing the Q/K row permutation that llama.cpp's converter applies to
Llama checkpoints; the architectures laid out differently (Gemma 2/3, Phi-3) are described in
`gguf_archs`. It needs numpy only (torch for the yielded tensors); the `gguf` package is a test
oracle, never imported here.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagoda.model.loader.gguf_archs import (
    LAYER_NAMES,
    ROPE_FACTOR_TENSORS,
    arch_config,
    norm_offset,
)
from pagoda.model.loader.gguf_quants import (
    GGML_BLOCK_SIZES,
    QK_K,
    SUPPORTED_GGML_TYPES,
    GGMLType,
    dequantize,
)

__all__ = [
    "GGML_BLOCK_SIZES",
    "QK_K",
    "SUPPORTED_GGML_TYPES",
    "GGMLType",
    "GGUFReader",
    "GGUFTensorInfo",
    "QUANT_KERNEL_TYPES",
    "dequantize",
    "gguf_name_to_hf",
    "gguf_config_keys",
    "gguf_to_hf_config",
    "iter_gguf_weights",
    "reverse_permute_qk",
]

GGUF_MAGIC = b"GGUF"
GGUF_DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (scalars) ; 8 = string, 9 = array.
_U64 = struct.Struct("<Q")
_SCALAR_FORMATS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd"))
_NUMPY_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip
_STRING, _ARRAY = 8, 9
# Numeric arrays at least this long stay numpy arrays (token types, scores); shorter become lists.
_LIST_MAX_LEN = 1024


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

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a tokenizer's vocabulary and merges: ~10^5 of them), in
        one loop without a call per value."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        unpack = _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                self._take(end + 1)  # the truncation error
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                self._take(end + 1)
            out.append(str(buf[pos : pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar(4), self.scalar(10)
            if etype == _STRING:
                return self.strings(count)
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


_PARSED: dict[tuple[str, int, int], tuple] = {}


class GGUFReader:
    """Parses a GGUF (v2/v3) file and memory-maps its tensor data."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        if os.path.isdir(self.path):
            raise ValueError(f"{self.path} is a directory: pass the path of a .gguf file")
        if not os.path.isfile(self.path):
            raise ValueError(f"GGUF file {self.path} does not exist: pass the path of a .gguf file")
        file_size = os.path.getsize(self.path)
        if file_size < 24:
            raise ValueError(f"GGUF file {self.path} is truncated ({file_size} bytes)")
        self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        # The config, the tokenizer and the weights each open the file: its header (a
        # vocabulary of ~10^5 strings, most of a second) is parsed once per process and file.
        st = os.stat(self.path)
        key = (os.path.realpath(self.path), st.st_mtime_ns, st.st_size)
        if key not in _PARSED:
            self._parse(file_size)
            _PARSED.clear()  # one file at a time is what a process loads
            _PARSED[key] = (self.version, self.metadata, self.alignment, self.data_offset,
                            self.tensors)  # fmt: skip
        version, metadata, self.alignment, self.data_offset, tensors = _PARSED[key]
        self.version, self.metadata, self.tensors = version, dict(metadata), dict(tensors)

    def _parse(self, file_size: int) -> None:
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
            if key in self.metadata:  # llama.cpp refuses the file too: which value holds?
                raise ValueError(f"GGUF file {self.path} has metadata key {key} twice")
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
        # Where the next tensor's data must start: as llama.cpp (gguf.c), the tensors follow
        # one another in the table's order, each padded to the alignment. A type or shape that
        # does not match the bytes written (a hand-edited or corrupt table) moves every tensor
        # after it, which would otherwise load as other bytes: a model giving garbage.
        expected_offset = 0
        for name, dims, ggml_type, rel_offset in infos:
            if name in self.tensors:
                raise ValueError(f"GGUF file {self.path}: tensor {name} is in the table twice")
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
            shape = tuple(int(d) for d in reversed(dims))
            if rel_offset != expected_offset:
                prev = next(reversed(self.tensors.values()), None)
                before = (
                    f"{prev.name} before it ({prev.type_name}, shape {list(prev.shape)}) ends"
                    if prev is not None
                    else "the data section starts"
                )
                raise ValueError(
                    f"GGUF file {self.path}: tensor {name} starts at data offset {rel_offset}, "
                    f"but {before} at {expected_offset}: the tensor table does not match the "
                    "data written (a type or shape changed, or a corrupt file); convert the "
                    "model again"
                )
            expected_offset += -(-nbytes // self.alignment) * self.alignment
            offset = self.data_offset + rel_offset
            if offset + nbytes > file_size:
                raise ValueError(
                    f"GGUF file {self.path} is truncated: tensor {name} needs bytes "
                    f"[{offset}, {offset + nbytes}) but the file has {file_size}; download it again"
                )
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
    "qwen2moe": ("Qwen2MoeForCausalLM", "qwen2_moe"),
    "qwen3moe": ("Qwen3MoeForCausalLM", "qwen3_moe"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "phi3": ("Phi3ForCausalLM", "phi3"),
    "granite": ("GraniteForCausalLM", "granite"),
    "olmo2": ("Olmo2ForCausalLM", "olmo2"),
}
# Mixtures of experts by architecture (Mixtral is `llama` with an expert_count).
_MOE_ARCHS = ("qwen2moe", "qwen3moe")
# llama.cpp's converter interleaves the rotary halves of Q/K rows for these (LlamaModel.permute).
_PERMUTED_QK_ARCHS = ("llama", "mistral", "granite")
_FILE_TYPE_DTYPES = {0: "float32", 1: "float16", 32: "bfloat16"}
# The types pagoda.kernels.cpu.quant multiplies in their blocks (quantization="gguf").
QUANT_KERNEL_TYPES = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q8_0, GGMLType.Q4_K, GGMLType.Q5_K,
                      GGMLType.Q6_K)  # fmt: skip

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
    "ffn_gate_inp": "mlp.gate",  # a MoE layer's router
}
# A MoE layer's experts stacked in one tensor [E, rows, cols]: yielded per expert, HF's names.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}  # fmt: skip
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors with no HF parameter: precomputed llama3 rope factors (derived from config instead),
# Phi-3's LongRoPE factors (read into the config).
_SKIPPED_TENSORS = ("rope_freqs.weight", *ROPE_FACTOR_TENSORS)


def _architecture(metadata: Mapping[str, Any]) -> str:
    arch = metadata.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHITECTURES)})"
        )
    return arch


def _int(value: Any, key: str) -> int:
    """A metadata value that must be an integer (GGUF types it; a malformed file may not)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"GGUF key {key} must be an integer, got {value!r:.100}")
    return int(value)


def _float(value: Any, key: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise ValueError(f"GGUF key {key} must be a number, got {value!r:.100}")
    return float(value)


def _one_value(value: Any, key: str) -> int:
    # Some files store a per-layer list (e.g. head_count_kv); Pagoda needs one value for all layers.
    if isinstance(value, (list, np.ndarray)):
        values = set(_int(v, key) for v in value)
        if len(values) != 1:
            raise ValueError(
                f"GGUF key {key} differs across layers ({sorted(values)}): not supported"
            )
        return values.pop()
    return _int(value, key)


# config.json field -> the GGUF key (after "{arch}.") it is read from, for error messages.
_CONFIG_KEYS = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length",
    "vocab_size": "vocab_size",
    "sliding_window": "attention.sliding_window",
}


def gguf_config_keys(metadata: Mapping[str, Any]) -> dict[str, str]:
    """config.json field -> the GGUF metadata key it came from (`validate_hf_config`'s names)."""
    arch = metadata.get("general.architecture")
    keys = {field: f"{arch}.{key}" for field, key in _CONFIG_KEYS.items()}
    if f"{arch}.vocab_size" not in metadata:
        keys["vocab_size"] = "the length of tokenizer.ggml.tokens"
    return keys


def gguf_to_hf_config(
    metadata: Mapping[str, Any] | GGUFReader, tensor_names: Iterable[str] | None = None
) -> dict[str, Any]:
    """The Hugging Face `config.json` equivalent of a GGUF file's metadata.

    Pass the reader (or the tensor names) so that tied embeddings and attention biases are read
    from the tensors present rather than guessed from the architecture.
    """
    reader = metadata if isinstance(metadata, GGUFReader) else None
    if reader is not None:
        tensor_names = tensor_names if tensor_names is not None else reader.tensors.keys()
        metadata = reader.metadata
    names = set(tensor_names) if tensor_names is not None else None
    arch = _architecture(metadata)
    hf_arch, model_type = _ARCHITECTURES[arch]

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    required = ("embedding_length", "block_count", "attention.head_count", "feed_forward_length")
    if arch in _MOE_ARCHS:
        required += ("expert_count", "expert_used_count")
    for key in required:
        if get(key) is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}: the file is incomplete")
    num_heads = _one_value(get("attention.head_count"), f"{arch}.attention.head_count")
    num_kv_heads = _one_value(
        get("attention.head_count_kv", num_heads), f"{arch}.attention.head_count_kv"
    )
    hidden_size = _int(get("embedding_length"), f"{arch}.embedding_length")
    vocab_size = get("vocab_size")
    if vocab_size is None:
        vocab_size = len(metadata.get("tokenizer.ggml.tokens", ()))
    rope_scaling = None
    scaling_type = get("rope.scaling.type")
    if scaling_type in ("linear", "yarn") and get("rope.scaling.factor"):
        factor = _float(get("rope.scaling.factor"), f"{arch}.rope.scaling.factor")
        rope_scaling = {"rope_type": scaling_type, "factor": factor}
        if get("rope.scaling.original_context_length"):
            rope_scaling["original_max_position_embeddings"] = _int(
                get("rope.scaling.original_context_length"),
                f"{arch}.rope.scaling.original_context_length",
            )
    if names is not None:
        tie = "output.weight" not in names
        attention_bias = "blk.0.attn_q.bias" in names
    else:
        tie, attention_bias = True, arch in ("qwen2", "qwen2moe")
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "intermediate_size": _one_value(get("feed_forward_length"), f"{arch}.feed_forward_length"),
        "num_hidden_layers": _int(get("block_count"), f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": _int(
            get("attention.key_length") or hidden_size // max(num_heads, 1),
            f"{arch}.attention.key_length",
        ),
        "rms_norm_eps": _float(
            get("attention.layer_norm_rms_epsilon", 1e-6),
            f"{arch}.attention.layer_norm_rms_epsilon",
        ),
        "rope_theta": _float(get("rope.freq_base", 10000.0), f"{arch}.rope.freq_base"),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": _int(get("context_length", 2048), f"{arch}.context_length"),
        "vocab_size": _int(vocab_size, f"{arch}.vocab_size"),
        "tie_word_embeddings": tie,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": metadata.get("tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
        "attention_bias": attention_bias,
        # Quantized files dequantize to float; float16 matches ggml's f16 block scales.
        "torch_dtype": _FILE_TYPE_DTYPES.get(metadata.get("general.file_type"), "float16"),
    }
    if reader is not None and any(
        t.ggml_type in QUANT_KERNEL_TYPES for t in reader.tensors.values()
    ):
        # blocks the quantized CPU GEMM can keep: the engine selects quantization="gguf"
        config["quantization_config"] = {"quant_method": "gguf"}
    if get("expert_count"):  # a mixture of experts (llama with experts: Mixtral)
        experts = _int(get("expert_count"), f"{arch}.expert_count")
        config["num_experts_per_tok"] = _int(get("expert_used_count"), f"{arch}.expert_used_count")
        if arch == "llama":
            config.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                          num_local_experts=experts)  # fmt: skip
        else:  # experts on every layer; llama.cpp renormalizes Qwen3-MoE's top-k weights only
            config.update(num_experts=experts, norm_topk_prob=arch == "qwen3moe")
            # llama.cpp's sizes where a key is absent: feed_forward_length / expert_used_count
            # for the experts, feed_forward_length for Qwen2-MoE's shared expert
            config["moe_intermediate_size"] = _int(
                get("expert_feed_forward_length")
                or config["intermediate_size"] // max(config["num_experts_per_tok"], 1),
                f"{arch}.expert_feed_forward_length",
            )
        if arch == "qwen2moe":  # the shared expert and its gate (gguf_archs), q/k/v biases
            config["shared_expert_intermediate_size"] = _int(
                get("expert_shared_feed_forward_length") or config["intermediate_size"],
                f"{arch}.expert_shared_feed_forward_length",
            )
            config["qkv_bias"] = attention_bias
    if get("attention.sliding_window"):
        config["sliding_window"] = _int(
            get("attention.sliding_window"), f"{arch}.attention.sliding_window"
        )
    read_tensor = reader.dequantize if reader is not None else None
    config.update(arch_config(arch, config, get, read_tensor, names))
    return config


def gguf_name_to_hf(name: str, arch: str = "llama") -> str | None:
    """HF parameter name of a GGUF tensor of architecture `arch`, or None for tensors HF models
    do not hold."""
    if name in _SKIPPED_TENSORS:
        return None
    parts = name.split(".")
    arch_names = LAYER_NAMES.get(arch, {})
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in arch_names:
        return f"model.layers.{parts[1]}.{arch_names[parts[2]]}.{parts[3]}"
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _EXPERT_NAMES:
        return f"model.layers.{parts[1]}.mlp.experts.{{}}.{_EXPERT_NAMES[parts[2]]}.{parts[3]}"
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


def iter_gguf_weights(
    reader_or_path: GGUFReader | str, keep_quantized: Iterable[int] = ()
) -> Iterator[tuple[str, Any]]:
    """Yield (HF parameter name, float32 torch.Tensor) for every weight of the file; matrices
    of a ggml type in `keep_quantized` come as their blocks instead, a
    `pagoda.kernels.cpu.quant.QuantWeight` (rows un-permuted like the dense ones). A MoE
    layer's stacked experts (`ffn_*_exps`, [E, rows, cols]) come one expert at a time, as
    `...mlp.experts.{e}.gate_proj.weight` etc., blocks or float alike."""
    import torch

    reader = (
        reader_or_path if isinstance(reader_or_path, GGUFReader) else GGUFReader(reader_or_path)
    )
    arch = _architecture(reader.metadata)
    config = gguf_to_hf_config(reader)
    keep_quantized = set(keep_quantized)
    for name, info in reader.tensors.items():
        try:
            hf_name = gguf_name_to_hf(name, arch)
        except ValueError as e:
            raise ValueError(f"GGUF file {reader.path}: {e}") from None
        if hf_name is None:
            continue
        # The router and Qwen2-MoE's shared expert gate (`ffn_gate_inp_shexp`) stay float.
        blocks = (info.ggml_type in keep_quantized and len(info.shape) in (2, 3)
                  and ".ffn_gate_inp" not in name)  # fmt: skip
        if blocks:  # [(experts,) rows, bytes per row]: a row permutation keeps blocks whole
            weight = reader.raw(name).reshape(*info.shape[:-1], -1)  # the memory map's bytes
            if len(info.shape) == 2:
                weight = np.array(weight)
        else:
            weight = reader.dequantize(name)
            if offset := norm_offset(arch, name):
                weight = weight + np.float32(offset)
            if ".ffn_gate_inp_shexp." in name:  # [hidden] from older converters: HF's [1, hidden]
                weight = weight.reshape(1, -1)
        if arch in _PERMUTED_QK_ARCHS and (".attn_q." in name or ".attn_k." in name):
            n_head = config["num_attention_heads" if ".attn_q." in name else "num_key_value_heads"]
            weight = reverse_permute_qk(weight, n_head)
        if "{}" in hf_name:  # stacked experts: one tensor per expert (blocks: read from the map)
            for expert, w in enumerate(weight):
                tensor = torch.from_numpy(np.array(w) if blocks else np.ascontiguousarray(w))
                yield hf_name.format(expert), _blocks(tensor, info) if blocks else tensor
            continue
        tensor = torch.from_numpy(np.ascontiguousarray(weight))
        yield hf_name, _blocks(tensor, info) if blocks else tensor


def _blocks(data: Any, info: GGUFTensorInfo) -> Any:
    """`data` [rows, bytes per row], a 2-D tensor's or one expert's of a stacked one, as the
    `QuantWeight` of its rows."""
    from pagoda.kernels.cpu.quant import QuantWeight

    return QuantWeight(data, info.ggml_type, *info.shape[-2:])
