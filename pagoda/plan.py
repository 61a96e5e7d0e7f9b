"""`pagoda plan MODEL`: what the engine will do with memory, from the model's config alone.

Reads config.json, a GGUF file's metadata or a preset (`benchmarks/presets/NAME`), loads no
weights and imports no torch, and runs the engine's own split (`memory_plan`) on the estimates
of `memory_estimate`: the weights (in the form the loader gives them: `plan_weights`), the KV
cache's bytes per token, its blocks and tokens, how many max_model_len requests fit at once,
the reserve beside the cache (activations, CUDA graphs, the CUDA context), and when it does not
fit, what to change.
"""

from __future__ import annotations

import argparse
import json
import math
import mmap
import os
import shutil
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

from pagoda.config import KV_CACHE_DTYPES
from pagoda.worker.memory_plan import (
    KV_CACHE_ITEMSIZE,
    GiB,
    KVCacheTooLargeError,
    blocks_per_request,
    cpu_kv_cache_bytes,
    kv_cache_bytes_per_block,
    plan_kv_cache_memory,
)

EXAMPLES = """examples:
  pagoda plan                                   # the embedded model on this CPU
  pagoda plan llama-3-8b --gpu-memory-gib 80    # a preset (benchmarks/presets) on an 80 GiB GPU
  pagoda plan /models/Llama-3-8B --gpu-memory-gib 141 --kv-cache-dtype fp8 --max-model-len 8192
  pagoda plan /models/Llama-3-8B-AWQ --gpu-memory-gib 24 --max-num-seqs 64 --json
"""
_PRESETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                        "presets")  # fmt: skip


@dataclass
class Plan:
    model: str
    device: str
    dtype: str
    kv_cache_dtype: str
    quantization: str | None
    max_model_len: int
    block_size: int
    tensor_parallel_size: int
    weights_bytes: int  # one rank's
    weights_note: str
    kv_bytes_per_token: int  # one rank's
    total_bytes: int | None = None  # GPU memory, or the machine's RAM on a CPU
    budget_bytes: int = 0  # what the KV cache and everything beside it may take
    activation_bytes: int = 0
    cuda_graph_bytes: int = 0
    non_torch_bytes: int = 0
    kv_cache_bytes: int = 0
    num_blocks: int = 0
    fits: bool = True
    problem: str = ""
    advice: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """max_model_len requests that fit at once (block 0 is the null block)."""
        if self.num_blocks <= 1:
            return 0.0
        return (self.num_blocks - 1) / blocks_per_request(self.max_model_len, self.block_size)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "num_tokens": self.num_tokens,
                "max_concurrency": self.max_concurrency}  # fmt: skip


def resolve_model(model: str | None) -> tuple[str, str]:
    """(path, load_format): a path as given, or a preset's config.json (dummy weights)."""
    from pagoda.config import embedded_model_path

    if not model:
        return embedded_model_path(), "auto"
    if os.path.exists(model):
        if model.endswith(".json"):
            return model, "dummy"
        if os.path.isdir(model) and not any(
            f.endswith((".safetensors", ".bin", ".pt")) for f in os.listdir(model)
        ):
            return model, "dummy"  # a config without weights: its shape is all plan needs
        return model, "auto"
    preset = os.path.join(_PRESETS, model, "config.json")
    if os.path.isfile(preset):
        return preset, "dummy"
    names = sorted(os.listdir(_PRESETS)) if os.path.isdir(_PRESETS) else []
    raise ValueError(
        f"model {model!r} is neither a path (HF directory, .gguf file, config.json) nor a "
        f"preset{' (' + ', '.join(names) + ')' if names else ''}"
    )


