"""Tensor parallelism over Ray actors (`RayExecutor`), on CPU with gloo and a local Ray.

Needs Ray (`pip install ray`), skipped without it. The module starts its own local Ray
(`ray.init(num_cpus=2)`, as a user would) and shuts it down at the end; the executor must
neither start another nor shut it down. The tiny GQA Llama of test_multiproc must generate the
same tokens with tensor_parallel_size=2 as in one process (through chunked prefill and
preemption, and with async scheduling), also with the ranks in a placement group (as on
several nodes); an actor that raises, dies or hangs surfaces in the engine as a `WorkerError`
naming the rank; no actor outlives its executor.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ray = pytest.importorskip("ray")

from model_testing import make_tiny_checkpoint  # noqa: E402
from tp_testing import (  # noqa: E402
    GREEDY,
    PROMPTS,
    SEEDED,
    alive,
    generated_tokens,
    tiny_checkpoint,
    tp_llm,
    wait_gone,
)

from pagoda import SamplingParams  # noqa: E402
from pagoda.executor import ray_executor  # noqa: E402
from pagoda.executor.multiproc import WorkerError  # noqa: E402


def _actor_pids() -> set[int]:
    """Live processes of RayWorker actors on this machine (Ray names them `ray::RayWorker`)."""
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::RayWorker") and alive(int(entry)):
                    pids.add(int(entry))
        except (FileNotFoundError, NotADirectoryError, PermissionError, ValueError):
            pass
    return pids


def _ray_still_works() -> bool:
    return ray.is_initialized() and ray.get(ray.remote(num_cpus=0)(lambda: 7).remote()) == 7


@pytest.fixture(scope="module")
def local_ray():
    if ray.is_initialized():
        pytest.skip("Ray is already initialized in this process")
    ray.init(num_cpus=2, include_dashboard=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def reference(checkpoint) -> dict[str, list]:
    llm = tp_llm(checkpoint, 1)
    return {
        "greedy": llm.generate(PROMPTS, GREEDY, use_tqdm=False),
        "seeded": generated_tokens(llm, SEEDED),
    }


def test_ray_tp2_greedy_matches_one_process_and_shutdown_keeps_ray(
    local_ray, checkpoint, reference
) -> None:
    llm = tp_llm(checkpoint, 2, distributed_executor_backend="ray")
    executor = llm.llm_engine.executor
    assert isinstance(executor, ray_executor.RayExecutor)
    pids = executor.worker_pids
    assert len(set(pids)) == 2 and set(pids) <= _actor_pids()
    assert executor.worker_nodes == [ray.util.get_node_ip_address()] * 2
    got = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    ref = reference["greedy"]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    assert llm.llm_engine.num_preemptions_total > 0
    for a, b in zip(ref, got):
        for x, y in zip(
            a.outputs[0].logprobs + a.prompt_logprobs[1:],
            b.outputs[0].logprobs + b.prompt_logprobs[1:],
        ):
            assert x.keys() == y.keys()
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4 for t in x)
    assert ray.get_runtime_context().gcs_address == local_ray  # joined, did not start its own

    executor.shutdown()
    assert wait_gone(pids) == []
    assert _ray_still_works()  # the user's Ray is not shut down
    with pytest.raises(WorkerError, match="shut down"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_ray_tp2_async_scheduling_in_a_placement_group_via_object_store(
    local_ray, checkpoint, reference, monkeypatch
) -> None:
    # As on a cluster of several nodes: one CPU bundle per rank, packed; steps run ahead, and
    # each goes through Ray's object store (as a large one would).
    monkeypatch.setattr(ray_executor, "_num_alive_nodes", lambda: 2)
    monkeypatch.setattr(ray_executor, "_INLINE_STEP_BYTES", 0)
    puts = []
    put = ray.put
    monkeypatch.setattr(ray, "put", lambda value: puts.append(len(value)) or put(value))
    llm = tp_llm(checkpoint, 2, distributed_executor_backend="ray", async_scheduling=True)
    executor = llm.llm_engine.executor
    try:
        assert llm.llm_engine.async_scheduling
        (pg,) = executor._placement
        assert ray.util.placement_group_table(pg)["state"] == "CREATED"
        assert generated_tokens(llm, SEEDED) == reference["seeded"]
        assert len(puts) > 10
    finally:
        executor.shutdown()
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    assert wait_gone(executor.worker_pids) == []


# ---- failures -------------------------------------------------------------------------------
def test_actor_exception_raises_naming_the_rank(local_ray, checkpoint) -> None:
    llm = tp_llm(checkpoint, 2, distributed_executor_backend="ray")
    executor = llm.llm_engine.executor
    with pytest.raises(
        WorkerError, match=r"failed in .initialize_kv_cache.: rank 0 raised (.|\n)*--- rank 0"
    ) as info:
        executor.collective_rpc("initialize_kv_cache", (-5,))
    assert not isinstance(info.value.__cause__, ray.exceptions.RayError)  # the actor's own
    assert wait_gone(executor.worker_pids) == []
    with pytest.raises(WorkerError, match="earlier failure"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)


def test_killed_actor_raises_in_the_engine(local_ray, checkpoint) -> None:
    llm = tp_llm(checkpoint, 2, distributed_executor_backend="ray")
    pids = llm.llm_engine.executor.worker_pids
    os.kill(pids[1], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1's actor died \(its worker process has died"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 10
    with pytest.raises(WorkerError, match="earlier failure"):
        llm.llm_engine.executor.execute_model_async(None).get()
    assert wait_gone(pids) == []
    assert _ray_still_works()


def test_start_error_is_reraised(local_ray, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    make_tiny_checkpoint(tmp_path, "llama_gqa_tied_llama3_rope")
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks tensors(.|\n)*up_proj") as info:
        tp_llm(str(tmp_path), 2, distributed_executor_backend="ray")
    assert any("tensor-parallel Ray actor rank" in n for n in info.value.__notes__)


@pytest.mark.slow
def test_step_timeout_raises(local_ray, checkpoint, monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_EXECUTE_MODEL_TIMEOUT_S", "1.5")
    llm = tp_llm(checkpoint, 2, distributed_executor_backend="ray")
    pids = llm.llm_engine.executor.worker_pids
    os.kill(pids[1], signal.SIGSTOP)  # rank 0 waits for it in the first all-reduce
    try:
        with pytest.raises(WorkerError, match=r"no answer within 1.5 s from rank\(s\) 0, 1"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert wait_gone(pids[:1]) == []
    finally:
        if alive(pids[1]):
            os.kill(pids[1], signal.SIGKILL)
    assert wait_gone(pids) == []


@pytest.mark.slow
def test_garbage_collection_kills_the_actors(local_ray, checkpoint) -> None:
    llm = tp_llm(checkpoint, 2, distributed_executor_backend="ray")
    pids = llm.llm_engine.executor.worker_pids
    del llm
    gc.collect()
    assert wait_gone(pids) == []


# ---- a driver in its own process (as `pagoda serve` on a cluster) -----------------------------
_SCRIPT = """
import sys, ray
from pagoda import LLM
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="ray",
              dtype="float32", skip_tokenizer_init=True, max_model_len=128,
              num_gpu_blocks_override=64)
    print(ray.get_runtime_context().gcs_address, *llm.llm_engine.executor.worker_pids,
          flush=True)
    if sys.argv[2] == "hang":
        sys.stdin.read()
