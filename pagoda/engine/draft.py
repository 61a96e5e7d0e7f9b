"""The draft model's engine parts for draft-model speculation: built here, in the engine layer,
and handed to `pagoda.spec_decode.DraftModelProposer`, which only drives them."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.engine.arg_utils import EngineArgs
from pagoda.executor.uniproc import UniProcExecutor

if TYPE_CHECKING:
    from pagoda.config import EngineConfig


def make_draft_executor(
    target: EngineConfig, num_target_blocks: int
) -> tuple[UniProcExecutor, int]:
    """The draft model's in-process executor with its KV cache initialised, and the cache's
    block count: as many tokens as the target's cache, at most what max_num_seqs full requests
    need, plus the null block. Raises ValueError for a draft whose vocabulary differs from the
    target's, or whose cache does not fit in the GPU memory the target left."""
    spec = target.speculative_config
    assert spec is not None and spec.model is not None
    mc, cc, sc = target.model_config, target.cache_config, target.scheduler_config
    tokens = min(num_target_blocks * cc.block_size, sc.max_num_seqs * mc.max_model_len)
    num_blocks = -(-tokens // cc.block_size) + 1
    args = EngineArgs(
        model=spec.model,
        dtype=mc.dtype,
        device=target.device_config.device,
        seed=mc.seed,
        max_model_len=mc.max_model_len,
        load_format=mc.load_format if mc.load_format == "dummy" else "auto",
        skip_tokenizer_init=True,
        block_size=cc.block_size,
        enable_prefix_caching=False,
        num_gpu_blocks_override=num_blocks,
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        enforce_eager=True,
        async_scheduling=False,
        attention_backend=target.device_config.attention_backend,
    )
    config = args.create_engine_config()
    draft_vocab = int(config.model_config.hf_config.get("vocab_size", 0))
    target_vocab = int(mc.hf_config.get("vocab_size", 0))
    if draft_vocab != target_vocab:
        raise ValueError(
            f"speculative draft model {spec.model} has vocab_size {draft_vocab}, the target "
            f"{target_vocab}: a draft model must share the target's tokenizer"
        )
    executor = UniProcExecutor(config)
    _check_device_memory(executor, num_blocks)
    executor.initialize_kv_cache(num_blocks)
    return executor, num_blocks


def _check_device_memory(executor: UniProcExecutor, num_blocks: int) -> None:
    """On a GPU the target's cache took its share first: fail now, with the numbers, if the
    draft's cache does not fit in what is left."""
    runner = executor.model_runner
    if runner.device.type != "cuda":
        return
    import torch

    free, _ = torch.cuda.mem_get_info(runner.device)
    need = num_blocks * runner.bytes_per_block()
    if need > 0.95 * free:
        raise ValueError(
            f"the draft model's KV cache needs {need / 2**30:.2f} GiB and {free / 2**30:.2f} GiB "
            "are free after the target's: lower --gpu-memory-utilization to leave room"
        )
