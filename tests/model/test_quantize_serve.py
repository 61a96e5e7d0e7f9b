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
    chat = {"add_generation_prompt": True, "tokenize": True}
    assert written.apply_chat_template(MESSAGES, **chat) == original.apply_chat_template(
        MESSAGES, **chat
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
    assert ids == original.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True)


def test_a_hf_source_directory_has_its_tokenizer_files_copied(tmp_path) -> None:
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    for name in TOKENIZER_FILES[:5]:
        (src / name).write_text(json.dumps({"file": name}))
    write_source_files(str(src), str(out), {})
    for name in TOKENIZER_FILES[:5]:
        assert (out / name).read_text() == (src / name).read_text()
    assert not (out / "merges.txt").exists()


def _perplexity_and_greedy(llm, text: str, prompts: list[str]):
    import math

    from pagoda import SamplingParams

    ids = llm.get_tokenizer().encode(text)[:512]
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    out = llm.generate([{"prompt_token_ids": ids}], scored, use_tqdm=False)[0]
    nll = -sum(e[t].logprob for t, e in zip(ids[1:], out.prompt_logprobs[1:])) / (len(ids) - 1)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    return math.exp(nll), [o.outputs[0] for o in outs]


@pytest.mark.slow
def test_awq_quantized_embedded_model_serves_without_a_tokenizer_argument(tmp_path, capsys) -> None:
    import pathlib

    from pagoda import LLM, SamplingParams
    from pagoda.cli import main

    out = tmp_path / "awq"
    argv = ["quantize", "--method", "awq", "--num-samples", "4", "--seq-len", "128"]
    assert main([*argv, "--output", str(out)]) == 0
    assert "AWQ 4-bit, group 128: 120 linear layers" in capsys.readouterr().out
    # Held-out text: this repository's README (the calibration is the built-in text).
    text = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "The three primary colors are",
        "Water boils at a temperature of",
    ]
    chat_params = SamplingParams(temperature=0.0, max_tokens=8)
    quant = LLM(model=str(out), max_model_len=1024)  # no tokenizer=: the directory has one
    chat = quant.chat([MESSAGES], chat_params, use_tqdm=False)[0]
    quant_ppl, got = _perplexity_and_greedy(quant, text, prompts)
    del quant
    source = LLM(model=embedded_model_path(), max_model_len=1024)
    assert chat.prompt_token_ids == source.chat([MESSAGES], chat_params)[0].prompt_token_ids
    source_ppl, want = _perplexity_and_greedy(source, text, prompts)
    # 4-bit weights of a 135M model: perplexity ~1.2x the source's (8 x 256 calibration
    # tokens: 59.8 vs 50.3 on benchmarks/README.md); greedy paths part after a few tokens.
    assert quant_ppl < 1.35 * source_ppl, (quant_ppl, source_ppl)
    assert "Paris" in got[0].text, got[0].text
    same_first = sum(g.token_ids[0] == w.token_ids[0] for g, w in zip(got, want))
    assert same_first >= 2, ([g.text for g in got], [w.text for w in want])
