"""`pagoda plan` against what the engine plans at start-up: on this CPU for the embedded model
(the engine started here), and on GPUs through the plans the engine logged on an H200
(benchmarks/results/h200/plan, written by benchmarks/plan_gpu_check.py): Llama-3-8B on 141 and
80 GiB, FP8 KV, an AWQ 4-bit checkpoint, a bigger batch, eager mode, two other shapes."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.cli import build_parser, main
from pagoda.utils.cpu_build import compiler_available

ROOT = Path(__file__).resolve().parents[1]
GPU_PLANS = json.loads((ROOT / "benchmarks/results/h200/plan/engine_memory_plans.json").read_text())
GiB = 2**30


def _plan(*argv: str):
    from pagoda.plan import make_plan

    return make_plan(build_parser(only="plan").parse_args(["plan", *argv]))


def _flags(record: dict) -> list[str]:
    model = Path(record["model"]).parent.name  # the preset's directory
    preset = model.removeprefix("awq-")
    flags = [preset] if record["model"].endswith(".json") else [record["model"].split("awq-")[-1]]
    if "awq" in record["model"]:
        flags += ["--quantization", "awq"]
    gib = record["gpu_gib"] or record["total_bytes"] / GiB
    flags += ["--gpu-memory-gib", str(gib)]
    for k, v in record["engine_args"].items():
        flag = "--" + k.replace("_", "-")
        flags += [flag] if v is True else [flag, str(v)]
    return flags


@pytest.mark.parametrize("record", GPU_PLANS, ids=[r["name"] for r in GPU_PLANS])
def test_plan_agrees_with_the_engines_gpu_start_up_within_2_percent(record):
    plan = _plan(*_flags(record))
    assert plan.device == "cuda" and plan.fits
    assert plan.num_blocks == pytest.approx(record["num_blocks"], rel=0.02)
    assert plan.weights_bytes == pytest.approx(record["weights_bytes"], rel=0.02)
    assert plan.kv_bytes_per_token * plan.block_size == record["bytes_per_block"]
    blocks_per_req = -(-record["max_model_len"] // 16)
    assert plan.max_concurrency == pytest.approx((record["num_blocks"] - 1) / blocks_per_req,
                                                 rel=0.02)  # fmt: skip
    reserve = plan.activation_bytes + plan.cuda_graph_bytes + plan.non_torch_bytes
    measured = (record["activation_bytes"] + record["cuda_graph_bytes"]
                + record["non_torch_bytes"])  # fmt: skip
    assert abs(reserve - measured) < 0.25 * GiB


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_plan_agrees_with_the_engine_on_this_cpu():
    from pagoda.engine.arg_utils import EngineArgs
    from pagoda.engine.llm_engine import LLMEngine

    plan = _plan("--device", "cpu", "--max-model-len", "2048")
    log, handler = logging.getLogger("pagoda.engine.core"), _Lines()
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)  # whatever level an earlier test's command line set for pagoda
    try:
        engine = LLMEngine(
            EngineArgs(device="cpu", max_model_len=2048, max_num_seqs=4).create_engine_config(),
            log_stats=False,
        )
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    line = next(m for m in handler.lines if "KV cache (" in m)  # the engine's start-up line
    cache_dtype, blocks, tokens = re.search(
        r"KV cache \((\w+)\): (\d+) blocks of \d+ tokens = (\d+) tokens", line
    ).groups()
    blocks, tokens = int(blocks), int(tokens)
    assert cache_dtype == plan.kv_cache_dtype
    assert blocks == engine.num_blocks
    assert plan.num_blocks == pytest.approx(blocks, rel=0.02)
    assert plan.num_tokens == pytest.approx(tokens, rel=0.02)
    assert plan.kv_bytes_per_token * 16 == engine.executor.bytes_per_block()
    assert plan.max_concurrency == pytest.approx(tokens / 2048, rel=0.02)
    assert plan.weights_note == "GGUF blocks kept quantized" or plan.dtype != "float32"


def test_a_plan_that_does_not_fit_says_what_to_change(capsys):
    assert main(["plan", "llama-3-8b", "--gpu-memory-gib", "16"]) == 1
    out = capsys.readouterr().out
    assert "Fits:         NO" in out and "--tensor-parallel-size 2" in out and "4-bit" in out
    plan = _plan("llama-3-8b", "--gpu-memory-gib", "17.5")
    assert not plan.fits and any("--enforce-eager" in a for a in plan.advice)
    plan = _plan("llama-3-8b", "--gpu-memory-gib", "19")
    assert not plan.fits and any(a.startswith("--max-model-len") for a in plan.advice)
    plan = _plan("llama-3-8b", "--gpu-memory-gib", "24", "--max-model-len", "8192")
    assert plan.fits and any("fp8" in a for a in plan.advice)


def test_a_kv_cache_larger_than_the_memory_does_not_fit(capsys):
    import os

    # The engine stops at start: the kernel refuses to map one layer's 310 GiB tensor.
    plan = _plan("--device", "cpu", "--kv-cache-memory-bytes", str(10**13))
    assert not plan.fits and "cannot be allocated" in plan.problem
    assert plan.advice[0].startswith("--kv-cache-memory-bytes below")
    # Each layer's tensor maps, but the whole cache cannot become resident as it fills.
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    plan = _plan("--device", "cpu", "--kv-cache-memory-bytes", str(2 * ram))
    assert not plan.fits and "runs out of memory as the cache fills" in plan.problem
    assert _plan("--device", "cpu", "--kv-cache-memory-bytes", str(ram // 8)).fits
    # On a GPU --kv-cache-memory-bytes replaces gpu_memory_utilization's share, up to what
    # the weights and the reserve leave of the whole GPU.
    assert main(["plan", "llama-3-8b", "--gpu-memory-gib", "80", "--kv-cache-memory-bytes",
                 str(10**12)]) == 1  # fmt: skip
    out = capsys.readouterr().out
    assert "NO: kv_cache_memory_bytes (--kv-cache-memory-bytes) asks for a 931.32 GiB" in out
    fit = int(re.search(r"--kv-cache-memory-bytes (\d+) or less", out).group(1))
    assert 60 * GiB < fit < 70 * GiB
    assert _plan("llama-3-8b", "--gpu-memory-gib", "80", "--kv-cache-memory-bytes", str(fit)).fits


def test_plan_errors_are_one_line(capsys):
    assert main(["plan", "/no/such/model"]) == 2
    assert capsys.readouterr().err.startswith("error: model '/no/such/model' is neither")
    assert main(["plan", "llama-3-8b", "--gpu-memory-gib", "-1"]) == 2
    assert "--gpu-memory-gib must be a positive number" in capsys.readouterr().err
    for value in ("inf", "nan"):  # inf overflowed int() with a traceback
        assert main(["plan", "llama-3-8b", "--gpu-memory-gib", value]) == 2
        assert capsys.readouterr().err == (
            f"error: --gpu-memory-gib must be a positive number of GiB, got {value}\n"
        )
    assert main(["plan", "llama-3-8b", "-tp", "3", "--gpu-memory-gib", "80"]) == 2
    assert "does not divide" in capsys.readouterr().err
    # The engine refuses an AWQ run of the GGUF checkpoint; plan planned the GGUF and said yes.
    assert main(["plan", "--quantization", "awq"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --quantization awq but ") and "is a 'gguf' checkpoint" in err
    assert _plan("--quantization", "gguf").quantization == "gguf"


def _int8_group(**changes) -> dict:
    args = {"num_bits": 8, "type": "int", "symmetric": True}
    return {"targets": ["Linear"], "weights": {**args, "strategy": "channel"},
            "input_activations": {**args, "strategy": "token", "dynamic": True}, **changes}  # fmt: skip


def _ct(group: dict) -> dict:
    return {"quant_method": "compressed-tensors", "format": "int-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"]}  # fmt: skip


def _quantized_config(directory: Path, qc: dict, weights: bool = False) -> Path:
    """llama-3.2-1b's config.json with `qc` as its quantization_config, in `directory`; with
    `weights` an empty safetensors file beside it (a checkpoint, not a shape to plan)."""
    config = json.loads((ROOT / "benchmarks/presets/llama-3.2-1b/config.json").read_text())
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    if weights:
        (directory / "model.safetensors").write_bytes(b"")
    return directory


def _awq(**changes) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
            "version": "gemm", **changes}  # fmt: skip


def _gptq(**changes) -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
            "sym": True, "checkpoint_format": "gptq", **changes}  # fmt: skip


# Configs the loader reads (an AWQ one whose modules_to_not_convert names only lm_head, dense in
# every checkpoint), and the `pagoda.quant_config` function that reads each in `pagoda plan`.
READABLE = {
    "W8A8": (_ct(_int8_group()), "parse_compressed_tensors", "int8 W8A8"),
    "AWQ": (_awq(modules_to_not_convert=["lm_head"]), "parse_awq_config", "awq"),
    "GPTQ": (_gptq(bits=8, desc_act=True), "parse_gptq_config", "gptq"),
}


@pytest.mark.parametrize("flags", [["llama-3-8b", "--gpu-memory-gib", "80"],
                                   ["llama-3-8b", "--device", "cpu", "-q", "awq"],
                                   *[[name, "--device", "cpu", "--max-model-len", "4096"]
                                     for name in READABLE]])  # fmt: skip
def test_plan_reads_the_config_without_torch(flags, tmp_path):
    """`pagoda plan` imports no torch, reading a compressed-tensors, AWQ or GPTQ config with
    `pagoda.quant_config`'s parsers included (each one's call recorded)."""
    qc, parser, note = READABLE.get(flags[0], (None, "checkpoint_quant_method", ""))
    if qc is not None:
        flags = [str(_quantized_config(tmp_path, qc)), *flags[1:]]
    code = ("import sys; import pagoda.quant_config as q; called = set(); "
            f"f = getattr(q, {parser!r}); "
            f"setattr(q, {parser!r}, lambda *a, **k: called.add(1) or f(*a, **k)); "
            "from pagoda.cli import main; "
            f"rc = main(['plan', *{flags!r}, '--json']); "
            f"assert called, '{parser} not called'; "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["num_blocks"] > 0
    assert plan["weights_note"].startswith(note)  # "int8 W8A8 ...", "awq ...", "gptq ..."


MALFORMED = {
    "4-bit weights": _ct(_int8_group(weights={"num_bits": 4, "type": "int"})),
    "weights only": _ct(_int8_group(input_activations=None)),
    "no config_groups": {"quant_method": "compressed-tensors"},
    "block-wise fp8": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}


@pytest.mark.parametrize("case", MALFORMED)
@pytest.mark.parametrize("weights", [False, True], ids=["shape", "checkpoint"])
def test_plan_refuses_a_quantization_config_as_the_loader_does(case, weights, tmp_path, capsys):
    """A quantization_config the loader refuses: plan stops with the loader's message, with or
    without --quantization naming the checkpoint's 8-bit type."""
    from pagoda.model.quantization import get_linear_method

    path = _quantized_config(tmp_path, MALFORMED[case], weights)
    hf_config = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError) as loader:
        get_linear_method(None, hf_config, dummy=not weights)
    assert main(["plan", str(path), "--device", "cpu"]) == 2
    assert capsys.readouterr().err == f"error: {loader.value}\n"
    if MALFORMED[case]["quant_method"] == "compressed-tensors":
        with pytest.raises(ValueError) as loader:
            get_linear_method("w8a8", hf_config, dummy=not weights)
        assert main(["plan", str(path), "--device", "cpu", "-q", "w8a8"]) == 2
        assert capsys.readouterr().err == f"error: {loader.value}\n"


