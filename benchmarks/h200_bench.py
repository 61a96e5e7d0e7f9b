"""The one-script GPU benchmark of issue 4: device ceilings, Pagoda a/b/c, transformers peer d.

Part 0 records the GPU, driver and versions and measures the device's own ceilings (copy
bandwidth, bf16 matmul rate); then, on the Llama-3-8B shape in bf16 with dummy weights:
(a) offline throughput on 256 random-token requests, (b) single-stream decode against the
weight-bandwidth roofline, (c) time to first token idle and with a cached prefix, plus a profile
of one decode step at high batch, and (d) workloads a and b through Hugging Face transformers'
continuous batching (benchmarks/hf_peer_bench.py). Each group runs in its own child process
with a hard time box (a hung kernel or an OOM loses one group, never the run, and each child
starts with the whole GPU); children write their results after every part. The parent never
touches CUDA: it prints the table last and writes everything to $OUT/h200_bench.json. With
`--kv-cache-dtypes auto,fp8` part a runs once more per further KV-cache dtype, each in its own
child and engine (~35 s each on the H200, taken from the peer's time), with rows of its own.

    python benchmarks/h200_bench.py [--quick] [--only a,b,c,d,p] [--kv-cache-dtypes auto,fp8]
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "benchmarks")]
# Both import no torch: the parent process must leave the GPU to its children.
from pagoda_bench import FULL, QUICK, Workloads  # noqa: E402

from pagoda.bench.throughput import make_requests  # noqa: E402
from pagoda.config import KV_CACHE_DTYPES  # noqa: E402

# Targets of issue 4 (the full run on the Llama-3-8B shape only).
TARGETS = {
    "a_output_tok_s": 12000.0,
    "b_decode_tok_s": 230.0,
    "c_ttft_idle_ms": 25.0,
    "c_ttft_cached_ms": 8.0,
}
PARTS = ("a", "b", "c", "d", "p")
# Hard caps (s) per child; the peer gets what is left of --time-budget.
ENV_CAP_S, PAGODA_CAP_S, PEER_MIN_S = 75.0, 300.0, 60.0
# Each further KV-cache dtype: engine start, warm-up and part a (~35 s on the H200).
EXTRA_KV_CAP_S = 120.0


# -- part 0: environment and device ceilings ------------------------------------------------
def _version(pkg: str) -> str:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return "not installed"


def collect_environment(device: str) -> dict[str, Any]:
    import platform

    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__}
    env.update({p: _version(p) for p in ("triton", "transformers")})
    env["cuda_runtime"] = torch.version.cuda
    # PAGODA_COMMIT names the code of a copy without its own git checkout (an exported tree
    # inside another checkout would otherwise report that checkout's HEAD).
    env["pagoda_commit"] = os.environ.get("PAGODA_COMMIT", "")
    try:
        git = ["git", "rev-parse", "--short", "HEAD"]
        if not env["pagoda_commit"]:
            env["pagoda_commit"] = subprocess.run(
                git, cwd=REPO, capture_output=True
            ).stdout.decode()
    except OSError:
        env["pagoda_commit"] = ""
    env["pagoda_commit"] = env["pagoda_commit"].strip() or "unknown (no git checkout)"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
        env["sm_count"] = props.multi_processor_count
        env["driver"] = _driver_version()
    else:
        env["gpu"] = f"none ({device}: a dry run, not a measurement)"
    return env


def _driver_version() -> str:
    try:
        smi = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        out = subprocess.run(smi, capture_output=True, timeout=20).stdout.decode().split()
        if out:
            return out[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:  # containers without nvidia-smi still see the kernel module's version line
        with open("/proc/driver/nvidia/version") as f:
            return f.readline().strip()
    except OSError:
        return "unknown (no nvidia-smi, no /proc/driver/nvidia/version)"


def _time_op(fn: Any, device: str, repeats: int, warmup: int = 3) -> float:
    """Median seconds of `fn()`: CUDA events on a GPU, perf_counter on the CPU."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_copy_bandwidth(device: str, nbytes: int, repeats: int) -> float:
    """Device-to-device copy, GB/s counting bytes read plus bytes written."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _time_op(lambda: dst.copy_(src), device, repeats)
    return 2 * nbytes / seconds / 1e9


def measure_matmul_tflops(device: str, n: int, repeats: int, dtype: str = "bfloat16") -> float:
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (
        torch.randn(n, n, device=device, dtype=getattr(torch, dtype), generator=gen) for _ in "ab"
    )
    c = torch.empty_like(a)
    seconds = _time_op(lambda: torch.mm(a, b, out=c), device, repeats)
    return 2 * n**3 / seconds / 1e12


def decode_weight_bytes(hf_config: dict[str, Any], dtype: str = "bfloat16") -> int:
    """Weight bytes one decode step must read: every layer and the LM head, but only one row
    of the input embedding per token (so it is left out)."""
    h, inter = int(hf_config["hidden_size"]), int(hf_config["intermediate_size"])
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    head_dim = int(hf_config.get("head_dim") or h // heads)
    attn = h * head_dim * (2 * heads + 2 * kv_heads)  # q, o and k, v projections
    per_layer = attn + 3 * h * inter + 2 * h  # + gate/up/down and two norms
    params = int(hf_config["num_hidden_layers"]) * per_layer + h + int(hf_config["vocab_size"]) * h
    return params * (4 if dtype in ("float32", "float", "fp32") else 2)


# -- children -------------------------------------------------------------------------------
def measure_ceilings(device: str, dtype: str, w: Workloads) -> dict[str, Any]:
    # On a CPU this is a dry run of the code path: keep it tiny.
    nbytes = w.copy_bytes if device == "cuda" else min(w.copy_bytes, 64 << 20)
    n = w.matmul_n if device == "cuda" else min(w.matmul_n, 256)
    return {
        "copy_GBps": round(measure_copy_bandwidth(device, nbytes, w.ceiling_repeats), 1),
        "copy_bytes_per_buffer": nbytes,
        "matmul_bf16_TFLOPs": round(measure_matmul_tflops(device, n, w.ceiling_repeats, dtype), 2),
        "matmul_n": n,
    }


def run_worker(part: str, args: argparse.Namespace, w: Workloads, record: Any) -> None:
    """One group, in a child process; `record(results)` after every part."""
    res: dict[str, Any] = {}

    def attempt(name: str, fn: Any, *fn_args: Any) -> None:
        t0 = time.perf_counter()
        try:
            res[name] = fn(*fn_args)
        except Exception as e:  # noqa: BLE001 - one failure must not lose the other parts
            traceback.print_exc()
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        res[name]["part_s"] = round(time.perf_counter() - t0, 2)
        record(res)

    def box(cap_s: float, reserve_s: float = 0.0) -> float:
        """A perf_counter deadline: `cap_s` from now, within the child's own deadline."""
        left = args.deadline - time.time() - reserve_s
        return time.perf_counter() + max(5.0, min(cap_s, left))

    if part == "env":
        attempt("env", collect_environment, args.device)
        attempt("ceilings", measure_ceilings, args.device, args.dtype, w)
    elif part == "pagoda":
        import pagoda_bench as pb

        t0 = time.perf_counter()
        try:
            llm = pb.make_llm(args, w)
        except Exception as e:  # noqa: BLE001 - say why in the results, not only in the log
            traceback.print_exc()
            res["engine"] = {"error": f"engine start failed: {type(e).__name__}: {e}"}
            record(res)
            return
        res["engine"] = {"start_s": round(time.perf_counter() - t0, 2)}
        res["engine"]["num_blocks"] = getattr(llm.llm_engine, "num_blocks", None)
        try:
            model = llm.llm_engine.executor.model_runner.model
            res["engine"]["param_bytes"] = sum(
                p.numel() * p.element_size() for p in model.parameters()
            )
        except AttributeError:
            pass
        record(res)
        # Short parts first, so that a slow throughput run cannot starve them.
        if "b" in args.only:
            # 90 s: its warm-up run may be where the prefill kernels compile.
            attempt("b_single_stream", pb.bench_single_stream, llm, w, box(90))
        if "c" in args.only:
            attempt("c_ttft", pb.bench_ttft, llm, w, box(60))
        if "a" in args.only:
            reserve = 45.0 if "p" in args.only else 0.0
            attempt("a_offline_throughput", pb.bench_offline_throughput, llm, w, box(1e9, reserve))
        if "p" in args.only:
            attempt("profile_decode_step", pb.profile_decode_step, llm, w, box(60))
    elif part == "peer":
        from hf_peer_bench import run_peer

        with open(os.path.join(args.model, "config.json")) as f:
            vocab = int(json.load(f)["vocab_size"])
        reqs = make_requests(w.num_requests, w.input_len, w.output_len, vocab, 0)
        stream = (w.stream_prompt_len, w.stream_output_len, w.stream_repeats)
        res["peer"] = {}

        def record_peer(peer: dict[str, Any]) -> None:
            res["peer"].update(peer)
            record(res)

        try:
            limit = args.deadline - time.time() - 15  # the manager's shutdown needs a moment
            run_peer(args.model, args.device, args.dtype, reqs, stream, limit, record_peer)
        except Exception as e:  # noqa: BLE001 - e.g. a transformers API this code does not know
            traceback.print_exc()
            record_peer({"error": f"{type(e).__name__}: {e}"})


