"""What the tensor-parallel executor tests share: the tiny GQA Llama checkpoint, the prompts and
sampling settings, the engine they build, and process liveness checks."""

from __future__ import annotations

import time

from model_testing import make_tiny_checkpoint

from pagoda import LLM, SamplingParams

PROMPTS = [
    {"prompt_token_ids": [(7 * i + 3 * j) % 128 for j in range(5 + 4 * i)]} for i in range(4)
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, logprobs=2, prompt_logprobs=1)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=11, n=2, max_tokens=12)


def tiny_checkpoint(path) -> str:
    # 4 heads / 2 KV heads, tied embeddings; a wider init than HF's keeps greedy choices clear.
    make_tiny_checkpoint(path, "llama_gqa_tied_llama3_rope", initializer_range=0.2)
    return str(path)


def tp_llm(path: str, tp: int, **kwargs) -> LLM:
    """The tiny checkpoint's engine with `tp` ranks. Its cache is float32 on every CPU, so that
    engines of different rank counts differ only in the order of the row-parallel layers' sums
    (~3e-6 in a logprob): the float16 cache an x86 CPU with a compiler takes for a float32
    model by default rounds keys and values at 2^-11, where a reordered sum can land one ulp
    over (~1e-4 in a logprob, over the tests' bound on an AVX2 build)."""
    kwargs = {"kv_cache_dtype": "float32", **kwargs}
    return LLM(
        path,
        tensor_parallel_size=tp,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=128,
        max_num_batched_tokens=16,  # chunked prefill: several steps per prompt
        num_gpu_blocks_override=9,  # 8 usable blocks of 16 tokens: requests get preempted
        **kwargs,
    )


def generated_tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(c.token_ids) for o in outs for c in o.outputs]


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not). OSError: gone before the open, or between the
    open and the read of its stat file (ESRCH, ProcessLookupError)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]