PACKED_MALFORMED = {
    "AWQ 3-bit": _awq(bits=3),
    "AWQ GEMV": _awq(version="gemv"),
    "AWQ without zero points": _awq(zero_point=False),
    "AWQ leaving out gate_proj": _awq(modules_to_not_convert=["gate"]),
    "GPTQ 3-bit": _gptq(bits=3),
    "GPTQ v2 format": _gptq(checkpoint_format="gptq_v2"),
}


@pytest.mark.parametrize("case", PACKED_MALFORMED)
@pytest.mark.parametrize("weights", [False, True], ids=["shape", "checkpoint"])
def test_plan_refuses_an_awq_or_gptq_config_as_the_loader_does(case, weights, tmp_path, capsys):
    """An AWQ / GPTQ quantization_config the loader refuses: plan stops with the loader's
    message, with or without --quantization naming the checkpoint's method."""
    from pagoda.model.quantization import get_linear_method

    qc = PACKED_MALFORMED[case]
    path = _quantized_config(tmp_path, qc, weights)
    hf_config = json.loads((path / "config.json").read_text())
    with pytest.raises(ValueError) as loader:
        get_linear_method(qc["quant_method"], hf_config, dummy=not weights)
    for flags in ([], ["-q", qc["quant_method"]]):
        assert main(["plan", str(path), "--device", "cpu", *flags]) == 2
        assert capsys.readouterr().err == f"error: {loader.value}\n"