def spawn(
    part: str, argv: list[str], timeout_s: float, tmp_dir: str, worker: str | None = None
) -> dict[str, Any]:
    """Run one group (`worker`, default `part`) in a child process with a hard time box; what
    it recorded survives."""
    path = os.path.join(tmp_dir, f"{part}.json")
    deadline = time.time() + timeout_s - 10  # the child's own deadline; the kill comes later
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", worker or part]
    cmd += ["--result-file", path, "--deadline", str(deadline)]
    print(f"\n=== {part}: child process, time box {timeout_s:.0f} s ===", flush=True)
    t0 = time.perf_counter()
    # Its own process group, so the kill also reaches compiler workers it may have started.
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        exit_status: int | str = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        exit_status = f"killed after {timeout_s:.0f} s (time box)"
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    res: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
    res["child"] = {"exit": exit_status, "wall_s": round(time.perf_counter() - t0, 1)}
    return res


# -- summary --------------------------------------------------------------------------------
def summarize(
    r: dict[str, Any], hf_config: dict[str, Any], args: argparse.Namespace
) -> list[list[str]]:
    """Rows (metric, value, target, met?) of the final table from the merged child results."""

    def get(*keys: str) -> Any:
        node: Any = r
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        return node

    bw = get("ceilings", "copy_GBps")
    weight_bytes = decode_weight_bytes(hf_config, args.dtype)
    loaded = get("engine", "param_bytes")
    if getattr(args, "quantization", None) and loaded:
        # Quantized layers: the loaded parameters, less the input embedding (one row a token).
        weight_bytes = loaded - int(hf_config["vocab_size"]) * int(hf_config["hidden_size"]) * 2
    roofline = bw * 1e9 / weight_bytes if bw else None
    a, b = "a_offline_throughput", "b_single_stream"
    pa, pb = get(a, "output_tokens_per_s"), get(b, "decode_tokens_per_s")
    ha = get("peer", "offline_throughput", "output_tokens_per_s")
    hb = get("peer", "single_stream", "decode_tokens_per_s")
    expected_hits = get("c_ttft", "expected_num_cached_tokens")
    extra_kv_rows = []  # part a again for each further KV-cache dtype
    for dt in (getattr(args, "kv_cache_dtypes", None) or [])[1:]:
        ax = extra_key(a, dt)
        extra_kv_rows += [
            (f"a Pagoda output tok/s ({dt} KV)", get(ax, "output_tokens_per_s"))
            + (TARGETS["a_output_tok_s"], "ge"),
            (f"a Pagoda total tok/s ({dt} KV)", get(ax, "total_tokens_per_s"), None, ""),
            (f"a Pagoda elapsed s ({dt} KV)", get(ax, "elapsed_s"), None, ""),
        ]
    rows = [  # (label, value, target, "ge" | "le" | "")
        ("copy bandwidth GB/s (read+write)", bw, None, ""),
        ("bf16 matmul TFLOP/s", get("ceilings", "matmul_bf16_TFLOPs"), None, ""),
        ("a Pagoda output tok/s", pa, TARGETS["a_output_tok_s"], "ge"),
        ("a Pagoda total tok/s", get(a, "total_tokens_per_s"), None, ""),
        ("a Pagoda elapsed s", get(a, "elapsed_s"), None, ""),
        ("a engine time outside execute_model s", get(a, "engine_outside_execute_s"), None, ""),
        ("a host busy s (async scheduling overlaps it)", get(a, "host_busy_s"), None, ""),
        ("a host waiting for the GPU s", get(a, "host_waiting_for_gpu_s"), None, ""),
        *extra_kv_rows,
        ("b Pagoda decode tok/s (TTFT excluded)", pb, TARGETS["b_decode_tok_s"], "ge"),
        ("b Pagoda overall tok/s", get(b, "overall_tokens_per_s"), None, ""),
        ("b roofline tok/s (weight bytes / copy bw)", roofline, None, ""),
        ("c TTFT idle ms", get("c_ttft", "idle_ms"), TARGETS["c_ttft_idle_ms"], "le"),
        ("c TTFT prefix cached ms", get("c_ttft", "cached_ms"), TARGETS["c_ttft_cached_ms"], "le"),
        (
            "c cached tokens (min of runs)",
            get("c_ttft", "min_num_cached_tokens"),
            expected_hits,
            "ge",
        ),
        ("d HF output tok/s (workload a)", ha, None, ""),
        ("d HF decode tok/s (workload b)", hb, None, ""),
        ("Pagoda / HF, workload a", pa / ha if pa and ha else None, None, ""),
        ("Pagoda / HF, workload b", pb / hb if pb and hb else None, None, ""),
    ]
    table = []
    for label, value, goal, sense in rows:
        text = "-" if value is None else f"{value:,.2f}" if isinstance(value, float) else str(value)
        met = ""
        if goal is not None and value is not None:
            ok = value >= goal if sense == "ge" else value <= goal
            # The targets are for the full workloads; the cache-hit count always counts.
            met = (
                "n/a (quick)" if args.quick and goal in TARGETS.values() else "yes" if ok else "NO"
            )
        target = "" if goal is None else f"{'>=' if sense == 'ge' else '<='} {goal:,.0f}"
        table.append([label, text, target, met])
    return table