"""


def _driver(checkpoint: str, mode: str, tmp_path, address: str) -> tuple[subprocess.Popen, list]:
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(_SCRIPT))
    proc = subprocess.Popen(
        [sys.executable, str(script), checkpoint, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "RAY_ADDRESS": address},
    )
    line = proc.stdout.readline()
    assert line, "the driver script failed"
    return proc, line.split()


@pytest.mark.slow
def test_driver_joins_ray_address_and_its_actors_end_with_it(local_ray, checkpoint, tmp_path):
    # $RAY_ADDRESS names the module's Ray: the driver joins it, as on a cluster.
    proc, (address, *pids) = _driver(checkpoint, "exit", tmp_path, local_ray)
    assert address == local_ray
    assert proc.wait(60) == 0
    assert wait_gone([int(p) for p in pids]) == []

    proc, (_, *pids) = _driver(checkpoint, "hang", tmp_path, local_ray)
    assert all(alive(int(p)) for p in pids)
    proc.kill()  # no finalizer: Ray ends the actors of a driver that is gone
    proc.wait(10)
    assert wait_gone([int(p) for p in pids], timeout=30) == []
    assert _ray_still_works()


@pytest.mark.slow
def test_serving_engine_core_process_joins_ray_address(
    local_ray, checkpoint, reference, monkeypatch
) -> None:
    # `pagoda serve` builds the engine in a child process, which joins the cluster named by
    # $RAY_ADDRESS and creates the actors there.
    import asyncio

    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.sampling_params import RequestOutputKind

    monkeypatch.setenv("RAY_ADDRESS", local_ray)
    args = EngineArgs(
        model=checkpoint,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        dtype="float32",
        kv_cache_dtype="float32",  # as `tp_llm`'s reference
        skip_tokenizer_init=True,
        max_model_len=128,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=9,
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=40, output_kind=RequestOutputKind.FINAL_ONLY
    )

    before = _actor_pids()
    llm = AsyncLLM.from_engine_args(args, multiprocess=True)

    async def run() -> list[list[int]]:
        async def one(i: int) -> list[int]:
            outs = [o async for o in llm.generate(PROMPTS[i], params, str(i))]
            return list(outs[-1].outputs[0].token_ids)

        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    try:
        got = asyncio.run(run())
        pids = _actor_pids() - before
        assert len(pids) == 2  # in this module's Ray
    finally:
        llm.shutdown()
    assert got == [list(o.outputs[0].token_ids)[:40] for o in reference["greedy"]]
    assert wait_gone(list(pids)) == []
    assert _ray_still_works()