def test_plan_refuses_a_quant_method_the_engine_does_not_read(tmp_path, capsys):
    from pagoda.engine.arg_utils import EngineArgs

    path = _quantized_config(tmp_path, {"quant_method": "bitsandbytes"}, weights=True)
    with pytest.raises(ValueError) as engine:
        EngineArgs(model=str(path)).create_engine_config()
    assert "'bitsandbytes' is not supported yet" in str(engine.value)
    assert main(["plan", str(path), "--device", "cpu"]) == 2
    assert capsys.readouterr().err == f"error: {engine.value}\n"
    # A shape planned with --quantization plans that format instead of its config's.
    assert _plan(str(path / "config.json"), "--device", "cpu", "-q", "awq").quantization == "awq"


_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
# --quantization over a checkpoint config of another method -> whether the loader takes it with
# dummy weights: fp8 / w8a8 over a 4-bit config (quantized at load) and w8a8 over vLLM's FP8.
MISMATCHED = {
    "awq over GPTQ": (_gptq(), "awq", False),
    "gptq over AWQ": (_awq(), "gptq", False),
    "awq over W8A8": (_ct(_int8_group()), "awq", False),
    "fp8 over W8A8": (_ct(_int8_group()), "fp8", False),
    "gptq over FP8": (_FP8, "gptq", False),
    "fp8 over GPTQ": (_gptq(), "fp8", True),
    "w8a8 over AWQ": (_awq(), "w8a8", True),
    "w8a8 over FP8": (_FP8, "w8a8", True),
}