def extra_key(name: str, kv_cache_dtype: str) -> str:
    """Where a further KV-cache dtype's result `name` goes in the merged results."""
    return f"{name}_kv_{kv_cache_dtype}"


def find_errors(node: Any, path: str = "") -> list[tuple[str, str]]:
    """Every recorded error and abnormal child exit, with where it happened."""
    if not isinstance(node, dict):
        return []
    found = [(path, str(node["error"]))] if "error" in node else []
    if path.endswith("child") and node.get("exit") != 0:
        found.append((path, f"child exit: {node.get('exit')}"))
    for key, value in node.items():
        found += find_errors(value, f"{path}.{key}" if path else key)
    return found


def print_table(table: list[list[str]], title: str) -> None:
    rows = [["metric", "value", "target", "met?"], *table]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    print(f"\n=== {title} ===")
    for row in rows:
        print("  ".join(c.ljust(n) for c, n in zip(row, widths)).rstrip())


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny workloads: a smoke test")
    ap.add_argument("--only", default=",".join(PARTS), help="subset of a,b,c,d,p (p: profile)")
    ap.add_argument("--out", default=".", help="directory for h200_bench.json (env OUT wins)")
    ap.add_argument("--model", default=os.path.join(REPO, "benchmarks", "presets", "llama-3-8b"))
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="of the Pagoda engine (default: on for CUDA)",
    )
    ap.add_argument(
        "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="of the Pagoda engine"
    )
    ap.add_argument(
        "--kv-cache-dtypes",
        default=None,
        help="comma list, e.g. auto,fp8 (overrides --kv-cache-dtype): the first runs every "
        "part, each further one part a again in an engine of its own",
    )
    ap.add_argument(
        "--quantization",
        default=None,
        choices=["awq", "gptq", "w8a8", "fp8"],
        help="of the Pagoda engine: dummy weights in that format (awq/gptq: 4-bit, group 128)",
    )
    ap.add_argument("--time-budget", type=float, default=540.0, help="seconds for the whole run")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.only = {p.strip() for p in args.only.split(",") if p.strip()}
    if not args.only <= set(PARTS):
        ap.error(f"--only takes a subset of {','.join(PARTS)}, got {','.join(sorted(args.only))}")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        ap.error(f"--model {args.model}: no config.json there (give a benchmarks/presets/ dir)")
    if args.kv_cache_dtypes is None:
        args.kv_cache_dtypes = [args.kv_cache_dtype]
    else:
        dtypes = [d.strip() for d in args.kv_cache_dtypes.split(",") if d.strip()]
        bad = [d for d in dtypes if d not in KV_CACHE_DTYPES]
        if not dtypes or bad or len(set(dtypes)) != len(dtypes):
            ap.error(
                f"--kv-cache-dtypes takes distinct values of {','.join(KV_CACHE_DTYPES)}, "
                f"got {args.kv_cache_dtypes!r}"
            )
        args.kv_cache_dtypes = dtypes
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    w = QUICK if args.quick else FULL
    if args.worker:

        def record(res: dict[str, Any]) -> None:  # atomic: a kill never leaves half a file
            with open(args.result_file + ".tmp", "w") as f:
                json.dump(res, f, indent=2, default=str)
            os.replace(args.result_file + ".tmp", args.result_file)

        run_worker(args.worker, args, w, record)
        return 0
    with open(os.path.join(args.model, "config.json")) as f:
        hf_config = json.load(f)
    start = time.time()
    settings = {**vars(args), "only": sorted(args.only)}
    results: dict[str, Any] = {"settings": settings, "workloads": asdict(w)}
    with tempfile.TemporaryDirectory() as tmp:
        results["env"] = spawn("env", argv, ENV_CAP_S, tmp)
        dtypes = args.kv_cache_dtypes
        peer_min = PEER_MIN_S if "d" in args.only else 0.0
        if args.only & {"a", "b", "c", "p"}:
            left = args.time_budget - (time.time() - start)
            extra = EXTRA_KV_CAP_S * (len(dtypes) - 1) if "a" in args.only else 0.0
            cap = min(PAGODA_CAP_S, left - peer_min - extra)
            main_argv = [*argv, "--kv-cache-dtype", dtypes[0]]  # the last one given wins
            results["pagoda"] = spawn("pagoda", main_argv, max(cap, 60.0), tmp)
        for dt in dtypes[1:] if "a" in args.only else []:
            left = args.time_budget - (time.time() - start)
            cap = max(min(EXTRA_KV_CAP_S, left - peer_min), 60.0)
            extra_argv = [*argv, "--kv-cache-dtype", dt, "--only", "a"]
            results[f"pagoda_kv_{dt}"] = spawn(f"pagoda_kv_{dt}", extra_argv, cap, tmp, "pagoda")
        if "d" in args.only:
            left = args.time_budget - (time.time() - start)
            results["peer"] = spawn("peer", argv, max(left, PEER_MIN_S), tmp)
    merged = {k: v for part in ("env", "pagoda", "peer") for k, v in results.get(part, {}).items()}
    for dt in args.kv_cache_dtypes[1:]:
        for name, value in results.get(f"pagoda_kv_{dt}", {}).items():
            merged[extra_key(name, dt)] = value
    results["roofline_decode_weight_bytes"] = decode_weight_bytes(hf_config, args.dtype)
    results["table"] = summarize(merged, hf_config, args)
    results["total_s"] = round(time.time() - start, 1)
    out_dir = os.environ.get("OUT") or args.out
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "h200_bench.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2, default=str)
    top_ops = (merged.get("profile_decode_step") or {}).get("top_ops")
    if top_ops:
        print("\n=== one all-decode step under torch.profiler (3 steps) ===\n" + top_ops)
    for name, err in find_errors(results):
        print(f"ERROR in {name}: {err}")
    print(f"\nwrote {path} (total {results['total_s']} s)")
    gpu = (merged.get("env") or {}).get("gpu", "?")
    model = os.path.basename(os.path.normpath(args.model))
    kv = "" if args.kv_cache_dtypes == ["auto"] else f" | KV cache {','.join(args.kv_cache_dtypes)}"
    if getattr(args, "quantization", None):
        kv += f" | {args.quantization} weights"
    print_table(
        results["table"], f"{gpu} | {model} {args.dtype}{kv}" + (" | QUICK" if args.quick else "")
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
