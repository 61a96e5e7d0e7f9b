"""The quantize-then-serve path as a new user runs it: `pagoda quantize` writes a directory that
loads on its own (`LLM(model=DIR)`, no --tokenizer): the source's tokenizer (a GGUF file's
written as tokenizer.json + tokenizer_config.json with its chat template, giving the same ids),
its generation config; and the quantized embedded model generates close to the source."""

from __future__ import annotations

import json

import pytest

from pagoda.config import embedded_model_path
from pagoda.model.quantization.checkpoint import TOKENIZER_FILES, write_source_files
from pagoda.tokenizer import get_tokenizer

TEXTS = [
    "The capital of France is",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "  two  spaces, a\ttab and\n\nnewlines",
    "Unicode: naïve café 日本語 🎉",
    "def f(x):\n    return x ** 2  # <|endoftext|>",
]
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def test_a_gguf_tokenizer_written_as_hf_files_gives_the_same_ids(tmp_path) -> None:
    source = embedded_model_path()
    write_source_files(source, str(tmp_path), {"max_position_embeddings": 8192})
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / name).is_file(), name
    original, written = get_tokenizer(source), get_tokenizer(str(tmp_path))
    for text in TEXTS:
        assert written.encode(text) == original.encode(text), text
        ids = original.encode(text)
        assert written.decode(ids, skip_special_tokens=False) == original.decode(
            ids, skip_special_tokens=False
        )
    assert written.apply_chat_template(MESSAGES, tokenize=True) == original.apply_chat_template(
        MESSAGES, tokenize=True
    )
    assert (written.bos_token_id, written.eos_token_id) == (
        original.bos_token_id,
        original.eos_token_id,
    )
    assert written.all_special_ids == original.all_special_ids
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["chat_template"] == original.chat_template and config["eos_token"] == "<|im_end|>"
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == original.eos_token_id


def test_the_written_tokenizer_reads_the_same_in_transformers(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    source = embedded_model_path()
    write_source_files(source, str(tmp_path), {"max_position_embeddings": 8192})
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    original = get_tokenizer(source)
    for text in TEXTS:
        assert hf.encode(text) == original.encode(text), text
    ids = hf.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    assert ids == original.apply_chat_template(MESSAGES, tokenize=True)


def test_a_hf_source_directory_has_its_tokenizer_files_copied(tmp_path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    for name in TOKENIZER_FILES[:5]:
        (src / name).write_text(json.dumps({"file": name}))
    write_source_files(str(src), str(out), {})
    for name in TOKENIZER_FILES[:5]:
        assert (out / name).read_text() == (src / name).read_text()
    assert not (out / "merges.txt").exists()


@pytest.mark.slow
def test_awq_quantized_embedded_model_serves_without_a_tokenizer_argument(tmp_path, capsys) -> None:
    from pagoda import LLM, SamplingParams
    from pagoda.cli import main

    out = tmp_path / "awq"
    argv = ["quantize", "--method", "awq", "--num-samples", "4", "--seq-len", "128"]
    assert main([*argv, "--output", str(out)]) == 0
    assert "AWQ 4-bit, group 128: 120 linear layers" in capsys.readouterr().out
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "The three primary colors are",
        "Water boils at a temperature of",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    quant = LLM(model=str(out), max_model_len=256)  # no tokenizer=: the directory has one
    chat = quant.chat([MESSAGES], SamplingParams(temperature=0.0, max_tokens=8))
    assert "4" in chat[0].outputs[0].text
    got = [o.outputs[0].token_ids for o in quant.generate(prompts, params)]
    del quant
    source = LLM(model=embedded_model_path(), max_model_len=256)
    want = [o.outputs[0].token_ids for o in source.generate(prompts, params)]
    # 4-bit weights: greedy paths may part after near-ties, but mostly agree.
    same_first = sum(g[:4] == w[:4] for g, w in zip(got, want))
    agree = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    assert same_first >= 3 and agree >= 0.5 * sum(len(w) for w in want), (got, want)
