"""Every environment variable Pagoda reads (its own `PAGODA_*` ones, and `CC`,
`OPENAI_API_KEY`, `OMP_WAIT_POLICY`, `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`): one table of name,
type, default and meaning (`VARIABLES`), the one parser of each, and the few places Pagoda
writes the environment, each saying why.

A variable is read when its attribute is (`envs.PAGODA_CPU_THREADS`), not at import, so a test
or a launcher that sets it before the use is seen. A value that does not parse is a ValueError
naming the variable. Flags take 0/false/off/no or 1/true/on/yes in any case; unset or empty is
the default. The README's table of environment variables lists the same rows
(`markdown_table()`; a test keeps the two equal). Standard library only: the torch-free core
reads it too.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    PAGODA_LOGGING_LEVEL: str
    PAGODA_CPU_THREADS: int | None
    PAGODA_CPU_FAST_OPS: bool
    PAGODA_CPU_ISA: str | None
    PAGODA_CPU_AMX: bool
    PAGODA_CPU_POOL: bool
    PAGODA_CPU_POOL_SPIN_US: int | None
    PAGODA_CPU_DECODER: bool
    PAGODA_CPU_NUMERICS: str
    PAGODA_CACHE_DIR: Path
    PAGODA_CALIBRATION_THREADS: int | None
    PAGODA_PROGRESS: bool | None
    PAGODA_GGUF_QUANTIZED: bool
    PAGODA_CPU_QUANTIZED: bool
    PAGODA_CUDA_DECODE: bool
    PAGODA_W4A16: bool
    PAGODA_W4A16_CUDA: bool
    PAGODA_W4A16_CLUSTER_SPLIT: int
    PAGODA_W4A16_SC_EARLY: bool
    PAGODA_PDL: bool
    PAGODA_W4A16_SILU: bool
    PAGODA_L2_PREFETCH_MB: int
    PAGODA_W8A8_FUSED_QUANT: bool
    PAGODA_W8A8_CUDA: bool
    PAGODA_W8A8_SPLIT_K: bool
    PAGODA_FP8_FAST_ACCUM: bool
    PAGODA_W8A16: bool
    PAGODA_ENABLE_MULTIPROCESSING: bool
    PAGODA_EXECUTE_MODEL_TIMEOUT_S: float
    PAGODA_GRAMMAR_COMPILE_TIMEOUT_S: float
    PAGODA_GRAMMAR_MASK_BUDGET_MS: float
    PAGODA_GRAMMAR_COMPILE_PROCESSES: int
    PAGODA_GRAMMAR_MAX_ABANDONED: int
    PAGODA_MAX_N_SEQUENCES: int
    PAGODA_API_KEY: str | None
    PAGODA_SERVER_DEV_MODE: bool
    PAGODA_RESPONSES_STORE_SIZE: int
    CC: str | None
    OPENAI_API_KEY: str | None
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: str

_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")


def _flag(name: str, default: bool | None) -> Callable[[], bool | None]:
    def read() -> bool | None:
        value = os.environ.get(name, "").strip().lower()
        if not value:
            return default
        if value in _OFF:
            return False
        if value in _ON:
            return True
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")

    return read


def _positive_int(name: str, default: int | None) -> Callable[[], int | None]:
    def read() -> int | None:
        value = os.environ.get(name, "").strip()
        if not value:
            return default
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
        return int(value)

    return read


def _count(name: str, default: int) -> Callable[[], int]:
    """A non-negative integer."""

    def read() -> int:
        value = os.environ.get(name, "").strip()
        if not value:
            return default
        if not value.isdigit():
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        return int(value)

    return read


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; all of them where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _positive_float(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        value = os.environ.get(name, "").strip()
        if not value:
            return default
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not number > 0:
            raise ValueError(f"{name} must be a positive number, got {value!r}")
        return number

    return read


def _text(
    name: str, default: str | None, transform: Callable[[str], str] = str.strip
) -> Callable[[], str | None]:
    def read() -> str | None:
        value = transform(os.environ.get(name, ""))
        return value or default

    return read


def _choice(name: str, default: str, choices: tuple[str, ...]) -> Callable[[], str]:
    def read() -> str:
        value = os.environ.get(name, "").strip().lower()
        if not value:
            return default
        if value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        return value

    return read


def _cache_dir() -> Path:
    value = os.environ.get("PAGODA_CACHE_DIR", "").strip()
    return Path(value) if value else Path.home() / ".cache" / "pagoda"


@dataclass(frozen=True)
class EnvVar:
    name: str
    type: str  # as the docs table shows it
    default: str  # as the docs table shows it
    doc: str  # one line
    read: Callable[[], Any]


VARIABLES: dict[str, EnvVar] = {
    var.name: var
    for var in (
        EnvVar(
            "PAGODA_LOGGING_LEVEL", "str", "info",
            "Log level (debug, info, warning, error); `--log-level` sets it for the processes "
            "Pagoda spawns too.",
            _text("PAGODA_LOGGING_LEVEL", "INFO", lambda v: v.strip().upper()),
        ),
        EnvVar(
            "PAGODA_CPU_THREADS", "int", "every core this process may use",
            "Threads of the CPU kernels and torch's CPU ops; fewer can be faster on a machine "
            "shared with other busy processes.",
            _positive_int("PAGODA_CPU_THREADS", None),
        ),
        EnvVar(
            "PAGODA_CPU_FAST_OPS", "flag", "1",
            "0: the torch path everywhere instead of Pagoda's C CPU kernels.",
            _flag("PAGODA_CPU_FAST_OPS", True),
        ),
        EnvVar(
            "PAGODA_CPU_ISA", "str", "the CPU's best level",
            "Force the ISA level the C CPU kernels build for (portable, avx2, avx512, "
            "avx512_bf16).",
            _text("PAGODA_CPU_ISA", None, lambda v: v.strip().lower()),
        ),
        EnvVar(
            "PAGODA_CPU_AMX", "flag", "1",
            "0: on a CPU with AMX-BF16, the packed bf16 GEMM keeps its AVX-512 register tiles "
            "instead of AMX's (the build leaves them out).",
            _flag("PAGODA_CPU_AMX", True),
        ),
        EnvVar(
            "PAGODA_CPU_POOL", "flag", "1",
            "0: the quantized CPU GEMM and paged attention split their work by OpenMP regions "
            "instead of Pagoda's thread pool.",
            _flag("PAGODA_CPU_POOL", True),
        ),
        EnvVar(
            "PAGODA_CPU_DECODER", "flag", "1",
            "0: CPU steps of Llama-family models run layer by layer from Python instead of "
            "all decoder layers in one C call.",
            _flag("PAGODA_CPU_DECODER", True),
        ),
        EnvVar(
            "PAGODA_CPU_NUMERICS", "str", "pagoda",
            "ggml: Llama GGUF models (Q4_1 / Q8_0) on the CPU compute llama.cpp's logits bit for "
            "bit, op by op in its arithmetic, several times slower (ggml-avx2 / ggml-avx512: as "
            "llama.cpp built for that ISA).",
            _text("PAGODA_CPU_NUMERICS", "pagoda", lambda v: v.strip().lower()),
        ),
        EnvVar(
            "PAGODA_CPU_POOL_SPIN_US", "int", "100",
            "How long a pool thread waits busily for the next job before it sleeps.",
            _positive_int("PAGODA_CPU_POOL_SPIN_US", None),
        ),
        EnvVar(
            "PAGODA_CACHE_DIR", "path", "~/.cache/pagoda",
            "Where the built C kernels are kept.",
            _cache_dir,
        ),
        EnvVar(
            "PAGODA_CALIBRATION_THREADS", "int", "cores minus the load average",
            "torch threads of `pagoda quantize`'s calibration.",
            _positive_int("PAGODA_CALIBRATION_THREADS", None),
        ),
        EnvVar(
            "PAGODA_PROGRESS", "flag", "on when stderr is a terminal",
            "The progress bar of `pagoda quantize`.",
            _flag("PAGODA_PROGRESS", None),
        ),
        EnvVar(
            "PAGODA_GGUF_QUANTIZED", "flag", "1",
            "0: dequantize a GGUF model's blocks at load (the float reference) instead of "
            "running the quantized CPU kernels.",
            _flag("PAGODA_GGUF_QUANTIZED", True),
        ),
        EnvVar(
            "PAGODA_CPU_QUANTIZED", "flag", "1",
            "0: AWQ/GPTQ layers on a CPU are dequantized at load (the dense reference), and int8 "
            "W8A8 and FP8 ones take the float32 reference product, instead of running as GGUF "
            "blocks in the quantized CPU kernels.",
            _flag("PAGODA_CPU_QUANTIZED", True),
        ),
        EnvVar(
            "PAGODA_CUDA_DECODE", "flag", "1",
            "0: decode attention on CUDA takes the Triton kernel instead of the CUDA one.",
            _flag("PAGODA_CUDA_DECODE", True),
        ),
        EnvVar(
            "PAGODA_W4A16", "flag", "1",
            "0: 4-bit AWQ/GPTQ layers on CUDA are dequantized at load instead of kept packed "
            "for the W4A16 kernel.",
            _flag("PAGODA_W4A16", True),
        ),
        EnvVar(
            "PAGODA_W4A16_CUDA", "flag", "1",
            "0: packed 4-bit layers on CUDA take the Triton kernels instead of the CUDA ones "
            "(the GEMV at few rows, the wgmma kernel on sm_90).",
            _flag("PAGODA_W4A16_CUDA", True),
        ),
        EnvVar(
            "PAGODA_W4A16_CLUSTER_SPLIT", "int", "2",
            "The largest K split of the CUDA W4A16 wgmma kernel whose partial tiles are summed "
            "among the CTAs of a thread-block cluster (distributed shared memory; up to 8) "
            "instead of through global memory (the last CTA to arrive adding them); 0 or 1 for "
            "none. Two-way splits (down at 224-256 rows) were faster in a cluster, four- and "
            "eight-way ones slower.",
            _count("PAGODA_W4A16_CLUSTER_SPLIT", 2),
        ),
        EnvVar(
            "PAGODA_W4A16_SC_EARLY", "flag", "0",
            "1: the CUDA W4A16 GEMV's consumers load their first K step's scales and zero "
            "points before waiting for the kernel before them (programmatic dependent launch), "
            "so that only x's load follows that wait; not yet timed on a GPU.",
            _flag("PAGODA_W4A16_SC_EARLY", False),
        ),
        EnvVar(
            "PAGODA_PDL", "flag", "1",
            "0: no programmatic dependent launch on sm_90 GPUs (the CUDA W4A16 GEMV and wgmma "
            "kernels and the latter's x tiling, the W8A8 / FP8 Triton and CUDA GEMMs, RMSNorm, "
            "SiLU-and-mul, RoPE + cache write and the decode attention then each wait for the "
            "kernel before them to end before they start).",
            _flag("PAGODA_PDL", True),
        ),
        EnvVar(
            "PAGODA_W4A16_SILU", "flag", "1",
            "1: a packed 4-bit MLP's SiLU-and-mul runs in its gate_up GEMV's epilogue (the "
            "CUDA decode kernel, sm_90, up to 16 rows) instead of as a kernel of its own; 0: "
            "the separate kernel.",
            _flag("PAGODA_W4A16_SILU", True),
        ),
        EnvVar(
            "PAGODA_L2_PREFETCH_MB", "int", "0",
            "MiB of weights asked into the GPU's L2 cache during each layer's attention in "
            "decode steps of up to 16 rows (sm_90): o_proj's, then the first rows of "
            "gate_up's (`pagoda/kernels/l2_prefetch.py`). 0 (default): none; on an H100 "
            "24 slowed 4-bit decode by 3% and sped bf16 by 2%.",
            _count("PAGODA_L2_PREFETCH_MB", 0),
        ),
        EnvVar(
            "PAGODA_W8A8_FUSED_QUANT", "flag", "1",
            "1: on CUDA the RMSNorm or SiLU-and-mul before a W8A8 / FP8 layer quantizes its "
            "output per token as it writes it; 0: the layer quantizes its input with a kernel "
            "of its own.",
            _flag("PAGODA_W8A8_FUSED_QUANT", True),
        ),
        EnvVar(
            "PAGODA_W8A8_CUDA", "flag", "1",
            "0: 8-bit layers on sm_90 take the Triton GEMM (int8) or cuBLASLt (FP8) where the "
            "rule would take the CUDA wgmma kernel (int8 from 65 rows, FP8 at 65-128).",
            _flag("PAGODA_W8A8_CUDA", True),
        ),
        EnvVar(
            "PAGODA_W8A8_SPLIT_K", "flag", "1",
            "0: the CUDA W8A8 kernel's rule never splits K among a cluster of CTAs (where a "
            "layer's tiles fill at most half the SMs it splits them in two).",
            _flag("PAGODA_W8A8_SPLIT_K", True),
        ),
        EnvVar(
            "PAGODA_FP8_FAST_ACCUM", "flag", "1",
            "1: FP8 GEMMs on sm_90 accumulate in the tensor cores' own precision across K (as "
            "vLLM's FP8 kernels do: cuBLASLt's fast accumulation, and the Triton GEMM without "
            "a float32 promotion every K tile); 0: each K tile's sum promoted to float32.",
            _flag("PAGODA_FP8_FAST_ACCUM", True),
        ),
        EnvVar(
            "PAGODA_W8A16", "flag", "1",
            "0: 8-bit GPTQ layers on CUDA are dequantized at load instead of kept 8-bit for the "
            "W8A16 kernel.",
            _flag("PAGODA_W8A16", True),
        ),
        EnvVar(
            "PAGODA_ENABLE_MULTIPROCESSING", "flag", "1",
            "0: the served engine core runs on a thread of the server process instead of its "
            "own process.",
            _flag("PAGODA_ENABLE_MULTIPROCESSING", True),
        ),
        EnvVar(
            "PAGODA_EXECUTE_MODEL_TIMEOUT_S", "float", "300",
            "Seconds a tensor-parallel step may take before its workers count as failed.",
            _positive_float("PAGODA_EXECUTE_MODEL_TIMEOUT_S", 300.0),
        ),
        EnvVar(
            "PAGODA_GRAMMAR_COMPILE_TIMEOUT_S", "float", "30",
            "Seconds a served request's structured-outputs constraint may take to compile (off "
            "the engine's step loop) before the request is refused.",
            _positive_float("PAGODA_GRAMMAR_COMPILE_TIMEOUT_S", 30.0),
        ),
        # 100 ms: ordinary constraints (JSON schemas, json_object, regexes, a choice of 2,000)
        # took at most 1.3 ms for one token's mask or advance, and 20 ms when four busy
        # processes shared the two cores (`benchmarks/grammar_mask_time.py [--busy 4]`, 2-core
        # AMD EPYC); a pathological regex took 0.65 s, then 19 s. One request past the budget
        # costs the others one step longer by the budget, once; a single slow token ends it,
        # since the step loop cannot wait for that token without everyone waiting.
        EnvVar(
            "PAGODA_GRAMMAR_MASK_BUDGET_MS", "float", "100",
            "Milliseconds a structured-outputs constraint may take to compute one token's mask, "
            "or to advance by one token, before its request ends with an error.",
            _positive_float("PAGODA_GRAMMAR_MASK_BUDGET_MS", 100.0),
        ),
        EnvVar(
            "PAGODA_GRAMMAR_COMPILE_PROCESSES", "int", "2",
            "Worker processes that compile a served engine's structured-outputs constraints "
            "(started when needed; one past PAGODA_GRAMMAR_COMPILE_TIMEOUT_S is killed). 0: "
            "two threads of the engine core instead, and a compile past the timeout keeps its "
            "core until xgrammar returns.",
            _count("PAGODA_GRAMMAR_COMPILE_PROCESSES", 2),
        ),
        # Each abandoned fill (or compile past its timeout on a thread) keeps a core busy until
        # xgrammar returns: 0.66 s to 19 s a token for the slow regex of docs/reliability.md.
        # At one per core they hold every core; more only slow everyone's steps down further.
        EnvVar(
            "PAGODA_GRAMMAR_MAX_ABANDONED", "int", "the cores this process may use",
            "New structured-outputs requests of a served engine get HTTP 503 (Retry-After) "
            "while this many constraint computations given up on as too slow (masks past "
            "PAGODA_GRAMMAR_MASK_BUDGET_MS, compiles past the timeout on threads) still run.",
            lambda: _positive_int("PAGODA_GRAMMAR_MAX_ABANDONED", None)() or usable_cores(),
        ),
        EnvVar(
            "PAGODA_MAX_N_SEQUENCES", "int", "128",
            "Largest `n` (sequences per request) a request may ask for.",
            _positive_int("PAGODA_MAX_N_SEQUENCES", 128),
        ),
        EnvVar(
            "PAGODA_API_KEY", "str", "none",
            "The API key `pagoda serve` requires when neither --api-key nor --api-key-file "
            "is given.",
            _text("PAGODA_API_KEY", None, lambda v: v),
        ),
        EnvVar(
            "PAGODA_SERVER_DEV_MODE", "flag", "0",
            "1: `pagoda serve` also serves POST /reset_prefix_cache, which drops the engine's "
            "cached prompt prefixes (vLLM's VLLM_SERVER_DEV_MODE); without it the path is 404.",
            _flag("PAGODA_SERVER_DEV_MODE", False),
        ),
        EnvVar(
            "PAGODA_RESPONSES_STORE_SIZE", "int", "1000",
            "How many responses of /v1/responses `pagoda serve` keeps in memory for GET "
            "/v1/responses/{id} and previous_response_id (the oldest goes first; 0 keeps none).",
            _count("PAGODA_RESPONSES_STORE_SIZE", 1000),
        ),
        EnvVar(
            "CC", "str", "cc, else gcc",
            "The C compiler that builds the CPU kernels.",
            _text("CC", None),
        ),
        EnvVar(
            "OPENAI_API_KEY", "str", "none",
            "The API key `pagoda bench serve` sends (the default of its --api-key).",
            _text("OPENAI_API_KEY", None, lambda v: v),
        ),
        EnvVar(
            "OMP_WAIT_POLICY", "str", "PASSIVE",
            "OpenMP threads sleep (PASSIVE) or spin (ACTIVE) between parallel regions; "
            "`import pagoda` sets PASSIVE unless it or GOMP_SPINCOUNT is set. ACTIVE is faster "
            "on a machine that runs nothing else.",
            _text("OMP_WAIT_POLICY", None),
        ),
        EnvVar(
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "str", "grpc",
            "How --otlp-traces-endpoint's spans are sent: grpc, or http/protobuf (the endpoint "
            "then the whole URL, e.g. http://collector:4318/v1/traces), as vLLM reads it.",
            _choice("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc", ("grpc", "http/protobuf")),
        ),
    )
}  # fmt: skip


def __getattr__(name: str) -> Any:
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return var.read()


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])


def pagoda_environment() -> dict[str, str]:
    """The `PAGODA_*` variables set in this process, as set: what a worker started elsewhere
    (a Ray actor, maybe on another machine) must see to behave like this process."""
    return {k: v for k, v in os.environ.items() if k.startswith("PAGODA_")}


def set_openmp_wait_policy() -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the user chose a policy (it or GOMP_SPINCOUNT is set):
    OpenMP threads (torch's and the C ops': one libgomp) sleep as soon as a parallel
    region ends instead of spinning for new work, which takes the cores the working threads
    and any other process need; on a 2-core machine with one other busy process, decoding 16
    sequences ran at 9.5 output tok/s spinning and 50 sleeping (on an idle machine sleeping
    costs single-stream decode about a quarter: ACTIVE for a dedicated one). libgomp reads the
    variable when it is loaded, so it is written into the environment before torch is
    imported."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def update_environment(env: dict[str, str]) -> None:
    """Set `env` in this process's environment: a Ray actor takes its driver's `PAGODA_*`
    variables (`pagoda_environment`) and its CUDA_VISIBLE_DEVICES this way, before anything in
    it touches CUDA, which reads the visible devices once."""
    os.environ.update(env)


def set_logging_level(level: str) -> None:
    """Write the log level into this process's environment: the processes Pagoda spawns (the
    engine core, tensor-parallel workers; Ray actors through `pagoda_environment`) configure
    their loggers from it at start-up, before any argument could reach them."""
    os.environ["PAGODA_LOGGING_LEVEL"] = level


def markdown_table() -> str:
    """The README's table of environment variables."""
    rows = ["| Variable | Type | Default | Meaning |", "| --- | --- | --- | --- |"]
    rows += [f"| `{v.name}` | {v.type} | {v.default} | {v.doc} |" for v in VARIABLES.values()]
    return "\n".join(rows)
