"""`ModelRunner`: owns the model, the paged KV cache and one step's execution on one device.

`execute_model(SchedulerOutput) -> ModelRunnerOutput`: build the flat inputs (`input_batch`),
run the model over every scheduled token (on CUDA a pure-decode step, or any step of at most 512
tokens, replays a captured CUDA graph, `cuda_graphs`), compute logits only for the rows that
sample (and the prompt rows whose logprobs were asked for), sample, verify speculative drafts,
and return plain Python lists. The only device-to-host wait of a step is reading the sampled
token ids. The runner keeps its own copy of the requests it runs (`request_state`), kept by the
steps' plain data (new requests whole, then diffs), and each seeded request's
`torch.Generator`, created on first sight and dropped when the request finishes. Sizing the
cache (`determine_num_blocks`) follows vLLM: a fixed budget on CPU; on CUDA the weights, a
profiling forward at full batch and the CUDA-graph reserve are taken from
gpu_memory_utilization and the rest goes to KV blocks (`memory_plan`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pagoda import envs
from pagoda.attention.metadata import AttentionMetadata
from pagoda.config import EngineConfig
from pagoda.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagoda.sample.bitmask import apply_token_bitmask
from pagoda.sample.metadata import to_device_tensor
from pagoda.sample.sampler import (
    Sampler,
    SamplerTensors,
    SamplingMetadata,
    compute_prompt_logprobs,
    compute_prompt_token_id_logprobs,
)
from pagoda.utils import cpu_kernels
from pagoda.utils.cpu_build import usable_cores
from pagoda.worker.cuda_graphs import (
    CaptureFn,
    CUDAGraphRunner,
    cuda_graph_capture_sizes,
    mixed_graph_reserve_bytes,
    mixed_graph_shapes,
)
from pagoda.worker.forward_timer import ForwardTimer
from pagoda.worker.input_batch import InputBuilder, StepInputs
from pagoda.worker.kv_cache import KVCacheSpec, allocate_kv_caches, cpu_kv_cache_bytes
from pagoda.worker.memory_plan import MemoryPlan, check_fits_one_request, plan_kv_cache_memory
from pagoda.worker.request_state import RequestState, RequestStates

logger = logging.getLogger(__name__)

# Prompt logprobs need a [rows, vocab] float32 block; bound it (49k vocab x 256 rows = 50 MB).
_PROMPT_LOGPROBS_CHUNK = 256
# Backends whose kernel launches depend only on a mixed graph's bucket (grid from the token and
# request counts, request lookup on the device): the only ones a mixed step can be captured for.
_MIXED_GRAPH_BACKENDS = ("triton",)
# Steps of at most this many requests count as small for `reserve_core_for_frontend`.
_SMALL_BATCH_REQS = 2


def num_cpu_threads() -> int:
    """Threads for CPU kernels: $PAGODA_CPU_THREADS, else every core this process may use.

    On a machine shared with other busy processes, fewer threads can be much faster: each
    parallel op waits at a barrier for its slowest thread, which may be waiting for a core."""
    if envs.PAGODA_CPU_THREADS is not None:
        return envs.PAGODA_CPU_THREADS
    return usable_cores()


class ModelRunner:
    def __init__(self, engine_config: EngineConfig, cpu_threads: int | None = None) -> None:
        """`cpu_threads`: threads for CPU kernels (default `num_cpu_threads()`)."""
        self.config = engine_config
        self.model_config = engine_config.model_config
        self.cache_config = engine_config.cache_config
        self.scheduler_config = engine_config.scheduler_config
        self.device = torch.device(engine_config.device_config.device)
        self.cpu_threads = cpu_threads or num_cpu_threads()
        # Serving sets this: threads for steps of few requests, leaving a core to the HTTP
        # front end (see `reserve_core_for_frontend`).
        self.small_batch_cpu_threads: int | None = None
        if self.device.type == "cpu":
            torch.set_num_threads(self.cpu_threads)
        self.block_size = self.cache_config.block_size
        max_len = self.model_config.max_model_len
        self.inputs = InputBuilder(
            max_num_tokens=self.scheduler_config.max_num_batched_tokens,
            max_num_reqs=self.scheduler_config.max_num_seqs,
            max_blocks_per_req=-(-max_len // self.block_size),
            block_size=self.block_size,
            device=self.device,
        )
        self.sampler = Sampler()
        self.requests = RequestStates()
        self.generators: dict[str, torch.Generator] = {}
        self.kv_caches: list[torch.Tensor] = []
        self.model: torch.nn.Module | None = None
        self.weights_bytes = 0
        self.memory_plan: MemoryPlan | None = None
        # CUDA graphs (decode and mixed steps): CUDA only, unless enforce_eager; captured with
        # the KV cache.
        self.use_cuda_graphs = (
            self.device.type == "cuda" and not engine_config.device_config.enforce_eager
        )
        self.cuda_graph_sizes = self._decode_graph_sizes() if self.use_cuda_graphs else []
        self.mixed_graph_shapes = self._mixed_graph_shapes() if self.use_cuda_graphs else []
        self.cuda_graphs: CUDAGraphRunner | None = None
        # The last step's sampled ids on the device and each sampling request's row in them:
        # where the next step's placeholder rows take their input ids from.
        self._prev_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        # INT8 cache on a GPU: the next step sets the layers' K/V scales (see initialize_kv_cache).
        self._calibrate_kv_scales = False
        # Detailed request traces: each step's forward pass timed (`ForwardTimer`).
        self.time_forward = engine_config.observability_config.collect_model_forward_time

    def _decode_graph_sizes(self) -> list[int]:
        sc = self.scheduler_config
        return cuda_graph_capture_sizes(sc.max_num_seqs, sc.max_num_batched_tokens)

    def _mixed_graph_shapes(self) -> list[tuple[int, int]]:
        # The request owning a graph's padding tokens must fit a block-table row.
        max_len = self.inputs.max_blocks_per_req * self.block_size
        sc = self.scheduler_config
        return mixed_graph_shapes(sc.max_num_seqs, min(sc.max_num_batched_tokens, max_len))

    # -- setup ---------------------------------------------------------------------------
    def load_model(self) -> None:
        from pagoda.attention.backend import get_attn_backend
        from pagoda.model.loader import load_model

        if self.device.type == "cpu":
            # Usually started already (`EngineArgs.create_engine_config`); the loaders below
            # wait for their own library.
            cpu_kernels.start_build(gguf=self.model_config.quantization == "gguf")
        backend = get_attn_backend(self.device, self.config.device_config.attention_backend)
        self.attn_backend = backend
        on_cuda = self.device.type == "cuda"
        before = torch.cuda.memory_allocated(self.device) if on_cuda else 0
        try:
            self.model = load_model(self.model_config, self.device, attn_backend=backend)
        except torch.OutOfMemoryError as e:
            total = torch.cuda.mem_get_info(self.device)[1]
            raise ValueError(
                f"the model weights do not fit on {self.device} ({total / 2**30:.2f} GiB, "
                f"{torch.cuda.memory_allocated(self.device) / 2**30:.2f} GiB allocated when "
                "loading failed): use a smaller or quantized model or more GPUs "
                "(--tensor-parallel-size)"
            ) from e
        if on_cuda:
            self.weights_bytes = torch.cuda.memory_allocated(self.device) - before
        # The torch attention backend is the reference path: the whole model runs in plain
        # torch then. Otherwise CUDA tensors take the fused Triton norm / activation / RoPE.
        set_fused = getattr(self.model, "set_fused_ops", None)
        if set_fused is not None:
            set_fused(backend.name != "torch")
        enable_cpu_decoder = getattr(self.model, "enable_cpu_decoder", None)
        if enable_cpu_decoder is not None and self.device.type == "cpu":
            enable_cpu_decoder()  # the weights are final from here on
        self._enable_ggml_numerics()
        if self.use_cuda_graphs and backend.name != "triton":
            # Graphs bake in host-side choices; only the Triton backend makes none per step.
            logger.info("CUDA graphs off: the %s attention backend runs eagerly", backend.name)
            self.use_cuda_graphs, self.cuda_graph_sizes, self.mixed_graph_shapes = False, [], []

    def _enable_ggml_numerics(self) -> None:
        """`$PAGODA_CPU_NUMERICS=ggml`: the model computes llama.cpp's logits bit for bit."""
        from pagoda.model.models.llama_ggml import variant_of

        mode = envs.PAGODA_CPU_NUMERICS
        variant = variant_of(mode)
        if variant is None:
            return
        enable = getattr(self.model, "enable_ggml_numerics", None)
        if enable is None or self.device.type != "cpu":
            raise ValueError(f"PAGODA_CPU_NUMERICS={mode} runs Llama GGUF models on the CPU")
        if self.cache_config.cache_dtype != "float16":
            raise ValueError(
                f"PAGODA_CPU_NUMERICS={mode} reads an f16 KV cache as llama.cpp keeps it: pass "
                f"--kv-cache-dtype float16 (got {self.cache_config.cache_dtype})"
            )
        if self.config.speculative_config is not None:
            raise ValueError(
                f"PAGODA_CPU_NUMERICS={mode} reproduces llama.cpp's one-token decode steps; "
                "speculative decoding verifies several tokens a step, which llama.cpp sums in "
                "another order: drop speculative_config"
            )
        enable(variant)
        logger.info("CPU numerics: llama.cpp's (ggml, %s build), op by op", variant)

    def get_kv_cache_spec(self) -> KVCacheSpec:
        from pagoda.model.layers.attention import Attention

        if self.model is None:
            raise RuntimeError("call load_model() before sizing the KV cache")
        layer = next(m for m in self.model.modules() if isinstance(m, Attention))
        return KVCacheSpec.from_config(
            self.cache_config.cache_dtype,
            self.model_config.dtype,
            self.model_config.num_layers,
            self.block_size,
            layer.num_kv_heads,
            layer.head_size,
        )

    def bytes_per_block(self) -> int:
        return self.get_kv_cache_spec().bytes_per_block

    def determine_num_blocks(self) -> int:
        """KV blocks to allocate: num_gpu_blocks_override if set; on CPU
        kv_cache_memory_bytes or min(2 GiB, 25% of available RAM); on CUDA what
        gpu_memory_utilization * total memory leaves after the weights, a profiling forward at
        full batch and the CUDA-graph reserve (`memory_plan`, logged)."""
        spec = self.get_kv_cache_spec()
        cc = self.cache_config
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        elif self.device.type == "cuda":
            self.memory_plan = self._plan_cuda_memory(spec)
            logger.info("%s", self.memory_plan.summary())
            num_blocks = self.memory_plan.num_blocks
        else:
            budget = cc.kv_cache_memory_bytes or cpu_kv_cache_bytes()
            num_blocks = budget // spec.bytes_per_block
        check_fits_one_request(num_blocks, self.block_size, self.model_config.max_model_len)
        return int(num_blocks)

    @torch.inference_mode()
    def _plan_cuda_memory(self, spec: KVCacheSpec) -> MemoryPlan:
        from pagoda.model.parallel import get_tp_size
        from pagoda.worker.profiling import (
            TP_PER_GRAPH_BYTES,
            estimate_cuda_graph_memory,
            profile_peak_memory,
        )

        sc = self.scheduler_config
        try:
            activations, non_torch = profile_peak_memory(self)
            graphs = estimate_cuda_graph_memory(self, self.cuda_graph_sizes)
            graphs += self._estimate_mixed_graph_memory()
            if graphs and get_tp_size() > 1:
                num_graphs = len(self.cuda_graph_sizes) + len(self.mixed_graph_shapes)
                graphs += num_graphs * TP_PER_GRAPH_BYTES
        except torch.OutOfMemoryError as e:
            raise ValueError(
                f"the profiling forward of a {sc.max_num_batched_tokens}-token step (and "
                f"{sc.max_num_seqs} sampled rows) ran out of GPU memory next to "
                f"{self.weights_bytes / 2**30:.2f} GiB of weights: lower "
                "--max-num-batched-tokens / --max-num-seqs"
            ) from e
        return plan_kv_cache_memory(
            total_bytes=torch.cuda.mem_get_info(self.device)[1],
            gpu_memory_utilization=self.cache_config.gpu_memory_utilization,
            weights_bytes=self.weights_bytes,
            activation_bytes=activations,
            non_torch_bytes=non_torch,
            cuda_graph_bytes=graphs,
            bytes_per_block=spec.bytes_per_block,
            block_size=self.block_size,
            max_model_len=self.model_config.max_model_len,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            kv_cache_memory_bytes=self.cache_config.kv_cache_memory_bytes,
        )

    def _estimate_mixed_graph_memory(self) -> int:
        """Bytes to reserve for the mixed graphs: a forward at the largest bucket over a
        two-block cache (the graphs' shared pool holds about its activations), plus outputs and
        per-graph overhead (`mixed_graph_reserve_bytes`). CUDA only."""
        shapes = self.mixed_graph_shapes
        if not shapes:
            return 0
        num_tokens, num_reqs = shapes[-1]
        caches = allocate_kv_caches(self.get_kv_cache_spec(), 2, self.device)
        inputs = self.inputs
        inputs.prepare_mixed_padding_only(num_tokens, num_reqs)
        md = inputs.mixed_metadata(num_tokens, num_reqs, self.model_config.max_model_len)
        ids, positions = inputs.input_ids.dev[:num_tokens], inputs.positions.dev[:num_tokens]
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            hidden = self.model(ids, positions, caches, md)
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - what capture would hit: run those steps eagerly
            logger.warning("Mixed-step CUDA graphs off: their padded forward failed (%s)", e)
            self.mixed_graph_shapes = []
            return 0
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        row_bytes = hidden.shape[-1] * hidden.element_size()
        del hidden, caches
        torch.cuda.empty_cache()
        return mixed_graph_reserve_bytes(peak, shapes, row_bytes)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """One tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_size]."""
        spec = self.get_kv_cache_spec()
        self.kv_caches = allocate_kv_caches(spec, num_blocks, self.device)
        self.num_blocks = num_blocks
        if self.device.type == "cuda" and self.kv_caches[0].dtype == torch.int8:
            # INT8 needs scales from real K/V: the first step computes them, eagerly.
            from pagoda.model.layers.attention import Attention

            for module in self.model.modules():
                if isinstance(module, Attention):
                    module.use_device_kv_scales(self.device)
            self._calibrate_kv_scales = True
        if self.use_cuda_graphs:
            self.capture_cuda_graphs()
        if self.device.type == "cuda" and not self._calibrate_kv_scales:
            from pagoda.worker.warmup import warm_up_eager_kernels

            seconds = warm_up_eager_kernels(self)
            logger.info("eager-step kernels compiled (warm-up steps) in %.1f s", seconds)

    def capture_cuda_graphs(self, capture_fn: CaptureFn | None = None) -> None:
        """Capture the decode and mixed-step graphs over the current KV cache (`capture_fn`: a
        stand-in for torch.cuda graphs, so the bookkeeping can be tested on a CPU). Mixed
        graphs only for a backend in `_MIXED_GRAPH_BACKENDS`."""
        mixed = self.mixed_graph_shapes if self.use_cuda_graphs else self._mixed_graph_shapes()
        if self.attn_backend.name not in _MIXED_GRAPH_BACKENDS:
            mixed = []
        self.cuda_graphs = CUDAGraphRunner(
            self._forward_for_graph,
            self.inputs,
            self.cuda_graph_sizes or self._decode_graph_sizes(),
            self.model_config.max_model_len,
            capture_fn=capture_fn,
            mixed_shapes=mixed,
        )
        self.cuda_graphs.capture()
        plan = self.memory_plan
        if plan is not None and self.cuda_graphs.memory_bytes > plan.cuda_graph_bytes:
            logger.warning(
                "CUDA graphs took %.2f GiB, more than the %.2f GiB reserved for them",
                self.cuda_graphs.memory_bytes / 2**30,
                plan.cuda_graph_bytes / 2**30,
            )

    def _forward_for_graph(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        # A backend's per-step plan is rebuilt from the buffers (only matters when a stand-in
        # re-runs this function; a real capture runs it once).
        attn_metadata.extra = None
        self.attn_backend.prepare(attn_metadata)
        return self.model(input_ids, positions, self.kv_caches, attn_metadata)

    # -- one step ------------------------------------------------------------------------
    def reserve_core_for_frontend(self, max_reqs: int = _SMALL_BATCH_REQS) -> None:
        """Run steps of at most `max_reqs` requests on one core fewer (CPU only).

        A server's event loop shares the cores with the compute threads; at small batches every
        parallel op then waits at its barrier for a thread the event loop pushed off its core.
        Measured on 2 cores, concurrency 1: 19.3 ms/token with 2 threads, 15.9 with 1."""
        if self.device.type == "cpu" and self.cpu_threads > 1:
            self.small_batch_cpu_threads = self.cpu_threads - 1
            self._small_batch_reqs = max_reqs

    def _set_cpu_threads(self, num_reqs: int) -> None:
        small = self.small_batch_cpu_threads
        want = small if small and num_reqs <= self._small_batch_reqs else self.cpu_threads
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens."""
        output = self.execute_model_async(so).get()
        self.inputs.copies_done()  # the host waited for the sampled ids, queued after them
        return output

    @torch.inference_mode()
    def execute_model_async(self, so: SchedulerOutput) -> StepOutputFuture:
        """Queue one step on the device and return without waiting for it; `.get()` on the
        result waits for the sampled tokens. Requests whose last token is still being sampled
        by the previous step (async scheduling: `Request.num_output_placeholders`) take it
        from that step's sampled ids on the device. Every step must reach the runner, in the
        order the scheduler made them: it keeps its requests by their diffs."""
        for rid in so.finished_req_ids:
            self.generators.pop(rid, None)
        requests = self.requests.update(so)
        req_ids = [r.req_id for r in requests]
        output = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids={r: [] for r in req_ids})
        if so.is_empty or not req_ids:
            return StepOutputFuture(output)
        if self.small_batch_cpu_threads is not None:
            self._set_cpu_threads(len(req_ids))
        graphs = self.cuda_graphs
        if graphs is None or self._calibrate_kv_scales:
            step = self.inputs.prepare(so, requests)
            step.attn_metadata.calibrate_kv_scales = self._calibrate_kv_scales
            self._calibrate_kv_scales = False
        else:
            step = self.inputs.prepare(so, requests, graphs.padded_size, graphs.mixed_shape)
        if step.placeholder_rows:
            self._fill_placeholders(step)
        graph_key = step.graph_key
        timer = ForwardTimer(self.device) if self.time_forward else None
        if graph_key is not None:
            hidden = graphs.replay(graph_key)
        else:
            self.attn_backend.prepare(step.attn_metadata)
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.attn_metadata)
        if timer is not None:
            timer.stop()

        future = StepOutputFuture(output, timer)
        if step.sample_rows:
            self._sample(step, hidden, future, so)
        for rid, (rows, targets) in step.prompt_logprob_rows.items():
            output.prompt_logprobs[rid] = self._prompt_logprobs(step, hidden, rid, rows, targets)
        for rid, (rows, first) in step.prompt_token_id_rows.items():
            output.prompt_token_id_logprobs[rid] = self._prompt_token_id_logprobs(
                step, hidden, rid, rows, first
            )
        return future

    def _fill_placeholders(self, step: StepInputs) -> None:
        """Write the device-side sampled ids of the previous step into the input rows whose
        token the host does not know yet."""
        if self._prev_sampled is None:
            raise RuntimeError("a step needs the previous step's sampled tokens, but none ran")
        prev_ids, prev_rows = self._prev_sampled
        dst = [row for row, _ in step.placeholder_rows]
        try:
            src = [prev_rows[rid] for _, rid in step.placeholder_rows]
        except KeyError as e:
            raise RuntimeError(f"request {e} has no token in flight from the previous step") from e
        ids = self.inputs.input_ids.dev
        n = len(dst)
        if dst[-1] == n - 1 and src == dst:  # the same requests in the same rows: one copy
            ids[:n].copy_(prev_ids[:n])
            return
        dst_t = to_device_tensor(dst, torch.int64, ids.device)
        src_t = to_device_tensor(src, torch.int64, ids.device)
        ids.index_copy_(0, dst_t, prev_ids.index_select(0, src_t))

    def _generator(self, req: RequestState) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(req.req_id)
        if gen is None:
            gen = torch.Generator(self.device).manual_seed(seed)
            self.generators[req.req_id] = gen
        return gen

    def _sample(
        self, step: StepInputs, hidden: torch.Tensor, future: StepOutputFuture, so: SchedulerOutput
    ) -> None:
        """Queue the logits and the sampler; the results reach the host asynchronously."""
        if step.logits_indices is None:  # rows 0 .. n-1: no gather
            logits = self.model.compute_logits(hidden[: len(step.sample_rows)])
        else:
            logits = self.model.compute_logits(hidden.index_select(0, step.logits_indices))
        if so.grammar_bitmask is not None:
            self._apply_grammar_bitmask(logits, step, so)
        params, prompts, outputs, generators = [], [], [], []
        spec = so.scheduled_spec_decode_tokens
        for req, lo, hi in step.sample_reqs:
            sp = req.sampling_params
            gen = self._generator(req) if sp.seed is not None else None
            params.append(sp)
            prompts.append(req.prompt_token_ids)
            outputs.append(req.output_token_ids)
            generators.append(gen)
            if hi - lo == 1:
                continue
            # Row j verifies draft j: its penalties see the drafts before it as output.
            drafts = spec[req.req_id]
            for j in range(1, hi - lo):
                params.append(sp)
                prompts.append(req.prompt_token_ids)
                outputs.append(req.output_token_ids + drafts[:j])
                generators.append(gen)
        md = SamplingMetadata.from_requests(
            params, prompts, outputs, generators, logits.shape[1], logits.device
        )
        sampled = self.sampler.sample_on_device(logits, md)
        # The next step may read these ids on the device (its placeholder rows).
        self._prev_sampled = (
            sampled.sampled_token_ids,
            {req.req_id: lo for req, lo, hi in step.sample_reqs if hi - lo == 1},
        )
        sample_reqs = [
            (
                req.req_id,
                lo,
                hi,
                spec[req.req_id] if hi - lo > 1 else [],
                req.sampling_params.num_logprobs is not None,
            )
            for req, lo, hi in step.sample_reqs
        ]
        future.set_sampled(sampled.to_host_async(), md, sample_reqs)

    def _apply_grammar_bitmask(
        self, logits: torch.Tensor, step: StepInputs, so: SchedulerOutput
    ) -> None:
        """Structured outputs: mask the rows of the requests the bitmask names, before the
        sampler (so its penalties, temperature, top-k/p and logprobs see the masked logits)."""
        first_row = {req.req_id: lo for req, lo, _ in step.sample_reqs}
        rows = [first_row[rid] for rid in so.structured_output_request_ids]
        apply_token_bitmask(logits, torch.from_numpy(so.grammar_bitmask), rows)

    def _prompt_logprobs(
        self, step: StepInputs, hidden: torch.Tensor, rid: str, rows: list[int], targets: list[int]
    ) -> list[dict[int, tuple[float, int]]]:
        req = next(r for r in step.requests if r.req_id == rid)
        k = req.sampling_params.prompt_logprobs or 0
        return self._score_prompt_rows(
            hidden,
            rows,
            lambda logits, i: compute_prompt_logprobs(
                logits, targets[i : i + _PROMPT_LOGPROBS_CHUNK], k
            ),
        )

    def _prompt_token_id_logprobs(
        self, step: StepInputs, hidden: torch.Tensor, rid: str, rows: list[int], first: int
    ) -> list[list[float]]:
        """The logprobs of rows first, first + 1, ... of the request's prompt_logprob_token_ids,
        at the hidden states `rows`."""
        req = next(r for r in step.requests if r.req_id == rid)
        ids = req.sampling_params.prompt_logprob_token_ids[first : first + len(rows)]
        return self._score_prompt_rows(
            hidden,
            rows,
            lambda logits, i: compute_prompt_token_id_logprobs(
                logits, ids[i : i + _PROMPT_LOGPROBS_CHUNK]
            ),
        )

    def _score_prompt_rows(
        self, hidden: torch.Tensor, rows: list[int], score: Callable[[torch.Tensor, int], list]
    ) -> list:
        """`score(logits, i)` of the logits of the hidden states `rows`, taken
        `_PROMPT_LOGPROBS_CHUNK` at a time (i: the chunk's first index in `rows`), concatenated."""
        result: list = []
        for i in range(0, len(rows), _PROMPT_LOGPROBS_CHUNK):
            chunk = torch.tensor(rows[i : i + _PROMPT_LOGPROBS_CHUNK], device=hidden.device)
            result += score(self.model.compute_logits(hidden.index_select(0, chunk)), i)
        return result


class StepOutputFuture:
    """One launched step's `ModelRunnerOutput`; `get()` waits for its sampled tokens (the
    step's only device-to-host wait) and fills them in."""

    def __init__(
        self, output: ModelRunnerOutput, forward_timer: ForwardTimer | None = None
    ) -> None:
        self.output = output
        self._forward_timer = forward_timer  # read into output.model_forward_time by get()
        self._sampled: SamplerTensors | None = None
        self._md: SamplingMetadata | None = None
        self._sample_reqs: list[tuple[str, int, int, list[int], bool]] = []
        self._event: torch.cuda.Event | None = None

    def set_sampled(
        self,
        sampled: SamplerTensors,
        md: SamplingMetadata,
        sample_reqs: list[tuple[str, int, int, list[int], bool]],
    ) -> None:
        """The sampler's results (host copies being made), its metadata, and per sampling
        request (request id, first row, end row, drafts verified by rows after the first,
        whether it asked for logprobs)."""
        self._sampled, self._md, self._sample_reqs = sampled, md, sample_reqs
        if sampled.sampled_token_ids.is_pinned():
            self._event = torch.cuda.Event()
            self._event.record()

    def done(self) -> bool:
        """Whether `get()` would return without waiting for the device."""
        return self._sampled is None or self._event is None or self._event.query()

    def get(self) -> ModelRunnerOutput:
        output = self._get_sampled()
        if self._forward_timer is not None:  # after the wait: its end event has passed
            output.model_forward_time = self._forward_timer.seconds()
            self._forward_timer = None
        return output

    def _get_sampled(self) -> ModelRunnerOutput:
        if self._sampled is None:
            return self.output
        if self._event is not None:
            self._event.synchronize()
        result = self._sampled.tolist(self._md)
        self._sampled = None
        token_ids, sampled_logprobs = result.sampled_token_ids, result.logprobs
        output = self.output
        for rid, lo, hi, drafts, wants_logprobs in self._sample_reqs:
            if hi - lo == 1:  # no drafts: the common case, kept short
                output.sampled_token_ids[rid] = [token_ids[lo]]
                if wants_logprobs:
                    output.logprobs[rid] = [sampled_logprobs[lo]]
                continue
            tokens = token_ids[lo:hi]
            logprobs = sampled_logprobs[lo:hi]
            # Drafts come from a deterministic proposer (n-gram, greedy draft model): sampling
            # the target and accepting a draft iff it equals the sample is then exact
            # rejection sampling (accept d with p(d); else a sample of p restricted to != d).
            num_accepted = 0
            for draft, token in zip(drafts, tokens):
                if draft != token:
                    break
                num_accepted += 1
            keep = num_accepted + 1
            output.sampled_token_ids[rid] = tokens[:keep]
            if wants_logprobs:
                output.logprobs[rid] = logprobs[:keep]
        return output
