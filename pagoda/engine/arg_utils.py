"""`EngineArgs`: the flat, vLLM-named engine arguments, and their turning into an `EngineConfig`.

The same names serve `LLM(...)` keyword arguments and CLI flags (`--max-num-seqs` ...).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from pagoda import envs
from pagoda.config import (
    DEFAULT_MAX_NUM_SEQS,
    DTYPES,
    KV_CACHE_DTYPES,
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    ObservabilityConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    embedded_model_path,
)
from pagoda.generation_config import check_generation_config
from pagoda.logger import init_logger
from pagoda.utils import cpu_kernels

logger = init_logger(__name__)

_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32"}
_DTYPE_ALIASES["bf16"] = "bfloat16"
_DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# A field's annotated type -> (check, what the message says it must be).
_TYPE_CHECKS = {
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "float": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "dict": (lambda v: isinstance(v, dict), "a dict"),
}


def _json_dict(text: str) -> dict[str, Any]:
    """argparse type of a JSON-object flag (--speculative-config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


# vLLM's older speculative-decoding arguments (vLLM <= 0.6: `LLM(speculative_model=...)`,
# `--speculative-model ...`), mapped onto `speculative_config`.
LEGACY_SPECULATIVE_ARGS = (
    "speculative_model",
    "num_speculative_tokens",
    "ngram_prompt_lookup_max",
    "ngram_prompt_lookup_min",
    "speculative_max_model_len",
)


def legacy_speculative_config(kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM <= 0.6's `speculative_model` (a draft model's path, or "[ngram]"),
    `num_speculative_tokens`, `ngram_prompt_lookup_max/min` as a `speculative_config` dict
    (popped from kwargs, with those set to None). `speculative_max_model_len` is logged as
    ignored: drafts are proposed up to the target's max_model_len (what the outputs are does not
    depend on it). None where none of them is set."""
    legacy = {k: kwargs.pop(k) for k in LEGACY_SPECULATIVE_ARGS if kwargs.get(k) is not None}
    for k in LEGACY_SPECULATIVE_ARGS:
        kwargs.pop(k, None)
    if "speculative_max_model_len" in legacy:
        logger.warning(
            "speculative_max_model_len=%s is ignored: drafts are proposed up to max_model_len",
            legacy.pop("speculative_max_model_len"),
        )
    if not legacy:
        return None
    model = legacy.get("speculative_model")
    if model is None:
        raise ValueError(f"{', '.join(sorted(legacy))} need speculative_model (e.g. '[ngram]')")
    config: dict[str, Any] = (
        {"method": "ngram"} if model == "[ngram]" else {"method": "draft_model", "model": model}
    )
    if "num_speculative_tokens" in legacy:
        config["num_speculative_tokens"] = legacy["num_speculative_tokens"]
    for old, new in (
        ("ngram_prompt_lookup_max", "prompt_lookup_max"),
        ("ngram_prompt_lookup_min", "prompt_lookup_min"),
    ):
        if old in legacy:
            config[new] = legacy[old]
    return config


def _cpu_default_dtype(hf_config: dict[str, Any], quantization: str | None = None) -> str:
    """`dtype="auto"` on a CPU: what ran faster (`pagoda bench throughput --num-prompts 16
    --input-len 64:256 --output-len 64:256 --seed 0`, the two dtypes one after the other).

    With Pagoda's C kernels (a compiler, `$PAGODA_CPU_FAST_OPS` not 0), bfloat16 at every ISA
    level: the packed bf16 GEMM streams half the weight bytes of float32 and computes as fast
    (below AVX512_BF16 it widens bf16 by a shift and uses FMAs), and the bf16 KV cache halves
    attention's reads. Output tok/s, bf16 vs float32: a 2-core Zen 3 (avx2; one thread, the
    machine shared with other work) 39.5 vs 30.9 (and 14.8 vs 7.4 at a busier time); 2 cores of
    an AVX512_BF16 Xeon (dummy weights) 137 vs 129 at avx2, 185 vs 162 at avx512, 190 vs 152 at
    avx512_bf16. Without them the model runs torch's ops, whose bf16 GEMM is fast only with
    AVX512_BF16 / AMX (elsewhere several times slower than float32's): float32 there.

    A GGUF file with quantized blocks (`quantization="gguf"`) runs in float32, the dtype in which
    its blocks stay quantized (the int8-activation kernels, as llama.cpp runs them), at every
    ISA level: they read a third of bf16's bytes, so a single stream decodes ~3x faster; at
    batch they compute within ~10% of the packed bf16 GEMM with AVX512-VNNI (`quant_x8.h`'s
    512-bit tile), and with the float16 KV cache a float32 model keeps on a CPU the offline
    workload ran as fast as in bf16 on a 2-core Zen 4 (AVX512-BF16; `pagoda bench throughput
    --num-prompts 64 --input-len 64:256 --output-len 64:256 --seed 0 [--dtype bfloat16]`:
    472.9 vs 472.6 output tok/s); and the
    process holds ~230 MiB less for the embedded model (benchmarks/README.md, "CPU: GGUF kept
    quantized"). With AMX both take AMX tiles at batch (bf16 from 8 rows; the blocks' integer
    dots, with the same bits, from 32-64), the bf16 GEMM gaining far more (2-9x against 1.0-1.4x),
    and the blocks stay the default: they win up to the CPU server's default of 4 running
    requests a core, bf16 from ~32 requests and at prefill. Decode steps of 1 / 8 / 32 / 64
    requests and a 512-token prefill
    took 7.5 / 14.5 / 34.9 / 62.9 and 283 ms in float32 against 12.6 / 17.8 / 30.0 / 49.2 and
    196 ms in bf16 on 2 cores of an Intel Xeon with AMX (`python
    benchmarks/runner_step_bench.py --dtype float32 --quantization gguf | --dtype bfloat16
    --batch 1 8 32 64 --context 192 --prefill 512`); offline throughput favours bf16 there.
    `--dtype bfloat16` dequantizes at load. Without a compiler the blocks are
    dequantized and the torch rule below applies, as it does where `quantization` asks for
    another format (`fp8`: the file's weights dequantized, then cast at load)."""
    from pagoda.utils import cpu_build as build  # stdlib only: no torch in the front end

    flags = set(build.cpu_flags().split())
    fast_bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
    quant = (hf_config.get("quantization_config") or {}).get("quant_method")
    if quant == "gguf" and quantization in (None, "gguf") and build.compiler_available():
        return "float32"
    if envs.PAGODA_CPU_FAST_OPS and build.compiler_available():
        return "bfloat16"
    return "bfloat16" if fast_bf16 else "float32"


def resolve_dtype(
    dtype: str, hf_config: dict[str, Any], device: str, quantization: str | None = None
) -> str:
    """The model dtype `dtype` names; "auto": the checkpoint's on a GPU, on a CPU
    `_cpu_default_dtype` (which takes the `quantization` asked for into account)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    dtype = _DTYPE_ALIASES.get(dtype, dtype)
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return _cpu_default_dtype(hf_config, quantization)
    ckpt = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16")
    ckpt = ckpt.replace("torch.", "")
    return ckpt if ckpt in ("bfloat16", "float16") else "bfloat16"


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, dtype: str, device: str, attention_backend: str | None = None
) -> str:
    """The KV cache dtype `kv_cache_dtype` names; "auto" is the model dtype `dtype`, except for
    a float32 model on an x86 CPU with AVX2 (F16C) or better whose attention runs Pagoda's C
    kernel: float16, as llama.cpp keeps its cache. The kernel widens the halves as it reads
    them, so a decode step reads half the bytes (at 64 requests of 300 tokens, the embedded
    model's step drops from ~205 to ~135-150 ms on a 2-core Zen 4, `python
    benchmarks/runner_step_bench.py --dtype float32 --quantization gguf --batch 64 --context
    300 --kv-cache-dtype float32|float16`) and the cache holds twice the tokens; float16's 10
    mantissa bits round keys and values ~8x finer than bfloat16's. `--kv-cache-dtype float32`
    keeps the full-precision cache."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    if device != "cpu" or dtype != "float32" or attention_backend not in (None, "cpu"):
        return dtype
    from pagoda.utils import cpu_build as build  # stdlib only: no torch in the front end

    if build.compiler_available() and build.selected_isa() != "portable":
        return "float16"
    return dtype


def resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    return device


def check_input_buffers_fit(config: EngineConfig) -> None:
    """Refuse a max_num_seqs / max_num_batched_tokens whose step inputs could never be
    allocated, where the configuration is made rather than in torch's allocator deep in the
    model runner's start. The runner keeps them in buffers allocated once (`InputBuilder`): a
    block-table row of max_model_len / block_size block ids for each of max_num_seqs
    sequences, and four ids for each of max_num_batched_tokens tokens. They must fit in the
    host memory available now and, on a GPU, in gpu_memory_utilization of its memory (where
    they are allocated a second time)."""
    from pagoda.worker.input_batch import input_buffer_bytes
    from pagoda.worker.memory_plan import GiB, available_memory_bytes

    sc, cc = config.scheduler_config, config.cache_config
    max_model_len = config.model_config.max_model_len
    blocks = -(-max_model_len // cc.block_size)
    on_gpu = config.device_config.device == "cuda"
    seqs, tokens = sc.max_num_seqs, sc.max_num_batched_tokens
    need = input_buffer_bytes(tokens, seqs, blocks, on_gpu)
    limits = [("host", need.host, available_memory_bytes(), "of memory available")]
    if on_gpu:
        import torch

        total = torch.cuda.get_device_properties("cuda").total_memory
        budget = int(total * cc.gpu_memory_utilization)
        limits.append(("device", need.device, budget, "of GPU memory (gpu_memory_utilization)"))
    for kind, bytes_needed, bytes_there, where in limits:
        if bytes_needed <= bytes_there:
            continue
        # The flag at fault: the one whose buffers alone do not fit, else both.
        alone = {
            "max_num_seqs (--max-num-seqs)": input_buffer_bytes(1, seqs, blocks, on_gpu),
            "max_num_batched_tokens (--max-num-batched-tokens)": input_buffer_bytes(
                tokens, 1, blocks, on_gpu
            ),
        }
        flags = [f for f, b in alone.items() if getattr(b, kind) > bytes_there] or list(alone)
        raise ValueError(
            f"max_num_seqs={seqs} and max_num_batched_tokens={tokens} cannot be honoured: the "
            f"engine's step inputs for them take {bytes_needed / GiB:.1f} GiB (about "
            f"{4 * blocks + 16} bytes a sequence, a block-table row of {blocks} blocks for "
            f"max_model_len {max_model_len} at block_size {cc.block_size}, and 40 a token), "
            f"more than the {bytes_there / GiB:.1f} GiB {where}: lower {' or '.join(flags)}"
        )


@dataclass
class EngineArgs:
    model: str | None = None
    tokenizer: str | None = None
    skip_tokenizer_init: bool = False
    dtype: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    load_format: str = "auto"
    quantization: str | None = None
    served_model_name: str | None = None
    # vLLM's: "auto" (default sampling parameters from the model's generation_config.json),
    # "vllm" (ignore it) or a folder holding one (`pagoda.generation_config`).
    generation_config: str = "auto"
    device: str = "auto"
    # Cache
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    # Scheduler
    # None: DEFAULT_MAX_NUM_SEQS, except that a server on a CPU sizes it to the cores
    # (`serving_engine_args`).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    stream_interval: int = 1
    # Execution
    enforce_eager: bool = False
    # None: on where it helps (a CUDA device), off on a CPU (nothing to overlap with).
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    attention_backend: str | None = None
    disable_log_stats: bool = False
    # vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
    speculative_config: dict[str, Any] | None = None
    # Tracing (`pagoda.tracing`): the OTLP collector that gets one span per finished request,
    # and the detailed timings it adds ("model", "worker", "all"; a list, or vLLM's older
    # comma-separated string).
    otlp_traces_endpoint: str | None = None
    collect_detailed_traces: str | list[str] | None = None

    def _check_types(self) -> None:
        """`LLM(...)` keywords arrive untyped: a wrong type is a ValueError naming the field
        here, not a TypeError from a comparison deep in the config."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kinds = [k.strip().split("[")[0] for k in str(f.type).split("|")]
            if value is None and "None" in kinds:
                continue
            checks = [_TYPE_CHECKS[k] for k in kinds if k in _TYPE_CHECKS]
            if len(checks) == len(kinds) - ("None" in kinds) and not any(
                ok(value) for ok, _ in checks
            ):
                what = " or ".join(name for _, name in checks)
                raise ValueError(f"{f.name} must be {what}, got {value!r:.100}")
        if not _INT64_MIN <= self.seed <= _INT64_MAX:
            raise ValueError(f"seed must be a signed 64-bit integer, got {self.seed}")

    def check_model_config(self) -> tuple[str, dict[str, Any], int]:
        """The part of `create_engine_config` that needs no torch: the arguments' types and
        ranges, the model's path and its config (read and checked), max_model_len. Returns
        (model, hf_config, max_model_len). The server's front end runs it before it starts
        the engine core (`pagoda.cli.check_engine_start`)."""
        from pagoda.model.loader import get_model_config_dict

        self._check_types()
        if self.model is not None and not (isinstance(self.model, str) and self.model.strip()):
            raise ValueError(
                f"model must be a path (or None for the embedded model), got {self.model!r}"
            )
        model = self.model or embedded_model_path()
        hf_config = get_model_config_dict(model, self.load_format)
        derived_max_len = int(hf_config.get("max_position_embeddings") or 2048)
        max_model_len = derived_max_len if self.max_model_len is None else self.max_model_len
        if max_model_len <= 0:
            raise ValueError(
                f"max_model_len must be positive, got {max_model_len} (leave it unset for the "
                f"model's {derived_max_len})"
            )
        if max_model_len > derived_max_len:
            raise ValueError(
                f"max_model_len ({max_model_len}) is larger than the model's "
                f"max_position_embeddings ({derived_max_len}); lower --max-model-len"
            )
        check_generation_config(self.generation_config)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        # The range checks of the configs that do not depend on the device.
        self._cache_config()
        self._scheduler_config(max_model_len, async_scheduling=False)
        self._parallel_config()
        self._speculative_config()
        self._observability_config()
        return model, hf_config, max_model_len

    def create_engine_config(self) -> EngineConfig:
        model, hf_config, max_model_len = self.check_model_config()
        if cpu_kernels.runs_on_cpu(self.device):
            # A CPU engine's C kernels compile in the background from here, beside the import
            # of torch and the model's loading rather than between them.
            ckpt = (hf_config.get("quantization_config") or {}).get("quant_method")
            gguf = (self.quantization or (ckpt if self.load_format != "dummy" else None)) == "gguf"
            cpu_kernels.start_build(gguf)
        from pagoda.model.quantization import (
            QUANT_METHODS,
            checkpoint_accepts,
            checkpoint_quant_method,
        )

        if self.quantization not in (None, "gguf", *QUANT_METHODS):
            raise ValueError(
                f"quantization={self.quantization!r} is not supported yet; supported: "
                + ", ".join(QUANT_METHODS)
            )
        quantization = self.quantization
        ckpt_method = checkpoint_quant_method(hf_config)
        if ckpt_method is not None and self.load_format != "dummy":
            if ckpt_method not in QUANT_METHODS:
                raise ValueError(
                    f"{model}: quantization_config.quant_method {ckpt_method!r} is not "
                    f"supported yet; supported: {', '.join(QUANT_METHODS)}"
                )
            if quantization is not None and not checkpoint_accepts(
                quantization, ckpt_method, hf_config
            ):
                raise ValueError(
                    f"quantization={quantization!r} but {model} is a {ckpt_method!r} checkpoint"
                )
            quantization = quantization or ckpt_method
        from pagoda.model.loader.hf_config import kv_cache_sliding_window

        device = resolve_device(self.device)
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError(
                    "device='cuda' but no CUDA GPU is available to this torch build "
                    f"({torch.__version__}): use device='cpu' (or 'auto')"
                )
        dtype = resolve_dtype(self.dtype, hf_config, device, quantization)
        if device == "cpu" and self.gpu_memory_utilization != EngineArgs.gpu_memory_utilization:
            logger.warning(
                "gpu_memory_utilization=%s is ignored on a CPU: the KV cache takes "
                "--kv-cache-memory-bytes (default: min(2 GiB, 25%% of the available RAM))",
                self.gpu_memory_utilization,
            )
        config = EngineConfig(
            model_config=ModelConfig(
                model=model,
                hf_config=hf_config,
                dtype=dtype,
                max_model_len=max_model_len,
                load_format=self.load_format,
                tokenizer=self.tokenizer,
                seed=self.seed,
                quantization=quantization,
                served_model_name=self.served_model_name,
                skip_tokenizer_init=self.skip_tokenizer_init,
            ),
            cache_config=self._cache_config(
                kv_cache_sliding_window(hf_config),
                resolve_kv_cache_dtype(self.kv_cache_dtype, dtype, device, self.attention_backend),
            ),
            scheduler_config=self._scheduler_config(
                max_model_len,
                device == "cuda" if self.async_scheduling is None else self.async_scheduling,
            ),
            parallel_config=self._parallel_config(),
            device_config=DeviceConfig(
                device=device,
                enforce_eager=self.enforce_eager,
                attention_backend=self.attention_backend,
            ),
            speculative_config=self._speculative_config(),
            observability_config=self._observability_config(),
        )
        check_input_buffers_fit(config)
        return config

    def _cache_config(
        self, sliding_window: int | None = None, cache_dtype: str | None = None
    ) -> CacheConfig:
        return CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            cache_dtype=cache_dtype or self.kv_cache_dtype,
            enable_prefix_caching=self.enable_prefix_caching,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            sliding_window=sliding_window,
        )

    def _scheduler_config(self, max_model_len: int, async_scheduling: bool) -> SchedulerConfig:
        max_batched = self.max_num_batched_tokens
        if max_batched is None:
            max_batched = _DEFAULT_MAX_NUM_BATCHED_TOKENS
            if not self.enable_chunked_prefill:
                max_batched = max(max_batched, max_model_len)
        return SchedulerConfig(
            max_num_seqs=DEFAULT_MAX_NUM_SEQS if self.max_num_seqs is None else self.max_num_seqs,
            max_num_batched_tokens=max_batched,
            max_model_len=max_model_len,
            policy=self.scheduling_policy,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            async_scheduling=async_scheduling,
            stream_interval=self.stream_interval,
        )

    def _parallel_config(self) -> ParallelConfig:
        return ParallelConfig(
            tensor_parallel_size=self.tensor_parallel_size,
            distributed_executor_backend=self.distributed_executor_backend,
        )

    def _speculative_config(self) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_dict(self.speculative_config)

    def _observability_config(self) -> ObservabilityConfig:
        modules = self.collect_detailed_traces
        if isinstance(modules, str):
            modules = [modules]
        if modules is not None:
            if not isinstance(modules, (list, tuple)) or not all(
                isinstance(m, str) for m in modules
            ):
                raise ValueError(
                    "collect_detailed_traces must be a list of 'model', 'worker', 'all' (or one "
                    f"comma-separated string), got {self.collect_detailed_traces!r:.100}"
                )
            modules = [m.strip() for item in modules for m in item.split(",") if m.strip()]
        return ObservabilityConfig(
            otlp_traces_endpoint=self.otlp_traces_endpoint,
            collect_detailed_traces=None if modules is None else tuple(modules),
        )

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        d = EngineArgs()
        g = parser.add_argument_group("engine")
        g.add_argument(
            "--model",
            type=str,
            default=None,
            help="HF directory, .gguf file, or "
            "config.json with --load-format dummy (default: the embedded SmolLM2-135M)",
        )
        g.add_argument("--tokenizer", type=str, default=None)
        g.add_argument(
            "--skip-tokenizer-init",
            action="store_true",
            help="no tokenizer: prompts are token ids and outputs are not detokenized",
        )
        g.add_argument("--dtype", type=str, default=d.dtype, choices=DTYPES)
        g.add_argument("--seed", type=int, default=d.seed)
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument(
            "--load-format",
            type=str,
            default=d.load_format,
            choices=["auto", "gguf", "safetensors", "pt", "dummy"],
        )
        g.add_argument("--quantization", "-q", type=str, default=None)
        g.add_argument("--served-model-name", type=str, default=None)
        g.add_argument(
            "--generation-config",
            type=str,
            default=d.generation_config,
            help="default sampling parameters for what a request leaves unset: 'auto' (the "
            "model's generation_config.json), 'vllm' (ignore it), or a folder holding one",
        )
        g.add_argument("--device", type=str, default=d.device, choices=["auto", "cpu", "cuda"])
        g.add_argument("--block-size", type=int, default=d.block_size)
        g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
        g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
        g.add_argument(
            "--kv-cache-dtype", type=str, default=d.kv_cache_dtype, choices=KV_CACHE_DTYPES
        )
        g.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=d.enable_prefix_caching,
        )
        g.add_argument("--num-gpu-blocks-override", type=int, default=None)
        g.add_argument(
            "--max-num-seqs",
            type=int,
            default=d.max_num_seqs,
            help=f"requests running at once (default {DEFAULT_MAX_NUM_SEQS}; a server on a CPU: "
            "4 per core, so that a full batch still streams at a readable pace)",
        )
        g.add_argument("--max-num-batched-tokens", type=int, default=None)
        g.add_argument(
            "--long-prefill-token-threshold",
            type=int,
            default=d.long_prefill_token_threshold,
            help="with chunked prefill, compute a longer prompt at most this many tokens per "
            "step, so running decodes keep their inter-token latency (0: off)",
        )
        g.add_argument(
            "--stream-interval",
            type=int,
            default=d.stream_interval,
            help="streaming: new tokens batched into each streamed chunk (the first and last "
            "go at once); a request's stream_interval may raise it (1: every token)",
        )
        g.add_argument(
            "--scheduling-policy",
            "--scheduler-policy",
            dest="scheduling_policy",
            type=str,
            default=d.scheduling_policy,
            choices=["fcfs", "priority"],
        )
        g.add_argument(
            "--enable-chunked-prefill",
            action=argparse.BooleanOptionalAction,
            default=d.enable_chunked_prefill,
        )
        g.add_argument("--enforce-eager", action="store_true")
        g.add_argument(
            "--async-scheduling",
            action=argparse.BooleanOptionalAction,
            default=None,
            help="schedule the next step while the device runs this one "
            "(default: on for CUDA, off on a CPU)",
        )
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size)
        g.add_argument(
            "--distributed-executor-backend", type=str, default=None, choices=["mp", "ray"]
        )
        g.add_argument(
            "--attention-backend", type=str, default=None, choices=["cpu", "torch", "triton"]
        )
        g.add_argument("--disable-log-stats", action="store_true")
        g.add_argument(
            "--speculative-config",
            type=_json_dict,
            default=None,
            help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
            '"num_speculative_tokens": 5, "prompt_lookup_max": 4}\'',
        )
        g.add_argument(
            "--speculative-model",
            type=str,
            default=None,
            help="vLLM <= 0.6's form of --speculative-config: a draft model's path, or [ngram]",
        )
        g.add_argument("--num-speculative-tokens", type=int, default=None)
        g.add_argument("--ngram-prompt-lookup-max", type=int, default=None)
        g.add_argument("--ngram-prompt-lookup-min", type=int, default=None)
        g.add_argument(
            "--otlp-traces-endpoint",
            type=str,
            default=None,
            help="send one OpenTelemetry span per finished request (llm_request, vLLM's "
            "attributes) to this OTLP collector: host:port over gRPC, or with "
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf the whole URL "
            "(http://HOST:4318/v1/traces). Needs pip install 'pagoda[tracing]'",
        )
        g.add_argument(
            "--collect-detailed-traces",
            type=str,
            nargs="+",
            default=None,
            metavar="{model,worker,all}",
            help="with --otlp-traces-endpoint, add to each span the model forward time (model) "
            "and the engine core's execute time (worker) of the request's steps; all: both",
        )
        g.add_argument(
            "--speculative-max-model-len",
            type=int,
            default=None,
            help="accepted and ignored (logged): drafts are proposed up to --max-model-len",
        )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = [f.name for f in dataclasses.fields(cls)]
        kwargs = {n: getattr(args, n) for n in names if hasattr(args, n)}
        # vLLM <= 0.6's flags (--speculative-model ...), as LLM(speculative_model=...) takes them.
        legacy = legacy_speculative_config(
            {k: getattr(args, k) for k in LEGACY_SPECULATIVE_ARGS if hasattr(args, k)}
        )
        if legacy is not None:
            if kwargs.get("speculative_config") is not None:
                raise ValueError("give --speculative-config or --speculative-model, not both")
            kwargs["speculative_config"] = legacy
        return cls(**kwargs)
