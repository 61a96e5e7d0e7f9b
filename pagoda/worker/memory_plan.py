"""How GPU memory is split at start: weights, activations, CUDA graphs, and the KV cache.

`plan_kv_cache_memory` is the arithmetic (no device needed, so it is tested on a CPU):
of gpu_memory_utilization * total device memory, what the weights, the peak activations of a
profiling forward at the largest batch (max_num_batched_tokens tokens, logits and sampler
included), the reserve for CUDA graphs and the memory used outside torch (CUDA context, other
processes) leave goes to KV blocks. A setting that cannot work fails here, at start, with the
numbers and the flag to change, never with an out-of-memory error mid-run. The measurements
come from `pagoda.worker.profiling` (decode graphs) and `ModelRunner._estimate_mixed_graph_memory`
(mixed-step graphs: a forward at the largest (tokens, requests) bucket, `cuda_graphs`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.config import DEFAULT_CPU_KV_CACHE_BYTES

GiB = 2**30
# Bytes of one cached K or V element by --kv-cache-dtype ("auto": the model's dtype).
KV_CACHE_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "fp8": 1, "fp8_e4m3": 1,
                     "fp8_e5m2": 1, "int8": 1}  # fmt: skip


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True)
class MemoryPlan:
    total_bytes: int  # device memory
    gpu_memory_utilization: float
    weights_bytes: int
    activation_bytes: int  # peak of the profiling forward beyond the weights
    non_torch_bytes: int  # used outside torch's allocator (CUDA context, other processes)
    cuda_graph_bytes: int  # reserved for decode and mixed-step CUDA graphs (0 with enforce_eager)
    bytes_per_block: int
    block_size: int
    max_model_len: int
    num_blocks: int

    @property
    def budget_bytes(self) -> int:
        return int(self.total_bytes * self.gpu_memory_utilization)

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def num_tokens(self) -> int:
        """Tokens the KV cache holds (the null block 0 included)."""
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens that fit at once."""
        return (self.num_blocks - 1) / blocks_per_request(self.max_model_len, self.block_size)

    def summary(self) -> str:
        return (
            f"GPU memory: {_gib(self.budget_bytes)} of {_gib(self.total_bytes)} "
            f"(gpu_memory_utilization={self.gpu_memory_utilization}): weights "
            f"{_gib(self.weights_bytes)}, peak activations {_gib(self.activation_bytes)}, "
            f"CUDA graphs {_gib(self.cuda_graph_bytes)}, outside torch "
            f"{_gib(self.non_torch_bytes)}, KV cache {_gib(self.kv_cache_bytes)} = "
            f"{self.num_blocks} blocks = {self.num_tokens} tokens; maximum concurrency at "
            f"max_model_len={self.max_model_len}: {self.max_concurrency:.1f}x"
        )


class KVCacheTooLargeError(ValueError):
    """kv_cache_memory_bytes asks for more than the device holds beside the rest; `fit_bytes`
    is the largest whole number of blocks that does fit (0 when none does)."""

    def __init__(self, message: str, fit_bytes: int) -> None:
        super().__init__(message)
        self.fit_bytes = fit_bytes


