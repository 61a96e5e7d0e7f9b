"""ctypes side of `decoder.c`: a Llama-family decoder stack in one C call per step.

`DecoderSpec` / `LayerSpec` / `PartSpec` describe a model in plain values (weight tensors,
norms, shapes); `CpuDecoderStack` turns them into the C structs once and runs a step. The
kernels it calls are the ones the layers call one by one (`ops.py`, `quant.py`,
`pagoda.attention.cpu`), handed over as function pointers, so both paths compute the same
values in the same order. Which models and steps qualify is the caller's business
(`pagoda.model.models.llama_cpu_decoder`).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from pagoda.utils import cpu_kernels
from pagoda.utils.cpu_build import build_library, open_library

SOURCE, _, ISA = cpu_kernels.DECODER  # portable: the kernels it calls are built per ISA level
_ABI = 5
MAX_PARTS = 4
PART_QUANT, PART_PACKED, PART_GEMV = 0, 1, 2
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ROPE_POSITION_ERROR = -100

_p, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class _Part(ctypes.Structure):
    _fields_ = [
        ("kind", _i32),
        ("ggml_type", _i32),
        ("x8", _i32),
        ("pad", _i32),
        ("w", _p),
        ("w_stride", _i64),
        ("bias", _p),
        ("col", _i64),
        ("n", _i64),
    ]


class _Linear(ctypes.Structure):
    _fields_ = [
        ("num_parts", _i32),
        ("pad", _i32),
        ("n", _i64),
        ("k", _i64),
        ("perm", _p),
        ("parts", _Part * MAX_PARTS),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("input_norm", _p),
        ("post_norm", _p),
        ("q_norm", _p),
        ("k_norm", _p),
        ("k_cache", _p),
        ("v_cache", _p),
        ("sliding_window", _i32),
        ("k_scale", _f32),
        ("v_scale", _f32),
        ("pad", _i32),
    ]


class _Decoder(ctypes.Structure):
    _fields_ = [
        ("quant_gemm", _p),
        ("gemv", _p),
        ("gemm_packed", _p),
        ("rms_norm", _p),
        ("silu_and_mul", _p),
        ("rope", _p),
        ("attention", _p),
        ("write_kv", _p),
        ("layers", ctypes.POINTER(_Layer)),
        ("final_norm", _p),
        ("cos_sin", _p),
        ("max_position", _i64),
        ("num_layers", _i32),
        ("hidden", _i32),
        ("num_heads", _i32),
        ("num_kv_heads", _i32),
        ("head_size", _i32),
        ("inter", _i32),
        ("rot", _i32),
        ("block_size", _i32),
        ("dt", _i32),
        ("norm_dt", _i32),
        ("cache_dt", _i32),
        ("pad", _i32),
        ("eps", _f32),
        ("scale", _f32),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        ("rows", _i64),
        ("positions", _p),
        ("slots", _p),
        ("block_tables", _p),
        ("seq_lens", _p),
        ("query_start_loc", _p),
        ("items", _p),
        ("block_table_stride", _i64),
        ("num_items", _i32),
        ("threads", _i32),
        ("attention_threads", _i32),
        ("pad", _i32),
        ("x", _p),
        ("residual", _p),
        ("qkv", _p),
        ("attn", _p),
        ("gate_up", _p),
        ("gathered", _p),
    ]


@dataclass(frozen=True)
class PartSpec:
    """Output columns [col, col + n) of a linear layer: a quantized GEMM on GGUF blocks
    (`ggml_type`, `x8`, `w_stride` bytes per row or row group), the packed bf16 GEMM, or the
    skinny GEMM on a plain [n, k] weight. `bias`: float32 for a quantized part, else the
    model dtype; tensors must stay alive as long as the stack (it keeps them)."""

    kind: int
    weight: torch.Tensor
    col: int
    n: int
    bias: torch.Tensor | None = None
    ggml_type: int = 0
    x8: bool = False
    w_stride: int = 0


@dataclass(frozen=True)
class LinearSpec:
    """A linear layer of `parts` side by side; with `perm` (int64 [k], contiguous) it reads
    x[:, perm] (a GPTQ act-order layer, its inputs sorted by group)."""

    n: int
    k: int
    parts: tuple[PartSpec, ...]
    perm: torch.Tensor | None = None


@dataclass(frozen=True)
class LayerSpec:
    qkv: LinearSpec
    o: LinearSpec
    gate_up: LinearSpec
    down: LinearSpec
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    sliding_window: int
    k_scale: float = 1.0  # an fp8 cache holds k / k_scale and v / v_scale
    v_scale: float = 1.0


@dataclass(frozen=True)
class DecoderSpec:
    layers: tuple[LayerSpec, ...]
    final_norm: torch.Tensor
    cos_sin: torch.Tensor  # [max_position, rot] float32
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    inter: int
    dtype: torch.dtype
    eps: float
    scale: float


@functools.cache
def load_decoder_library() -> ctypes.CDLL:
    """Raises CpuKernelUnavailable when it does not build or load."""
    lib = open_library(build_library(SOURCE, (), ISA), "pagoda_decoder_abi", _ABI)
    lib.pagoda_decoder_run.argtypes = [ctypes.POINTER(_Decoder), ctypes.POINTER(_Step)]
    lib.pagoda_decoder_run.restype = ctypes.c_int
    return lib


def _address(fn: object) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _linear(spec: LinearSpec) -> _Linear:
    if not 1 <= len(spec.parts) <= MAX_PARTS:
        raise ValueError(f"a linear layer takes 1 to {MAX_PARTS} parts, got {len(spec.parts)}")
    if spec.perm is not None and (
        spec.perm.dtype is not torch.int64
        or tuple(spec.perm.shape) != (spec.k,)
        or not spec.perm.is_contiguous()
    ):
        raise ValueError(f"a layer's input permutation is int64 [{spec.k}], contiguous")
    lin = _Linear(num_parts=len(spec.parts), n=spec.n, k=spec.k, perm=_ptr(spec.perm))
    for i, p in enumerate(spec.parts):
        lin.parts[i] = _Part(
            kind=p.kind,
            ggml_type=p.ggml_type,
            x8=int(p.x8),
            w=p.weight.data_ptr(),
            w_stride=p.w_stride,
            bias=_ptr(p.bias),
            col=p.col,
            n=p.n,
        )
    return lin


class CpuDecoderStack:
    """The C structs of one model, kept with the tensors they point into; `bind_kv_caches`
    points the layers at the KV cache (again whenever it is reallocated)."""

    def __init__(self, spec: DecoderSpec, block_size: int) -> None:
        from pagoda.attention.cpu.library import load_library
        from pagoda.kernels.cpu import ops

        self.spec = spec
        self._lib = load_decoder_library()
        ops_lib, attention_lib = ops.load_cpu_ops(), load_library()
        quant_gemm = 0
        if any(p.kind == PART_QUANT for layer in spec.layers for p in layer_parts(layer)):
            from pagoda.kernels.cpu import quant

            quant_gemm = _address(quant.load_quant_library().pagoda_quant_gemm)
        self._layers = (_Layer * len(spec.layers))()
        for i, layer in enumerate(spec.layers):
            self._layers[i] = _Layer(
                qkv=_linear(layer.qkv),
                o=_linear(layer.o),
                gate_up=_linear(layer.gate_up),
                down=_linear(layer.down),
                input_norm=layer.input_norm.data_ptr(),
                post_norm=layer.post_norm.data_ptr(),
                q_norm=_ptr(layer.q_norm),
                k_norm=_ptr(layer.k_norm),
                sliding_window=layer.sliding_window,
                k_scale=layer.k_scale,
                v_scale=layer.v_scale,
            )
        self._decoder = _Decoder(
            quant_gemm=quant_gemm,
            gemv=_address(ops_lib.pagoda_gemv),
            gemm_packed=_address(ops_lib.pagoda_gemm_packed),
            rms_norm=_address(ops_lib.pagoda_rms_norm),
            silu_and_mul=_address(ops_lib.pagoda_silu_and_mul),
            rope=_address(ops_lib.pagoda_rotary_embedding),
            attention=_address(attention_lib.pagoda_paged_attention),
            write_kv=_address(attention_lib.pagoda_write_kv),
            layers=self._layers,
            final_norm=spec.final_norm.data_ptr(),
            cos_sin=spec.cos_sin.data_ptr(),
            max_position=spec.cos_sin.shape[0],
            num_layers=len(spec.layers),
            hidden=spec.hidden,
            num_heads=spec.num_heads,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            inter=spec.inter,
            rot=spec.cos_sin.shape[1],
            block_size=block_size,
            dt=_DTYPES[spec.dtype],
            norm_dt=_DTYPES[spec.final_norm.dtype],
            cache_dt=_DTYPES[spec.dtype],
            eps=spec.eps,
            scale=spec.scale,
        )
        self._bound: tuple[int, ...] = ()
        self._gather_k = max(
            (
                lin.k
                for layer in spec.layers
                for lin in layer_linears(layer)
                if lin.perm is not None
            ),
            default=0,
        )

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Point layer i at kv_caches[i] ([2, num_blocks, block_size, kv_heads, head_size],
        contiguous, all in the model dtype or all in a 16-bit dtype under a float32 model); a
        no-op when they are the tensors already bound."""
        key = tuple(c.data_ptr() for c in kv_caches)
        if key == self._bound:
            return
        if len(kv_caches) != len(self.spec.layers):
            raise ValueError(f"{len(self.spec.layers)} layers, {len(kv_caches)} KV caches")
        dtypes = {c.dtype for c in kv_caches}
        if len(dtypes) != 1 or not cache_dtype_supported(self.spec.dtype, kv_caches[0].dtype):
            raise ValueError(
                f"KV caches in {sorted(map(str, dtypes))} for a {self.spec.dtype} model"
            )
        from pagoda.attention.cpu.library import CACHE_DTYPE_CODES

        self._decoder.cache_dt = CACHE_DTYPE_CODES[kv_caches[0].dtype]
        for layer, cache in zip(self._layers, kv_caches, strict=True):
            layer.k_cache, layer.v_cache = cache[0].data_ptr(), cache[1].data_ptr()
        self._bound = key

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        items: torch.Tensor,
        threads: int,
        attention_threads: int,
    ) -> torch.Tensor:
        """x [rows, hidden] (the embeddings, contiguous) becomes the final hidden states in
        place; positions and slots int64, the attention tables int32, all contiguous."""
        s = self.spec
        rows = x.shape[0]
        residual = torch.empty_like(x)
        qkv = x.new_empty(rows, (s.num_heads + 2 * s.num_kv_heads) * s.head_size)
        attn = x.new_empty(rows, s.num_heads * s.head_size)
        gate_up = x.new_empty(rows, 2 * s.inter)
        gathered = x.new_empty(rows, self._gather_k) if self._gather_k else None
        step = _Step(
            rows=rows,
            positions=positions.data_ptr(),
            slots=slots.data_ptr(),
            block_tables=block_tables.data_ptr(),
            seq_lens=seq_lens.data_ptr(),
            query_start_loc=query_start_loc.data_ptr(),
            items=items.data_ptr(),
            block_table_stride=block_tables.stride(0),
            num_items=items.shape[0],
            threads=threads,
            attention_threads=attention_threads,
            x=x.data_ptr(),
            residual=residual.data_ptr(),
            qkv=qkv.data_ptr(),
            attn=attn.data_ptr(),
            gate_up=gate_up.data_ptr(),
            gathered=_ptr(gathered),
        )
        rc = self._lib.pagoda_decoder_run(ctypes.byref(self._decoder), ctypes.byref(step))
        if rc == ROPE_POSITION_ERROR:
            raise ValueError(
                f"a position is outside the rotary table [0, {s.cos_sin.shape[0]}): raise "
                "max_position_embeddings or shorten the request"
            )
        if rc != 0:
            raise RuntimeError(f"pagoda_decoder_run failed (code {rc})")
        return x


def cache_dtype_supported(model_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the stack runs a model of `model_dtype` over a KV cache of `cache_dtype`: the
    model dtype, a 16-bit cache under float32, or fp8 e5m2 under float32 (widened as the
    attention kernel reads it)."""
    return cache_dtype == model_dtype or (
        model_dtype == torch.float32
        and cache_dtype in (torch.bfloat16, torch.float16, torch.float8_e5m2)
    )


def layer_linears(layer: LayerSpec) -> tuple[LinearSpec, ...]:
    return (layer.qkv, layer.o, layer.gate_up, layer.down)


def layer_parts(layer: LayerSpec) -> tuple[PartSpec, ...]:
    return tuple(p for lin in layer_linears(layer) for p in lin.parts)
