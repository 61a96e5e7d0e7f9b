"""GPU memory planning arithmetic (no GPU needed): what is left of gpu_memory_utilization after
weights, activations, CUDA graphs and non-torch memory becomes KV blocks, and the settings that
cannot work fail at start with the numbers and the flag to change."""

from __future__ import annotations

import pytest

from pagoda.worker.memory_plan import GiB, KVCacheTooLargeError, plan_kv_cache_memory

MiB = 2**20
# Llama-3-8B on an H200-sized device: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes x 16.
BYTES_PER_BLOCK = 32 * 8 * 128 * 2 * 2 * 16


def _plan(**overrides):
    args = dict(
        total_bytes=140 * GiB,
        gpu_memory_utilization=0.9,
        weights_bytes=15 * GiB,
        activation_bytes=2 * GiB,
        non_torch_bytes=GiB // 2,
        cuda_graph_bytes=256 * MiB,
        bytes_per_block=BYTES_PER_BLOCK,
        block_size=16,
        max_model_len=8192,
        max_num_batched_tokens=8192,
    )
    return plan_kv_cache_memory(**{**args, **overrides})


def test_kv_cache_gets_the_rest_of_the_budget():
    plan = _plan()
    left = int(140 * GiB * 0.9) - 15 * GiB - 2 * GiB - GiB // 2 - 256 * MiB
    assert plan.num_blocks == left // BYTES_PER_BLOCK
    assert 0 <= left - plan.kv_cache_bytes < BYTES_PER_BLOCK
    assert plan.num_tokens == plan.num_blocks * 16
    assert plan.max_concurrency == pytest.approx((plan.num_blocks - 1) / 512)
    text = plan.summary()
    for part in ("weights 15.00 GiB", "CUDA graphs 0.25 GiB", f"{plan.num_blocks} blocks"):
        assert part in text


def test_kv_cache_memory_bytes_overrides_the_remainder():
    plan = _plan(kv_cache_memory_bytes=2 * GiB)
    assert plan.num_blocks == 2 * GiB // BYTES_PER_BLOCK


def test_kv_cache_memory_bytes_may_pass_the_budget_but_not_the_device():
    # The rest of the 140 GiB device beside weights, activations, graphs and the outside use.
    left = 140 * GiB - 15 * GiB - 2 * GiB - GiB // 2 - 256 * MiB
    assert _plan(kv_cache_memory_bytes=left).kv_cache_bytes > int(140 * GiB * 0.9) - 18 * GiB
    with pytest.raises(
        KVCacheTooLargeError, match=r"asks for a 1000.00 GiB.*leave 122.25 GiB"
    ) as e:
        _plan(kv_cache_memory_bytes=1000 * GiB)
    assert isinstance(e.value, ValueError) and "--kv-cache-memory-bytes" in str(e.value)
    assert e.value.fit_bytes == left // BYTES_PER_BLOCK * BYTES_PER_BLOCK


def test_weights_larger_than_the_budget_name_the_flag():
    with pytest.raises(ValueError, match="weights take 130.00 GiB.*--gpu-memory-utilization"):
        _plan(weights_bytes=130 * GiB)


def test_no_room_left_for_the_cache_names_the_flags():
    with pytest.raises(ValueError, match="no GPU memory is left.*--max-num-batched-tokens"):
        _plan(activation_bytes=111 * GiB)


def test_cache_smaller_than_one_request_names_max_model_len():
    # 1 GiB holds 8192 tokens of this model: fewer than one 16k request.
    with pytest.raises(ValueError, match="max_model_len=16384.*--max-model-len"):
        _plan(max_model_len=16384, kv_cache_memory_bytes=GiB)