def detect_gpu_memory_bytes() -> int | None:
    """The first GPU's memory from nvidia-smi, or None where there is none."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.split()  # fmt: skip
        return int(float(out[0])) * 2**20 if out else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def make_plan(args: argparse.Namespace) -> Plan:
    """The plan for `args` (see `add_plan_args`); raises ValueError for a bad value."""
    from pagoda.engine.arg_utils import EngineArgs, resolve_dtype, resolve_kv_cache_dtype
    from pagoda.plan_weights import estimate_weights
    from pagoda.quant_config import (
        QUANT_METHODS,
        checkpoint_accepts,
        checkpoint_quant_method,
        linear_method_refusal,
    )
    from pagoda.worker import memory_estimate as est

    if args.gpu_memory_gib is not None and args.device == "cpu":
        raise ValueError("--gpu-memory-gib is for a GPU: leave out --device cpu")
    if args.gpu_memory_gib is not None and not 0 < args.gpu_memory_gib < math.inf:
        raise ValueError(
            f"--gpu-memory-gib must be a positive number of GiB, got {args.gpu_memory_gib}"
        )
    total = None if args.gpu_memory_gib is None else int(args.gpu_memory_gib * GiB)
    device = args.device
    if device == "auto":
        total = total or detect_gpu_memory_bytes()
        device = "cuda" if total else "cpu"
    if device == "cuda" and total is None:
        total = detect_gpu_memory_bytes()
        if total is None:
            raise ValueError("no GPU found here: pass --gpu-memory-gib N for the GPU to plan for")
    path, load_format = resolve_model(args.model)
    engine_args = EngineArgs(
        model=path, load_format=load_format, dtype=args.dtype, max_model_len=args.max_model_len,
        block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
    )  # fmt: skip
    model, hf_config, max_model_len = engine_args.check_model_config()
    sc = engine_args._scheduler_config(max_model_len, async_scheduling=False)  # noqa: SLF001
    ckpt = checkpoint_quant_method(hf_config)
    if ckpt not in (None, *QUANT_METHODS) and (load_format != "dummy" or not args.quantization):
        # As the engine refuses a checkpoint's method at start; a shape planned with
        # --quantization plans that instead of its config's.
        raise ValueError(f"{model}: quantization_config.quant_method {ckpt!r} is not supported "
                         f"yet; supported: {', '.join(QUANT_METHODS)}")  # fmt: skip
    if args.quantization and load_format != "dummy":
        # As the engine refuses it at start (EngineArgs.create_engine_config); for a shape
        # without weights (a preset, a config.json) --quantization says what to plan.
        if ckpt and not checkpoint_accepts(args.quantization, ckpt, hf_config):
            raise ValueError(f"--quantization {args.quantization} but {model} is a {ckpt!r} "
                             "checkpoint: leave out --quantization")  # fmt: skip
        if not ckpt and args.quantization == "w8a8":
            raise ValueError(f"--quantization w8a8 but {model} has no compressed-tensors "
                             "quantization_config: make one with `pagoda quantize --method "
                             "w8a8`, or plan --quantization fp8 (quantized at load)")  # fmt: skip
    elif args.quantization and ckpt in QUANT_METHODS:
        # A shape without weights, loaded as the engine's --load-format dummy loads it: the
        # loader refuses a config of another method (awq over gptq, gptq over awq, awq / gptq
        # over compressed-tensors or fp8, fp8 over an int8 compressed-tensors config) and
        # takes fp8 / w8a8 over an AWQ / GPTQ one (quantized at load).
        refusal = linear_method_refusal(args.quantization, hf_config, dummy=True)
        if refusal is not None:
            raise ValueError(refusal)
    quant = args.quantization or ckpt
    dtype = resolve_dtype(args.dtype, hf_config, device, quant)
    tp = args.tensor_parallel_size
    shape = est.ModelShape.from_hf_config(hf_config)
    if shape.num_attention_heads % tp:
        raise ValueError(
            f"--tensor-parallel-size {tp} does not divide the model's "
            f"{shape.num_attention_heads} attention heads"
        )
    itemsize = est.DTYPE_ITEMSIZE[dtype]
    cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, device)
    bytes_per_block = kv_cache_bytes_per_block(
        shape.num_layers, args.block_size, shape.kv_heads_per_rank(tp), shape.head_dim,
        KV_CACHE_ITEMSIZE[cache_dtype],
    )  # fmt: skip
    weights, note = estimate_weights(model, hf_config, dtype, itemsize, device, quant, tp)
    plan = Plan(
        model=args.model or os.path.basename(model),
        device=device, dtype=dtype, kv_cache_dtype=cache_dtype, quantization=quant,
        max_model_len=max_model_len, block_size=args.block_size, tensor_parallel_size=tp,
        weights_bytes=weights, weights_note=note,
        kv_bytes_per_token=bytes_per_block // args.block_size, total_bytes=total,
    )  # fmt: skip
    if device == "cpu":
        return _plan_cpu(plan, args, bytes_per_block, shape.num_layers)
    eager = args.enforce_eager
    plan.activation_bytes = est.activation_bytes(hf_config, itemsize, sc.max_num_batched_tokens,
                                                 sc.max_num_seqs, tp)  # fmt: skip
    plan.cuda_graph_bytes = 0 if eager else est.cuda_graph_bytes(
        hf_config, itemsize, sc.max_num_batched_tokens, sc.max_num_seqs, max_model_len,
        args.block_size, tp,
    )  # fmt: skip
    plan.non_torch_bytes = est.CUDA_CONTEXT_BYTES
    plan.budget_bytes = int(total * args.gpu_memory_utilization)
    try:
        mp = plan_kv_cache_memory(
            total_bytes=total, gpu_memory_utilization=args.gpu_memory_utilization,
            weights_bytes=weights, activation_bytes=plan.activation_bytes,
            non_torch_bytes=plan.non_torch_bytes, cuda_graph_bytes=plan.cuda_graph_bytes,
            bytes_per_block=bytes_per_block, block_size=args.block_size,
            max_model_len=max_model_len, max_num_batched_tokens=sc.max_num_batched_tokens,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        )  # fmt: skip
        plan.num_blocks, plan.kv_cache_bytes = mp.num_blocks, mp.kv_cache_bytes
    except KVCacheTooLargeError as e:
        plan.fits, plan.problem = False, str(e)
        plan.kv_cache_bytes = args.kv_cache_memory_bytes
        plan.num_blocks = plan.kv_cache_bytes // bytes_per_block
        plan.advice = [f"--kv-cache-memory-bytes {e.fit_bytes} or less (or leave it out: "
                       "gpu_memory_utilization sizes the cache)"] if e.fit_bytes else []  # fmt: skip
        return plan
    except ValueError as e:
        plan.fits, plan.problem = False, str(e)
        fixed = weights + plan.activation_bytes + plan.cuda_graph_bytes + plan.non_torch_bytes
        plan.kv_cache_bytes = max(plan.budget_bytes - fixed, 0)
        plan.num_blocks = plan.kv_cache_bytes // bytes_per_block
    plan.advice = advise(plan, sc.max_num_seqs, shape)
    return plan


def _mapping_refused(nbytes: int) -> str | None:
    """Why the kernel refuses an anonymous mapping of `nbytes` (None when it grants it). The
    engine maps each layer's CPU cache so (`pagoda.worker.kv_cache._zeros`) and stops at start
    when the kernel refuses; asking here for the same mapping, released untouched, costs no
    memory and tells what the engine would meet."""
    try:
        mmap.mmap(-1, nbytes).close()
    except (OSError, OverflowError) as e:
        return getattr(e, "strerror", None) or str(e)
    return None


def _plan_cpu(plan: Plan, args: argparse.Namespace, bytes_per_block: int, num_layers: int) -> Plan:
    """As `ModelRunner.determine_num_blocks` on a CPU: a fixed budget for the cache."""
    from pagoda.cli import _total_memory_bytes

    tp = plan.tensor_parallel_size
    budget = args.kv_cache_memory_bytes or cpu_kv_cache_bytes() // tp
    plan.total_bytes = _total_memory_bytes()
    plan.budget_bytes = budget
    plan.num_blocks = budget // bytes_per_block
    plan.kv_cache_bytes = plan.num_blocks * bytes_per_block
    layer_bytes = plan.kv_cache_bytes // num_layers  # one [2, num_blocks, ...] tensor a layer
    refused = _mapping_refused(layer_bytes) if layer_bytes else None
    need = (plan.weights_bytes + plan.kv_cache_bytes) * tp
    if plan.total_bytes and plan.weights_bytes * tp > plan.total_bytes:
        plan.fits = False
        plan.problem = (f"the weights take {plan.weights_bytes * tp / GiB:.1f} GiB, more than "
                        f"this machine's {plan.total_bytes / GiB:.1f} GiB of memory")  # fmt: skip
    elif refused or plan.total_bytes and need > plan.total_bytes:
        plan.fits = False
        plan.problem = (
            f"a KV cache tensor of {_size(layer_bytes)} a layer cannot be allocated ({refused}): "
            "the engine stops at start" if refused else
            f"the KV cache ({_size(plan.kv_cache_bytes * tp)}) and the weights take "
            f"{_size(need)}, more than this machine's {_size(plan.total_bytes)}: the engine "
            "starts, but runs out of memory as the cache fills"
        )  # fmt: skip
        room = (plan.total_bytes or 0) // tp - plan.weights_bytes
        fit = room // bytes_per_block * bytes_per_block
        plan.advice = [f"--kv-cache-memory-bytes below {fit}, what the RAM leaves beside the "
                       "weights (or leave it out)"] if fit > 0 else []  # fmt: skip
        return plan
    elif plan.num_blocks < blocks_per_request(plan.max_model_len, plan.block_size) + 1:
        plan.fits = False
        plan.problem = (f"the KV cache budget ({budget / GiB:.2f} GiB) holds {plan.num_tokens} "
                        f"tokens, fewer than one max_model_len={plan.max_model_len} request")  # fmt: skip
    plan.advice = advise(plan, args.max_num_seqs, None)
    return plan


def advise(plan: Plan, max_num_seqs: int, shape: Any) -> list[str]:
    """What to change: to fit at all, or to run max_num_seqs full-length requests at once."""
    out: list[str] = []
    gpu = plan.device == "cuda"
    if gpu and plan.weights_bytes > plan.budget_bytes - plan.non_torch_bytes:
        usable = max(plan.budget_bytes - plan.non_torch_bytes, 1)
        need = math.ceil(plan.weights_bytes * plan.tensor_parallel_size / usable)
        tp = 1 << max(need - 1, 0).bit_length()
        return [f"the weights do not fit: --tensor-parallel-size {tp} (if the heads divide), "
                "a 4-bit AWQ/GPTQ checkpoint (about 0.36x of bf16), or a larger GPU"]  # fmt: skip
    if not plan.fits and not gpu and "weights" in plan.problem:
        return ["use a smaller or quantized model (a GGUF file keeps its blocks on a CPU)"]
    if plan.max_concurrency >= max_num_seqs:
        return out
    fit_len = max(plan.num_blocks - 1, 0) * plan.block_size
    if plan.max_concurrency < 1 and fit_len >= 16:
        out.append(f"--max-model-len {fit_len} fits one request")
    if gpu:
        if plan.kv_cache_dtype not in ("fp8", "fp8_e4m3", "fp8_e5m2", "int8"):
            out.append("--kv-cache-dtype fp8 halves the cache's bytes per token (2x the tokens)")
        if plan.cuda_graph_bytes:
            out.append(f"--enforce-eager frees the CUDA graphs' "
                       f"{plan.cuda_graph_bytes / GiB:.2f} GiB (slower decode)")  # fmt: skip
        if plan.num_blocks < 1:
            out.append("--max-num-batched-tokens 512 shrinks the activations' reserve")
        out.append("--gpu-memory-utilization 0.95 gives the cache more of the GPU")
    else:
        out.append("--kv-cache-memory-bytes N gives the cache more of the RAM")
    if plan.max_concurrency >= 1:
        out.append(f"at max_model_len={plan.max_model_len} only {plan.max_concurrency:.1f} "
                   f"requests fit at once, below --max-num-seqs {max_num_seqs}: shorter "
                   "requests share the rest (lower --max-model-len to what requests need)")  # fmt: skip
    return out


def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


def format_plan(p: Plan) -> str:
    rank = " a rank" if p.tensor_parallel_size > 1 else ""
    lines = [
        f"Model:        {p.model} ({p.dtype} on {p.device}"
        + (f", tensor parallel {p.tensor_parallel_size}" if p.tensor_parallel_size > 1 else "")
        + f"), max_model_len {p.max_model_len}",
        f"Weights:      {_size(p.weights_bytes)}{rank} ({p.weights_note})",
        f"KV cache:     {p.kv_bytes_per_token / 1024:.1f} KiB per token{rank} "
        f"({p.kv_cache_dtype}), blocks of {p.block_size} tokens",
    ]
    if p.device == "cuda":
        lines += [
            f"GPU memory:   {_size(p.total_bytes)} x gpu_memory_utilization = "
            f"{_size(p.budget_bytes)}",
            f"Reserve:      activations {_size(p.activation_bytes)}, CUDA graphs "
            f"{_size(p.cuda_graph_bytes)}, CUDA context {_size(p.non_torch_bytes)}",
        ]
    else:
        lines.append(f"RAM:          {_size(p.total_bytes)}; the KV cache takes a fixed "
                     f"{_size(p.budget_bytes)} (--kv-cache-memory-bytes; default min(2 GiB, "
                     "25% of the available RAM)); no activation reserve on a CPU")  # fmt: skip
    lines += [
        f"KV cache:     {_size(p.kv_cache_bytes)} = {p.num_blocks} blocks = {p.num_tokens} tokens",
        f"Concurrency:  {p.max_concurrency:.1f} requests of max_model_len={p.max_model_len} "
        "at once",
        "Fits:         " + ("yes" if p.fits else "NO: " + " ".join(p.problem.split())),
    ]
    lines += [f"To change:    {a}" if i == 0 else f"              {a}"
              for i, a in enumerate(p.advice)]  # fmt: skip
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    plan = make_plan(args)
    print(json.dumps(plan.to_json(), indent=1) if args.json else format_plan(plan))
    return 0 if plan.fits else 1


def add_plan_args(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", help="what fits in memory, from the model's config alone (no weights loaded)",
        description=__doc__, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    p.add_argument("model", nargs="?", default=None,
                   help="HF directory, .gguf file, config.json or preset name (default: the "
                   "embedded model)")  # fmt: skip
    p.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="plan for a GPU of this many GiB (default: this machine's GPU, if any)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["awq", "gptq", "gguf", "w8a8", "fp8"],
        help="plan a checkpoint of this format (read from the config when it says); fp8 also "
        "a bf16/fp16 or GGUF checkpoint quantized at load",
    )
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (no reserve)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run_plan)
    return p