@pytest.mark.parametrize("case", MISMATCHED)
def test_plan_of_a_config_without_weights_refuses_another_method_as_the_loader(
    case, tmp_path, capsys
):
    """A checkpoint directory with its config.json but no weights, planned with --quantization
    of another method: plan stops with the loader's message where the loader (with dummy
    weights, as plan loads none) refuses it, and plans that method where the loader takes it.
    `pagoda plan -q awq` of a GPTQ config planned AWQ."""
    from pagoda.model.quantization import get_linear_method

    qc, quant, taken = MISMATCHED[case]
    path = _quantized_config(tmp_path, qc)
    hf_config = json.loads((path / "config.json").read_text())
    if taken:
        assert get_linear_method(quant, hf_config, dummy=True) is not None
        assert _plan(str(path), "--device", "cpu", "-q", quant).quantization == quant
    else:
        with pytest.raises(ValueError) as loader:
            get_linear_method(quant, hf_config, dummy=True)
        assert main(["plan", str(path), "--device", "cpu", "-q", quant]) == 2
        assert capsys.readouterr().err == f"error: {loader.value}\n"
    # With its weights the engine refuses every mismatch at start (`checkpoint_accepts`).
    path = _quantized_config(tmp_path / "weights", qc, weights=True)
    assert main(["plan", str(path), "--device", "cpu", "-q", quant]) == 2
    assert capsys.readouterr().err.startswith(f"error: --quantization {quant} but ")


@pytest.mark.skipif(not compiler_available(), reason="no C compiler: the layers are dequantized")
def test_a_4bit_checkpoint_on_a_cpu_plans_its_gguf_blocks():
    """AWQ / GPTQ layers on a CPU become GGUF blocks at load (`cpu_blocks`; the loader's bytes:
    tests/model/test_plan_cpu_quantized.py): 20 bytes (Q4_1) or 18 (GPTQ's symmetric Q4_0)
    per 32 weights, not the dequantized bf16 weights' 64."""
    dense = _plan("llama-3-8b", "--device", "cpu", "--dtype", "bfloat16")
    awq = _plan("llama-3-8b", "--device", "cpu", "--dtype", "bfloat16", "-q", "awq")
    gptq = _plan("llama-3-8b", "--device", "cpu", "--dtype", "bfloat16", "-q", "gptq")
    assert awq.weights_note == "awq 4-bit layers as Q4_1 GGUF blocks"
    assert gptq.weights_note == "gptq 4-bit layers as Q4_0 GGUF blocks"
    embeddings = 2 * 128256 * 4096 * 2  # untied, bf16
    norms = (2 * 32 + 1) * 4096 * 2  # two a layer and the final one, bf16
    linear = (dense.weights_bytes - embeddings - norms) // 2
    assert awq.weights_bytes == embeddings + norms + linear * 20 // 32
    assert gptq.weights_bytes == embeddings + norms + linear * 18 // 32