def blocks_per_request(max_model_len: int, block_size: int) -> int:
    return -(-max_model_len // block_size)


def plan_kv_cache_memory(
    *,
    total_bytes: int,
    gpu_memory_utilization: float,
    weights_bytes: int,
    activation_bytes: int,
    non_torch_bytes: int,
    cuda_graph_bytes: int,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    kv_cache_memory_bytes: int | None = None,
) -> MemoryPlan:
    """The KV blocks left by the rest (see the module docstring); `kv_cache_memory_bytes`
    replaces that remainder when given. Raises ValueError when the weights do not fit, nothing
    is left for the cache, the cache cannot hold one max_model_len request, or (a
    KVCacheTooLargeError) kv_cache_memory_bytes is more than the device holds beside the rest."""
    budget = int(total_bytes * gpu_memory_utilization)
    usable = budget - non_torch_bytes
    if weights_bytes > usable:
        raise ValueError(
            f"the model weights take {_gib(weights_bytes)} but gpu_memory_utilization="
            f"{gpu_memory_utilization} of {_gib(total_bytes)} leaves {_gib(usable)} "
            f"({_gib(non_torch_bytes)} are used outside torch): raise "
            "--gpu-memory-utilization, or use a smaller or quantized model or more GPUs "
            "(--tensor-parallel-size)"
        )
    fixed = weights_bytes + activation_bytes + cuda_graph_bytes + non_torch_bytes
    if kv_cache_memory_bytes is not None and kv_cache_memory_bytes > total_bytes - fixed:
        # It replaces gpu_memory_utilization's share (vLLM's meaning), so it may exceed the
        # budget, but not the whole device: the cache would run out of memory at allocation.
        left = max(total_bytes - fixed, 0)
        raise KVCacheTooLargeError(
            f"kv_cache_memory_bytes (--kv-cache-memory-bytes) asks for a "
            f"{_gib(kv_cache_memory_bytes)} KV cache, but the device's {_gib(total_bytes)} "
            f"leave {_gib(left)} beside the weights ({_gib(weights_bytes)}), the activations "
            f"({_gib(activation_bytes)}), CUDA graphs ({_gib(cuda_graph_bytes)}) and the "
            f"memory used outside torch ({_gib(non_torch_bytes)}): pass at most {left} bytes, "
            "or leave it out (gpu_memory_utilization sizes the cache)",
            fit_bytes=left // bytes_per_block * bytes_per_block,
        )
    kv_bytes = budget - fixed if kv_cache_memory_bytes is None else kv_cache_memory_bytes
    if kv_bytes <= 0:
        raise ValueError(
            f"no GPU memory is left for the KV cache: gpu_memory_utilization="
            f"{gpu_memory_utilization} of {_gib(total_bytes)} is {_gib(budget)}, and the "
            f"weights take {_gib(weights_bytes)}, the activations of a "
            f"{max_num_batched_tokens}-token step {_gib(activation_bytes)}, CUDA graphs "
            f"{_gib(cuda_graph_bytes)} and {_gib(non_torch_bytes)} are used outside torch: "
            "raise --gpu-memory-utilization, lower --max-num-batched-tokens, or pass "
            "--enforce-eager (no CUDA graphs)"
        )
    plan = MemoryPlan(
        total_bytes=total_bytes,
        gpu_memory_utilization=gpu_memory_utilization,
        weights_bytes=weights_bytes,
        activation_bytes=activation_bytes,
        non_torch_bytes=non_torch_bytes,
        cuda_graph_bytes=cuda_graph_bytes,
        bytes_per_block=bytes_per_block,
        block_size=block_size,
        max_model_len=max_model_len,
        num_blocks=kv_bytes // bytes_per_block,
    )
    check_fits_one_request(plan.num_blocks, block_size, max_model_len, plan.summary())
    return plan


def check_fits_one_request(
    num_blocks: int, block_size: int, max_model_len: int, context: str = ""
) -> None:
    """Raise ValueError unless one max_model_len request fits (block 0 is the null block)."""
    needed = blocks_per_request(max_model_len, block_size) + 1
    if num_blocks < needed:
        raise ValueError(
            f"the KV cache has room for {num_blocks} blocks of {block_size} tokens, fewer "
            f"than one max_model_len={max_model_len} request needs ({needed}, the null block "
            "included): lower --max-model-len, raise --gpu-memory-utilization / "
            "kv_cache_memory_bytes, or lower --max-num-batched-tokens (activations)"
            + (f". {context}" if context else "")
        )


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_size: int, itemsize: int
) -> int:
    """K and V of one block in every layer (`num_kv_heads` on this rank)."""
    return 2 * block_size * num_kv_heads * head_size * itemsize * num_layers


def available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def cpu_kv_cache_bytes() -> int:
    """Default CPU budget: min(2 GiB, 25% of the RAM available now)."""
    return min(DEFAULT_CPU_KV_CACHE_BYTES, available_memory_bytes() // 4)
